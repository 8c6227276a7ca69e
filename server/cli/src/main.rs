//! `ferry-server`: runs a ferry node on TCP (and a Unix socket if asked) until Ctrl-C or SIGTERM.
//! A thin front: the flags (`args.rs`) describe a `ferry_server::ServerBuilder`, which checks
//! them and builds the node as any program embedding one does.

mod args;

use std::io::{IsTerminal, Write};

use anyhow::Context;
use clap::Parser;

fn main() -> anyhow::Result<()> {
    // Before the runtime's threads exist: glibc fixes its arena limit when the second arena is
    // made, and a thread's first allocation makes one.
    ferry_server::tune_allocator();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(serve())
}

async fn serve() -> anyhow::Result<()> {
    let args = args::Args::parse();
    init_logs(&args.log_format);
    let server = args.builder()?.start().await?;
    let addr = server.local_addr()?;
    // Scripts and tests find the port from this exact first line (and the Unix socket, if any,
    // from the second).
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "listening on {addr}")?;
    if let Some(path) = server.unix_path() {
        writeln!(stdout, "listening on unix:{}", path.display())?;
    }
    stdout.flush()?;
    drop(stdout);
    let node = server.node();
    let config = node.config();
    let devices: Vec<String> = config.devices.iter().map(|d| d.to_string()).collect();
    tracing::info!(
        %addr,
        unix = ?server.unix_path(),
        shared_memory = config.shared_memory == ferry_io::SharedMemory::Offer
            && ferry_io::connection::shared_memory_supported(),
        tls = config.tls.is_some(),
        node_id = %node.node_id(),
        ?devices,
        "ferry node serving"
    );
    server.run(shutdown_signal()).await?;
    tracing::info!("ferry node stopped");
    Ok(())
}

/// Logs on stderr: `text` for people, `json` (one object per line) for collectors; the level
/// from `RUST_LOG` (default `info`).
fn init_logs(format: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if format == "json" {
        logs.json()
            .with_current_span(true)
            .with_span_list(false)
            .init();
    } else {
        logs.with_ansi(std::io::stderr().is_terminal()).init();
    }
}

/// Completes on Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {},
        () = terminate => {},
    }
}
