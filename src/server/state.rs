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

#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The name clients use in `model`.
    pub served_model_name: String,
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
}

pub struct AppState {
    pub cfg: ServeConfig,
    pub metrics: Arc<Metrics>,
    /// Set once the model is loaded; until then the APIs answer 503 and /health too.
    pub engine: OnceLock<EngineHandle>,
    pub started: u64,
}

impl AppState {
    pub fn new(cfg: ServeConfig, metrics: Arc<Metrics>) -> Self {
        AppState { cfg, metrics, engine: OnceLock::new(), started: now_unix() }
    }

    pub fn engine(&self) -> Result<&EngineHandle, ApiError> {
        self.engine.get().ok_or_else(|| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the model is still loading"))
    }

    /// The model name to answer with; unknown names are a 404.
    pub fn check_model(&self, model: Option<&str>) -> Result<String, ApiError> {
        match model {
            None | Some("") => Ok(self.cfg.served_model_name.clone()),
            Some(m) if m == self.cfg.served_model_name || m == self.cfg.model_path => {
                Ok(self.cfg.served_model_name.clone())
            }
            Some(m) => Err(ApiError::not_found(format!(
                "The model `{m}` does not exist. This server serves `{}`.",
                self.cfg.served_model_name
            ))
            .param("model")
            .code("model_not_found")),
        }
    }
}

/// Seconds since the Unix epoch (`created` in responses, `AppState::started`).
pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
