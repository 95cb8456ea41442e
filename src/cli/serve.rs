//! `iris serve`: the OpenAI- and Anthropic-compatible HTTP server.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::args::EngineArgs;
use crate::engine::build::build_engine;
use crate::media::remote::RemoteFetcher;
use crate::media::DecodeLimits;
use crate::server::browser::BrowserPolicy;
use crate::server::engine_loop::RequestLimits;
use crate::server::images::MediaPolicy;
use crate::server::reasoning::ReasoningFormat;
use crate::server::tool_request::ParserConfig;
use crate::server::tools::ToolFormat;
use crate::server::{self, AppState, ConnectionLimits, Metrics, ServeConfig};

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the log says which).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name clients use in `model` (default: the model file or directory name). More
    /// names after the first are aliases the server also accepts (vLLM's form); `*` in an
    /// alias matches any run of characters, e.g. `--served-model-name qwen 'claude-*'` for
    /// the model names Claude Code sends.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// How tool calls in replies are written (vLLM's names): hermes (Qwen2.5, Qwen3),
    /// qwen3_xml or qwen3_coder (Qwen3-Coder, Qwen3.5), glm45 (GLM-4.5/4.6, 4.5V/4.6V),
    /// llama3_json (Llama 3.x), gemma4 (Gemma 4). Default: read from the chat template.
    #[arg(long)]
    pub tool_call_parser: Option<String>,
    /// Let requests leave the choice of calling a tool to the model (`tool_choice: auto`,
    /// the default when a request has tools). iris always allows it; the flag is accepted so
    /// that vLLM command lines run unchanged.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// Split the model's thinking from its answer (vLLM's names): qwen3, glm45, deepseek_r1,
    /// gemma4. OpenAI replies carry it as `reasoning_content`, Anthropic ones as `thinking`
    /// blocks. Default: gemma4 for Gemma 4's chat template (its thought channel's markers are
    /// control tokens, so its replies cannot be read without it), else none.
    #[arg(long)]
    pub reasoning_parser: Option<String>,
    /// Require this key (`Authorization: Bearer KEY` or `x-api-key: KEY`) on the APIs.
    #[arg(long, env = "IRIS_API_KEY")]
    pub api_key: Option<String>,
    /// Most sequences waiting beyond --max-num-seqs; past that requests get 429.
    #[arg(long, default_value_t = 1024)]
    pub max_queue: usize,
    /// Largest request body accepted, in bytes (larger ones get 413).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Worker threads for HTTP handling (default: the number of cores, at least 2).
    #[arg(long)]
    pub http_threads: Option<usize>,
    /// Allow `file://` image URLs, but only for files under this directory.
    #[arg(long)]
    pub allowed_local_media_path: Option<std::path::PathBuf>,
    /// Fetch http(s) image URLs (OpenAI `image_url`, Anthropic `source.type = "url"`). Only
    /// public addresses are fetched: a URL or redirect whose host resolves to a loopback,
    /// private, link-local or other internal address gets 400.
    #[arg(long)]
    pub allow_remote_media: bool,
    /// With --allow-remote-media: seconds one image fetch may take, redirects included.
    #[arg(long, default_value_t = 10.0)]
    pub remote_media_timeout: f64,
    /// Largest encoded image accepted, in bytes (larger ones get 400; a download stops there).
    #[arg(long, default_value_t = 20 << 20)]
    pub max_image_bytes: usize,
    /// Largest image accepted, in pixels (width x height, read before decoding; larger: 400).
    #[arg(long, default_value_t = 8192 * 8192)]
    pub max_image_pixels: u64,
    /// Most connections open at once; one more gets 503 (with Retry-After) and is closed.
    #[arg(long, default_value_t = 1024)]
    pub max_connections: usize,
    /// Seconds a request head may take, from the connection opening or the previous
    /// response ending; a client that stalls in the middle of one is disconnected.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout: f64,
    /// Seconds a request body may take after its head (slower ones get 408).
    #[arg(long, default_value_t = 60.0)]
    pub body_read_timeout: f64,
    /// Seconds an idle keep-alive connection stays open (uvicorn's and vLLM's default: 5).
    #[arg(long, default_value_t = 5.0)]
    pub timeout_keep_alive: f64,
    /// Seconds a request may run in all; past that it is cancelled (504, or an error event
    /// in a stream). Default: no limit.
    #[arg(long)]
    pub request_timeout: Option<f64>,
    /// `max_tokens` of a chat or Anthropic request that gives none (capped by the context;
    /// default: the rest of the context, as vLLM does). Completions default to 16.
    #[arg(long)]
    pub default_max_tokens: Option<usize>,
    /// Origins (`scheme://host[:port]`) whose browser pages may call the API, comma-separated
    /// or a JSON list (vLLM's form), `*` for any. Default: none; other cross-origin requests get 403.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Methods a CORS preflight may ask for (default `*`: any).
    #[arg(long, value_delimiter = ',', default_value = "*")]
    pub allowed_methods: Vec<String>,
    /// Request headers a CORS preflight may ask for (default `*`: any).
    #[arg(long, value_delimiter = ',', default_value = "*")]
    pub allowed_headers: Vec<String>,
    /// Let allowed origins send credentials (cookies, Authorization) from browsers.
    #[arg(long)]
    pub allowed_credentials: bool,
    /// Host names the `Host` header may carry (comma-separated, `*` for any); others get 403,
    /// which blocks DNS rebinding. Default: localhost, 127.0.0.1 and ::1 when bound to a
    /// loopback address, any otherwise.
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Most responses `/v1/responses` keeps in memory (with `store: true`, OpenAI's default)
    /// for `previous_response_id` and `GET /v1/responses/{id}`; past that the least recently
    /// used is dropped (its id is then a 404). 0 stores none.
    #[arg(long, default_value_t = 1024)]
    pub max_stored_responses: usize,
}

