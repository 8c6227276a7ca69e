//! [`Connected`]: a store's node reached over a connection (or several: lanes). A collect
//! walks the module on the caller's thread and sends its parameters on one thread per
//! connection, what has arrived for it in one pipelined batch (`outgoing.rs`: a Flex
//! parameter's buffers as they lie, others read off within a bounded window of host copies).

use std::collections::HashMap;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, MutexGuard};

use burn_core::tensor::TensorData;
use burn_store::{ApplyResult, ModuleSnapshot, PathFilter};
use ferry_client::{BlockingClient, Wait};
use ferry_proto::message::ModelManifest;
use ferry_proto::{NodeId, TensorKey};

use crate::StoreError;
use crate::store::collect_walk::CollectWalk;
use crate::store::deferred_tensors;
use crate::store::link::{Link, Listed, Sending, outside_runtime};
use crate::store::outgoing::{Deal, Outgoing, next_batch, put_batch};
use crate::store::plan::Targets;
use crate::store::prefetch::{Ahead, Each, Prefetch};
use crate::store::replicas::{Replica, Replicas};
use crate::store::window::Window;

/// The node at the other end of a connection: a [`FerryStore`](crate::FerryStore) over it
/// sends and fetches with the connection's own calls (`put`, `get`, `list`), so every byte is
/// checked as a client's are. A collect also sends over the store's further connections to
/// the same node, its lanes ([`FerryStore::with_lanes`](crate::FerryStore::with_lanes)), each
/// with a pipelined batch in flight.
#[derive(Debug)]
pub struct Connected {
    client: Mutex<BlockingClient>,
    /// Further connections to the same node (checked by its id), for a collect's sends.
    lanes: Mutex<Vec<BlockingClient>>,
    /// That node's id, once lanes were given: each lane is asked it again before a collect.
    node: std::sync::OnceLock<NodeId>,
    /// Where a committed version goes on to.
    replicas: Mutex<Option<Replicas>>,
}

impl Connected {
    pub(crate) fn new(client: BlockingClient) -> Self {
        Self {
            client: Mutex::new(client),
            lanes: Mutex::new(Vec::new()),
            node: std::sync::OnceLock::new(),
            replicas: Mutex::new(None),
        }
    }

    /// The connection; one whose last user panicked is still in step or refuses by itself.
    fn client(&self) -> MutexGuard<'_, BlockingClient> {
        self.client
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn lanes(&self) -> MutexGuard<'_, Vec<BlockingClient>> {
        self.lanes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds `more` connections as lanes, each checked to reach the node the first one does
    /// (the node's id): a lane to another node would scatter a model over two.
    pub(crate) fn add_lanes(&self, more: Vec<BlockingClient>) -> Result<(), StoreError> {
        if more.is_empty() {
            return Ok(());
        }
        outside_runtime()?;
        let node = self.client().identify().wait()?;
        let mut checked = Vec::with_capacity(more.len());
        for mut lane in more {
            let other = lane.identify().wait()?;
            if other != node {
                return Err(StoreError::LaneToAnotherNode {
                    store: node.to_string(),
                    lane: other.to_string(),
                });
            }
            checked.push(lane);
        }
        let _ = self.node.set(node);
        self.lanes().extend(checked);
        Ok(())
    }

    /// Sets the workers a committed version goes on to ([`Replicas`]).
    pub(crate) fn set_replicas(&self, from: String, replicas: Vec<Replica>) {
        *self
            .replicas
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some(Replicas::new(from, replicas));
    }

    /// The tensors under `keys` in one pipelined exchange over the store's connection, each
    /// handed to `each` as it arrives.
    fn fetch_each(&self, keys: &[TensorKey], each: &mut Each<'_>) -> Result<(), StoreError> {
        self.client()
            .get_each(keys, |i, answer| each(i, answer.map_err(StoreError::from)))
            .wait()?;
        Ok(())
    }

    /// The lanes a collect can send over: each still in step and answering as the store's node
    /// (one round trip each). A lane that failed an earlier collect, or that the node closed
    /// meanwhile (idle past its keepalive), is dropped for good; the collect goes on without it.
    fn lanes_ready(&self) -> MutexGuard<'_, Vec<BlockingClient>> {
        let mut lanes = self.lanes();
        if let Some(node) = self.node.get() {
            lanes.retain_mut(|lane| {
                lane.in_step() && lane.identify().wait().is_ok_and(|id| id == *node)
            });
        }
        lanes
    }
}

impl Link for Connected {
    fn node(&self) -> String {
        self.client().endpoint().to_string()
    }

    fn begin(&self, device: u32, prefix: &str, replace: bool) -> Result<u64, StoreError> {
        outside_runtime()?;
        Ok(self.client().begin_model(device, prefix, replace).wait()?)
    }

    fn commit(
        &self,
        device: u32,
        prefix: &str,
        version: u64,
        paths: &[String],
    ) -> Result<ModelManifest, StoreError> {
        outside_runtime()?;
        let paths = paths.iter().map(String::as_str);
        let mut client = self.client();
        Ok(client
            .commit_model(device, prefix, version, paths, Vec::new())
            .wait()?)
    }

    fn replicate(&self, device: u32, prefix: &str, replace: bool) -> Result<(), StoreError> {
        let mut replicas = self
            .replicas
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match replicas.as_mut() {
            Some(replicas) => {
                outside_runtime()?;
                replicas.relay(&mut self.client(), device, prefix, replace)
            }
            None => Ok(()),
        }
    }

    fn abort(&self, device: u32, prefix: &str, version: u64) {
        // A connection out of step (the failure itself) gives the version up as it closes.
        let mut client = self.client();
        if client.in_step() {
            let _ = client.abort_model(device, prefix, version).wait();
        }
    }

