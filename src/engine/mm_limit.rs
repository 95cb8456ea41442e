//! `--limit-mm-per-prompt`, as vLLM takes it: a JSON object of most items per request by
//! modality, e.g. '{"image": 2}'. Images are the one modality iris reads; at image 0 a
//! vision-language checkpoint's tower is not loaded and its language model serves text alone.

use serde_json::Value;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MmLimitError {
    #[error("--limit-mm-per-prompt: not a JSON object of counts by modality ({0}); e.g. '{{\"image\": 0}}'")]
    Json(String),
    #[error("--limit-mm-per-prompt: `{key}` needs a whole number of items (or {{\"count\": N}}), not {value}")]
    Count { key: String, value: String },
    #[error("--limit-mm-per-prompt: iris takes no {0} input; give it 0 or leave it out")]
    Unsupported(String),
    #[error("--limit-mm-per-prompt: `{0}` is not a modality (image, video, audio)")]
    Unknown(String),
}

/// The most images one request may carry (None: the flag does not limit them).
pub fn parse(s: &str) -> Result<Option<usize>, MmLimitError> {
    let json: Value = serde_json::from_str(s).map_err(|e| MmLimitError::Json(e.to_string()))?;
    let Value::Object(map) = json else { return Err(MmLimitError::Json(format!("`{s}` is not an object"))) };
    let mut image = None;
    for (key, value) in &map {
        // vLLM takes a count, or an object with one (and per-modality options iris has no use for).
        let n = value.as_u64().or_else(|| value.get("count").and_then(Value::as_u64));
        let n = n.ok_or_else(|| MmLimitError::Count { key: key.clone(), value: value.to_string() })?;
        match key.as_str() {
            "image" => image = Some(n as usize),
            "video" | "audio" if n == 0 => {}
            "video" | "audio" => return Err(MmLimitError::Unsupported(key.clone())),
            _ => return Err(MmLimitError::Unknown(key.clone())),
        }
    }
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_spellings() {
        assert_eq!(parse(r#"{"image": 0}"#), Ok(Some(0)));
        assert_eq!(parse(r#"{"image": 2, "video": 0}"#), Ok(Some(2)));
        assert_eq!(parse(r#"{"image": {"count": 3}}"#), Ok(Some(3)));
        assert_eq!(parse(r#"{"audio": 0}"#), Ok(None));
        assert_eq!(parse("{}"), Ok(None));
    }

    #[test]
    fn refuses_what_iris_cannot_take() {
        assert_eq!(parse(r#"{"video": 1}"#), Err(MmLimitError::Unsupported("video".into())));
        assert_eq!(parse(r#"{"pointcloud": 0}"#), Err(MmLimitError::Unknown("pointcloud".into())));
        assert!(matches!(parse(r#"{"image": -1}"#), Err(MmLimitError::Count { .. })));
        assert!(matches!(parse(r#"{"image": 1.5}"#), Err(MmLimitError::Count { .. })));
        assert!(matches!(parse("image=0"), Err(MmLimitError::Json(_))));
        assert!(matches!(parse("[0]"), Err(MmLimitError::Json(_))));
    }
}
