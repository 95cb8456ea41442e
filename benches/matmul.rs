//! Dense 16-bit products on CUDA by the three paths a projection can take: cuBLAS, the GEMV
//! kernel (up to 8 rows) and the batch-invariant tensor-core kernels (`ops/invariant_matmul`),
//! for a model's projection shapes and a range of row counts. Prints microseconds per product,
//! the weights' bytes per second and the arithmetic rate; one launch of each path is timed
//! after the others, round after round, and the median of `--rounds` is kept.
//!
//!   cargo bench --features cuda --bench matmul -- [--rows 1,2,4,8,16,32,64,128,512,2048]
//!       [--shapes qwen2.5-7b] [--reps 50] [--rounds 5] [--dtype bf16|f16]
//!
//! Shapes (N x K): qwen2.5-7b's q/k/v 4608 x 3584, o 3584 x 3584, gate/up 37888 x 3584, down
//! 3584 x 18944 and the head 152064 x 3584; `--shapes NxK,NxK` for others.

#[cfg(feature = "cuda")]
fn main() {
    use candle_core::{DType, Device, Tensor};
    use iris::ops::gemv::Gemv;
    use iris::ops::invariant_matmul::InvariantMatmul;
    use std::time::Instant;

    fn arg(name: &str, default: &str) -> String {
        let args: Vec<String> = std::env::args().collect();
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned()).unwrap_or_else(|| default.into())
    }
    let rows: Vec<usize> =
        arg("--rows", "1,2,4,8,16,32,64,128,512,2048").split(',').map(|r| r.parse().expect("--rows")).collect();
    let reps: usize = arg("--reps", "50").parse().expect("--reps");
    let rounds: usize = arg("--rounds", "5").parse().expect("--rounds");
    let dt = match arg("--dtype", "bf16").as_str() {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => panic!("--dtype {other}: bf16 or f16"),
    };
    let shapes: Vec<(&str, usize, usize)> = match arg("--shapes", "qwen2.5-7b").as_str() {
        "qwen2.5-7b" => vec![
            ("qkv", 4608, 3584),
            ("o", 3584, 3584),
            ("gate_up", 37888, 3584),
            ("down", 3584, 18944),
            ("head", 152064, 3584),
        ],
        list => list
            .split(',')
            .map(|s| {
                let (n, k) = s.split_once('x').expect("--shapes NxK,...");
                ("", n.parse().expect("N"), k.parse().expect("K"))
            })
            .collect(),
    };
    let dev = Device::new_cuda(0).expect("a CUDA device");
    println!("| shape | M | path | us | weights GB/s | TFLOP/s |");
    println!("|---|---|---|---|---|---|");
    for &(name, n, k) in &shapes {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev).unwrap().to_dtype(dt).unwrap();
        for &m in &rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap().to_dtype(dt).unwrap();
            type Path<'a> = (&'a str, Box<dyn Fn() -> Tensor + 'a>);
            let mut paths: Vec<Path> = vec![
                ("cublas", Box::new(|| x.matmul(&w.t().unwrap()).unwrap())),
                ("invariant", Box::new(|| InvariantMatmul::forward(&x, &w).unwrap())),
            ];
            if m <= iris::ops::gemv::MAX_ROWS {
                paths.push(("gemv", Box::new(|| Gemv::forward(&x, &w).unwrap())));
            }
            let mut times = vec![Vec::new(); paths.len()];
            for _ in 0..rounds {
                for (i, (_, f)) in paths.iter().enumerate() {
                    f();
                    dev.synchronize().unwrap();
                    let t = Instant::now();
                    for _ in 0..reps {
                        f();
                    }
                    dev.synchronize().unwrap();
                    times[i].push(t.elapsed().as_secs_f64() / reps as f64);
                }
            }
            for (i, (path, _)) in paths.iter().enumerate() {
                times[i].sort_by(f64::total_cmp);
                let s = times[i][rounds / 2];
                let bytes = (n * k * dt.size_in_bytes()) as f64;
                println!(
                    "| {name} {n}x{k} | {m} | {path} | {:.1} | {:.0} | {:.1} |",
                    s * 1e6,
                    bytes / s / 1e9,
                    2.0 * (m * n * k) as f64 / s / 1e12
                );
            }
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("matmul: a CUDA bench; build with --features cuda");
    std::process::exit(2);
}
