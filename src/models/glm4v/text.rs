//! The GLM-4.xV language model: attention with q/k/v biases and partial M-RoPE (three-axis
//! positions come with the batch), then an MLP.
//!   GLM-4.1V (`glm4v`):       h = x + N_a(Attn(N_1(x)));   x' = h + N_m(MLP(N_2(h)))
//!   GLM-4.5V (`glm4v_moe`):   h = x + Attn(N_1(x));        x' = h + F(N_2(h))
//! where F is a dense MLP in the first `first_k_dense_replace` layers and a mixture of experts
//! (`layers::moe`) after them.

use candle_core::{DType, Device, Result, Tensor};

use crate::batch::Batch;
use crate::config::{Arch, TextConfig};
use crate::kv::KvCache;
use crate::layers::attention::SelfAttention;
use crate::layers::embedding::Embedding;
use crate::layers::linear::Linear;
use crate::layers::mlp::GatedMlp;
use crate::layers::moe::Moe;
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::layers::rotary::Rotary;
use crate::models::model::{Taps, TextModel};
use crate::weights::{Weights, WeightsError};

enum Ffn {
    Dense(GatedMlp),
    Experts(Moe),
}

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

pub struct GlmText {
    cfg: TextConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    dtype: DType,
    device: Device,
}

impl GlmText {
    pub fn load(w: &Weights, cfg: TextConfig) -> std::result::Result<Self, WeightsError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let norm = |name: String| RmsNorm::load(w, &name, h, eps, NormStyle::Plain);
        let sandwich = cfg.arch == Arch::Glm4v;
        let layers = (0..cfg.num_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let ffn = match &cfg.moe {
                    Some(moe) if moe.is_moe_layer(i) => {
                        Ffn::Experts(Moe::load(w, &format!("{p}.mlp"), h, moe, cfg.activation)?)
                    }
                    _ => Ffn::Dense(GatedMlp::load(w, &format!("{p}.mlp"), h, cfg.intermediate_size, cfg.activation)?),
                };
                Ok(Layer {
                    input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                    attn: SelfAttention::load(w, &cfg, i, None)?,
                    post_attn_norm: sandwich
                        .then(|| norm(format!("{p}.post_self_attn_layernorm.weight")))
                        .transpose()?,
                    ffn_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                    ffn,
                    post_ffn_norm: sandwich.then(|| norm(format!("{p}.post_mlp_layernorm.weight"))).transpose()?,
                })
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let embed = Embedding::load(w, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = embed.output_head(w, cfg.tie_word_embeddings, cfg.vocab_size, h)?;
        Ok(GlmText {
            embed,
            layers,
            norm: norm("model.norm.weight".into())?,
            lm_head,
            rotary: Rotary::new(&cfg.rope, cfg.rotary_dim, cfg.rope_layout).on_device(
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
            let mut a = l.attn.forward(&l.input_norm.forward(&x)?, &rot, kv.layer(i), &batch.attn)?;
            if let Some(n) = &l.post_attn_norm {
                a = n.forward(&a)?;
            }
            let h = (&x + a)?;
            let hn = l.ffn_norm.forward(&h)?;
            let mut f = match &l.ffn {
                Ffn::Dense(mlp) => mlp.forward(&hn)?,
                Ffn::Experts(moe) => {
                    let routing = moe.route(&hn)?;
                    if let Some(t) = taps.as_deref_mut() {
                        t.router.push((i, routing.experts.clone()));
                    }
                    moe.forward(&hn, &routing)?
                }
            };
            if let Some(n) = &l.post_ffn_norm {
                f = n.forward(&f)?;
            }
            x = (&h + f)?;
            if let Some(t) = taps.as_deref_mut() {
                t.layers.push(x.clone());
            }
        }
        self.norm.forward(&x)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)?.to_dtype(DType::F32)
    }
}
