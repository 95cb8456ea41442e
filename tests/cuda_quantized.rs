//! Quantized matrices kept quantized on CUDA (`ops/qmatmul/cuda.rs`, `cuda/qgemv.cu`) against
//! the CPU's kernels. Compiled only with `--features cuda`; run on a GPU machine by
//! scripts/gpu-check.sh and scripts/gpu-quant-ab.sh (IRIS_REQUIRE_GPU=1 turns a missing GPU
//! into a failure instead of a skip).
#![cfg(feature = "cuda")]

mod common;

use candle_core::{DType, Device};
use common::cuda::{gpu, max_rel_err, random};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Quantized matrices kept quantized on the GPU: every GGUF block format with a packed form
/// and every MLX affine width, decoded on the device to the CPU's weights bit for bit, and
/// their products with f32 and bf16 rows (the GEMV kernel up to 8 rows, dequantize + cuBLAS
/// past that) against the CPU kernels'.
#[test]
fn quantized_matrices_match_cpu() {
    use candle_core::quantized::{GgmlDType, QTensor};
    use iris::ops::qmatmul::QMatrix;
    use iris::weights::{AffineMatrix, AffineParams};
    use std::sync::Arc;
    let Some(dev) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let (n, k) = (300, 768);
    let mut mats: Vec<(String, QMatrix)> = Vec::new();
    for dt in [
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        let w = random(&mut rng, &[n, k]);
        mats.push((format!("{dt:?}"), QMatrix::new(Arc::new(QTensor::quantize(&w, dt).unwrap())).unwrap()));
    }
    // MLX checkpoints hold bf16 or f16 scales and biases (the device keeps them 16-bit, one per
    // group); plain f32 ones take the f32 planes.
    let bf16 = |v: f32| half::bf16::from_f32(v).to_f32();
    let f16 = |v: f32| half::f16::from_f32(v).to_f32();
    let same = |v: f32| v;
    let forms: [(&str, &dyn Fn(f32) -> f32); 3] = [("bf16", &bf16), ("f16", &f16), ("f32", &same)];
    for (i, bits) in AffineParams::BITS.into_iter().enumerate() {
        for (j, group) in [32, 64, 128].into_iter().enumerate() {
            let (form, round) = forms[(i + j) % 3];
            let params = AffineParams { bits, group };
            let groups = n * k / group;
            let a = AffineMatrix {
                rows: n,
                cols: k,
                params,
                codes: (0..n * params.packed_words(k)).map(|_| rng.random::<u32>()).collect(),
                scales: (0..groups).map(|_| round(rng.random_range(-0.05f32..0.05))).collect(),
                biases: (0..groups).map(|_| round(rng.random_range(-1f32..1.0))).collect(),
            };
            let q = QMatrix::from_affine(&a).unwrap();
            if bits == 4 && form != "f32" {
                // The file's bytes: the codes and a 16-bit scale and bias per group (the rows
                // padded to the tensor-core tiles' 16).
                let g = q.upload(&dev).unwrap().unwrap();
                let rows = n.next_multiple_of(16);
                assert_eq!(g.bytes(), rows * k / 2 + 2 * rows * (k / group) * 2, "4-bit group {group} {form}");
            }
            mats.push((format!("mlx {bits}-bit group {group} {form}"), q));
        }
    }
    // Rows of 25 blocks: the tiles' last chunk of 4 blocks is cut short (its padding blocks must
    // add nothing, and x past the row must not be read).
    let short = 800;
    let w = random(&mut rng, &[n, short]);
    mats.push(("Q4_0, 25 blocks a row".into(), QMatrix::new(Arc::new(QTensor::quantize(&w, GgmlDType::Q4_0).unwrap())).unwrap()));
    let params = AffineParams { bits: 4, group: 32 };
    let a = AffineMatrix {
        rows: n,
        cols: short,
        params,
        codes: (0..n * params.packed_words(short)).map(|_| rng.random::<u32>()).collect(),
        scales: (0..n * short / 32).map(|_| half::bf16::from_f32(rng.random_range(-0.05f32..0.05)).to_f32()).collect(),
        biases: (0..n * short / 32).map(|_| half::bf16::from_f32(rng.random_range(-1f32..1.0)).to_f32()).collect(),
    };
    mats.push(("mlx 4-bit group 32, 25 blocks a row".into(), QMatrix::from_affine(&a).unwrap()));
    for (name, q) in &mats {
        let k = q.dims().1;
        let g = q.upload(&dev).unwrap().expect("a packed format has CUDA kernels");
        let want = q.dequantize_all().unwrap();
        let got = g.dequantize(DType::F32).unwrap().to_device(&Device::Cpu).unwrap();
        assert_eq!(max_rel_err(&got, &want), 0.0, "{name}: the device decodes other weights");
        // Across the kernels' row limits: 8 (qgemv), 32 (qtile, 4-bit codes), then a GEMM.
        let xs = random(&mut rng, &[65, k]);
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let mut first: Option<Vec<f32>> = None;
            for m in [1, 2, 3, 8, 9, 17, 32, 33, 65] {
                let x = xs.narrow(0, 0, m).unwrap().to_dtype(dt).unwrap();
                let cpu = q.forward(&x.to_dtype(DType::F32).unwrap()).unwrap();
                let got = g.forward(&x.to_device(&dev).unwrap()).unwrap();
                let e = max_rel_err(&got.to_dtype(DType::F32).unwrap(), &cpu);
                // f32: f32 rounding; 16-bit outputs: their own rounding.
                let tol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
                assert!(e <= tol, "{name} m={m} {dt:?}: rel err {e}");
                // Row 0 does not depend on the rows beside it, up to the GEMV's limit.
                if m <= g.max_gemv_rows() {
                    let row0: Vec<f32> = got.get(0).unwrap().to_dtype(DType::F32).unwrap().to_vec1().unwrap();
                    match &first {
                        None => first = Some(row0),
                        Some(f) => assert_eq!(&row0, f, "{name} {dt:?}: row 0 changed at m={m}"),
                    }
                }
            }
        }
    }
}
