//! A node's connection to a source node it pulls from: the handshake, then `Fetch` (a guard that
//! must be followed by its payload) and `Release`. Node to node only; no client API.

use ferry_io::connection::SealedRegion;
use ferry_io::handshake::{self, HelloError};
use ferry_io::{
    ClientTls, Connection, ConnectionError, ConnectionLimits, Endpoint, PayloadRoute, RegionUse,
    Stream, TensorAssembler,
};
use ferry_proto::{
    ErrorCode, ErrorReply, ProtoError, Request, Response, TensorInfo, TensorMeta, Welcome,
};

use crate::node::AGENT;

/// Why an exchange with a source failed.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The connection failed or the source broke the protocol.
    #[error(transparent)]
    Connection(#[from] ConnectionError),
    /// The source refused or failed the request; `message` is its own.
    #[error("{code:?}: {message}")]
    Node {
        /// What kind of failure.
        code: ErrorCode,
        /// The source's message.
        message: String,
    },
    /// The source answered something that does not fit the request.
    #[error("unexpected answer from the source: {0}")]
    Unexpected(String),
    /// The source's certificate names another node than the one listed at its address (or the
    /// link has no certificate to show): nothing was sent to it.
    #[error("the source's certificate names {certified:?}, not the peer {expected:?} listed there")]
    NotThePeer {
        /// The identity listed.
        expected: String,
        /// What its certificate names (`None`: no certificate, not a TLS link).
        certified: Option<String>,
    },
    /// An earlier exchange on this connection did not finish (an error mid-answer, a fetch whose
    /// payload was never read, a cancelled call): answers could be misattributed.
    #[error("the connection to the source is out of step after an unfinished exchange")]
    OutOfStep,
}

impl SourceError {
    /// The source's error code, when the source reported the failure.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            SourceError::Node { code, .. } => Some(*code),
            _ => None,
        }
    }
}

impl From<ErrorReply> for SourceError {
    fn from(reply: ErrorReply) -> Self {
        SourceError::Node {
            code: reply.code,
            message: reply.message,
        }
    }
}

impl From<HelloError> for SourceError {
    fn from(error: HelloError) -> Self {
        match error {
            HelloError::Connection(e) => SourceError::Connection(e),
            HelloError::Refused(reply) => reply.into(),
            HelloError::Unexpected(what) => SourceError::Unexpected(what),
        }
    }
}

impl From<ProtoError> for SourceError {
    fn from(e: ProtoError) -> Self {
        SourceError::Connection(ConnectionError::Proto(e))
    }
}

fn unexpected(response: Response) -> SourceError {
    match response {
        Response::Error(reply) => reply.into(),
        other => SourceError::Unexpected(format!("{other:?}")),
    }
}

/// How this node reaches its sources.
#[derive(Debug, Clone)]
pub struct SourceConfig<'a> {
    /// The token presented to the source.
    pub token: Option<&'a str>,
    /// Frame, chunk and idle limits.
    pub limits: ConnectionLimits,
    /// Take payloads as shared-memory regions where the source offers them.
    pub shared_memory: bool,
    /// Mutual TLS to sources over TCP (this node's certificate presented, the source's
    /// verified); `None` for TCP in clear.
    pub tls: Option<&'a ClientTls>,
    /// The identity the source's certificate must carry, checked before anything is sent to it
    /// (the token included); `None` for any certificate the CA signed for the address.
    pub identity: Option<&'a str>,
    /// Over a Unix socket, require that this very user serves it (root not counted), before
    /// anything is sent: for a socket whose path came from a cluster's directory.
    pub own_user_socket: bool,
}

/// One connection to a source node. Exchanges on it run one at a time.
#[derive(Debug)]
pub struct SourceConnection {
    conn: Connection<Stream>,
    welcome: Welcome,
    /// An exchange began and did not finish: the next answer may belong to it.
    out_of_step: bool,
}

