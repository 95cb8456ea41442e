//! The engine: owns the model and the KV memory, runs one scheduled step at a time.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::detokenizer::IncrementalDetokenizer;
use super::finish::FinishReason;
use super::multimodal::{EmbedCache, ImageInput, MultiModalState};
use super::request::{Request, RequestError, SeqUpdate};
use super::runner::{StepOutput, StepRunner};
use super::sampler::{draws_plainly, logprobs, Sampled};
use super::scheduler::{Plan, Scheduler, SchedulerConfig};
use super::sequence::{SeqId, Sequence};
use super::stop::StopChecker;
use crate::batch::{Batch, ImageRows, Positions, SeqSlice};
use crate::kv::KvCache;
use crate::media::PixelValues;
use crate::models::{TextModel, VisionModel};
use crate::ops::sample::Draw;
use crate::tokenizer::TextTokenizer;

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Longest sequence (prompt + output) accepted.
    pub max_model_len: usize,
}

/// Text-side state of a sequence: incremental detokenization and stop strings.
struct TextState {
    detok: IncrementalDetokenizer,
    stop: StopChecker,
}

/// Counters for metrics and logs.
#[derive(Debug, Default, Clone, Copy)]
pub struct EngineStats {
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
}

/// Default byte budget of the image-embedding cache.
const EMBED_CACHE_BYTES: usize = 256 << 20;

pub struct Engine {
    model: Box<dyn TextModel>,
    vision: Option<Arc<dyn VisionModel>>,
    embed_cache: EmbedCache,
    kv: KvCache,
    runner: StepRunner,
    scheduler: Scheduler,
    tokenizer: Arc<TextTokenizer>,
    text: HashMap<SeqId, TextState>,
    cfg: EngineConfig,
    next_id: u64,
    eos: Vec<u32>,
    pub stats: EngineStats,
}

impl Engine {
    pub fn new(
        model: Box<dyn TextModel>,
        kv: KvCache,
        tokenizer: Arc<TextTokenizer>,
        cfg: EngineConfig,
        device: Device,
    ) -> Self {
        let scheduler = Scheduler::new(cfg.scheduler, kv.spec().num_blocks);
        let mut eos: Vec<u32> = model.config().eos_token_ids.clone();
        for &id in tokenizer.eos_token_ids() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let max_blocks = cfg.max_model_len.div_ceil(cfg.scheduler.block_size);
        let max_positions = model.config().max_position_embeddings.min(crate::layers::rotary::MAX_TABLE_POSITIONS);
        let runner = StepRunner::new(device, cfg.scheduler.max_num_seqs, max_blocks, max_positions);
        Engine {
            model,
            vision: None,
            embed_cache: EmbedCache::new(EMBED_CACHE_BYTES),
            kv,
            runner,
            scheduler,
            tokenizer,
            text: HashMap::new(),
            cfg,
            next_id: 0,
            eos,
            stats: EngineStats::default(),
        }
    }

    /// Adds the vision tower of a vision-language model: requests may then carry images.
    pub fn with_vision(mut self, vision: Option<Arc<dyn VisionModel>>) -> Self {
        self.vision = vision;
        self
    }

    pub fn vision(&self) -> Option<&Arc<dyn VisionModel>> {
        self.vision.as_ref()
    }

    pub fn embed_cache(&self) -> &EmbedCache {
        &self.embed_cache
    }

    /// Forgets every cached image embedding (benchmarks time the vision tower with it).
    pub fn clear_embed_cache(&mut self) {
        self.embed_cache.clear();
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }

    pub fn model(&self) -> &dyn TextModel {
        self.model.as_ref()
    }

    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Queues a request; it joins the running batch at the next step that has room.
    pub fn add_request(&mut self, req: Request) -> Result<SeqId, RequestError> {
        self.add_request_with_images(req, Vec::new())
    }

