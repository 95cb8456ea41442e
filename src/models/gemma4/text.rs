//! Gemma 4 (text): plain-w RMSNorms around both sub-blocks; q/k/v norms and attention scale 1;
//! sliding layers with their own rotary, full layers with wider heads and proportional RoPE;
//! the last layers may attend over an earlier layer's keys and values (KV sharing).
//!   h = x + Norm(Attn(Norm(x)))
//!   m = MLP(Norm(h)),  or with experts  m = Norm(MLP(Norm(h))) + Norm(MoE(Norm(h), route(h)))
//!   x' = (h + Norm(m) [+ Norm(W_o (gelu(W_g (h + Norm(m))) * ple_l))]) * layer_scalar

use std::borrow::Cow;

use candle_core::{DType, Device, Result, Tensor};

use crate::batch::{AttentionMeta, Batch};
use crate::config::{Activation, LayerKind, TextConfig};
use crate::kv::{KvCache, LayerCache};
use crate::layers::attention::{AttentionOptions, SelfAttention};
use crate::layers::embedding::Embedding;
use crate::layers::linear::Linear;
use crate::layers::mlp::GatedMlp;
use crate::layers::moe::Moe;
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::layers::per_layer_embedding::{PerLayerEmbedding, PleGate};
use crate::layers::rotary::{Rotary, RotaryAngles};
use crate::models::model::{Taps, TextModel};
use crate::weights::{Weights, WeightsError};

/// The experts beside the dense MLP, with the three norms around them.
struct Experts {
    moe: Moe,
    pre_norm: RmsNorm,
    post_dense_norm: RmsNorm,
    post_norm: RmsNorm,
}

pub(super) struct Layer {
    input_norm: RmsNorm,
    attn: SelfAttention,
    post_attn_norm: RmsNorm,
    pre_mlp_norm: RmsNorm,
    mlp: GatedMlp,
    post_mlp_norm: RmsNorm,
    experts: Option<Experts>,
    ple: Option<PleGate>,
    scalar: Tensor,
    pub(super) sliding: bool,
}

pub struct Gemma4 {
    cfg: TextConfig,
    embed: Embedding,
    ple: Option<PerLayerEmbedding>,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary_full: Rotary,
    rotary_sliding: Rotary,
    dtype: DType,
    device: Device,
}

impl Gemma4 {
    pub fn load(w: &Weights, cfg: TextConfig) -> std::result::Result<Self, WeightsError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let layers =
            (0..cfg.num_layers).map(|i| Layer::load(w, &cfg, i)).collect::<std::result::Result<Vec<_>, _>>()?;
        let embed = Embedding::load(w, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = embed.output_head(w, cfg.tie_word_embeddings, cfg.vocab_size, h)?;
        let ple = cfg.gemma4.unwrap_or_default().per_layer_input;
        let ple = ple.map(|p| PerLayerEmbedding::load(w, p, cfg.num_layers, h, eps)).transpose()?;
        let (rotary_full, rotary_sliding) = rotaries(w, &cfg)?;
        Ok(Gemma4 {
            embed,
            ple,
            layers,
            norm: RmsNorm::load(w, "model.norm.weight", h, eps, NormStyle::Plain)?,
            lm_head,
            rotary_full,
            rotary_sliding,
            dtype: w.dtype(),
            device: w.device().clone(),
            cfg,
        })
    }

    /// The scaled input embeddings `[T, hidden]` of `ids` (what the first layer reads; the
    /// assistant drafter reads them too).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        // transformers rounds the scale to the embedding dtype before multiplying.
        let scale = Tensor::new((self.cfg.hidden_size as f32).sqrt(), &self.device)?.to_dtype(self.dtype)?;
        self.embed.forward(ids, self.dtype)?.broadcast_mul(&scale)
    }
}

/// The full and the sliding layers' rotaries, each as wide as its layers' heads.
pub(super) fn rotaries(w: &Weights, cfg: &TextConfig) -> std::result::Result<(Rotary, Rotary), WeightsError> {
    let local = cfg.rope_local.clone().unwrap_or_else(|| cfg.rope.clone());
    let rotary = |rope, kind| {
        let width = (0..cfg.num_layers)
            .find(|&l| cfg.layer_kinds[l] == kind)
            .map_or(cfg.head_dim, |l| cfg.kv_shape(l).head_dim);
        Rotary::new(rope, width, cfg.rope_layout).on_device(w.device(), w.dtype(), cfg.max_position_embeddings)
    };
    Ok((rotary(&cfg.rope, LayerKind::Full)?, rotary(&local, LayerKind::Sliding)?))
}

