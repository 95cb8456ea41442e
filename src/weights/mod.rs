//! A model's tensors, wherever they live: safetensors files of an HF directory (memory-mapped,
//! single file or shards) or one GGUF file. Models ask for tensors by their HF names; the store
//! maps names, checks shapes and hands out dense tensors or quantized matrices.

mod error;
mod gguf;
mod names;
mod safetensors;
mod tensor;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

pub use error::WeightsError;
pub use gguf::GgufFile;
pub use names::gguf_name;
pub use safetensors::SafetensorsDir;
pub use tensor::StoredTensor;

use crate::config::Arch;

enum Source {
    Safetensors(SafetensorsDir),
    Gguf(GgufFile),
}

/// The tensors of one model, loaded onto `device`; dense weights converted to `dtype`.
pub struct Weights {
    source: Source,
    device: Device,
    dtype: DType,
}

impl Weights {
    pub fn from_safetensors(dir: SafetensorsDir, device: Device, dtype: DType) -> Self {
        Weights { source: Source::Safetensors(dir), device, dtype }
    }

    pub fn from_gguf(file: GgufFile, device: Device, dtype: DType) -> Self {
        Weights { source: Source::Gguf(file), device, dtype }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn origin(&self) -> &Path {
        match &self.source {
            Source::Safetensors(s) => s.dir(),
            Source::Gguf(g) => g.path(),
        }
    }

    /// The file holding tensor `name` (for safetensors shards; the GGUF file otherwise).
    pub fn origin_of(&self, name: &str) -> &Path {
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
        match &self.source {
            Source::Safetensors(s) => s.contains(name),
            Source::Gguf(g) => gguf_name(name, g.arch()).is_some_and(|n| g.contains(&n)),
        }
    }

    /// A tensor as stored (quantized GGUF types stay quantized), shape-checked.
    pub fn stored(&self, name: &str, shape: &[usize]) -> Result<StoredTensor, WeightsError> {
        let stored = match &self.source {
            Source::Safetensors(s) => StoredTensor::Dense(s.load(name, &self.device)?),
            Source::Gguf(g) => {
                let arch = self.arch().unwrap_or(Arch::Llama);
                let gname = gguf_name(name, arch).ok_or_else(|| WeightsError::MissingTensor {
                    name: name.to_string(),
                    origin: g.path().to_path_buf(),
                })?;
                if self.device.is_cpu() {
                    g.load(&gname, &self.device)?
                } else {
                    // Quantized matrices stay quantized only where iris has kernels for them
                    // (the CPU); for other devices they are dequantized once, at load.
                    match g.load(&gname, &Device::Cpu)? {
                        StoredTensor::Quantized(q) => {
                            StoredTensor::Dense(q.dequantize(&Device::Cpu)?.to_device(&self.device)?)
                        }
                        StoredTensor::Dense(t) => StoredTensor::Dense(t.to_device(&self.device)?),
                    }
                }
            }
        };
        let actual = match &stored {
            StoredTensor::Dense(t) => t.dims().to_vec(),
            StoredTensor::Quantized(q) => q.shape().dims().to_vec(),
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

    /// A dense tensor in the model's dtype (quantized ones are dequantized).
    pub fn dense(&self, name: &str, shape: &[usize]) -> Result<Tensor, WeightsError> {
        let t = match self.stored(name, shape)? {
            StoredTensor::Dense(t) => t,
            StoredTensor::Quantized(q) => q.dequantize(&self.device)?,
        };
        Ok(t.to_dtype(self.dtype)?)
    }

    /// A dense tensor kept in f32 whatever the model dtype (norm weights feeding f32 math).
    pub fn dense_f32(&self, name: &str, shape: &[usize]) -> Result<Tensor, WeightsError> {
        let t = match self.stored(name, shape)? {
            StoredTensor::Dense(t) => t,
            StoredTensor::Quantized(q) => q.dequantize(&self.device)?,
        };
        Ok(t.to_dtype(DType::F32)?)
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
