//! `iris bench`: prefill and decode throughput and time to first token, in-process, plus the
//! vision tower and an image prompt's TTFT on vision-language models (`image_bench.rs`); with
//! `--url`, a load benchmark of a running server instead (`load_bench.rs`).

use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::args::EngineArgs;
use super::image_bench::{self, ImageBench, ImageSource};
use super::session::open_engine;
use super::stats::median;
use crate::engine::{
    Drafter, Engine, Grammar, GrammarCompiler, GrammarSpec, ImageInput, ReplayDrafter, Request, SamplingParams,
};

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Benchmark the server running at this URL (e.g. http://127.0.0.1:8000) with concurrent
    /// streaming chat requests, instead of the engine in-process. The engine flags and
    /// --batch-sizes, --prompt-len, --repeats do not apply then; --gen-len is max_tokens.
    #[arg(long)]
    pub url: Option<String>,
    /// With --url: concurrent streams, one level after another.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub concurrency: Vec<usize>,
    /// With --url: requests per level (default: 4 per stream, at least 16).
    #[arg(long)]
    pub num_requests: Option<usize>,
    /// With --url: API key to send (`Authorization: Bearer`).
    #[arg(long, env = "IRIS_API_KEY")]
    pub api_key: Option<String>,
    /// With --url: seconds after which an unfinished request counts as failed.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Batch sizes (concurrent sequences) to measure decode at.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch_sizes: Vec<usize>,
    /// Prompt length in tokens (of a built-in English text, repeated).
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Use this file's text as the prompt instead (whole; --prompt-len does not apply), e.g. an
    /// input-grounded task for --speculative-config: code to repeat with one change, a text to
    /// summarise.
    #[arg(long)]
    pub prompt_file: Option<std::path::PathBuf>,
    /// With --prompt-file: send its text as a user message through the model's chat template.
    #[arg(long, requires = "prompt_file")]
    pub chat: bool,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 64)]
    pub gen_len: usize,
    /// Repetitions per measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Vision-language models: benchmark the image side with this image file (PNG, JPEG, WebP,
    /// GIF) instead of a generated one.
    #[arg(long, conflicts_with = "image_size")]
    pub image: Option<std::path::PathBuf>,
    /// Vision-language models: the generated benchmark image's size, WIDTHxHEIGHT (it is then
    /// resized by the model's processor as any image is).
    #[arg(long, value_parser = super::image_bench::parse_size, default_value = "448x448")]
    pub image_size: (usize, usize),
    /// Print JSON instead of tables: `{"rows": [one per batch size], "image": null or the
    /// image benchmark}`.
    #[arg(long)]
    pub json: bool,
    /// Sampling temperature of the generated tokens (0: greedy). Each sequence gets its own
    /// seed, so a run repeats exactly.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// With --temperature: nucleus sampling (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// With --temperature: keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// With --speculative-config, greedy: draft the model's own greedy continuation (recorded
    /// in a first pass) instead of n-grams, and count every draft accepted (a near-tie that
    /// rounds the other way in a verify step would otherwise end the run of accepted drafts):
    /// what verifying K tokens per pass costs and gives at best. The text is then not the
    /// model's own where such a tie flipped.
    #[arg(long, requires = "speculative_config")]
    pub all_accepted: bool,
    /// Hold every generated sequence to this JSON schema (a file), as structured outputs do:
    /// what the grammar's masks cost. Choose a schema that the generated length cannot
    /// complete (e.g. an array with many required items), so every sequence runs --gen-len
    /// tokens.
    #[arg(long)]
    pub json_schema: Option<std::path::PathBuf>,
    /// Instead of the batch table: a conversation of this many turns, each prompt the previous
    /// one with its answer (--gen-len tokens) and a new user message (--prompt-len tokens),
    /// run with prefix caching on and off (two engines from the same flags): time to first
    /// token per turn, medians over --repeats conversations.
    #[arg(long, conflicts_with_all = ["url", "all_accepted", "prompt_file"])]
    pub conversation_turns: Option<usize>,
    /// With --conversation-turns on a vision-language model: the first user message holds an
    /// image (--image, or a generated one of --image-size; another picture per conversation),
    /// and every turn resends it.
    #[arg(long, requires = "conversation_turns")]
    pub conversation_image: bool,
    /// Instead of the batch table: --streams sequences decode (prompts of --prompt-len), then a
    /// prompt of this many tokens arrives; the streams' inter-token latency before it (over
    /// --gen-len steps) and while it is admitted, and its time to first token. Compare runs
    /// with and without --long-prefill-token-threshold.
    #[arg(long, conflicts_with_all = ["url", "all_accepted", "prompt_file", "conversation_turns"])]
    pub admit_prompt_len: Option<usize>,
    /// With --admit-prompt-len: sequences decoding while the long prompt is admitted.
    #[arg(long, default_value_t = 8, requires = "admit_prompt_len")]
    pub streams: usize,
}

