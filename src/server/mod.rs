//! The HTTP server: OpenAI and Anthropic APIs, health and Prometheus metrics.
//!
//! Handlers never touch the model: they validate, tokenize, and hand sequences to the
//! engine thread through an [`EngineHandle`] (see `engine_loop.rs`); every request joins the
//! engine's continuous batch. Modules: `openai` and `anthropic` (the APIs), `openai_choices`
//! (the chat and completions output formats and their stream), `generate` (what the APIs
//! share), `sse` (streaming), `errors` (error bodies), `metrics`, `state` (what every handler
//! shares: the settings, the engine, the metrics).

pub mod anthropic;
mod content;
pub mod engine_loop;
pub mod errors;
pub mod generate;
pub mod images;
pub mod metrics;
pub mod openai;
pub mod openai_choices;
pub mod sse;
mod state;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;

pub use engine_loop::{spawn_engine, EngineHandle, EngineInfo};
use errors::ApiError;
pub use metrics::Metrics;
pub use state::{AppState, ServeConfig};

pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.cfg.max_body_bytes;
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/models", get(openai::models))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

fn flavor_for(path: &str) -> errors::Flavor {
    if path.starts_with("/v1/messages") {
        errors::Flavor::Anthropic
    } else {
        errors::Flavor::OpenAi
    }
}

/// `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic).
async fn auth(State(app): State<Arc<AppState>>, headers: HeaderMap, req: Request, next: Next) -> Response {
    let Some(key) = &app.cfg.api_key else {
        return next.run(req).await;
    };
    let bearer = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim);
    let x_api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    let ok = [bearer, x_api_key].into_iter().flatten().any(|k| constant_time_eq(k.as_bytes(), key.as_bytes()));
    if ok {
        return next.run(req).await;
    }
    let msg = if bearer.is_none() && x_api_key.is_none() {
        "missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
    } else {
        "invalid API key"
    };
    ApiError::new(StatusCode::UNAUTHORIZED, msg)
        .code("invalid_api_key")
        .with_flavor(flavor_for(req.uri().path()))
        .into_response()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn count_requests(State(app): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let known = [
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/health",
        "/metrics",
    ];
    let endpoint = if known.contains(&path.as_str()) { path.as_str() } else { "other" };
    app.metrics.record_request(endpoint, resp.status().as_u16());
    resp
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    ApiError::not_found(format!("no route for {} {path}", req.method())).with_flavor(flavor_for(&path)).into_response()
}

async fn health(State(app): State<Arc<AppState>>) -> Response {
    match app.engine.get() {
        Some(e) if e.is_alive() => (StatusCode::OK, "ok").into_response(),
        Some(_) => (StatusCode::SERVICE_UNAVAILABLE, "the engine stopped (see the server log)").into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "loading").into_response(),
    }
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

/// Serves on `listener` until SIGINT/SIGTERM; then stops accepting, lets in-flight requests
/// finish for `shutdown_timeout`, cancels what is left and returns.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<AppState>) -> anyhow::Result<()> {
    let app = router(state.clone());
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Streams write one small chunk per token: with Nagle's algorithm each chunk would wait
    // for the ACK of the previous one, which a client may delay by ~40 ms.
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("cannot set TCP_NODELAY: {e}");
        }
    });
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    let mut server = std::pin::pin!(server.into_future());
    let mut stop_rx = stop_rx;
    tokio::select! {
        r = &mut server => return r.map_err(Into::into),
        _ = stop_rx.wait_for(|s| *s) => {}
    }
    let in_flight = state.engine.get().map(|e| e.in_flight()).unwrap_or(0);
    tracing::info!(
        "shutting down: no new connections; {in_flight} sequences in flight get {:?} to finish",
        state.cfg.shutdown_timeout
    );
    if tokio::time::timeout(state.cfg.shutdown_timeout, &mut server).await.is_ok() {
        tracing::info!("all requests finished; bye");
        return Ok(());
    }
    tracing::warn!("shutdown deadline passed: cancelling the requests still running");
    if let Some(e) = state.engine.get() {
        e.abort_all();
    }
    // Cancelled streams end at once; give their last bytes a moment to go out.
    let _ = tokio::time::timeout(Duration::from_secs(2), &mut server).await;
    tracing::info!("bye");
    Ok(())
}
