//! The engine: requests, sequences, and the step as three parts: the scheduler (what runs),
//! the model runner (the flat batch on the device, sampling and draft verification), and the
//! output processor (accepted tokens, text, stop conditions, finishing, the next drafts).

pub mod build;
pub mod calibrate;
pub mod core;
#[cfg(feature = "cuda")]
mod cuda_graph;
pub mod detokenizer;
pub mod finish;
pub mod grammar;
mod mask_job;
pub mod mm_limit;
pub mod model_drafter;
pub mod mtp_drafter;
pub mod multimodal;
pub mod output;
pub mod prefix;
pub mod request;
pub mod runner;
pub mod sampler;
pub mod sampling_params;
pub mod scheduler;
pub mod sequence;
#[cfg(test)]
mod spec_distribution;
mod spec_governor;
pub mod speculative;
pub mod step_output;
pub mod stop;

pub use core::{Engine, EngineConfig};
pub use detokenizer::{DetokenizeError, IncrementalDetokenizer};
pub use finish::FinishReason;
pub use grammar::{Grammar, GrammarCompiler, GrammarError, GrammarSpec};
pub use multimodal::{expand_image_tokens, EmbedCache, ImageInput};
pub use output::{EngineStats, SpecStats};
pub use prefix::PrefixStats;
pub use request::{Request, RequestError, SeqUpdate};
pub use sampler::{sample_batch, DraftDist, SampleRow, Sampled, SequenceSampler};
pub use sampling_params::{SamplingError, SamplingParams};
pub use sequence::SeqId;
pub use speculative::{Drafter, ReplayDrafter, SpeculativeConfig, SpeculativeConfigError};
pub use stop::{StopChecker, StopOutcome};
