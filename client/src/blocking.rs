//! Blocking use of the client, for code without an async runtime: [`Wait`], which runs any call
//! of [`Client`] to its answer on one shared runtime (`.wait()` in place of `.await`), and
//! [`BlockingClient`], a connection opened on that runtime that derefs to its [`Client`].
//!
//! There is no blocking twin of each call: every call of [`Client`] (an `async fn` or a builder
//! such as [`Put`](crate::Put)) is reached through a `BlockingClient` by deref and blocked on with
//! `.wait()`, so a call added to [`Client`] is there at once, and every blocking call goes through
//! one check that this thread may block ([`ClientError::InsideRuntime`]).

use std::ops::{Deref, DerefMut};
use std::sync::OnceLock;

use tokio::runtime::{Builder, Runtime};

use crate::client::{Client, ClientError, Connect};
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
fn block_on<F: Future>(work: F) -> Result<F::Output, ClientError> {
    Ok(runtime()?.block_on(work))
}

/// What a call of the client answers, as [`Wait::wait`] hands it back: a call that answers a
/// `Result` is waited for as that `Result`; one that answers each tensor and never fails as a
/// whole (a batch over lanes, [`NodeCopy::run_in_lanes`](crate::NodeCopy::run_in_lanes)) is
/// waited for as `Ok` of its answers. Either way a thread that may not block gets
/// `Err(ClientError::InsideRuntime)`.
pub trait Answer: Sized + sealed::Sealed {
    /// What [`Wait::wait`] returns.
    type Waited;

    /// The answer, arrived.
    fn arrived(self) -> Self::Waited;

    /// No answer: the call could not be waited for (`why`).
    fn refused(why: ClientError) -> Self::Waited;
}

impl<T> Answer for Result<T, ClientError> {
    type Waited = Self;

    fn arrived(self) -> Self::Waited {
        self
    }

    fn refused(why: ClientError) -> Self::Waited {
        Err(why)
    }
}

impl<T> Answer for Vec<Result<T, ClientError>> {
    type Waited = Result<Self, ClientError>;

    fn arrived(self) -> Self::Waited {
        Ok(self)
    }

    fn refused(why: ClientError) -> Self::Waited {
        Err(why)
    }
}

/// Keeps [`Answer`] to the shapes above.
mod sealed {
    pub trait Sealed {}
    impl<T> Sealed for Result<T, crate::ClientError> {}
    impl<T> Sealed for Vec<Result<T, crate::ClientError>> {}
}

/// A call of the client run to its answer by blocking this thread: `.wait()` in place of
/// `.await`, on every call of [`Client`] (any future or builder whose answer is an [`Answer`]).
///
/// ```no_run
/// # fn run() -> Result<(), ferry_client::ClientError> {
/// use ferry_client::{BlockingClient, TensorData, TensorKey, Wait};
/// let mut client = BlockingClient::connect("127.0.0.1:7070").blocking()?;
/// let key = TensorKey::new(0, "mask");
/// client.put(&key, &TensorData::new(vec![1u8, 2, 3, 4], [2, 2])).wait()?;
/// let back = client.get(&key).wait()?;
/// # Ok(()) }
/// ```
///
/// The calls run on one runtime thread shared by every blocking client, which drives their
/// connections. Meant for a connection opened there ([`BlockingClient`]); a [`Client`] opened on
/// a runtime of the caller's is driven by that runtime, which has to keep running meanwhile. On
/// a thread that drives an async runtime (a task's thread) `.wait()` refuses with
/// [`ClientError::InsideRuntime`] before the call starts: `.await` there.
pub trait Wait: IntoFuture<Output: Answer> {
    /// Blocks until the call is answered.
    fn wait(self) -> <Self::Output as Answer>::Waited;
}

impl<F: IntoFuture<Output: Answer>> Wait for F {
    fn wait(self) -> <F::Output as Answer>::Waited {
        match block_on(self.into_future()) {
            Ok(answer) => answer.arrived(),
            Err(why) => F::Output::refused(why),
        }
    }
}

/// A connection for code without a runtime: a [`Client`] opened on the shared blocking runtime.
/// It derefs to that [`Client`], so it has every call of it, each blocked on with
/// [`.wait()`](Wait::wait) (the calls run on the shared runtime's thread). Inside an async runtime
/// (on a task's thread) every `.wait()` returns [`ClientError::InsideRuntime`]; use [`Client`] and
/// `.await` there.
///
/// Deref, for a type that is not a pointer, because a `BlockingClient` is a `Client` with one
/// promise added (its connection lives on the runtime [`Wait`] blocks on), not a type of its own
/// calls: a mirror of each call would drift from [`Client`], as it did.
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
        let client = block_on(connect.open())??;
        Ok(Self { client })
    }

    /// The async client underneath.
    pub fn into_async(self) -> Client {
        self.client
    }
}

impl Deref for BlockingClient {
    type Target = Client;

    fn deref(&self) -> &Client {
        &self.client
    }
}

impl DerefMut for BlockingClient {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}

/// So that blocking clients serve as lanes ([`PutBatch::lanes`](crate::PutBatch::lanes)).
impl AsMut<Client> for BlockingClient {
    fn as_mut(&mut self) -> &mut Client {
        &mut self.client
    }
}
