//! The engine: owns the model and the KV memory, runs one scheduled step at a time.

use std::sync::Arc;

use candle_core::Device;

use super::detokenizer::IncrementalDetokenizer;
use super::model_drafter::{DraftInput, ModelDrafter};
use super::mtp_drafter;
use super::multimodal::{EmbedCache, ImageInput, MultiModalState};
use super::output::{EngineStats, OutputProcessor};
use super::prefix::PrefixHasher;
use super::request::{Request, RequestError, SeqUpdate};
use super::runner::ModelRunner;
use super::sampler::DraftDist;
use super::scheduler::SchedulerOutput;
use super::scheduler::{Scheduler, SchedulerConfig};
use super::sequence::{SeqId, Sequence, TextState};
use super::spec_governor::SpecGovernor;
use super::speculative::{Drafter, NgramDrafter, SpeculativeConfig};
use super::stop::StopChecker;
use crate::kv::prefix_cache::root_hash;
use crate::kv::KvCache;
use crate::media::PixelValues;
use crate::models::{TextModel, VisionModel};
use crate::tokenizer::TextTokenizer;

#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Longest sequence (prompt + output) accepted.
    pub max_model_len: usize,
    /// Speculative decoding (None: one token per sequence and step).
    pub speculative: Option<SpeculativeConfig>,
    /// Automatic prefix caching: full blocks stay cached by content and are shared by
    /// sequences whose prompts start with them (`engine::prefix`). The builder turns it off
    /// for models and caches it cannot serve exactly.
    pub prefix_caching: bool,
}

