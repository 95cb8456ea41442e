//! The HTTP server: OpenAI and Anthropic APIs, health and Prometheus metrics.
//!
//! Handlers never touch the model: they validate, tokenize, and hand sequences to the
//! engine thread through an [`EngineHandle`] (see `engine_loop.rs`); every request joins the
//! engine's continuous batch. Modules: `openai` and `anthropic` (the APIs), `openai_choices`
//! (the chat and completions output formats and their stream), `generate` (what the APIs
//! share), `sse` (streaming), `errors` (error bodies), `metrics`, `state` (what every handler
//! shares: the settings, the engine, the metrics), `responses*` and `response_store` (the
//! Responses API).

pub mod anthropic;
pub mod anthropic_request;
mod auth;
pub mod browser;
mod browser_policy;
pub mod chat_prompt;
pub mod connections;
mod content;
pub mod engine_loop;
pub mod errors;
pub mod fields;
pub mod generate;
mod ids;
pub mod images;
pub mod metrics;
pub mod openai;
pub mod openai_choices;
pub mod reasoning;
pub mod reply;
pub mod response_store;
pub mod responses;
pub mod responses_output;
pub mod responses_request;
pub mod responses_stream;
pub mod sse;
mod state;
pub mod structured;
pub mod timed_body;
pub mod tool_grammar;
pub mod tool_request;
pub mod tools;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

pub use connections::ConnectionLimits;
pub use engine_loop::{spawn_engine, EngineHandle, EngineInfo};
use errors::{ApiError, Flavor};
pub use metrics::Metrics;
pub use state::{AppState, ServeConfig};

/// The routes metrics count by name; anything else counts as `other`.
const KNOWN: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/health",
    "/ping",
    "/version",
    "/metrics",
];

/// The routes that take POST only (the rest take GET, /ping both).
const POST_ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/v1/completions",
    "/tokenize",
    "/detokenize",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
];

pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{*id}", get(openai::model))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::get).delete(responses::delete))
        .route_layer(middleware::from_fn(browser::require_json))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::auth));
    // Layers run outside in: counting, JSON error bodies, Host and CORS checks, the routes.
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/ping", get(health).post(health))
        .route("/version", get(version))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), browser::guard))
        .layer(middleware::from_fn(json_errors))
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

async fn count_requests(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let endpoint = if KNOWN.contains(&path.as_str()) {
        path.as_str()
    } else if path.starts_with("/v1/models/") {
        "/v1/models/{id}"
    } else if path.starts_with("/v1/responses/") {
        "/v1/responses/{id}"
    } else {
        "other"
    };
    app.metrics.record_request(endpoint, resp.status().as_u16());
    resp
}

/// Every error answer carries a JSON body: the ones axum writes itself (405, rejections)
/// and the plain-text ones of /health get the API's error shape here.
async fn json_errors(req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    let resp = next.run(req).await;
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_string();
    let message = if status == StatusCode::METHOD_NOT_ALLOWED {
        // axum adds the `Allow` header outside this layer; the routes say the same.
        let allow = if path == "/ping" {
            "GET, POST"
        } else if path.starts_with("/v1/responses/") {
            "GET, DELETE"
        } else if POST_ROUTES.contains(&path.as_str()) {
            "POST"
        } else {
            "GET"
        };
        format!("the method {method} is not allowed on {path} (allowed: {allow})")
    } else if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let mut out = ApiError::new(status, message).with_flavor(Flavor::for_path(&path)).into_response();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            out.headers_mut().insert(name.clone(), value.clone());
        }
    }
    out
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    ApiError::not_found(format!("no route for {} {path}", req.method()))
        .with_flavor(Flavor::for_path(&path))
        .into_response()
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    match app.engine.get() {
        Some(e) if e.is_alive() => (StatusCode::OK, "ok").into_response(),
        Some(_) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the engine stopped (see the server log)")
            .code("engine_stopped")
            .into_response(),
        None => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "loading").code("loading").into_response(),
    }
}

/// vLLM's `/version`.
async fn version() -> Response {
    axum::Json(serde_json::json!({ "version": env!("CARGO_PKG_VERSION") })).into_response()
}

async fn metrics_text(State(app): State<Arc<AppState>>) -> Response {
    let total = app.engine.get().map(|e| e.info.num_blocks).unwrap_or(0);
    let body = app.metrics.render(&app.cfg.served_model_name, total);
    ([("content-type", "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

/// Resolves when SIGINT or SIGTERM arrives.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Serves on `listener` until SIGINT/SIGTERM; then stops accepting, closes idle and
/// half-sent connections, lets in-flight requests finish for `shutdown_timeout`, cancels what
/// is left and returns.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<AppState>) -> anyhow::Result<()> {
    let app = router(state.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let conns = connections::Connections::new(state.cfg.connections, stop_rx);
    let accept = tokio::spawn(conns.clone().accept_loop(listener, app));
    shutdown_signal().await;
    let _ = stop_tx.send(true);
    let _ = accept.await;
    let in_flight = state.engine.get().map(|e| e.in_flight()).unwrap_or(0);
    tracing::info!(
        "shutting down: no new connections; {in_flight} sequences in flight get {:?} to finish ({} connections open)",
        state.cfg.shutdown_timeout,
        conns.open()
    );
    if tokio::time::timeout(state.cfg.shutdown_timeout, conns.drained()).await.is_ok() {
        tracing::info!("all requests finished; bye");
        return Ok(());
    }
    let cancelled = match state.engine.get() {
        Some(e) => e.abort_all().await,
        None => 0,
    };
    tracing::warn!("shutdown deadline passed: cancelled {cancelled} sequences still running");
    // Cancelled streams end at once; give their last bytes a moment to go out.
    let _ = tokio::time::timeout(Duration::from_secs(2), conns.drained()).await;
    tracing::info!("bye");
    Ok(())
}
