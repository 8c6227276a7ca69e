//! A load generator: many clients putting, getting, copying and deleting tensors of mixed sizes
//! and dtypes on one node, every transfer checked byte for byte, with latency percentiles and
//! the node's memory before, during and after (`ferry load`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use burn_std::quantization::{QuantScheme, QuantStore, QuantValue};
use burn_std::{BoolStore, DType, TensorData};
use ferry_proto::TensorKey;
use tokio::sync::{Mutex, Semaphore};

use ferry_client::{Client, ClientError, Connect};

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// The node, and how each client connects to it.
    pub connect: Connect,
    /// Clients running at once, each on its own connection.
    pub clients: usize,
    /// Rounds (put, get, copy, get, delete twice) per client; with `duration`, whichever ends
    /// first.
    pub rounds: Option<u64>,
    /// How long to run; with `rounds`, whichever ends first.
    pub duration: Option<Duration>,
    /// The smallest tensor, in bytes.
    pub min_bytes: usize,
    /// The largest tensor, in bytes (sizes are spread evenly on a log scale in between).
    pub max_bytes: usize,
    /// Tensor bytes the generator holds at once across clients (each round holds its tensor
    /// until it is checked), so that many clients with big tensors stay within memory.
    pub max_in_flight_bytes: usize,
    /// Where tensors are put.
    pub device: u32,
    /// Where they are copied to.
    pub copy_device: u32,
    /// Seed for sizes, dtypes and contents.
    pub seed: u64,
    /// Rounds per client run first, unmeasured, before the node's memory is read for "before"
    /// (0 for none).
    pub warmup_rounds: u64,
}

/// Latency percentiles of one operation, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Latency {
    /// Operations measured.
    pub count: u64,
    /// Median.
    pub p50_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Slowest.
    pub max_ms: f64,
}

