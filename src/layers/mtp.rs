//! An MTP (multi-token prediction) head's input and output, around one decoder layer of the
//! model's own kind, named as `MtpLayout` says (Qwen3.5's `mtp.*`, or the NextN layer of
//! DeepSeek-V3 and GLM-4.5V / GLM-4.6V). For the pair of a target hidden row h_p (after the
//! final norm) and the token t_{p+1} it produced:
//!   x = fc(concat(N_e(E[t_{p+1}]), N_h(h_p)));   m_p = N_m(Layer(x, position p))
//! and lm_head(m_p) predicts t_{p+2}. The embedding table and the LM head are the target's.
//!
//! A head may come with a draft vocabulary (`mtp.draft_vocab`, token ids; an iris extension,
//! the idea of FR-Spec and EAGLE-3's reduced vocabularies): drafts are then scored over those
//! tokens only, which makes the head's LM-head product, the larger part of a small model's
//! draft step, that much smaller. Drafts are verified as always, so outputs do not change.

use candle_core::{Result, Tensor};

use crate::config::{Arch, TextConfig};
use crate::layers::linear::Linear;
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::weights::{Weights, WeightsError};

/// Where a checkpoint keeps its head's parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MtpLayout {
    /// Qwen3.5's: `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}` around the
    /// decoder layer at `mtp.layers.0`.
    Qwen,
    /// DeepSeek-V3's NextN layer (GLM-4.5V / GLM-4.6V), stored as decoder layer
    /// `num_hidden_layers` under the decoder's prefix: `{enorm, hnorm, eh_proj,
    /// shared_head.norm}` beside the layer's own tensors. Its `embed_tokens` and
    /// `shared_head.head`, where a checkpoint has them, are not read: they are the target's,
    /// shared in training (transformers' MtpModel ties both to the target's, vLLM takes the
    /// target's embedding), and would double the largest matrices in memory.
    NextN,
}

impl MtpLayout {
    /// How `arch`'s heads are stored; None for a family without one iris can run.
    pub fn of(arch: Arch) -> Option<Self> {
        match arch {
            Arch::Qwen35 | Arch::Qwen35Moe | Arch::Llama => Some(MtpLayout::Qwen),
            // GLM-4.1V's would be its own (sandwich-norm) layer in the same layout; only
            // GLM-4.5V's is tested (tests/mtp.rs).
            Arch::Glm4v | Arch::Glm4vMoe => Some(MtpLayout::NextN),
            _ => None,
        }
    }

    /// The modules of (embedding norm, hidden norm, fc, output norm) and the layer's prefix,
    /// for a decoder of `num_layers` layers.
    fn modules(self, num_layers: usize) -> [String; 5] {
        match self {
            MtpLayout::Qwen => {
                ["mtp.pre_fc_norm_embedding", "mtp.pre_fc_norm_hidden", "mtp.fc", "mtp.norm", "mtp.layers.0"]
                    .map(String::from)
            }
            MtpLayout::NextN => {
                let p = format!("model.layers.{num_layers}");
                [format!("{p}.enorm"), format!("{p}.hnorm"), format!("{p}.eh_proj"), format!("{p}.shared_head.norm"), p]
            }
        }
    }

    /// The tensor every head of this layout has (the loader looks for it).
    pub fn marker(self, num_layers: usize) -> String {
        let [_, _, fc, _, _] = self.modules(num_layers);
        format!("{fc}.weight")
    }
}

pub struct MtpHead<L> {
    embed_norm: RmsNorm,
    hidden_norm: RmsNorm,
    fc: Linear,
    norm: RmsNorm,
    /// The decoder layer, built by the family (`mtp.layers.0`, or NextN's `model.layers.{N}`);
    /// its cache layer is the first after the decoder's (`TextConfig::num_layers`).
    pub layer: L,
    /// With a draft vocabulary: the LM head's rows of its tokens, and the tokens.
    draft_head: Option<(Linear, Vec<u32>)>,
}

