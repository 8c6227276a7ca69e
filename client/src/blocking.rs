//! `BlockingClient`: every call of [`Client`] for code without a runtime, and
//! [`NodeCopy::run_blocking`].

use std::sync::OnceLock;

use burn_std::Bytes;
use ferry_proto::{
    ContentHash, IfExists, NodeId, NodeStats, TensorData, TensorInfo, TensorKey, TensorMeta,
    Transfer, Welcome,
};
use tokio::runtime::{Builder, Runtime};

use crate::client::{Client, ClientError, Connect, HeldProbe, IssuedCapability, NodeCopy};
use ferry_io::connection::ConnectionError;
use ferry_io::transport::Endpoint;

/// The runtime every blocking client's calls run on: one worker thread that drives their
/// sockets, shared so that a copy between two blocking clients can drive both connections.
/// Handed out only to a thread that may block on it (see [`outside_runtime`]): every blocking
/// call comes through here, so none can forget the check.
fn runtime() -> Result<&'static Runtime, ClientError> {
    outside_runtime()?;
    static RUNTIME: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("ferry-blocking")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| ClientError::Connection(ConnectionError::Io(std::io::Error::other(e.clone()))))
}

/// Refuses to block on a thread that drives an async runtime (a task's thread), where tokio
/// would panic ("Cannot start a runtime from within a runtime") and waiting would stall the
/// runtime that has to answer. A thread that merely has a runtime's context, such as one of
/// `spawn_blocking`'s, may block: tokio's own check decides, probed with an empty future (its
/// refusal is a panic, contained and quiet here).
fn outside_runtime() -> Result<(), ClientError> {
    let Ok(handle) = tokio::runtime::Handle::try_current() else {
        return Ok(());
    };
    let _quiet = ferry_proto::contain::QuietPanics::enter();
    ferry_proto::contained(|| handle.block_on(async {})).map_err(|_| ClientError::InsideRuntime)
}

/// Runs `work` to its end on the shared runtime, or refuses where this thread may not block.
fn block_on<T>(work: impl Future<Output = Result<T, ClientError>>) -> Result<T, ClientError> {
    runtime()?.block_on(work)
}

/// A [`Client`] whose calls block until the node answered. Inside an async runtime (on a task's
/// thread) every call returns [`ClientError::InsideRuntime`]; use [`Client`] there.
#[derive(Debug)]
pub struct BlockingClient {
    client: Client,
}

impl BlockingClient {
    /// Starts opening a connection to the node at `addr`: set what differs from the defaults,
    /// then [`blocking`](Connect::blocking).
    pub fn connect(addr: impl Into<Endpoint>) -> Connect {
        Client::connect(addr)
    }

    /// Connects to member `name` of the cluster kept at `cluster` (`etcd://HOST:PORT[,...]`), as
    /// [`Directory::reach`](crate::cluster::Directory::reach) does: its Unix socket where it runs
    /// on this machine, else its TCP address, and only once it is the node the member
    /// registered.
    pub fn reach(
        cluster: &str,
        name: &str,
        options: crate::ConnectOptions,
    ) -> Result<(Self, ferry_proto::cluster::MemberRecord), crate::cluster::ReachError> {
        let (client, member) = runtime()?.block_on(async {
            let mut directory =
                crate::cluster::Directory::connect_with(cluster, options.tls.as_ref()).await?;
            directory.reach(name, options).await
        })?;
        Ok((Self { client }, member))
    }

    /// Opens what `connect` describes.
    pub(crate) fn open(connect: Connect) -> Result<Self, ClientError> {
        let client = block_on(connect.open())?;
        Ok(Self { client })
    }

    /// The async client underneath.
    pub fn into_async(self) -> Client {
        self.client
    }

    /// See [`Client::welcome`].
    pub fn welcome(&self) -> &Welcome {
        self.client.welcome()
    }

    /// See [`Client::shared_memory`].
    pub fn shared_memory(&self) -> bool {
        self.client.shared_memory()
    }

    /// See [`Client::in_step`].
    pub fn in_step(&self) -> bool {
        self.client.in_step()
    }

    /// See [`Client::put`].
    pub fn put(&mut self, key: &TensorKey, data: &TensorData) -> Result<TensorInfo, ClientError> {
        block_on(self.client.put(key, data))
    }

    /// See [`Client::put_with`].
    pub fn put_with(
        &mut self,
        key: &TensorKey,
        data: &TensorData,
        if_exists: IfExists,
    ) -> Result<TensorInfo, ClientError> {
        block_on(self.client.put_with(key, data, if_exists))
    }

    /// See [`Client::put_unnamed`].
    pub fn put_unnamed(
        &mut self,
        device: u32,
        data: &TensorData,
    ) -> Result<TensorInfo, ClientError> {
        block_on(self.client.put_unnamed(device, data))
    }

    /// See [`Client::put_batch`].
    pub fn put_batch(
        &mut self,
        tensors: &[(TensorKey, TensorData)],
        if_exists: IfExists,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        block_on(self.client.put_batch(tensors, if_exists))
    }

