//! The coordinator's side of the deployment example: build the model, quantize it, send it to a
//! worker's node with one call, send a batch, and read the worker's output back, next to the
//! coordinator's own forward pass of the same model on the same batch.

use std::time::Duration;

use anyhow::Context;
use burn_core::tensor::{Device, TensorData};
use burn_store::ModuleStore;
use ferry_burn::FerryStore;
use ferry_client::{BlockingClient, ErrorCode, Wait};
use ferry_proto::{IfExists, TensorKey};

use crate::tiny_lm::{Quantization, TinyLm, batch, quantized};

/// The worker's output and the coordinator's own, for one batch.
pub struct Outputs {
    /// What the coordinator's model computed.
    pub here: TensorData,
    /// What the worker computed with the model it was sent.
    pub worker: TensorData,
}

/// Sends a model quantized as `quantization` to the worker at the other end of `store_link`
/// (which the store takes) and runs a batch there through `requests` (a second connection to
/// the same worker).
pub fn ship_and_run(
    store_link: BlockingClient,
    mut requests: BlockingClient,
    quantization: Quantization,
) -> anyhow::Result<Outputs> {
    let device = Device::flex();
    let model = quantized(TinyLm::new(&device), quantization);

    // The whole model, quantized weights with their scales, in one call: a new version of the
    // worker's model, replacing the one it has (if any) as one step.
    FerryStore::connected(store_link, 0, "model")
        .if_exists(IfExists::Replace)
        .collect_from(&model)
        .context("sending the model")?;

    let tokens = batch(4, 16, &device);
    let output = TensorKey::new(0, "output");
    match requests.delete(&output).wait() {
        Ok(_) => {}
        Err(e) if e.code() == Some(ErrorCode::NotFound) => {}
        Err(e) => return Err(e).context("clearing an earlier output"),
    }
    requests
        .put(&TensorKey::new(0, "batch"), tokens.clone())
        .wait()
        .context("sending the batch")?;
    // The node answers when the worker's output arrives: nothing polls.
    let arrived = requests
        .wait_for(&output, Duration::from_secs(60))
        .wait()
        .context("waiting for the output")?;
    anyhow::ensure!(arrived.is_some(), "no output within a minute");
    let worker = requests.get(&output).wait().context("reading the output")?;
    Ok(Outputs {
        here: model.forward(tokens).into_data(),
        worker,
    })
}
