//! Node-to-node calls: capabilities (identify, grant, release), pulls, and [`copy_between`],
//! which copies or moves tensors from one node to another without their bytes passing through
//! this client.

use ferry_proto::{ErrorCode, Request, Response, TensorInfo, TensorKey};

use super::{Client, ClientError, unexpected};

/// How many capabilities a node-to-node batch asks for ahead of their pulls.
const GRANT_WINDOW: usize = 4;

/// The `path` a target reports for a pull it skipped because it already held the same bytes
/// and copied its own (PROTOCOL.md: `TensorInfo::path`).
const DEDUP_PATH: &str = "dedup";

/// Whether the target registered `info` from bytes it already held (a dedup), so it never
/// fetched from the source and the capability is still unused.
fn was_dedup(info: &TensorInfo) -> bool {
    info.path == DEDUP_PATH
}

/// A capability a source node issued: hand it to the target node's [`Client::pull`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The secret.
    pub token: String,
    /// Milliseconds until it expires.
    pub expires_in_ms: u64,
    /// The tensor it grants.
    pub info: TensorInfo,
    /// BLAKE3 of the tensor's bytes (hex).
    pub content_hash: String,
}

/// A node's answer to a grant: the capability.
fn grant_from(response: Response) -> Result<Grant, ClientError> {
    match response {
        Response::Capability {
            token,
            expires_in_ms,
            info,
            content_hash,
        } => Ok(Grant {
            token,
            expires_in_ms,
            info,
            content_hash,
        }),
        other => Err(unexpected(other)),
    }
}

/// The request that asks a target node to pull `grant`'s tensor from the node at `source`.
fn pull_request(
    source: &str,
    grant: &Grant,
    dst_device: u32,
    dst_name: Option<&str>,
    overwrite: bool,
) -> Request {
    Request::Pull {
        source: source.to_string(),
        capability: grant.token.clone(),
        src: grant.info.key.clone(),
        dst_device,
        dst_name: dst_name.map(str::to_string),
        overwrite,
        content_hash: Some(grant.content_hash.clone()),
    }
}

/// How often a grant answered `Busy` (the source still computing the tensor's content hash) is
/// asked again; the source waits up to 10 seconds each time, so this bounds the wait at about 5
/// minutes of hashing (several hundred GB).
const GRANT_BUSY_RETRIES: u32 = 30;

/// Where and how [`copy_between`] puts the tensors.
#[derive(Debug, Clone, Copy)]
pub struct NodeCopy<'a> {
    /// The source node's address as the target reaches it.
    pub source_addr: &'a str,
    /// The target device.
    pub dst_device: u32,
    /// The target name (for a single tensor); each source name when absent.
    pub dst_name: Option<&'a str>,
    /// Delete each source tensor once the target registered it (a move).
    pub remove_source: bool,
    /// Replace tensors already registered under the target keys.
    pub overwrite: bool,
    /// The content hash the granted tensor must have (for a single tensor): a copy of the
    /// version a directory listed, refused ([`ClientError::NotTheListedVersion`]) if the source
    /// holds another by now.
    pub expect_hash: Option<&'a str>,
}