/// A flag's number of seconds: positive and finite.
fn seconds(flag: &str, v: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow::anyhow!("{flag} must be a positive number of seconds, got {v}"))
}

/// A flag's count: at least 1.
fn positive(flag: &str, v: usize) -> anyhow::Result<usize> {
    if v == 0 {
        anyhow::bail!("{flag} must be at least 1, got 0");
    }
    Ok(v)
}

/// A list flag given as a JSON list (`'["a","b"]'`, vLLM's form) or comma-separated.
fn list(values: &[String]) -> Vec<String> {
    let joined = values.join(",");
    if joined.trim_start().starts_with('[') {
        if let Ok(v) = serde_json::from_str::<Vec<String>>(&joined) {
            return v;
        }
    }
    values.iter().map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()
}

/// The settings `iris serve` checks before it binds: nonsense values fail at start.
fn check_flags(a: &ServeArgs) -> anyhow::Result<()> {
    positive("--max-body-bytes", a.max_body_bytes)?;
    positive("--max-connections", a.max_connections)?;
    positive("--max-image-bytes", a.max_image_bytes)?;
    positive("--max-num-seqs", a.engine.max_num_seqs)?;
    positive("--block-size", a.engine.block_size)?;
    positive("--max-num-batched-tokens", a.engine.max_num_batched_tokens)?;
    if let Some(m) = a.engine.max_model_len {
        positive("--max-model-len", m)?;
    }
    if let Some(t) = a.http_threads {
        positive("--http-threads", t)?;
    }
    if let Some(m) = a.default_max_tokens {
        positive("--default-max-tokens", m)?;
    }
    if a.max_image_pixels == 0 {
        anyhow::bail!("--max-image-pixels must be at least 1, got 0");
    }
    if !(a.shutdown_timeout.is_finite() && a.shutdown_timeout >= 0.0) {
        anyhow::bail!("--shutdown-timeout must be a number of seconds >= 0, got {}", a.shutdown_timeout);
    }
    seconds("--header-read-timeout", a.header_read_timeout)?;
    seconds("--body-read-timeout", a.body_read_timeout)?;
    seconds("--timeout-keep-alive", a.timeout_keep_alive)?;
    seconds("--remote-media-timeout", a.remote_media_timeout)?;
    if let Some(t) = a.request_timeout {
        seconds("--request-timeout", t)?;
    }
    for o in list(&a.allowed_origins) {
        if o != "*" && !(o.starts_with("http://") || o.starts_with("https://")) {
            anyhow::bail!("--allowed-origins: `{o}` is not an origin (scheme://host[:port]) or `*`");
        }
    }
    if a.port != 0 && a.host.trim().is_empty() {
        anyhow::bail!("--host must not be empty");
    }
    Ok(())
}

/// The `Host` names to accept: the flag's, else the loopback names on a loopback bind, else any.
fn allowed_hosts(a: &ServeArgs, bound: std::net::SocketAddr) -> Option<Vec<String>> {
    let given = list(&a.allowed_hosts);
    if !given.is_empty() {
        return Some(given);
    }
    bound.ip().is_loopback().then(|| crate::server::browser::LOOPBACK_HOSTS.iter().map(|h| h.to_string()).collect())
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    check_flags(&a)?;
    let threads =
        a.http_threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2).max(2));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("iris-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(serve(a))
}

