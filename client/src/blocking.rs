//! `BlockingClient`: the same API as [`Client`] for code without a runtime.

use ferry_proto::{NodeStats, TensorData, TensorInfo, TensorKey};
use tokio::runtime::{Builder, Runtime};

use crate::client::{Client, ClientConfig, ClientError};
use ferry_io::connection::ConnectionError;
use ferry_io::transport::Endpoint;

/// A [`Client`] driven by its own single-threaded runtime. Each call blocks until the node
/// answered. Do not use it from inside an async runtime; use [`Client`] there.
#[derive(Debug)]
pub struct BlockingClient {
    runtime: Runtime,
    client: Client,
}

impl BlockingClient {
    /// Connects to the node at `addr`, with `token` if given.
    pub fn connect(addr: impl Into<Endpoint>, token: Option<&str>) -> Result<Self, ClientError> {
        let config = ClientConfig {
            token: token.map(str::to_string),
            ..ClientConfig::default()
        };
        Self::connect_with(addr, config)
    }

    /// Connects with a full configuration.
    pub fn connect_with(
        addr: impl Into<Endpoint>,
        config: ClientConfig,
    ) -> Result<Self, ClientError> {
        let runtime = Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(ConnectionError::from)?;
        let client = runtime.block_on(Client::connect_with(addr, config))?;
        Ok(Self { runtime, client })
    }

    /// See [`Client::put`].
    pub fn put(
        &mut self,
        device: u32,
        name: &str,
        data: &TensorData,
    ) -> Result<TensorInfo, ClientError> {
        self.runtime.block_on(self.client.put(device, name, data))
    }

    /// See [`Client::put_with`].
    pub fn put_with(
        &mut self,
        device: u32,
        name: Option<&str>,
        data: &TensorData,
        overwrite: bool,
    ) -> Result<TensorInfo, ClientError> {
        self.runtime
            .block_on(self.client.put_with(device, name, data, overwrite))
    }

    /// See [`Client::put_batch`].
    pub fn put_batch(
        &mut self,
        device: u32,
        tensors: &[(String, TensorData)],
        overwrite: bool,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        self.runtime
            .block_on(self.client.put_batch(device, tensors, overwrite))
    }

    /// See [`Client::get`].
    pub fn get(&mut self, key: &TensorKey) -> Result<TensorData, ClientError> {
        self.runtime.block_on(self.client.get(key))
    }

    /// See [`Client::get_batch`].
    pub fn get_batch(
        &mut self,
        keys: &[TensorKey],
    ) -> Result<Vec<Result<TensorData, ClientError>>, ClientError> {
        self.runtime.block_on(self.client.get_batch(keys))
    }

    /// See [`Client::put_tensor`].
    pub fn put_tensor<const D: usize, K: burn_tensor::kind::Basic>(
        &mut self,
        device: u32,
        name: &str,
        tensor: burn_tensor::Tensor<D, K>,
    ) -> Result<TensorInfo, ClientError> {
        self.runtime
            .block_on(self.client.put_tensor(device, name, tensor))
    }

    /// See [`Client::get_tensor`].
    pub fn get_tensor<const D: usize, K: burn_tensor::kind::Basic + 'static>(
        &mut self,
        key: &TensorKey,
        device: &burn_tensor::Device,
    ) -> Result<burn_tensor::Tensor<D, K>, ClientError> {
        self.runtime.block_on(self.client.get_tensor(key, device))
    }

    /// See [`Client::copy`].
    pub fn copy(
        &mut self,
        src: &TensorKey,
        dst_device: u32,
        dst_name: Option<&str>,
    ) -> Result<TensorInfo, ClientError> {
        self.runtime
            .block_on(self.client.copy(src, dst_device, dst_name))
    }

    /// See [`Client::move_to`].
    pub fn move_to(
        &mut self,
        src: &TensorKey,
        dst_device: u32,
        dst_name: Option<&str>,
    ) -> Result<TensorInfo, ClientError> {
        self.runtime
            .block_on(self.client.move_to(src, dst_device, dst_name))
    }

    /// See [`Client::transfer`].
    pub fn transfer(
        &mut self,
        src: &TensorKey,
        dst_device: u32,
        dst_name: Option<&str>,
        remove_source: bool,
        overwrite: bool,
    ) -> Result<TensorInfo, ClientError> {
        self.runtime.block_on(self.client.transfer(
            src,
            dst_device,
            dst_name,
            remove_source,
            overwrite,
        ))
    }

    /// See [`Client::identify`].
    pub fn identify(&mut self) -> Result<String, ClientError> {
        self.runtime.block_on(self.client.identify())
    }

    /// See [`copy_between`](crate::copy_between): node to node, from `source` to this client's
    /// node.
    pub fn pull_from(
        &mut self,
        source: &mut BlockingClient,
        keys: &[TensorKey],
        how: &crate::NodeCopy<'_>,
    ) -> Result<Vec<Result<TensorInfo, ClientError>>, ClientError> {
        self.runtime.block_on(crate::copy_between(
            &mut source.client,
            &mut self.client,
            keys,
            how,
        ))
    }

    /// See [`Client::delete`].
    pub fn delete(&mut self, key: &TensorKey) -> Result<TensorInfo, ClientError> {
        self.runtime.block_on(self.client.delete(key))
    }

    /// See [`Client::list`].
    pub fn list(&mut self, device: Option<u32>) -> Result<Vec<TensorInfo>, ClientError> {
        self.runtime.block_on(self.client.list(device))
    }

    /// See [`Client::stat`].
    pub fn stat(&mut self) -> Result<NodeStats, ClientError> {
        self.runtime.block_on(self.client.stat())
    }
}
