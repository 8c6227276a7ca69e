//! Randomized, seeded histories of clients racing on a few shared keys of two nodes (puts, gets,
//! deletes, copies and moves in one node and node to node), checked Jepsen-style for phantom
//! and stale reads and lost acknowledged writes.
//!
//! `FERRY_HISTORY_SEED`, `FERRY_HISTORY_SECS` and `FERRY_HISTORY_CLIENTS` set the seed, the
//! duration and the number of clients; `tests/history.sh` runs the long, ignored test. The seed
//! fixes each client's sequence of operations, not how they interleave: a failure prints the
//! history around it, and with `FERRY_HISTORY_DUMP=PATH` writes the whole round to PATH.
//!
//! A run goes in rounds of at most ten seconds, each ending with every client stopped and every
//! key read, and each checked as one history that opens with the state the previous round ended
//! in, so that a long run needs no more memory than a short one.

#[path = "concurrency/checker.rs"]
mod checker;
#[path = "concurrency/history.rs"]
mod history;

use ferry_proto::{IfExists, Transfer};
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::{Duration, Instant};

use ferry_client::{Client, ClientError, ErrorCode, NodeCopy};
use ferry_testkit::{TestNode, start_with};
use history::{Clock, Counts, Key, Op, OpKind, Outcome, count_into};

/// Devices per node, and names per device: keys are (node, device, name).
const DEVICES: u32 = 2;
const NAMES: u8 = 3;

/// The longest stretch of racing checked as one history: a long run is a sequence of rounds.
const ROUND: Duration = Duration::from_secs(10);

/// The most operations one round records, over all its clients: a history stays checkable.
const MAX_OPS: usize = 500_000;

/// How long a client waits before connecting again after a connection failed.
const RECONNECT_PAUSE: Duration = Duration::from_millis(10);

/// What a run does, from the environment or the test's defaults.
#[derive(Debug, Clone, Copy)]
struct Settings {
    seed: u64,
    duration: Duration,
    clients: usize,
}

impl Settings {
    fn from_env(default_secs: f64, default_clients: usize) -> Self {
        let secs: f64 = env_or("FERRY_HISTORY_SECS", default_secs);
        Self {
            seed: env_or("FERRY_HISTORY_SEED", 1),
            duration: Duration::from_secs_f64(secs),
            clients: env_or("FERRY_HISTORY_CLIENTS", default_clients).max(1),
        }
    }
}

fn env_or<T: FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?} does not parse")),
        Err(_) => default,
    }
}

/// SplitMix64: a small, seedable generator, so that a seed names the same operations on every
/// platform and toolchain.
struct SplitMix64(u64);

impl SplitMix64 {
    fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform enough in `0..n` for picking operations.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A client of the run: one connection to each node, opened on first use and again after a
/// connection error (after which the old one may be out of step).
struct Racer {
    index: usize,
    addrs: [SocketAddr; 2],
    connections: [Option<Client>; 2],
    rng: SplitMix64,
    writes: u64,
    connect_failures: usize,
}

impl Racer {
    fn random_key(&mut self, node: usize) -> Key {
        let device = self.rng.below(DEVICES.into()) as u32;
        let name = self.rng.below(NAMES.into()) as u8;
        Key::new(node, device, name)
    }

    /// The next operation: mostly reads and writes, with every kind of transfer among them.
    fn next_kind(&mut self) -> OpKind {
        let node = self.rng.below(2) as usize;
        let key = self.random_key(node);
        match self.rng.below(100) {
            0..34 => OpKind::Get { key },
            34..58 => {
                self.writes += 1;
                // Unique over the run: the client in the high bits, its count in the low ones.
                let value = ((self.index as u64 + 1) << 40) | self.writes;
                OpKind::Put { key, value }
            }
            58..66 => OpKind::Delete { key },
            choice => {
                let (dst_node, remove_source) = match choice {
                    66..74 => (node, false),
                    74..80 => (node, true),
                    80..92 => (1 - node, false),
                    _ => (1 - node, true),
                };
                let mut dst = self.random_key(dst_node);
                if dst_node == node && dst.device == key.device {
                    // In one node a transfer goes to the other device (one key to itself is
                    // refused).
                    dst.device = (key.device + 1) % DEVICES;
                }
                OpKind::Transfer {
                    src: key,
                    dst,
                    remove_source,
                }
            }
        }
    }

