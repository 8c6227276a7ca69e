//! A cluster's member list and tensor directory, read from etcd: what `ferry ls @` shows, and
//! how `@NAME` and a tensor named alone resolve to a node and a source.
//!
//! What etcd holds was written by nodes (and possibly by anyone else with access to that etcd):
//! keys are parsed and values decoded with bounds, and an entry that does not parse is skipped.
//! Reached under TLS, the directory takes only records each member sealed with its own key
//! (`ferry_io::signed_record`): an entry anyone else wrote is skipped, and a member record
//! asked for by name that its member did not seal is an error saying who did.

pub use ferry_etcd::EtcdUser;
use ferry_etcd::{Etcd, EtcdError};
use ferry_io::ClientTls;
use ferry_io::Endpoint;
use ferry_io::signed_record::Records;
use ferry_proto::NodeId;
use ferry_proto::cluster::{self as keys, MemberRecord, TensorRecord};
use std::time::Duration;

use crate::{Client, ClientError, ConnectOptions};
use ferry_io::PeerCheck;

mod load;
mod source;
pub use load::{LOAD_DEADLINE, Load, Loads, ask_loads, choose_weighed};
pub use source::{ChooseError, MOST_ASKED, Source, choose_source, worth_asking};

/// How long etcd may take to connect or answer.
const ETCD_TIMEOUT: Duration = Duration::from_secs(3);

/// Why the directory could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DirectoryError {
    /// `--cluster` is not `etcd://HOST:PORT[,...]`.
    #[error("cluster address: {0}")]
    Address(String),
    /// No member is registered under the name.
    #[error("no member @{0} is registered in the cluster")]
    UnknownMember(String),
    /// Under TLS: the record under the member's name is not one the member sealed.
    #[error("@{member}'s record is refused: {source}")]
    Record {
        /// The member's name.
        member: String,
        /// Why the record was not taken.
        #[source]
        source: ferry_io::RecordError,
    },
    /// The member's record names a node id the operator's list does not admit.
    #[error("@{member}'s record names node {node_id:?}, which is not among the admitted members")]
    NotAdmitted {
        /// The member's name.
        member: String,
        /// The node id its record names.
        node_id: NodeId,
    },
    /// etcd did not answer or refused.
    #[error("etcd at {endpoints} (none of them answered): {cause}")]
    Etcd {
        /// The endpoints tried.
        endpoints: String,
        /// What failed.
        cause: String,
    },
}

/// A tensor the directory places on a member's device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    /// The member holding it.
    pub member: String,
    /// The device on that member.
    pub device: u32,
    /// The tensor's name.
    pub name: String,
    /// What the member published about it.
    pub record: TensorRecord,
}

/// A connection to a cluster's etcd, for reading.
pub struct Directory {
    etcd: Etcd,
    endpoints: String,
    /// Which records count: under TLS only those each member sealed, and a member's name is its
    /// node id, whatever address (a Unix socket too) its record gives.
    records: Records,
    /// The node ids the operator admits as members; `None`: whoever registers.
    admitted: Option<std::collections::BTreeSet<NodeId>>,
}

impl Directory {
    /// Connects to the etcd `cluster` names (`etcd://HOST:PORT[,HOST:PORT...]`).
    pub async fn connect(cluster: &str) -> Result<Directory, DirectoryError> {
        Directory::connect_with(cluster, None).await
    }

    /// [`connect`](Self::connect), with `tls` for a cluster under TLS: etcd's certificate checked
    /// against the CA and this side's presented where etcd takes TLS (`etcds://HOST:PORT`), and
    /// only records their members sealed taken (nodes under TLS seal every record).
    pub async fn connect_with(
        cluster: &str,
        tls: Option<&ClientTls>,
    ) -> Result<Directory, DirectoryError> {
        Directory::connect_as(cluster, tls, None).await
    }

    /// [`connect_with`](Self::connect_with), logged in to etcd as `user` where etcd runs with
    /// auth on (its password goes over TLS or to loopback only).
    pub async fn connect_as(
        cluster: &str,
        tls: Option<&ClientTls>,
        user: Option<EtcdUser>,
    ) -> Result<Directory, DirectoryError> {
        let endpoints = keys::endpoints(cluster).map_err(DirectoryError::Address)?;
        let joined = endpoints.join(",");
        let tls_connector = tls.map(ClientTls::connector);
        let etcd = Etcd::connect_as(&endpoints, ETCD_TIMEOUT, tls_connector, user)
            .await
            .map_err(|e| DirectoryError::Etcd {
                endpoints: joined.clone(),
                cause: e.to_string(),
            })?;
        Ok(Directory {
            etcd,
            endpoints: joined,
            records: match tls {
                Some(tls) => Records::Sealed(tls.record_check().clone()),
                None => Records::Claimed,
            },
            admitted: None,
        })
    }

