//! Tensor operations candle lacks. Each is a candle custom op whose CPU implementation is
//! plain Rust and is the reference any device kernel is checked against. Besides the ops:
//! `turboquant`, the codec the TurboQuant cache's ops share (and the storage they take), and
//! `team`, the threads the CPU ops run on. Layer 1: below the ops only `config`, `simd`,
//! `switches` and `device`; beside them `batch`, whose attention metadata they read.

pub mod activation;
pub mod add_rms_norm;
pub mod argmax;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gated_act;
pub mod gated_delta;
#[cfg(feature = "cuda")]
pub mod gated_delta_cuda;
pub mod gemv;
pub mod host_memory;
pub mod invariant_matmul;
pub mod kv_elem;
pub mod kv_write;
#[cfg(feature = "cuda")]
pub mod moe_experts;
pub mod moe_route;
pub mod paged_attention;
pub mod qkv_rope;
pub mod qmatmul;
pub mod sample;
pub mod team;
pub mod token_mask;
pub mod tq_attention;
pub mod tq_write;
pub mod turboquant;
