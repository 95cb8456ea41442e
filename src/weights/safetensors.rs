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
    /// Opens `model.safetensors.index.json`'s shards, or every `*.safetensors` in `dir`.
    pub fn open(dir: &Path) -> Result<Self, WeightsError> {
        let files = shard_files(dir)?;
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

    /// VLM checkpoints saved by transformers 5 keep the language model under
    /// `model.language_model.` and the vision tower under `model.visual.`; older ones use
    /// `model.` and `visual.`. Names resolve to either, so one set of model code reads both.
    fn resolve(&self, name: &str) -> Option<String> {
        if self.names.contains_key(name) {
            return Some(name.to_string());
        }
        let alt = match name.strip_prefix("model.") {
            Some(rest) => format!("model.language_model.{rest}"),
            None => format!("model.{name}"),
        };
        self.names.contains_key(&alt).then_some(alt)
    }

    /// The file holding tensor `name` (the directory if no file does).
    pub fn file_of(&self, name: &str) -> &Path {
        self.resolve(name).and_then(|k| self.names.get(&k)).map_or(self.dir.as_path(), PathBuf::as_path)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.resolve(name).is_some()
    }

    pub fn load(&self, name: &str, device: &Device) -> Result<Tensor, WeightsError> {
        let key = self
            .resolve(name)
            .ok_or_else(|| WeightsError::MissingTensor { name: name.to_string(), origin: self.dir.clone() })?;
        self.st.load(&key, device).map_err(|e| WeightsError::BadTensor {
            origin: self.names.get(&key).cloned().unwrap_or_else(|| self.dir.clone()),
            name: key,
            msg: root_cause(&e),
        })
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