    fn open(&self, device: u32, prefix: &str) -> Result<ModelManifest, StoreError> {
        outside_runtime()?;
        Ok(self.client().open_model(device, prefix).wait()?)
    }

    fn close(&self, manifest: &ModelManifest) {
        // A connection out of step lets the version go as it closes.
        let mut client = self.client();
        if client.in_step() {
            let _ = client.close_model(manifest).wait();
        }
    }

    fn fetch(&self, key: &TensorKey) -> Result<TensorData, StoreError> {
        outside_runtime()?;
        Ok(self.client().get(key).wait()?)
    }

    #[allow(private_interfaces)]
    fn apply<M: ModuleSnapshot>(
        self: Arc<Self>,
        module: &mut M,
        listing: Vec<(String, Listed)>,
        filter: Option<&PathFilter>,
        window: u64,
    ) -> Result<ApplyResult, StoreError> {
        outside_runtime()?;
        let targets = Arc::new(Targets::of(module));
        // Fetched ahead in the order the Applier draws them, unless a filter skips some (which
        // only the Applier's own walk can tell): those would hold the window to no use. Nor is
        // a tensor the parameter's device cannot hold: its draw refuses it before a byte moves.
        let ahead = filter.is_none().then(|| {
            let by_path: HashMap<&str, &Listed> =
                listing.iter().map(|(p, l)| (p.as_str(), l)).collect();
            let ahead = targets
                .order()
                .iter()
                .filter_map(|path| Some((path, *by_path.get(path.as_str())?)))
                .filter(|(path, l)| targets.check(path, &l.dtype, &l.shape).is_ok())
                .map(|(_, listed)| listed)
                .map(|listed| Ahead {
                    key: listed.key.clone(),
                    bytes: listed.bytes,
                })
                .collect();
            let link = self.clone();
            Arc::new(Prefetch::start(ahead, window, move |keys, each| {
                link.fetch_each(keys, each)
            }))
        });
        // burn-store's own Applier, each fetch checked against the parameter's device first.
        let tensors = deferred_tensors(&self, listing, targets, ahead);
        Ok(module.apply(tensors, filter.cloned(), None, false))
    }

    #[allow(private_interfaces)]
    fn send<M: ModuleSnapshot>(
        &self,
        module: &M,
        sending: &Sending<'_>,
    ) -> Result<Vec<String>, StoreError> {
        outside_runtime()?;
        let mut first = self.client();
        let mut lanes = self.lanes_ready();
        let mut connections: Vec<&mut BlockingClient> = std::iter::once(&mut *first)
            .chain(lanes.iter_mut())
            .collect();
        // The window, times the connections, shared between them: every lane can have a tensor
        // in flight.
        let n = u64::try_from(connections.len()).unwrap_or(u64::MAX);
        let window = &Window::new(sending.window.saturating_mul(n));
        // One channel and one sending thread per connection; tensor i goes to connection
        // i % n, as its turn comes (a fixed deal: which connection carried a tensor is known).
        let (senders, arrivals): (Vec<_>, Vec<_>) = connections
            .iter()
            .map(|_| std::sync::mpsc::channel::<Outgoing>())
            .unzip();
        let failed: Mutex<Option<StoreError>> = Mutex::new(None);
        let sent: Mutex<Vec<String>> = Mutex::new(Vec::new());
        let send_over = |client: &mut BlockingClient, arrived: Receiver<Outgoing>| {
            // Closes the window as this sender leaves, however it leaves (done, failed or
            // panicking): the walk must not wait for room this sender will not make.
            let _close = CloseOnDrop(window);
            // What has arrived goes in one pipelined exchange: the next tensor's request goes
            // out while the node registers the one before.
            // A batch holds at most half of a connection's window of copies, so that the walk
            // reads the next copies off while a batch is sent.
            let cap = sending.window / 2;
            while let Some(batch) = next_batch(&arrived, cap) {
                // Another sender failed: the collect's error is its.
                if lock(&failed).is_some() {
                    return;
                }
                let held: u64 = batch.iter().map(|o| o.held).sum();
                // The batch's copies are gone once it returns, before their room is given back.
                let put = put_batch(client, sending, batch);
                window.give(held);
                match put {
                    Ok(paths) => lock(&sent).extend(paths),
                    Err(e) => {
                        lock(&failed).get_or_insert(e);
                        return;
                    }
                }
            }
        };
        std::thread::scope(|scope| {
            for (client, arrived) in connections.iter_mut().zip(arrivals) {
                scope.spawn(move || send_over(client, arrived));
            }
            // This thread walks the module (which need be neither Send nor Sync) and owns the
            // channels' senders: each sender's loop ends when the walk is done and `deal`
            // dropped, and the walk stops once a sender has gone or closed the window.
            let mut deal = Deal::new(senders, window);
            match &sending.adapter {
                // The adapter rewrites burn-store's snapshots: burn-store's collect, each
                // tensor read off (copied) as it reaches it.
                Some(adapter) => {
                    let filter = sending.filter.cloned();
                    for tensor in module.collect(filter, Some(adapter.clone()), false) {
                        if !deal.offer_read_off(tensor) {
                            break;
                        }
                    }
                }
                // A Flex parameter's buffers go as they lie, shared, instead of the copy
                // burn-store's collect makes of a tensor the module still holds.
                None => module.visit(&mut CollectWalk::new(&mut deal, sending.filter)),
            }
        });
        match failed
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Some(e) => Err(e),
            None => Ok(sent
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner)),
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Closes the window when dropped: the walk stops rather than wait for room that will not
/// come (after an error, or a panic on the sending thread, which the scope then passes on).
struct CloseOnDrop<'a>(&'a Window);

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        self.0.close();
    }
}
