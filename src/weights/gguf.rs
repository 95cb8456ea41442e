use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use candle_core::Device;

use super::error::WeightsError;
use super::safetensors::root_cause;
use super::tensor::StoredTensor;
use crate::config::{gguf_arch, Arch};

/// One GGUF file: its metadata and a reader for its tensors.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: Mutex<BufReader<File>>,
    arch: Arch,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, WeightsError> {
        let file = File::open(path).map_err(|e| WeightsError::io(path, e))?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader)
            .map_err(|e| WeightsError::Gguf { path: path.to_path_buf(), msg: root_cause(&e) })?;
        let arch = gguf_arch(&content).map_err(|e| e.in_file(path))?;
        Ok(GgufFile { path: path.to_path_buf(), content, reader: Mutex::new(reader), arch })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn arch(&self) -> Arch {
        self.arch
    }

    pub fn content(&self) -> &Content {
        &self.content
    }

    pub fn contains(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Quantization types present, with tensor counts (for `iris inspect`).
    pub fn dtype_histogram(&self) -> Vec<(GgmlDType, usize)> {
        let mut h: Vec<(GgmlDType, usize)> = Vec::new();
        for info in self.content.tensor_infos.values() {
            match h.iter_mut().find(|(d, _)| *d == info.ggml_dtype) {
                Some((_, n)) => *n += 1,
                None => h.push((info.ggml_dtype, 1)),
            }
        }
        h.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
        h
    }

    pub fn load(&self, name: &str, device: &Device) -> Result<StoredTensor, WeightsError> {
        if !self.contains(name) {
            return Err(WeightsError::MissingTensor { name: name.to_string(), origin: self.path.clone() });
        }
        let bad = |e: candle_core::Error| WeightsError::BadTensor {
            name: name.to_string(),
            origin: self.path.clone(),
            msg: root_cause(&e),
        };
        let q = {
            let mut reader = self.reader.lock().unwrap_or_else(|p| p.into_inner());
            self.content.tensor(&mut *reader, name, device).map_err(bad)?
        };
        let dense = matches!(q.dtype(), GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        if !dense {
            return Ok(StoredTensor::Quantized(Arc::new(q)));
        }
        let mut t = q.dequantize(device).map_err(bad)?;
        // llama.cpp stores Gemma's RMSNorm weights as 1 + w; the model code applies 1 + w itself.
        if self.arch == Arch::Gemma3 && name.ends_with("norm.weight") {
            t = (t - 1.0).map_err(bad)?;
        }
        Ok(StoredTensor::Dense(t))
    }
}
