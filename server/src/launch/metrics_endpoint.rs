//! The Prometheus endpoint a server serves its metrics on (clear HTTP, any path answers), and
//! the sampler that keeps its memory gauges fresh.

use std::net::SocketAddr;
use std::time::Duration;

use super::StartError;
use crate::service::{Exposure, metrics_door};

/// Upper bounds of the transfer latency histogram, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Installs the Prometheus exporter on `addr` (beyond loopback only under
/// [`Exposure::Insecure`]: clear HTTP with no credential) and samples the memory gauges every
/// second. One per process: the exporter is the process's metrics recorder.
pub(crate) fn serve(
    addr: SocketAddr,
    exposure: Exposure,
    pool: Option<ferry_memory::Pool>,
) -> Result<(), StartError> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    if let Some(missing) = metrics_door(addr, exposure).map_err(StartError::MetricsExposed)? {
        tracing::warn!(%addr, %missing, "Exposure::Insecure: serving metrics beyond loopback in clear");
    }
    let failed = |e: &dyn std::fmt::Display| StartError::Metrics {
        addr,
        reason: e.to_string(),
    };
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Full(crate::metrics::TRANSFER_SECONDS.to_string()),
            LATENCY_BUCKETS,
        )
        .map_err(|e| failed(&e))?
        .install()
        .map_err(|e| failed(&e))?;
    crate::metrics::describe();
    tokio::spawn(async move {
        loop {
            crate::metrics::sample_resident_memory();
            if let Some(pool) = &pool {
                crate::metrics::sample_pool(pool);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });
    Ok(())
}
