//! Gated DeltaNet (Qwen3.5's linear attention), for rows `x` of a step:
//!   qkv, z, b, a = x W_qkv^T, x W_z^T, x W_b^T, x W_a^T
//!   o = DeltaRule(conv(qkv), a, b)           per sequence, from its state (`ops::gated_delta`)
//!   y = out_proj(RMSNorm_w(o) * silu(z))     the gated norm over each value head, plain w
//! The state lives in the layer's `LayerCache::Recurrent`, one slot per running sequence
//! (`AttentionMeta::state_slots`); a sequence computing its position 0 starts from zero. A
//! sequence verifying drafts (`AttentionMeta::state_checkpoints`) also leaves the state after
//! each of its rows but the last in its slot's checkpoints, for the runner to roll back to.
//! On the CPU the recurrence runs on the host (`ops::gated_delta`, the reference); on a GPU
//! in device kernels over the device states (`ops::gated_delta_cuda`), without checkpoints.

use candle_core::{DType, Result, Tensor};

use super::linear::{Linear, StackedLinear};
use super::norm::{NormStyle, RmsNorm};
use crate::batch::AttentionMeta;
use crate::config::{LinearAttnConfig, TextConfig};
use crate::kv::LayerCache;
use crate::ops::gated_delta::{run_sequence_recording, DeltaParams, RowStates};
use crate::weights::{Weights, WeightsError};

pub struct GatedDeltaNet {
    /// in_proj_qkv, in_proj_z, in_proj_b, in_proj_a as one product.
    in_proj: StackedLinear,
    /// `[conv_dim, K]` f32 (HF stores `[conv_dim, 1, K]`).
    conv_weight: Vec<f32>,
    /// `-exp(A_log)` per value head.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    norm: RmsNorm,
    out_proj: Linear,
    dims: LinearAttnConfig,
    /// The same fixed parameters in device memory, on a GPU.
    #[cfg(feature = "cuda")]
    device: Option<crate::ops::gated_delta_cuda::DeviceDeltaParams>,
}

/// The RMSNorm convention of a Qwen3.5 checkpoint's decoder norms: HF checkpoints store `w`
/// for `1 + w`; MLX conversions store `1 + w` (mlx's sanitize adds the one as it moves
/// `conv1d`'s axes to channels-last, so the conv layout tells which checkpoint this is).
pub fn decoder_norm_style(w: &Weights, cfg: &TextConfig) -> NormStyle {
    let (Some(l), Some(&layer)) = (&cfg.linear_attn, cfg.linear_layers().first()) else {
        return NormStyle::OnePlus;
    };
    let conv = format!("model.layers.{layer}.linear_attn.conv1d.weight");
    match w.is_channels_last(&conv, &[l.conv_dim(), 1, l.conv_kernel]) {
        true => NormStyle::Plain,
        false => NormStyle::OnePlus,
    }
}

impl GatedDeltaNet {
    /// Layer `layer`'s `linear_attn` of a config with `linear_attn` sizes.
    pub fn load(w: &Weights, cfg: &TextConfig, layer: usize) -> std::result::Result<Self, WeightsError> {
        let l = cfg.linear_attn.as_ref().ok_or_else(|| WeightsError::Config {
            path: w.origin().to_path_buf(),
            msg: format!("layer {layer} is linear attention but the config has no `linear_*` sizes"),
        })?;
        let p = format!("model.layers.{layer}.linear_attn");
        let dims = *l;
        let (h, c, hv) = (cfg.hidden_size, dims.conv_dim(), dims.num_value_heads);
        let vec1 = |name: &str, shape: &[usize]| -> std::result::Result<Vec<f32>, WeightsError> {
            Ok(w.dense_f32(&format!("{p}.{name}"), shape)?.flatten_all()?.to_vec1()?)
        };
        let parts = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"].map(|n| format!("{p}.{n}"));
        let conv_weight: Vec<f32> = w
            .conv(&format!("{p}.conv1d.weight"), &[c, 1, dims.conv_kernel])?
            .to_dtype(candle_core::DType::F32)?
            .flatten_all()?
            .to_vec1()?;
        let neg_a: Vec<f32> = vec1("A_log", &[hv])?.into_iter().map(|a| -a.exp()).collect();
        let dt_bias = vec1("dt_bias", &[hv])?;
        #[cfg(feature = "cuda")]
        let device = match w.device() {
            d if d.is_cuda() => Some(crate::ops::gated_delta_cuda::DeviceDeltaParams {
                conv_weight: Tensor::from_slice(&conv_weight, (c, dims.conv_kernel), d)?,
                neg_a: Tensor::from_slice(&neg_a, hv, d)?,
                dt_bias: Tensor::from_slice(&dt_bias, hv, d)?,
            }),
            _ => None,
        };
        Ok(GatedDeltaNet {
            in_proj: StackedLinear::load(w, &parts, h, &[c, dims.value_dim(), hv, hv], false)?,
            conv_weight,
            neg_a,
            dt_bias,
            norm: RmsNorm::load(
                w,
                &format!("{p}.norm.weight"),
                dims.value_head_dim,
                cfg.rms_norm_eps,
                NormStyle::Plain,
            )?,
            out_proj: Linear::load(w, &format!("{p}.out_proj"), dims.value_dim(), h, false)?,
            dims,
            #[cfg(feature = "cuda")]
            device,
        })
    }