/// A fetch the source answered: the tensor it is sending and its meta. The payload follows on
/// the wire, so the connection is usable again only once [`payload`](Self::payload) has read it;
/// dropping the guard instead leaves the connection out of step.
#[derive(Debug)]
pub struct Fetch<'a> {
    source: &'a mut SourceConnection,
    /// The tensor the capability names.
    pub info: TensorInfo,
    /// Its validated meta: what the payload must fill.
    pub meta: TensorMeta,
}

impl SourceConnection {
    /// Connects to the source at `addr` and says hello.
    pub async fn open(
        addr: impl Into<Endpoint>,
        config: SourceConfig<'_>,
    ) -> Result<Self, SourceError> {
        let socket = addr
            .into()
            .connect(config.tls)
            .await
            .map_err(ConnectionError::from)?;
        if config.own_user_socket {
            socket.require_own_user().map_err(ConnectionError::from)?;
        }
        if let Some(expected) = config.identity {
            let certified = socket.peer_identity().map(|id| id.as_str());
            if certified != Some(expected) {
                return Err(SourceError::NotThePeer {
                    expected: expected.to_string(),
                    certified: certified.map(str::to_string),
                });
            }
        }
        let mut conn = Connection::new(socket, config.limits);
        let offer = handshake::Offer {
            token: config.token,
            agent: AGENT,
            shared_memory: config.shared_memory,
        };
        let welcome = handshake::hello(&mut conn, offer).await?;
        Ok(Self {
            conn,
            welcome,
            out_of_step: false,
        })
    }

    /// What the source said when the connection opened.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// Whether every exchange on this connection finished, so that it can take another.
    pub fn in_step(&self) -> bool {
        !self.out_of_step
    }

    /// Starts an exchange, unless an earlier one was left unfinished.
    fn begin(&mut self) -> Result<(), SourceError> {
        if self.out_of_step {
            return Err(SourceError::OutOfStep);
        }
        self.out_of_step = true;
        Ok(())
    }

    /// Ends an exchange: it finished if it succeeded or the source answered with an error.
    fn end<T>(&mut self, result: Result<T, SourceError>) -> Result<T, SourceError> {
        if matches!(&result, Ok(_) | Err(SourceError::Node { .. })) {
            self.out_of_step = false;
        }
        result
    }

    /// Asks for the tensor `capability` names, bound to `node_id`, from `offset` on.
    pub async fn fetch(
        &mut self,
        capability: &str,
        node_id: &str,
        offset: u64,
    ) -> Result<Fetch<'_>, SourceError> {
        self.begin()?;
        let request = Request::Fetch {
            capability: capability.to_string(),
            node_id: node_id.to_string(),
            offset,
        };
        let answer = async {
            self.conn.write_request(&request).await?;
            match self.conn.read_response().await? {
                Response::Tensor { info, meta } => {
                    let meta = TensorMeta::try_from(&meta).map_err(ProtoError::from)?;
                    Ok((info, meta))
                }
                other => Err(unexpected(other)),
            }
        }
        .await;
        match answer {
            // Still in the exchange: the payload follows.
            Ok((info, meta)) => Ok(Fetch {
                source: self,
                info,
                meta,
            }),
            Err(e) => self.end(Err(e)),
        }
    }

    /// Tells the source every byte arrived, which uses the capability up.
    pub async fn release(&mut self, capability: &str, node_id: &str) -> Result<(), SourceError> {
        self.begin()?;
        let request = Request::Release {
            capability: capability.to_string(),
            node_id: node_id.to_string(),
        };
        let result = async {
            self.conn.write_request(&request).await?;
            match self.conn.read_response().await? {
                Response::Released => Ok(()),
                other => Err(unexpected(other)),
            }
        }
        .await;
        self.end(result)
    }
}

impl Fetch<'_> {
    /// Reads the payload into `assembler`, from where its verified bytes end, doing with a
    /// payload that comes as a shared-memory region what `regions` says; ends the exchange.
    pub async fn payload(
        self,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<(PayloadRoute, Option<SealedRegion>), SourceError> {
        let result = self
            .source
            .conn
            .read_payload_keeping(assembler, regions)
            .await
            .map_err(SourceError::from);
        self.source.end(result)
    }
}
