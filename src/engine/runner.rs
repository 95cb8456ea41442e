//! The model runner: turns a scheduled step into one flat batch, runs it on the engine's
//! device by the fastest path that covers it, and returns each sequence's tokens.
//!
//! Paths: on a GPU, steps in which every sequence computes the same few rows (a decode, or
//! its last token and the same number of drafts) replay CUDA graphs (`cuda_graph`); when every sampled row draws from its logits as they are, the tokens are
//! drawn on the device and only their ids come back. Steps with images, three-axis positions
//! or prompt logprobs, and every step on the CPU, run the model's plain forward pass and copy
//! the sampled rows' logits to the host. A sequence with draft tokens gets one sampled row
//! more than it has drafts (its last token's and each draft's), verified against the drafts
//! here (`SequenceSampler::verify`); a rejected draft's float-window ring rows are restored.

use candle_core::{Device, Result, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

use super::grammar::RowMasks;
use super::mask_job::masks_beside;
use super::multimodal::EmbedCache;
use super::sampler::{draws_plainly, logprobs, Sampled};
use super::scheduler::{ScheduledSeq, SchedulerOutput};
use super::sequence::Sequences;
use super::step_output::{draw_on_device, StepOutput};
use crate::batch::{Batch, ImageRows, Positions, SeqSlice};
use crate::kv::KvCache;
use crate::models::{TextModel, VisionModel};
use crate::ops::sample::{Draw, NO_TOKEN};
use crate::ops::token_mask::TokenMasks;

/// Default byte budget of the image-embedding cache.
const EMBED_CACHE_BYTES: usize = 256 << 20;

pub struct ModelRunner {
    device: Device,
    /// Benchmarks only (`iris bench --all-accepted`): count every draft accepted, so that each
    /// step verifies all its drafts whatever the target says.
    pub accept_all_drafts: bool,
    /// Keep the last step's sampled hidden rows (`sampled_hidden`) for a drafter model.
    pub keep_hidden: bool,
    /// With `keep_hidden`: the last step's final hidden rows of its sampled rows, and how many
    /// each scheduled sequence had (in plan order). CPU only.
    pub sampled_hidden: Option<(Tensor, Vec<usize>)>,
    /// Keep every row's final hidden state of the last step (`all_hidden`), for an MTP head.
    pub keep_all_hidden: bool,
    /// With `keep_all_hidden`: the last step's final hidden rows, each sequence's scheduled
    /// rows in plan order. CPU only.
    pub all_hidden: Option<Tensor>,
    vision: Option<Arc<dyn VisionModel>>,
    embed_cache: EmbedCache,
    #[cfg(feature = "cuda")]
    graphs: Option<super::cuda_graph::DecodeGraphs>,
}

/// A step's batch and, per scheduled sequence, the first of its sampled rows and how many
/// (none while its prompt is still being computed).
struct BuiltStep {
    batch: Batch,
    sampled: Vec<(usize, usize)>,
}

impl BuiltStep {
    fn sample_rows(&self) -> Vec<u32> {
        self.sampled.iter().flat_map(|&(first, n)| (first..first + n).map(|r| r as u32)).collect()
    }
}

impl ModelRunner {
    /// `max_blocks_per_seq` bounds a sequence's block table (decode graphs size their buffers
    /// by it); graphs run steps whose positions are all below `max_positions` (the model's
    /// rotary table on the device) and of at most `max_rows_per_seq` rows per sequence (1 + the
    /// most draft tokens).
    pub fn new(
        device: Device,
        max_num_seqs: usize,
        max_blocks_per_seq: usize,
        max_positions: usize,
        max_rows_per_seq: usize,
    ) -> Self {
        #[cfg(feature = "cuda")]
        let graphs = super::cuda_graph::DecodeGraphs::new(
            &device,
            max_num_seqs,
            max_blocks_per_seq,
            max_positions,
            max_rows_per_seq,
        );
        #[cfg(not(feature = "cuda"))]
        let _ = (max_num_seqs, max_blocks_per_seq, max_positions, max_rows_per_seq);
        ModelRunner {
            device,
            accept_all_drafts: false,
            keep_hidden: false,
            sampled_hidden: None,
            keep_all_hidden: false,
            all_hidden: None,
            vision: None,
            embed_cache: EmbedCache::new(EMBED_CACHE_BYTES),
            #[cfg(feature = "cuda")]
            graphs,
        }
    }

    /// Device memory the runner's fast paths keep for themselves at most (the CUDA graphs'
    /// buffers), for a runner built with these settings; 0 on the CPU.
    pub fn reserved_bytes(device: &Device, max_num_seqs: usize, max_rows_per_seq: usize, vocab: usize) -> u64 {
        #[cfg(feature = "cuda")]
        return super::cuda_graph::DecodeGraphs::buffer_bytes(device, max_num_seqs, max_rows_per_seq, vocab);
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (device, max_num_seqs, max_rows_per_seq, vocab);
            0
        }
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn set_vision(&mut self, vision: Option<Arc<dyn VisionModel>>) {
        self.vision = vision;
    }

    pub fn vision(&self) -> Option<&Arc<dyn VisionModel>> {
        self.vision.as_ref()
    }

    pub fn embed_cache(&self) -> &EmbedCache {
        &self.embed_cache
    }

    pub fn embed_cache_mut(&mut self) -> &mut EmbedCache {
        &mut self.embed_cache
    }

    /// Runs one scheduled step. Returns, per scheduled sequence in order, the tokens it gets:
    /// none while its prompt is still being computed, else its drafts accepted in order and
    /// one token more.
    pub fn execute(
        &mut self,
        model: &dyn TextModel,
        kv: &KvCache,
        seqs: &mut Sequences,
        plan: &SchedulerOutput,
    ) -> Result<Vec<Vec<Sampled>>> {
        self.encode_images(seqs, plan)?;
        let cfg = model.config();
        let mut step = build_batch(seqs, plan, kv, cfg.rope.mrope_section.is_some(), cfg.images_attend_both_ways())?;
        if self.keep_all_hidden {
            step.batch.output_rows = None;
        }
        let rows = step.sample_rows();
        let checkpoint = match &step.batch.attn.window {
            Some(w) => {
                let slots: Vec<u32> = plan
                    .items
                    .iter()
                    .zip(&step.sampled)
                    .flat_map(|(item, &(first, _))| (first + 1..first + 1 + item.num_draft).map(|r| w.slots[r]))
                    .collect();
                kv.save_window_rows(&slots)?
            }
            None => None,
        };
        let state_slots = step.batch.attn.state_slots.clone();
        let counts: Vec<usize> = step.sampled.iter().map(|&(_, n)| n).collect();
        self.sampled_hidden = None;
        self.all_hidden = None;
        let keep = self.keep_hidden.then(|| counts.clone());
        let keep_all = self.keep_all_hidden;
        let beside = !self.device.is_cpu();
        let masked =
            plan.items.iter().zip(&counts).any(|(item, &n)| n > 0 && seqs.expect(item.id).constraint.is_some());
        let (out, masks) = masks_beside(seqs, plan, &counts, beside, |seqs| -> Result<StepOutput> {
            if needs_plain_forward(seqs, plan, &step.batch) {
                let hidden = self.forward(model, kv, step.batch)?;
                record_prompt_logprobs(model, seqs, plan, &hidden)?;
                self.keep_rows(&hidden, &rows, keep, keep_all)?;
                self.logits(model, &hidden, &rows)
            } else {
                let draws = self.device_draws(seqs, plan, &step.sampled);
                if keep.is_some() || keep_all {
                    // Drafter models run on the CPU only: the plain pass there.
                    let hidden = model.forward(&step.batch, kv, None)?;
                    self.keep_rows(&hidden, &rows, keep, keep_all)?;
                    return self.logits(model, &hidden, &rows);
                }
                self.run(model, kv, step.batch, &rows, draws.as_deref(), masked)
            }
        });
        let out = out?.drawn(|vocab| token_masks(&masks, &counts, vocab))?;
        let mut tokens = verify(seqs, plan, &step.sampled, out, masks);
        if self.accept_all_drafts {
            for (item, t) in plan.items.iter().zip(&mut tokens) {
                if let Some(last) = t.last().cloned().filter(|_| item.num_draft > 0) {
                    let drafts = &seqs.expect(item.id).draft[..item.num_draft];
                    *t = drafts.iter().map(|&d| Sampled::token_only(d)).chain([last]).collect();
                }
            }
        }
        if let Some(cp) = checkpoint {
            // Saved rows are the drafts of the sequences that have any, in plan order.
            let rejected: Vec<bool> = plan
                .items
                .iter()
                .zip(&tokens)
                .flat_map(|(item, t)| (0..item.num_draft).map(move |j| j + 1 >= t.len()))
                .collect();
            kv.restore_window_rows(&cp, |i| rejected[i])?;
        }
        if let Some(slots) = &state_slots {
            // A recurrent layer kept the state after each row of a sequence with drafts; where
            // some were rejected, the state after its last kept row becomes the live one.
            for ((item, t), &slot) in plan.items.iter().zip(&tokens).zip(slots) {
                let kept = item.num_new + t.len().saturating_sub(1);
                if item.num_draft > 0 && kept < item.num_rows() {
                    kv.restore_state(slot, kept)?;
                }
            }
        }
        Ok(tokens)
    }

    /// Runs the vision tower for scheduled sequences whose images have no embeddings yet
    /// (each image on its own, so its embeddings do not depend on the batch).
    fn encode_images(&mut self, seqs: &mut Sequences, plan: &SchedulerOutput) -> Result<()> {
        let Some(vision) = self.vision.clone() else { return Ok(()) };
        for item in &plan.items {
            let seq = seqs.expect_mut(item.id);
            let (start, prompt_len) = (seq.num_computed, seq.prompt().len());
            let Some(mm) = seq.mm.as_mut() else { continue };
            // Images whose tokens all came from the prefix cache need no tower (a preempted
            // sequence that finds them evicted encodes them when it runs again).
            if mm.embeds.is_some() || mm.embed_rows_in(start..prompt_len).is_empty() {
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

    /// On a GPU, when every sampled row draws from its logits as they are (but for a grammar's
    /// mask, which the device applies), each row's draw, for the device to pick the tokens
    /// (only their ids are copied back); None otherwise (the
    /// logits come to the host). Takes from each row's generator what host sampling would; a
    /// sequence with drafts has its drafts judged on the device (rejection sampling, see
    /// `SequenceSampler::verify_draws`) and its generator advanced once the outcome is known.
    /// `IRIS_DEVICE_SAMPLING=0` sends every step's logits to the host (for comparisons).
    fn device_draws(
        &self,
        seqs: &mut Sequences,
        plan: &SchedulerOutput,
        sampled: &[(usize, usize)],
    ) -> Option<Vec<Draw>> {
        if self.device.is_cpu() || !crate::switches::switched_on!("IRIS_DEVICE_SAMPLING") {
            return None;
        }
        // The device judges drafts as point masses only: drafts with a distribution of their
        // own (sampled MTP drafts) are judged on the host.
        let sampled_drafts =
            |item: &ScheduledSeq| seqs.expect(item.id).draft_q.iter().take(item.num_draft).any(|q| !q.is_point());
        if plan.items.iter().any(sampled_drafts) {
            return None;
        }
        // Every row a sequence samples, the last after all its drafts, draws plainly.
        let plain = |item: &ScheduledSeq, n: usize| {
            let s = seqs.expect(item.id);
            let out = s.output().len();
            n == 0 || (draws_plainly(&s.params, out) && draws_plainly(&s.params, out + item.num_draft))
        };
        if !plan.items.iter().zip(sampled).all(|(item, &(_, n))| plain(item, n)) {
            return None;
        }
        let mut draws = Vec::new();
        for (item, &(_, n)) in plan.items.iter().zip(sampled) {
            let s = seqs.expect_mut(item.id);
            if item.num_draft > 0 {
                draws.extend(s.sampler.verify_draws(&s.params, &s.draft[..item.num_draft]));
            } else if n > 0 {
                draws.push(s.sampler.device_draw(&s.params));
            }
        }
        Some(draws)
    }

    /// Runs every step op by op (a model whose steps cannot be captured as CUDA graphs).
    pub fn without_graphs(&mut self) {
        #[cfg(feature = "cuda")]
        {
            self.graphs = None;
        }
    }

    /// Runs `batch` (built on the host) and returns the next-token data of `sample_rows`;
    /// `draws`, one per sampled row, let a GPU pick the tokens itself (None: logits to the host),
    /// once the grammar masks are known when some row is `masked` (`StepOutput::Undrawn`).
    pub fn run(
        &mut self,
        model: &dyn TextModel,
        kv: &KvCache,
        batch: Batch,
        sample_rows: &[u32],
        draws: Option<&[Draw]>,
        masked: bool,
    ) -> Result<StepOutput> {
        if self.device.is_cpu() {
            let hidden = model.forward(&batch, kv, None)?;
            return self.logits(model, &hidden, sample_rows);
        }
        #[cfg(feature = "cuda")]
        if let Some(graphs) = self.graphs.as_mut() {
            if let Some(out) = graphs.run(model, kv, &batch, sample_rows, draws, masked)? {
                return Ok(out);
            }
            graphs.ran_other_step();
        }
        let hidden = self.forward(model, kv, batch)?;
        if sample_rows.is_empty() {
            return Ok(StepOutput::Logits(Vec::new()));
        }
        let all_rows =
            sample_rows.len() == hidden.dim(0)? && sample_rows.iter().enumerate().all(|(i, &r)| r as usize == i);
        let hidden =
            if all_rows { hidden } else { hidden.index_select(&Tensor::new(sample_rows, &self.device)?, 0)? };
        let logits = model.logits(&hidden)?;
        match draws {
            Some(draws) if masked => Ok(StepOutput::Undrawn { logits, draws: draws.to_vec() }),
            Some(draws) => Ok(StepOutput::Tokens(draw_on_device(&logits, None, draws)?)),
            None => Ok(StepOutput::Logits(logits.to_vec2()?)),
        }
    }

    /// The model's plain forward pass over `batch` (built on the host) on the device: hidden
    /// states of every row.
    pub fn forward(&self, model: &dyn TextModel, kv: &KvCache, mut batch: Batch) -> Result<Tensor> {
        batch.to_device(&self.device)?;
        model.forward(&batch, kv, None)
    }

    fn keep_rows(&mut self, hidden: &Tensor, rows: &[u32], counts: Option<Vec<usize>>, all: bool) -> Result<()> {
        if all {
            self.all_hidden = Some(hidden.clone());
        }
        if let Some(counts) = counts.filter(|_| !rows.is_empty()) {
            let kept = hidden.index_select(&Tensor::new(rows, hidden.device())?, 0)?;
            self.sampled_hidden = Some((kept, counts));
        }
        Ok(())
    }

    /// The logits of `sample_rows` of `hidden`, copied to the host.
    pub fn logits(&self, model: &dyn TextModel, hidden: &Tensor, sample_rows: &[u32]) -> Result<StepOutput> {
        if sample_rows.is_empty() {
            return Ok(StepOutput::Logits(Vec::new()));
        }
        let rows = Tensor::new(sample_rows, hidden.device())?;
        Ok(StepOutput::Logits(model.logits(&hidden.index_select(&rows, 0)?)?.to_vec2()?))
    }
}

/// The grammar masks of a step's sampled rows, in order, for the device (`counts`: each plan
/// item's sampled rows).
fn token_masks(masks: &[Option<RowMasks>], counts: &[usize], vocab: usize) -> TokenMasks {
    let mut out = TokenMasks::new(vocab);
    for (m, &n) in masks.iter().zip(counts) {
        for row in 0..n {
            out.push(m.as_ref().and_then(|m| m.allowed_bits(row, vocab)).as_deref());
        }
    }
    out
}

/// Each sequence's tokens from its sampled rows: sampled, or its drafts verified.
fn verify(
    seqs: &mut Sequences,
    plan: &SchedulerOutput,
    sampled: &[(usize, usize)],
    out: StepOutput,
    masks: Vec<Option<RowMasks>>,
) -> Vec<Vec<Sampled>> {
    let mut at = 0;
    let mut next_rows = |n: usize| {
        let r = at..at + n;
        at += n;
        r
    };
    match out {
        // Drawn on the device: a draft is accepted while its row gave it (the argmax, or the
        // draft judged by rejection sampling, whose rejections never give the draft).
        StepOutput::Tokens(ids) => plan
            .items
            .iter()
            .zip(sampled)
            .map(|(item, &(_, n))| {
                let ids = &ids[next_rows(n)];
                let seq = seqs.expect_mut(item.id);
                let accepted = ids.iter().zip(&seq.draft[..item.num_draft]).take_while(|(a, b)| a == b).count();
                if item.num_draft > 0 {
                    seq.sampler.settle_verify(&seq.params, item.num_draft, accepted);
                }
                let take = if n == 0 { 0 } else { 1 + accepted };
                ids[..take].iter().map(|&t| Sampled::token_only(if t == NO_TOKEN { 0 } else { t })).collect()
            })
            .collect(),
        // The sequences side by side: each filters whole-vocabulary rows, which one after
        // another held up GPU steps of sampled sequences with drafts. Each samples with its own
        // RNG, so results depend neither on the batch nor on the threads.
        StepOutput::Undrawn { .. } => unreachable!("the step's output is drawn (`StepOutput::drawn`) before verify"),
        StepOutput::Logits(mut logits) => {
            let mut rest = &mut logits[..];
            let mut rows_of = Vec::with_capacity(sampled.len());
            for &(_, n) in sampled {
                let (rows, tail) = std::mem::take(&mut rest).split_at_mut(n);
                rows_of.push(rows);
                rest = tail;
            }
            let ids: Vec<_> = plan.items.iter().map(|item| item.id).collect();
            let work: Vec<_> = plan.items.iter().zip(seqs.expect_many_mut(&ids)).zip(rows_of).zip(masks).collect();
            work.into_par_iter()
                .map(|(((item, seq), rows), masks)| {
                    if rows.is_empty() {
                        return Vec::new();
                    }
                    let s = seq.sampling();
                    let m = masks.as_ref();
                    if item.num_draft == 0 {
                        vec![s.sampler.sample_masked(&mut rows[0], s.params, s.prompt, s.output, m)]
                    } else {
                        let drafts = &s.draft[..item.num_draft];
                        // The scheduler may verify fewer drafts than there are: their q too.
                        let q = s.draft_q.get(..item.num_draft).unwrap_or(&[]);
                        s.sampler.verify_masked(rows, drafts, q, s.params, s.prompt, s.output, m)
                    }
                })
                .collect()
        }
    }
}

/// Steps the runner's fast paths (CUDA graphs, argmax on the device) do not cover go through
/// the model's plain forward pass: those with images or three-axis positions, and those in
/// which a sequence asks for prompt logprobs (which read the prefill rows' hidden states).
fn needs_plain_forward(seqs: &Sequences, plan: &SchedulerOutput, batch: &Batch) -> bool {
    batch.images.is_some()
        || matches!(batch.positions, Positions::MRope(_))
        || plan.items.iter().any(|item| seqs.expect(item.id).params.prompt_logprobs.is_some())
}

/// Flattens the plan into one batch on the host (the runner moves it to the device): each
/// sequence's scheduled tokens, then its scheduled drafts. A model with M-RoPE (`mrope`) gets
/// three-axis positions in steps with images; any other keeps one axis. A model whose image
/// tokens see their whole image (`bidirectional`) gets each chunk's image runs.
fn build_batch(
    seqs: &Sequences,
    plan: &SchedulerOutput,
    kv: &KvCache,
    mrope: bool,
    bidirectional: bool,
) -> Result<BuiltStep> {
    let mut tokens = Vec::with_capacity(plan.num_tokens());
    let mut slices = Vec::with_capacity(plan.items.len());
    let mut sampled = Vec::with_capacity(plan.items.len());
    // Per-sequence positions: three-axis once any sequence in the step has images.
    let mrope = mrope && plan.items.iter().any(|item| seqs.expect(item.id).mm.is_some());
    let mut flat = Vec::new();
    let mut axes = Vec::new();
    let (mut image_rows, mut image_embeds) = (Vec::new(), Vec::new());
    let mut ranges = Vec::with_capacity(if bidirectional { plan.items.len() } else { 0 });
    for item in &plan.items {
        let seq = seqs.expect(item.id);
        let q_start = tokens.len();
        let n = item.num_rows();
        let range = seq.num_computed..seq.num_computed + n;
        tokens.extend((seq.num_computed..seq.num_computed + item.num_new).map(|i| seq.token(i)));
        tokens.extend_from_slice(&seq.draft[..item.num_draft]);
        match (&seq.mm, mrope) {
            (Some(mm), _) => {
                if mrope {
                    axes.extend(range.clone().map(|i| mm.position(i)));
                } else {
                    flat.extend(range.clone().map(|i| mm.position(i)[0]));
                }
                if bidirectional {
                    // The scheduler keeps each image whole in one chunk.
                    let runs = mm.image_runs().into_iter().filter(|&(a, b)| a < range.end && b > range.start);
                    ranges.push(runs.collect());
                }
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
        if bidirectional && seq.mm.is_none() {
            ranges.push(Vec::new());
        }
        slices.push(SeqSlice { q_start, q_len: n, context_len: range.end, block_table: seq.block_table.ids() });
        let samples = seq.num_computed + item.num_new == seq.num_tokens();
        sampled.push(if samples { (q_start + item.num_new - 1, 1 + item.num_draft) } else { (q_start, 0) });
    }
    let positions = if mrope { Positions::MRope(axes) } else { Positions::Flat(flat) };
    let images = if image_rows.is_empty() {
        None
    } else {
        Some(ImageRows::new(&image_rows, Tensor::cat(&image_embeds, 0)?, tokens.len())?)
    };
    let mut batch = Batch::new(&Device::Cpu, kv.spec().block_size, slices, &tokens, positions, images)?;
    if let Some(len) = kv.turboquant().map(|t| t.float_window).filter(|&w| w > 0) {
        let rings = plan
            .items
            .iter()
            .map(|item| seqs.expect(item.id).state_slot)
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| candle_core::Error::Msg("a scheduled sequence holds no state slot".into()))?;
        batch.attn.set_float_window(len, rings)?;
    }
    if bidirectional {
        batch.attn.set_bidirectional(ranges)?;
    }
    // The rows read after the pass: the sampled ones, unless a sequence wants the logprobs of
    // its prompt (every row of its chunks).
    if !plan.items.iter().any(|item| seqs.expect(item.id).params.prompt_logprobs.is_some()) {
        batch.output_rows = Some(sampled.iter().map(|&(_, n)| n).collect());
    }
    if kv.has_recurrent_layers() {
        // The scheduler gives every running sequence its own slot; a recurrent layer carries
        // the sequence's state there from one step (or prompt chunk) to the next.
        let slots = plan
            .items
            .iter()
            .map(|item| seqs.expect(item.id).state_slot)
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| candle_core::Error::Msg("a scheduled sequence holds no state slot".into()))?;
        batch.attn.set_state_slots(slots)?;
        // A verify step keeps each row's state, to roll back to after the drafts are judged.
        batch.attn.set_state_checkpoints(plan.items.iter().map(|item| item.num_draft > 0).collect())?;
    }
    Ok(BuiltStep { batch, sampled })
}

/// vLLM's `prompt_logprobs`: for each sequence that asks, the rows of this step's chunk
/// whose next token is still a prompt token give that token's logprob under the raw model.
/// Their logits are computed apart from the sampled rows' (which stay exactly as without
/// this feature), a bounded number of rows at a time. A chunk recomputed after preemption
/// adds nothing: its entries are already there.
fn record_prompt_logprobs(
    model: &dyn TextModel,
    seqs: &mut Sequences,
    plan: &SchedulerOutput,
    hidden: &Tensor,
) -> Result<()> {
    /// Most rows of vocabulary-wide logits held at once.
    const ROWS_AT_ONCE: usize = 256;
    let mut rows: Vec<(usize, u32, u32)> = Vec::new(); // (plan item, batch row, next prompt token)
    let mut q_start = 0;
    for (k, item) in plan.items.iter().enumerate() {
        let seq = seqs.expect(item.id);
        if seq.params.prompt_logprobs.is_some() {
            // Position p predicts prompt token p + 1; entries before `done` exist already.
            let done = seq.prompt_logprobs.len();
            let end = (seq.num_computed + item.num_new).min(seq.prompt().len().saturating_sub(1));
            for p in seq.num_computed.max(done)..end {
                rows.push((k, (q_start + p - seq.num_computed) as u32, seq.prompt()[p + 1]));
            }
        }
        q_start += item.num_rows();
    }
    for chunk in rows.chunks(ROWS_AT_ONCE) {
        let idx: Vec<u32> = chunk.iter().map(|r| r.1).collect();
        let idx = Tensor::new(idx.as_slice(), hidden.device())?;
        let logits: Vec<Vec<f32>> = model.logits(&hidden.index_select(&idx, 0)?)?.to_vec2()?;
        for (&(k, _, next), l) in chunk.iter().zip(&logits) {
            let seq = seqs.expect_mut(plan.items[k].id);
            let (logprob, top_logprobs) = logprobs(l, next, seq.params.prompt_logprobs.unwrap_or(0));
            seq.prompt_logprobs.push(Sampled { token: next, logprob, top_logprobs });
        }
    }
    Ok(())
}