    /// `x`: `[T, hidden]` -> `[T, hidden]`; advances each sequence's state past its rows (and
    /// records the state after each row of a sequence marked in `meta.state_checkpoints`).
    pub fn forward(&self, x: &Tensor, cache: &LayerCache, meta: &AttentionMeta) -> Result<Tensor> {
        let LayerCache::Recurrent(state) = cache else {
            candle_core::bail!("a Gated DeltaNet layer needs a recurrent state, not a KV cache")
        };
        let Some(slots) = &meta.state_slots else {
            candle_core::bail!(
                "a Gated DeltaNet layer needs each sequence's state slot (AttentionMeta::set_state_slots)"
            )
        };
        // NO_SLOT: a CUDA graph's padding sequence, which the device kernels skip.
        if let Some(&slot) = slots.iter().find(|&&s| s != crate::batch::NO_SLOT && s as usize >= state.slots()) {
            candle_core::bail!("state slot {slot} of a recurrent layer with {} slots", state.slots());
        }
        let t = x.dim(0)?;
        let [qkv, z, b, a]: [Tensor; 4] =
            self.in_proj.forward(x)?.try_into().map_err(|_| candle_core::Error::Msg("in_proj: 4 parts".into()))?;
        let o = match state.device_tensors() {
            Some((conv, ssm)) => self.recur_on_device(conv, ssm, meta, &qkv, &a, &b)?,
            None => self.recur_on_host(state, meta, slots, &qkv, &a, &b)?,
        };
        let (hv, dv, vd) = (self.dims.num_value_heads, self.dims.value_head_dim, self.dims.value_dim());
        let o = o.reshape((t, hv, dv))?.to_dtype(x.dtype())?;
        let z = z.contiguous()?.reshape((t, hv, dv))?;
        let gated = (self.norm.forward(&o)? * candle_nn::ops::silu(&z)?)?;
        self.out_proj.forward(&gated.reshape((t, vd))?)
    }

    /// The recurrence in device kernels: `o` `[T, Hv * Dv]` f32.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn recur_on_device(
        &self,
        conv: &Tensor,
        ssm: &Tensor,
        meta: &AttentionMeta,
        qkv: &Tensor,
        a: &Tensor,
        b: &Tensor,
    ) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let (Some(params), Some(dm)) = (&self.device, &meta.device) {
            return crate::ops::gated_delta_cuda::run_step(&self.dims, params, conv, ssm, dm, qkv, a, b);
        }
        candle_core::bail!(
            "a Gated DeltaNet layer with its state on a device needs its parameters and the step's metadata there"
        )
    }

    /// The recurrence on the host, sequence by sequence (the reference): `o` `[T, Hv * Dv]` f32.
    fn recur_on_host(
        &self,
        state: &crate::kv::RecurrentState,
        meta: &AttentionMeta,
        slots: &[u32],
        qkv: &Tensor,
        a: &Tensor,
        b: &Tensor,
    ) -> Result<Tensor> {
        let (t, device) = (qkv.dim(0)?, qkv.device().clone());
        let host = |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
        let (qkv, a, b) = (host(qkv)?, host(a)?, host(b)?);
        let (c, hv, vd) = (self.dims.conv_dim(), self.dims.num_value_heads, self.dims.value_dim());
        let params = DeltaParams { conv_weight: &self.conv_weight, neg_a: &self.neg_a, dt_bias: &self.dt_bias };
        let mut o = vec![0f32; t * vd];
        let (cl, sl) = self.dims.state_len();
        for (i, (s, &slot)) in meta.seqs.iter().zip(slots).enumerate() {
            let rows = s.q_start..s.q_start + s.q_len;
            let record = meta.state_checkpoints.as_ref().is_some_and(|r| r.get(i) == Some(&true));
            if record && s.q_len > state.checkpoints() {
                candle_core::bail!(
                    "a verify step of {} rows, but the recurrent state keeps {} checkpoints per sequence",
                    s.q_len,
                    state.checkpoints()
                );
            }
            let out = state.with_slot_checkpoints(slot, s.first_position() == 0, |conv, ssm| {
                // Copy 0 is the live state; copies 1.. take the state after each row.
                let (conv, conv_rows) = conv.split_at_mut(cl);
                let (ssm, ssm_rows) = ssm.split_at_mut(sl);
                run_sequence_recording(
                    &self.dims,
                    &params,
                    conv,
                    ssm,
                    &qkv[rows.start * c..rows.end * c],
                    &a[rows.start * hv..rows.end * hv],
                    &b[rows.start * hv..rows.end * hv],
                    record.then_some(RowStates { conv: conv_rows, ssm: ssm_rows }),
                )
            })?;
            o[rows.start * vd..rows.end * vd].copy_from_slice(&out);
        }
        Tensor::from_vec(o, (t, vd), &device)
    }
}
