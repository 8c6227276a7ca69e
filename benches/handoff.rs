//! The handoff between an embedded node and the Burn program around it, on Flex: a 256 MiB
//! tensor handed in (`insert_tensor`) and out (`tensor`), against a memcpy of the same bytes in
//! the same run. No byte is copied either way, so the time is that of the node's bookkeeping
//! (admission, a message to the device worker and its answer): its goal is under 1 ms, whatever
//! the size.
//!
//! Run with `cargo bench -p ferry-suite --bench handoff`. Memory: the process's resident size
//! before the handoffs, and its peak (VmHWM, reset before them) over them: a copy, even one freed
//! at once, would raise the peak by 256 MiB.
// Test and example code: an unwrap that fails is the failure, with its location.
#![allow(clippy::unwrap_used)]

mod support;

use std::time::{Duration, Instant};

use burn_tensor::{Device, Tensor};
use ferry_burn::NodeTensors;
use ferry_proto::{IfExists, TensorKey};
use ferry_server::{DeviceSpec, Node, NodeConfig};
use support::{MIB, f32_tensor, memcpy_once, mib, own_status, q8s_256};

/// The median of `times`.
fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn main() {
    const RUNS: usize = 21;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let node = Node::start(NodeConfig {
        devices: vec![DeviceSpec::Flex],
        ..NodeConfig::light()
    })
    .unwrap();
    let device = Device::flex();
    let src = vec![1u8; 256 * MIB];
    let mut dst = vec![0u8; 256 * MIB];
    let mut copies: Vec<Duration> = (0..5).map(|_| memcpy_once(&src, &mut dst)).collect();
    let memcpy = median(&mut copies);
    drop((src, dst));
    println!(
        "memcpy 256 MiB: median {:.1} ms",
        memcpy.as_secs_f64() * 1e3
    );

    for (label, data) in [
        ("f32 256 MiB", f32_tensor(256 * MIB)),
        ("Q8S 256 MiB", q8s_256()),
    ] {
        let dtype = data.dtype();
        let tensor = Tensor::<2>::from_data(data, (&device, dtype));
        let key = TensorKey::new(0, label);
        // Peak reset to the resident size now (where the kernel allows it).
        let _ = std::fs::write("/proc/self/clear_refs", "5");
        let before = own_status("VmRSS");
        let mut ins = Vec::with_capacity(RUNS);
        let mut outs = Vec::with_capacity(RUNS);
        runtime.block_on(async {
            for _ in 0..RUNS {
                let started = Instant::now();
                node.insert_tensor(&key, &tensor, IfExists::Replace)
                    .await
                    .unwrap();
                ins.push(started.elapsed());
                let started = Instant::now();
                let back: Tensor<2> = node.tensor(&key).await.unwrap();
                outs.push(started.elapsed());
                drop(back);
            }
        });
        let peak = own_status("VmHWM");
        let (insert, out) = (median(&mut ins), median(&mut outs));
        println!(
            "{label}: insert_tensor median {:.3} ms, tensor median {:.3} ms \
             ({:.0}x and {:.0}x faster than memcpy); resident {} before, peak {} over the runs",
            insert.as_secs_f64() * 1e3,
            out.as_secs_f64() * 1e3,
            memcpy.as_secs_f64() / insert.as_secs_f64(),
            memcpy.as_secs_f64() / out.as_secs_f64(),
            mib(before),
            mib(peak),
        );
        let met = out < Duration::from_millis(1) && insert < Duration::from_millis(1);
        println!(
            "{label}: goal (under 1 ms each way) {}",
            if met { "met" } else { "NOT met" }
        );
        runtime.block_on(node.remove(&key)).unwrap();
    }
}
