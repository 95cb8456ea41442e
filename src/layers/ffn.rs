//! A decoder layer's feed-forward part where a family mixes kinds: a dense gated MLP, or a
//! mixture of experts (`layers::moe`) from `first_k_dense_replace` on (Qwen3.5-MoE's every
//! layer, GLM-4.5V's after the first; an MTP layer past the decoder's is one of the latter).

use candle_core::{Result, Tensor};

use super::mlp::GatedMlp;
use super::moe::Moe;
use crate::config::TextConfig;
use crate::weights::{Weights, WeightsError};

pub enum Ffn {
    Dense(GatedMlp),
    Experts(Moe),
}

impl Ffn {
    /// Layer `i`'s, under `{p}.mlp`.
    pub fn load(w: &Weights, cfg: &TextConfig, p: &str, i: usize) -> std::result::Result<Self, WeightsError> {
        let (h, act) = (cfg.hidden_size, cfg.activation);
        Ok(match &cfg.moe {
            Some(moe) if moe.is_moe_layer(i) => Ffn::Experts(Moe::load(w, &format!("{p}.mlp"), h, moe, act)?),
            _ => Ffn::Dense(GatedMlp::load(w, &format!("{p}.mlp"), h, cfg.intermediate_size, act)?),
        })
    }

    /// The output for rows `x`, and with experts the ones each row chose (`[T, top_k]` u32,
    /// ascending; for a model's taps).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        match self {
            Ffn::Dense(mlp) => Ok((mlp.forward(x)?, None)),
            Ffn::Experts(moe) => {
                let routing = moe.route(x)?;
                Ok((moe.forward(x, &routing)?, Some(routing.experts)))
            }
        }
    }
}
