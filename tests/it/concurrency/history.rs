//! The recorded history of a randomized run: keys, operations with their invoke and completion
//! times and outcomes, the encoding that makes every put's bytes unique, and a summary of counts.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Instant;

use ferry_client::{ClientError, ErrorCode};
use ferry_proto::{DType, TensorData, TensorKey};

/// The nodes of a run, by index: a key's `node` indexes this.
pub const NODE_NAMES: [&str; 2] = ["A", "B"];

/// Mixed into the second element of a value's tensor, so that bytes which merely start with a
/// known write id (a truncated or foreign tensor) do not pass as that write.
const PATTERN: u64 = 0x5555_5555_5555_5555;

/// Where a tensor lives in the cluster: a node, one of its devices, a name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    pub node: usize,
    pub device: u32,
    /// The name is `k{name}`.
    pub name: u8,
}

impl Key {
    pub fn new(node: usize, device: u32, name: u8) -> Self {
        Self { node, device, name }
    }

    pub fn name(&self) -> String {
        format!("k{}", self.name)
    }

    /// The key as its node knows it.
    pub fn tensor_key(&self) -> TensorKey {
        TensorKey::new(self.device, self.name())
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let node = NODE_NAMES.get(self.node).copied().unwrap_or("?");
        write!(f, "{node}/{}/k{}", self.device, self.name)
    }
}

/// What a client asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpKind {
    /// An upload of `value` (a write id) under `key`, replacing what is there.
    Put {
        key: Key,
        value: u64,
    },
    Get {
        key: Key,
    },
    Delete {
        key: Key,
    },
    /// A copy, or with `remove_source` a move, from `src` to `dst`, replacing what is there:
    /// `Client::transfer` when both are on one node, `copy_keys` (a pull by the target node)
    /// when they are not.
    Transfer {
        src: Key,
        dst: Key,
        remove_source: bool,
    },
}

impl OpKind {
    /// Whether the operation reads, writes or removes `key`.
    pub fn touches(&self, key: Key) -> bool {
        match *self {
            OpKind::Put { key: k, .. } | OpKind::Get { key: k } | OpKind::Delete { key: k } => {
                k == key
            }
            OpKind::Transfer { src, dst, .. } => src == key || dst == key,
        }
    }

    /// A short name of the kind, for counts.
    pub fn label(&self) -> &'static str {
        match *self {
            OpKind::Put { .. } => "put",
            OpKind::Get { .. } => "get",
            OpKind::Delete { .. } => "delete",
            OpKind::Transfer {
                src,
                dst,
                remove_source,
            } => match (src.node == dst.node, remove_source) {
                (true, false) => "copy",
                (true, true) => "move",
                (false, false) => "node copy",
                (false, true) => "node move",
            },
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            OpKind::Put { key, value } => write!(f, "put {key} = {value:#x}"),
            OpKind::Get { key } => write!(f, "get {key}"),
            OpKind::Delete { key } => write!(f, "delete {key}"),
            OpKind::Transfer { src, dst, .. } => write!(f, "{} {src} -> {dst}", self.label()),
        }
    }
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The node acknowledged it (`Stored`, `Deleted`).
    Ok,
    /// A get answered the tensor of the put of this value.
    Read(u64),
    /// A get answered a tensor that is no put's encoding (wrong dtype, shape or bytes).
    Garbled(String),
    /// A node-to-node move registered its target but kept its source, which changed meanwhile
    /// (`ClientError::SourceChanged`): it did what a copy does.
    SourceKept,
    /// The node answered with an error.
    Refused { code: ErrorCode, message: String },
    /// The connection failed or answered out of step: the operation may or may not have taken
    /// effect, now or later.
    Unknown(String),
}

impl Outcome {
    /// The outcome of a call that answered nothing to record but success.
    pub fn of<T>(result: Result<T, ClientError>) -> Self {
        match result {
            Ok(_) => Outcome::Ok,
            Err(error) => Self::of_error(error),
        }
    }

    pub fn of_error(error: ClientError) -> Self {
        match error {
            ClientError::Node { code, message } => Outcome::Refused { code, message },
            ClientError::SourceChanged { .. } => Outcome::SourceKept,
            other => Outcome::Unknown(other.to_string()),
        }
    }

