//! The cluster a server joins: what it is told ([`ClusterJoin`]) and the membership
//! configuration checked from it, given where the server listens.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::StartError;
use super::secrets::token_in;
use crate::cluster::{ClusterConfig, EtcdUser};

/// A cluster kept in etcd for a server to join: it registers itself and publishes what it
/// holds under a lease it renews, and pulls from the registered members.
#[derive(Debug, Clone)]
pub struct ClusterJoin {
    /// `etcd://HOST:PORT[,HOST:PORT...]`, or `etcds://` for etcd over TLS (reached with the
    /// node's certificate).
    pub cluster: String,
    /// The node's name in the cluster (`@NAME`): 1 to 63 letters, digits, `-`, `_`, `.`; under
    /// TLS, its certificate's name.
    pub name: String,
    /// The TCP address others reach the node at; default: the address it listens on, where that
    /// is not a wildcard.
    pub advertise: Option<String>,
    /// How long a dead node stays registered at most.
    pub ttl: Duration,
    /// The node ids that may be members (the operator's list); none: whoever registers.
    pub member_ids: Vec<String>,
    /// The etcd user the node logs in as, and the file holding its password (its first line
    /// that is not blank or a `#` comment), for an etcd with auth on.
    pub etcd_login: Option<(String, PathBuf)>,
}

impl ClusterJoin {
    /// Joins `cluster` as `name`, advertising the listen address, with a 5 s lease.
    pub fn new(cluster: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            cluster: cluster.into(),
            name: name.into(),
            advertise: None,
            ttl: Duration::from_secs(5),
            member_ids: Vec::new(),
            etcd_login: None,
        }
    }

    /// Checks what can be checked before the node starts: the name, the endpoints, etcd over TLS
    /// only with the node's certificate, and under TLS the certificate's name; reads the etcd
    /// user's password.
    pub(crate) fn check(&self, certified: Option<&str>) -> Result<Option<EtcdUser>, StartError> {
        if !ferry_proto::cluster::valid_member_name(&self.name) {
            return Err(StartError::MemberName(self.name.clone()));
        }
        ferry_proto::cluster::endpoints(&self.cluster).map_err(|reason| StartError::Cluster {
            cluster: self.cluster.clone(),
            reason,
        })?;
        match certified {
            None if self.cluster.starts_with("etcds://") => {
                Err(StartError::EtcdsWithoutTls(self.cluster.clone()))
            }
            Some(certified) if certified != self.name => Err(StartError::MemberNameNotCertified {
                given: self.name.clone(),
                certified: certified.to_string(),
            }),
            _ => Ok(()),
        }?;
        match &self.etcd_login {
            Some((name, path)) => EtcdUser::new(name.clone(), token_in(path)?)
                .map(Some)
                .ok_or(StartError::EtcdUser),
            None => Ok(None),
        }
    }

    /// The membership's configuration, for a node listening on `listening` (and `unix`).
    pub(crate) fn config(
        &self,
        listening: SocketAddr,
        unix: Option<&Path>,
        etcd_user: Option<EtcdUser>,
    ) -> Result<ClusterConfig, StartError> {
        let endpoints = ferry_proto::cluster::endpoints(&self.cluster).map_err(|reason| {
            StartError::Cluster {
                cluster: self.cluster.clone(),
                reason,
            }
        })?;
        let advertise = match &self.advertise {
            Some(advertise) => advertise.clone(),
            None if !listening.ip().is_unspecified() => listening.to_string(),
            None => return Err(StartError::AdvertiseNeeded(listening)),
        };
        Ok(ClusterConfig {
            endpoints,
            name: self.name.clone(),
            advertise,
            unix: unix.map(|p| format!("unix:{}", p.display())),
            ttl: self.ttl,
            etcd_user,
        })
    }
}
