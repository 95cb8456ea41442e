//! Qwen3.5 and Qwen3.5-MoE, the hybrid family: each layer mixes tokens with either a Gated
//! DeltaNet (`layers::gated_deltanet`, a recurrent state per sequence) or, every
//! `full_attention_interval`-th layer, gated attention (q/k RMSNorm, partial rotary, output
//! times sigmoid(gate)); then an MLP (dense, or experts with a gated shared expert):
//!   h = x + Mixer(N_1(x));   x' = h + F(N_2(h));   output N(x_last)
//! Every RMSNorm outside the DeltaNet is x / rms(x) * (1 + w) (folded at load).

use candle_core::{DType, Device, Result, Tensor};

use crate::batch::{AttentionMeta, Batch};
use crate::config::{LayerKind, TextConfig};
use crate::kv::{KvCache, LayerCache};
use crate::layers::attention::{AttentionOptions, SelfAttention};
use crate::layers::embedding::Embedding;
use crate::layers::ffn::Ffn;
use crate::layers::gated_deltanet::{decoder_norm_style, GatedDeltaNet};
use crate::layers::linear::Linear;
use crate::layers::mtp::{self, MtpHead};
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::layers::rotary::{Rotary, RotaryAngles};
use crate::models::model::{Taps, TextModel};
use crate::weights::{Weights, WeightsError};

enum Mixer {
    DeltaNet(GatedDeltaNet),
    Attention(SelfAttention),
}

struct Layer {
    input_norm: RmsNorm,
    mixer: Mixer,
    ffn_norm: RmsNorm,
    ffn: Ffn,
}

impl Layer {
    /// The layer under `{p}` whose cache is layer `i` (`cfg.layer_kind(i)` picks the mixer).
    fn load(
        w: &Weights,
        cfg: &TextConfig,
        p: &str,
        i: usize,
        style: NormStyle,
    ) -> std::result::Result<Self, WeightsError> {
        let h = cfg.hidden_size;
        let norm = |name: &str| RmsNorm::load(w, &format!("{p}.{name}.weight"), h, cfg.rms_norm_eps, style);
        let mixer = match cfg.layer_kind(i) {
            LayerKind::Linear => Mixer::DeltaNet(GatedDeltaNet::load(w, cfg, i)?),
            _ => Mixer::Attention(SelfAttention::load_at(
                w,
                cfg,
                p,
                i,
                AttentionOptions { qk_norm: Some(style), gated: true, v_norm: false },
            )?),
        };
        let ffn = Ffn::load(w, cfg, p, i)?;
        Ok(Layer { input_norm: norm("input_layernorm")?, mixer, ffn_norm: norm("post_attention_layernorm")?, ffn })
    }

    /// x -> x' over the rows of a batch; `cache`: the layer's (its state or keys and values).
    fn forward(
        &self,
        x: &Tensor,
        rot: &RotaryAngles,
        cache: &LayerCache,
        attn: &AttentionMeta,
        taps: Option<(usize, &mut Taps)>,
    ) -> Result<Tensor> {
        let xn = self.input_norm.forward(x)?;
        let m = match &self.mixer {
            Mixer::DeltaNet(d) => d.forward(&xn, cache, attn)?,
            Mixer::Attention(a) => a.forward(&xn, rot, cache, attn)?,
        };
        let (h, hn) = self.ffn_norm.forward_residual(x, &m)?;
        let (f, experts) = self.ffn.forward(&hn)?;
        if let (Some((i, t)), Some(e)) = (taps, experts) {
            t.router.push((i, e));
        }
        &h + f
    }
}

pub struct Qwen35 {
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

impl Qwen35 {
    pub fn load(w: &Weights, cfg: TextConfig) -> std::result::Result<Self, WeightsError> {
        let h = cfg.hidden_size;
        let style = decoder_norm_style(w, &cfg);
        let layers = (0..cfg.num_layers)
            .map(|i| Layer::load(w, &cfg, &format!("model.layers.{i}"), i, style))
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let embed = Embedding::load(w, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = embed.output_head(w, cfg.tie_word_embeddings, cfg.vocab_size, h)?;
        let mtp = MtpHead::load(w, &cfg, style, &lm_head, |p, i| Layer::load(w, &cfg, p, i, style))?;
        Ok(Qwen35 {
            embed,
            layers,
            norm: RmsNorm::load(w, "model.norm.weight", h, cfg.rms_norm_eps, style)?,
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

impl TextModel for Qwen35 {
    fn config(&self) -> &TextConfig {
        &self.cfg
    }

    fn forward(&self, batch: &Batch, kv: &KvCache, mut taps: Option<&mut Taps>) -> Result<Tensor> {
        let rot = self.rotary.angles_for(&batch.positions, &batch.attn, &self.device, self.dtype)?;
        let mut x = batch.input_embeds(self.embed.forward(&batch.token_ids, self.dtype)?)?;
        if let Some(t) = taps.as_deref_mut() {
            t.embed = Some(x.clone());
        }
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(&x, &rot, kv.layer(i), &batch.attn, taps.as_deref_mut().map(|t| (i, t)))?;
            if let Some(t) = taps.as_deref_mut() {
                t.layers.push(x.clone());
            }
        }
        self.norm.forward(&x)
    }

    fn mtp_forward(&self, batch: &Batch, hidden: &Tensor, kv: &KvCache) -> Result<Tensor> {
        let mtp = mtp::loaded(&self.mtp)?;
        let rot = self.rotary.angles_for(&batch.positions, &batch.attn, &self.device, self.dtype)?;
        let x = mtp.input(&self.embed.forward(&batch.token_ids, self.dtype)?, hidden)?;
        mtp.output(&mtp.layer.forward(&x, &rot, kv.layer(self.cfg.num_layers), &batch.attn, None)?)
    }

    fn mtp_logits(&self, m: &Tensor) -> Result<(Tensor, Option<&[u32]>)> {
        mtp::loaded(&self.mtp)?.draft_logits(m, |m| self.logits(m))
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)?.to_dtype(DType::F32)
    }
}
