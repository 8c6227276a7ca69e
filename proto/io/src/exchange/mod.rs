//! `Exchange`: the request/answer discipline every ferry client runs on one connection (the
//! application's `Client`, and a node pulling from a source). Here: the connection and what the
//! node said when it opened, and the [`Step`] guard through which alone requests and answers pass.
//! How a connection is opened is in `dial`, a pulling node's fetch and release in `fetch`, the
//! errors in `error`.
//!
//! The invariant: answers are read in the order requests were written, so an exchange that
//! stops half-way (an error mid-answer, a cancelled future) leaves answers on the wire that
//! belong to it. Every request therefore goes through a `Step`; a step that is not
//! [`finish`](Step::finish)ed (dropped by `?` or by cancellation) leaves the connection out of
//! step, and every later [`begin`](Exchange::begin) refuses with
//! [`ExchangeError::OutOfStep`] instead of reading a stale answer as its own.

mod dial;
mod error;
mod fetch;

pub use dial::{ClearTokens, Dial, LocalServer, PeerCheck, SharedMemory, TokenWithheld};
pub use error::ExchangeError;
pub use fetch::Fetch;

use ferry_proto::{Request, Response, Welcome};

use crate::TensorAssembler;
use crate::connection::{Connection, Known, PayloadRoute, RegionUse, SealedRegion};
use crate::transport::Stream;

/// One connection to a node, on which exchanges run one at a time.
#[derive(Debug)]
pub struct Exchange {
    conn: Connection<Stream>,
    welcome: Welcome,
    state: State,
}

/// Whether the connection can take another exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Every exchange finished: the next answer on the wire belongs to the next request.
    InStep,
    /// An exchange is running, or began and never finished.
    Unfinished,
}

/// One exchange in progress: the only way to write requests and read answers. Dropped without
/// [`finish`](Self::finish) once it wrote or read a byte, it leaves the connection out of step;
/// dropped before (a request refused before it was sent), it leaves it as it was.
#[derive(Debug)]
pub struct Step<'a> {
    exchange: &'a mut Exchange,
    /// Whether a byte may have been written or read: from then on, only `finish` puts the
    /// connection back in step.
    used: bool,
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        if !self.used {
            self.exchange.state = State::InStep;
        }
    }
}

impl Exchange {
    /// An exchange over a connection whose handshake ended in `welcome`.
    pub(crate) fn new(conn: Connection<Stream>, welcome: Welcome) -> Self {
        Self {
            conn,
            welcome,
            state: State::InStep,
        }
    }

    /// What the node said when the connection opened.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// Whether payloads travel through shared memory (a Unix socket to a node that agreed).
    pub fn shared_memory(&self) -> bool {
        self.conn.shared_memory()
    }

    /// The protocol minor this connection speaks with the node: the lower of the two.
    pub fn node_minor(&self) -> u16 {
        self.conn.peer_minor()
    }

    /// Whether every exchange so far finished, so that the connection can take another.
    pub fn in_step(&self) -> bool {
        self.state == State::InStep
    }

    /// Starts an exchange, unless an earlier one was left unfinished.
    pub fn begin(&mut self) -> Result<Step<'_>, ExchangeError> {
        match self.state {
            State::Unfinished => Err(ExchangeError::OutOfStep),
            State::InStep => {
                self.state = State::Unfinished;
                Ok(Step {
                    exchange: self,
                    used: false,
                })
            }
        }
    }

    /// One request and its one answer: `pick` takes the answer of the kind the request expects
    /// (`None` for any other, which is then [`ExchangeError::Unexpected`]). A refusal by the
    /// node finishes the exchange like an answer does.
    pub async fn call<T>(
        &mut self,
        request: &Request,
        pick: impl FnOnce(Response) -> Option<T>,
    ) -> Result<T, ExchangeError> {
        let mut step = self.begin()?;
        step.send(request).await?;
        let answer = step.answer(pick).await;
        step.finish_if_answered(answer)
    }
}

