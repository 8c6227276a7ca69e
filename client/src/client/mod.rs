//! `Client`: the async Rust API to a ferry node. Here: connecting, the exchange every call runs
//! (one request, its answer, and the bookkeeping that keeps answers in step), and the calls on
//! one node (put, get, copy, move, delete, list, stat). Batches are in `batch`, node-to-node
//! calls in `node_copy`, errors in `error`.

mod batch;
mod error;
mod node_copy;

pub use error::ClientError;
pub use node_copy::{Grant, NodeCopy, copy_between};

use burn_std::Bytes;
use error::unexpected;
use ferry_io::connection::{Connection, ConnectionError, ConnectionLimits};
use ferry_io::handshake;
use ferry_io::transport::{Endpoint, Stream};
use ferry_io::{ClientTls, TensorAssembler};
use ferry_proto::{
    DType, NodeStats, PROTOCOL_MINOR, ProtoError, Request, Response, TensorData, TensorInfo,
    TensorKey, TensorMeta, Welcome, WireMeta,
};

/// One probe a device ran at start ([`Client::holds`]).
#[derive(Debug, Clone, PartialEq)]
pub struct HeldProbe {
    /// The dtype (a quantized one stands for its scheme with any block size).
    pub dtype: DType,
    /// The shape, standing for its class: rank 0, an empty dimension, whole 32-bit words, or any
    /// other (see `ferry_server::holds::ShapeClass`).
    pub shape: Vec<usize>,
    /// Why the device does not give it back bit-exact; `None` where it does.
    pub refused: Option<String>,
}

/// How many tensors [`Client::list`] asks for per page.
const LIST_PAGE: u32 = 4096;

/// The software name the client reports.
pub const AGENT: &str = concat!("ferry-client/", env!("CARGO_PKG_VERSION"));

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
    /// Mutual TLS to nodes over TCP: the CA the node's certificate must chain to, and the
    /// client's own certificate; `None` for TCP in clear. Unix sockets never take it.
    pub tls: Option<ClientTls>,
    /// The identity the node's certificate must carry (its node id, as a cluster member
    /// registered it), checked before anything is sent, the token included; `None` for any
    /// certificate the CA signed for the address. Over TCP it needs `tls`; over a Unix socket
    /// there is no certificate, and the socket must then be served by this very user (root not
    /// counted), before anything is sent.
    pub identity: Option<String>,
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

/// A node's answer that a tensor was registered (an upload, a copy, a pull).
fn stored(answer: Response) -> Result<TensorInfo, ClientError> {
    match answer {
        Response::Stored(info) => Ok(info),
        other => Err(unexpected(other)),
    }
}

