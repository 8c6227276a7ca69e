//! Opening a [`Client`]: [`ConnectOptions`] (token, TLS, the node expected there, shared memory,
//! limits; what differs from the defaults) and [`Connect`], the options and an address, which
//! `.await` opens (or [`blocking`](Connect::blocking) for code without a runtime).

use std::future::{Future, IntoFuture};
use std::pin::Pin;

use ferry_io::{
    ClearTokens, ClientTls, ConnectionLimits, Dial, Endpoint, ExchangeError, PeerCheck,
    SharedMemory,
};
use ferry_proto::{NodeId, Token};

use super::{AGENT, Client, ClientError};
use crate::BlockingClient;

/// How a client connects, whatever the address: the defaults are no token, TCP in clear, any
/// node, a token in clear to loopback only (to a port this user or root holds), shared memory
/// offered on a Unix socket, default limits, no bound on a tensor received.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    pub(crate) token: Option<Token>,
    pub(crate) tls: Option<ClientTls>,
    pub(crate) check: PeerCheck,
    pub(crate) clear_tokens: ClearTokens,
    pub(crate) shared_memory: SharedMemory,
    pub(crate) limits: ConnectionLimits,
    pub(crate) max_tensor_bytes: u64,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            token: None,
            tls: None,
            check: PeerCheck::Any,
            clear_tokens: ClearTokens::default(),
            shared_memory: SharedMemory::Offer,
            limits: ConnectionLimits::default(),
            max_tensor_bytes: u64::MAX,
        }
    }
}

/// A connection to open: made by [`Client::connect`], opened by `.await`.
///
/// ```no_run
/// # async fn run() -> Result<(), ferry_client::ClientError> {
/// use ferry_client::Client;
/// let client = Client::connect("127.0.0.1:7070").token("s3cret").await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[must_use = "a Connect does nothing until it is awaited (or `.blocking()`)"]
pub struct Connect {
    endpoint: Endpoint,
    options: ConnectOptions,
}

/// The setters, on the options and on a connection to open alike.
macro_rules! setters {
    ($options:ident) => {
        /// Presents the node's shared token, over TCP in clear: under TLS the certificate is the
        /// credential and on a Unix socket the kernel's word on this user is, so no token is
        /// sent there (none reaches a node that could replay it). In clear it goes to loopback
        /// only, to a port this user or root holds, unless
        /// [`clear_tokens`](Self::clear_tokens) says otherwise: elsewhere the connection is
        /// refused ([`ClientError::TokenWithheld`]) before any byte is sent.
        pub fn token(mut self, token: impl Into<Token>) -> Self {
            self.$options().token = Some(token.into());
            self
        }

        /// Presents `token` where there is one.
        pub fn token_if_any(mut self, token: Option<Token>) -> Self {
            self.$options().token = token;
            self
        }

        /// Mutual TLS over TCP: the node's certificate must chain to the CA `tls` holds, and
        /// the client presents its own. Unix sockets never take it.
        pub fn tls(mut self, tls: ClientTls) -> Self {
            self.$options().tls = Some(tls);
            self
        }

        /// Mutual TLS where `tls` is given, TCP in clear otherwise.
        pub fn tls_if_any(mut self, tls: Option<ClientTls>) -> Self {
            self.$options().tls = tls;
            self
        }

        /// Requires the node `node` at the address, checked before anything (the token
        /// included) is sent: over TCP its certificate must name it (so TLS is needed); over a
        /// Unix socket this very user must serve it (root not counted).
        pub fn expect_node(mut self, node: impl Into<NodeId>) -> Self {
            self.$options().check = PeerCheck::Node(node.into());
            self
        }

        /// What is checked of the peer before anything is sent
        /// ([`expect_node`](Self::expect_node) is the usual choice).
        pub fn check(mut self, check: PeerCheck) -> Self {
            self.$options().check = check;
            self
        }

        /// Where the token may go over TCP in clear, and who may hold a loopback port it goes
        /// to; the default, [`ClearTokens::LoopbackOnly`] with this user or root, keeps it off
        /// the network and from other local users. [`ClearTokens::Anywhere`] is the opt-in for
        /// a network one trusts.
        pub fn clear_tokens(mut self, clear_tokens: ClearTokens) -> Self {
            self.$options().clear_tokens = clear_tokens;
            self
        }

        /// Whether payloads may travel through shared memory (on a Unix socket to a node that
        /// agrees).
        pub fn shared_memory(mut self, shared_memory: SharedMemory) -> Self {
            self.$options().shared_memory = shared_memory;
            self
        }

        /// Frame, chunk and idle limits.
        pub fn limits(mut self, limits: ConnectionLimits) -> Self {
            self.$options().limits = limits;
            self
        }

        /// The largest tensor the client accepts from the node, in bytes: a larger one is
        /// refused before memory is allocated for it.
        pub fn max_tensor_bytes(mut self, bytes: u64) -> Self {
            self.$options().max_tensor_bytes = bytes;
            self
        }
    };
}

impl ConnectOptions {
    fn options(&mut self) -> &mut ConnectOptions {
        self
    }

    setters!(options);

    /// A connection to `addr` with these options.
    pub fn to(self, addr: impl Into<Endpoint>) -> Connect {
        Connect {
            endpoint: addr.into(),
            options: self,
        }
    }

    /// Whether a token is set.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Whether TLS is set.
    pub fn has_tls(&self) -> bool {
        self.tls.is_some()
    }
}

impl Connect {
    fn options(&mut self) -> &mut ConnectOptions {
        &mut self.options
    }

    setters!(options);

    /// The address.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// Opens the connection.
    pub async fn open(self) -> Result<Client, ClientError> {
        let options = &self.options;
        let dial = Dial {
            token: options.token.as_ref(),
            agent: AGENT,
            tls: options.tls.as_ref(),
            check: &options.check,
            clear_tokens: options.clear_tokens,
            shared_memory: options.shared_memory,
            limits: options.limits,
        };
        let exchange = match dial.open(&self.endpoint).await {
            Ok(exchange) => exchange,
            // The address in the error: "cannot reach HOST:PORT: connection refused".
            Err(ExchangeError::Connection(source)) => {
                return Err(ClientError::Unreachable {
                    node: self.endpoint.to_string(),
                    source,
                });
            }
            Err(other) => return Err(other.into()),
        };
        Ok(Client::over(
            exchange,
            options.max_tensor_bytes,
            self.endpoint,
        ))
    }

    /// Opens the connection for code without a runtime: a [`BlockingClient`].
    pub fn blocking(self) -> Result<BlockingClient, ClientError> {
        BlockingClient::open(self)
    }
}

impl IntoFuture for Connect {
    type Output = Result<Client, ClientError>;
    type IntoFuture = Pin<Box<dyn Future<Output = Self::Output> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(self.open())
    }
}
