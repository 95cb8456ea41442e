//! The GLM-4.xV language model: attention with q/k/v biases and partial M-RoPE (three-axis
//! positions come with the batch), then an MLP.
//!   GLM-4.1V (`glm4v`):       h = x + N_a(Attn(N_1(x)));   x' = h + N_m(MLP(N_2(h)))
//!   GLM-4.5V (`glm4v_moe`):   h = x + Attn(N_1(x));        x' = h + F(N_2(h))
//! where F is a dense MLP in the first `first_k_dense_replace` layers and a mixture of experts
//! (`layers::moe`) after them. A checkpoint's NextN layer (`layers.{num_hidden_layers}`, one
//! more such layer) is its MTP head (`layers::mtp`).

use candle_core::{DType, Device, Result, Tensor};

use crate::batch::{AttentionMeta, Batch};
use crate::config::{Arch, TextConfig};
use crate::kv::{KvCache, LayerCache};
use crate::layers::attention::{AttentionOptions, SelfAttention};
use crate::layers::embedding::Embedding;
use crate::layers::ffn::Ffn;
use crate::layers::linear::Linear;
use crate::layers::mtp::{self, MtpHead};
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::layers::rotary::{Rotary, RotaryAngles};
use crate::models::model::{Taps, TextModel};
use crate::weights::{Weights, WeightsError};

struct Layer {
    input_norm: RmsNorm,
    attn: SelfAttention,
    /// GLM-4.1V normalises the attention output before the residual add.
    post_attn_norm: Option<RmsNorm>,
    ffn_norm: RmsNorm,
    ffn: Ffn,
    /// GLM-4.1V normalises the MLP output before the residual add.
    post_ffn_norm: Option<RmsNorm>,
}

impl Layer {
    /// The layer under `{p}` whose cache is layer `i`.
    fn load(w: &Weights, cfg: &TextConfig, p: &str, i: usize) -> std::result::Result<Self, WeightsError> {
        let h = cfg.hidden_size;
        let norm = |name: &str| RmsNorm::load(w, &format!("{p}.{name}.weight"), h, cfg.rms_norm_eps, NormStyle::Plain);
        let sandwich = cfg.arch == Arch::Glm4v;
        Ok(Layer {
            input_norm: norm("input_layernorm")?,
            attn: SelfAttention::load_at(w, cfg, p, i, AttentionOptions::default())?,
            post_attn_norm: sandwich.then(|| norm("post_self_attn_layernorm")).transpose()?,
            ffn_norm: norm("post_attention_layernorm")?,
            ffn: Ffn::load(w, cfg, p, i)?,
            post_ffn_norm: sandwich.then(|| norm("post_mlp_layernorm")).transpose()?,
        })
    }

    /// x -> x' over the rows of a batch.
    fn forward(
        &self,
        x: &Tensor,
        rot: &RotaryAngles,
        cache: &LayerCache,
        attn: &AttentionMeta,
        taps: Option<(usize, &mut Taps)>,
    ) -> Result<Tensor> {
        let mut a = self.attn.forward(&self.input_norm.forward(x)?, rot, cache, attn)?;
        if let Some(n) = &self.post_attn_norm {
            a = n.forward(&a)?;
        }
        let h = (x + a)?;
        let (mut f, experts) = self.ffn.forward(&self.ffn_norm.forward(&h)?)?;
        if let (Some((i, t)), Some(e)) = (taps, experts) {
            t.router.push((i, e));
        }
        if let Some(n) = &self.post_ffn_norm {
            f = n.forward(&f)?;
        }
        &h + f
    }
}

pub struct GlmText {
    cfg: TextConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    /// The NextN layer as an MTP head, when drafting with it (`TextConfig::mtp_layers`).
    mtp: Option<MtpHead<Layer>>,
    dtype: DType,
    device: Device,
}

impl GlmText {
    pub fn load(w: &Weights, cfg: TextConfig) -> std::result::Result<Self, WeightsError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let layers = (0..cfg.num_layers)
            .map(|i| Layer::load(w, &cfg, &format!("model.layers.{i}"), i))
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let embed = Embedding::load(w, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = embed.output_head(w, cfg.tie_word_embeddings, cfg.vocab_size, h)?;
        let mtp = MtpHead::load(w, &cfg, NormStyle::Plain, &lm_head, |p, i| Layer::load(w, &cfg, p, i))?;
        Ok(GlmText {
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

impl TextModel for GlmText {
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