    /// Connects to every node this operation needs; false if one could not be reached.
    async fn connect(&mut self, kind: &OpKind) -> bool {
        let nodes: &[usize] = match *kind {
            OpKind::Transfer { src, dst, .. } if src.node != dst.node => &[0, 1],
            _ => &[home_node(kind)][..],
        };
        for &node in nodes {
            if self.connections[node].is_none() {
                match Client::connect(self.addrs[node]).await {
                    Ok(client) => self.connections[node] = Some(client),
                    Err(_) => {
                        self.connect_failures += 1;
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                        return false;
                    }
                }
            }
        }
        true
    }

    /// Runs one operation and records it; `None` if a node could not be reached, so that
    /// nothing was sent.
    async fn run(&mut self, kind: OpKind, clock: &Clock) -> Option<Op> {
        if !self.connect(&kind).await {
            return None;
        }
        let invoke = clock.now();
        let (outcome, broken) = self.send(&kind).await;
        let complete = clock.now();
        for node in broken {
            self.connections[node] = None;
        }
        Some(Op {
            client: self.index,
            kind,
            invoke,
            complete,
            outcome,
        })
    }

    /// Sends `kind` and says how it ended, and which connections can no longer be trusted.
    async fn send(&mut self, kind: &OpKind) -> (Outcome, Vec<usize>) {
        let not_connected = || (Outcome::Unknown("not connected".into()), Vec::new());
        if let OpKind::Transfer {
            src,
            dst,
            remove_source,
        } = *kind
            && src.node != dst.node
        {
            let [to_a, to_b] = &mut self.connections;
            let (Some(to_a), Some(to_b)) = (to_a.as_mut(), to_b.as_mut()) else {
                return not_connected();
            };
            let (source, target) = if src.node == 0 {
                (to_a, to_b)
            } else {
                (to_b, to_a)
            };
            let copy = NodeCopy::new(self.addrs[src.node].to_string())
                .tensor(src.tensor_key(), dst.tensor_key())
                .transfer(Transfer::from_remove_source(remove_source))
                .if_exists(IfExists::Replace);
            let answers = copy.run(source, target).await;
            return match answers.map(|answers| answers.into_iter().next()) {
                Ok(Some(Ok(_))) => (Outcome::Ok, Vec::new()),
                Ok(Some(Err(
                    error @ (ClientError::Node { .. } | ClientError::SourceChanged { .. }),
                ))) => (Outcome::of_error(error), Vec::new()),
                Ok(Some(Err(error))) | Err(error) => {
                    // A node copy pipelines on both connections: either may be out of step now.
                    (Outcome::of_error(error), vec![0, 1])
                }
                Ok(None) => (Outcome::Unknown("no answer for the key".into()), vec![0, 1]),
            };
        }
        let node = home_node(kind);
        match self.connections[node].as_mut() {
            Some(client) => one_node(client, kind, node).await,
            None => not_connected(),
        }
    }
}

/// The node an operation is sent to (a node-to-node transfer's source).
fn home_node(kind: &OpKind) -> usize {
    match *kind {
        OpKind::Put { key, .. } | OpKind::Get { key } | OpKind::Delete { key } => key.node,
        OpKind::Transfer { src, .. } => src.node,
    }
}

/// Sends an operation that concerns one node over `client`, its connection to node `node`.
async fn one_node(client: &mut Client, kind: &OpKind, node: usize) -> (Outcome, Vec<usize>) {
    let outcome = match *kind {
        OpKind::Put { key, value } => {
            let data = history::encode(value);
            Outcome::of(
                client
                    .put(&key.tensor_key(), &data)
                    .if_exists(IfExists::Replace)
                    .await,
            )
        }
        OpKind::Get { key } => match client.get(&key.tensor_key()).await {
            Ok(data) => match history::decode(&data) {
                Ok(value) => Outcome::Read(value),
                Err(why) => Outcome::Garbled(why),
            },
            Err(error) => Outcome::of_error(error),
        },
        OpKind::Delete { key } => Outcome::of(client.delete(&key.tensor_key()).await),
        OpKind::Transfer {
            src,
            dst,
            remove_source,
        } => Outcome::of(
            client
                .transfer(
                    &src.tensor_key(),
                    &dst.tensor_key(),
                    Transfer::from_remove_source(remove_source),
                    IfExists::Replace,
                )
                .await,
        ),
    };
    let broken = match outcome {
        Outcome::Unknown(_) => vec![node],
        _ => Vec::new(),
    };
    (outcome, broken)
}

impl Racer {
    fn new(index: usize, seed: u64, addrs: [SocketAddr; 2]) -> Self {
        Self {
            index,
            addrs,
            connections: [None, None],
            rng: SplitMix64::new(seed ^ (index as u64 + 1).wrapping_mul(0xA076_1D64_78BD_642F)),
            writes: 0,
            connect_failures: 0,
        }
    }

