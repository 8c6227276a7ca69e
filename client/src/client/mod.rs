//! `Client`: the async Rust API to a ferry node (put, get, copy, move, delete, list, stat).

use ferry_io::TensorAssembler;
use ferry_io::connection::{Connection, ConnectionError, ConnectionLimits};
use ferry_io::handshake::{self, HelloError};
use ferry_io::transport::{Endpoint, Stream};
use ferry_proto::{
    ErrorCode, ErrorReply, MetaError, NodeStats, PROTOCOL_MINOR, ProtoError, Request, Response,
    TensorData, TensorInfo, TensorKey, TensorMeta, Welcome,
};

/// How many downloads a batch keeps outstanding at once.
const PIPELINE_WINDOW: usize = 64;

/// How many capabilities a node-to-node batch asks for ahead of their pulls.
const GRANT_WINDOW: usize = 4;

/// How many tensors [`Client::list`] asks for per page.
const LIST_PAGE: u32 = 4096;

/// The software name the client reports.
pub const AGENT: &str = concat!("ferry-client/", env!("CARGO_PKG_VERSION"));

/// Why a client call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The connection failed or the node broke the protocol.
    #[error(transparent)]
    Connection(#[from] ConnectionError),
    /// The node refused or failed the request; `message` is the node's own.
    #[error("{code:?}: {message}")]
    Node {
        /// What kind of failure.
        code: ErrorCode,
        /// The node's message.
        message: String,
    },
    /// A tensor that cannot be sent as it is (its bytes disagree with its shape and dtype).
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// The node answered something that does not fit the request.
    #[error("unexpected answer from the node: {0}")]
    Unexpected(String),
    /// An earlier call on this connection ended in the middle of an exchange (a failure while
    /// reading an answer, or a cancelled future), so answers could be misattributed; connect
    /// again.
    #[error("the connection is out of step after an unfinished exchange; connect again")]
    OutOfStep,
    /// A Burn tensor could not be made from, or read into, the data (wrong rank or kind for the
    /// dtype, a device that cannot hold it).
    #[error("{0}")]
    Tensor(String),
    /// A move between nodes copied the tensor, but the source changed meanwhile (a newer
    /// version was written there), so the source was not deleted: both remain.
    #[error(
        "{key} was copied to the target as {}, but the source changed meanwhile, so it was \
         kept: both remain",
        stored.key
    )]
    SourceChanged {
        /// The source key.
        key: TensorKey,
        /// What the target registered.
        stored: Box<TensorInfo>,
    },
    /// The node's `stat` answer is of another protocol minor version, whose fields differ
    /// (PROTOCOL.md §8): the one answer that does not carry across minors.
    #[error(
        "the node speaks protocol minor {node}, this client minor {client}: its stat answer has \
         other fields ({cause}); use a client of the node's version"
    )]
    StatsOfAnotherMinor {
        /// The node's minor version.
        node: u16,
        /// This client's.
        client: u16,
        /// What failed to decode.
        cause: String,
    },
}

impl ClientError {
    /// The node's error code, when the node reported the failure.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Node { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<ErrorReply> for ClientError {
    fn from(reply: ErrorReply) -> Self {
        ClientError::Node {
            code: reply.code,
            message: reply.message,
        }
    }
}

impl From<HelloError> for ClientError {
    fn from(error: HelloError) -> Self {
        match error {
            HelloError::Connection(e) => ClientError::Connection(e),
            HelloError::Refused(reply) => reply.into(),
            HelloError::Unexpected(what) => ClientError::Unexpected(what),
        }
    }
}

