//! The engine: requests, sequences, the scheduler, the step loop, and the per-request
//! generation logic between logits and text (sampling, detokenization, stop strings).

pub mod build;
pub mod calibrate;
pub mod core;
#[cfg(feature = "cuda")]
mod cuda_graph;
pub mod detokenizer;
pub mod finish;
pub mod multimodal;
pub mod request;
pub mod runner;
pub mod sampler;
pub mod sampling_params;
pub mod scheduler;
pub mod sequence;
pub mod stop;

pub use core::{Engine, EngineConfig, EngineStats};
pub use detokenizer::{DetokenizeError, IncrementalDetokenizer};
pub use finish::FinishReason;
pub use multimodal::{expand_image_tokens, EmbedCache, ImageInput};
pub use request::{Request, RequestError, SeqUpdate};
pub use sampler::{sample_batch, SampleRow, Sampled, SequenceSampler};
pub use sampling_params::{SamplingError, SamplingParams};
pub use sequence::SeqId;
pub use stop::{StopChecker, StopOutcome};
