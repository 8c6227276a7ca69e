//! Connections per peer address: at most so many from one IP address at once, counted from
//! accept (before any TLS handshake or hello), so that one host cannot take every slot of the
//! node, whether it speaks or not.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};

/// The connections open per peer address, and the most one address may hold.
#[derive(Debug)]
pub(super) struct PerAddress {
    limit: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in its address's count, given back when dropped.
#[derive(Debug)]
pub(super) struct AddressSlot {
    counts: Arc<PerAddress>,
    ip: IpAddr,
}

impl PerAddress {
    /// At most `limit` connections per address.
    pub(super) fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            open: Mutex::new(HashMap::new()),
        })
    }

    fn open(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most one address may hold.
    pub(super) fn limit(&self) -> usize {
        self.limit
    }

    /// A slot for a connection from `ip`, or `None` when that address holds the limit already.
    pub(super) fn enter(self: &Arc<Self>, ip: IpAddr) -> Option<AddressSlot> {
        let mut open = self.open();
        let count = open.entry(ip).or_insert(0);
        if *count >= self.limit {
            return None;
        }
        *count += 1;
        Some(AddressSlot {
            counts: self.clone(),
            ip,
        })
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut open = self.counts.open();
        // An address with no connection left is forgotten: the map holds only live ones.
        if let Some(count) = open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_holds_at_most_the_limit_and_slots_come_back() {
        let counts = PerAddress::new(2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = counts.enter(a).unwrap();
        let _second = counts.enter(a).unwrap();
        assert!(counts.enter(a).is_none(), "a third from one address");
        let _other = counts.enter(b).expect("another address is counted apart");
        drop(first);
        let again = counts.enter(a).expect("a slot came back");
        drop(again);
        drop(_second);
        assert!(
            !counts.open().contains_key(&a),
            "an address with none open is forgotten"
        );
    }
}
