//! With the `cuda` feature, compiles src/ops/cuda/*.cu to PTX (loaded at run time by
//! src/ops/cuda/mod.rs). The default build has nothing to do here.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda_kernels();
}

#[cfg(feature = "cuda")]
fn cuda_kernels() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // The directory, so that a new .cu file is picked up too.
    println!("cargo::rerun-if-changed=src/ops/cuda");
    let ptx = cudaforge::KernelBuilder::new()
        .source_dir("src/ops/cuda")
        .watch([
            "src/ops/cuda/common.cuh",
            "src/ops/cuda/tq_common.cuh",
            "src/ops/cuda/mma.cuh",
            "src/ops/cuda/flash.cuh",
        ])
        .arg("-std=c++17")
        .arg("-O3")
        .arg("--expt-relaxed-constexpr")
        .build_ptx()
        .unwrap_or_else(|e| panic!("compiling the CUDA kernels: {e}"));
    ptx.write(out.join("iris_ptx.rs")).unwrap_or_else(|e| panic!("writing iris_ptx.rs: {e}"));
}