impl Step<'_> {
    /// The protocol minor this exchange speaks with the node: the lower of the two, which the
    /// connection encodes and decodes as (what the node can be asked).
    pub fn node_minor(&self) -> u16 {
        self.exchange.conn.peer_minor()
    }

    /// Whether payloads travel through shared memory.
    pub fn shared_memory(&self) -> bool {
        self.exchange.conn.shared_memory()
    }

    /// Writes `request`, unless the node's minor is too old for it (then nothing is sent: a step
    /// that sent nothing else leaves the connection in step when dropped).
    pub async fn send(&mut self, request: &Request) -> Result<(), ExchangeError> {
        let needs = request.since_minor();
        let node = self.node_minor();
        if needs > node {
            return Err(ExchangeError::NodeTooOld {
                what: request.name(),
                node,
                needs,
            });
        }
        // Set before the write: a write cancelled half-way has left part of a frame.
        self.used = true;
        Ok(self.exchange.conn.write_request(request).await?)
    }

    /// Reads the next answer: the node's refusal as [`ExchangeError::Refused`], an answer `pick`
    /// does not take (`None`) as [`ExchangeError::Unexpected`].
    pub async fn answer<T>(
        &mut self,
        pick: impl FnOnce(Response) -> Option<T>,
    ) -> Result<T, ExchangeError> {
        self.used = true;
        match self.exchange.conn.read_response().await? {
            Response::Error(reply) => Err(ExchangeError::Refused(reply)),
            answer => {
                let kind = answer.name();
                pick(answer).ok_or_else(|| {
                    ExchangeError::Unexpected(format!("a {kind} answer to this request"))
                })
            }
        }
    }

    /// Writes a payload (after a request that announced it).
    pub async fn send_payload(&mut self, payload: &[u8]) -> Result<PayloadRoute, ExchangeError> {
        self.send_payload_parts(&[payload]).await
    }

    /// Writes a payload that lies in several slices, end to end, without joining them (after a
    /// request that announced it).
    pub async fn send_payload_parts(
        &mut self,
        parts: &[&[u8]],
    ) -> Result<PayloadRoute, ExchangeError> {
        self.used = true;
        Ok(self.exchange.conn.write_payload_parts(parts, 0).await?)
    }

    /// Writes a payload that lies in several slices as chunk frames, never as a region (an eager
    /// put's, which the node reads as chunks only).
    pub async fn send_payload_chunks(&mut self, parts: &[&[u8]]) -> Result<(), ExchangeError> {
        self.used = true;
        // The whole payload, always as chunks: a part that is all of it.
        let whole = 0..usize::MAX;
        Ok(self
            .exchange
            .conn
            .write_payload_part(parts, whole, Known::default())
            .await?)
    }

    /// How a whole payload of `len` bytes sent now travels (see
    /// [`Connection::whole_payload_route`]).
    pub fn whole_payload_route(&self, len: usize) -> PayloadRoute {
        self.exchange.conn.whole_payload_route(len)
    }

    /// Reads chunk frames the node announced into `sink` until it is complete.
    pub async fn read_chunks<K: crate::ChunkSink>(
        &mut self,
        sink: &mut K,
    ) -> Result<(), ExchangeError> {
        self.used = true;
        Ok(self.exchange.conn.read_chunks(sink).await?)
    }

    /// Reads a payload the node announced into `assembler`, doing with a payload that comes as a
    /// shared-memory region what `regions` says.
    pub async fn read_payload(
        &mut self,
        assembler: &mut TensorAssembler,
        regions: RegionUse,
    ) -> Result<(PayloadRoute, Option<SealedRegion>), ExchangeError> {
        self.used = true;
        Ok(self
            .exchange
            .conn
            .read_payload_keeping(assembler, regions)
            .await?)
    }

    /// Ends the exchange: every answer it asked for was read, so the connection takes the next.
    pub fn finish(self) {
        self.exchange.state = State::InStep;
    }

    /// Ends the exchange with `error`: finished where the node refused (it answered in full),
    /// left out of step otherwise.
    pub fn fail(self, error: ExchangeError) -> ExchangeError {
        if matches!(error, ExchangeError::Refused(_)) {
            self.finish();
        }
        error
    }

    /// Ends the exchange where `result` says the node answered in full (a success, or the node's
    /// refusal); anything else leaves the connection out of step.
    pub fn finish_if_answered<T>(
        self,
        result: Result<T, ExchangeError>,
    ) -> Result<T, ExchangeError> {
        if matches!(&result, Ok(_) | Err(ExchangeError::Refused(_))) {
            self.finish();
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ferry_proto::{ErrorCode, ErrorReply, FEATURES, PROTOCOL_MINOR, PROTOCOL_VERSION};
    use tokio::net::{TcpListener, TcpStream};

    use super::*;
    use crate::connection::ConnectionLimits;
    use crate::transport::Endpoint;

    /// A node that welcomes one client at `minor` and answers each request with what `answer`
    /// says (`None`: no answer at all).
    async fn node(minor: u16, answer: fn(&Request) -> Option<Response>) -> Endpoint {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            let mut conn: Connection<TcpStream> =
                Connection::new(socket, ConnectionLimits::default());
            // Welcomed as a node welcomes a client with no credential asked (the node's half of
            // the handshake is ferry-server's): the features both speak, and from the `Hello`
            // on, the lower of the two minors.
            let Ok(Some(Request::Hello(hello))) = conn.read_request().await else {
                panic!("the client's first message is its Hello");
            };
            conn.set_peer_minor(hello.minor);
            let limits = ConnectionLimits::default();
            let welcome = Welcome {
                major: PROTOCOL_VERSION,
                minor: PROTOCOL_MINOR,
                features: FEATURES
                    .iter()
                    .filter(|f| hello.features.iter().any(|g| g == *f))
                    .map(|f| f.to_string())
                    .collect(),
                agent: "test node".to_string(),
                max_body: limits.max_body as u64,
                chunk_size: limits.chunk_size as u64,
            };
            conn.write_response(&Response::Welcome(welcome))
                .await
                .unwrap();
            // Answered as a node of `minor` would, whatever the client speaks.
            conn.set_peer_minor(minor.min(conn.peer_minor()));
            while let Ok(Some(request)) = conn.read_request().await {
                if let Some(answer) = answer(&request) {
                    conn.write_response(&answer).await.unwrap();
                }
            }
        });
        Endpoint::from(addr)
    }

    async fn open(endpoint: &Endpoint) -> Exchange {
        let dial = Dial {
            token: None,
            agent: "test client",
            tls: None,
            check: &PeerCheck::Any,
            clear_tokens: Default::default(),
            shared_memory: SharedMemory::Decline,
            limits: ConnectionLimits::default(),
        };
        dial.open(endpoint).await.unwrap()
    }

    fn identity(answer: Response) -> Option<()> {
        match answer {
            Response::Identity { .. } => Some(()),
            _ => None,
        }
    }

    #[tokio::test]
    async fn a_refusal_finishes_the_exchange_and_an_answer_of_another_kind_does_not() {
        let endpoint = node(7, |request| {
            Some(match request {
                Request::Stat => Response::Error(ErrorReply {
                    code: ErrorCode::BadRequest,
                    message: "no".into(),
                }),
                _ => Response::Released,
            })
        })
        .await;
        let mut exchange = open(&endpoint).await;
        let refused = exchange.call(&Request::Stat, identity).await;
        assert_eq!(refused.unwrap_err().code(), Some(ErrorCode::BadRequest));
        assert!(exchange.in_step(), "a refusal is a whole answer");
        let odd = exchange.call(&Request::Identify, identity).await;
        assert!(matches!(odd, Err(ExchangeError::Unexpected(_))), "{odd:?}");
        assert!(!exchange.in_step(), "the node broke the exchange");
        let after = exchange.call(&Request::Identify, identity).await;
        assert!(matches!(after, Err(ExchangeError::OutOfStep)), "{after:?}");
    }

    #[tokio::test]
    async fn a_call_cancelled_while_waiting_for_its_answer_puts_the_connection_out_of_step() {
        // The node answers nothing, as if still working: the call is dropped after its request.
        let endpoint = node(7, |_| None).await;
        let mut exchange = open(&endpoint).await;
        let waiting = exchange.call(&Request::Identify, identity);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), waiting)
                .await
                .is_err()
        );
        assert!(!exchange.in_step());
        let next = exchange.call(&Request::Identify, identity).await;
        assert!(matches!(next, Err(ExchangeError::OutOfStep)), "{next:?}");
    }

    #[tokio::test]
    async fn a_request_the_node_is_too_old_for_is_refused_unsent_and_the_connection_stays_usable() {
        let endpoint = node(4, |request| match request {
            Request::Identify => Some(Response::Identity {
                node_id: "old".into(),
            }),
            _ => Some(Response::Released),
        })
        .await;
        let mut exchange = open(&endpoint).await;
        assert_eq!(exchange.welcome().minor, PROTOCOL_MINOR);
        // The test node welcomes at this build's minor and then speaks minor 4: so does this side.
        exchange.conn.set_peer_minor(4);
        let holds = exchange
            .call(&Request::Holds { device: 0 }, |_| Some(()))
            .await;
        assert!(
            matches!(
                holds,
                Err(ExchangeError::NodeTooOld {
                    node: 4,
                    needs: 5,
                    ..
                })
            ),
            "{holds:?}"
        );
        assert!(exchange.in_step(), "nothing was sent");
        exchange.call(&Request::Identify, identity).await.unwrap();
        let unused = exchange.begin().unwrap();
        drop(unused);
        assert!(
            exchange.in_step(),
            "a step that touched nothing changes nothing"
        );
    }

    /// A source that answers a ranged fetch with a part that is not the one asked for (another
    /// start, or an end that is neither the part's nor the payload's) is refused before any
    /// payload byte is read, the connection out of step; the part asked for, or the rest of the
    /// payload from its start, is taken.
    #[tokio::test]
    async fn a_ranged_fetch_takes_only_the_part_asked_for_or_the_rest_of_the_payload() {
        // A [4, 1000] f32 tensor: 16000 payload bytes after a 25-byte prefix (tag, rank, 2 dims).
        fn part(start: u64, end: u64) -> Option<Response> {
            let meta =
                ferry_proto::TensorMeta::new(vec![4, 1000], ferry_proto::DType::F32).unwrap();
            Some(Response::TensorPart {
                info: ferry_proto::TensorInfo {
                    key: ferry_proto::TensorKey::new(0, "w"),
                    dtype: ferry_proto::DType::F32.into(),
                    shape: vec![4, 1000],
                    bytes: 16_000,
                    path: ferry_proto::TransferPath::Put,
                },
                meta: meta.to_wire(),
                start,
                end,
            })
        }
        type Answer = fn(&Request) -> Option<Response>;
        let cases: [(Answer, bool); 5] = [
            (|_| part(1024 - 25, 2048 - 25), true),
            (|_| part(1024 - 25, 16_000), true),
            (|_| part(1024 - 24, 2048 - 25), false),
            (|_| part(1024 - 25, 2048), false),
            (|_| part(1024 - 25, 16_001), false),
        ];
        for (i, (answer, taken)) in cases.into_iter().enumerate() {
            let endpoint = node(PROTOCOL_MINOR, answer).await;
            let mut exchange = open(&endpoint).await;
            let fetch = exchange
                .fetch_range(&"cap".into(), &"node-b".into(), 1024..2048)
                .await
                .map(|fetch| fetch.range);
            match fetch {
                Ok(range) => assert!(taken, "case {i}: {range:?} taken"),
                Err(error) => {
                    assert!(!taken, "case {i}: {error}");
                    assert!(
                        matches!(error, ExchangeError::Unexpected(_)),
                        "case {i}: {error}"
                    );
                    assert!(!exchange.in_step(), "case {i}");
                }
            }
        }
    }

    /// A source of minor 7 is never asked for a range: nothing is sent, the connection stays in
    /// step (a pull then fetches the tensor whole).
    #[tokio::test]
    async fn a_ranged_fetch_is_not_sent_to_a_source_of_minor_7() {
        let endpoint = node(7, |_| Some(Response::Released)).await;
        let mut exchange = open(&endpoint).await;
        exchange.conn.set_peer_minor(7);
        assert_eq!(exchange.node_minor(), 7);
        let fetch = exchange
            .fetch_range(&"cap".into(), &"node-b".into(), 0..4096)
            .await
            .map(|f| f.range);
        assert!(
            matches!(
                fetch,
                Err(ExchangeError::NodeTooOld {
                    node: 7,
                    needs: 8,
                    ..
                })
            ),
            "{fetch:?}"
        );
        assert!(exchange.in_step());
    }
}
