//! The model the deployment example ships: a small language-model head built from burn-nn
//! layers (an embedding, a layer norm, two linear layers), shared by the coordinator, the
//! worker and the tests.

use burn_core as burn;
use burn_core::module::{Module, Quantizer};
use burn_core::tensor::activation::gelu;
use burn_core::tensor::quantization::{
    Calibration, QuantScheme, QuantStore, QuantValue, ScaleDtype,
};
use burn_core::tensor::{Device, Int, Tensor};
use burn_nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};

/// Tokens the embedding knows.
pub const VOCAB: usize = 96;
/// The model's width.
pub const WIDTH: usize = 64;
/// The hidden layer's width.
pub const HIDDEN: usize = 128;

/// Token ids in, one logit per vocabulary entry out.
#[derive(Module, Debug)]
pub struct TinyLm {
    /// Token ids to vectors.
    pub embedding: Embedding,
    /// Layer norm over each vector.
    pub norm: LayerNorm,
    /// The hidden layer (then GELU).
    pub hidden: Linear,
    /// One logit per vocabulary entry.
    pub output: Linear,
}

impl TinyLm {
    /// A model of random weights on `device` (the device's seed decides them).
    pub fn new(device: &Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(VOCAB, WIDTH).init(device),
            norm: LayerNormConfig::new(WIDTH).init(device),
            hidden: LinearConfig::new(WIDTH, HIDDEN).init(device),
            output: LinearConfig::new(HIDDEN, VOCAB).init(device),
        }
    }

    /// `[batch, tokens]` ids to `[batch, tokens, VOCAB]` logits.
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let x = self.norm.forward(self.embedding.forward(tokens));
        self.output.forward(gelu(self.hidden.forward(x)))
    }
}

/// The two quantizations the deployment ships: Q8S with one scale per tensor, and Q8S with one
/// scale per block of 32 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Quantization {
    /// One f32 scale per tensor.
    PerTensor,
    /// One f32 scale per 32 values along the last dimension.
    PerBlock,
}

impl Quantization {
    /// Burn's scheme for it.
    pub fn scheme(self) -> QuantScheme {
        let q8s = QuantScheme::default()
            .with_value(QuantValue::Q8S)
            .with_store(QuantStore::Native);
        match self {
            Quantization::PerTensor => q8s,
            Quantization::PerBlock => q8s.per_block([32], ScaleDtype::F32),
        }
    }
}

/// `model` with its linear layers quantized, weights and biases (min-max calibration); the embedding and
/// the norm stay in f32.
pub fn quantized(model: TinyLm, quantization: Quantization) -> TinyLm {
    let mut quantizer = Quantizer::new(Calibration::MinMax, quantization.scheme());
    TinyLm {
        hidden: model.hidden.quantize_weights(&mut quantizer),
        output: model.output.quantize_weights(&mut quantizer),
        ..model
    }
}

/// A batch of token ids: `rows` sequences of `tokens` ids, the same for every caller.
pub fn batch(rows: usize, tokens: usize, device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = (0..rows * tokens)
        .map(|i| ((i * 37 + 11) % VOCAB) as i64)
        .collect();
    Tensor::<1, Int>::from_data(
        burn_core::tensor::TensorData::new(ids, [rows * tokens]),
        device,
    )
    .reshape([rows, tokens])
}
