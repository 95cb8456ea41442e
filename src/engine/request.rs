//! What callers hand the engine, and what it hands back.

use super::finish::FinishReason;
use super::sampler::Sampled;
use super::sampling_params::SamplingParams;
use super::sequence::SeqId;

/// A tokenized prompt and how to continue it.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
}

/// Why the engine refused a request. Each says what to change.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum RequestError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens, more than the model's context of {max} tokens")]
    PromptTooLong { prompt: usize, max: usize },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    BadToken { id: u32, vocab: usize },
    #[error("{0}")]
    BadParams(String),
    /// Images given to a model without a vision tower, or not matching the prompt's image tokens.
    #[error("{0}")]
    BadImages(String),
}

/// What one step produced for one sequence.
#[derive(Debug, Clone)]
pub struct SeqUpdate {
    pub id: SeqId,
    /// The token sampled this step, when one was.
    pub token: Option<Sampled>,
    /// New text, safe to show: complete characters, never a possible start of a stop string.
    pub text: String,
    pub finish: Option<FinishReason>,
    /// With the first token of a sequence whose params ask for `prompt_logprobs`: the
    /// logprobs of its prompt tokens from the second on (the first has no context).
    pub prompt_logprobs: Option<Vec<Sampled>>,
    /// Prompt tokens (for usage accounting); filled when the sequence finishes.
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
    /// Of the prompt, tokens whose keys came from the prefix cache (known once the sequence
    /// first runs: usage's `cached_tokens`, Anthropic's `cache_read_input_tokens`).
    pub num_cached_tokens: usize,
}
