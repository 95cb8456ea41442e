//! `iris serve`: the OpenAI- and Anthropic-compatible HTTP server.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use super::args::EngineArgs;
use crate::engine::build::build_engine;
use crate::media::remote::RemoteFetcher;
use crate::media::DecodeLimits;
use crate::server::images::MediaPolicy;
use crate::server::{self, AppState, Metrics, ServeConfig};

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
    /// Model name clients use in `model` (default: the model file or directory name).
    #[arg(long)]
    pub served_model_name: Option<String>,
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
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
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
    // Resolve (and fetch, for the default model) before binding, so a bad path fails fast.
    let path = tokio::task::spawn_blocking({
        let m = a.engine.model.clone();
        move || m.resolve()
    })
    .await??;
    let device = a.engine.device()?;
    let fetch_timeout = Duration::try_from_secs_f64(a.remote_media_timeout)
        .ok()
        .filter(|t| !t.is_zero())
        .ok_or_else(|| anyhow::anyhow!("--remote-media-timeout must be a positive number of seconds"))?;
    let opts = a.engine.options()?;
    let name = a.served_model_name.clone().unwrap_or_else(|| default_name(&path));
    let cfg = ServeConfig {
        served_model_name: name.clone(),
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
    };
    let addr = format!("{}:{}", a.host, a.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let local = listener.local_addr()?;
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
                        "loaded {} ({}, {} layers, {:.0} MB of weights; CPU kernels: {})",
                        p.display(),
                        cfg.arch.name(),
                        cfg.num_layers,
                        report.weight_bytes as f64 / 1e6,
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
