//! Connections per peer address: at most so many from one IP address at once (an IPv6 host by
//! its /64, which it is usually given whole), counted from accept (before any TLS handshake or
//! hello), so that one host cannot take every slot of the node, whether it speaks or not.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

/// The address a connection from `ip` is counted under: an IPv4 address as it is (also when it
/// arrives mapped into IPv6), an IPv6 address by its /64 prefix.
pub(super) fn counted_as(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(Ipv6Addr::from(prefix))
        }
    }
}

/// The connections open per peer address, and the most one address may hold.
#[derive(Debug)]
pub(super) struct PerAddress {
    limit: NonZeroUsize,
    open: Mutex<HashMap<IpAddr, usize>>,
    /// Signalled whenever a slot is given back.
    freed: Notify,
}

/// One connection's place in its address's count, given back when dropped.
#[derive(Debug)]
pub(super) struct AddressSlot {
    counts: Arc<PerAddress>,
    ip: IpAddr,
}

impl PerAddress {
    /// At most `limit` connections per address.
    pub(super) fn new(limit: NonZeroUsize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            open: Mutex::new(HashMap::new()),
            freed: Notify::new(),
        })
    }

    fn open(&self) -> MutexGuard<'_, HashMap<IpAddr, usize>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most one address may hold.
    pub(super) fn limit(&self) -> NonZeroUsize {
        self.limit
    }

    /// A slot for a connection from `ip`, or `None` when that address holds the limit already.
    pub(super) fn enter(self: &Arc<Self>, ip: IpAddr) -> Option<AddressSlot> {
        let ip = counted_as(ip);
        let mut open = self.open();
        let count = open.entry(ip).or_insert(0);
        if *count >= self.limit.get() {
            return None;
        }
        *count += 1;
        Some(AddressSlot {
            counts: self.clone(),
            ip,
        })
    }
}

impl PerAddress {
    /// A slot for a connection from `ip` once one is given back (by a connection closed to make
    /// room), within `within`; `None` if another newcomer takes each first.
    pub(super) async fn enter_within(
        self: &Arc<Self>,
        ip: IpAddr,
        within: Duration,
    ) -> Option<AddressSlot> {
        let waiting = async {
            loop {
                // Registered before the check, so that a slot freed between them still wakes it.
                let freed = self.freed.notified();
                if let Some(slot) = self.enter(ip) {
                    return slot;
                }
                freed.await;
            }
        };
        tokio::time::timeout(within, waiting).await.ok()
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
        drop(open);
        self.counts.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_holds_at_most_the_limit_and_slots_come_back() {
        let counts = PerAddress::new(NonZeroUsize::new(2).unwrap());
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

    #[test]
    fn an_ipv6_host_is_counted_by_its_64_and_mapped_ipv4_as_ipv4() {
        let counts = PerAddress::new(NonZeroUsize::new(1).unwrap());
        let _one = counts.enter("2001:db8:1:2::1".parse().unwrap()).unwrap();
        assert!(
            counts
                .enter("2001:db8:1:2:ffff::9".parse().unwrap())
                .is_none(),
            "another address of the same /64"
        );
        assert!(
            counts.enter("2001:db8:1:3::1".parse().unwrap()).is_some(),
            "another /64"
        );
        let _v4 = counts.enter("192.0.2.7".parse().unwrap()).unwrap();
        assert!(
            counts.enter("::ffff:192.0.2.7".parse().unwrap()).is_none(),
            "the same IPv4 host, mapped"
        );
    }
}
