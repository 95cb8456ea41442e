use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};
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

/// Part of a GGUF block-quantized matrix (`[rows, cols]`), as its bytes: the runs of rows
/// `rows`, one after another, and of each the columns `cols`, which must start and end on
/// block boundaries (32 weights, 256 for the k-quants). None where they do not, or where the
/// tensor is not a matrix.
pub fn quantized_part(
    q: &QTensor,
    rows: &[std::ops::Range<usize>],
    cols: std::ops::Range<usize>,
) -> Option<candle_core::Result<QTensor>> {
    let &[n, k] = q.shape().dims() else { return None };
    let (dt, bs) = (q.dtype(), q.dtype().block_size());
    if rows.iter().any(|r| r.start > r.end || r.end > n)
        || cols.end > k
        || !cols.start.is_multiple_of(bs)
        || !cols.end.is_multiple_of(bs)
    {
        return None;
    }
    let per_block = dt.type_size();
    let row_bytes = k / bs * per_block;
    let (from, to) = (cols.start / bs * per_block, cols.end / bs * per_block);
    let count: usize = rows.iter().map(|r| r.len()).sum();
    let part = q.data().map(|data| {
        let mut out = Vec::with_capacity(count * (to - from));
        for r in rows.iter().flat_map(|r| r.clone()) {
            out.extend_from_slice(&data[r * row_bytes + from..r * row_bytes + to]);
        }
        out
    });
    Some(part.and_then(|bytes| qtensor_from_ggml(dt, &bytes, vec![count, cols.len()], &Device::Cpu)))
}

#[cfg(test)]
mod tests {
    use super::quantized_part;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    /// A part's bytes are the whole's: it dequantizes to the same rows and columns. Columns off
    /// the blocks' boundaries are refused.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // runs of rows
    fn parts_are_whole_blocks_of_the_matrix() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (6, 512), &dev).unwrap();
        for dt in [GgmlDType::Q4_0, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K] {
            let q = QTensor::quantize(&w, dt).unwrap();
            let whole = q.dequantize(&dev).unwrap();
            let bs = dt.block_size();
            let part = quantized_part(&q, &[1..3, 4..6], bs..2 * bs).unwrap().unwrap();
            assert_eq!(part.shape().dims(), &[4, bs]);
            let want = Tensor::cat(&[whole.narrow(0, 1, 2).unwrap(), whole.narrow(0, 4, 2).unwrap()], 0)
                .unwrap()
                .narrow(1, bs, bs)
                .unwrap();
            let got = part.dequantize(&dev).unwrap();
            let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert_eq!(diff, 0.0, "{dt:?}");
            assert!(quantized_part(&q, &[0..6], 16..bs + 16).is_none(), "{dt:?}: a cut block");
            assert!(quantized_part(&q, &[0..7], 0..bs).is_none(), "{dt:?}: rows past the end");
        }
    }
}
