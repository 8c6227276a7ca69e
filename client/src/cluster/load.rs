//! How busy each holder is as a source, asked of the holders themselves ([`ask_loads`]): what a
//! copy by name weighs, after nearness, when it chooses among holders (`source.rs`).

use std::collections::BTreeMap;
use std::time::Duration;

use ferry_proto::cluster::MemberRecord;
use ferry_proto::message::LOAD_MINOR;
use futures_util::future::join_all;

use super::source::{ChooseError, Source, choose_source, worth_asking};
use super::{Located, connect_nearest};
use crate::ConnectOptions;

/// How long a holder may take to connect and say its load: one that takes longer is passed
/// over as unreachable (a copy from it would wait as long again).
pub const LOAD_DEADLINE: Duration = Duration::from_secs(2);

/// A holder's load as a source, as its node said it when asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Load {
    /// It answered: the fetches it serves now and the payload bytes they were asked for.
    Serving {
        /// Fetches under way (other nodes pulling from it).
        fetches: u64,
        /// Their payload bytes.
        bytes: u64,
    },
    /// It answered, but is a node older than protocol minor 10, which does not say its load.
    Unknown,
    /// It did not connect or answer in time, or is not the node it registered as: why, for a
    /// person. A copy reads from it only where no holder answered.
    Unreachable(String),
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Load::Serving { fetches, bytes } => {
                write!(f, "serving {fetches} fetches, {bytes} bytes")
            }
            Load::Unknown => write!(f, "load not known (a node of an older protocol)"),
            Load::Unreachable(why) => write!(f, "did not answer: {why}"),
        }
    }
}

/// The load of each member asked, by member name; a member not in it was not asked.
pub type Loads = BTreeMap<String, Load>;

/// Asks each of `members` for its load at once, each within [`LOAD_DEADLINE`], through the
/// checks of [`connect_nearest`].
pub async fn ask_loads(members: &[MemberRecord], options: &ConnectOptions) -> Loads {
    let asks = members.iter().map(|member| async move {
        let asked = async {
            let mut client = connect_nearest(member, options.clone()).await?;
            let says_load = client.welcome().minor >= LOAD_MINOR;
            client.stat().await.map(|stats| (stats, says_load))
        };
        let load = match tokio::time::timeout(LOAD_DEADLINE, asked).await {
            Ok(Ok((stats, true))) => Load::Serving {
                fetches: stats.fetches_in_flight,
                bytes: stats.fetch_bytes_in_flight,
            },
            Ok(Ok((_, false))) => Load::Unknown,
            Ok(Err(e)) => Load::Unreachable(e.to_string()),
            Err(_) => Load::Unreachable(format!("no answer within {LOAD_DEADLINE:?}")),
        };
        (member.name.clone(), load)
    });
    join_all(asks).await.into_iter().collect()
}

/// [`choose_source`] for a copy of `name` to `target`, after asking the holders
/// [`worth_asking`] names for their load.
pub async fn choose_weighed(
    name: &str,
    holders: &[Located],
    members: &[MemberRecord],
    target: Option<&MemberRecord>,
    options: &ConnectOptions,
) -> Result<Source, ChooseError> {
    let asked = worth_asking(name, holders, members, target);
    let loads = ask_loads(&asked, options).await;
    choose_source(name, holders, members, target, &loads)
}
