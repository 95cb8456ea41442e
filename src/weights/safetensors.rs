use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{Device, Tensor};

use super::error::WeightsError;

/// The safetensors files of an HF model directory, memory-mapped.
pub struct SafetensorsDir {
    dir: PathBuf,
    files: Vec<PathBuf>,
    st: MmapedSafetensors,
    /// Each tensor's name and the file holding it.
    names: HashMap<String, PathBuf>,
}

impl SafetensorsDir {
    /// Opens `model.safetensors.index.json`'s shards, or every `*.safetensors` in `dir`, and
    /// the sidecar files MLX conversions keep MTP heads in (`MTP_SIDECARS`) when there.
    pub fn open(dir: &Path) -> Result<Self, WeightsError> {
        let mut files = shard_files(dir)?;
        for side in MTP_SIDECARS.iter().map(|f| dir.join(f)) {
            if side.is_file() && !files.contains(&side) {
                files.push(side);
            }
        }
        Self::open_files(dir, files)
    }

    /// Opens exactly `files` (errors name `dir` for the set).
    pub fn open_files(dir: &Path, files: Vec<PathBuf>) -> Result<Self, WeightsError> {
        // Validate each file on its own first so a truncated shard is named in the error, and
        // note which file holds each tensor so later errors can name it.
        let mut names = HashMap::new();
        for f in &files {
            // SAFETY: the mapping is read-only; iris never writes model files while serving them.
            let one = unsafe { MmapedSafetensors::new(f) }
                .map_err(|e| WeightsError::Safetensors { path: f.clone(), msg: root_cause(&e) })?;
            for (name, _) in one.tensors() {
                if let Some(first) = names.insert(name.clone(), f.clone()) {
                    return Err(WeightsError::Safetensors {
                        path: f.clone(),
                        msg: format!("tensor `{name}` is also in {}", first.display()),
                    });
                }
            }
        }
        // SAFETY: as above.
        let st = unsafe { MmapedSafetensors::multi(&files) }
            .map_err(|e| WeightsError::Safetensors { path: dir.to_path_buf(), msg: root_cause(&e) })?;
        Ok(SafetensorsDir { dir: dir.to_path_buf(), files, st, names })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// The stored key of tensor `name`. VLM checkpoints saved by transformers 5 keep the
    /// language model under `model.language_model.` and the vision tower under `model.visual.`;
    /// older ones use `model.` and `visual.`; mlx-vlm conversions use `language_model.model.`,
    /// `language_model.lm_head.` and `vision_tower.`. Names resolve to any of them, so one set
    /// of model code reads all.
    pub fn key_of(&self, name: &str) -> Option<String> {
        if self.names.contains_key(name) {
            return Some(name.to_string());
        }
        let alts: Vec<String> = if name.starts_with("mtp.") {
            // MTP heads: top level in Qwen3.5 checkpoints, under the wrapper in others.
            vec![format!("model.{name}"), format!("language_model.{name}"), format!("model.language_model.{name}")]
        } else if let Some(rest) = name.strip_prefix("model.") {
            vec![format!("model.language_model.{rest}"), format!("language_model.{name}")]
        } else if let Some(rest) = name.strip_prefix("visual.") {
            vec![format!("model.{name}"), format!("vision_tower.{rest}")]
        } else if name.starts_with("lm_head.") {
            vec![format!("language_model.{name}"), format!("model.{name}")]
        } else {
            vec![format!("model.{name}")]
        };
        alts.into_iter().find(|k| self.names.contains_key(k))
    }

    /// Where tensor `name` lives: its key, or for `{p}.experts.{e}.{rest}` absent as such,
    /// the MoE experts stacked along a first axis, and the expert's index. Stacks are stored
    /// as `{p}.switch_mlp.{rest}` (MLX), `{p}.experts.switch_glu.{rest}` (MLX's Gemma 4) or
    /// `{p}.experts.gate_up_proj` / `.down_proj` without `.weight` (transformers 5's Gemma 4).
    pub(crate) fn locate(&self, name: &str) -> Option<(String, Option<usize>)> {
        if let Some(k) = self.key_of(name) {
            return Some((k, None));
        }
        let (prefix, rest) = name.split_once(".experts.")?;
        let (e, rest) = rest.split_once('.')?;
        let e: usize = e.parse().ok()?;
        let fused = rest.strip_suffix(".weight").map(|r| format!("{prefix}.experts.{r}"));
        [Some(format!("{prefix}.switch_mlp.{rest}")), Some(format!("{prefix}.experts.switch_glu.{rest}")), fused]
            .into_iter()
            .flatten()
            .find_map(|k| self.key_of(&k))
            .map(|k| (k, Some(e)))
    }

    /// The file holding tensor `name` (the directory if no file does).
    pub fn file_of(&self, name: &str) -> &Path {
        self.locate(name).and_then(|(k, _)| self.names.get(&k)).map_or(self.dir.as_path(), PathBuf::as_path)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.locate(name).is_some()
    }

    /// The stored shape of tensor `name` (one expert's, for a slice of stacked experts).
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        let (key, expert) = self.locate(name)?;
        let shape = self.st.get(&key).ok()?.shape().to_vec();
        Some(if expert.is_some() { shape[1..].to_vec() } else { shape })
    }