/// A node's answer that a tensor was deleted.
fn deleted(answer: Response) -> Result<TensorInfo, ClientError> {
    match answer {
        Response::Deleted(info) => Ok(info),
        other => Err(unexpected(other)),
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
        let socket = addr
            .into()
            .connect(config.tls.as_ref())
            .await
            .map_err(ConnectionError::from)?;
        if let Some(expected) = &config.identity {
            socket.require_own_user().map_err(ConnectionError::from)?;
            let unix = matches!(socket, ferry_io::transport::Stream::Unix(_));
            let certified = socket.peer_identity().map(|id| id.as_str().to_string());
            if !unix && certified.as_deref() != Some(expected.as_str()) {
                return Err(ClientError::NotTheNode {
                    expected: expected.clone(),
                    certified,
                });
            }
        }
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

    /// One request and its one answer, as an exchange ([`begin`](Self::begin) /
    /// [`end`](Self::end)): `answer` turns the node's answer into the call's result (an answer
    /// of another kind into [`unexpected`]).
    async fn exchange<T>(
        &mut self,
        request: &Request,
        answer: impl FnOnce(Response) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        self.exchange_read(request, |read| answer(read?)).await
    }

    /// [`exchange`](Self::exchange) for a call that judges a failed read of the answer itself.
    async fn exchange_read<T>(
        &mut self,
        request: &Request,
        answer: impl FnOnce(Result<Response, ConnectionError>) -> Result<T, ClientError>,
    ) -> Result<T, ClientError> {
        self.begin()?;
        let result = async {
            self.conn.write_request(request).await?;
            answer(self.conn.read_response().await)
        }
        .await;
        self.end(result)
    }

    /// A node's answer to an upload or a pull, one of several in flight: registered, or
    /// refused. `Err` only for an answer that breaks the exchange.
    async fn read_stored(&mut self) -> Result<Result<TensorInfo, ClientError>, ClientError> {
        match self.conn.read_response().await? {
            Response::Stored(info) => Ok(Ok(info)),
            Response::Error(reply) => Ok(Err(reply.into())),
            other => Err(unexpected(other)),
        }
    }

    /// Reads the payload of a tensor the node announced as `wire`, checked against it. A node
    /// that announces a tensor and then sends a bad description or bytes has broken the stream:
    /// that fails the whole connection.
    ///
    /// `buffer_for` may give the memory to receive into once the description is checked (see
    /// [`get_batch_into`](Self::get_batch_into)); new memory otherwise.
    async fn read_tensor_payload(
        &mut self,
        wire: &WireMeta,
        buffer_for: impl FnOnce(&TensorMeta) -> Option<Bytes>,
    ) -> Result<TensorData, ClientError> {
        let meta = TensorMeta::try_from(wire).map_err(ProtoError::from)?;
        // The limit holds whoever's buffer it is.
        let given = (meta.byte_len() as u64 <= self.max_tensor_bytes)
            .then(|| buffer_for(&meta))
            .flatten()
            .map(|buf| TensorAssembler::into_buffer(meta.clone(), buf));
        let mut assembler = match given {
            Some(Ok(assembler)) => assembler,
            // A buffer of the wrong length is dropped: the payload goes to new memory.
            Some(Err(_)) | None => {
                TensorAssembler::new(meta, self.max_tensor_bytes).map_err(ProtoError::from)?
            }
        };
        self.conn.read_payload(&mut assembler).await?;
        Ok(assembler.finish()?)
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
            stored(self.conn.read_response().await?)
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
            Ok((info, self.read_tensor_payload(&wire, |_| None).await?))
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
        let request = Request::Copy {
            src: src.clone(),
            dst_device,
            dst_name: dst_name.map(str::to_string),
            remove_source,
            overwrite,
        };
        self.exchange(&request, stored).await
    }

    /// Deletes the tensor under `key`.
    pub async fn delete(&mut self, key: &TensorKey) -> Result<TensorInfo, ClientError> {
        self.exchange(&Request::Delete { key: key.clone() }, deleted)
            .await
    }

    /// Deletes the tensor under `key` only if it is still the version whose content hash is
    /// `content_hash`; a node that holds another version answers
    /// [`ErrorCode::Changed`](ferry_proto::ErrorCode::Changed) and deletes nothing.
    pub async fn delete_if(
        &mut self,
        key: &TensorKey,
        content_hash: &str,
    ) -> Result<TensorInfo, ClientError> {
        let request = Request::DeleteIf {
            key: key.clone(),
            content_hash: content_hash.to_string(),
        };
        self.exchange(&request, deleted).await
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
        let request = Request::ListPage {
            device,
            after,
            limit,
        };
        self.exchange(&request, |answer| match answer {
            Response::Page { tensors, next } => Ok((tensors, next)),
            other => Err(unexpected(other)),
        })
        .await
    }

    /// What device `device` measured at start that it stores bit-exact: every dtype it probed
    /// (a quantized one stands for its scheme with any block size) on each class of shape (rank
    /// 0, an empty dimension, whole 32-bit words, any other), each with why not where it does
    /// not.
    pub async fn holds(&mut self, device: u32) -> Result<Vec<HeldProbe>, ClientError> {
        const NEEDS: u16 = 5;
        if self.welcome.minor < NEEDS {
            return Err(ClientError::NodeTooOld {
                what: "a device's measured holds table",
                node: self.welcome.minor,
                needs: NEEDS,
            });
        }
        let dtypes = self
            .exchange(&Request::Holds { device }, |answer| match answer {
                Response::Holds { device: d, dtypes } if d == device => Ok(dtypes),
                other => Err(unexpected(other)),
            })
            .await?;
        dtypes
            .into_iter()
            .map(|held| {
                let dtype = DType::try_from(&held.dtype).map_err(|e| {
                    ClientError::Unexpected(format!("the node named an unknown dtype: {e}"))
                })?;
                let shape = held
                    .shape
                    .iter()
                    .map(|&d| usize::try_from(d))
                    .collect::<Result<_, _>>()
                    .map_err(|_| ClientError::Unexpected("a probe shape past usize".into()))?;
                Ok(HeldProbe {
                    dtype,
                    shape,
                    refused: held.refused,
                })
            })
            .collect()
    }

    /// The listing of a node older than minor 3, in one answer.
    async fn list_whole(&mut self, device: Option<u32>) -> Result<Vec<TensorInfo>, ClientError> {
        self.exchange(&Request::List { device }, |answer| match answer {
            Response::Listing(all) => Ok(all),
            other => Err(unexpected(other)),
        })
        .await
    }

    /// Node statistics.
    pub async fn stat(&mut self) -> Result<NodeStats, ClientError> {
        let node = self.welcome.minor;
        self.exchange_read(&Request::Stat, |read| match read {
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
        })
        .await
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
}