#[derive(Debug, Serialize, Clone)]
pub struct BenchRow {
    pub batch: usize,
    pub prompt_len: usize,
    pub gen_len: usize,
    /// Prompt tokens per second over the prefill of all sequences.
    pub prefill_tok_s: f64,
    /// Time from submission to the first token of the first sequence.
    pub ttft_ms: f64,
    /// Generated tokens per second once every sequence is decoding.
    pub decode_tok_s: f64,
    /// All generated tokens over the whole run, prefill included.
    pub total_tok_s: f64,
    /// With --speculative-config: accepted share of the draft tokens verified.
    pub acceptance_rate: Option<f64>,
    /// With --speculative-config: tokens appended per sequence and verify pass (accepted + 1).
    pub tokens_per_verify: Option<f64>,
    /// With --speculative-config: per draft position, the share of verify passes that accepted
    /// the draft there (and so every one before it).
    pub accepted_by_position: Option<Vec<f64>>,
}

const TEXT: &str = "The quick brown fox jumps over the lazy dog while the children watch from the window. \
In the morning the market fills with people buying bread, fruit and fresh fish from the harbour. ";

fn prompt_tokens(engine: &Engine, a: &BenchArgs) -> anyhow::Result<Vec<u32>> {
    let tok = engine.tokenizer();
    if let Some(path) = &a.prompt_file {
        let text =
            std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("--prompt-file {}: {e}", path.display()))?;
        let ids = if a.chat {
            tok.encode_chat(&[crate::tokenizer::ChatMessage::text("user", &text)], true)?
        } else {
            tok.encode(&text, true)?
        };
        anyhow::ensure!(!ids.is_empty(), "--prompt-file {} has no tokens", path.display());
        return Ok(ids);
    }
    let len = a.prompt_len;
    let unit = tok.encode(TEXT, false)?;
    anyhow::ensure!(!unit.is_empty(), "the tokenizer produced no tokens for the benchmark text");
    Ok(unit.iter().copied().cycle().take(len).collect())
}

/// The grammar of --json-schema, compiled for the model.
fn grammar(engine: &Engine, a: &BenchArgs) -> anyhow::Result<Option<Grammar>> {
    let Some(path) = &a.json_schema else { return Ok(None) };
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("--json-schema {}: {e}", path.display()))?;
    let schema: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("--json-schema {}: {e}", path.display()))?;
    let compiler =
        GrammarCompiler::new(engine.tokenizer().inner(), engine.model().config().vocab_size, &engine.eos_token_ids())?;
    Ok(Some(compiler.compile(&GrammarSpec::JsonSchema(schema)).map_err(|e| anyhow::anyhow!("--json-schema: {e}"))?))
}