impl<L> MtpHead<L> {
    /// The head, in its family's layout, when `cfg.mtp_layers` asks for one (the first layer
    /// only: every released head has one), else None. `layer` builds the decoder layer from
    /// its tensor prefix and cache layer index.
    pub fn load(
        w: &Weights,
        cfg: &TextConfig,
        style: NormStyle,
        lm_head: &Linear,
        layer: impl FnOnce(&str, usize) -> std::result::Result<L, WeightsError>,
    ) -> std::result::Result<Option<Self>, WeightsError> {
        // The loader refuses MTP drafting for a family without a layout before this.
        let Some(layout) = MtpLayout::of(cfg.arch).filter(|_| cfg.mtp_layers > 0) else { return Ok(None) };
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let [embed_norm, hidden_norm, fc, norm, prefix] = layout.modules(cfg.num_layers);
        let norm_at = |m: &str| RmsNorm::load(w, &format!("{m}.weight"), h, eps, style);
        Ok(Some(MtpHead {
            embed_norm: norm_at(&embed_norm)?,
            hidden_norm: norm_at(&hidden_norm)?,
            fc: Linear::load(w, &fc, 2 * h, h, false)?,
            norm: norm_at(&norm)?,
            layer: layer(&prefix, cfg.num_layers)?,
            draft_head: draft_head(w, cfg, lm_head)?,
        }))
    }

    /// The layer's input for rows of (embedded next token, target hidden row).
    pub fn input(&self, embeds: &Tensor, hidden: &Tensor) -> Result<Tensor> {
        let both = Tensor::cat(&[self.embed_norm.forward(embeds)?, self.hidden_norm.forward(hidden)?], 1)?;
        self.fc.forward(&both)
    }

    /// The head's hidden rows (its logits through the target's LM head; the next draft step's
    /// hidden input).
    pub fn output(&self, x: &Tensor) -> Result<Tensor> {
        self.norm.forward(x)
    }

    /// Draft logits of the head's rows `m`: over the draft vocabulary (with its tokens) when
    /// the head has one, else the target's whole LM head's (`full`).
    pub fn draft_logits(
        &self,
        m: &Tensor,
        full: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, Option<&[u32]>)> {
        match &self.draft_head {
            Some((head, ids)) => Ok((head.forward(m)?.to_dtype(candle_core::DType::F32)?, Some(ids))),
            None => Ok((full(m)?, None)),
        }
    }
}

/// A model's head, when it was loaded with one (the engine asks for it only when drafting
/// with MTP, so its absence is a bug in the caller, not bad input).
pub fn loaded<L>(head: &Option<MtpHead<L>>) -> Result<&MtpHead<L>> {
    head.as_ref().ok_or_else(|| candle_core::Error::Msg("this model was loaded without its MTP head".into()))
}

/// `mtp.draft_vocab`'s rows of `lm_head`, when the head has that tensor.
fn draft_head(
    w: &Weights,
    cfg: &TextConfig,
    lm_head: &Linear,
) -> std::result::Result<Option<(Linear, Vec<u32>)>, WeightsError> {
    const NAME: &str = "mtp.draft_vocab";
    let Some(shape) = w.shape_of(NAME) else { return Ok(None) };
    let bad = |msg: String| WeightsError::BadTensor { name: NAME.into(), origin: w.origin_of(NAME).to_path_buf(), msg };
    let values = w.dense_f32(NAME, &shape)?.flatten_all()?.to_vec1::<f32>()?;
    // Checked before the cast, which would turn a negative or fractional id into another one.
    let is_id = |v: f32| v >= 0.0 && v.fract() == 0.0 && (v as usize) < cfg.vocab_size;
    if shape.len() != 1 || values.is_empty() || !values.iter().all(|&v| is_id(v)) {
        return Err(bad(format!("must be a list of token ids below the vocabulary's {}", cfg.vocab_size)));
    }
    let ids: Vec<u32> = values.iter().map(|&v| v as u32).collect();
    Ok(lm_head.rows(&ids)?.map(|h| (h, ids)))
}
