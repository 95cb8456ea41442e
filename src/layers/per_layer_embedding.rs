//! Gemma 4's per-layer embeddings (PLE): each token gets a small input of its own for every
//! decoder layer, a mix of a second embedding table and a projection of its input embedding:
//!   ple = (RMSNorm(W_p e / sqrt(H)) + E_ple[id] * sqrt(P)) / sqrt(2),   reshaped [T, L, P]
//! where e is the (scaled) input embedding; layer l reads `ple[:, l, :]` at its end through a
//! gate (`PleGate`). The table holds one P-wide slice per layer side by side (`[vocab, L * P]`).

use candle_core::{Result, Tensor};

use super::embedding::Embedding;
use super::linear::Linear;
use super::norm::{NormStyle, RmsNorm};
use crate::batch::Batch;
use crate::config::{Activation, PerLayerInput};
use crate::ops::activation;
use crate::weights::{Weights, WeightsError};

pub struct PerLayerEmbedding {
    table: Embedding,
    projection: Linear,
    norm: RmsNorm,
    layers: usize,
    dim: usize,
    hidden: usize,
    pad_token_id: u32,
}

impl PerLayerEmbedding {
    pub fn load(
        w: &Weights,
        p: PerLayerInput,
        layers: usize,
        hidden: usize,
        eps: f64,
    ) -> std::result::Result<Self, WeightsError> {
        let width = layers * p.dim;
        Ok(PerLayerEmbedding {
            table: Embedding::load(w, "model.embed_tokens_per_layer.weight", p.vocab, width)?,
            projection: Linear::load(w, "model.per_layer_model_projection", hidden, width, false)?,
            norm: RmsNorm::load(w, "model.per_layer_projection_norm.weight", p.dim, eps, NormStyle::Plain)?,
            layers,
            dim: p.dim,
            hidden,
            pad_token_id: p.pad_token_id,
        })
    }

    /// `[T, layers, dim]` for the batch's tokens, whose input embeddings are `embeds`
    /// (`[T, hidden]`, images merged in). An image row's table part is the pad token's.
    pub fn forward(&self, batch: &Batch, embeds: &Tensor) -> Result<Tensor> {
        let ids = match &batch.images {
            Some(images) => images.replace_ids(&batch.token_ids, self.pad_token_id)?,
            None => batch.token_ids.clone(),
        };
        let (t, dtype) = (embeds.dim(0)?, embeds.dtype());
        let shape = (t, self.layers, self.dim);
        let projected = (self.projection.forward(embeds)? * (self.hidden as f64).powf(-0.5))?;
        let projected = self.norm.forward(&projected.reshape(shape)?)?;
        // transformers rounds the table's scale to the weights' dtype before multiplying.
        let scale = Tensor::new((self.dim as f32).sqrt(), embeds.device())?.to_dtype(dtype)?;
        let token = self.table.forward(&ids, dtype)?.broadcast_mul(&scale)?.reshape(shape)?;
        (projected + token)? * std::f64::consts::FRAC_1_SQRT_2
    }
}

/// The end of a layer with per-layer embeddings: a gate from the residual stream times the
/// layer's slice of them, projected back and normed: `Norm(W_o (act(W_g x) * ple_l))`.
pub struct PleGate {
    gate: Linear,
    projection: Linear,
    norm: RmsNorm,
}

impl PleGate {
    /// `layer`: the decoder layer's prefix (`model.layers.{i}`).
    pub fn load(
        w: &Weights,
        layer: &str,
        hidden: usize,
        dim: usize,
        eps: f64,
    ) -> std::result::Result<Self, WeightsError> {
        Ok(PleGate {
            gate: Linear::load(w, &format!("{layer}.per_layer_input_gate"), hidden, dim, false)?,
            projection: Linear::load(w, &format!("{layer}.per_layer_projection"), dim, hidden, false)?,
            norm: RmsNorm::load(
                w,
                &format!("{layer}.post_per_layer_input_norm.weight"),
                hidden,
                eps,
                NormStyle::Plain,
            )?,
        })
    }

    /// What the layer adds to `x` (`[T, hidden]`) given its slice `ple` (`[T, dim]`).
    pub fn forward(&self, x: &Tensor, ple: &Tensor, act: Activation) -> Result<Tensor> {
        let gated = (activation::apply(act, &self.gate.forward(x)?)? * ple)?;
        self.norm.forward(&self.projection.forward(&gated)?)
    }
}
