//! A model's tensors, wherever they live: safetensors files of an HF directory or an MLX
//! conversion (memory-mapped, single file or shards) or one GGUF file. Models ask for tensors
//! by their HF names; the store maps names, checks shapes and hands out dense tensors or
//! quantized matrices (GGUF blocks, MLX affine groups).

mod error;
pub mod footprint;
mod gguf;
mod mlx;
mod names;
mod safetensors;
mod tensor;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use candle_core::{DType, Device, Tensor};

pub use crate::ops::qmatmul::{AffineMatrix, AffineParams};
pub use error::WeightsError;
pub use gguf::GgufFile;
pub use mlx::{MlxQuantization, ModuleQuant};
pub use names::gguf_name;
pub use safetensors::{SafetensorsDir, MTP_SIDECARS};
pub use tensor::StoredTensor;

use crate::config::Arch;
use crate::parallel::{Shard, Split};

enum Source {
    Safetensors(SafetensorsDir),
    Gguf(GgufFile),
}

/// The tensors of one model, loaded onto `device`; dense weights converted to `dtype`.
pub struct Weights {
    source: Source,
    device: Device,
    dtype: DType,
    /// An MLX conversion's `quantization` block.
    mlx: Option<MlxQuantization>,
    /// Safetensors holding an MTP head (`mtp.*`) apart from the checkpoint (beside a GGUF).
    mtp_sidecar: Option<SafetensorsDir>,
    /// A NextN layer's tensor prefix (`model.layers.{N}.`), when drafting with one: its
    /// quantized matrices are dequantized at load, as an `mtp.*` head's are.
    mtp_layer: Option<String>,
    /// With a sidecar for a model whose q/k rows are in adjacent-pair order (a GGUF llama):
    /// the head dim by which the sidecar's HF-order q/k rows are put in that order too.
    sidecar_pairs: Option<usize>,
    /// Bytes held by what was built from this store (it keeps nothing itself but memory maps).
    held: AtomicU64,
    /// Under tensor parallelism, this rank's place: divided tensors are handed out as its part.
    shard: Option<Shard>,
}

/// Whether `name` is an MTP head's tensor (`mtp.*`): quantized ones are dequantized at load,
/// since a 4-bit head drafts almost nothing right (measured by vllm-mlx).
fn is_mtp(name: &str) -> bool {
    name.starts_with("mtp.")
}

impl Weights {
    pub fn from_safetensors(dir: SafetensorsDir, device: Device, dtype: DType) -> Self {
        Self::new(Source::Safetensors(dir), device, dtype)
    }

    pub fn from_gguf(file: GgufFile, device: Device, dtype: DType) -> Self {
        Self::new(Source::Gguf(file), device, dtype)
    }

    fn new(source: Source, device: Device, dtype: DType) -> Self {
        Weights {
            source,
            device,
            dtype,
            mlx: None,
            mtp_sidecar: None,
            mtp_layer: None,
            sidecar_pairs: None,
            held: AtomicU64::new(0),
            shard: None,
        }
    }

    /// The parameters an MLX conversion's config gives its quantized modules.
    pub fn with_mlx_quantization(mut self, q: Option<MlxQuantization>) -> Self {
        self.mlx = q;
        self
    }

    /// Reads `mtp.*` tensors from `side` (an MTP head kept apart from the checkpoint); with
    /// `pairs`, its q/k projections' rows are reordered for adjacent-pair rotary by that head dim.
    pub fn with_mtp_sidecar(mut self, side: SafetensorsDir, pairs: Option<usize>) -> Self {
        self.mtp_sidecar = Some(side);
        self.sidecar_pairs = pairs;
        self
    }

    /// Treats the tensors under `prefix` (a NextN layer's, `model.layers.{N}.`) as an MTP
    /// head's: quantized ones are dequantized at load.
    pub fn with_mtp_layer(mut self, prefix: String) -> Self {
        self.mtp_layer = Some(prefix);
        self
    }

    /// Whether `name` belongs to the MTP head: `mtp.*`, or the NextN layer's prefix.
    fn in_mtp_head(&self, name: &str) -> bool {
        is_mtp(name) || self.mtp_layer.as_deref().is_some_and(|p| name.starts_with(p))
    }