    /// Takes as members only those whose node id is among `ids` (the operator's list): a record
    /// of any other id, whoever wrote it, resolves to [`DirectoryError::NotAdmitted`].
    pub fn admitting(mut self, ids: impl IntoIterator<Item = NodeId>) -> Directory {
        self.admitted = Some(ids.into_iter().collect());
        self
    }

    /// Whether the operator's list (if any) admits node `id`.
    fn admits(&self, id: &NodeId) -> bool {
        self.admitted.as_ref().is_none_or(|ids| ids.contains(id))
    }

    fn failed(&self, e: EtcdError) -> DirectoryError {
        DirectoryError::Etcd {
            endpoints: self.endpoints.clone(),
            cause: e.to_string(),
        }
    }

    /// Every registered member (of those the operator's list admits, where there is one),
    /// sorted by name.
    pub async fn members(&mut self) -> Result<Vec<MemberRecord>, DirectoryError> {
        let answer = self
            .etcd
            .get_prefix(keys::MEMBERS.as_bytes())
            .await
            .map_err(|e| self.failed(e))?;
        let mut members: Vec<MemberRecord> = answer
            .kvs
            .iter()
            .filter_map(|kv| self.records.member(&kv.key, &kv.value).ok())
            .filter(|m| self.admits(&m.node_id))
            .collect();
        members.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(members)
    }

    /// The member registered as `name`, if any; under TLS a record there that the member did not
    /// seal is [`DirectoryError::Record`].
    pub async fn member(&mut self, name: &str) -> Result<Option<MemberRecord>, DirectoryError> {
        if !keys::valid_member_name(name) {
            return Ok(None);
        }
        let key = keys::member_key(name);
        let answer = self
            .etcd
            .get(key.as_bytes())
            .await
            .map_err(|e| self.failed(e))?;
        let Some(kv) = answer.kvs.iter().find(|kv| kv.key == key.as_bytes()) else {
            return Ok(None);
        };
        match self.records.member(&kv.key, &kv.value) {
            Ok(record) => Ok(Some(record)),
            Err(ferry_io::RecordError::Unreadable(_)) if !self.records.is_sealed() => Ok(None),
            Err(source) => Err(DirectoryError::Record {
                member: name.to_string(),
                source,
            }),
        }
    }

    /// The member registered as `name`, or [`DirectoryError::UnknownMember`].
    pub async fn resolve(&mut self, name: &str) -> Result<MemberRecord, DirectoryError> {
        let member = self
            .member(name)
            .await?
            .ok_or_else(|| DirectoryError::UnknownMember(name.to_string()))?;
        if !self.admits(&member.node_id) {
            return Err(DirectoryError::NotAdmitted {
                member: member.name,
                node_id: member.node_id,
            });
        }
        Ok(member)
    }

    /// Connects to member `name` ([`connect_nearest`]): the one-call form of `@NAME`.
    pub async fn reach(
        &mut self,
        name: &str,
        options: ConnectOptions,
    ) -> Result<(Client, MemberRecord), ReachError> {
        let member = self.resolve(name).await?;
        // Under TLS a member's name is its node id, on every path to it: a record naming another
        // node under @name (and that node's Unix socket) is refused before connecting, even by a
        // caller that reaches its socket without TLS of its own. (A sealed record says so
        // already; this holds whatever the record's way here.)
        if self.records.is_sealed() && member.node_id.as_str() != member.name {
            return Err(ReachError::Client(ClientError::NameIsNotIdentity {
                member: member.name.clone(),
                registered: member.node_id.clone(),
            }));
        }
        let client = connect_nearest(&member, options).await?;
        Ok((client, member))
    }

    /// Every place the directory lists a tensor named `tensor`, on any member and device.
    pub async fn holders(&mut self, tensor: &str) -> Result<Vec<Located>, DirectoryError> {
        // The directory is keyed by member, then device, then name: finding a name means reading
        // it all (see ARCHITECTURE.md on scale).
        self.entries(None, Some(tensor)).await
    }

    /// The tensors the directory places on `member`, or on every member; sorted by member,
    /// device and name.
    pub async fn tensors(&mut self, member: Option<&str>) -> Result<Vec<Located>, DirectoryError> {
        self.entries(member, None).await
    }