/// Owns the model and the KV memory; each step is the scheduler's plan, the runner's pass
/// over it, and the output processor's bookkeeping.
pub struct Engine {
    model: Box<dyn TextModel>,
    kv: KvCache,
    scheduler: Scheduler,
    runner: ModelRunner,
    output: OutputProcessor,
    tokenizer: Arc<TextTokenizer>,
    cfg: EngineConfig,
    next_id: u64,
    /// Drafts from a model reading the target's state (else the output processor's drafter).
    model_drafter: Option<ModelDrafter>,
    /// Drafts from the target's own MTP head (`mtp_drafter`).
    mtp: bool,
    /// With adaptive speculation: whether drafts pay at the batch running (`spec_governor`).
    governor: Option<SpecGovernor>,
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
        // The model's whole configuration names it: a cached block is only ever read by the
        // model that wrote it (one per engine), this keeps the names honest regardless.
        let prefix = cfg.prefix_caching.then(|| {
            let model_id = format!("{:?}", model.config());
            PrefixHasher::new(root_hash(kv.spec(), kv.turboquant(), &model_id), cfg.scheduler.block_size)
        });
        let scheduler = Scheduler::new(cfg.scheduler, kv.spec().num_blocks, prefix);
        let eos = all_eos_ids(model.as_ref(), &tokenizer);
        let max_blocks = cfg.max_model_len.div_ceil(cfg.scheduler.block_size);
        let max_positions = model.config().max_position_embeddings.min(crate::layers::rotary::MAX_TABLE_POSITIONS);
        let max_drafts = cfg.speculative.map_or(0, |s| s.num_tokens);
        let mut runner =
            ModelRunner::new(device, cfg.scheduler.max_num_seqs, max_blocks, max_positions, 1 + max_drafts);
        if !model.graph_capturable() {
            runner.without_graphs();
        }
        let drafter = cfg.speculative.map(|s| Drafter::Ngram(NgramDrafter::new(s)));
        let output = OutputProcessor::new(eos, cfg.max_model_len, drafter, max_drafts);
        Engine {
            model,
            kv,
            scheduler,
            runner,
            output,
            tokenizer,
            cfg,
            next_id: 0,
            model_drafter: None,
            mtp: false,
            governor: cfg.speculative.filter(|s| s.adaptive).map(|_| SpecGovernor::default()),
            stats: EngineStats::default(),
        }
    }

    /// Replaces the drafter of an engine built with speculative decoding (benchmarks use a
    /// `ReplayDrafter`); drafts are bounded by its `num_speculative_tokens` still.
    pub fn set_drafter(&mut self, drafter: Drafter) -> Result<(), super::speculative::SpeculativeConfigError> {
        match self.cfg.speculative {
            Some(_) => {
                self.output.set_drafter(drafter);
                Ok(())
            }
            None => Err(super::speculative::SpeculativeConfigError::NotEnabled),
        }
    }

    /// Drafts with a model that reads the target's hidden rows and caches (in place of the
    /// n-gram drafter); needs speculative decoding on (its `num_speculative_tokens` bounds it).
    pub fn set_model_drafter(
        &mut self,
        drafter: ModelDrafter,
    ) -> Result<(), super::speculative::SpeculativeConfigError> {
        if self.cfg.speculative.is_none() {
            return Err(super::speculative::SpeculativeConfigError::NotEnabled);
        }
        self.output.clear_drafter();
        self.runner.keep_hidden = true;
        self.model_drafter = Some(drafter);
        Ok(())
    }

    /// Drafts with the target's MTP head (the model must have been loaded with one); needs
    /// speculative decoding on (its `num_speculative_tokens` bounds the drafts).
    pub fn set_mtp_drafter(&mut self) -> Result<(), super::speculative::SpeculativeConfigError> {
        if self.cfg.speculative.is_none() {
            return Err(super::speculative::SpeculativeConfigError::NotEnabled);
        }
        self.output.clear_drafter();
        self.runner.keep_all_hidden = true;
        self.mtp = true;
        Ok(())
    }

    /// Benchmarks only: every draft counts as accepted (the token after them is the target's
    /// own from the row that rejected, so the output is not the model's; each step then
    /// verifies all its drafts, which measures what that costs and gives at best).
    pub fn accept_all_drafts(&mut self, on: bool) {
        self.runner.accept_all_drafts = on;
    }

    /// Adds the vision tower of a vision-language model: requests may then carry images.
    pub fn with_vision(mut self, vision: Option<Arc<dyn VisionModel>>) -> Self {
        self.runner.set_vision(vision);
        self
    }

    pub fn vision(&self) -> Option<&Arc<dyn VisionModel>> {
        self.runner.vision()
    }

    pub fn embed_cache(&self) -> &EmbedCache {
        self.runner.embed_cache()
    }

    /// Forgets every cached image embedding (benchmarks time the vision tower with it).
    pub fn clear_embed_cache(&mut self) {
        self.runner.embed_cache_mut().clear();
    }

    /// Every id that ends a sequence: the model config's, then the tokenizer's.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        all_eos_ids(self.model(), &self.tokenizer)
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
        let mm = match (self.runner.vision(), images.is_empty()) {
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
                let image_keys = images.iter().map(|i| (i.key, v.num_image_tokens(&i.pixels))).collect();
                Some(Box::new(MultiModalState { images, positions, image_rows, image_keys, embeds: None }))
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
        let text = TextState { detok, stop: StopChecker::new(&req.params.stop) };
        let eos = self.output.eos().to_vec();
        self.scheduler.add(Sequence::new(id, req.prompt_tokens, req.params, eos, text));
        Ok(id)
    }

    /// Ends a sequence now (client gone, cancelled); its blocks are free for the next step.
    pub fn abort(&mut self, id: SeqId) -> bool {
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

    /// schedule -> execute -> apply.
    fn step_inner(&mut self) -> candle_core::Result<Vec<SeqUpdate>> {
        let started = std::time::Instant::now();
        let plan = self.scheduler.schedule();
        self.stats.preemptions += plan.preempted.len() as u64;
        self.stats.prefix = self.scheduler.prefix_stats;
        if plan.is_empty() {
            return Ok(Vec::new());
        }
        self.stats.steps += 1;
        let tokens = self.runner.execute(self.model.as_ref(), &self.kv, self.scheduler.seqs_mut(), &plan)?;
        // Per scheduled sequence, the sampled row that produced its last token.
        let last_rows: Vec<Option<usize>> = match &self.runner.sampled_hidden {
            Some((_, counts)) => {
                let starts = counts.iter().scan(0, |acc, &n| {
                    *acc += n;
                    Some(*acc - n)
                });
                starts.zip(&tokens).map(|(s, t)| t.len().checked_sub(1).map(|a| s + a)).collect()
            }
            None => Vec::new(),
        };
        // The MTP head catches up on every kept row before sequences that finish are gone.
        let caught = match self.runner.all_hidden.take().filter(|_| self.mtp) {
            Some(hidden) => {
                mtp_drafter::catch_up(self.model.as_ref(), &self.kv, &self.scheduler, &plan, &tokens, &hidden)?
            }
            None => None,
        };
        // A step of decodes only is timed for the governor (prompt chunks would blur it).
        let decodes = plan.items.iter().all(|item| item.num_new == 1);
        let drafted = plan.items.iter().any(|item| item.num_draft > 0);
        let produced: usize = tokens.iter().map(Vec::len).sum();
        if let Some(g) = &mut self.governor {
            self.output.set_drafting(g.wants_drafts(self.scheduler.num_running()));
        }
        let updates = self.output.apply(&mut self.scheduler, &plan, tokens, &mut self.stats);
        if self.model_drafter.is_some() {
            self.draft_with_model(&plan, &last_rows)?;
        }
        if let Some(caught) = caught {
            let output = &self.output;
            let drafts = mtp_drafter::propose(self.model.as_ref(), &self.kv, &mut self.scheduler, caught, |s| {
                output.draft_limit(s)
            })?;
            for (id, (d, q)) in drafts {
                if let Some(seq) = self.scheduler.get_mut(id) {
                    seq.draft = d;
                    // Only sampled requests carry distributions; greedy ones are point masses.
                    seq.draft_q = if q.iter().all(DraftDist::is_point) { Vec::new() } else { q };
                }
            }
        }
        if let Some(g) = self.governor.as_mut().filter(|_| decodes) {
            g.record(plan.items.len(), drafted, started.elapsed().as_secs_f64(), produced);
        }
        Ok(updates)
    }

    /// The next step's drafts of the sequences that decode, from the drafter model.
    fn draft_with_model(&mut self, plan: &SchedulerOutput, last_rows: &[Option<usize>]) -> candle_core::Result<()> {
        let (Some(drafter), Some((hidden, _))) = (&self.model_drafter, &self.runner.sampled_hidden) else {
            return Ok(());
        };
        let mut ids = Vec::new();
        let mut inputs = Vec::new();
        for (item, row) in plan.items.iter().zip(last_rows) {
            let (Some(row), Some(seq)) = (row, self.scheduler.get_mut(item.id)) else { continue };
            let Some(max) = self.output.draft_limit(seq).filter(|&m| m > 0) else { continue };
            let Some(&last_token) = seq.tokens().last() else { continue };
            ids.push(item.id);
            inputs.push(DraftInput {
                last_token,
                cached: seq.num_computed,
                block_table: seq.block_table.ids(),
                hidden_row: *row,
                max,
            });
        }
        if inputs.is_empty() {
            return Ok(());
        }
        let drafts = drafter.propose(self.model.as_ref(), &self.kv, self.cfg.scheduler.block_size, hidden, &inputs)?;
        for (id, d) in ids.into_iter().zip(drafts) {
            if let Some(seq) = self.scheduler.get_mut(id) {
                seq.draft = d;
            }
        }
        Ok(())
    }
}

/// The ids that end a sequence: the model config's, then the tokenizer's others.
fn all_eos_ids(model: &dyn TextModel, tokenizer: &TextTokenizer) -> Vec<u32> {
    let mut eos = model.config().eos_token_ids.clone();
    for &id in tokenizer.eos_token_ids() {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    eos
}
