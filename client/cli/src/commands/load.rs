//! `ferry load NODE`: the load generator's run and its report (every transfer checked).

use crate::load::LoadConfig;
use anyhow::bail;

pub(crate) async fn load(config: LoadConfig, json: bool) -> anyhow::Result<()> {
    let report = crate::load::run(config).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        println!(
            "{} clients, {} rounds, {} operations in {:.1} s: {:.3} GB/s of payload",
            report.clients, report.rounds, report.operations, report.seconds, report.gbps
        );
        println!(
            "errors {}, mismatches {}, tensors left {}",
            report.errors, report.mismatches, report.tensors_left
        );
        for (op, l) in [
            ("put", report.put),
            ("get", report.get),
            ("copy", report.copy),
            ("delete", report.delete),
        ] {
            println!(
                "{op:<6} {:>7} ops  p50 {:>8.2} ms  p99 {:>8.2} ms  max {:>8.2} ms",
                l.count, l.p50_ms, l.p99_ms, l.max_ms
            );
        }
        println!(
            "node resident memory: {:.1} MiB before, {:.1} MiB peak, {:.1} MiB after ({:+.1}% of before)",
            mib(report.node_resident_before),
            mib(report.node_resident_peak),
            mib(report.node_resident_after),
            (report.node_resident_after as f64 / report.node_resident_before.max(1) as f64 - 1.0)
                * 100.0
        );
    }
    if !json {
        let growth = report.memory_growth() * 100.0;
        println!(
            "targets: no error {}; no mismatch {}; memory after within 10% of before {} ({growth:+.1}%)",
            if report.errors == 0 {
                "holds"
            } else {
                "MISSED"
            },
            if report.mismatches == 0 {
                "holds"
            } else {
                "MISSED"
            },
            if growth <= 10.0 { "holds" } else { "MISSED" },
        );
    }
    if !report.clean() {
        bail!(
            "{} errors, {} mismatches, {} tensors left",
            report.errors,
            report.mismatches,
            report.tensors_left
        );
    }
    Ok(())
}