    /// The entries under `member` (or every member's), of the tensor named `name` (or of every
    /// tensor), of members the operator's list admits. An entry's key is parsed, and its name
    /// matched, before its seal is checked: a reader looking for one name verifies only its
    /// holders' entries.
    async fn entries(
        &mut self,
        member: Option<&str>,
        name: Option<&str>,
    ) -> Result<Vec<Located>, DirectoryError> {
        // Under the operator's list, only admitted members' entries: their names, read from the
        // member records this directory takes (under TLS, a member's name is its node id).
        let admitted_names: Option<std::collections::BTreeSet<String>> = match &self.admitted {
            Some(_) => Some(self.members().await?.into_iter().map(|m| m.name).collect()),
            None => None,
        };
        let prefix = match member {
            Some(name) => keys::member_tensors(name),
            None => keys::TENSORS.to_string(),
        };
        let answer = self
            .etcd
            .get_prefix(prefix.as_bytes())
            .await
            .map_err(|e| self.failed(e))?;
        let mut found: Vec<Located> = answer
            .kvs
            .iter()
            .filter(|kv| {
                let place = std::str::from_utf8(&kv.key)
                    .ok()
                    .and_then(keys::parse_tensor_key);
                place.is_some_and(|(member, _, tensor)| {
                    name.is_none_or(|name| name == tensor)
                        && admitted_names
                            .as_ref()
                            .is_none_or(|names| names.contains(member))
                })
            })
            .filter_map(|kv| {
                let (member, device, name, record) =
                    self.records.tensor(&kv.key, &kv.value).ok()?;
                Some(Located {
                    member: member.to_string(),
                    device,
                    name: name.to_string(),
                    record,
                })
            })
            .collect();
        found.sort_by(|a, b| (&a.member, a.device, &a.name).cmp(&(&b.member, b.device, &b.name)));
        Ok(found)
    }
}

/// The address a client on the machine `here` uses for `member`: its Unix socket where the
/// member runs on this machine and has one (the transport then checks that this user serves
/// it), else its TCP address.
pub fn address_for(member: &MemberRecord, here: &str) -> String {
    match &member.unix {
        Some(unix) if !member.host.is_empty() && member.host == here => unix.clone(),
        _ => member.tcp.clone(),
    }
}

/// Connects to `member` at `addr` (one of its registered addresses, as [`address_for`] picks)
/// and makes sure it is the node the member registered: over TCP under TLS, its certificate
/// must name the member's node id before anything (the token included) is sent; otherwise the
/// node's own answer to `identify` must, so that a stale or wrong entry is an error rather than
/// a silent use of another node. Under TLS a member's name must be its node id (its
/// certificate's name): a record under one name naming another node is refused
/// ([`ClientError::NameIsNotIdentity`]). A token never goes in clear to a TCP address the directory
/// gave: whoever can write the directory would choose where it goes
/// ([`ClientError::UncheckedMember`]). Over a Unix socket, the socket must be served by this
/// very user (a root daemon listening at a path the directory named is not the member).
pub async fn connect_member(
    member: &MemberRecord,
    addr: &str,
    options: ConnectOptions,
) -> Result<Client, ClientError> {
    // Under TLS the name is the identity: a record under @a naming node b (rewritten by an etcd
    // writer) would otherwise pass, b being who the record says.
    if options.has_tls() && member.node_id.as_str() != member.name {
        return Err(ClientError::NameIsNotIdentity {
            member: member.name.clone(),
            registered: member.node_id.clone(),
        });
    }
    let endpoint = Endpoint::parse(addr);
    let check = match &endpoint {
        Endpoint::Tcp(_) if !options.has_tls() && options.has_token() => {
            return Err(ClientError::UncheckedMember {
                member: member.name.clone(),
                addr: addr.to_string(),
            });
        }
        // In clear and without a token there is nothing to check before sending.
        // (A check the caller asked for stays, and fails there: TCP in clear shows no identity.)
        Endpoint::Tcp(_) if !options.has_tls() => options.check.clone(),
        // Under TLS the certificate; over a Unix socket, that this very user serves it.
        _ => PeerCheck::Node(member.node_id.clone()),
    };
    let mut client = options.check(check).to(endpoint).await?;
    let answered = client.identify().await?;
    if answered != member.node_id {
        return Err(ClientError::NotTheMember {
            member: member.name.clone(),
            registered: member.node_id.clone(),
            answered,
        });
    }
    Ok(client)
}

/// Connects to `member` the nearest way: its Unix socket where it runs on this machine
/// ([`address_for`]), and its TCP address where that socket does not serve (not there, another
/// user's, or another node's: two machines may share a name); with [`connect_member`]'s checks
/// either way.
pub async fn connect_nearest(
    member: &MemberRecord,
    options: ConnectOptions,
) -> Result<Client, ClientError> {
    let addr = address_for(member, &ferry_io::machine::name());
    if addr == member.tcp {
        return connect_member(member, &addr, options).await;
    }
    match connect_member(member, &addr, options.clone()).await {
        Err(
            ClientError::Connection(_)
            | ClientError::Unreachable { .. }
            | ClientError::NotTheMember { .. },
        ) => connect_member(member, &member.tcp, options).await,
        other => other,
    }
}

/// Why [`Directory::reach`] did not connect.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReachError {
    /// The directory could not say where the member is.
    #[error(transparent)]
    Directory(#[from] DirectoryError),
    /// The member did not connect, or is not who it registered as.
    #[error(transparent)]
    Client(#[from] ClientError),
}
