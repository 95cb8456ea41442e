//! What every handler shares: the server's settings, the engine once it is loaded, the
//! metrics.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;

use super::browser_policy::BrowserPolicy;
use super::connections::ConnectionLimits;
use super::engine_loop::EngineHandle;
use super::errors::ApiError;
use super::images::MediaPolicy;
use super::metrics::Metrics;
use super::response_store::ResponseStore;
use super::tool_request::ParserConfig;

#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The name clients use in `model` (the first of --served-model-name).
    pub served_model_name: String,
    /// Other names accepted in `model` (the rest of --served-model-name); `*` in one matches
    /// any run of characters, so `claude-*` takes the names Claude Code sends.
    pub aliases: Vec<String>,
    /// The tool-call and reasoning parsers.
    pub parsers: ParserConfig,
    /// Also accepted in `model` (the path given with --model).
    pub model_path: String,
    pub api_key: Option<String>,
    pub max_body_bytes: usize,
    /// After SIGINT/SIGTERM, in-flight requests get this long to finish before they are
    /// cancelled.
    pub shutdown_timeout: Duration,
    /// Where images may come from, and how large they may be.
    pub media: MediaPolicy,
    /// Open connections and their timeouts.
    pub connections: ConnectionLimits,
    /// Host check and CORS.
    pub browser: BrowserPolicy,
    /// Most responses the Responses API keeps for `previous_response_id` and GET
    /// (--max-stored-responses; 0: none).
    pub max_stored_responses: usize,
}

pub struct AppState {
    pub cfg: ServeConfig,
    pub metrics: Arc<Metrics>,
    /// Set once the model is loaded; until then the APIs answer 503 and /health too.
    pub engine: OnceLock<EngineHandle>,
    pub started: u64,
    /// The Responses API's stored responses.
    pub responses: Arc<ResponseStore>,
}

impl AppState {
    pub fn new(cfg: ServeConfig, metrics: Arc<Metrics>) -> Self {
        let responses = Arc::new(ResponseStore::new(cfg.max_stored_responses));
        AppState { cfg, metrics, engine: OnceLock::new(), started: now_unix(), responses }
    }

    pub fn engine(&self) -> Result<&EngineHandle, ApiError> {
        self.engine.get().ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the model is still loading"))
    }

    /// The model name to answer with; unknown names are a 404. A name matched by an alias
    /// is answered with as sent (vLLM answers with the request's name too).
    pub fn check_model(&self, model: Option<&str>) -> Result<String, ApiError> {
        match model {
            None | Some("") => Ok(self.cfg.served_model_name.clone()),
            Some(m) if m == self.cfg.served_model_name || m == self.cfg.model_path => {
                Ok(self.cfg.served_model_name.clone())
            }
            Some(m) if self.cfg.aliases.iter().any(|a| glob_match(a, m)) => Ok(m.to_string()),
            Some(m) => Err(ApiError::not_found(format!(
                "The model `{m}` does not exist. This server serves `{}`.",
                self.cfg.served_model_name
            ))
            .param("model")
            .code("model_not_found")),
        }
    }
}

/// Does `name` match `pattern`, where `*` stands for any run of characters?
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == name;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !name.starts_with(first) || name.len() < first.len() + last.len() || !name.ends_with(last) {
        return false;
    }
    let mut rest = &name[first.len()..name.len() - last.len()];
    for p in &parts[1..parts.len() - 1] {
        match rest.find(p) {
            Some(i) => rest = &rest[i + p.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    #[test]
    fn globs() {
        use super::glob_match as g;
        assert!(g("claude-*", "claude-sonnet-4-5"));
        assert!(g("*", "anything"));
        assert!(g("a*b*c", "aXbYc"));
        assert!(!g("a*b*c", "aXcYb"));
        assert!(!g("claude-*", "gpt-4"));
        assert!(g("exact", "exact"));
        assert!(!g("ab*ba", "aba"));
    }
}

/// Seconds since the Unix epoch (`created` in responses, `AppState::started`).
pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
