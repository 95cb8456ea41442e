//! iris: an inference engine for LLMs and vision-language models.
//!
//! Layers (each knows only the ones below it): `ops` (custom tensor ops) -> `weights`
//! -> `layers` -> `models` -> `kv` -> `engine` -> `cli`. See ARCHITECTURE.md.

pub mod batch;
pub mod cli;
pub mod config;
pub mod device;
pub mod engine;
pub mod fetch;
pub mod kv;
pub mod layers;
pub mod loader;
pub mod media;
pub mod models;
pub mod ops;
pub mod server;
pub mod simd;
mod switches;
pub mod tokenizer;
pub mod weights;