    /// Races until `deadline` or `budget` operations; the client (to race again) and what it
    /// did.
    async fn race(mut self, clock: Clock, deadline: Instant, budget: usize) -> (Self, Vec<Op>) {
        let mut ops = Vec::new();
        while Instant::now() < deadline && ops.len() < budget {
            let kind = self.next_kind();
            ops.extend(self.run(kind, &clock).await);
        }
        (self, ops)
    }
}

/// Reads every key once, with no other client running: the quiescent state a round ends in,
/// recorded as operations of client `reader`.
async fn read_every_key(nodes: &[TestNode; 2], clock: &Clock, reader: usize) -> Vec<Op> {
    let mut reads = Vec::new();
    for (node, test_node) in nodes.iter().enumerate() {
        let mut client = test_node.client().await;
        for device in 0..DEVICES {
            for name in 0..NAMES {
                let key = Key::new(node, device, name);
                let invoke = clock.now();
                let outcome = match client.get(&key.tensor_key()).await {
                    Ok(data) => history::decode(&data).map_or_else(Outcome::Garbled, Outcome::Read),
                    Err(error) => Outcome::of_error(error),
                };
                reads.push(Op {
                    client: reader,
                    kind: OpKind::Get { key },
                    invoke,
                    complete: clock.now(),
                    outcome,
                });
            }
        }
    }
    reads
}

/// The state quiescent `reads` found, as instantaneous puts at the end of each read, to open
/// the next round's history with: every value held then, and nothing else.
fn state_as_puts(reads: &[Op]) -> Vec<Op> {
    reads
        .iter()
        .filter_map(|read| match (&read.kind, &read.outcome) {
            (&OpKind::Get { key }, &Outcome::Read(value)) => Some(Op {
                kind: OpKind::Put { key, value },
                invoke: read.complete,
                outcome: Outcome::Ok,
                ..read.clone()
            }),
            (
                OpKind::Get { .. },
                Outcome::Refused {
                    code: ErrorCode::NotFound,
                    ..
                },
            ) => None,
            _ => panic!("a quiescent read failed, so the next round has no known state: {read}"),
        })
        .collect()
}

/// Two nodes with two Flex devices each and `settings.clients` clients racing on them, in
/// rounds of at most [`ROUND`]; each round ends with a quiescent read of every key and is
/// checked as one history, which opens with the state the previous round ended in. Panics with
/// the violations found; returns the counts of what ran.
async fn run_and_check(settings: Settings) -> Counts {
    let nodes: [TestNode; 2] = [
        start_with(&["flex", "flex"]).await,
        start_with(&["flex", "flex"]).await,
    ];
    let addrs = [nodes[0].addr, nodes[1].addr];
    println!(
        "history: seed {} ({} clients, {:?}; FERRY_HISTORY_SEED={} reruns these operations)",
        settings.seed, settings.clients, settings.duration, settings.seed
    );
    let clock = Clock::start();
    let run_end = Instant::now() + settings.duration;
    let budget = MAX_OPS / settings.clients;
    let quiescent_reader = settings.clients;
    let mut racers: Vec<Racer> = (0..settings.clients)
        .map(|index| Racer::new(index, settings.seed, addrs))
        .collect();
    let mut counts = Counts::new();
    let mut initial_state = Vec::new();
    for round in 1.. {
        let started = Instant::now();
        let deadline = (started + ROUND).min(run_end);
        let tasks: Vec<_> = racers
            .drain(..)
            .map(|racer| tokio::spawn(racer.race(clock, deadline, budget)))
            .collect();
        let mut history = std::mem::take(&mut initial_state);
        let opening = history.len();
        let mut out_of_budget = 0;
        for task in tasks {
            let (racer, ops) = task.await.expect("a client task panicked");
            out_of_budget += usize::from(ops.len() >= budget);
            history.extend(ops);
            racers.push(racer);
        }
        let raced = started.elapsed();
        let reads = read_every_key(&nodes, &clock, quiescent_reader).await;
        history.extend(reads.iter().cloned());

        let checking = Instant::now();
        let violations = checker::check(&history);
        let checked = checking.elapsed();
        let ops = &history[opening..];
        count_into(&mut counts, ops);
        println!(
            "history: round {round}: {} operations in {raced:.2?} ({out_of_budget} clients \
             stopped at their budget of {budget}), checked in {checked:.2?}",
            ops.len()
        );
        let unknown = history::unknown_outcomes(ops);
        for ((kind, why), count) in &unknown {
            println!("  {kind:>10} of unknown outcome {count:>4}x: {why}");
        }
        if !violations.is_empty() {
            if let Ok(path) = std::env::var("FERRY_HISTORY_DUMP") {
                dump(&history, &path);
            }
            // The first few in full, the rest a line each.
            const EXPLAINED: usize = 5;
            for violation in violations.iter().take(EXPLAINED) {
                println!("{}", checker::explain(&history, violation, settings.seed));
            }
            for violation in violations.iter().skip(EXPLAINED) {
                println!(
                    "also: #{} {}: {}",
                    violation.op, history[violation.op], violation.what
                );
            }
            panic!(
                "{} history violations in round {round} with seed {} (above); rerun with \
                 FERRY_HISTORY_SEED={}",
                violations.len(),
                settings.seed,
                settings.seed
            );
        }
        if Instant::now() >= run_end {
            break;
        }
        if !unknown.is_empty() {
            // Their effects could land in the next round, whose opening state would not show
            // them.
            println!("history: ending the run after operations of unknown outcome");
            break;
        }
        initial_state = state_as_puts(&reads);
    }
    let connect_failures: usize = racers.iter().map(|r| r.connect_failures).sum();
    println!("history: {connect_failures} failed connects; operations by kind and outcome:");
    for ((kind, outcome), count) in &counts {
        println!("  {kind:>10} {outcome:<18} {count:>8}");
    }
    counts
}

/// Writes `history` to `path`, an operation a line with its index, for a closer look.
fn dump(history: &[Op], path: &str) {
    let lines: String = history
        .iter()
        .enumerate()
        .map(|(index, op)| format!("#{index} {op}\n"))
        .collect();
    match std::fs::write(path, lines) {
        Ok(()) => println!("history: the round's operations are in {path}"),
        Err(error) => println!("history: could not write {path}: {error}"),
    }
}

/// A run that did nothing of interest checks nothing: some gets must have seen values, and
/// some node-to-node transfers must have succeeded.
fn assert_exercised(counts: &Counts) {
    let values_read = history::count(counts, "get", "value");
    let node_copies = history::count(counts, "node copy", "ok")
        + history::count(counts, "node move", "ok")
        + history::count(counts, "node move", "source kept");
    assert!(values_read > 0, "no get saw a value");
    assert!(node_copies > 0, "no node-to-node copy or move succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_random_history_of_racing_clients_is_linearizable() {
    let counts = run_and_check(Settings::from_env(3.0, 4)).await;
    assert_exercised(&counts);
}

/// The same for longer and with more clients: `tests/history.sh SECONDS [CLIENTS] [SEED]`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a long run; tests/history.sh runs it"]
async fn long_random_history() {
    let counts = run_and_check(Settings::from_env(60.0, 8)).await;
    assert_exercised(&counts);
}
