//! A cluster's member list and tensor directory, read from etcd: what `ferry ls @` shows.
//!
//! What etcd holds was written by nodes (and possibly by anyone else with access to that etcd):
//! keys are parsed and values decoded with bounds, and an entry that does not parse is skipped.

use etcd_client::{Client as Etcd, ConnectOptions, GetOptions};
use ferry_proto::cluster::{self as keys, MemberRecord, TensorRecord};
use std::time::Duration;

/// How long etcd may take to connect or answer.
const ETCD_TIMEOUT: Duration = Duration::from_secs(3);

/// Why the directory could not be read.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    /// `--cluster` is not `etcd://HOST:PORT[,...]`.
    #[error("cluster address: {0}")]
    Address(String),
    /// etcd did not answer or refused.
    #[error("etcd at {endpoints}: {cause}")]
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
}

impl Directory {
    /// Connects to the etcd `cluster` names (`etcd://HOST:PORT[,HOST:PORT...]`).
    pub async fn connect(cluster: &str) -> Result<Directory, DirectoryError> {
        let endpoints = keys::endpoints(cluster).map_err(DirectoryError::Address)?;
        let options = ConnectOptions::new()
            .with_timeout(ETCD_TIMEOUT)
            .with_connect_timeout(ETCD_TIMEOUT);
        let joined = endpoints.join(",");
        let etcd = Etcd::connect(&endpoints, Some(options))
            .await
            .map_err(|e| DirectoryError::Etcd {
                endpoints: joined.clone(),
                cause: e.to_string(),
            })?;
        Ok(Directory {
            etcd,
            endpoints: joined,
        })
    }

    fn failed(&self, e: etcd_client::Error) -> DirectoryError {
        DirectoryError::Etcd {
            endpoints: self.endpoints.clone(),
            cause: e.to_string(),
        }
    }

    /// Every registered member, sorted by name.
    pub async fn members(&mut self) -> Result<Vec<MemberRecord>, DirectoryError> {
        let answer = self
            .etcd
            .get(keys::MEMBERS, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.failed(e))?;
        let mut members: Vec<MemberRecord> = answer
            .kvs()
            .iter()
            .filter_map(|kv| {
                let name = std::str::from_utf8(kv.key())
                    .ok()?
                    .strip_prefix(keys::MEMBERS)?;
                let record: MemberRecord = keys::decode(kv.value())?;
                (record.name == name && keys::valid_member_name(name)).then_some(record)
            })
            .collect();
        members.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(members)
    }

    /// The member registered as `name`, if any.
    pub async fn member(&mut self, name: &str) -> Result<Option<MemberRecord>, DirectoryError> {
        Ok(self.members().await?.into_iter().find(|m| m.name == name))
    }

    /// The tensors the directory places on `member`, or on every member; sorted by member,
    /// device and name.
    pub async fn tensors(&mut self, member: Option<&str>) -> Result<Vec<Located>, DirectoryError> {
        let prefix = match member {
            Some(name) => keys::member_tensors(name),
            None => keys::TENSORS.to_string(),
        };
        let answer = self
            .etcd
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.failed(e))?;
        let mut found: Vec<Located> = answer
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = std::str::from_utf8(kv.key()).ok()?;
                let (member, device, name) = keys::parse_tensor_key(key)?;
                Some(Located {
                    member: member.to_string(),
                    device,
                    name: name.to_string(),
                    record: keys::decode(kv.value())?,
                })
            })
            .collect();
        found.sort_by(|a, b| (&a.member, a.device, &a.name).cmp(&(&b.member, b.device, &b.name)));
        Ok(found)
    }
}
