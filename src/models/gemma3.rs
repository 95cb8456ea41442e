//! Gemma 3 (text): scaled embeddings, (1 + w) RMSNorms around both sub-blocks, per-head q/k
//! norms, sliding-window layers with their own rotary base, GELU-tanh MLP.
//!   h = x + Norm(Attn(Norm(x)));  x' = h + Norm(MLP(Norm(h)))

use candle_core::{DType, Device, Result, Tensor};

use super::model::{Taps, TextModel};
use crate::batch::Batch;
use crate::config::{LayerKind, TextConfig};
use crate::kv::KvCache;
use crate::layers::attention::SelfAttention;
use crate::layers::embedding::Embedding;
use crate::layers::linear::Linear;
use crate::layers::mlp::GatedMlp;
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::layers::rotary::Rotary;
use crate::weights::{Weights, WeightsError};

struct Layer {
    input_norm: RmsNorm,
    attn: SelfAttention,
    post_attn_norm: RmsNorm,
    pre_mlp_norm: RmsNorm,
    mlp: GatedMlp,
    post_mlp_norm: RmsNorm,
    sliding: bool,
}

pub struct Gemma3 {
    cfg: TextConfig,
    embed: Embedding,
    embed_scale: f64,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary_global: Rotary,
    rotary_local: Rotary,
    dtype: DType,
    device: Device,
}

impl Gemma3 {
    pub fn load(w: &Weights, cfg: TextConfig) -> std::result::Result<Self, WeightsError> {
        let (h, eps, s) = (cfg.hidden_size, cfg.rms_norm_eps, NormStyle::OnePlus);
        let norm = |name: String| RmsNorm::load(w, &name, h, eps, s);
        let layers = (0..cfg.num_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                Ok(Layer {
                    input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                    attn: SelfAttention::load(w, &cfg, i, Some(s))?,
                    post_attn_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                    pre_mlp_norm: norm(format!("{p}.pre_feedforward_layernorm.weight"))?,
                    mlp: GatedMlp::load(w, &format!("{p}.mlp"), h, cfg.intermediate_size, cfg.activation)?,
                    post_mlp_norm: norm(format!("{p}.post_feedforward_layernorm.weight"))?,
                    sliding: cfg.layer_kinds[i] == LayerKind::Sliding,
                })
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let embed = Embedding::load(w, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = embed.output_head(w, cfg.tie_word_embeddings, cfg.vocab_size, h)?;
        let local = cfg.rope_local.clone().unwrap_or_else(|| cfg.rope.clone());
        Ok(Gemma3 {
            embed,
            embed_scale: (h as f64).sqrt(),
            layers,
            norm: norm("model.norm.weight".into())?,
            lm_head,
            rotary_global: Rotary::new(&cfg.rope, cfg.rotary_dim, cfg.rope_layout).on_device(
                w.device(),
                w.dtype(),
                cfg.max_position_embeddings,
            )?,
            rotary_local: Rotary::new(&local, cfg.rotary_dim, cfg.rope_layout).on_device(
                w.device(),
                w.dtype(),
                cfg.max_position_embeddings,
            )?,
            dtype: w.dtype(),
            device: w.device().clone(),
            cfg,
        })
    }
}

impl TextModel for Gemma3 {
    fn config(&self) -> &TextConfig {
        &self.cfg
    }

    fn forward(&self, batch: &Batch, kv: &KvCache, mut taps: Option<&mut Taps>) -> Result<Tensor> {
        let rot_global = self.rotary_global.angles_for(&batch.positions, &batch.attn, &self.device, self.dtype)?;
        let rot_local = self.rotary_local.angles_for(&batch.positions, &batch.attn, &self.device, self.dtype)?;
        // transformers rounds the scale to the embedding dtype before multiplying.
        let scale = Tensor::new(self.embed_scale as f32, &self.device)?.to_dtype(self.dtype)?;
        let mut x = self.embed.forward(&batch.token_ids, self.dtype)?.broadcast_mul(&scale)?;
        if let Some(t) = taps.as_deref_mut() {
            t.embed = Some(x.clone());
        }
        for (i, l) in self.layers.iter().enumerate() {
            let rot = if l.sliding { &rot_local } else { &rot_global };
            let a = l.attn.forward(&l.input_norm.forward(&x)?, rot, kv.layer(i), &batch.attn)?;
            let h = (&x + l.post_attn_norm.forward(&a)?)?;
            let m = l.mlp.forward(&l.pre_mlp_norm.forward(&h)?)?;
            x = (&h + l.post_mlp_norm.forward(&m)?)?;
            if let Some(t) = taps.as_deref_mut() {
                t.layers.push(x.clone());
            }
        }
        self.norm.forward(&x)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.lm_head.forward(hidden)?.to_dtype(DType::F32)?;
        match self.cfg.final_logit_softcapping {
            Some(cap) => (logits / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }
}