async fn serve(a: ServeArgs) -> anyhow::Result<()> {
    // Resolve (and fetch: the default model, a Hugging Face id) before binding, so a bad path
    // fails fast.
    let model = tokio::task::spawn_blocking({
        let m = a.engine.model.clone();
        move || -> anyhow::Result<super::args::ResolvedModel> {
            let model = m.resolve()?;
            // Read the model's config now: a wrong --model fails before the server binds.
            crate::loader::read_config(&model.path).with_context(|| format!("--model {}", model.path.display()))?;
            Ok(model)
        }
    })
    .await??;
    let path = model.path;
    let device = a.engine.device()?;
    let fetch_timeout = seconds("--remote-media-timeout", a.remote_media_timeout)?;
    let mut opts = a.engine.options()?;
    opts.tokenizer = model.tokenizer;
    // A hub id is the name clients know the model by (as vLLM serves it).
    let name = a.served_model_name.first().cloned().or(model.hub_id).unwrap_or_else(|| default_name(&path));
    let parsers = ParserConfig {
        tool_format: a
            .tool_call_parser
            .as_deref()
            .map(|n| {
                ToolFormat::from_name(n).ok_or_else(|| {
                    anyhow::anyhow!("--tool-call-parser {n}: not one of {}", ToolFormat::NAMES.join(", "))
                })
            })
            .transpose()?,
        reasoning: a
            .reasoning_parser
            .as_deref()
            .map(|n| {
                ReasoningFormat::from_name(n).ok_or_else(|| {
                    anyhow::anyhow!("--reasoning-parser {n}: not one of {}", ReasoningFormat::NAMES.join(", "))
                })
            })
            .transpose()?,
    };
    let cfg = ServeConfig {
        served_model_name: name.clone(),
        aliases: a.served_model_name.iter().skip(1).cloned().collect(),
        parsers,
        model_path: a
            .engine
            .model
            .model
            .as_ref()
            .map(|p| p.display().to_string())
            .unwrap_or_else(|| path.display().to_string()),
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        max_body_bytes: a.max_body_bytes,
        shutdown_timeout: Duration::from_secs_f64(a.shutdown_timeout.max(0.0)),
        media: MediaPolicy {
            allowed_local_media_path: a
                .allowed_local_media_path
                .as_ref()
                .map(|d| d.canonicalize().with_context(|| format!("--allowed-local-media-path {}", d.display())))
                .transpose()?,
            remote: a.allow_remote_media.then(|| Arc::new(RemoteFetcher::new(fetch_timeout, a.max_image_bytes))),
            limits: DecodeLimits { max_bytes: a.max_image_bytes, max_pixels: a.max_image_pixels },
        },
        connections: ConnectionLimits {
            max_connections: a.max_connections,
            header_read_timeout: seconds("--header-read-timeout", a.header_read_timeout)?,
            body_read_timeout: seconds("--body-read-timeout", a.body_read_timeout)?,
            keep_alive_timeout: seconds("--timeout-keep-alive", a.timeout_keep_alive)?,
        },
        browser: BrowserPolicy {
            allowed_origins: list(&a.allowed_origins),
            allowed_methods: list(&a.allowed_methods),
            allowed_headers: list(&a.allowed_headers),
            allow_credentials: a.allowed_credentials,
            allowed_hosts: None,
        },
        max_stored_responses: a.max_stored_responses,
    };
    let limits = RequestLimits {
        default_max_tokens: a.default_max_tokens,
        request_timeout: a.request_timeout.map(|t| seconds("--request-timeout", t)).transpose()?,
        max_images: opts.image_limit,
    };
    let addr = format!("{}:{}", a.host, a.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
    let mut cfg = cfg;
    cfg.browser.allowed_hosts = allowed_hosts(&a, local);
    tracing::info!("listening on http://{local} (loading {}; /health answers 503 until it is ready)", path.display());
    let metrics = Arc::new(Metrics::new());
    let state = Arc::new(AppState::new(cfg, metrics.clone()));

    // Load on the engine thread while the listener already answers /health.
    let loader = {
        let state = state.clone();
        let path = path.clone();
        let max_queue = a.max_queue;
        tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
            let p = path.clone();
            let handle = server::spawn_engine(
                move || {
                    let (engine, report) =
                        build_engine(&p, &device, &opts).with_context(|| format!("cannot load {}", p.display()))?;
                    let cfg = engine.model().config();
                    tracing::info!(
                        "loaded {} ({}, {} layers, {}; CPU kernels: {})",
                        p.display(),
                        cfg.arch.name(),
                        cfg.num_layers,
                        report.weights.summary(),
                        crate::simd::Isa::active().name()
                    );
                    tracing::info!(
                        "{} ({} blocks of {} tokens); max model len {}",
                        report.kv_summary(),
                        engine.scheduler().allocator.num_blocks(),
                        engine.config().scheduler.block_size,
                        report.max_model_len
                    );
                    Ok(engine)
                },
                max_queue,
                metrics,
            )?;
            let mut handle = handle;
            handle.limits = limits;
            let info = handle.info.clone();
            let _ = state.engine.set(handle);
            tracing::info!(
                "serving `{}` at http://{local}/v1 (max-num-seqs {}, queue {}{})",
                state.cfg.served_model_name,
                info.max_num_seqs,
                max_queue,
                if state.cfg.api_key.is_some() { ", API key required" } else { "" }
            );
            Ok(())
        })
    };
    let server = server::serve(listener, state.clone());
    tokio::pin!(server);
    let mut loader = loader;
    tokio::select! {
        r = &mut server => return r,
        r = &mut loader => r??,
    }
    server.await
}

fn default_name(path: &std::path::Path) -> String {
    let stem = if path.is_dir() { path.file_name() } else { path.file_stem() };
    stem.map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string())
}
