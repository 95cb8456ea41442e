//! Quantized matmul throughput: weight bytes streamed per second for decode-sized batches
//! (the fused kernels) and prompt-sized ones (the tiled GEMM), on a matrix that fits in
//! cache (compute-bound) and ones that do not (memory-bound).
//!
//!   cargo bench --bench qmatmul [-- Q4_1 Q8_0 ...]   (only those types)
//!   cargo bench --bench qmatmul -- model            (a SmolLM2 decode step's matrices)

use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use iris::ops::qmatmul::QMatrix;

fn bench(dt: GgmlDType, n: usize, k: usize, m: usize) {
    let dev = Device::Cpu;
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
    let q = Arc::new(QTensor::quantize(&w, dt).unwrap());
    let bytes = q.storage_size_in_bytes() as f64;
    let qm = QMatrix::new(q).unwrap();
    let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
    let _ = qm.forward(&x).unwrap();
    let iters = ((2e9 / (bytes * m.max(1) as f64).max(1.0)) as usize).clamp(3, 2000);
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        for _ in 0..iters {
            let _ = qm.forward(&x).unwrap();
        }
        times.push(t.elapsed().as_secs_f64() / iters as f64);
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let t = times[2];
    let gflops = 2.0 * (n * k * m) as f64 / t / 1e9;
    println!(
        "{dt:?} {n}x{k} m={m:<4} {:>8.1} us  {:>6.1} GB/s of weights  {:>6.1} GFLOP/s",
        t * 1e6,
        bytes / t / 1e9,
        gflops
    );
}

/// A decode step's matrices in order (SmolLM2-135M's 30 layers: q, k, v, o, gate, up,
/// down, then the Q8_0 head), each multiplied once per pass: the weights stream from DRAM
/// as in the engine, in matrices of 0.1-0.6 MB.
fn bench_model(m: usize) {
    let dev = Device::Cpu;
    let make = |dt: GgmlDType, n: usize, k: usize| {
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        QMatrix::new(Arc::new(QTensor::quantize(&w, dt).unwrap())).unwrap()
    };
    let (h, f) = (576, 1536);
    let mut mats = Vec::new();
    for _ in 0..30 {
        for (n, k) in [(h, h), (192, h), (192, h), (h, h), (f, h), (f, h), (h, f)] {
            mats.push(make(GgmlDType::Q4_1, n, k));
        }
    }
    mats.push(make(GgmlDType::Q8_0, 49152, h));
    let bytes: usize = mats.iter().map(|q| q.held_bytes()).sum();
    let xs: Vec<Tensor> = mats.iter().map(|q| Tensor::randn(0f32, 1.0, (m, q.dims().1), &dev).unwrap()).collect();
    let mut times = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        for (q, x) in mats.iter().zip(&xs) {
            let _ = q.forward(x).unwrap();
        }
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let t = times[3];
    println!(
        "SmolLM2 step m={m:<3} {:>8.1} us  {:>6.1} GB/s of weights ({} matrices)",
        t * 1e6,
        bytes as f64 / t / 1e9,
        mats.len()
    );
}

fn main() {
    if std::env::args().any(|a| a == "model") {
        for m in [1, 8] {
            bench_model(m);
        }
        return;
    }
    // `cargo bench --bench qmatmul -- Q4_1 Q8_0` measures only those types.
    let only: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-') && a != "model").collect();
    for dt in [
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        if !only.is_empty() && !only.iter().any(|o| o.eq_ignore_ascii_case(&format!("{dt:?}"))) {
            continue;
        }
        for m in [1, 8, 128] {
            bench(dt, 512, 512, m); // 0.15 MB: in cache
            bench(dt, 1536 * 8, 512, m); // 5 MB (Q4_1)
        }
        // An LM head's size (a quarter of Gemma-3's 262,144 x 640; k-quants need rows of
        // whole 256-weight blocks): streams from DRAM.
        bench(dt, 65536, if dt.block_size() == 256 { 768 } else { 640 }, 1);
    }
}
