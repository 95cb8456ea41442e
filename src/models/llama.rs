//! Llama and its close relatives Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm):
//!   h = x + Attn(RMSNorm(x));  x' = h + MLP(RMSNorm(h));  output RMSNorm(x_last)
//! Qwen2-VL's language model is Qwen2 with M-RoPE (three-axis positions) and image
//! embeddings in place of image-pad tokens; both come in with the batch.

use candle_core::{DType, Device, Result, Tensor};

use super::model::{Taps, TextModel};
use crate::batch::{AttentionMeta, Batch};
use crate::config::{Arch, TextConfig};
use crate::kv::{KvCache, LayerCache};
use crate::layers::attention::{AttentionOptions, SelfAttention};
use crate::layers::embedding::Embedding;
use crate::layers::linear::Linear;
use crate::layers::mlp::GatedMlp;
use crate::layers::mtp::{self, MtpHead};
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::layers::rotary::{Rotary, RotaryAngles};
use crate::weights::{Weights, WeightsError};

struct Layer {
    attn_norm: RmsNorm,
    attn: SelfAttention,
    mlp_norm: RmsNorm,
    mlp: GatedMlp,
}

impl Layer {
    /// The layer under `{p}` whose cache is layer `i`.
    fn load(w: &Weights, cfg: &TextConfig, p: &str, i: usize) -> std::result::Result<Self, WeightsError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let qk_norm = (cfg.arch == Arch::Qwen3).then_some(NormStyle::Plain);
        let norm = |name: &str| RmsNorm::load(w, &format!("{p}.{name}.weight"), h, eps, NormStyle::Plain);
        Ok(Layer {
            attn_norm: norm("input_layernorm")?,
            attn: SelfAttention::load_at(w, cfg, p, i, AttentionOptions { qk_norm, ..Default::default() })?,
            mlp_norm: norm("post_attention_layernorm")?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), h, cfg.intermediate_size, cfg.activation)?,
        })
    }

    /// x -> x' on its own (the decoder fuses each residual add with the next norm instead).
    fn forward(&self, x: &Tensor, rot: &RotaryAngles, cache: &LayerCache, attn: &AttentionMeta) -> Result<Tensor> {
        let a = self.attn.forward(&self.attn_norm.forward(x)?, rot, cache, attn)?;
        let (h, hn) = self.mlp_norm.forward_residual(x, &a)?;
        &h + self.mlp.forward(&hn)?
    }
}

pub struct Llama {
    cfg: TextConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    /// The MTP head, when drafting with it (`TextConfig::mtp_layers`).
    mtp: Option<MtpHead<Layer>>,
    dtype: DType,
    device: Device,
}

impl Llama {
    pub fn load(w: &Weights, cfg: TextConfig) -> std::result::Result<Self, WeightsError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let layers = (0..cfg.num_layers)
            .map(|i| Layer::load(w, &cfg, &format!("model.layers.{i}"), i))
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let embed = Embedding::load(w, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = embed.output_head(w, cfg.tie_word_embeddings, cfg.vocab_size, h)?;
        let mtp = MtpHead::load(w, &cfg, NormStyle::Plain, &lm_head, |p, i| Layer::load(w, &cfg, p, i))?;
        Ok(Llama {
            embed,
            layers,
            norm: RmsNorm::load(w, "model.norm.weight", h, eps, NormStyle::Plain)?,
            lm_head,
            rotary: Rotary::new(&cfg.rope, cfg.rotary_dim, cfg.rope_layout).on_device(
                w.device(),
                w.dtype(),
                cfg.max_position_embeddings,
            )?,
            mtp,
            dtype: w.dtype(),
            device: w.device().clone(),
            cfg,
        })
    }
}

impl TextModel for Llama {
    fn config(&self) -> &TextConfig {
        &self.cfg
    }

    fn forward(&self, batch: &Batch, kv: &KvCache, mut taps: Option<&mut Taps>) -> Result<Tensor> {
        let rot = self.rotary.angles_for(&batch.positions, &batch.attn, &self.device, self.dtype)?;
        let mut x = batch.input_embeds(self.embed.forward(&batch.token_ids, self.dtype)?)?;
        if let Some(t) = taps.as_deref_mut() {
            t.embed = Some(x.clone());
        }
        // Each residual add is computed together with the norm that reads its sum (the next
        // sublayer's, or the final one), so `normed` is always RMSNorm(x).
        let Some(first) = self.layers.first() else { return self.norm.forward(&x) };
        let mut normed = first.attn_norm.forward(&x)?;
        for (i, l) in self.layers.iter().enumerate() {
            let (h, h_normed) =
                l.mlp_norm.forward_residual(&x, &l.attn.forward(&normed, &rot, kv.layer(i), &batch.attn)?)?;
            let next_norm = self.layers.get(i + 1).map_or(&self.norm, |n| &n.attn_norm);
            (x, normed) = next_norm.forward_residual(&h, &l.mlp.forward(&h_normed)?)?;
            if let Some(t) = taps.as_deref_mut() {
                t.layers.push(x.clone());
            }
        }
        Ok(normed)
    }

    fn mtp_forward(&self, batch: &Batch, hidden: &Tensor, kv: &KvCache) -> Result<Tensor> {
        let mtp = mtp::loaded(&self.mtp)?;
        let rot = self.rotary.angles_for(&batch.positions, &batch.attn, &self.device, self.dtype)?;
        let x = mtp.input(&self.embed.forward(&batch.token_ids, self.dtype)?, hidden)?;
        mtp.output(&mtp.layer.forward(&x, &rot, kv.layer(self.cfg.num_layers), &batch.attn)?)
    }

    fn mtp_logits(&self, m: &Tensor) -> Result<(Tensor, Option<&[u32]>)> {
        mtp::loaded(&self.mtp)?.draft_logits(m, |m| self.logits(m))
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)?.to_dtype(DType::F32)
    }
}
