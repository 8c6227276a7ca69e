//! Connections per identity: once a hello says who a connection is (which token, which
//! certificate, the node's own user), one identity holds at most its share of the node's
//! connections, so that one credential's holder, from however many addresses, cannot take the
//! slots every other identity needs.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use ferry_io::tls::Identity;
use ferry_proto::Hello;

use super::door::credential;
use super::door::handshake::Door;

/// Who holds a connection, as far as sharing the node's connections goes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) enum Holder {
    /// A client of a token (TCP in clear): which of the node's credentials, by its place in
    /// the list (never the token, which is neither kept nor logged).
    Token(usize),
    /// A certificate's identity, under TLS.
    Certified(Identity),
    /// The node's own user or root, on the Unix socket of a node that asks credentials of
    /// others: one identity like any other, so that a local program that runs away with
    /// connections leaves the others their quarter.
    OwnUser,
    /// Anyone at all, on a node that asks no credential: only its own user and root can
    /// connect there (checked at accept), one kind of client with nobody to keep slots for, so
    /// no share applies.
    Anyone,
}

impl Holder {
    /// Who a connection that came in by `door` with `hello` is, where the node takes
    /// `credentials` (none: it asks for none, unless under TLS).
    pub(super) fn of(
        door: &Door,
        hello: &Hello,
        credentials: &[credential::Credential],
        asks_credentials: bool,
    ) -> Holder {
        match door {
            _ if !asks_credentials => Holder::Anyone,
            Door::OwnUserSocket => Holder::OwnUser,
            Door::Certified(identity) => Holder::Certified(identity.clone()),
            Door::Clear => {
                let token = hello.token.as_ref().map(ferry_proto::Token::as_str);
                // A welcomed hello matched one; `Anyone` were it ever not (nothing to share).
                credential::matching(credentials, token).map_or(Holder::Anyone, Holder::Token)
            }
        }
    }
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // Counted from 1, as the lines of a token file.
            Holder::Token(index) => write!(f, "token credential #{}", index + 1),
            Holder::Certified(identity) => write!(f, "certificate {identity}"),
            Holder::OwnUser => f.write_str("the node's own user"),
            Holder::Anyone => f.write_str("anyone"),
        }
    }
}

/// The most connections one identity holds where the configuration names no share: three
/// quarters of the node's, so that a quarter is always left to the other identities (a node's
/// pulls, an operator's `ferry stat`) however many one holder opens; above the default
/// per-address limit (a quarter), so that one client host is held back by that first.
pub(super) fn default_share(max_connections: usize) -> usize {
    max_connections - max_connections / 4
}

/// The most connections `holder` may hold at once, where `share` is one identity's; `None` for
/// no limit of its own.
pub(super) fn share_of(holder: &Holder, share: usize) -> Option<usize> {
    match holder {
        Holder::Anyone => None,
        Holder::Token(_) | Holder::Certified(_) | Holder::OwnUser => Some(share),
    }
}

/// Whether a new connection of an identity that holds `held` connections already is admitted,
/// under its `limit` (`None`: none).
pub(super) fn admits(held: usize, limit: Option<usize>) -> bool {
    limit.is_none_or(|limit| held < limit)
}

/// The connections each identity holds, and the share one may hold.
#[derive(Debug)]
pub(super) struct PerIdentity {
    share: usize,
    open: Mutex<HashMap<Holder, usize>>,
}

/// One connection's place in its identity's count, given back when dropped.
#[derive(Debug)]
pub(super) struct IdentitySlot {
    counts: Arc<PerIdentity>,
    holder: Holder,
}

impl PerIdentity {
    /// At most `share` connections per identity (see [`share_of`]).
    pub(super) fn new(share: usize) -> Arc<Self> {
        Arc::new(Self {
            share,
            open: Mutex::new(HashMap::new()),
        })
    }

    fn open(&self) -> MutexGuard<'_, HashMap<Holder, usize>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for a connection of `holder`, or `Err` with its share when it holds that many.
    pub(super) fn enter(self: &Arc<Self>, holder: Holder) -> Result<IdentitySlot, usize> {
        let limit = share_of(&holder, self.share);
        let mut open = self.open();
        let held = open.get(&holder).copied().unwrap_or(0);
        if !admits(held, limit) {
            return Err(limit.unwrap_or(held));
        }
        open.insert(holder.clone(), held + 1);
        Ok(IdentitySlot {
            counts: self.clone(),
            holder,
        })
    }
}

impl Drop for IdentitySlot {
    fn drop(&mut self) {
        let mut open = self.counts.open();
        // An identity with no connection left is forgotten: the map holds only live ones.
        if let Some(held) = open.get_mut(&self.holder) {
            *held -= 1;
            if *held == 0 {
                open.remove(&self.holder);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_is_admitted_below_its_share_and_anyone_always() {
        for (holder, held, share, admitted) in [
            (Holder::Token(0), 0, 3, true),
            (Holder::Token(0), 2, 3, true),
            (Holder::Token(0), 3, 3, false),
            (Holder::Token(4), 9, 3, false),
            (Holder::OwnUser, 2, 3, true),
            (Holder::OwnUser, 3, 3, false),
            (Holder::Anyone, 0, 3, true),
            (Holder::Anyone, 1_000_000, 3, true),
            (Holder::Token(0), 0, 0, false),
        ] {
            assert_eq!(
                admits(held, share_of(&holder, share)),
                admitted,
                "{holder} holding {held} of {share}"
            );
        }
    }

    #[test]
    fn the_default_share_keeps_a_quarter_back() {
        for (max, share) in [(1024, 768), (32, 24), (4, 3), (3, 3), (1, 1), (0, 0)] {
            assert_eq!(default_share(max), share, "of {max}");
        }
    }

    #[test]
    fn each_identity_is_counted_apart_and_slots_come_back() {
        let counts = PerIdentity::new(2);
        let reader = Holder::Token(0);
        let first = counts.enter(reader.clone()).unwrap();
        let _second = counts.enter(reader.clone()).unwrap();
        assert_eq!(counts.enter(reader.clone()).unwrap_err(), 2, "a third");
        let _writer = counts
            .enter(Holder::Token(1))
            .expect("another credential is counted apart");
        let _anyone: Vec<_> = (0..5)
            .map(|_| counts.enter(Holder::Anyone).unwrap())
            .collect();
        drop(first);
        let again = counts.enter(reader.clone()).expect("a slot came back");
        drop(again);
        drop(_second);
        assert!(
            !counts.open().contains_key(&reader),
            "an identity with none open is forgotten"
        );
    }
}