fn run_once(
    engine: &mut Engine,
    batch: usize,
    prompt: &[u32],
    gen_len: usize,
    a: &BenchArgs,
    grammar: Option<&Grammar>,
) -> anyhow::Result<BenchRow> {
    let spec_before = engine.stats.spec.clone();
    let start = Instant::now();
    for i in 0..batch {
        let params = SamplingParams {
            max_tokens: gen_len,
            ignore_eos: true,
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            seed: Some(i as u64),
            grammar: grammar.cloned(),
            ..SamplingParams::default()
        };
        engine.add_request(Request { prompt_tokens: prompt.to_vec(), params })?;
    }
    let (mut first_token, mut all_started, mut tokens_at_all_started) = (None, None, 0usize);
    let mut started = std::collections::HashSet::new();
    let mut generated = 0usize;
    while engine.has_work() {
        for u in engine.step()? {
            if u.token.is_some() {
                generated += 1;
                first_token.get_or_insert_with(|| start.elapsed());
                started.insert(u.id);
            }
        }
        if all_started.is_none() && started.len() == batch {
            all_started = Some(start.elapsed());
            tokens_at_all_started = generated;
        }
    }
    let total = start.elapsed().as_secs_f64();
    let prefill_done = all_started.map(|d| d.as_secs_f64()).unwrap_or(total);
    let decode_time = total - prefill_done;
    let spec = engine.stats.spec.since(&spec_before);
    let speculating = engine.config().speculative.is_some();
    Ok(BenchRow {
        batch,
        prompt_len: prompt.len(),
        gen_len,
        prefill_tok_s: (batch * prompt.len()) as f64 / prefill_done.max(1e-9),
        ttft_ms: first_token.map(|d| d.as_secs_f64() * 1e3).unwrap_or(0.0),
        decode_tok_s: (generated - tokens_at_all_started) as f64 / decode_time.max(1e-9),
        total_tok_s: generated as f64 / total.max(1e-9),
        acceptance_rate: speculating.then(|| spec.acceptance_rate()),
        tokens_per_verify: speculating.then(|| spec.tokens_per_verify()),
        accepted_by_position: speculating
            .then(|| spec.accepted_per_position.iter().map(|&a| a as f64 / spec.num_drafts.max(1) as f64).collect()),
    })
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    if let Some(url) = a.url {
        let timeout = std::time::Duration::try_from_secs_f64(a.request_timeout)
            .ok()
            .filter(|t| !t.is_zero())
            .ok_or_else(|| anyhow::anyhow!("--request-timeout must be a positive number of seconds"))?;
        return super::load_bench::run(super::load_bench::LoadBench {
            url,
            concurrency: a.concurrency,
            num_requests: a.num_requests,
            max_tokens: a.gen_len,
            api_key: a.api_key.filter(|k| !k.is_empty()),
            timeout,
            json: a.json,
        });
    }
    anyhow::ensure!(
        a.repeats > 0 && a.gen_len > 1 && a.prompt_len > 0,
        "--repeats, --gen-len (> 1) and --prompt-len must be positive"
    );
    anyhow::ensure!(
        !a.batch_sizes.is_empty() && a.batch_sizes.iter().all(|&b| b > 0),
        "--batch-sizes must be positive numbers"
    );
    anyhow::ensure!(!a.all_accepted || a.temperature == 0.0, "--all-accepted needs greedy decoding (--temperature 0)");
    if let Some(turns) = a.conversation_turns {
        return conversation(&a, turns);
    }
    if let Some(n) = a.admit_prompt_len {
        return admission(&a, n);
    }
    let (mut engine, _) = open_engine(&uncached(&a.engine))?;
    let prompt = prompt_tokens(&engine, &a)?;
    if a.all_accepted {
        // Every sequence of a run has this prompt, so one greedy continuation serves them all.
        let params = SamplingParams { max_tokens: a.gen_len, ignore_eos: true, ..SamplingParams::default() };
        engine.add_request(Request { prompt_tokens: prompt.clone(), params })?;
        let mut recorded = prompt.clone();
        while engine.has_work() {
            recorded.extend(engine.step()?.into_iter().filter_map(|u| u.token.map(|t| t.token)));
        }
        let k = engine.config().speculative.map_or(0, |s| s.num_tokens);
        engine.set_drafter(Drafter::Replay(ReplayDrafter::new(k, vec![(prompt.len(), recorded)])))?;
        engine.accept_all_drafts(true);
    }
    let grammar = grammar(&engine, &a)?;
    // Warm up caches and thread pools.
    run_once(&mut engine, 1, &prompt, 4, &a, grammar.as_ref())?;
    let pb = ProgressBar::new((a.batch_sizes.len() * a.repeats) as u64);
    pb.set_style(
        ProgressStyle::with_template("bench {bar:30} {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut rows = Vec::new();
    for &b in &a.batch_sizes {
        pb.set_message(format!("batch {b}"));
        let mut runs = Vec::new();
        for _ in 0..a.repeats {
            runs.push(run_once(&mut engine, b, &prompt, a.gen_len, &a, grammar.as_ref())?);
            pb.inc(1);
        }
        let m = |f: fn(&BenchRow) -> f64| median(runs.iter().map(f).collect());
        rows.push(BenchRow {
            batch: b,
            prompt_len: prompt.len(),
            gen_len: a.gen_len,
            prefill_tok_s: m(|r| r.prefill_tok_s),
            ttft_ms: m(|r| r.ttft_ms),
            decode_tok_s: m(|r| r.decode_tok_s),
            total_tok_s: m(|r| r.total_tok_s),
            acceptance_rate: runs[0].acceptance_rate.map(|_| m(|r| r.acceptance_rate.unwrap_or(0.0))),
            tokens_per_verify: runs[0].tokens_per_verify.map(|_| m(|r| r.tokens_per_verify.unwrap_or(0.0))),
            accepted_by_position: runs[0].accepted_by_position.as_ref().map(|first| {
                let at = |r: &BenchRow, j: usize| r.accepted_by_position.as_ref().and_then(|v| v.get(j).copied());
                (0..first.len()).map(|j| median(runs.iter().map(|r| at(r, j).unwrap_or(0.0)).collect())).collect()
            }),
        });
    }
    pb.finish_and_clear();
    // The image side runs on every vision-language model; --image on a text model is an error.
    let image = match (&a.image, engine.vision().is_some()) {
        (None, false) => None,
        (Some(p), _) => Some(image_bench::run(&mut engine, &ImageSource::File(p.clone()), a.repeats)?),
        (None, true) => {
            let (w, h) = a.image_size;
            Some(image_bench::run(&mut engine, &ImageSource::Generated(w, h), a.repeats)?)
        }
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&BenchReport { rows, image })?);
    } else {
        let spec = rows.iter().any(|r| r.acceptance_rate.is_some());
        let (head, rule) = if spec {
            (" draft acceptance | tokens/verify | accepted by position |", "---|---|---|")
        } else {
            ("", "")
        };
        println!("| batch | prompt | gen | prefill tok/s | TTFT ms | decode tok/s | total tok/s |{head}");
        println!("|---|---|---|---|---|---|---|{rule}");
        for r in &rows {
            let extra = match (r.acceptance_rate, r.tokens_per_verify, &r.accepted_by_position) {
                (Some(a), Some(t), Some(p)) => {
                    let p: Vec<String> = p.iter().map(|v| format!("{v:.2}")).collect();
                    format!(" {:.1}% | {t:.2} | {} |", a * 100.0, p.join(" / "))
                }
                _ => String::new(),
            };
            println!(
                "| {} | {} | {} | {:.0} | {:.1} | {:.1} | {:.1} |{extra}",
                r.batch, r.prompt_len, r.gen_len, r.prefill_tok_s, r.ttft_ms, r.decode_tok_s, r.total_tok_s
            );
        }
        if let Some(i) = image {
            println!();
            println!("| image | image tokens | prompt | preprocess ms | vision ms/image | image prompt TTFT ms |");
            println!("|---|---|---|---|---|---|");
            println!(
                "| {}x{} | {} | {} | {:.2} | {:.2} | {:.2} |",
                i.width, i.height, i.image_tokens, i.prompt_len, i.preprocess_ms, i.vision_ms_per_image, i.ttft_ms
            );
        }
    }
    Ok(())
}

