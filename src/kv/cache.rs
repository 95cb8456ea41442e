use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::calibration::CalibrationCache;
use super::format::{KvDtype, TqSpec};
use super::recurrent::RecurrentState;
use crate::config::{KvShape, LayerKind, TextConfig};
use crate::ops::turboquant::{Codebook, FloatWindow, LayerCodecs, TqLayerCache};

/// Shape of the pool: how many blocks of how many tokens, in which float type (that of every
/// layer, or in a TurboQuant pool that of its unquantized parts).
#[derive(Debug, Clone, Copy)]
pub struct KvCacheSpec {
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtype: KvDtype,
}

impl KvCacheSpec {
    /// Bytes one token occupies across all layers (keys and values) in a dense pool.
    pub fn bytes_per_token(cfg: &TextConfig, dtype: KvDtype) -> usize {
        super::spec::CacheSpec::for_model(cfg, dtype, None).bytes_per_token()
    }

    /// As many blocks as `budget_bytes` holds.
    pub fn from_budget(cfg: &TextConfig, dtype: KvDtype, block_size: usize, budget_bytes: u64) -> Self {
        Self::with_token_bytes(Self::bytes_per_token(cfg, dtype), dtype, block_size, budget_bytes)
    }

    /// As many blocks of tokens of `bytes_per_token` as `budget_bytes` holds.
    pub fn with_token_bytes(bytes_per_token: usize, dtype: KvDtype, block_size: usize, budget_bytes: u64) -> Self {
        let per_block = (bytes_per_token * block_size) as u64;
        KvCacheSpec { block_size, num_blocks: (budget_bytes / per_block.max(1)) as usize, dtype }
    }

    pub fn capacity_tokens(&self) -> usize {
        self.block_size * self.num_blocks
    }
}

/// One layer's block storage.
pub enum LayerCache {
    /// Keys and values as `[num_blocks * block_size, kv_heads, head_dim]`.
    Dense {
        k: Tensor,
        v: Tensor,
    },
    TurboQuant(Box<TqLayerCache>),
    /// Dense f32, recording the queries' and keys' moments (`kv::calibration`).
    Calibration(Box<CalibrationCache>),
    /// A linear-attention layer's state per state slot; no blocks.
    Recurrent(Box<RecurrentState>),
    /// A KV-sharing layer (Gemma 4) stores nothing: it reads layer `source`'s keys and values,
    /// which `KvCache::layer` hands out in its place.
    Shared {
        source: usize,
    },
}

/// The whole pool: every layer's storage for the same set of blocks.
pub struct KvCache {
    spec: KvCacheSpec,
    turboquant: Option<TqSpec>,
    layers: Vec<LayerCache>,
    bytes: usize,
}

impl KvCache {
    /// A dense pool of `spec.dtype` (with one sequence's state in each linear-attention layer).
    pub fn new(cfg: &TextConfig, spec: KvCacheSpec, device: &Device) -> candle_core::Result<Self> {
        Self::build(cfg, spec, None, 1, device)
    }

    /// A pool whose layers store TurboQuant codes, except `tq.skip_layers`, which (like the
    /// float window) store `spec.dtype`; linear-attention layers hold `state_slots` states.
    pub fn build(
        cfg: &TextConfig,
        spec: KvCacheSpec,
        tq: Option<&TqSpec>,
        state_slots: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        Self::build_with_checkpoints(cfg, spec, tq, state_slots, 1, device)
    }