/// Copies (or, with `remove_source`, moves) tensors from one node to another, node to node:
/// the target pulls each tensor straight from the source with a single-use capability bound to
/// the target, so the bytes never pass through this client. Grants and pulls are pipelined;
/// one answer per tensor, in order. A move deletes a source tensor only after the target
/// registered it.
pub async fn copy_between(
    source: &mut Client,
    target: &mut Client,
    keys: &[TensorKey],
    how: &NodeCopy<'_>,
) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
    let NodeCopy {
        source_addr,
        dst_device,
        dst_name,
        remove_source,
        overwrite,
        expect_hash,
    } = *how;
    if (dst_name.is_some() || expect_hash.is_some()) && keys.len() > 1 {
        return Err(ClientError::Unexpected(
            "a target name (or an expected hash) is for one tensor; copy several under their \
             own names"
                .into(),
        ));
    }
    let audience = target.identify().await?;
    let mut results = Vec::with_capacity(keys.len());
    // Few grants ahead of the pulls: a capability's clock runs from its grant, and pulls of
    // large tensors one after another could outlast it.
    for window in keys.chunks(GRANT_WINDOW) {
        for key in window {
            source
                .conn
                .write_request(&Request::Grant {
                    key: key.clone(),
                    audience: audience.clone(),
                })
                .await?;
        }
        let mut grants = Vec::with_capacity(window.len());
        for _ in window {
            let answer = source.conn.read_response().await;
            grants.push(answer.map_err(ClientError::from).and_then(grant_from));
        }
        // A tensor whose content hash the source is still computing (a large put just before)
        // is granted once it has: each ask waits for it up to the node's bound, then says Busy.
        for (key, grant) in window.iter().zip(grants.iter_mut()) {
            let mut asked = 0;
            while asked < GRANT_BUSY_RETRIES
                && matches!(
                    grant,
                    Err(ClientError::Node {
                        code: ErrorCode::Busy,
                        ..
                    })
                )
            {
                asked += 1;
                *grant = source.grant(key, &audience).await;
            }
            if let (Some(listed), Ok(granted)) = (expect_hash, &*grant)
                && granted.content_hash != listed
            {
                let _ = source.release(&granted.token, &audience).await;
                *grant = Err(ClientError::NotTheListedVersion {
                    key: key.clone(),
                    listed: listed.to_string(),
                    granted: granted.content_hash.clone(),
                });
            }
        }
        for grant in grants.iter().flatten() {
            target
                .conn
                .write_request(&pull_request(
                    source_addr,
                    grant,
                    dst_device,
                    dst_name,
                    overwrite,
                ))
                .await?;
        }
        for grant in grants {
            let grant = match grant {
                Ok(grant) => grant,
                Err(e) => {
                    results.push(Err(e));
                    continue;
                }
            };
            let stored = target.read_stored().await?;
            // A pull that failed leaves its capability unused (or used: then the source says
            // so, and that is fine): given back, so that it does not count against this
            // client's outstanding grants until it lapses.
            if stored.is_err() {
                let _ = source.release(&grant.token, &audience).await;
            }
            // A target that already held the bytes never fetched: use the capability up here
            // rather than leave it to lapse.
            if matches!(&stored, Ok(info) if was_dedup(info))
                && let Err(e) = source.release(&grant.token, &audience).await
            {
                results.push(Err(e));
                continue;
            }
            // A move deletes the version it copied, and only that one: a newer version written
            // to the source meanwhile stays, and the move says so.
            if let (Ok(info), true) = (&stored, remove_source) {
                match source.delete_if(&grant.info.key, &grant.content_hash).await {
                    Ok(_) => {}
                    Err(ClientError::Node {
                        code: ErrorCode::Changed,
                        ..
                    }) => {
                        results.push(Err(ClientError::SourceChanged {
                            key: grant.info.key.clone(),
                            stored: Box::new(info.clone()),
                        }));
                        continue;
                    }
                    Err(e) => {
                        results.push(Err(e));
                        continue;
                    }
                }
            }
            results.push(stored);
        }
    }
    Ok(results)
}

impl Client {
    /// The node's id (what a capability is bound to).
    pub async fn identify(&mut self) -> Result<String, ClientError> {
        self.exchange(&Request::Identify, |answer| match answer {
            Response::Identity { node_id } => Ok(node_id),
            other => Err(unexpected(other)),
        })
        .await
    }

    /// Asks this (source) node for a single-use capability that lets the node `audience` pull
    /// the tensor under `key`.
    pub async fn grant(&mut self, key: &TensorKey, audience: &str) -> Result<Grant, ClientError> {
        let request = Request::Grant {
            key: key.clone(),
            audience: audience.to_string(),
        };
        self.exchange(&request, grant_from).await
    }

    /// Asks this (target) node to pull `grant`'s tensor from the node at `source` and register
    /// it on `dst_device`. Answered once the target registered it; the bytes never pass
    /// through this client.
    pub async fn pull(
        &mut self,
        source: &str,
        grant: &Grant,
        dst_device: u32,
        dst_name: Option<&str>,
        overwrite: bool,
    ) -> Result<TensorInfo, ClientError> {
        let request = pull_request(source, grant, dst_device, dst_name, overwrite);
        self.exchange(&request, super::stored).await
    }

    /// Gives back a capability this connection was granted and no node fetched (or, node to
    /// node, tells the source that every byte arrived), which uses it up.
    pub async fn release(&mut self, capability: &str, node_id: &str) -> Result<(), ClientError> {
        let request = Request::Release {
            capability: capability.to_string(),
            node_id: node_id.to_string(),
        };
        self.exchange(&request, |answer| match answer {
            Response::Released => Ok(()),
            other => Err(unexpected(other)),
        })
        .await
    }
}