    /// See [`Client::put_batch_in_lanes`]: the batch over every one of `lanes` at once (each a
    /// connection to the same node). `Err` only where no runtime could be started, or on a
    /// thread that may not block ([`ClientError::InsideRuntime`]).
    pub fn put_batch_in_lanes(
        lanes: &mut [BlockingClient],
        tensors: &[(TensorKey, TensorData)],
        if_exists: IfExists,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        let clients = lanes.iter_mut().map(|lane| &mut lane.client);
        Ok(runtime()?.block_on(Client::put_batch_in_lanes(clients, tensors, if_exists)))
    }

    /// See [`Client::get`].
    pub fn get(&mut self, key: &TensorKey) -> Result<TensorData, ClientError> {
        block_on(self.client.get(key))
    }

    /// See [`Client::get_with_info`].
    pub fn get_with_info(
        &mut self,
        key: &TensorKey,
    ) -> Result<(TensorInfo, TensorData), ClientError> {
        block_on(self.client.get_with_info(key))
    }

    /// See [`Client::get_batch`].
    pub fn get_batch(
        &mut self,
        keys: &[TensorKey],
    ) -> Result<Vec<Result<TensorData, ClientError>>, ClientError> {
        block_on(self.client.get_batch(keys))
    }

    /// See [`Client::get_batch_into`].
    pub fn get_batch_into(
        &mut self,
        keys: &[TensorKey],
        buffer_for: impl FnMut(usize, &TensorMeta) -> Option<Bytes>,
    ) -> Result<Vec<Result<TensorData, ClientError>>, ClientError> {
        block_on(self.client.get_batch_into(keys, buffer_for))
    }

    /// See [`Client::put_tensor`].
    pub fn put_tensor<const D: usize, K: burn_tensor::kind::Basic>(
        &mut self,
        key: &TensorKey,
        tensor: burn_tensor::Tensor<D, K>,
    ) -> Result<TensorInfo, ClientError> {
        block_on(self.client.put_tensor(key, tensor))
    }

    /// See [`Client::get_tensor`].
    pub fn get_tensor<const D: usize, K: burn_tensor::kind::Basic + 'static>(
        &mut self,
        key: &TensorKey,
        device: &burn_tensor::Device,
    ) -> Result<burn_tensor::Tensor<D, K>, ClientError> {
        block_on(self.client.get_tensor(key, device))
    }

    /// See [`Client::copy`].
    pub fn copy(&mut self, src: &TensorKey, dst: &TensorKey) -> Result<TensorInfo, ClientError> {
        block_on(self.client.copy(src, dst))
    }

    /// See [`Client::move_to`].
    pub fn move_to(&mut self, src: &TensorKey, dst: &TensorKey) -> Result<TensorInfo, ClientError> {
        block_on(self.client.move_to(src, dst))
    }

    /// See [`Client::transfer`].
    pub fn transfer(
        &mut self,
        src: &TensorKey,
        dst: &TensorKey,
        transfer: Transfer,
        if_exists: IfExists,
    ) -> Result<TensorInfo, ClientError> {
        block_on(self.client.transfer(src, dst, transfer, if_exists))
    }

    /// See [`Client::delete`].
    pub fn delete(&mut self, key: &TensorKey) -> Result<TensorInfo, ClientError> {
        block_on(self.client.delete(key))
    }

    /// See [`Client::delete_if`].
    pub fn delete_if(
        &mut self,
        key: &TensorKey,
        version: &ContentHash,
    ) -> Result<TensorInfo, ClientError> {
        block_on(self.client.delete_if(key, version))
    }

    /// See [`Client::list`].
    pub fn list(&mut self, device: Option<u32>) -> Result<Vec<TensorInfo>, ClientError> {
        block_on(self.client.list(device))
    }

    /// See [`Client::list_page`].
    pub fn list_page(
        &mut self,
        device: Option<u32>,
        after: Option<TensorKey>,
        limit: u32,
    ) -> Result<(Vec<TensorInfo>, Option<TensorKey>), ClientError> {
        block_on(self.client.list_page(device, after, limit))
    }

    /// See [`Client::holds`].
    pub fn holds(&mut self, device: u32) -> Result<Vec<HeldProbe>, ClientError> {
        block_on(self.client.holds(device))
    }

    /// See [`Client::stat`].
    pub fn stat(&mut self) -> Result<NodeStats, ClientError> {
        block_on(self.client.stat())
    }

    /// See [`Client::identify`].
    pub fn identify(&mut self) -> Result<NodeId, ClientError> {
        block_on(self.client.identify())
    }

    /// See [`Client::grant`].
    pub fn grant(
        &mut self,
        key: &TensorKey,
        audience: &NodeId,
    ) -> Result<IssuedCapability, ClientError> {
        block_on(self.client.grant(key, audience))
    }

    /// See [`Client::pull`].
    pub fn pull(
        &mut self,
        source: &str,
        grant: &IssuedCapability,
        dst: &TensorKey,
        if_exists: IfExists,
    ) -> Result<TensorInfo, ClientError> {
        block_on(self.client.pull(source, grant, dst, if_exists))
    }

    /// See [`Client::release`].
    pub fn release(&mut self, grant: &IssuedCapability) -> Result<(), ClientError> {
        block_on(self.client.release(grant))
    }
}

impl NodeCopy {
    /// [`run`](Self::run) for blocking clients.
    pub fn run_blocking(
        &self,
        source: &mut BlockingClient,
        target: &mut BlockingClient,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        block_on(self.run(&mut source.client, &mut target.client))
    }
}