/// The engine flags with prefix caching off unless `--enable-prefix-caching` was given: the
/// batch table sends the same prompt again and again (every sequence of a batch, every repeat,
/// the warm-up), so with the cache on it would time its hits, not the prefill; the admission
/// bench cuts its prompts from one text, and its long prompt's admission is to be a prefill.
fn uncached(flags: &EngineArgs) -> EngineArgs {
    with_prefix_caching(flags, flags.enable_prefix_caching)
}

/// The engine flags with prefix caching on or off.
fn with_prefix_caching(flags: &EngineArgs, on: bool) -> EngineArgs {
    let mut flags = flags.clone();
    (flags.enable_prefix_caching, flags.no_enable_prefix_caching) = (on, !on);
    flags
}

/// `--conversation-turns`: the same flags with prefix caching on, then off.
fn conversation(a: &BenchArgs, turns: usize) -> anyhow::Result<()> {
    use super::conversation_bench::{self as conv, Conversation};
    let (mut on, _) = open_engine(&with_prefix_caching(&a.engine, true))?;
    let (mut off, _) = open_engine(&with_prefix_caching(&a.engine, false))?;
    let unit = on.tokenizer().encode(TEXT, false)?;
    // With an image: its one-turn prompt opens every conversation, another picture each
    // (variant r + 1; the warm-up's is variant 0).
    let vision = match (a.conversation_image, on.vision()) {
        (false, _) => None,
        (true, Some(v)) => Some(v.clone()),
        (true, None) => anyhow::bail!("--conversation-image needs a vision-language model"),
    };
    // The picture is read once; entry r holds variant r of it.
    let per_conversation: Vec<Vec<ImageInput>> = match &vision {
        None => vec![Vec::new(); a.repeats + 1],
        Some(v) => {
            let source = match &a.image {
                Some(p) => ImageSource::File(p.clone()),
                None => ImageSource::Generated(a.image_size.0, a.image_size.1),
            };
            let image = image_bench::load_image(&source)?;
            (0..=a.repeats)
                .map(|r| Ok(vec![ImageInput::new(v.preprocess(&image_bench::variant(&image, r))?)]))
                .collect::<anyhow::Result<_>>()?
        }
    };
    let opening = match (&vision, per_conversation[0].first()) {
        (Some(v), Some(image)) => image_bench::image_prompt(&on, v.as_ref(), &image.pixels)?,
        _ => Vec::new(),
    };
    let images = |r: usize| per_conversation[r].clone();
    let shifted = |r: usize| per_conversation[r + 1].clone();
    // Warm up caches and thread pools (a conversation of its own: other tokens than the runs').
    let placeholder = vision.as_ref().map(|v| v.image_token_id());
    let warm = Conversation {
        unit: &unit[1..],
        opening: &opening,
        images: &images,
        placeholder,
        turns: 1,
        user_len: 16,
        gen_len: 2,
    };
    conv::run(&mut on, &mut off, &warm, 1)?;
    let c = Conversation {
        unit: &unit,
        opening: &opening,
        images: &shifted,
        placeholder,
        turns,
        user_len: a.prompt_len,
        gen_len: a.gen_len,
    };
    let rows = conv::run(&mut on, &mut off, &c, a.repeats)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!("| turn | prompt | cached | TTFT ms, cache on | TTFT ms, cache off | speedup | new tokens alone ms | cache on / alone |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {:.1} | {:.1} | {:.2}x | {:.1} | {:.2} |",
            r.turn,
            r.prompt_len,
            r.cached,
            r.ttft_on_ms,
            r.ttft_off_ms,
            r.ttft_off_ms / r.ttft_on_ms.max(1e-9),
            r.ttft_new_alone_ms,
            r.ttft_on_ms / r.ttft_new_alone_ms.max(1e-9)
        );
    }
    Ok(())
}

