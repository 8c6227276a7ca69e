//! `Client`: the async Rust API to a ferry node. Here: the client over its connection and the
//! calls on one node (get, copy, move, delete, list, stat). Every call runs through the exchange
//! layer's step guard (`ferry_io::exchange`), so a call that fails or is cancelled half-way
//! leaves the connection refusing further calls ([`ClientError::OutOfStep`]) rather than reading
//! another call's answer. Opening is in `connect`, uploads (the `put` builders) in `put`,
//! pipelined batches in `batch` (a batch of uploads over several connections in `put_lanes`),
//! node-to-node copies in `node_copy` (over several pairs of connections at once in `lanes`, to
//! several targets relayed along a chain in `relay`), errors in `error`.

mod batch;
mod connect;
mod deal;
mod error;
mod lanes;
mod model;
mod model_copy;
mod node_copy;
mod put;
mod put_ask;
mod put_lanes;
mod relay;
mod wait;

pub use connect::{Connect, ConnectOptions};
pub use error::{ClientError, InterruptedCopy};
pub use lanes::Lane;
pub use model_copy::ModelCopy;
pub use node_copy::{IssuedCapability, NodeCopy};
pub use put::{Payload, Put, PutBatch, PutBatchInLanes, PutTo, TensorParts, Upload};
pub use relay::RelayTarget;