    /// Queues a request with images. Its prompt holds, for each image in order, a run of the
    /// model's image token as long as the image's embedding (`VisionModel::num_image_tokens`).
    /// The sequence's three-axis positions are computed here, once.
    pub fn add_request_with_images(&mut self, req: Request, images: Vec<ImageInput>) -> Result<SeqId, RequestError> {
        let vocab = self.model.config().vocab_size;
        if req.prompt_tokens.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        if req.prompt_tokens.len() >= self.cfg.max_model_len {
            return Err(RequestError::PromptTooLong { prompt: req.prompt_tokens.len(), max: self.cfg.max_model_len });
        }
        if let Some(&id) = req.prompt_tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(RequestError::BadToken { id, vocab });
        }
        req.params.validate(vocab).map_err(|e| RequestError::BadParams(e.to_string()))?;
        let mm = match (&self.vision, images.is_empty()) {
            (None, true) => None,
            (None, false) => return Err(RequestError::BadImages("this model does not take images".into())),
            (Some(v), true) if req.prompt_tokens.contains(&v.image_token_id()) => {
                return Err(RequestError::BadImages("the prompt has image tokens but the request has no images".into()))
            }
            (Some(_), true) => None,
            (Some(v), false) => {
                let pixels: Vec<&PixelValues> = images.iter().map(|i| i.pixels.as_ref()).collect();
                let positions = v
                    .prompt_positions(&req.prompt_tokens, &pixels)
                    .map_err(|e| RequestError::BadImages(e.to_string()))?;
                let image_token = v.image_token_id();
                let image_rows: Vec<usize> =
                    req.prompt_tokens.iter().enumerate().filter(|(_, &t)| t == image_token).map(|(i, _)| i).collect();
                if image_rows.len() != pixels.iter().map(|p| v.num_image_tokens(p)).sum::<usize>() {
                    return Err(RequestError::BadImages("the prompt's image tokens do not match its images".into()));
                }
                Some(Box::new(MultiModalState { images, positions, image_rows, embeds: None }))
            }
        };
        let id = self.admit(req)?;
        self.scheduler.get_mut(id).expect("admitted sequence exists").mm = mm;
        Ok(id)
    }

    fn admit(&mut self, req: Request) -> Result<SeqId, RequestError> {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        let detok = IncrementalDetokenizer::new(
            self.tokenizer.inner().clone(),
            &req.prompt_tokens,
            req.params.skip_special_tokens,
        )
        .map_err(|e| RequestError::BadParams(e.to_string()))?;
        let stop = StopChecker::new(&req.params.stop);
        self.text.insert(id, TextState { detok, stop });
        self.scheduler.add(Sequence::new(id, req.prompt_tokens, req.params, self.eos.clone()));
        Ok(id)
    }

    /// Ends a sequence now (client gone, cancelled); its blocks are free for the next step.
    pub fn abort(&mut self, id: SeqId) -> bool {
        self.text.remove(&id);
        self.scheduler.remove(id).is_some()
    }

    /// Runs one step: schedule, run the model on the flat batch, sample, detokenize.
    pub fn step(&mut self) -> candle_core::Result<Vec<SeqUpdate>> {
        // Run the step on a worker of the compute pool: the kernels' parallel loops then
        // start from inside the pool (the caller works too) instead of waking every worker
        // from outside for each of the ~200 parallel regions of a decode step. A GPU step has
        // no such loops, and handing it to a (possibly sleeping) worker costs it time.
        if rayon::current_thread_index().is_some() || !self.runner.device().is_cpu() {
            return self.step_inner();
        }
        // From outside the pool, `rayon::scope` runs its body on a pool worker.
        rayon::scope(|_| self.step_inner())
    }

    fn step_inner(&mut self) -> candle_core::Result<Vec<SeqUpdate>> {
        let plan = self.scheduler.schedule();
        self.stats.preemptions += plan.preempted.len() as u64;
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        self.stats.steps += 1;
        self.encode_images(&plan)?;
        let (batch, sample_rows) = self.build_batch(&plan)?;
        let rows: Vec<u32> = sample_rows.iter().map(|(_, r)| *r as u32).collect();
        let out = if self.needs_plain_forward(&plan, &batch) {
            let hidden = self.runner.forward(self.model.as_ref(), &self.kv, batch)?;
            self.record_prompt_logprobs(&plan, &hidden)?;
            self.runner.logits(self.model.as_ref(), &hidden, &rows)?
        } else {
            let draws = self.device_draws(&sample_rows);
            self.runner.run(self.model.as_ref(), &self.kv, batch, &rows, draws.as_deref())?
        };
        let mut updates = Vec::new();
        // Advance what was computed before sampling, whatever happens next.
        for &(id, n) in &plan.items {
            if let Some(seq) = self.scheduler.get_mut(id) {
                seq.num_computed += n;
                if seq.output.is_empty() {
                    self.stats.prompt_tokens += n as u64;
                }
            }
        }
        if sample_rows.is_empty() {
            return Ok(updates);
        }
        let sampled = match out {
            StepOutput::Logits(mut logits) => self.sample(&sample_rows, &mut logits),
            StepOutput::Tokens(tokens) => tokens.into_iter().map(Sampled::token_only).collect(),
        };
        for ((id, _), tok) in sample_rows.iter().zip(sampled) {
            updates.push(self.append_token(*id, tok));
        }
        Ok(updates)
    }

    /// On a GPU, when every sampled row draws from its logits as they are, each row's draw, for
    /// the device to pick the tokens (only their ids are copied back); None otherwise (the
    /// logits come to the host). Takes from each row's generator what host sampling would.
    /// `IRIS_DEVICE_SAMPLING=0` sends every step's logits to the host (for comparisons).
    fn device_draws(&mut self, sample_rows: &[(SeqId, usize)]) -> Option<Vec<Draw>> {
        if self.runner.device().is_cpu() || !crate::switches::switched_on!("IRIS_DEVICE_SAMPLING") {
            return None;
        }
        let plain = |id: &SeqId| self.scheduler.get(*id).is_some_and(|s| draws_plainly(&s.params, s.output.len()));
        if !sample_rows.iter().all(|(id, _)| plain(id)) {
            return None;
        }
        sample_rows
            .iter()
            .map(|(id, _)| self.scheduler.get_mut(*id).map(|s| s.sampler.device_draw(&s.params)))
            .collect()
    }

    /// Runs the vision tower for scheduled sequences whose images have no embeddings yet
    /// (each image on its own, so its embeddings do not depend on the batch).
    fn encode_images(&mut self, plan: &Plan) -> candle_core::Result<()> {
        let Some(vision) = self.vision.clone() else { return Ok(()) };
        for &(id, _) in &plan.items {
            let Some(seq) = self.scheduler.get_mut(id) else { continue };
            let Some(mm) = seq.mm.as_mut() else { continue };
            if mm.embeds.is_some() {
                continue;
            }
            let mut parts = Vec::with_capacity(mm.images.len());
            for img in &mm.images {
                let e = match self.embed_cache.get(&img.key) {
                    Some(e) => e,
                    None => {
                        let e = vision.encode(&img.pixels)?;
                        self.embed_cache.insert(img.key, e.clone());
                        e
                    }
                };
                parts.push(e);
            }
            mm.embeds = Some(Tensor::cat(&parts, 0)?);
            // The embeddings outlive preemption; the pixels are not needed any more.
            mm.images.clear();
        }
        Ok(())
    }

    /// Steps the runner's fast paths (CUDA graphs, argmax on the device) do not cover go through
    /// the model's plain forward pass: those with images or three-axis positions, and those in
    /// which a sequence asks for prompt logprobs (which read the prefill rows' hidden states).
    fn needs_plain_forward(&self, plan: &Plan, batch: &Batch) -> bool {
        batch.images.is_some()
            || matches!(batch.positions, Positions::MRope(_))
            || plan
                .items
                .iter()
                .any(|(id, _)| self.scheduler.get(*id).is_some_and(|s| s.params.prompt_logprobs.is_some()))
    }

    /// Flattens the plan into one batch on the host (the runner moves it to the device);
    /// returns which rows need next-token logits.
    fn build_batch(&self, plan: &Plan) -> candle_core::Result<(Batch, Vec<(SeqId, usize)>)> {
        let mut tokens = Vec::with_capacity(plan.num_tokens());
        let mut slices = Vec::with_capacity(plan.items.len());
        let mut sample_rows = Vec::new();
        // Per-sequence positions: three-axis once any sequence in the step has images.
        let mrope = plan.items.iter().any(|(id, _)| self.scheduler.get(*id).is_some_and(|s| s.mm.is_some()));
        let mut flat = Vec::new();
        let mut axes = Vec::new();
        let (mut image_rows, mut image_embeds) = (Vec::new(), Vec::new());
        for &(id, n) in &plan.items {
            let seq = self.scheduler.get(id).expect("scheduled sequence exists");
            let q_start = tokens.len();
            let range = seq.num_computed..seq.num_computed + n;
            tokens.extend(range.clone().map(|i| seq.token(i)));
            match (&seq.mm, mrope) {
                (Some(mm), _) => {
                    axes.extend(range.clone().map(|i| mm.position(i)));
                    let ks = mm.embed_rows_in(range.clone());
                    if !ks.is_empty() {
                        let embeds = mm.embeds.as_ref().expect("images encoded before the batch is built");
                        image_rows.extend(ks.clone().map(|k| (q_start + mm.image_rows[k] - range.start) as u32));
                        image_embeds.push(embeds.narrow(0, ks.start, ks.len())?);
                    }
                }
                (None, true) => axes.extend(range.clone().map(|i| [i as u32; 3])),
                (None, false) => flat.extend(range.clone().map(|i| i as u32)),
            }
            slices.push(SeqSlice {
                q_start,
                q_len: n,
                context_len: seq.num_computed + n,
                block_table: seq.block_table.ids(),
            });
            if seq.num_computed + n == seq.num_tokens() {
                sample_rows.push((id, q_start + n - 1));
            }
        }
        let positions = if mrope { Positions::MRope(axes) } else { Positions::Flat(flat) };
        let images = if image_rows.is_empty() {
            None
        } else {
            Some(ImageRows::new(&image_rows, Tensor::cat(&image_embeds, 0)?, tokens.len())?)
        };
        let block_size = self.scheduler.config().block_size;
        let mut batch = Batch::new(&Device::Cpu, block_size, slices, &tokens, positions, images)?;
        if let Some(len) = self.kv.turboquant().map(|t| t.float_window).filter(|&w| w > 0) {
            let rings = plan
                .items
                .iter()
                .map(|&(id, _)| self.scheduler.get(id).and_then(|s| s.window_ring))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| candle_core::Error::Msg("a scheduled sequence holds no window ring".into()))?;
            batch.attn.set_float_window(len, rings)?;
        }
        Ok((batch, sample_rows))
    }

    /// vLLM's `prompt_logprobs`: for each sequence that asks, the rows of this step's chunk
    /// whose next token is still a prompt token give that token's logprob under the raw model.
    /// Their logits are computed apart from the sampled rows' (which stay exactly as without
    /// this feature), a bounded number of rows at a time. A chunk recomputed after preemption
    /// adds nothing: its entries are already there.
    fn record_prompt_logprobs(&mut self, plan: &Plan, hidden: &Tensor) -> candle_core::Result<()> {
        /// Most rows of vocabulary-wide logits held at once.
        const ROWS_AT_ONCE: usize = 256;
        let mut rows: Vec<(SeqId, u32, u32)> = Vec::new(); // (sequence, batch row, next prompt token)
        let mut q_start = 0;
        for &(id, n) in &plan.items {
            let seq = self.scheduler.get(id).expect("scheduled sequence exists");
            if seq.params.prompt_logprobs.is_some() {
                // Position p predicts prompt token p + 1; entries before `done` exist already.
                let done = seq.prompt_logprobs.len();
                let end = (seq.num_computed + n).min(seq.prompt.len().saturating_sub(1));
                for p in seq.num_computed.max(done)..end {
                    rows.push((id, (q_start + p - seq.num_computed) as u32, seq.prompt[p + 1]));
                }
            }
            q_start += n;
        }
        for chunk in rows.chunks(ROWS_AT_ONCE) {
            let idx: Vec<u32> = chunk.iter().map(|r| r.1).collect();
            let idx = Tensor::new(idx.as_slice(), hidden.device())?;
            let logits: Vec<Vec<f32>> = self.model.logits(&hidden.index_select(&idx, 0)?)?.to_vec2()?;
            for (&(id, _, next), l) in chunk.iter().zip(&logits) {
                let seq = self.scheduler.get_mut(id).expect("scheduled sequence exists");
                let (logprob, top_logprobs) = logprobs(l, next, seq.params.prompt_logprobs.unwrap_or(0));
                seq.prompt_logprobs.push(Sampled { token: next, logprob, top_logprobs });
            }
        }
        Ok(())
    }

    fn sample(&mut self, rows: &[(SeqId, usize)], logits: &mut [Vec<f32>]) -> Vec<Sampled> {
        // Each sequence samples with its own RNG, so results do not depend on the batch.
        rows.iter()
            .zip(logits.iter_mut())
            .map(|((id, _), l)| {
                let seq = self.scheduler.get_mut(*id).expect("sampled sequence exists");
                let (prompt, output) = (&seq.prompt, &seq.output);
                seq.sampler.sample(l, &seq.params, prompt, output)
            })
            .collect()
    }

    fn append_token(&mut self, id: SeqId, tok: Sampled) -> SeqUpdate {
        let seq = self.scheduler.get_mut(id).expect("sampled sequence exists");
        seq.output.push(tok.token);
        self.stats.generated_tokens += 1;
        let p = &seq.params;
        let n_out = seq.output.len();
        let prompt_logprobs =
            (n_out == 1 && p.prompt_logprobs.is_some()).then(|| std::mem::take(&mut seq.prompt_logprobs));
        let state = self.text.get_mut(&id).expect("text state exists");
        // The sampler keeps EOS and stop ids out until min_tokens, so any here are final.
        let ends = (!p.ignore_eos && self.eos.contains(&tok.token)) || p.stop_token_ids.contains(&tok.token);
        let mut finish = None;
        let mut text = String::new();
        if ends {
            finish = Some(FinishReason::Stop);
        } else {
            let delta = match state.detok.push(tok.token) {
                Ok(d) => d,
                Err(e) => {
                    finish = Some(FinishReason::Error(e.to_string()));
                    String::new()
                }
            };
            let out = state.stop.push(&delta);
            text = out.emit;
            if out.stopped.is_some() && n_out > p.min_tokens {
                // Text after the stop string is dropped, as OpenAI does.
                return self.finish(id, tok, text, FinishReason::Stop, prompt_logprobs);
            }
        }
        if finish.is_none() && (n_out >= p.max_tokens || seq.num_tokens() >= self.cfg.max_model_len) {
            finish = Some(FinishReason::Length);
        }
        match finish {
            Some(reason) => {
                // Release text held back for a character or stop string that never completed.
                let tail = state.detok.finish().unwrap_or_default();
                text.push_str(&state.stop.push(&tail).emit);
                text.push_str(&state.stop.flush());
                self.finish(id, tok, text, reason, prompt_logprobs)
            }
            None => SeqUpdate {
                id,
                token: Some(tok),
                text,
                finish: None,
                prompt_logprobs,
                num_prompt_tokens: seq.prompt.len(),
                num_output_tokens: n_out,
            },
        }
    }

    fn finish(
        &mut self,
        id: SeqId,
        tok: Sampled,
        text: String,
        reason: FinishReason,
        prompt_logprobs: Option<Vec<Sampled>>,
    ) -> SeqUpdate {
        self.text.remove(&id);
        let seq = self.scheduler.remove(id).expect("finishing sequence exists");
        SeqUpdate {
            id,
            token: Some(tok),
            text,
            finish: Some(reason),
            prompt_logprobs,
            num_prompt_tokens: seq.prompt.len(),
            num_output_tokens: seq.output.len(),
        }
    }
}