    /// `build`, with `state_checkpoints` copies of each recurrent state slot (1 + the most
    /// draft tokens when speculating; `CacheSpec::state_checkpoints`).
    pub fn build_with_checkpoints(
        cfg: &TextConfig,
        spec: KvCacheSpec,
        tq: Option<&TqSpec>,
        state_slots: usize,
        state_checkpoints: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let slots = spec.num_blocks * spec.block_size;
        let float = spec.dtype.dtype();
        // One pair of codebooks per head width (Gemma 4's full layers have wider heads).
        let mut codebooks: Vec<(usize, (Arc<Codebook>, Arc<Codebook>))> = Vec::new();
        let layers = (0..cfg.num_cache_layers())
            .map(|layer| {
                if let Some(state) = recurrent_state(cfg, layer, state_slots, state_checkpoints, device)? {
                    return Ok(LayerCache::Recurrent(Box::new(state)));
                }
                if let Some(source) = cfg.kv_source(layer) {
                    return Ok(LayerCache::Shared { source });
                }
                let KvShape { num_kv_heads: h, head_dim: d } = cfg.kv_shape(layer);
                let floats = |rows: usize| -> candle_core::Result<(Tensor, Tensor)> {
                    Ok((zeros((rows, h, d), float, device)?, zeros((rows, h, d), float, device)?))
                };
                let tq = tq.filter(|t| t.quantizes(layer) && !cfg.is_mtp_layer(layer));
                let (tq, (kb, vb)) = match tq {
                    Some(tq) => {
                        let cb = match codebooks.iter().find(|(width, _)| *width == d) {
                            Some((_, cb)) => cb.clone(),
                            None => {
                                let cb = (
                                    Arc::new(Codebook::lloyd_max(d, tq.bits.key)),
                                    Arc::new(Codebook::lloyd_max(d, tq.bits.value)),
                                );
                                codebooks.push((d, cb.clone()));
                                cb
                            }
                        };
                        (tq, cb)
                    }
                    _ => {
                        let (k, v) = floats(slots)?;
                        return Ok(LayerCache::Dense { k, v });
                    }
                };
                let mut codecs = LayerCodecs::for_layer(layer, d, &kb, &vb);
                if let Some(scale) = tq.key_scales.get(layer).filter(|s| !s.is_empty()) {
                    if scale.len() != h * d {
                        candle_core::bail!("key scales of layer {layer}: {} values for {h} x {d}", scale.len());
                    }
                    codecs.key_scale = Some(scale.clone());
                }
                let window = if tq.float_window > 0 {
                    let (k, v) = floats(tq.window_rings * tq.float_window)?;
                    Some(FloatWindow { len: tq.float_window, k, v })
                } else {
                    None
                };
                Ok(LayerCache::TurboQuant(Box::new(TqLayerCache {
                    k: zeros((slots, h, codecs.key.row_bytes()), DType::U8, device)?,
                    v: zeros((slots, h, codecs.value.row_bytes()), DType::U8, device)?,
                    device: if device.is_cpu() { None } else { Some(codecs.upload(device)?) },
                    codecs,
                    window,
                })))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let bytes = layers.iter().map(LayerCache::bytes).sum();
        Ok(KvCache { spec, turboquant: tq.cloned(), layers, bytes })
    }

    /// A dense f32 cache for `tokens` tokens that records what attention sees, for
    /// `key_scales`.
    pub fn calibration(
        cfg: &TextConfig,
        block_size: usize,
        tokens: usize,
        device: &Device,
    ) -> candle_core::Result<Self> {
        let spec = KvCacheSpec { block_size, num_blocks: tokens.div_ceil(block_size), dtype: KvDtype::F32 };
        let layers = (0..cfg.num_layers)
            .map(|layer| {
                if let Some(state) = recurrent_state(cfg, layer, 1, 1, device)? {
                    return Ok(LayerCache::Recurrent(Box::new(state)));
                }
                if let Some(source) = cfg.kv_source(layer) {
                    return Ok(LayerCache::Shared { source });
                }
                let KvShape { num_kv_heads, head_dim } = cfg.kv_shape(layer);
                let shape = (spec.num_blocks * block_size, num_kv_heads, head_dim);
                let k = Tensor::zeros(shape, DType::F32, device)?;
                let v = Tensor::zeros(shape, DType::F32, device)?;
                Ok(LayerCache::Calibration(Box::new(CalibrationCache::new(k, v))))
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        let bytes = layers.iter().map(LayerCache::bytes).sum();
        Ok(KvCache { spec, turboquant: None, layers, bytes })
    }

    /// Per layer, the key scales measured by a calibration cache (empty for other caches and
    /// for layers without keys).
    pub fn key_scales(&self, cfg: &TextConfig) -> Vec<Vec<f32>> {
        self.layers
            .iter()
            .enumerate()
            .map(|(i, l)| match l {
                LayerCache::Calibration(c) => c.key_scales(cfg.kv_shape(i).head_dim, cfg.rope_layout),
                _ => Vec::new(),
            })
            .collect()
    }

    /// Whether some layer keeps a recurrent state per sequence.
    pub fn has_recurrent_layers(&self) -> bool {
        self.recurrent().next().is_some()
    }

    /// Makes checkpoint `checkpoint` of state slot `slot` the live state in every recurrent
    /// layer: the state after a verify step's row `checkpoint - 1`, when the rows after it
    /// were rejected drafts.
    pub fn restore_state(&self, slot: u32, checkpoint: usize) -> candle_core::Result<()> {
        self.recurrent().try_for_each(|r| r.restore(slot, checkpoint))
    }

    fn recurrent(&self) -> impl Iterator<Item = &RecurrentState> {
        self.layers.iter().filter_map(|l| match l {
            LayerCache::Recurrent(r) => Some(r.as_ref()),
            _ => None,
        })
    }

    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    /// The TurboQuant layout, for a quantized pool.
    pub fn turboquant(&self) -> Option<&TqSpec> {
        self.turboquant.as_ref()
    }

    /// Layer `i`'s storage: for a KV-sharing layer, that of the layer it reads.
    pub fn layer(&self, i: usize) -> &LayerCache {
        match &self.layers[i] {
            LayerCache::Shared { source } => &self.layers[*source],
            own => own,
        }
    }

    /// Bytes actually allocated for the pool.
    pub fn allocated_bytes(&self) -> usize {
        self.bytes
    }
}

/// The float-window ring rows a verify step's draft rows are about to overwrite, copied out
/// per layer before the step so that rejected drafts can be undone: a ring row holds a
/// position that later rows still read until the draft's own position is accepted.
pub struct WindowCheckpoint {
    slots: Vec<u32>,
    /// Per layer with a float window: its keys and values at `slots`.
    saved: Vec<(Tensor, Tensor)>,
}

impl KvCache {
    /// Copies the float-window ring rows at `slots` (none: nothing to keep, or no window).
    pub fn save_window_rows(&self, slots: &[u32]) -> candle_core::Result<Option<WindowCheckpoint>> {
        let windows: Vec<&FloatWindow> = self.windows().collect();
        if slots.is_empty() || windows.is_empty() {
            return Ok(None);
        }
        let device = windows[0].k.device();
        let idx = Tensor::new(slots, device)?;
        let saved = windows
            .iter()
            .map(|w| Ok((w.k.index_select(&idx, 0)?, w.v.index_select(&idx, 0)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Some(WindowCheckpoint { slots: slots.to_vec(), saved }))
    }

    /// Writes back the saved rows for which `undo(i)` holds (`i` indexes the saved slots).
    pub fn restore_window_rows(&self, cp: &WindowCheckpoint, undo: impl Fn(usize) -> bool) -> candle_core::Result<()> {
        let mapping: Vec<u32> =
            cp.slots.iter().enumerate().map(|(i, &s)| if undo(i) { s } else { crate::batch::NO_SLOT }).collect();
        if mapping.iter().all(|&s| s == crate::batch::NO_SLOT) {
            return Ok(());
        }
        let Some(device) = self.windows().next().map(|w| w.k.device().clone()) else { return Ok(()) };
        let device_meta =
            if device.is_cpu() { None } else { Some(crate::batch::DeviceAttentionMeta::slots(&mapping, &device)?) };
        let write = crate::ops::kv_write::KvWrite::to_slots(&mapping, device_meta.as_ref());
        for (w, (k, v)) in self.windows().zip(&cp.saved) {
            // The CPU writer reads f32 rows; a float cache's rows widen exactly.
            let (k, v) = if device.is_cpu() {
                (k.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?)
            } else {
                (k.clone(), v.clone())
            };
            w.k.inplace_op2(&k, &write)?;
            w.v.inplace_op2(&v, &write)?;
        }
        Ok(())
    }

    fn windows(&self) -> impl Iterator<Item = &FloatWindow> {
        self.layers.iter().filter_map(|l| match l {
            LayerCache::TurboQuant(t) => t.window.as_ref(),
            _ => None,
        })
    }
}

/// A linear-attention layer's state storage, for `slots` sequences of `checkpoints` copies, on
/// `device`; None for other layers.
fn recurrent_state(
    cfg: &TextConfig,
    layer: usize,
    slots: usize,
    checkpoints: usize,
    device: &Device,
) -> candle_core::Result<Option<RecurrentState>> {
    match cfg.linear_attn.as_ref().filter(|_| cfg.layer_kinds.get(layer) == Some(&LayerKind::Linear)) {
        Some(&dims) => RecurrentState::with_checkpoints(dims, slots, checkpoints, device).map(Some),
        None => Ok(None),
    }
}

impl LayerCache {
    /// Bytes the layer allocated.
    fn bytes(&self) -> usize {
        match self {
            LayerCache::Recurrent(r) => r.bytes(),
            LayerCache::Shared { .. } => 0,
            other => other.tensors().iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum(),
        }
    }

    /// Every tensor the layer allocated.
    fn tensors(&self) -> Vec<&Tensor> {
        match self {
            LayerCache::Recurrent(_) | LayerCache::Shared { .. } => vec![],
            LayerCache::Dense { k, v } => vec![k, v],
            LayerCache::Calibration(c) => vec![&c.k, &c.v],
            LayerCache::TurboQuant(t) => {
                let mut all = vec![&t.k, &t.v];
                if let Some(w) = &t.window {
                    all.extend([&w.k, &w.v]);
                }
                all
            }
        }
    }
}

/// A zeroed cache tensor; on the host, on huge pages (`ops::host_memory`: the cache is what a
/// decode at long contexts streams through).
fn zeros(shape: (usize, usize, usize), dtype: DType, device: &Device) -> candle_core::Result<Tensor> {
    use crate::ops::host_memory::zeroed;
    let n = shape.0 * shape.1 * shape.2;
    match (device.is_cpu(), dtype) {
        (true, DType::F32) => Tensor::from_vec(zeroed::<f32>(n), shape, device),
        (true, DType::BF16) => Tensor::from_vec(zeroed::<half::bf16>(n), shape, device),
        (true, DType::F16) => Tensor::from_vec(zeroed::<half::f16>(n), shape, device),
        (true, DType::U8) => Tensor::from_vec(zeroed::<u8>(n), shape, device),
        _ => Tensor::zeros(shape, dtype, device),
    }
}