impl Latency {
    fn of(samples: &mut [Duration]) -> Latency {
        if samples.is_empty() {
            return Latency::default();
        }
        samples.sort();
        let at = |q: f64| {
            let index = ((samples.len() - 1) as f64 * q).round() as usize;
            samples.get(index).map_or(0.0, |d| d.as_secs_f64() * 1e3)
        };
        Latency {
            count: samples.len() as u64,
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        }
    }
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct LoadReport {
    /// Clients that ran.
    pub clients: usize,
    /// Rounds completed without an error.
    pub rounds: u64,
    /// Operations that succeeded (a round is six: put, copy, two gets, two deletes).
    pub operations: u64,
    /// Operations that failed (each one printed as it happened).
    pub errors: u64,
    /// Tensors that came back with other bytes, dtype or shape.
    pub mismatches: u64,
    /// Payload bytes moved by operations that succeeded (puts and gets; copies stay on the
    /// node).
    pub bytes_moved: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Payload throughput, GB/s (1e9 bytes).
    pub gbps: f64,
    /// Per-operation latency.
    pub put: Latency,
    /// See `put`.
    pub get: Latency,
    /// See `put`.
    pub copy: Latency,
    /// See `put`.
    pub delete: Latency,
    /// The node's resident memory before the run, bytes.
    pub node_resident_before: u64,
    /// The highest resident memory seen during the run (sampled every 100 ms), bytes.
    pub node_resident_peak: u64,
    /// Resident memory after the run, once every tensor it made is deleted, bytes.
    pub node_resident_after: u64,
    /// Tensors the run left on the node (always 0 unless a delete failed).
    pub tensors_left: u64,
}

impl LoadReport {
    /// Whether every operation succeeded and every tensor came back exact.
    pub fn clean(&self) -> bool {
        self.errors == 0 && self.mismatches == 0 && self.tensors_left == 0
    }
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The node could not be reached for its memory figures.
    #[error("node: {0}")]
    Node(#[from] ClientError),
    /// Contradictory settings.
    #[error("{0}")]
    Config(String),
}

/// A small, fast generator (xorshift64*): contents need to be arbitrary, not unpredictable.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn fill(&mut self, bytes: &mut [u8]) {
        let mut words = bytes.chunks_exact_mut(8);
        for word in &mut words {
            word.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = words.into_remainder();
        let last = self.next().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

/// The dtypes a run mixes: floats, integers, booleans and a quantized scheme.
const MIX: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::U8,
    DType::Bool(BoolStore::Native),
    DType::F32, // QFloat stands here; see `make`.
];

/// A tensor of about `bytes` bytes of the `which`-th dtype of the mix, with arbitrary contents.
fn make(rng: &mut Rng, which: usize, bytes: usize) -> TensorData {
    let cols = 64usize;
    if which == MIX.len() - 1 {
        // Q8S, one f32 scale for the tensor: values are any i8.
        let rows = (bytes / cols).max(1);
        let mut values = vec![0u8; rows * cols];
        rng.fill(&mut values);
        let values: Vec<i8> = bytemuck::cast_vec(values);
        let scheme = QuantScheme::default()
            .with_value(QuantValue::Q8S)
            .with_store(QuantStore::Native);
        let scale = 0.001 + (rng.below(1000) as f32) * 1e-4;
        return TensorData::quantized(values, [rows, cols], scheme, &[scale], None);
    }
    let dtype = MIX[which % MIX.len()];
    let size = dtype.size();
    let rows = (bytes / (cols * size)).max(1);
    let mut raw = vec![0u8; rows * cols * size];
    if matches!(dtype, DType::Bool(_)) {
        for b in raw.iter_mut() {
            *b = (rng.next() & 1) as u8;
        }
    } else {
        rng.fill(&mut raw);
    }
    TensorData::from_bytes_vec(raw, [rows, cols], dtype)
}

fn same(got: &TensorData, want: &TensorData) -> bool {
    got.dtype() == want.dtype() && got.shape() == want.shape() && got.as_bytes() == want.as_bytes()
}

#[derive(Default)]
struct Samples {
    put: Vec<Duration>,
    get: Vec<Duration>,
    copy: Vec<Duration>,
    delete: Vec<Duration>,
}

#[derive(Default)]
struct Totals {
    rounds: AtomicU64,
    operations: AtomicU64,
    errors: AtomicU64,
    mismatches: AtomicU64,
    bytes: AtomicU64,
}

/// Runs the load and reports.
pub async fn run(config: LoadConfig) -> Result<LoadReport, LoadError> {
    if config.rounds.is_none() && config.duration.is_none() {
        return Err(LoadError::Config(
            "give a number of rounds or a duration".into(),
        ));
    }
    if config.min_bytes == 0 || config.min_bytes > config.max_bytes {
        return Err(LoadError::Config(
            "sizes must satisfy 0 < min <= max".into(),
        ));
    }
    let connect = || config.connect.clone().open();
    // The node's figures are read over client 0's connection, between its rounds: the run
    // opens `clients` connections and no more, so that `--clients N` fits a node that takes N
    // from one address.
    let shared = Arc::new(Mutex::new(connect().await?));
    let mut warmup_errors = 0;
    if config.warmup_rounds > 0 {
        // A first pass sets up what the node keeps for good (connection buffers, worker and
        // allocator state), so that "before" and "after" compare like with like.
        let warmup = LoadConfig {
            rounds: Some(config.warmup_rounds),
            duration: None,
            seed: config.seed.wrapping_add(WARMUP_SEED),
            ..config.clone()
        };
        let (totals, _, _) = pass(&warmup, &shared).await;
        warmup_errors =
            totals.errors.load(Ordering::Relaxed) + totals.mismatches.load(Ordering::Relaxed);
        tokio::time::sleep(SETTLE).await;
    }
    let before = shared.lock().await.stat().await?.resident_bytes;
    let peak = Arc::new(AtomicU64::new(before));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop, shared) = (peak.clone(), stop.clone(), shared.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                // Borrowed between two of client 0's rounds (the lock is fair: the sampler
                // waits for one round at most).
                if let Ok(stats) = shared.lock().await.stat().await {
                    peak.fetch_max(stats.resident_bytes, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let (totals, mut samples, seconds) = pass(&config, &shared).await;
    stop.store(true, Ordering::Relaxed);
    let _ = sampler.await;

    // What the run made is gone; give the node a moment to hand freed memory back (it trims its
    // allocator every few seconds), then read its memory. Client 0's connection, unless the run
    // broke it (the others are closed by now, which leaves room for a new one).
    let mut monitor = match Arc::try_unwrap(shared).map(Mutex::into_inner) {
        Ok(client) if client.in_step() => client,
        _ => connect().await?,
    };
    let tensors_left = count_left(&mut monitor, &config).await?;
    tokio::time::sleep(SETTLE).await;
    let after = monitor.stat().await?.resident_bytes;
    let bytes = totals.bytes.load(Ordering::Relaxed);
    Ok(LoadReport {
        clients: config.clients,
        rounds: totals.rounds.load(Ordering::Relaxed),
        operations: totals.operations.load(Ordering::Relaxed),
        errors: totals.errors.load(Ordering::Relaxed) + warmup_errors,
        mismatches: totals.mismatches.load(Ordering::Relaxed),
        bytes_moved: bytes,
        seconds,
        gbps: bytes as f64 / seconds / 1e9,
        put: Latency::of(&mut samples.put),
        get: Latency::of(&mut samples.get),
        copy: Latency::of(&mut samples.copy),
        delete: Latency::of(&mut samples.delete),
        node_resident_before: before,
        node_resident_peak: peak.load(Ordering::Relaxed).max(after),
        node_resident_after: after,
        tensors_left,
    })
}

/// Added to the seed for the warm-up pass, so its tensors never share a name with the run's.
const WARMUP_SEED: u64 = 0x5741_524d;
/// How long the node gets to hand freed memory back before its memory is read.
const SETTLE: Duration = Duration::from_secs(6);

/// One pass of every client, client 0 on `shared`; its totals, latency samples and wall time.
async fn pass(config: &LoadConfig, shared: &Arc<Mutex<Client>>) -> (Arc<Totals>, Samples, f64) {
    // Permits are MiB of tensor held by the generator at once.
    let budget_mib = (config.max_in_flight_bytes >> 20).max(1);
    let budget = Arc::new(Semaphore::new(budget_mib));
    let totals = Arc::new(Totals::default());
    let samples = Arc::new(Mutex::new(Samples::default()));
    let deadline = config.duration.map(|d| Instant::now() + d);
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(config.clients);
    for id in 0..config.clients {
        let config = config.clone();
        let (budget, totals, samples) = (budget.clone(), totals.clone(), samples.clone());
        let lent = (id == 0).then(|| shared.clone());
        tasks.push(tokio::spawn(async move {
            let gauges = Gauges {
                budget_mib,
                budget,
                totals,
                samples,
            };
            client_loop(id, config, deadline, lent, gauges).await
        }));
    }
    for task in tasks {
        let _ = task.await;
    }
    let seconds = started.elapsed().as_secs_f64();
    let samples = std::mem::take(&mut *samples.lock().await);
    (totals, samples, seconds)
}

impl LoadReport {
    /// The resident memory after the run relative to before it (0.1 is 10% more).
    pub fn memory_growth(&self) -> f64 {
        self.node_resident_after as f64 / self.node_resident_before.max(1) as f64 - 1.0
    }
}

/// Tensors left under the names this run uses.
async fn count_left(node: &mut Client, config: &LoadConfig) -> Result<u64, LoadError> {
    let prefix = format!("load-{}-", config.seed);
    let mut left = 0;
    for device in [config.device, config.copy_device] {
        left += node
            .list(Some(device))
            .await?
            .iter()
            .filter(|t| t.key.name.starts_with(&prefix))
            .count() as u64;
        if config.device == config.copy_device {
            break;
        }
    }
    Ok(left)
}

/// What the clients of a pass share: the bytes they may hold, and what they count.
struct Gauges {
    /// MiB of tensor held at once by the generator.
    budget_mib: usize,
    /// Its permits.
    budget: Arc<Semaphore>,
    totals: Arc<Totals>,
    samples: Arc<Mutex<Samples>>,
}

/// One client's rounds, on a connection of its own or on `lent`, which it holds a round at a
/// time (the memory sampler reads the node's figures over it in between).
async fn client_loop(
    id: usize,
    config: LoadConfig,
    deadline: Option<Instant>,
    lent: Option<Arc<Mutex<Client>>>,
    gauges: Gauges,
) {
    let Gauges {
        budget_mib,
        budget,
        totals,
        samples,
    } = gauges;
    let fail = |what: String| {
        totals.errors.fetch_add(1, Ordering::Relaxed);
        eprintln!("error: client {id}: {what}");
    };
    let connection = match lent {
        Some(lent) => lent,
        None => match config.connect.clone().open().await {
            Ok(client) => Arc::new(Mutex::new(client)),
            Err(e) => return fail(format!("connect: {e}")),
        },
    };
    let mut rng = Rng::new(config.seed ^ (id as u64).wrapping_mul(0xA24B_AED4_963E_E407));
    let (lo, hi) = (
        (config.min_bytes as f64).ln(),
        (config.max_bytes as f64).ln(),
    );
    let mut round = 0u64;
    let mut local = Samples::default();
    loop {
        if config.rounds.is_some_and(|r| round >= r)
            || deadline.is_some_and(|d| Instant::now() >= d)
        {
            break;
        }
        let t = rng.below(1 << 20) as f64 / (1u64 << 20) as f64;
        let bytes = (lo + (hi - lo) * t).exp() as usize;
        let mib = ((bytes >> 20) + 1).min(budget_mib) as u32;
        let Ok(_permit) = budget.acquire_many(mib).await else {
            break;
        };
        let mut client = connection.lock().await;
        let which = rng.below(MIX.len() as u64) as usize;
        let data = make(&mut rng, which, bytes);
        let payload = data.as_bytes().len() as u64;
        let name = format!("load-{}-{id}-{round}", config.seed);
        let key = TensorKey::new(config.device, &name);
        let copy_key = TensorKey::new(config.copy_device, format!("{name}.copy"));
        round += 1;

        // Only what succeeded counts; a broken connection ends this client (its later calls
        // would all fail the same way).
        let succeeded = |bytes: u64| {
            totals.operations.fetch_add(1, Ordering::Relaxed);
            totals.bytes.fetch_add(bytes, Ordering::Relaxed);
        };
        let broken = |e: &ClientError| {
            matches!(
                e,
                ClientError::OutOfStep
                    | ClientError::Connection(_)
                    | ClientError::Unreachable { .. }
            )
        };
        let at = Instant::now();
        if let Err(e) = client
            .put(&TensorKey::new(config.device, name.clone()), &data)
            .await
        {
            fail(format!("put {key}: {e}"));
            if broken(&e) {
                break;
            }
            continue;
        }
        local.put.push(at.elapsed());
        succeeded(payload);
        let mut ok = true;
        let mut lost = false;
        let at = Instant::now();
        match client.copy(&key, &copy_key).await {
            Ok(_) => {
                local.copy.push(at.elapsed());
                succeeded(0);
            }
            Err(e) => {
                fail(format!("copy {key}: {e}"));
                lost |= broken(&e);
                ok = false;
            }
        }
        let checks: &[&TensorKey] = if ok { &[&key, &copy_key] } else { &[&key] };
        for key in checks {
            if lost {
                break;
            }
            let at = Instant::now();
            match client.get(key).await {
                Ok(back) => {
                    local.get.push(at.elapsed());
                    if same(&back, &data) {
                        succeeded(payload);
                    } else {
                        totals.mismatches.fetch_add(1, Ordering::Relaxed);
                        eprintln!("error: client {id}: {key}: other bytes than were put");
                        ok = false;
                    }
                }
                Err(e) => {
                    fail(format!("get {key}: {e}"));
                    lost |= broken(&e);
                    ok = false;
                }
            }
        }
        for key in [&key, &copy_key] {
            if lost {
                break;
            }
            let at = Instant::now();
            match client.delete(key).await {
                Ok(_) => {
                    local.delete.push(at.elapsed());
                    succeeded(0);
                }
                Err(e) if e.code() == Some(ferry_proto::ErrorCode::NotFound) && !ok => {}
                Err(e) => {
                    fail(format!("delete {key}: {e}"));
                    lost |= broken(&e);
                    ok = false;
                }
            }
        }
        if ok {
            totals.rounds.fetch_add(1, Ordering::Relaxed);
        }
        if lost {
            break;
        }
    }
    let mut samples = samples.lock().await;
    samples.put.append(&mut local.put);
    samples.get.append(&mut local.get);
    samples.copy.append(&mut local.copy);
    samples.delete.append(&mut local.delete);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_of_the_mix_makes_a_valid_tensor_of_about_the_size() {
        let mut rng = Rng::new(7);
        for which in 0..MIX.len() {
            for bytes in [4096, 100_000, 1 << 20] {
                let data = make(&mut rng, which, bytes);
                let meta = ferry_proto::tensor::meta_of(&data).expect("consistent");
                assert!(meta.byte_len() <= bytes + 64 * 8 + 4, "{which} {bytes}");
                assert!(meta.byte_len() * 2 >= bytes.min(1 << 20), "{which} {bytes}");
            }
        }
    }

    #[test]
    fn percentiles_are_read_off_the_sorted_samples() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_millis).collect();
        let latency = Latency::of(&mut samples);
        assert_eq!(latency.count, 100);
        assert!((latency.p50_ms - 51.0).abs() < 1.01);
        assert!((latency.p99_ms - 99.0).abs() < 1.01);
        assert_eq!(latency.max_ms, 100.0);
    }
}
