//! Uploads: [`Client::put`] (one tensor) and [`Client::put_batch`] (many, pipelined, over one
//! connection or several) and the builders they return; set what differs from the defaults, then
//! `.await` (or [`.wait()`](crate::Wait::wait) without a runtime).
//!
//! Why builders: an upload has one required input (what, and where) and a few options (what to
//! do with a tensor already under the key, how many connections to use). A method per
//! combination (`put_with`, `put_unnamed`, `put_tensor`, `put_batch_in_lanes`, ...) multiplies
//! with every new option, and each needed a blocking twin. A builder that is itself the call,
//! awaited through [`IntoFuture`] as hyper's and reqwest's requests are (and as
//! [`Connect`](super::Connect) is), keeps one entry point per shape of answer, makes the defaults
//! the short form (`client.put(&key, &data).await`), and lets the option that changes the
//! answer's shape ([`PutBatch::lanes`]: every tensor answered, none lost to one failed
//! connection, so no error for the whole) change the builder's type, so that the answer is typed
//! by what was asked. The builders borrow the client and the data, so nothing is copied, and
//! nothing is sent until the call is awaited (or [`.wait()`](crate::Wait::wait)ed): a builder
//! dropped unawaited leaves the connection as it was.

use std::pin::Pin;

use ferry_proto::{DType, IfExists, TensorData, TensorInfo, TensorKey, TensorMeta};

use super::put_ask::PutAsk;
use super::{Client, ClientError, ready, stored};

/// Where [`Client::put`] registers its tensor: under a key (`&TensorKey` converts), or on a
/// device under a name the node chooses and answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutTo<'k> {
    /// Under this key.
    Key(&'k TensorKey),
    /// On this device, under a name the node chooses (in the answer's key).
    Device(u32),
}

impl<'k> From<&'k TensorKey> for PutTo<'k> {
    fn from(key: &'k TensorKey) -> Self {
        PutTo::Key(key)
    }
}

/// What [`Client::put`] uploads: a `&TensorData` (sent from where it lies, never copied), a
/// Burn `Tensor` of any kind and dtype (quantized ones keep their scheme and scales), read into
/// host memory when the put is made, or bytes that lie in several slices
/// ([`Payload::from_parts`]).
#[derive(Debug)]
pub struct Payload<'d>(PayloadData<'d>);

/// A payload's bytes, or why a Burn tensor gave none.
#[derive(Debug)]
enum PayloadData<'d> {
    /// The caller's.
    Borrowed(&'d TensorData),
    /// Read off a Burn tensor.
    Owned(TensorData),
    /// The caller's, in slices sent end to end.
    Parts(TensorParts<'d>),
    /// A Burn tensor that could not be read.
    Unreadable(ClientError),
}

impl<'d> Payload<'d> {
    /// A tensor of `dtype` and `shape` whose bytes lie in `parts`, laid end to end (a quantized
    /// tensor's values and its scales, as a backend keeps them apart): sent from where they
    /// lie, never joined. Checked as a `TensorData` of theirs would be (the byte-length rule,
    /// the scales' encodings) before anything is sent; a put of parts that fail it is refused
    /// with that error. [`TensorParts`] is the same for [`Client::put_batch`].
    pub fn from_parts(shape: Vec<usize>, dtype: DType, parts: Vec<&'d [u8]>) -> Self {
        Payload::from(TensorParts::new(shape, dtype, parts))
    }
}

impl<'d> From<TensorParts<'d>> for Payload<'d> {
    fn from(parts: TensorParts<'d>) -> Self {
        Payload(PayloadData::Parts(parts))
    }
}

/// A tensor whose bytes lie in several slices, laid end to end (a quantized tensor's values and
/// its scales, as a backend keeps them apart), for [`Client::put_batch`]: uploaded from where
/// they lie, never joined, and checked as a `TensorData` of theirs would be before its request
/// goes (a tensor that fails is answered with that error; the batch goes on).
#[derive(Clone)]
pub struct TensorParts<'d> {
    shape: Vec<usize>,
    dtype: DType,
    parts: Vec<&'d [u8]>,
}

impl<'d> TensorParts<'d> {
    /// The tensor of `dtype` and `shape` whose bytes are `parts`, end to end.
    pub fn new(shape: Vec<usize>, dtype: DType, parts: Vec<&'d [u8]>) -> Self {
        Self {
            shape,
            dtype,
            parts,
        }
    }
}

impl std::fmt::Debug for TensorParts<'_> {
    // Lengths, not bytes: a payload's Debug is no dump of a model.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorParts")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .field(
                "lens",
                &self.parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// What an upload of a batch needs of each tensor, out of reach outside the crate (the
/// trait that seals [`Upload`]).
pub(super) mod sealed {
    use ferry_proto::{TensorData, TensorMeta};

    use super::{ClientError, TensorParts};

    pub trait Sealed {
        /// The checked meta and the slices the payload lies in, end to end.
        fn checked(&self) -> Result<(TensorMeta, Vec<&[u8]>), ClientError>;
    }

