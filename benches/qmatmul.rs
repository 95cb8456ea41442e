//! Quantized matmul throughput: weight bytes streamed per second for decode-sized batches
//! (the fused kernels) and prompt-sized ones (the tiled GEMM), on a matrix that fits in
//! cache (compute-bound) and ones that do not (memory-bound).
//!
//!   cargo bench --bench qmatmul

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

fn main() {
    for dt in [
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q8_0,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        for m in [1, 8, 128] {
            bench(dt, 512, 512, m); // 0.15 MB: in cache
            bench(dt, 1536 * 8, 512, m); // 5 MB (Q4_1)
        }
        // An LM head's size (a quarter of Gemma-3's 262,144 x 640; k-quants need rows of
        // whole 256-weight blocks): streams from DRAM.
        bench(dt, 65536, if dt.block_size() == 256 { 768 } else { 640 }, 1);
    }
}
