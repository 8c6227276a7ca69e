//! [`Connected`]: a store's node reached over a connection. A collect reads parameters off
//! their devices on one thread and sends them on another, a bounded window of host copies
//! between the two.

use std::sync::{Arc, Mutex, MutexGuard};

use burn_core::tensor::{DType, TensorData};
use burn_store::{ApplyResult, ModuleSnapshot, PathFilter, bridge};
use ferry_client::{BlockingClient, ClientError};
use ferry_proto::TensorKey;

use crate::StoreError;
use crate::store::deferred_tensors;
use crate::store::link::{Link, Listed, PAGE, Sending, listing_start, outside_runtime};
use crate::store::plan::Targets;
use crate::store::window::Window;

/// The node at the other end of a connection: a [`FerryStore`](crate::FerryStore) over it
/// sends and fetches with the connection's own calls (`put`, `get`, `list`), so every byte is
/// checked as a client's are.
#[derive(Debug)]
pub struct Connected {
    client: Mutex<BlockingClient>,
}

impl Connected {
    pub(crate) fn new(client: BlockingClient) -> Self {
        Self {
            client: Mutex::new(client),
        }
    }

    /// The connection; one whose last user panicked is still in step or refuses by itself.
    fn client(&self) -> MutexGuard<'_, BlockingClient> {
        self.client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Link for Connected {
    #[allow(private_interfaces)]
    fn list(&self, device: u32, prefix: &str) -> Result<Vec<Listed>, StoreError> {
        outside_runtime()?;
        let mut client = self.client();
        let mut infos = Vec::new();
        if client.welcome().minor < 3 {
            // A node of minor 2 or older lists a device whole.
            infos = client.list(Some(device))?;
        } else {
            // Page by page from the prefix, stopping at the first name past it.
            let mut after = listing_start(device, prefix);
            loop {
                let (page, next) = client.list_page(Some(device), after, PAGE as u32)?;
                let past = page.iter().any(|i| !i.key.name.starts_with(prefix));
                infos.extend(page);
                match next {
                    Some(next) if !past => after = Some(next),
                    _ => break,
                }
            }
        }
        drop(client);
        // Only what is under the prefix is read: a tensor elsewhere on the device is no
        // concern of this store, whatever its dtype.
        infos
            .into_iter()
            .filter(|info| info.key.name.starts_with(prefix))
            .map(|info| {
                let dtype = DType::try_from(&info.dtype)
                    .map_err(|e| ClientError::from(ferry_proto::ProtoError::from(e)))?;
                let shape = info
                    .shape
                    .iter()
                    .map(|&d| usize::try_from(d))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| StoreError::ReadBack {
                        path: info.key.name.clone(),
                        message: "a dimension beyond this machine's address space".into(),
                    })?;
                Ok(Listed {
                    key: info.key,
                    dtype,
                    shape,
                })
            })
            .collect()
    }

    fn fetch(&self, key: &TensorKey) -> Result<TensorData, StoreError> {
        outside_runtime()?;
        Ok(self.client().get(key)?)
    }

    #[allow(private_interfaces)]
    fn apply<M: ModuleSnapshot>(
        self: Arc<Self>,
        module: &mut M,
        listing: Vec<(String, Listed)>,
        filter: Option<&PathFilter>,
    ) -> Result<ApplyResult, StoreError> {
        // burn-store's own Applier, each fetch checked against the parameter's device first.
        let tensors = deferred_tensors(&self, listing, Arc::new(Targets::of(module)));
        Ok(module.apply(tensors, filter.cloned(), None, false))
    }

    #[allow(private_interfaces)]
    fn send<M: ModuleSnapshot>(
        &self,
        module: &M,
        sending: &Sending<'_>,
    ) -> Result<usize, StoreError> {
        outside_runtime()?;
        // Lazy: each tensor is read off its device only when the reader thread reaches it.
        let tensors = module.collect(sending.filter.cloned(), None, false);
        let window = &Window::new(sending.window);
        let (copies, arrived) = std::sync::mpsc::channel();
        std::thread::scope(|scope| {
            // Owns the sender: the loop below ends when the reader is done.
            scope.spawn(move || {
                for tensor in tensors {
                    let bytes = tensor.byte_len() as u64;
                    if !window.take(bytes) {
                        return;
                    }
                    let path = tensor.name.clone();
                    if copies
                        .send((path, bridge::into_data(tensor), bytes))
                        .is_err()
                    {
                        return;
                    }
                }
            });
            // Wakes the reader, which may wait for room, however this thread leaves.
            let _close = CloseOnDrop(window);
            let mut client = self.client();
            let send_all = || {
                let mut sent = 0;
                for (path, data, bytes) in arrived {
                    let data = data.map_err(|e| StoreError::ReadBack {
                        path: path.clone(),
                        message: e.to_string(),
                    })?;
                    client.put_with(&sending.key(&path)?, &data, sending.if_exists)?;
                    drop(data);
                    window.give(bytes);
                    sent += 1;
                }
                Ok(sent)
            };
            send_all()
        })
    }
}

/// Closes the window when dropped: the reader stops rather than wait for room that will not
/// come (after an error, or a panic on the sending thread, which the scope then passes on).
struct CloseOnDrop<'a>(&'a Window);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}
