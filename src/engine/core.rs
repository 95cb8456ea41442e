//! The engine: owns the model and the KV memory, runs one scheduled step at a time.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::detokenizer::IncrementalDetokenizer;
use super::finish::FinishReason;
use super::request::{Request, RequestError, SeqUpdate};
use super::sampler::Sampled;
use super::scheduler::{Plan, Scheduler, SchedulerConfig};
use super::sequence::{SeqId, Sequence};
use super::stop::StopChecker;
use crate::batch::{Batch, SeqSlice};
use crate::kv::KvCache;
use crate::models::TextModel;
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

pub struct Engine {
    model: Box<dyn TextModel>,
    kv: KvCache,
    scheduler: Scheduler,
    tokenizer: Arc<TextTokenizer>,
    text: HashMap<SeqId, TextState>,
    cfg: EngineConfig,
    device: Device,
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
        Engine {
            model,
            kv,
            scheduler,
            tokenizer,
            text: HashMap::new(),
            cfg,
            device,
            next_id: 0,
            eos,
            stats: EngineStats::default(),
        }
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
        // from outside for each of the ~200 parallel regions of a decode step.
        if rayon::current_thread_index().is_some() {
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
        let (batch, sample_rows) = self.build_batch(&plan)?;
        let hidden = self.model.forward(&batch, &self.kv, None)?;
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
        let rows: Vec<u32> = sample_rows.iter().map(|(_, r)| *r as u32).collect();
        let rows = Tensor::new(rows.as_slice(), &self.device)?;
        let logits = self.model.logits(&hidden.index_select(&rows, 0)?)?;
        let mut logits: Vec<Vec<f32>> = logits.to_vec2()?;
        let sampled = self.sample(&sample_rows, &mut logits);
        for ((id, _), tok) in sample_rows.iter().zip(sampled) {
            updates.push(self.append_token(*id, tok));
        }
        Ok(updates)
    }

    /// Flattens the plan into one batch; returns which rows need next-token logits.
    fn build_batch(&self, plan: &Plan) -> candle_core::Result<(Batch, Vec<(SeqId, usize)>)> {
        let mut tokens = Vec::with_capacity(plan.num_tokens());
        let mut slices = Vec::with_capacity(plan.items.len());
        let mut sample_rows = Vec::new();
        for &(id, n) in &plan.items {
            let seq = self.scheduler.get(id).expect("scheduled sequence exists");
            let q_start = tokens.len();
            tokens.extend((seq.num_computed..seq.num_computed + n).map(|i| seq.token(i)));
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
        let mut batch = Batch::from_tokens(&self.device, self.scheduler.config().block_size, slices, &tokens)?;
        batch.attn.window_rings = plan
            .items
            .iter()
            .map(|&(id, _)| self.scheduler.get(id).and_then(|s| s.window_ring))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| candle_core::Error::Msg("a scheduled sequence holds no window ring".into()))?;
        Ok((batch, sample_rows))
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
                return self.finish(id, tok, text, FinishReason::Stop);
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
                self.finish(id, tok, text, reason)
            }
            None => SeqUpdate {
                id,
                token: Some(tok),
                text,
                finish: None,
                num_prompt_tokens: seq.prompt.len(),
                num_output_tokens: n_out,
            },
        }
    }

    fn finish(&mut self, id: SeqId, tok: Sampled, text: String, reason: FinishReason) -> SeqUpdate {
        self.text.remove(&id);
        let seq = self.scheduler.remove(id).expect("finishing sequence exists");
        SeqUpdate {
            id,
            token: Some(tok),
            text,
            finish: Some(reason),
            num_prompt_tokens: seq.prompt.len(),
            num_output_tokens: seq.output.len(),
        }
    }
}