    /// Hands out this rank's part of every tensor `Shard::split_of` divides (asked for in the
    /// shape of the part), for a rank of a tensor-parallel group.
    pub fn with_shard(mut self, shard: Shard) -> Self {
        self.shard = Some(shard);
        self
    }

    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// The sidecar that holds `name`, if it is an MTP tensor and there is one.
    fn sidecar_for(&self, name: &str) -> Option<&SafetensorsDir> {
        self.mtp_sidecar.as_ref().filter(|_| is_mtp(name))
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes held by what was built from this store so far: dense tensors as handed out (in
    /// their dtype), and what layers made of `stored` ones (`hold`). Measured around a
    /// model's load, what that model holds.
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Counts `bytes` as held by the model being built (what a layer made of a `stored` tensor).
    pub fn hold(&self, bytes: usize) {
        self.held.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    fn hand_out(&self, t: Tensor) -> Tensor {
        self.hold(t.elem_count() * t.dtype().size_in_bytes());
        t
    }

    pub fn origin(&self) -> &Path {
        match &self.source {
            Source::Safetensors(s) => s.dir(),
            Source::Gguf(g) => g.path(),
        }
    }

    /// The file holding tensor `name` (for safetensors shards; the GGUF file otherwise).
    pub fn origin_of(&self, name: &str) -> &Path {
        if let Some(side) = self.sidecar_for(name) {
            return side.file_of(name);
        }
        match &self.source {
            Source::Safetensors(s) => s.file_of(name),
            Source::Gguf(g) => g.path(),
        }
    }

    fn arch(&self) -> Option<Arch> {
        match &self.source {
            Source::Gguf(g) => Some(g.arch()),
            Source::Safetensors(_) => None,
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        if let Some(side) = self.sidecar_for(name) {
            return side.contains(name);
        }
        match &self.source {
            Source::Safetensors(s) => s.contains(name),
            Source::Gguf(g) => gguf_name(name, g.arch()).is_some_and(|n| g.contains(&n)),
        }
    }

    /// The stored shape of a safetensors tensor (None if absent, or in a GGUF).
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        match (&self.source, self.sidecar_for(name)) {
            (_, Some(s)) | (Source::Safetensors(s), None) => s.shape_of(name),
            (Source::Gguf(_), None) => None,
        }
    }

    /// A tensor as stored, shape-checked: dense ones on the device, quantized matrices (GGUF
    /// blocks, MLX affine) on the host as they are.
    /// Not counted in `held_bytes`: the layer that keeps it in another form (converted,
    /// repacked, stacked, dequantized on a GPU) counts that form with `hold`.
    pub fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor, WeightsError> {
        let stored = match (&self.shard, Shard::split_of(name)) {
            (Some(shard), Some(split)) => {
                // The whole tensor's shape (what an MLX-quantized one is read as): its stored
                // rows, or a row-parallel part's columns times the ranks.
                let mut whole = shape.to_vec();
                match (split, whole.last_mut()) {
                    (Split::Columns, Some(cols)) => *cols *= shard.world(),
                    _ => {
                        if let (Some(rows), Some(stored)) = (whole.first_mut(), self.shape_of(name)) {
                            *rows = stored.first().copied().unwrap_or(*rows);
                        }
                    }
                }
                let stored = self.stored_whole(name, &whole)?;
                self.part(shard, split, name, shape, stored)?
            }
            _ => self.stored_whole(name, shape)?,
        };
        let actual = match &stored {
            StoredTensor::Dense(t) => t.dims().to_vec(),
            StoredTensor::Quantized(q) => q.shape().dims().to_vec(),
            StoredTensor::Affine(a) => vec![a.rows, a.cols],
        };
        if actual != shape {
            return Err(WeightsError::ShapeMismatch {
                name: name.to_string(),
                origin: self.origin_of(name).to_path_buf(),
                expected: shape.to_vec(),
                actual,
            });
        }
        Ok(stored)
    }

    /// This rank's part of `stored`, divided by `split`, of the `shape` its layer asks for.
    fn part(
        &self,
        shard: &Shard,
        split: Split,
        name: &str,
        shape: &[usize],
        stored: StoredTensor,
    ) -> Result<StoredTensor, WeightsError> {
        let bad = |msg: String| WeightsError::BadTensor {
            name: name.to_string(),
            origin: self.origin_of(name).to_path_buf(),
            msg,
        };
        let len = match split {
            Split::Rows | Split::RowHalves => shape.first(),
            Split::Columns => shape.last(),
        }
        .copied()
        .unwrap_or(0);
        let replicable = Shard::replicable(name);
        let undivided = |dims: &[usize]| {
            bad(format!(
                "of shape {dims:?} does not divide among {} ranks into parts of shape {shape:?}",
                shard.world()
            ))
        };
        match stored {
            StoredTensor::Dense(t) => match shard.part(&t, split, len, replicable)? {
                Some(part) => Ok(StoredTensor::Dense(part)),
                None => Err(undivided(t.dims())),
            },
            // MLX affine: rows whole, or columns on the quantization groups' boundaries.
            StoredTensor::Affine(a) => {
                let part = shard.runs(split, a.rows, a.cols, len, replicable).and_then(|(rows, cols)| {
                    let mut runs: Vec<AffineMatrix> = rows.iter().map(|r| a.rows(r.start, r.end)).collect();
                    let held = match runs.len() {
                        1 => runs.pop()?,
                        _ => AffineMatrix::concat_rows(&runs.iter().collect::<Vec<_>>())?,
                    };
                    if cols == (0..a.cols) {
                        Some(held)
                    } else {
                        held.columns(cols.start, cols.end)
                    }
                });
                // A column part must also start and end on a group's boundary.
                let within = if split == Split::Columns { " on group boundaries" } else { "" };
                part.map(StoredTensor::Affine).ok_or_else(|| {
                    bad(format!(
                        "is MLX-quantized in groups of {} and its {} x {} do not divide among {} ranks into parts of shape {shape:?}{within}",
                        a.params.group,
                        a.rows,
                        a.cols,
                        shard.world()
                    ))
                })
            }
            // GGUF blocks: rows whole, or columns on the blocks' boundaries.
            StoredTensor::Quantized(q) => {
                let (n, k) = match q.shape().dims() {
                    &[n, k] => (n, k),
                    dims => return Err(undivided(dims)),
                };
                let part = shard
                    .runs(split, n, k, len, replicable)
                    .and_then(|(rows, cols)| gguf::quantized_part(&q, &rows, cols));
                let within = if split == Split::Columns { " on block boundaries" } else { "" };
                match part {
                    Some(p) => Ok(StoredTensor::Quantized(std::sync::Arc::new(p?))),
                    None => Err(bad(format!(
                        "is GGUF-quantized ({:?}, blocks of {}) and its {n} x {k} do not divide among {} ranks into parts of shape {shape:?}{within}",
                        q.dtype(),
                        q.dtype().block_size(),
                        shard.world()
                    ))),
                }
            }
        }
    }

    /// A tensor as stored, whole.
    fn stored_whole(&self, name: &str, shape: &[usize]) -> Result<StoredTensor, WeightsError> {
        Ok(match (&self.source, self.sidecar_for(name)) {
            (_, Some(s)) | (Source::Safetensors(s), None) => match name.strip_suffix(".weight") {
                Some(module) if s.contains(&format!("{module}.scales")) => {
                    let a = self.affine(s, module, shape)?;
                    if self.in_mtp_head(name) {
                        StoredTensor::Dense(a.dequantize(&self.device)?.reshape(shape)?.to_dtype(self.dtype)?)
                    } else {
                        StoredTensor::Affine(a)
                    }
                }
                _ => {
                    let t = s.load(name, &self.device)?;
                    match self.sidecar_pairs.filter(|_| self.sidecar_for(name).is_some() && is_qk(name)) {
                        Some(d) => StoredTensor::Dense(half_to_pairs(&t, d)?),
                        None => StoredTensor::Dense(t),
                    }
                }
            },
            (Source::Gguf(g), None) => {
                let arch = self.arch().unwrap_or(Arch::Llama);
                let gname = gguf_name(name, arch).ok_or_else(|| WeightsError::MissingTensor {
                    name: name.to_string(),
                    origin: g.path().to_path_buf(),
                })?;
                match g.load(&gname, &Device::Cpu)? {
                    // Quantized matrices stay on the host here; the layers that take them put
                    // them on their device (`Linear`: kept quantized on CUDA).
                    StoredTensor::Dense(t) => StoredTensor::Dense(t.to_device(&self.device)?),
                    other => other,
                }
            }
        })
    }

    /// A dense tensor in the model's dtype (quantized ones are dequantized).
    pub fn dense(&self, name: &str, shape: &[usize]) -> Result<Tensor, WeightsError> {
        Ok(self.hand_out(self.dequantized(name, shape)?.to_dtype(self.dtype)?))
    }

    /// Whether convolution weight `name`, `[out, in, k...]` in PyTorch's layout (`shape`), is
    /// stored channels-last, `[out, k..., in]`, as MLX conversions store convolutions.
    pub fn is_channels_last(&self, name: &str, shape: &[usize]) -> bool {
        let last = channels_last(shape);
        let stored = match &self.source {
            Source::Safetensors(s) => s.shape_of(name),
            Source::Gguf(_) => None,
        };
        last != shape && stored.as_deref() == Some(&last[..])
    }

    /// A convolution's weight in PyTorch's layout `shape` (`[out, in, k...]`), in the model's
    /// dtype, whichever of the two layouts it is stored in.
    pub fn conv(&self, name: &str, shape: &[usize]) -> Result<Tensor, WeightsError> {
        if !self.is_channels_last(name, shape) {
            return self.dense(name, shape);
        }
        let t = self.dequantized(name, &channels_last(shape))?.to_dtype(self.dtype)?;
        let n = shape.len();
        let order: Vec<usize> = [0, n - 1].into_iter().chain(1..n - 1).collect();
        Ok(self.hand_out(t.permute(order)?.contiguous()?))
    }

    /// A dense tensor kept in f32 whatever the model dtype (norm weights feeding f32 math).
    pub fn dense_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor, WeightsError> {
        Ok(self.hand_out(self.dequantized(name, shape)?.to_dtype(DType::F32)?))
    }

    fn dequantized(&self, name: &str, shape: &[usize]) -> Result<Tensor, WeightsError> {
        Ok(match self.stored(name, shape)? {
            StoredTensor::Dense(t) => t,
            StoredTensor::Quantized(q) => q.dequantize(&Device::Cpu)?.to_device(&self.device)?,
            StoredTensor::Affine(a) => a.dequantize(&self.device)?.reshape(shape)?,
        })
    }

    /// The MLX affine module `module` (`.weight` u32 codes, `.scales`, `.biases`) as the
    /// `shape` the model expects (its last axis the input), its bits and group size read off
    /// the stored shapes and checked against the config's.
    fn affine(&self, s: &SafetensorsDir, module: &str, shape: &[usize]) -> Result<AffineMatrix, WeightsError> {
        let cpu = Device::Cpu;
        // The stored key: one expert of a stack is checked against the stack's override
        // (`experts.switch_glu.up_proj`), which is how MLX names it in the config.
        let key = s.locate(&format!("{module}.weight")).map_or_else(|| format!("{module}.weight"), |(k, _)| k);
        let bad = |msg: String| WeightsError::BadTensor {
            name: key.clone(),
            origin: s.file_of(&format!("{module}.weight")).to_path_buf(),
            msg,
        };
        let codes = s.load(&format!("{module}.weight"), &cpu)?;
        if codes.dtype() != DType::U32 {
            return Err(bad(format!("has .scales, so it is MLX-quantized, but is {:?}, not uint32", codes.dtype())));
        }
        let part = |suffix: &str| -> Result<Tensor, WeightsError> {
            let name = format!("{module}.{suffix}");
            if !s.contains(&name) {
                return Err(bad(format!("is MLX affine-quantized but `{name}` is missing")));
            }
            Ok(s.load(&name, &cpu)?.to_dtype(DType::F32)?)
        };
        let (scales, biases) = (part("scales")?, part("biases")?);
        let (cols, lead) = match shape.split_last() {
            Some((&c, lead)) if !lead.is_empty() => (c, lead),
            _ => return Err(bad(format!("is quantized, but the model reads it as a {}-D tensor", shape.len()))),
        };
        let rows: usize = lead.iter().product();
        let last = |t: &Tensor| t.dims().last().copied().unwrap_or(0);
        let leading_ok = |t: &Tensor| t.dims().len() == shape.len() && &t.dims()[..lead.len()] == lead;
        if !leading_ok(&codes) || !leading_ok(&scales) || scales.dims() != biases.dims() {
            return Err(WeightsError::ShapeMismatch {
                name: key.clone(),
                origin: s.file_of(&format!("{module}.weight")).to_path_buf(),
                expected: shape.to_vec(),
                actual: codes.dims().to_vec(),
            });
        }
        let params = AffineParams::from_shapes(cols, last(&codes), last(&scales)).ok_or_else(|| {
            bad(format!(
                "{} u32 words and {} scales per row of {cols} weights is no MLX affine format",
                last(&codes),
                last(&scales)
            ))
        })?;
        if let Some(q) = &self.mlx {
            let path = key.strip_suffix(".weight").unwrap_or(&key);
            match q.module(path) {
                ModuleQuant::Affine(p) if p == params => {}
                ModuleQuant::Affine(p) => {
                    return Err(bad(format!(
                        "config.json gives it {} bits in groups of {}, its tensors hold {} bits in groups of {}",
                        p.bits, p.group, params.bits, params.group
                    )))
                }
                ModuleQuant::Float => {
                    return Err(bad("config.json lists it as not quantized, yet it has .scales".into()))
                }
            }
        }
        let flat = |t: Tensor| -> Result<Vec<f32>, WeightsError> { Ok(t.flatten_all()?.to_vec1::<f32>()?) };
        Ok(AffineMatrix {
            rows,
            cols,
            params,
            codes: codes.flatten_all()?.to_vec1::<u32>()?,
            scales: flat(scales)?,
            biases: flat(biases)?,
        })
    }
}

fn is_qk(name: &str) -> bool {
    name.ends_with("self_attn.q_proj.weight") || name.ends_with("self_attn.k_proj.weight")
}

/// Rows of a q/k projection from HF's rotary order (each head's first half, then its second)
/// to adjacent pairs (llama.cpp's order): row 2i + j of a head is HF's row j * d/2 + i.
fn half_to_pairs(w: &Tensor, head_dim: usize) -> candle_core::Result<Tensor> {
    let (rows, cols) = w.dims2()?;
    w.reshape((rows / head_dim, 2, head_dim / 2, cols))?.transpose(1, 2)?.contiguous()?.reshape((rows, cols))
}

/// `[out, in, k...]` -> `[out, k..., in]`.
fn channels_last(shape: &[usize]) -> Vec<usize> {
    match shape {
        [out, inp, k @ ..] if !k.is_empty() => [*out].into_iter().chain(k.iter().copied()).chain([*inp]).collect(),
        _ => shape.to_vec(),
    }
}

/// Where the model is: a directory with config.json + safetensors, or a `.gguf` file (or a
/// directory holding exactly one).
#[derive(Debug, Clone)]
pub enum ModelLocation {
    HfDir(PathBuf),
    Gguf(PathBuf),
}

impl ModelLocation {
    pub fn resolve(path: &Path) -> Result<Self, WeightsError> {
        if !path.exists() {
            return Err(WeightsError::NotFound { path: path.to_path_buf() });
        }
        if path.is_file() {
            return if path.extension().is_some_and(|e| e == "gguf") {
                Ok(ModelLocation::Gguf(path.to_path_buf()))
            } else {
                Err(WeightsError::UnknownFormat { path: path.to_path_buf() })
            };
        }
        if path.join("config.json").is_file() {
            return Ok(ModelLocation::HfDir(path.to_path_buf()));
        }
        let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(|e| WeightsError::io(path, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
            .collect();
        match ggufs.as_slice() {
            [one] => Ok(ModelLocation::Gguf(one.clone())),
            [] => Err(WeightsError::UnknownFormat { path: path.to_path_buf() }),
            _ => Err(WeightsError::AmbiguousGguf { path: path.to_path_buf(), count: ggufs.len() }),
        }
    }
}
