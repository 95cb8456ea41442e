//! iris: an inference engine for LLMs and vision-language models.
//!
//! Layers (each knows only the ones below it): `ops` (custom tensor ops) -> `weights`
//! -> `layers` -> `models` -> `kv` -> `engine` -> `cli`. See ARCHITECTURE.md.

pub mod engine;
pub mod tokenizer;
