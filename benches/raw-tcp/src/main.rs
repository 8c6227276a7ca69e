//! `ferry-raw-tcp BYTES [RUNS]`: the ceiling the benches' scripts time ferry's commands against.
//!
//! BYTES (suffixes `KiB`, `MiB`, `GiB`) go over one loopback TCP stream, written in 4 MiB pieces
//! from a buffer of that size and read with `read_exact` into one buffer of BYTES touched before
//! (warm memory, as a node's ready pool is), timed from both ends connected to the last byte
//! read; the best of RUNS (default 3) is printed as `SECONDS GB/s` on one line. Only std, so
//! that nothing but the kernel's copy is measured.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// The sender's write size, ferry's chunk size.
const WRITE_SIZE: usize = 4 << 20;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (bytes, runs) = match args.as_slice() {
        [bytes] => (parse_size(bytes), Some(3)),
        [bytes, runs] => (parse_size(bytes), runs.parse().ok().filter(|&r| r > 0)),
        _ => (None, None),
    };
    let (Some(bytes), Some(runs)) = (bytes, runs) else {
        eprintln!("usage: ferry-raw-tcp BYTES [RUNS]   (BYTES like 2491416576 or 256MiB)");
        return ExitCode::from(2);
    };
    let src = vec![7u8; bytes];
    let mut dst = vec![0u8; bytes];
    // Touch every page, so that the runs measure the copy and not the first faults.
    dst.iter_mut().step_by(4096).for_each(|b| *b = 1);
    let best = (0..runs)
        .map(|_| match once(&src, &mut dst) {
            Ok(took) => took,
            Err(e) => {
                eprintln!("ferry-raw-tcp: {e}");
                std::process::exit(1);
            }
        })
        .min()
        .unwrap_or_default();
    println!(
        "{:.6} {:.3}",
        best.as_secs_f64(),
        bytes as f64 / best.as_secs_f64() / 1e9
    );
    ExitCode::SUCCESS
}

/// `256MiB` -> 268435456; a bare number is bytes.
fn parse_size(text: &str) -> Option<usize> {
    let (digits, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(at) => text.split_at(at),
        None => (text, ""),
    };
    let shift = match unit {
        "" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        _ => return None,
    };
    digits.parse::<usize>().ok()?.checked_mul(1 << shift)
}

/// One transfer of `src` into `dst` over a fresh loopback connection.
fn once(src: &[u8], dst: &mut [u8]) -> std::io::Result<Duration> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let ready = Barrier::new(2);
    std::thread::scope(|scope| {
        let sender = scope.spawn(|| -> std::io::Result<()> {
            let mut stream = TcpStream::connect(addr)?;
            // ferry's connections set it too.
            stream.set_nodelay(true)?;
            ready.wait();
            for piece in src.chunks(WRITE_SIZE) {
                stream.write_all(piece)?;
            }
            Ok(())
        });
        let (mut stream, _) = listener.accept()?;
        ready.wait();
        let started = Instant::now();
        stream.read_exact(dst)?;
        let took = started.elapsed();
        sender.join().expect("the sending thread does not panic")?;
        Ok(took)
    })
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_binary_suffixes_and_refuse_the_rest() {
        for (text, bytes) in [
            ("0", Some(0)),
            ("4096", Some(4096)),
            ("1KiB", Some(1024)),
            ("256MiB", Some(256 << 20)),
            ("2GiB", Some(2 << 30)),
            ("2GB", None),
            ("MiB", None),
            ("-1", None),
            ("99999999999999999999GiB", None),
        ] {
            assert_eq!(parse_size(text), bytes, "{text}");
        }
    }
}