    /// A short name of the outcome, for counts.
    pub fn label(&self) -> String {
        match self {
            Outcome::Ok => "ok".into(),
            Outcome::Read(_) => "value".into(),
            Outcome::Garbled(_) => "garbled".into(),
            Outcome::SourceKept => "source kept".into(),
            Outcome::Refused { code, .. } => format!("{code:?}"),
            Outcome::Unknown(_) => "unknown".into(),
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Outcome::Ok => write!(f, "ok"),
            Outcome::Read(value) => write!(f, "{value:#x}"),
            Outcome::Garbled(why) => write!(f, "garbled ({why})"),
            Outcome::SourceKept => write!(f, "copied, source kept (it changed meanwhile)"),
            Outcome::Refused { code, message } => write!(f, "{code:?} ({message})"),
            Outcome::Unknown(why) => write!(f, "unknown ({why})"),
        }
    }
}

/// One operation of one client. Times are nanoseconds on the run's [`Clock`]: `invoke` right
/// before the request went out, `complete` right after the answer came back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub client: usize,
    pub kind: OpKind,
    pub invoke: u64,
    pub complete: u64,
    pub outcome: Outcome,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "c{} [{:>10.3} ms, {:>10.3} ms] {} -> {}",
            self.client,
            self.invoke as f64 / 1e6,
            self.complete as f64 / 1e6,
            self.kind,
            self.outcome
        )
    }
}

/// The run's monotonic clock, shared by every client so that their times compare.
#[derive(Debug, Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    pub fn start() -> Self {
        Self(Instant::now())
    }

    /// Nanoseconds since the run started.
    pub fn now(&self) -> u64 {
        self.0.elapsed().as_nanos() as u64
    }
}

/// The tensor a put of `value` uploads: two I64 elements, the value and the value mixed with a
/// fixed pattern, so that a read maps back to exactly one put.
pub fn encode(value: u64) -> TensorData {
    TensorData::new(vec![value as i64, (value ^ PATTERN) as i64], [2])
}

/// The value whose tensor `data` is, or why it is no value's.
pub fn decode(data: &TensorData) -> Result<u64, String> {
    if data.dtype() != DType::I64 {
        return Err(format!("dtype {:?}, not I64", data.dtype()));
    }
    if data.shape().as_slice() != [2] {
        return Err(format!("shape {:?}, not [2]", data.shape().as_slice()));
    }
    let bytes = data.as_bytes();
    let element = |i: usize| -> Option<u64> {
        let slice = bytes.get(i * 8..i * 8 + 8)?;
        Some(u64::from_le_bytes(slice.try_into().ok()?))
    };
    match (element(0), element(1)) {
        (Some(value), Some(check)) if check == value ^ PATTERN && bytes.len() == 16 => Ok(value),
        _ => Err(format!("bytes {bytes:02x?} are no put's encoding")),
    }
}

/// Operations by kind and outcome label ([`OpKind::label`], [`Outcome::label`]).
pub type Counts = BTreeMap<(&'static str, String), usize>;

/// Adds the operations of `history` to `counts`.
pub fn count_into(counts: &mut Counts, history: &[Op]) {
    for op in history {
        *counts
            .entry((op.kind.label(), op.outcome.label()))
            .or_insert(0) += 1;
    }
}

/// How many operations of kind `kind` ended with outcome `outcome`.
pub fn count(counts: &Counts, kind: &'static str, outcome: &str) -> usize {
    counts
        .get(&(kind, outcome.to_string()))
        .copied()
        .unwrap_or(0)
}

/// The operations of unknown outcome by kind and reason, with their counts: these weaken what
/// the checker can tell, so a run shows them.
pub fn unknown_outcomes(history: &[Op]) -> BTreeMap<(&'static str, &str), usize> {
    let mut counts = BTreeMap::new();
    for op in history {
        if let Outcome::Unknown(why) = &op.outcome {
            *counts.entry((op.kind.label(), why.as_str())).or_insert(0) += 1;
        }
    }
    counts
}
