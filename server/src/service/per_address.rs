//! Connections per peer address: at most so many from one IP address at once (an IPv6 host by
//! its /64, which it is usually given whole; every loopback address as one, this host), counted
//! from accept (before any TLS handshake or hello), so that one host cannot take every slot of
//! the node, whether it speaks or not.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::oneshot;

/// The address a connection from `ip` is counted under: an IPv4 address as it is (also when it
/// arrives mapped into IPv6), an IPv6 address by its /64 prefix, and every loopback address
/// (127.0.0.0/8, `::1`, mapped or not) as `127.0.0.1`: they are all this host, and a local
/// client may pick any of the 16 million source addresses of 127.0.0.0/8.
pub(super) fn counted_as(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        loopback if loopback.is_loopback() => IpAddr::V4(Ipv4Addr::LOCALHOST),
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
    counts: Mutex<Counts>,
}

/// Per address: the slots held, and the newcomers waiting for one, first come first served.
#[derive(Debug, Default)]
struct Counts {
    open: HashMap<IpAddr, usize>,
    waiting: HashMap<IpAddr, VecDeque<oneshot::Sender<()>>>,
}

/// One connection's place in its address's count, given back when dropped (to the address's
/// newcomer that has waited longest, if one waits).
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
            counts: Mutex::new(Counts::default()),
        })
    }

    fn counts(&self) -> MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The most one address may hold.
    pub(super) fn limit(&self) -> NonZeroUsize {
        self.limit
    }

    /// A slot for a connection from `ip`, or `None` when that address holds the limit already
    /// (or newcomers of the address wait for the slots it will give back: they come first).
    #[cfg(test)]
    pub(super) fn enter(self: &Arc<Self>, ip: IpAddr) -> Option<AddressSlot> {
        let ip = counted_as(ip);
        let mut counts = self.counts();
        let count = counts.open.entry(ip).or_insert(0);
        if *count >= self.limit.get() {
            return None;
        }
        *count += 1;
        Some(AddressSlot {
            counts: self.clone(),
            ip,
        })
    }

    /// A place in the line of `ip`'s newcomers for the next slot the address gives back, taken
    /// at once (before a connection is told to close to make room, so that the slot it frees
    /// finds this newcomer waiting). A slot free now is taken instead.
    pub(super) fn queue_for(self: &Arc<Self>, ip: IpAddr) -> Result<AddressSlot, SlotWaiter> {
        let ip = counted_as(ip);
        let mut counts = self.counts();
        let count = counts.open.entry(ip).or_insert(0);
        if *count < self.limit.get() {
            *count += 1;
            return Ok(AddressSlot {
                counts: self.clone(),
                ip,
            });
        }
        let (hand, handed) = oneshot::channel();
        counts.waiting.entry(ip).or_default().push_back(hand);
        Err(SlotWaiter {
            counts: self.clone(),
            ip,
            handed,
        })
    }
}

/// A newcomer in its address's line for a slot; leaving the line (dropped, or given up) passes
/// on a slot that was handed over meanwhile.
#[derive(Debug)]
pub(super) struct SlotWaiter {
    counts: Arc<PerAddress>,
    ip: IpAddr,
    handed: oneshot::Receiver<()>,
}

impl SlotWaiter {
    /// The slot handed over within `within`, or `None`.
    pub(super) async fn wait(mut self, within: Duration) -> Option<AddressSlot> {
        match tokio::time::timeout(within, &mut self.handed).await {
            Ok(Ok(())) => {
                // Taken: the unit handed over is this slot's now (not passed on by `drop`).
                self.handed = oneshot::channel().1;
                Some(AddressSlot {
                    counts: self.counts.clone(),
                    ip: self.ip,
                })
            }
            _ => None,
        }
    }
}

impl Drop for SlotWaiter {
    fn drop(&mut self) {
        // Out of the line; a slot handed over meanwhile (its task cancelled, or given up at the
        // moment it came) is passed on, not lost.
        self.handed.close();
        if self.handed.try_recv().is_ok() {
            drop(AddressSlot {
                counts: self.counts.clone(),
                ip: self.ip,
            });
        }
    }
}

impl Drop for AddressSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.counts();
        // The slot goes to the address's oldest newcomer still waiting; a waiter that gave up
        // refuses it, and the next one is asked.
        while let Some(hand) = counts
            .waiting
            .get_mut(&self.ip)
            .and_then(VecDeque::pop_front)
        {
            if hand.send(()).is_ok() {
                return;
            }
        }
        counts.waiting.remove(&self.ip);
        // An address with no connection left is forgotten: the map holds only live ones.
        if let Some(count) = counts.open.get_mut(&self.ip) {
            *count -= 1;
            if *count == 0 {
                counts.open.remove(&self.ip);
            }
        }
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
            !counts.counts().open.contains_key(&a),
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

    #[test]
    fn every_loopback_address_is_counted_as_one_and_others_as_before() {
        let localhost: IpAddr = "127.0.0.1".parse().unwrap();
        for (peer, counted) in [
            ("127.0.0.1", "127.0.0.1"),
            ("127.0.0.5", "127.0.0.1"),
            ("127.0.0.200", "127.0.0.1"),
            ("127.255.255.254", "127.0.0.1"),
            ("::1", "127.0.0.1"),
            ("::ffff:127.0.0.1", "127.0.0.1"),
            ("::ffff:127.9.8.7", "127.0.0.1"),
            ("192.0.2.7", "192.0.2.7"),
            ("::ffff:192.0.2.7", "192.0.2.7"),
            ("128.0.0.1", "128.0.0.1"),
            ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::"),
            ("::2", "::"),
        ] {
            let peer: IpAddr = peer.parse().unwrap();
            let counted: IpAddr = counted.parse().unwrap();
            assert_eq!(counted_as(peer), counted, "{peer}");
        }
        let counts = PerAddress::new(NonZeroUsize::new(1).unwrap());
        let _held = counts.enter("127.0.0.2".parse().unwrap()).unwrap();
        assert!(
            counts.enter(localhost).is_none(),
            "another loopback address"
        );
        assert!(
            counts.enter("::1".parse().unwrap()).is_none(),
            "IPv6's loopback"
        );
    }

    #[tokio::test]
    async fn a_slot_given_back_goes_to_the_newcomer_that_waited_longest() {
        let counts = PerAddress::new(NonZeroUsize::new(1).unwrap());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let held = counts.enter(a).unwrap();
        let wait = |within: Duration| {
            let waiter = counts.queue_for(a).unwrap_err();
            tokio::spawn(waiter.wait(within))
        };
        let first = wait(Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let second = wait(Duration::from_millis(300));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(counts.enter(a).is_none(), "the waiting come first");
        drop(held);
        let first = first.await.unwrap();
        assert!(first.is_some(), "the first newcomer got the slot");
        assert!(
            second.await.unwrap().is_none(),
            "none was left for the second"
        );
        drop(first);
        assert!(counts.enter(a).is_some(), "given back, with nobody waiting");
    }

    #[tokio::test]
    async fn a_slot_handed_to_a_waiter_that_is_gone_passes_on() {
        let counts = PerAddress::new(NonZeroUsize::new(1).unwrap());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let held = counts.enter(a).unwrap();
        let cancelled = counts.queue_for(a).unwrap_err();
        let next = counts.queue_for(a).unwrap_err();
        drop(held); // handed to `cancelled`, which never takes it
        drop(cancelled); // passes it on
        assert!(next.wait(Duration::from_secs(1)).await.is_some());
        assert!(counts.enter(a).is_some(), "nothing left counted");
    }
}
