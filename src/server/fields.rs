//! The request fields each endpoint reads, and the ones it accepts and ignores: any other
//! field is a 400 that names it, so that nothing a client asks for is silently dropped
//! (docs/serving.md lists the ignored ones and why).

use serde_json::Value;

use super::errors::ApiError;

/// The sampling fields every OpenAI generation endpoint reads (`generate::SamplingFields`).
const SAMPLING: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
];

/// Fields of the OpenAI APIs that change nothing iris computes: who the user is, metadata
/// for OpenAI's own storage and billing, cache hints.
const OPENAI_IGNORED: &[&str] = &["user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"];

/// One endpoint's fields.
pub struct Fields {
    pub read: &'static [&'static str],
    pub sampling: bool,
    pub ignored: &'static [&'static str],
}

pub const CHAT: Fields = Fields {
    read: &[
        "model",
        "messages",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "add_generation_prompt",
        "chat_template_kwargs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "modalities",
        // vLLM's structured outputs (`structured::from_body`).
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ],
    sampling: true,
    ignored: OPENAI_IGNORED,
};

pub const COMPLETIONS: Fields = Fields {
    read: &[
        "model",
        "prompt",
        "stream",
        "stream_options",
        "logprobs",
        "echo",
        "suffix",
        "add_special_tokens",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ],
    sampling: true,
    ignored: OPENAI_IGNORED,
};

pub const TOKENIZE: Fields = Fields {
    read: &[
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "tools",
        "chat_template_kwargs",
    ],
    sampling: false,
    ignored: &[],
};

pub const DETOKENIZE: Fields = Fields { read: &["model", "tokens"], sampling: false, ignored: &[] };

/// Anthropic: `metadata` (a user id) and `service_tier` change nothing here; `cache_control`
/// (automatic prompt caching) is a hint iris has no cache for yet, as on content blocks.
pub const MESSAGES: Fields = Fields {
    read: &[
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
        // vLLM's sampling extensions.
        "ignore_eos",
        "min_tokens",
        "seed",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
    ],
    sampling: false,
    ignored: &["metadata", "service_tier", "cache_control"],
};

/// The Responses API. Besides its own fields it reads vLLM's sampling extensions, as the
/// chat endpoint does (not `max_tokens` / `n`: `max_output_tokens`, one output). `include`,
/// `truncation`, `background`, `max_tool_calls`, `top_logprobs` and `stream_options` are read
/// to refuse the values iris cannot honour (`responses_request::check_settings`).
pub const RESPONSES: Fields = Fields {
    read: &[
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "reasoning",
        "text",
        "metadata",
        "user",
        "stream",
        "store",
        "previous_response_id",
        "include",
        "truncation",
        "background",
        "max_tool_calls",
        "top_logprobs",
        "stream_options",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "ignore_eos",
        "min_tokens",
        "stop_token_ids",
        "skip_special_tokens",
    ],
    sampling: false,
    ignored: &["service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"],
};

pub const COUNT_TOKENS: Fields = Fields {
    read: &["model", "messages", "system", "tools", "tool_choice", "thinking"],
    sampling: false,
    ignored: &["metadata", "cache_control"],
};

impl Fields {
    fn knows(&self, name: &str) -> bool {
        self.read.contains(&name) || (self.sampling && SAMPLING.contains(&name)) || self.ignored.contains(&name)
    }

    /// A 400 naming the first field of `body` this endpoint neither reads nor ignores.
    pub fn check(&self, body: &Value) -> Result<(), ApiError> {
        let Some(obj) = body.as_object() else { return Ok(()) };
        match obj.keys().find(|k| !self.knows(k)) {
            None => Ok(()),
            Some(k) => Err(ApiError::invalid_param(
                k.clone(),
                format!("unsupported field `{k}`: iris does not implement it (docs/serving.md lists what is accepted)"),
            )
            .code("unsupported_field")),
        }
    }
}

/// `modalities`: text only.
pub fn check_modalities(v: Option<&Value>) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Array(m)) if m.iter().all(|x| x == "text") => Ok(()),
        Some(_) => {
            Err(ApiError::invalid_param("modalities", "`modalities`: only the `text` output modality is supported")
                .code("unsupported_field"))
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn unknown_fields_are_named() {
        assert!(CHAT.check(&json!({"model": "m", "messages": [], "temperature": 0, "user": "u"})).is_ok());
        let e = CHAT.check(&json!({"messages": [], "functions": []})).expect_err("unknown");
        assert!(e.to_string().contains("`functions`"), "{e}");
        assert!(MESSAGES.check(&json!({"messages": [], "n": 2})).is_err());
        assert!(RESPONSES.check(&json!({"input": "x", "max_output_tokens": 4, "store": false, "seed": 1})).is_ok());
        for f in ["max_tokens", "n", "conversation", "prompt", "messages"] {
            let e = RESPONSES.check(&json!({"input": "x", f: 1})).expect_err(f);
            assert_eq!(e.param.as_deref(), Some(f));
        }
        assert!(check_modalities(Some(&json!(["text", "audio"]))).is_err());
    }
}