impl From<ProtoError> for ClientError {
    fn from(e: ProtoError) -> Self {
        ClientError::Connection(ConnectionError::Proto(e))
    }
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
    } = *how;
    if dst_name.is_some() && keys.len() > 1 {
        return Err(ClientError::Unexpected(
            "a target name names one tensor; copy several under their own names".into(),
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
            grants.push(source.read_grant().await);
        }
        for grant in grants.iter().flatten() {
            target
                .write_pull(source_addr, grant, dst_device, dst_name, overwrite)
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
            let stored = match target.conn.read_response().await? {
                Response::Stored(info) => Ok(info),
                Response::Error(reply) => Err(reply.into()),
                other => return Err(unexpected(other)),
            };
            // A target that already held the bytes never fetched: use the capability up here
            // rather than leave it to lapse.
            if matches!(&stored, Ok(info) if info.path == "dedup")
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

/// How a client connects.
#[derive(Debug, Clone, Default)]
pub struct ClientConfig {
    /// The node's shared token, if it requires one.
    pub token: Option<String>,
    /// Frame, chunk and idle limits.
    pub limits: ConnectionLimits,
    /// The largest tensor the client accepts from a node, in bytes; `None` for no limit.
    pub max_tensor_bytes: Option<u64>,
    /// Never move payloads through shared memory, even on a Unix socket to a node that offers it.
    pub disable_shared_memory: bool,
}

/// One connection to a node. Requests on it run one at a time.
#[derive(Debug)]
pub struct Client {
    conn: Connection<Stream>,
    welcome: Welcome,
    max_tensor_bytes: u64,
    /// An exchange started and did not finish (an error mid-answer, or a cancelled call): the
    /// next answer on the wire may belong to it, so the connection is not used again.
    out_of_step: bool,
}

fn unexpected(response: Response) -> ClientError {
    match response {
        Response::Error(reply) => reply.into(),
        other => ClientError::Unexpected(format!("{other:?}")),
    }
}

impl Client {
    /// Connects to the node at `addr` (`HOST:PORT`, `unix:PATH`, a `SocketAddr` or an
    /// [`Endpoint`]) and says hello, with `token` if given.
    pub async fn connect(
        addr: impl Into<Endpoint>,
        token: Option<&str>,
    ) -> Result<Self, ClientError> {
        let config = ClientConfig {
            token: token.map(str::to_string),
            ..ClientConfig::default()
        };
        Self::connect_with(addr, config).await
    }

    /// Connects with a full configuration.
    pub async fn connect_with(
        addr: impl Into<Endpoint>,
        config: ClientConfig,
    ) -> Result<Self, ClientError> {
        let socket = addr.into().connect().await.map_err(ConnectionError::from)?;
        let mut conn = Connection::new(socket, config.limits);
        let offer = handshake::Offer {
            token: config.token.as_deref(),
            agent: AGENT,
            shared_memory: !config.disable_shared_memory,
        };
        let welcome = handshake::hello(&mut conn, offer).await?;
        Ok(Self {
            conn,
            welcome,
            max_tensor_bytes: config.max_tensor_bytes.unwrap_or(u64::MAX),
            out_of_step: false,
        })
    }

    /// Whether payloads on this connection travel through shared memory (a Unix socket to a node
    /// that agreed to it).
    pub fn shared_memory(&self) -> bool {
        self.conn.shared_memory()
    }

    /// Starts an exchange, unless an earlier one was left unfinished.
    fn begin(&mut self) -> Result<(), ClientError> {
        if self.out_of_step {
            return Err(ClientError::OutOfStep);
        }
        self.out_of_step = true;
        Ok(())
    }

    /// Ends an exchange: it finished if it succeeded or the node answered with an error.
    fn end<T>(&mut self, result: Result<T, ClientError>) -> Result<T, ClientError> {
        if matches!(&result, Ok(_) | Err(ClientError::Node { .. })) {
            self.out_of_step = false;
        }
        result
    }

    /// What the node said when the connection opened.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// Uploads `data` to `device` under `name`; refused if the name is taken.
    pub async fn put(
        &mut self,
        device: u32,
        name: &str,
        data: &TensorData,
    ) -> Result<TensorInfo, ClientError> {
        self.put_with(device, Some(name), data, false).await
    }

    /// Uploads `data` to `device`, under `name` or a node-chosen one, replacing a tensor of that
    /// name if `overwrite`. Answered once the node registered it.
    pub async fn put_with(
        &mut self,
        device: u32,
        name: Option<&str>,
        data: &TensorData,
        overwrite: bool,
    ) -> Result<TensorInfo, ClientError> {
        // Checked before anything is sent: a tensor that cannot go leaves the connection as is.
        let meta = ferry_proto::tensor::meta_of(data)?;
        self.begin()?;
        let result = async {
            self.conn
                .write_request(&Request::Put {
                    device,
                    name: name.map(str::to_string),
                    meta: meta.to_wire(),
                    overwrite,
                })
                .await?;
            match self.conn.read_response().await? {
                Response::Ready => {}
                other => return Err(unexpected(other)),
            }
            self.conn.write_payload(data.as_bytes()).await?;
            match self.conn.read_response().await? {
                Response::Stored(info) => Ok(info),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }

    /// Downloads the tensor under `key`, bit-exact, its dtype and shape checked.
    pub async fn get(&mut self, key: &TensorKey) -> Result<TensorData, ClientError> {
        self.get_with_info(key).await.map(|(_, data)| data)
    }

    /// Downloads the tensor under `key` with the node's description of it.
    pub async fn get_with_info(
        &mut self,
        key: &TensorKey,
    ) -> Result<(TensorInfo, TensorData), ClientError> {
        self.begin()?;
        let result = async {
            self.conn
                .write_request(&Request::Get { key: key.clone() })
                .await?;
            let (info, wire) = match self.conn.read_response().await? {
                Response::Tensor { info, meta } => (info, meta),
                other => return Err(unexpected(other)),
            };
            let meta = TensorMeta::try_from(&wire).map_err(ProtoError::from)?;
            let mut assembler =
                TensorAssembler::new(meta, self.max_tensor_bytes).map_err(ProtoError::from)?;
            self.conn.read_payload(&mut assembler).await?;
            Ok((info, assembler.finish()?))
        }
        .await;
        self.end(result)
    }

    /// Copies the tensor under `src` to `dst_device` of the same node, under `dst_name` or its
    /// own name. Answered once the target registered it.
    pub async fn copy(
        &mut self,
        src: &TensorKey,
        dst_device: u32,
        dst_name: Option<&str>,
    ) -> Result<TensorInfo, ClientError> {
        self.transfer(src, dst_device, dst_name, false, false).await
    }

    /// Moves the tensor under `src` to `dst_device`: the source is deleted only after the target
    /// registered the tensor.
    pub async fn move_to(
        &mut self,
        src: &TensorKey,
        dst_device: u32,
        dst_name: Option<&str>,
    ) -> Result<TensorInfo, ClientError> {
        self.transfer(src, dst_device, dst_name, true, false).await
    }

    /// Copies or moves with every option.
    pub async fn transfer(
        &mut self,
        src: &TensorKey,
        dst_device: u32,
        dst_name: Option<&str>,
        remove_source: bool,
        overwrite: bool,
    ) -> Result<TensorInfo, ClientError> {
        self.begin()?;
        let result = async {
            self.conn
                .write_request(&Request::Copy {
                    src: src.clone(),
                    dst_device,
                    dst_name: dst_name.map(str::to_string),
                    remove_source,
                    overwrite,
                })
                .await?;
            match self.conn.read_response().await? {
                Response::Stored(info) => Ok(info),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }

    /// Deletes the tensor under `key`.
    pub async fn delete(&mut self, key: &TensorKey) -> Result<TensorInfo, ClientError> {
        self.begin()?;
        let result = async {
            self.conn
                .write_request(&Request::Delete { key: key.clone() })
                .await?;
            match self.conn.read_response().await? {
                Response::Deleted(info) => Ok(info),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }

    /// Deletes the tensor under `key` only if it is still the version whose content hash is
    /// `content_hash`; a node that holds another version answers [`ErrorCode::Changed`] and
    /// deletes nothing.
    pub async fn delete_if(
        &mut self,
        key: &TensorKey,
        content_hash: &str,
    ) -> Result<TensorInfo, ClientError> {
        self.begin()?;
        let result = async {
            self.conn
                .write_request(&Request::DeleteIf {
                    key: key.clone(),
                    content_hash: content_hash.to_string(),
                })
                .await?;
            match self.conn.read_response().await? {
                Response::Deleted(info) => Ok(info),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }

    /// The tensors on `device`, or on every device, sorted by device and name: read a page at
    /// a time, so any number of them can be listed.
    pub async fn list(&mut self, device: Option<u32>) -> Result<Vec<TensorInfo>, ClientError> {
        if self.welcome.minor < 3 {
            return self.list_whole(device).await;
        }
        let mut all = Vec::new();
        let mut after = None;
        loop {
            let (page, next) = self.list_page(device, after, LIST_PAGE).await?;
            all.extend(page);
            match next {
                Some(next) => after = Some(next),
                None => return Ok(all),
            }
        }
    }

    /// One page of [`list`](Self::list): at most `limit` tensors (the node may send fewer)
    /// after the key `after`, and where the next page starts (`None` after the last).
    pub async fn list_page(
        &mut self,
        device: Option<u32>,
        after: Option<TensorKey>,
        limit: u32,
    ) -> Result<(Vec<TensorInfo>, Option<TensorKey>), ClientError> {
        self.begin()?;
        let result = async {
            self.conn
                .write_request(&Request::ListPage {
                    device,
                    after,
                    limit,
                })
                .await?;
            match self.conn.read_response().await? {
                Response::Page { tensors, next } => Ok((tensors, next)),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }

    /// The listing of a node older than minor 3, in one answer.
    async fn list_whole(&mut self, device: Option<u32>) -> Result<Vec<TensorInfo>, ClientError> {
        self.begin()?;
        let result = async {
            self.conn.write_request(&Request::List { device }).await?;
            match self.conn.read_response().await? {
                Response::Listing(all) => Ok(all),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }

    /// Node statistics.
    pub async fn stat(&mut self) -> Result<NodeStats, ClientError> {
        self.begin()?;
        let result = async {
            self.conn.write_request(&Request::Stat).await?;
            let node = self.welcome.minor;
            match self.conn.read_response().await {
                Ok(Response::Stats(stats)) => Ok(stats),
                Ok(other) => Err(unexpected(other)),
                Err(ConnectionError::Proto(cause)) if node != PROTOCOL_MINOR => {
                    Err(ClientError::StatsOfAnotherMinor {
                        node,
                        client: PROTOCOL_MINOR,
                        cause: cause.to_string(),
                    })
                }
                Err(error) => Err(error.into()),
            }
        }
        .await;
        self.end(result)
    }

    /// Uploads many tensors to `device` in one pipelined exchange (a whole model's weights): the
    /// next upload starts while the node registers the previous one. One answer per tensor, in
    /// order; a refused tensor does not stop the others. `Err` only when the connection fails.
    pub async fn put_batch(
        &mut self,
        device: u32,
        tensors: &[(String, TensorData)],
        overwrite: bool,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        self.begin()?;
        let result = async {
            let mut results: Vec<Option<Result<TensorInfo, ClientError>>> =
                (0..tensors.len()).map(|_| None).collect();
            // The upload whose `Stored` (or error) the node still owes.
            let mut owed: Option<usize> = None;
            for (i, (name, data)) in tensors.iter().enumerate() {
                let meta = match ferry_proto::tensor::meta_of(data) {
                    Ok(meta) => meta,
                    Err(e) => {
                        results[i] = Some(Err(e.into()));
                        continue;
                    }
                };
                self.conn
                    .write_request(&Request::Put {
                        device,
                        name: Some(name.clone()),
                        meta: meta.to_wire(),
                        overwrite,
                    })
                    .await?;
                if let Some(prev) = owed.take() {
                    results[prev] = Some(self.read_stored().await?);
                }
                match self.conn.read_response().await? {
                    Response::Ready => {
                        self.conn.write_payload(data.as_bytes()).await?;
                        owed = Some(i);
                    }
                    Response::Error(reply) => results[i] = Some(Err(reply.into())),
                    other => return Err(unexpected(other)),
                }
            }
            if let Some(prev) = owed {
                results[prev] = Some(self.read_stored().await?);
            }
            Ok(results
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(ClientError::Unexpected("no answer".into()))))
                .collect())
        }
        .await;
        self.end(result)
    }

    /// A node's answer to an upload: registered, or refused.
    async fn read_stored(&mut self) -> Result<Result<TensorInfo, ClientError>, ClientError> {
        match self.conn.read_response().await? {
            Response::Stored(info) => Ok(Ok(info)),
            Response::Error(reply) => Ok(Err(reply.into())),
            other => Err(unexpected(other)),
        }
    }

    /// Downloads many tensors in one pipelined exchange: every request is sent before the first
    /// answer is read. One answer per key, in order.
    pub async fn get_batch(
        &mut self,
        keys: &[TensorKey],
    ) -> Result<Vec<Result<TensorData, ClientError>>, ClientError> {
        self.begin()?;
        let result = async {
            let mut results = Vec::with_capacity(keys.len());
            // Requests go out in windows so that a huge batch never has more than this many
            // answers outstanding.
            for window in keys.chunks(PIPELINE_WINDOW) {
                for key in window {
                    self.conn
                        .write_request(&Request::Get { key: key.clone() })
                        .await?;
                }
                for _ in window {
                    results.push(self.read_tensor().await?);
                }
            }
            Ok(results)
        }
        .await;
        self.end(result)
    }

    /// A node's answer to a download: the tensor, or an error.
    async fn read_tensor(&mut self) -> Result<Result<TensorData, ClientError>, ClientError> {
        let wire = match self.conn.read_response().await? {
            Response::Tensor { meta, .. } => meta,
            Response::Error(reply) => return Ok(Err(reply.into())),
            other => return Err(unexpected(other)),
        };
        // A node that announces a tensor and then sends a bad description or bytes has broken
        // the stream: that fails the whole connection.
        let meta = TensorMeta::try_from(&wire).map_err(ProtoError::from)?;
        let mut assembler =
            TensorAssembler::new(meta, self.max_tensor_bytes).map_err(ProtoError::from)?;
        self.conn.read_payload(&mut assembler).await?;
        Ok(Ok(assembler.finish()?))
    }

    /// Uploads a Burn tensor (quantized ones included) to `device` under `name`.
    pub async fn put_tensor<const D: usize, K: burn_tensor::kind::Basic>(
        &mut self,
        device: u32,
        name: &str,
        tensor: burn_tensor::Tensor<D, K>,
    ) -> Result<TensorInfo, ClientError> {
        let data = crate::tensor::into_data(tensor)?;
        self.put(device, name, &data).await
    }

    /// Downloads the tensor under `key` as a Burn tensor on `device`, with its own dtype
    /// (quantized ones stay quantized, scheme and scales unchanged).
    pub async fn get_tensor<const D: usize, K: burn_tensor::kind::Basic + 'static>(
        &mut self,
        key: &TensorKey,
        device: &burn_tensor::Device,
    ) -> Result<burn_tensor::Tensor<D, K>, ClientError> {
        let data = self.get(key).await?;
        crate::tensor::from_data(data, device)
    }

    /// The node's id (what a capability is bound to).
    pub async fn identify(&mut self) -> Result<String, ClientError> {
        self.begin()?;
        let result = async {
            self.conn.write_request(&Request::Identify).await?;
            match self.conn.read_response().await? {
                Response::Identity { node_id } => Ok(node_id),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }

    /// Asks this (source) node for a single-use capability that lets the node `audience` pull
    /// the tensor under `key`.
    pub async fn grant(&mut self, key: &TensorKey, audience: &str) -> Result<Grant, ClientError> {
        self.begin()?;
        let result = async {
            self.conn
                .write_request(&Request::Grant {
                    key: key.clone(),
                    audience: audience.to_string(),
                })
                .await?;
            self.read_grant().await
        }
        .await;
        self.end(result)
    }

    async fn read_grant(&mut self) -> Result<Grant, ClientError> {
        match self.conn.read_response().await? {
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
        self.begin()?;
        let result = async {
            self.write_pull(source, grant, dst_device, dst_name, overwrite)
                .await?;
            match self.conn.read_response().await? {
                Response::Stored(info) => Ok(info),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }

    async fn write_pull(
        &mut self,
        source: &str,
        grant: &Grant,
        dst_device: u32,
        dst_name: Option<&str>,
        overwrite: bool,
    ) -> Result<(), ClientError> {
        self.conn
            .write_request(&Request::Pull {
                source: source.to_string(),
                capability: grant.token.clone(),
                src: grant.info.key.clone(),
                dst_device,
                dst_name: dst_name.map(str::to_string),
                overwrite,
                content_hash: Some(grant.content_hash.clone()),
            })
            .await?;
        Ok(())
    }

    /// Gives back a capability this connection was granted and no node fetched (or, node to
    /// node, tells the source that every byte arrived), which uses it up.
    pub async fn release(&mut self, capability: &str, node_id: &str) -> Result<(), ClientError> {
        self.begin()?;
        let result = async {
            self.conn
                .write_request(&Request::Release {
                    capability: capability.to_string(),
                    node_id: node_id.to_string(),
                })
                .await?;
            match self.conn.read_response().await? {
                Response::Released => Ok(()),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }
}