impl Layer {
    pub(super) fn load(w: &Weights, cfg: &TextConfig, i: usize) -> std::result::Result<Self, WeightsError> {
        let (h, eps, g) = (cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma4.unwrap_or_default());
        let norm = |name: String| RmsNorm::load(w, &name, h, eps, NormStyle::Plain);
        let opts = AttentionOptions { qk_norm: Some(NormStyle::Plain), gated: false, v_norm: true };
        let p = format!("model.layers.{i}");
        let shared = cfg.kv_source(i).is_some();
        let width = if g.double_wide_mlp && shared { 2 } else { 1 } * cfg.intermediate_size;
        let experts = cfg.moe.as_ref().map(|m| -> std::result::Result<_, WeightsError> {
            Ok(Experts {
                moe: Moe::load_gemma(w, &p, h, eps, m, cfg.activation)?,
                pre_norm: norm(format!("{p}.pre_feedforward_layernorm_2.weight"))?,
                post_dense_norm: norm(format!("{p}.post_feedforward_layernorm_1.weight"))?,
                post_norm: norm(format!("{p}.post_feedforward_layernorm_2.weight"))?,
            })
        });
        Ok(Layer {
            input_norm: norm(format!("{p}.input_layernorm.weight"))?,
            attn: SelfAttention::load_with(w, cfg, i, opts)?,
            post_attn_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
            pre_mlp_norm: norm(format!("{p}.pre_feedforward_layernorm.weight"))?,
            mlp: GatedMlp::load(w, &format!("{p}.mlp"), h, width, cfg.activation)?,
            post_mlp_norm: norm(format!("{p}.post_feedforward_layernorm.weight"))?,
            experts: experts.transpose()?,
            ple: g.per_layer_input.map(|pl| PleGate::load(w, &p, h, pl.dim, eps)).transpose()?,
            scalar: w.dense(&format!("{p}.layer_scalar"), &[1])?,
            sliding: cfg.layer_kinds[i] == LayerKind::Sliding,
        })
    }

    pub(super) fn forward(
        &self,
        x: &Tensor,
        rot: &RotaryAngles,
        cache: &LayerCache,
        meta: &AttentionMeta,
        ple: Option<&Tensor>,
        act: Activation,
    ) -> Result<Tensor> {
        let a = self.attn.forward(&self.input_norm.forward(x)?, rot, cache, meta)?;
        let h = (x + self.post_attn_norm.forward(&a)?)?;
        let mut m = self.mlp.forward(&self.pre_mlp_norm.forward(&h)?)?;
        if let Some(e) = &self.experts {
            let routed = e.moe.forward(&e.pre_norm.forward(&h)?, &e.moe.route(&h)?)?;
            m = (e.post_dense_norm.forward(&m)? + e.post_norm.forward(&routed)?)?;
        }
        let mut x = (&h + self.post_mlp_norm.forward(&m)?)?;
        if let (Some(g), Some(ple)) = (&self.ple, ple) {
            x = (&x + g.forward(&x, ple, act)?)?;
        }
        x.broadcast_mul(&self.scalar)
    }
}

impl TextModel for Gemma4 {
    fn config(&self) -> &TextConfig {
        &self.cfg
    }

    fn forward(&self, batch: &Batch, kv: &KvCache, mut taps: Option<&mut Taps>) -> Result<Tensor> {
        let mut rot_full = self.rotary_full.angles_for(&batch.positions, &batch.attn, &self.device, self.dtype)?;
        let mut rot_sliding =
            self.rotary_sliding.angles_for(&batch.positions, &batch.attn, &self.device, self.dtype)?;
        // Image rows take their embeddings from the vision tower, unscaled.
        let mut x = batch.input_embeds(self.embed(&batch.token_ids)?)?;
        let mut ple = self.ple.as_ref().map(|p| p.forward(batch, &x)).transpose()?;
        if let Some(t) = taps.as_deref_mut() {
            t.embed = Some(x.clone());
        }
        let (rows, first_shared) = (batch.num_rows(), self.cfg.kv_source.iter().position(Option::is_some));
        let (mut meta, mut kept) = (Cow::Borrowed(&batch.attn), None);
        for (i, l) in self.layers.iter().enumerate() {
            // The KV-sharing layers store nothing: only the rows read after the pass need
            // them (transformers slices its prefill alike).
            let drops = |c: &Vec<usize>| c.iter().zip(&batch.attn.seqs).any(|(&n, s)| n < s.q_len);
            if let (Some(counts), true, None) =
                (batch.output_rows.as_ref().filter(|c| drops(c)), Some(i) == first_shared, &taps)
            {
                let (tail, keep) = batch.attn.tail(counts)?;
                if keep.is_empty() {
                    return Tensor::zeros((rows, self.cfg.hidden_size), self.dtype, &self.device);
                }
                if keep.len() < rows {
                    let idx = Tensor::new(keep, &self.device)?;
                    (x, rot_full, rot_sliding) =
                        (x.index_select(&idx, 0)?, rot_full.rows(&idx)?, rot_sliding.rows(&idx)?);
                    ple = ple.map(|p| p.index_select(&idx, 0)).transpose()?;
                    (meta, kept) = (Cow::Owned(tail), Some(idx));
                }
            }
            let rot = if l.sliding { &rot_sliding } else { &rot_full };
            let ple_i = ple.as_ref().map(|p| p.narrow(1, i, 1)?.squeeze(1)).transpose()?;
            x = l.forward(&x, rot, kv.layer(i), &meta, ple_i.as_ref(), self.cfg.activation)?;
            if let Some(t) = taps.as_deref_mut() {
                t.layers.push(x.clone());
            }
        }
        let h = self.norm.forward(&x)?;
        match kept {
            Some(idx) => Tensor::zeros((rows, self.cfg.hidden_size), h.dtype(), &self.device)?.index_add(&idx, &h, 0),
            None => Ok(h),
        }
    }

    fn input_embeddings(&self, ids: &Tensor) -> Result<Tensor> {
        self.embed(ids)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        let logits = self.lm_head.forward(hidden)?.to_dtype(DType::F32)?;
        match self.cfg.final_logit_softcapping {
            Some(cap) => (logits / cap)?.tanh()? * cap,
            None => Ok(logits),
        }
    }
}