    impl Sealed for TensorData {
        fn checked(&self) -> Result<(TensorMeta, Vec<&[u8]>), ClientError> {
            Ok((ferry_proto::tensor::meta_of(self)?, vec![self.as_bytes()]))
        }
    }

    impl Sealed for TensorParts<'_> {
        fn checked(&self) -> Result<(TensorMeta, Vec<&[u8]>), ClientError> {
            let meta =
                ferry_proto::tensor::meta_of_parts(self.shape.clone(), self.dtype, &self.parts)?;
            Ok((meta, self.parts.clone()))
        }
    }
}

/// What [`Client::put_batch`] uploads: a `TensorData`, or a [`TensorParts`]. Sealed.
pub trait Upload: sealed::Sealed + Sync {}

impl Upload for TensorData {}

impl Upload for TensorParts<'_> {}

impl<'d> From<&'d TensorData> for Payload<'d> {
    fn from(data: &'d TensorData) -> Self {
        Payload(PayloadData::Borrowed(data))
    }
}

impl<const D: usize, K: burn_tensor::kind::Basic> From<burn_tensor::Tensor<D, K>> for Payload<'_> {
    fn from(tensor: burn_tensor::Tensor<D, K>) -> Self {
        match crate::tensor::into_data(tensor) {
            Ok(data) => Payload(PayloadData::Owned(data)),
            Err(e) => Payload(PayloadData::Unreadable(e)),
        }
    }
}

impl Client {
    /// Starts an upload of `data` (a `&TensorData`, a Burn `Tensor`, or
    /// [`Payload::from_parts`]) to `to`
    /// (a `&TensorKey`, or [`PutTo::Device`] for a name the node chooses): refused if the key is
    /// taken unless [`if_exists`](Put::if_exists) says otherwise. Answered, once awaited, when the
    /// node registered the tensor.
    ///
    /// ```no_run
    /// # async fn run(client: &mut ferry_client::Client, data: &ferry_client::TensorData)
    /// # -> Result<(), ferry_client::ClientError> {
    /// use ferry_client::{IfExists, PutTo, TensorKey};
    /// let key = TensorKey::new(0, "encoder.w");
    /// client.put(&key, data).await?;
    /// client.put(&key, data).if_exists(IfExists::Replace).await?;
    /// let named = client.put(PutTo::Device(0), data).await?; // named.key: the node's choice
    /// # Ok(()) }
    /// ```
    pub fn put<'a>(
        &'a mut self,
        to: impl Into<PutTo<'a>>,
        data: impl Into<Payload<'a>>,
    ) -> Put<'a> {
        Put {
            client: self,
            to: to.into(),
            payload: data.into(),
            if_exists: IfExists::Refuse,
        }
    }

    /// Starts an upload of many tensors (`TensorData`s, or [`TensorParts`]) in one pipelined
    /// exchange (a whole model's weights): the next upload starts while the node registers the
    /// previous one. Awaited, it answers once per tensor, in order; a refused tensor does not
    /// stop the others; `Err` only when the connection fails. [`lanes`](PutBatch::lanes) spreads
    /// a batch of `TensorData`s over several connections.
    pub fn put_batch<'a, T: Upload>(
        &'a mut self,
        tensors: &'a [(TensorKey, T)],
    ) -> PutBatch<'a, T> {
        PutBatch {
            client: self,
            tensors,
            if_exists: IfExists::Refuse,
        }
    }

    /// One upload of a payload of `meta` (checked, as every caller checks it before anything is
    /// sent: a tensor that cannot go leaves the connection as is) lying in `parts`: request,
    /// `Ready`, payload, `Stored`; or, for a small payload, request and payload at once
    /// ([`PutAsk`]), then `Stored`.
    async fn upload(
        &mut self,
        device: u32,
        name: Option<&str>,
        meta: &TensorMeta,
        parts: &[&[u8]],
        if_exists: IfExists,
    ) -> Result<TensorInfo, ClientError> {
        let mut step = self.exchange.begin()?;
        let len = meta.byte_len();
        let ask = PutAsk::for_payload(step.node_minor(), len as u64, step.whole_payload_route(len));
        let request = ask.request(
            device,
            name.map(str::to_string),
            meta,
            if_exists.overwrite(),
        );
        step.send(&request).await?;
        match ask {
            PutAsk::AfterReady => {
                // A refusal instead of `Ready` finishes the exchange: no payload follows it.
                if let Err(refused) = step.answer(ready).await {
                    return Err(step.fail(refused).into());
                }
                step.send_payload_parts(parts).await?;
            }
            // Refused or not, the node reads it before it answers.
            PutAsk::Eager => step.send_payload_chunks(parts).await?,
        }
        let answer = step.answer(stored).await;
        Ok(step.finish_if_answered(answer)?)
    }
}

/// One upload to make: by [`Client::put`], sent by `.await`.
#[derive(Debug)]
#[must_use = "a Put does nothing until it is awaited (or `.wait()`ed)"]
pub struct Put<'a> {
    client: &'a mut Client,
    to: PutTo<'a>,
    payload: Payload<'a>,
    if_exists: IfExists,
}

