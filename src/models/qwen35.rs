//! Qwen3.5 and Qwen3.5-MoE, the hybrid family: each layer mixes tokens with either a Gated
//! DeltaNet (`layers::gated_deltanet`, a recurrent state per sequence) or, every
//! `full_attention_interval`-th layer, gated attention (q/k RMSNorm, partial rotary, output
//! times sigmoid(gate)); then an MLP (dense, or experts with a gated shared expert):
//!   h = x + Mixer(N_1(x));   x' = h + F(N_2(h));   output N(x_last)
//! Every RMSNorm outside the DeltaNet is x / rms(x) * (1 + w) (folded at load).

use candle_core::{DType, Device, Result, Tensor};

use crate::batch::Batch;
use crate::config::{LayerKind, TextConfig};
use crate::kv::KvCache;
use crate::layers::attention::{AttentionOptions, SelfAttention};
use crate::layers::embedding::Embedding;
use crate::layers::gated_deltanet::{decoder_norm_style, GatedDeltaNet};
use crate::layers::linear::Linear;
use crate::layers::mlp::GatedMlp;
use crate::layers::moe::Moe;
use crate::layers::norm::RmsNorm;
use crate::layers::rotary::Rotary;
use crate::models::model::{Taps, TextModel};
use crate::weights::{Weights, WeightsError};

enum Mixer {
    DeltaNet(GatedDeltaNet),
    Attention(SelfAttention),
}

enum Ffn {
    Dense(GatedMlp),
    Experts(Moe),
}

struct Layer {
    input_norm: RmsNorm,
    mixer: Mixer,
    ffn_norm: RmsNorm,
    ffn: Ffn,
}

pub struct Qwen35 {
    cfg: TextConfig,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    lm_head: Linear,
    rotary: Rotary,
    dtype: DType,
    device: Device,
}

impl Qwen35 {
    pub fn load(w: &Weights, cfg: TextConfig) -> std::result::Result<Self, WeightsError> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let style = decoder_norm_style(w, &cfg);
        let norm = |name: String| RmsNorm::load(w, &name, h, eps, style);
        let layers = (0..cfg.num_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let mixer = match cfg.layer_kinds[i] {
                    LayerKind::Linear => Mixer::DeltaNet(GatedDeltaNet::load(w, &cfg, i)?),
                    _ => Mixer::Attention(SelfAttention::load_with(
                        w,
                        &cfg,
                        i,
                        AttentionOptions { qk_norm: Some(style), gated: true, v_norm: false },
                    )?),
                };
                let ffn = match &cfg.moe {
                    Some(moe) => Ffn::Experts(Moe::load(w, &format!("{p}.mlp"), h, moe, cfg.activation)?),
                    None => {
                        Ffn::Dense(GatedMlp::load(w, &format!("{p}.mlp"), h, cfg.intermediate_size, cfg.activation)?)
                    }
                };
                Ok(Layer {
                    input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                    mixer,
                    ffn_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                    ffn,
                })
            })
            .collect::<std::result::Result<Vec<_>, WeightsError>>()?;
        let embed = Embedding::load(w, "model.embed_tokens.weight", cfg.vocab_size, h)?;
        let lm_head = embed.output_head(w, cfg.tie_word_embeddings, cfg.vocab_size, h)?;
        Ok(Qwen35 {
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
            let xn = l.input_norm.forward(&x)?;
            let m = match &l.mixer {
                Mixer::DeltaNet(d) => d.forward(&xn, kv.layer(i), &batch.attn)?,
                Mixer::Attention(a) => a.forward(&xn, &rot, kv.layer(i), &batch.attn)?,
            };
            let (h, hn) = l.ffn_norm.forward_residual(&x, &m)?;
            let f = match &l.ffn {
                Ffn::Dense(mlp) => mlp.forward(&hn)?,
                Ffn::Experts(moe) => {
                    let routing = moe.route(&hn)?;
                    if let Some(t) = taps.as_deref_mut() {
                        t.router.push((i, routing.experts.clone()));
                    }
                    moe.forward(&hn, &routing)?
                }
            };
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