use burn_std::Bytes;
use ferry_io::{
    BufferFrom, Endpoint, Exchange, HashUse, Purpose, RegionUse, Step, TensorAssembler,
};
use ferry_proto::{
    ContentHash, DType, IfExists, NodeStats, ProtoError, Request, Response, TensorData, TensorInfo,
    TensorKey, TensorMeta, Transfer, Welcome, WireMeta,
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

/// One connection to a node. Calls on it run one at a time.
#[derive(Debug)]
pub struct Client {
    exchange: Exchange,
    max_tensor_bytes: u64,
    /// Where it is connected, for errors that name the node.
    endpoint: Endpoint,
}

/// The answer that a tensor was registered (an upload, a copy, a pull).
fn stored(answer: Response) -> Option<TensorInfo> {
    match answer {
        Response::Stored(info) => Some(info),
        _ => None,
    }
}

/// The answer that a tensor was deleted.
fn deleted(answer: Response) -> Option<TensorInfo> {
    match answer {
        Response::Deleted(info) => Some(info),
        _ => None,
    }
}

/// The answer that a payload may follow.
fn ready(answer: Response) -> Option<()> {
    match answer {
        Response::Ready => Some(()),
        _ => None,
    }
}

/// The answer that a tensor's payload follows.
fn tensor_follows(answer: Response) -> Option<(TensorInfo, WireMeta)> {
    match answer {
        Response::Tensor { info, meta } => Some((info, meta)),
        _ => None,
    }
}

impl Client {
    /// Starts opening a connection to the node at `addr` (`HOST:PORT`, `unix:PATH`, a
    /// `SocketAddr` or an [`Endpoint`]): set what differs from the defaults, then `.await`.
    pub fn connect(addr: impl Into<Endpoint>) -> Connect {
        ConnectOptions::default().to(addr)
    }

    /// A client over an open exchange.
    fn over(exchange: Exchange, max_tensor_bytes: u64, endpoint: Endpoint) -> Self {
        Self {
            exchange,
            max_tensor_bytes,
            endpoint,
        }
    }

    /// The address this client connected to (the node's, as it was reached).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// What the node said when the connection opened.
    pub fn welcome(&self) -> &Welcome {
        self.exchange.welcome()
    }

    /// Whether payloads on this connection travel through shared memory (a Unix socket to a node
    /// that agreed to it).
    pub fn shared_memory(&self) -> bool {
        self.exchange.shared_memory()
    }

    /// Whether every call so far finished, so that the connection takes another.
    pub fn in_step(&self) -> bool {
        self.exchange.in_step()
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
        let max = self.max_tensor_bytes;
        let mut step = self.exchange.begin()?;
        step.send(&Request::Get { key: key.clone() }).await?;
        let (info, wire) = match step.answer(tensor_follows).await {
            Ok(announced) => announced,
            Err(e) => return Err(step.fail(e).into()),
        };
        let data = read_tensor_payload(&mut step, max, &wire, |_| None).await?;
        step.finish();
        Ok((info, data))
    }

    /// Copies the tensor under `src` to `dst` on the same node. Answered once the target
    /// registered it.
    pub async fn copy(
        &mut self,
        src: &TensorKey,
        dst: &TensorKey,
    ) -> Result<TensorInfo, ClientError> {
        self.transfer(src, dst, Transfer::Copy, IfExists::Refuse)
            .await
    }

    /// Moves the tensor under `src` to `dst` on the same node: the source is deleted only after
    /// the target registered the tensor.
    pub async fn move_to(
        &mut self,
        src: &TensorKey,
        dst: &TensorKey,
    ) -> Result<TensorInfo, ClientError> {
        self.transfer(src, dst, Transfer::Move, IfExists::Refuse)
            .await
    }

    /// Copies or moves within the node, doing with a tensor already under `dst` what `if_exists`
    /// says.
    pub async fn transfer(
        &mut self,
        src: &TensorKey,
        dst: &TensorKey,
        transfer: Transfer,
        if_exists: IfExists,
    ) -> Result<TensorInfo, ClientError> {
        let request = Request::Copy {
            src: src.clone(),
            dst_device: dst.device,
            dst_name: Some(dst.name.clone()),
            remove_source: transfer.removes_source(),
            overwrite: if_exists.overwrite(),
        };
        Ok(self.exchange.call(&request, stored).await?)
    }

    /// Deletes the tensor under `key`.
    pub async fn delete(&mut self, key: &TensorKey) -> Result<TensorInfo, ClientError> {
        let request = Request::Delete { key: key.clone() };
        Ok(self.exchange.call(&request, deleted).await?)
    }

    /// Deletes the tensor under `key` only if it is still the version whose content hash is
    /// `version`; a node that holds another version answers
    /// [`ErrorCode::Changed`](ferry_proto::ErrorCode::Changed) and deletes nothing.
    pub async fn delete_if(
        &mut self,
        key: &TensorKey,
        version: &ContentHash,
    ) -> Result<TensorInfo, ClientError> {
        let request = Request::DeleteIf {
            key: key.clone(),
            content_hash: *version,
        };
        Ok(self.exchange.call(&request, deleted).await?)
    }

    /// The tensors on `device`, or on every device, sorted by device and name: read a page at
    /// a time, so any number of them can be listed.
    pub async fn list(&mut self, device: Option<u32>) -> Result<Vec<TensorInfo>, ClientError> {
        if self.welcome().minor < 3 {
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
        let page = self
            .exchange
            .call(&request, |answer| match answer {
                Response::Page { tensors, next } => Some((tensors, next)),
                _ => None,
            })
            .await?;
        Ok(page)
    }

    /// The listing of a node older than minor 3, in one answer.
    async fn list_whole(&mut self, device: Option<u32>) -> Result<Vec<TensorInfo>, ClientError> {
        let request = Request::List { device };
        let all = self
            .exchange
            .call(&request, |answer| match answer {
                Response::Listing(all) => Some(all),
                _ => None,
            })
            .await?;
        Ok(all)
    }

    /// What device `device` measured at start that it stores bit-exact: every dtype it probed
    /// (a quantized one stands for its scheme with any block size) on each class of shape (rank
    /// 0, an empty dimension, whole 32-bit words, any other), each with why not where it does
    /// not.
    pub async fn holds(&mut self, device: u32) -> Result<Vec<HeldProbe>, ClientError> {
        let dtypes = self
            .exchange
            .call(&Request::Holds { device }, |answer| match answer {
                Response::Holds { device: d, dtypes } if d == device => Some(dtypes),
                _ => None,
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

    /// Node statistics (a node of an older minor answers them too: the fields it lacks read as
    /// zero or none).
    pub async fn stat(&mut self) -> Result<NodeStats, ClientError> {
        let stats = self
            .exchange
            .call(&Request::Stat, |answer| match answer {
                Response::Stats(stats) => Some(stats),
                _ => None,
            })
            .await?;
        Ok(stats)
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

/// Reads the payload of a tensor the node announced as `wire`, checked against it and against
/// `max` bytes. A node that announces a tensor and then sends a bad description or bytes has
/// broken the stream: that fails the whole connection (the step is not finished).
///
/// `buffer_for` may give the memory to receive into once the description is checked (see
/// [`Client::get_batch_into`]); new memory otherwise.
async fn read_tensor_payload(
    step: &mut Step<'_>,
    max: u64,
    wire: &WireMeta,
    buffer_for: impl FnOnce(&TensorMeta) -> Option<Bytes>,
) -> Result<TensorData, ClientError> {
    let meta = TensorMeta::try_from(wire).map_err(ProtoError::from)?;
    // The limit holds whoever's buffer it is; a buffer of the wrong length is dropped, and the
    // payload goes to new memory.
    let from = (meta.byte_len() as u64 <= max)
        .then(|| buffer_for(&meta))
        .flatten()
        .filter(|buf| buf.len() == meta.byte_len())
        .map_or(BufferFrom::Fresh, BufferFrom::Provided);
    let hash_use = HashUse::for_purpose(Purpose::Read);
    let mut assembler =
        TensorAssembler::new(meta, max, from, hash_use).map_err(ProtoError::from)?;
    step.read_payload(&mut assembler, RegionUse::Map).await?;
    Ok(assembler.finish()?.data)
}