impl Put<'_> {
    /// What to do with a tensor already under the key ([`IfExists::Refuse`] by default). A put
    /// to [`PutTo::Device`] takes a new name, which nothing is under: it is always sent as
    /// `Refuse`.
    pub fn if_exists(mut self, if_exists: IfExists) -> Self {
        self.if_exists = if_exists;
        self
    }

    /// Sends the upload.
    async fn send(self) -> Result<TensorInfo, ClientError> {
        use sealed::Sealed;
        let payload = match self.payload.0 {
            PayloadData::Unreadable(e) => return Err(e),
            payload => payload,
        };
        // Checked before anything is sent: a tensor that cannot go leaves the connection as is.
        let (meta, parts) = match &payload {
            PayloadData::Borrowed(data) => data.checked()?,
            PayloadData::Owned(data) => data.checked()?,
            PayloadData::Parts(parts) => parts.checked()?,
            PayloadData::Unreadable(_) => unreachable!("returned above"),
        };
        let (device, name, if_exists) = match self.to {
            PutTo::Key(key) => (key.device, Some(key.name.as_str()), self.if_exists),
            PutTo::Device(device) => (device, None, IfExists::Refuse),
        };
        self.client
            .upload(device, name, &meta, &parts, if_exists)
            .await
    }
}

impl<'a> IntoFuture for Put<'a> {
    type Output = Result<TensorInfo, ClientError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.send())
    }
}

/// A batch of uploads over one connection: made by [`Client::put_batch`], sent by `.await`.
#[derive(Debug)]
#[must_use = "a PutBatch does nothing until it is awaited (or `.wait()`ed)"]
pub struct PutBatch<'a, T = TensorData> {
    client: &'a mut Client,
    tensors: &'a [(TensorKey, T)],
    if_exists: IfExists,
}

impl<T: Upload> PutBatch<'_, T> {
    /// What to do with a tensor already under a key ([`IfExists::Refuse`] by default).
    pub fn if_exists(mut self, if_exists: IfExists) -> Self {
        self.if_exists = if_exists;
        self
    }
}

impl<'a> PutBatch<'a> {
    /// The batch over this connection and `others` at once, every one a connection to the same
    /// node, so that while the node registers one tensor (or faults in new memory for it)
    /// another is already arriving: tensor `i` goes over the `i % n`th of the `n` connections
    /// still in step (this one first), each connection's share a batch of its own. Awaited, it
    /// answers every tensor, in order, and never fails as a whole: a connection that fails
    /// keeps the answers it had and answers each tensor it had none for with
    /// [`ClientError::NoAnswer`], whose reason says whether it may have been stored all the
    /// same (those whose payloads were sent, or being sent, and not yet answered when the
    /// connection failed: at most two per connection) or was not; the other connections go on. Where no connection is in step, every tensor is
    /// answered so. That every connection reaches one node is the caller's to check
    /// ([`identify`](Client::identify)): an address behind a balancer may reach several. Two
    /// tensors with one key should not share a batch over lanes: which lands last is not fixed.
    pub fn lanes<C: AsMut<Client> + 'a>(
        self,
        others: impl IntoIterator<Item = &'a mut C>,
    ) -> PutBatchInLanes<'a> {
        PutBatchInLanes {
            lanes: std::iter::once(self.client)
                .chain(others.into_iter().map(AsMut::as_mut))
                .collect(),
            tensors: self.tensors,
            if_exists: self.if_exists,
        }
    }
}

impl<'a, T: Upload> IntoFuture for PutBatch<'a, T> {
    type Output = Result<Vec<Result<TensorInfo, ClientError>>, ClientError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.client.put_batch_over_one(self.tensors, self.if_exists))
    }
}

/// A batch of uploads over several connections to one node: made by [`PutBatch::lanes`], sent by
/// `.await`.
#[derive(Debug)]
#[must_use = "a PutBatchInLanes does nothing until it is awaited (or `.wait()`ed)"]
pub struct PutBatchInLanes<'a> {
    lanes: Vec<&'a mut Client>,
    tensors: &'a [(TensorKey, TensorData)],
    if_exists: IfExists,
}

impl<'a> PutBatchInLanes<'a> {
    /// What to do with a tensor already under a key ([`IfExists::Refuse`] by default).
    pub fn if_exists(mut self, if_exists: IfExists) -> Self {
        self.if_exists = if_exists;
        self
    }

    /// More connections to the same node, after those already given.
    pub fn lanes<C: AsMut<Client> + 'a>(
        mut self,
        more: impl IntoIterator<Item = &'a mut C>,
    ) -> Self {
        self.lanes.extend(more.into_iter().map(AsMut::as_mut));
        self
    }
}

impl<'a> IntoFuture for PutBatchInLanes<'a> {
    type Output = Vec<Result<TensorInfo, ClientError>>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send + 'a>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(super::put_lanes::put_batch_in_lanes(
            self.lanes,
            self.tensors,
            self.if_exists,
        ))
    }
}

impl AsMut<Client> for Client {
    fn as_mut(&mut self) -> &mut Client {
        self
    }
}
