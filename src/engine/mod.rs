//! Per-request generation logic that sits between the model's logits and the client:
//! sampling parameters, the sampler, incremental detokenization, stop strings and
//! finish reasons. Nothing here touches tensors; the scheduler hands us host logits.

pub mod detokenizer;
pub mod finish;
pub mod sampler;
pub mod sampling_params;
pub mod stop;

pub use detokenizer::{DetokenizeError, IncrementalDetokenizer};
pub use finish::FinishReason;
pub use sampler::{sample_batch, SampleRow, Sampled, SequenceSampler};
pub use sampling_params::{SamplingError, SamplingParams};
pub use stop::{StopChecker, StopOutcome};
