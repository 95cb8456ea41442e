//! Why a sequence stopped generating.

use serde::{Deserialize, Serialize};

/// Serializes as `"stop"`, `"length"`, `"cancelled"` or `{"error": "..."}`; use
/// [`FinishReason::as_openai_str`] for the OpenAI `finish_reason` field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the context length was reached.
    Length,
    /// The client went away or the request was aborted.
    Cancelled,
    /// The engine failed this sequence (the message is for logs / the client).
    Error(String),
}

impl FinishReason {
    /// The OpenAI `finish_reason` value. OpenAI has no value for aborts and errors;
    /// we follow vLLM's `"abort"` and use `"error"`.
    pub fn as_openai_str(&self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Cancelled => "abort",
            Self::Error(_) => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_strings_and_serde() {
        assert_eq!(FinishReason::Stop.as_openai_str(), "stop");
        assert_eq!(FinishReason::Length.as_openai_str(), "length");
        assert_eq!(FinishReason::Cancelled.as_openai_str(), "abort");
        assert_eq!(FinishReason::Error("oom".into()).as_openai_str(), "error");
        assert_eq!(serde_json::to_string(&FinishReason::Length).ok().as_deref(), Some(r#""length""#));
        let back: FinishReason = serde_json::from_str(r#"{"error":"oom"}"#).expect("valid json");
        assert_eq!(back, FinishReason::Error("oom".into()));
    }
}
