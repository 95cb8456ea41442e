//! Gemma 4's assistant drafter (`gemma4_assistant`): Gemma 4 layers that keep no keys and
//! values of their own and attend over the target's cache (each the last target layer of its
//! kind that stores any), from one position for every draft step:
//!   x  = W_pre [ E_target(t) ; h ]      t the last token, h the target's final hidden row
//!                                       that produced it (later steps: the drafter's own h')
//!   y  = Norm(layers(x))                query at the position of t, keys the cached ones
//!   logits = head(y)  (centroid-masked with ordered embeddings; no soft-capping)
//!   h' = W_post y
//! The draft is the argmax; it and h' feed the next step.

use std::path::Path;

use candle_core::{DType, Device, Result, Tensor};

use super::assistant_config::{AssistantConfig, AssistantError};
use super::text::{rotaries, Layer};
use crate::batch::AttentionMeta;
use crate::config::TextConfig;
use crate::kv::KvCache;
use crate::layers::centroid_head::CentroidHead;
use crate::layers::linear::Linear;
use crate::layers::norm::{NormStyle, RmsNorm};
use crate::layers::rotary::Rotary;
use crate::weights::{SafetensorsDir, Weights};

pub struct Gemma4Assistant {
    cfg: AssistantConfig,
    layers: Vec<Layer>,
    norm: RmsNorm,
    pre_projection: Linear,
    post_projection: Linear,
    /// `[vocab, hidden]` (tied with the embeddings).
    head: Tensor,
    centroids: Option<CentroidHead>,
    rotary_full: Rotary,
    rotary_sliding: Rotary,
}

/// One draft step's output for each sequence.
pub struct DraftStep {
    /// `[S, vocab]` f32.
    pub logits: Tensor,
    /// `[S, target hidden]`: the next step's hidden row.
    pub hidden: Tensor,
}

impl Gemma4Assistant {
    /// Loads the assistant in `dir` for `target` (refused when they don't fit).
    pub fn load(
        dir: &Path,
        target: &TextConfig,
        device: &Device,
        dtype: DType,
    ) -> std::result::Result<Self, AssistantError> {
        let cfg = AssistantConfig::load(dir, target)?;
        let w = Weights::from_safetensors(SafetensorsDir::open(dir)?, device.clone(), dtype);
        let t = &cfg.text;
        let (h, b) = (t.hidden_size, cfg.backbone_hidden);
        let layers = (0..t.num_layers).map(|i| Layer::load(&w, t, i)).collect::<std::result::Result<Vec<_>, _>>()?;
        let centroids = cfg
            .centroids
            .map(|c| CentroidHead::load(&w, "masked_embedding", h, t.vocab_size, c.num_centroids, c.top_k))
            .transpose()?;
        let (rotary_full, rotary_sliding) = rotaries(&w, t)?;
        Ok(Gemma4Assistant {
            layers,
            norm: RmsNorm::load(&w, "model.norm.weight", h, t.rms_norm_eps, NormStyle::Plain)?,
            pre_projection: Linear::load(&w, "pre_projection", 2 * b, h, false)?,
            post_projection: Linear::load(&w, "post_projection", h, b, false)?,
            head: w.dense(
                if t.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" },
                &[t.vocab_size, h],
            )?,
            centroids,
            rotary_full,
            rotary_sliding,
            cfg,
        })
    }

    pub fn config(&self) -> &AssistantConfig {
        &self.cfg
    }

    /// One draft step for S sequences. `embeds` `[S, target hidden]`: the target's input
    /// embeddings of each sequence's last token; `hidden` `[S, target hidden]`; `positions`:
    /// each last token's position (= tokens in its cache); `meta`: one row per sequence whose
    /// context is its cached tokens (so the row sits at the last cached position: causal
    /// full layers see them all, the widened sliding window the last window + 1); `kv`: the
    /// target's cache, read only.
    pub fn step(
        &self,
        embeds: &Tensor,
        hidden: &Tensor,
        positions: &[u32],
        kv: &KvCache,
        meta: &AttentionMeta,
    ) -> Result<DraftStep> {
        let (dev, dtype) = (embeds.device(), embeds.dtype());
        let rot_full = self.rotary_full.angles(positions, dev, dtype)?;
        let rot_sliding = self.rotary_sliding.angles(positions, dev, dtype)?;
        let mut x = self.pre_projection.forward(&Tensor::cat(&[embeds, &hidden.to_dtype(dtype)?], 1)?)?;
        let t = &self.cfg.text;
        for (i, l) in self.layers.iter().enumerate() {
            let src = t
                .kv_source(i)
                .ok_or_else(|| candle_core::Error::Msg(format!("assistant layer {i} reads no target layer")))?;
            let rot = if l.sliding { &rot_sliding } else { &rot_full };
            x = l.forward(&x, rot, kv.layer(src), meta, None, t.activation)?;
        }
        let y = self.norm.forward(&x)?;
        let logits = match &self.centroids {
            Some(c) => c.forward(&y, &self.head)?,
            None => y.matmul(&self.head.t()?)?.to_dtype(DType::F32)?,
        };
        Ok(DraftStep { logits, hidden: self.post_projection.forward(&y)? })
    }
}