/// `--admit-prompt-len`: a long prompt admitted beside decoding streams.
fn admission(a: &BenchArgs, admit_len: usize) -> anyhow::Result<()> {
    let (mut engine, _) = open_engine(&uncached(&a.engine))?;
    let unit = engine.tokenizer().encode(TEXT, false)?;
    // Warm up caches and thread pools.
    run_once(&mut engine, 1, &unit, 4, a, None)?;
    let r = super::admission_bench::run(&mut engine, &unit, a.streams, a.prompt_len, admit_len, a.gen_len)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    println!(
        "{} streams; a {}-token prompt admitted in {} steps, first token after {:.1} ms \
         (--max-num-batched-tokens {}, --long-prefill-token-threshold {})",
        r.streams,
        r.admitted_prompt_len,
        r.admission_steps,
        r.admitted_ttft_ms,
        r.max_num_batched_tokens,
        r.long_prefill_token_threshold
    );
    println!("| streams' inter-token latency | gaps | median ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|");
    for (phase, l) in [("steady", &r.steady), ("while admitting", &r.admitting)] {
        println!("| {phase} | {} | {:.2} | {:.2} | {:.2} |", l.gaps, l.median_ms, l.p99_ms, l.max_ms);
    }
    Ok(())
}

#[derive(Serialize)]
struct BenchReport {
    rows: Vec<BenchRow>,
    image: Option<ImageBench>,
}