    pub fn load(&self, name: &str, device: &Device) -> Result<Tensor, WeightsError> {
        let (key, expert) = self
            .locate(name)
            .ok_or_else(|| WeightsError::MissingTensor { name: name.to_string(), origin: self.dir.clone() })?;
        let bad = |msg: String| WeightsError::BadTensor {
            origin: self.names.get(&key).cloned().unwrap_or_else(|| self.dir.clone()),
            name: key.clone(),
            msg,
        };
        let view = self.st.get(&key).map_err(|e| bad(root_cause(&e)))?;
        let dtype =
            candle_dtype(view.dtype()).ok_or_else(|| bad(format!("dtype {:?} is not supported", view.dtype())))?;
        let (mut shape, mut data) = (view.shape().to_vec(), view.data());
        if let Some(e) = expert {
            // One expert's slice of the stacked tensor: its bytes are contiguous.
            let n = shape.first().copied().unwrap_or(0);
            if e >= n || shape.len() < 2 {
                return Err(bad(format!("has no expert {e} (shape {shape:?})")));
            }
            let per = data.len() / n;
            data = &data[e * per..(e + 1) * per];
            shape.remove(0);
        }
        Tensor::from_raw_buffer(data, dtype, &shape, device).map_err(|e| bad(root_cause(&e)))
    }

    /// Every tensor with its stored dtype and shape.
    pub fn views(&self) -> Vec<(String, (safetensors::Dtype, Vec<usize>))> {
        self.st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec()))).collect()
    }

    /// Every tensor name with its dtype and shape (for `iris inspect`).
    pub fn summary(&self) -> Vec<(String, String, Vec<usize>)> {
        let mut v: Vec<_> = self
            .st
            .tensors()
            .into_iter()
            .map(|(n, view)| (n, format!("{:?}", view.dtype()), view.shape().to_vec()))
            .collect();
        v.sort();
        v
    }
}

/// Files beside a checkpoint's shards that hold its MTP head (`mtp.*`), where MLX tools put
/// it when the index does not list it.
pub const MTP_SIDECARS: [&str; 2] = ["model-mtp.safetensors", "mtp/weights.safetensors"];

fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, WeightsError> {
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| WeightsError::io(&index, e))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| WeightsError::Config { path: index.clone(), msg: format!("not valid JSON: {e}") })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| WeightsError::Config { path: index.clone(), msg: "missing `weight_map` object".into() })?;
        let mut files: Vec<PathBuf> = Vec::new();
        for v in map.values() {
            let f = v.as_str().ok_or_else(|| WeightsError::Config {
                path: index.clone(),
                msg: "`weight_map` values must be file names".into(),
            })?;
            let p = dir.join(f);
            if !files.contains(&p) {
                if !p.is_file() {
                    return Err(WeightsError::MissingShard { path: p, index: index.clone() });
                }
                files.push(p);
            }
        }
        files.sort();
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| WeightsError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    if files.is_empty() {
        return Err(WeightsError::NoSafetensors { dir: dir.to_path_buf() });
    }
    files.sort();
    Ok(files)
}

fn candle_dtype(d: safetensors::Dtype) -> Option<candle_core::DType> {
    use candle_core::DType;
    use safetensors::Dtype as S;
    Some(match d {
        S::U8 => DType::U8,
        S::U32 => DType::U32,
        S::I64 => DType::I64,
        S::BF16 => DType::BF16,
        S::F16 => DType::F16,
        S::F32 => DType::F32,
        S::F64 => DType::F64,
        _ => return None,
    })
}

/// candle wraps errors in path and backtrace layers; users need the innermost message.
pub(crate) fn root_cause(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithPath { inner, .. } | candle_core::Error::WithBacktrace { inner, .. } => {
            root_cause(inner)
        }
        candle_core::Error::Context { inner, .. } => root_cause(inner),
        other => other.to_string(),
    }
}
