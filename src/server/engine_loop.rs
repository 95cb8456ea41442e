//! The engine thread and the handle HTTP handlers use to talk to it.
//!
//! One thread owns the [`Engine`]. Handlers send it commands over a channel ([`Command`]) and
//! get each request's updates back on a channel of their own. The thread blocks while it has
//! nothing to do; otherwise it drains new commands, drops sequences whose receiver is gone
//! (the client disconnected: their KV blocks are free for the very next step), runs one step
//! and routes the updates. No lock is ever held around model state.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::metrics::Metrics;
use crate::engine::{
    Engine, FinishReason, GrammarCompiler, GrammarError, ImageInput, Request, RequestError, SeqId, SeqUpdate,
};
use crate::models::VisionModel;
use crate::tokenizer::TextTokenizer;

/// What the engine thread tells a request about one of its sequences (`index` is the
/// sequence's place in the request: choice index for `n > 1`, prompt index for batches).
#[derive(Debug)]
pub struct SeqEvent {
    pub index: usize,
    pub kind: SeqEventKind,
}

#[derive(Debug)]
pub enum SeqEventKind {
    /// The engine refused the sequence (the handler validates first, so this is rare).
    Rejected(RequestError),
    Update(SeqUpdate),
    /// Ended by the engine without a token: server shutdown or a failed step.
    Ended(FinishReason),
}

pub enum Command {
    Add {
        index: usize,
        request: Box<Request>,
        /// Preprocessed images whose tokens the prompt holds (vision-language models).
        images: Vec<ImageInput>,
        events: UnboundedSender<SeqEvent>,
    },
    /// Cancel everything (shutdown deadline passed); the reply says how many sequences were
    /// cancelled.
    AbortAll { reply: tokio::sync::oneshot::Sender<usize> },
}

/// Facts about the loaded engine that handlers need.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub max_model_len: usize,
    pub vocab_size: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub eos_token_ids: Vec<u32>,
}

/// Why a submission was refused before it reached the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitError {
    /// Running plus queued sequences would exceed the limit.
    QueueFull { limit: usize },
    /// The engine thread is gone (shutdown or crash).
    EngineGone,
    /// More sequences than running plus queued can ever hold: waiting would not help.
    NeverFits { asked: usize, limit: usize },
}

/// Server-side limits applied to each request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestLimits {
    /// `max_tokens` of a request that gives none (else the rest of the context).
    pub default_max_tokens: Option<usize>,
    /// A request still running this long after submission is cancelled.
    pub request_timeout: Option<std::time::Duration>,
    /// Most images one request may carry (`--limit-mm-per-prompt`).
    pub max_images: Option<usize>,
}

/// Cheap to clone; every handler holds one.
#[derive(Clone)]
pub struct EngineHandle {
    pub limits: RequestLimits,
    commands: Sender<Command>,
    in_flight: Arc<AtomicUsize>,
    /// Most sequences running or queued at once (max-num-seqs + max-queue).
    limit: usize,
    pub info: Arc<EngineInfo>,
    pub tokenizer: Arc<TextTokenizer>,
    /// The vision tower's preprocessing (and token counts) for requests with images.
    pub vision: Option<Arc<dyn VisionModel>>,
    /// False once the engine thread has ended (it panicked, or every handle was dropped).
    alive: Arc<AtomicBool>,
    /// Structured outputs' grammar compiler, built at the first request that needs one (its
    /// vocabulary trie costs a pass over the tokenizer, which other servers need not pay).
    grammar: Arc<OnceLock<Result<Arc<GrammarCompiler>, GrammarError>>>,
}

/// Clears the liveness flag when the engine thread ends, by return or by panic.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// A request's sequences inside the engine. Dropping it (the client went away, the handler
/// finished) releases the queue slots; the engine thread notices the closed channel and
/// aborts whatever is still running before its next step.
pub struct Submission {
    pub events: UnboundedReceiver<SeqEvent>,
    /// How long the request may run (`--request-timeout`).
    pub deadline: Option<std::time::Duration>,
    _slots: Slots,
}

struct Slots {
    counter: Arc<AtomicUsize>,
    n: usize,
}

impl Drop for Slots {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.n, Ordering::SeqCst);
    }
}

impl EngineHandle {
    /// The grammar compiler for this model (built once, on first use).
    pub fn grammar_compiler(&self) -> Result<Arc<GrammarCompiler>, GrammarError> {
        self.grammar
            .get_or_init(|| {
                GrammarCompiler::new(self.tokenizer.inner(), self.info.vocab_size, &self.info.eos_token_ids)
                    .map(Arc::new)
            })
            .clone()
    }

