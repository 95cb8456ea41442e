//! iris: an inference engine for LLMs and vision-language models.
//!
//! Layers, lowest first; each module uses only its own layer and lower ones, and no two files
//! use each other (DESIGN.md, "Layers of the code"; `tests/layering.rs` checks both):
//! 0 `config`, `simd`, `switches`, `device` -> 1 `ops`, `batch` -> 2 `weights`, `tokenizer`,
//! `media` -> 3 `kv` -> 4 `layers` -> 5 `models` -> `loader` -> 6 `engine` -> 7 `server`,
//! `cli`, `fetch`, `hub`. See ARCHITECTURE.md.

pub mod batch;
pub mod cli;
pub mod config;
pub mod device;
pub mod engine;
pub mod fetch;
pub mod hub;
pub mod kv;
pub mod layers;
pub mod loader;
pub mod media;
pub mod models;
pub mod ops;
pub mod parallel;
pub mod server;
pub mod simd;
mod switches;
pub mod tokenizer;
pub mod weights;