    /// Submits the sequences of one HTTP request; their events arrive on one channel.
    pub fn submit(&self, requests: Vec<Request>) -> Result<Submission, SubmitError> {
        self.submit_with_images(requests, Vec::new())
    }

    /// Like [`Self::submit`]; every sequence gets the same images.
    pub fn submit_with_images(
        &self,
        requests: Vec<Request>,
        images: Vec<ImageInput>,
    ) -> Result<Submission, SubmitError> {
        let n = requests.len();
        if n > self.limit {
            return Err(SubmitError::NeverFits { asked: n, limit: self.limit });
        }
        let mut cur = self.in_flight.load(Ordering::SeqCst);
        loop {
            if cur + n > self.limit {
                return Err(SubmitError::QueueFull { limit: self.limit });
            }
            match self.in_flight.compare_exchange(cur, cur + n, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        let slots = Slots { counter: self.in_flight.clone(), n };
        let (tx, rx) = unbounded_channel();
        for (index, request) in requests.into_iter().enumerate() {
            self.commands
                .send(Command::Add { index, request: Box::new(request), images: images.clone(), events: tx.clone() })
                .map_err(|_| SubmitError::EngineGone)?;
        }
        Ok(Submission { events: rx, deadline: self.limits.request_timeout, _slots: slots })
    }

    /// Cancels every sequence; returns how many the engine really cancelled.
    pub async fn abort_all(&self) -> usize {
        let (reply, rx) = tokio::sync::oneshot::channel();
        if self.commands.send(Command::AbortAll { reply }).is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }

    /// Most sequences running or queued at once (--max-num-seqs + --max-queue).
    pub fn limit(&self) -> usize {
        self.limit
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

/// Per-sequence bookkeeping on the engine thread.
struct Entry {
    index: usize,
    events: UnboundedSender<SeqEvent>,
    last_token: Option<Instant>,
    arrival: Instant,
}

/// Starts the engine thread around an engine built by `build` (on that thread, so the
/// model never has to move between threads). Returns once the engine is built.
pub fn spawn_engine<F>(build: F, max_queue: usize, metrics: Arc<Metrics>) -> anyhow::Result<EngineHandle>
where
    F: FnOnce() -> anyhow::Result<Engine> + Send + 'static,
{
    let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded::<Command>();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let alive = Arc::new(AtomicBool::new(true));
    let guard = AliveGuard(alive.clone());
    std::thread::Builder::new().name("iris-engine".into()).spawn(move || {
        let _guard = guard;
        let engine = match build() {
            Ok(e) => e,
            Err(e) => {
                let _ = ready_tx.send(Err(e));
                return;
            }
        };
        let cfg = engine.config();
        let info = EngineInfo {
            max_model_len: cfg.max_model_len,
            vocab_size: engine.model().config().vocab_size,
            num_blocks: engine.scheduler().allocator.num_blocks(),
            block_size: cfg.scheduler.block_size,
            max_num_seqs: cfg.scheduler.max_num_seqs,
            eos_token_ids: engine.eos_token_ids(),
        };
        let _ = ready_tx.send(Ok((info, engine.tokenizer().clone(), engine.vision().cloned())));
        run_loop(engine, cmd_rx, &metrics);
    })?;
    let (info, tokenizer, vision) =
        ready_rx.recv().map_err(|_| anyhow::anyhow!("the engine thread died while loading"))??;
    let limit = info.max_num_seqs + max_queue;
    Ok(EngineHandle {
        limits: RequestLimits::default(),
        commands: cmd_tx,
        in_flight: Arc::new(AtomicUsize::new(0)),
        limit,
        info: Arc::new(info),
        tokenizer,
        vision,
        alive,
        grammar: Arc::new(OnceLock::new()),
    })
}

fn run_loop(mut engine: Engine, commands: Receiver<Command>, metrics: &Metrics) {
    let mut entries: HashMap<SeqId, Entry> = HashMap::new();
    let mut disconnected = false;
    loop {
        // Block while idle; otherwise take whatever arrived since the last step.
        if !engine.has_work() {
            publish_gauges(&engine, metrics);
            match commands.recv() {
                Ok(cmd) => handle_command(&mut engine, &mut entries, cmd, metrics),
                Err(_) => return, // every handle dropped: the server is gone
            }
        }
        while !disconnected {
            match commands.try_recv() {
                Ok(cmd) => handle_command(&mut engine, &mut entries, cmd, metrics),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => disconnected = true,
            }
        }
        // Clients that went away: free their sequences before this step is planned.
        let gone: Vec<SeqId> = entries.iter().filter(|(_, e)| e.events.is_closed()).map(|(id, _)| *id).collect();
        for id in gone {
            engine.abort(id);
            entries.remove(&id);
            metrics.record_finish("abort");
            tracing::debug!("{id}: client gone, aborted");
        }
        if !engine.has_work() {
            // Nothing left in the engine: any entry left is stale (cannot happen, but a
            // client must never wait forever).
            for (_, entry) in entries.drain() {
                let reason = FinishReason::Error("the sequence was lost".into());
                let _ = entry.events.send(SeqEvent { index: entry.index, kind: SeqEventKind::Ended(reason) });
            }
            if disconnected {
                return;
            }
            continue;
        }
        match engine.step() {
            Ok(updates) => {
                // Gauges first: a client that has its answer must find /metrics already
                // counting its sequence as finished.
                publish_gauges(&engine, metrics);
                let now = Instant::now();
                for u in updates {
                    route(&mut entries, u, now, metrics);
                }
            }
            Err(e) => {
                // The step failed as a whole: end every sequence with an error rather than
                // leave clients waiting on a state we can no longer trust.
                tracing::error!("engine step failed: {e}");
                let ids: Vec<SeqId> = entries.keys().copied().collect();
                for id in ids {
                    engine.abort(id);
                    if let Some(entry) = entries.remove(&id) {
                        let reason = FinishReason::Error(format!("engine step failed: {e}"));
                        let _ = entry.events.send(SeqEvent { index: entry.index, kind: SeqEventKind::Ended(reason) });
                        metrics.record_finish("error");
                    }
                }
                publish_gauges(&engine, metrics);
            }
        }
    }
}

fn handle_command(engine: &mut Engine, entries: &mut HashMap<SeqId, Entry>, cmd: Command, metrics: &Metrics) {
    match cmd {
        Command::Add { index, request, images, events } => {
            if events.is_closed() {
                // Gone before it was admitted: still a cancellation the metrics count.
                metrics.record_finish("abort");
                return;
            }
            match engine.add_request_with_images(*request, images) {
                Ok(id) => {
                    entries.insert(id, Entry { index, events, last_token: None, arrival: Instant::now() });
                }
                Err(e) => {
                    let _ = events.send(SeqEvent { index, kind: SeqEventKind::Rejected(e) });
                }
            }
        }
        Command::AbortAll { reply } => {
            let ids: Vec<SeqId> = entries.keys().copied().collect();
            let _ = reply.send(ids.len());
            for id in ids {
                engine.abort(id);
                if let Some(entry) = entries.remove(&id) {
                    let _ = entry
                        .events
                        .send(SeqEvent { index: entry.index, kind: SeqEventKind::Ended(FinishReason::Cancelled) });
                    metrics.record_finish("abort");
                }
            }
        }
    }
}

fn route(entries: &mut HashMap<SeqId, Entry>, u: SeqUpdate, now: Instant, metrics: &Metrics) {
    let Some(entry) = entries.get_mut(&u.id) else { return };
    if u.token.is_some() {
        metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
        match entry.last_token {
            None => metrics.ttft.observe((now - entry.arrival).as_secs_f64()),
            Some(t) => metrics.itl.observe((now - t).as_secs_f64()),
        }
        entry.last_token = Some(now);
    }
    let finished = u.finish.clone();
    let id = u.id;
    let index = entry.index;
    let num_prompt = u.num_prompt_tokens;
    // A closed receiver is noticed (and the sequence aborted) before the next step.
    let _ = entry.events.send(SeqEvent { index, kind: SeqEventKind::Update(u) });
    if let Some(reason) = finished {
        if let Some(entry) = entries.remove(&id) {
            metrics.prompt_tokens.fetch_add(num_prompt as u64, Ordering::Relaxed);
            metrics.e2e.observe((now - entry.arrival).as_secs_f64());
        }
        metrics.record_finish(reason.as_openai_str());
    }
}

fn publish_gauges(engine: &Engine, metrics: &Metrics) {
    let s = engine.scheduler();
    metrics.running.store(s.num_running(), Ordering::Relaxed);
    metrics.waiting.store(s.num_waiting(), Ordering::Relaxed);
    metrics.kv_used.store(s.allocator.num_used(), Ordering::Relaxed);
    metrics.kv_free.store(s.allocator.num_free(), Ordering::Relaxed);
    metrics.preemptions.store(engine.stats.preemptions as usize, Ordering::Relaxed);
    *metrics.prefix.lock().unwrap_or_else(|p| p.into_inner()) = engine.stats.prefix;
    if engine.config().speculative.is_some() {
        *metrics.spec.lock().unwrap_or_else(|p| p.into_inner()) = engine.stats.spec.clone();
    }
}
