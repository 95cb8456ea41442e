//! Each tiny fixture model against transformers: every layer's hidden states and the logits
//! (f32, relative error <= 1e-4 of the reference's largest magnitude), greedy tokens, and the
//! chat template's token ids.

mod common;

use candle_core::{DType, Tensor};
use common::*;
use iris::engine::build::EngineOptions;
use iris::kv::{KvCache, KvCacheSpec, KvDtype};
use iris::models::Taps;

const TOL: f32 = 1e-4;

fn forward_chunked(name: &str, tokens: &[u32], chunk: usize) -> (Tensor, Tensor, Taps) {
    forward_in_chunks(&fixture(name), tokens, chunk)
}

fn check_layers(name: &str) {
    let _gpu = gpu_lock();
    let r = reference(name);
    let tokens = ids(&r["text.input_ids"]);
    let (hidden, logits, taps) = forward_chunked(name, &tokens, usize::MAX);
    let e = rel_err(taps.embed.as_ref().unwrap(), &r["text.embed"]);
    assert!(e <= TOL, "{name} embeddings: rel err {e}");
    let n_layers = reference_json(name)["num_layers"].as_u64().unwrap() as usize;
    assert_eq!(taps.layers.len(), n_layers);
    for (i, h) in taps.layers.iter().enumerate() {
        let e = rel_err(h, &r[&format!("text.layer.{i}")]);
        assert!(e <= TOL, "{name} layer {i}: rel err {e}");
    }
    let e = rel_err(&hidden, &r["text.final_norm"]);
    assert!(e <= TOL, "{name} final norm: rel err {e}");
    let e = rel_err(&logits, &r["text.logits"]);
    assert!(e <= TOL, "{name} logits: rel err {e}");

    // The same prompt prefilled in chunks of 5 (each attending to the cached prefix).
    let (_, chunked, _) = forward_chunked(name, &tokens, 5);
    let e = rel_err(&chunked, &r["text.logits"]);
    assert!(e <= TOL, "{name} chunked-prefill logits: rel err {e}");
    // And token by token, as decode does.
    let (_, stepped, _) = forward_chunked(name, &tokens, 1);
    let e = rel_err(&stepped, &r["text.logits"]);
    assert!(e <= TOL, "{name} token-by-token logits: rel err {e}");
}

fn check_greedy(name: &str) {
    let _gpu = gpu_lock();
    let r = reference(name);
    // 8 MiB: a hybrid model also reserves a recurrent state for each of the 256 sequences.
    let mut engine = engine_with(&fixture(name), EngineOptions { kv_memory: Some(8 << 20), ..Default::default() });
    for key in ["text", "chat"] {
        let prompt = ids(&r[&format!("{key}.input_ids")]);
        let want = ids(&r[&format!("{key}.generated_ids")]);
        let got = run_requests(&mut engine, &[(prompt, greedy(want.len()))], &[0]);
        assert_eq!(got[0], want, "{name} {key}: greedy tokens differ from transformers");
    }
}

fn check_chat_template(name: &str) {
    let r = reference(name);
    let j = reference_json(name);
    let msgs: Vec<iris::tokenizer::ChatMessage> = serde_json::from_value(j["chat_messages"].clone()).unwrap();
    let tok = iris::tokenizer::TextTokenizer::from_dir(&fixture(name)).unwrap();
    let got = tok.encode_chat(&msgs, true).unwrap();
    assert_eq!(got, ids(&r["chat.input_ids"]), "{name}: chat template token ids differ from transformers");
}

/// vLLM's prompt_logprobs against transformers' teacher-forced logits: the prompt prefilled in
/// chunks of 7 tokens next to another sequence's decode gives, for every prompt token after
/// the first, log_softmax(reference logits of the previous position) at that token, and the
/// same top alternatives; the sampled tokens stay those of transformers' greedy decode.
fn check_prompt_logprobs(name: &str) {
    let r = reference(name);
    let prompt = ids(&r["text.input_ids"]);
    let want_out = ids(&r["text.generated_ids"]);
    let logits = r["text.logits"].to_dtype(DType::F32).unwrap();
    let scale = logits.abs().unwrap().max_keepdim(1).unwrap().max(0).unwrap().to_vec1::<f32>().unwrap()[0];
    let want_lp = candle_nn::ops::log_softmax(&logits, 1).unwrap().to_vec2::<f32>().unwrap();
    let opts =
        EngineOptions { kv_memory: Some(8 << 20), max_num_batched_tokens: 7, block_size: 4, ..Default::default() };
    let mut engine = engine_with(&fixture(name), opts);
    let other = ids(&r["chat.input_ids"]);
    engine.add_request(iris::engine::Request { prompt_tokens: other, params: greedy(6) }).unwrap();
    engine.step().unwrap();
    let params = iris::engine::SamplingParams { prompt_logprobs: Some(3), ..greedy(2) };
    let id = engine.add_request(iris::engine::Request { prompt_tokens: prompt.clone(), params }).unwrap();
    let (mut got, mut out) = (None, Vec::new());
    while engine.has_work() {
        for u in engine.step().unwrap().into_iter().filter(|u| u.id == id) {
            out.push(u.token.as_ref().unwrap().token);
            if let Some(p) = u.prompt_logprobs {
                assert!(got.is_none(), "prompt logprobs come once");
                got = Some(p);
            }
        }
    }
    assert_eq!(out, want_out[..2], "{name}: asking for prompt logprobs changed the sampled tokens");
    let got = got.expect("the first token carries the prompt logprobs");
    assert_eq!(got.len(), prompt.len() - 1);
    // log_softmax moves by at most twice the largest logit error (<= 1e-4 of the scale each).
    let tol = 2.5e-4 * scale;
    for (k, e) in got.iter().enumerate() {
        let row = &want_lp[k];
        assert_eq!(e.token, prompt[k + 1]);
        let want = row[prompt[k + 1] as usize];
        assert!((e.logprob - want).abs() <= tol, "{name} prompt token {}: logprob {} vs {want}", k + 1, e.logprob);
        assert_eq!(e.top_logprobs.len(), 3);
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        for (j, &(tid, lp)) in e.top_logprobs.iter().enumerate() {
            assert!((lp - row[order[j]]).abs() <= tol, "{name} position {k} alternative {j}");
            // Ids must agree unless the reference itself is within tolerance of a tie.
            let tied = |a: usize, b: usize| (row[order[a]] - row[order[b]]).abs() <= 2.0 * tol;
            let near_tie = (j > 0 && tied(j - 1, j)) || tied(j, j + 1);
            assert!(
                near_tie || tid as usize == order[j],
                "{name} position {k}: alternative {j} is {tid}, not {}",
                order[j]
            );
        }
    }
}

/// A hybrid model's prompt prefilled in chunks of every size from 1 (token by token, as decode
/// runs) to the whole prompt: the recurrent state carries each chunk's end into the next, so
/// the logits are those of the whole prefill (the recurrence gives the same bits in any
/// chunking; the matrix products may round a row differently among fewer rows, on a GPU by up
/// to the suite's f32 tolerance: 1.02e-5 measured on the H200).
fn check_every_chunk_size(name: &str) {
    let _gpu = gpu_lock();
    let r = reference(name);
    let tokens = ids(&r["text.input_ids"]);
    let (_, whole, _) = forward_chunked(name, &tokens, usize::MAX);
    let tol = if on_gpu() { 1e-4 } else { 1e-5 };
    for chunk in 1..tokens.len() {
        let (_, chunked, _) = forward_chunked(name, &tokens, chunk);
        let e = rel_err(&chunked, &whole);
        assert!(e <= tol, "{name}: chunks of {chunk}: logits differ from the whole prefill by {e}");
    }
}

#[test]
fn qwen35_chunked_prefill_of_every_size_equals_whole_prefill() {
    check_every_chunk_size("tiny-qwen3.5");
}

#[test]
fn qwen35_moe_chunked_prefill_of_every_size_equals_whole_prefill() {
    check_every_chunk_size("tiny-qwen3.5-moe");
}

/// The KV pool of a 3:1 hybrid holds keys and values for its attention layer only; the
/// DeltaNet layers' state is per sequence, beside it.
#[test]
fn qwen35_kv_pool_covers_only_the_attention_layers() {
    let cfg = iris::loader::read_config(&fixture("tiny-qwen3.5")).unwrap().1;
    assert_eq!(cfg.attention_layers(), vec![3]);
    assert_eq!(KvCacheSpec::bytes_per_token(&cfg, KvDtype::F32), 2 * cfg.num_kv_heads * cfg.head_dim * 4);
    // 3 layers x (conv: 3 inputs of 2*32 + 64 channels; state: 4 heads x 16 x 16), f32.
    assert_eq!(cfg.state_bytes_per_sequence(), 3 * (3 * 128 + 4 * 16 * 16) * 4);
    let opts = EngineOptions { kv_memory: Some(1 << 20), max_num_seqs: 4, block_size: 4, ..Default::default() };
    let (_, report) = iris::engine::build::build_engine(&fixture("tiny-qwen3.5"), &device(), &opts).unwrap();
    let state = 4 * cfg.state_bytes_per_sequence();
    assert_eq!(report.kv_capacity_tokens, ((1 << 20) - state) / (4 * report.kv_bytes_per_token) * 4);
    assert!(report.kv_summary().contains("recurrent state of 4 sequences"), "{}", report.kv_summary());
    if on_gpu() {
        return; // speculation is refused there for hybrid models (tests/speculative.rs)
    }
    // Speculating 3 tokens, each sequence's state is kept 4 times (the live state, and the
    // state after each verified row but the last, to roll back to).
    let spec = Some(iris::engine::SpeculativeConfig { num_tokens: 3, lookup_min: 1, lookup_max: 3, adaptive: false });
    let opts = EngineOptions { speculative: spec, ..opts };
    let (_, report) = iris::engine::build::build_engine(&fixture("tiny-qwen3.5"), &device(), &opts).unwrap();
    assert_eq!(report.state_bytes_per_seq, 4 * cfg.state_bytes_per_sequence());
    let state = 4 * 4 * cfg.state_bytes_per_sequence();
    assert_eq!(report.kv_capacity_tokens, ((1 << 20) - state) / (4 * report.kv_bytes_per_token) * 4);
    assert!(report.kv_allocated_bytes >= state, "{} bytes allocated", report.kv_allocated_bytes);
}

/// Gemma 4's KV-sharing layers store nothing, so a step computes them only for the rows read
/// after it: two sequences' prompt chunks, one sampling its last row and one mid-prompt, give
/// that last row's hidden state as the whole pass does, and zeros elsewhere (never read). Its
/// pool holds the storing layers only (E2B-like: 2 sliding of 1 x 16, 1 global of 1 x 32).
#[test]
fn gemma4_shared_layers_compute_only_the_rows_read() {
    use iris::batch::{Batch, SeqSlice};
    let _gpu = gpu_lock();
    let (dev, name) = (device(), "tiny-gemma4");
    let m = iris::loader::load(&fixture(name), &dev, DType::F32).unwrap();
    let cfg = m.config().clone();
    assert_eq!(cfg.cache_layers(), vec![0, 1, 2]);
    assert_eq!(KvCacheSpec::bytes_per_token(&cfg, KvDtype::F32), 2 * (16 + 16 + 32) * 4);
    let tokens = ids(&reference(name)["text.input_ids"]);
    let (a, b) = (tokens.len(), 9);
    let spec = KvCacheSpec { block_size: 4, num_blocks: (a + b).div_ceil(4) + 2, dtype: KvDtype::F32 };
    let blocks = |r: std::ops::Range<u32>| r.collect::<Vec<u32>>();
    let seqs = vec![
        SeqSlice { q_start: 0, q_len: a, context_len: a, block_table: blocks(0..a.div_ceil(4) as u32) },
        SeqSlice {
            q_start: a,
            q_len: b,
            context_len: b,
            block_table: blocks(a.div_ceil(4) as u32..spec.num_blocks as u32),
        },
    ];
    let input: Vec<u32> = tokens.iter().chain(&tokens[..b]).copied().collect();
    let run = |output_rows: Option<Vec<usize>>| {
        let kv = KvCache::new(&cfg, spec, &dev).unwrap();
        let mut batch = Batch::from_tokens(&dev, 4, seqs.clone(), &input).unwrap();
        batch.output_rows = output_rows;
        m.model.forward(&batch, &kv, None).unwrap()
    };
    let (all, some) = (run(None), run(Some(vec![1, 0])));
    let row = |t: &Tensor, r: usize| t.get(r).unwrap();
    let e = rel_err(&row(&some, a - 1), &row(&all, a - 1));
    assert!(e <= 1e-5, "the sampled row: rel err {e}");
    let rest = Tensor::cat(&[some.narrow(0, 0, a - 1).unwrap(), some.narrow(0, a, b).unwrap()], 0).unwrap();
    assert_eq!(
        rest.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(),
        0.0,
        "rows nobody reads were computed"
    );
}

/// Speculative decoding rolls the recurrent state back from per-row checkpoints, which only
/// the CPU keeps so far: it builds there (tests/speculative.rs checks its tokens), and on a
/// GPU it is refused at start, in one line that says what to do.
#[test]
fn qwen35_speculates_on_the_cpu_only() {
    let spec =
        iris::engine::speculative::SpeculativeConfig { num_tokens: 2, lookup_min: 1, lookup_max: 3, adaptive: false };
    let opts =
        EngineOptions { kv_memory: Some(8 << 20), max_num_seqs: 4, speculative: Some(spec), ..Default::default() };
    let built = iris::engine::build::build_engine(&fixture("tiny-qwen3.5"), &device(), &opts);
    match (built, on_gpu()) {
        (Ok(_), false) => {}
        (Err(e), false) => panic!("speculation on the CPU: {e}"),
        (Ok(_), true) => panic!("speculation on a hybrid model must be refused on a GPU"),
        (Err(e), true) => {
            let err = e.to_string();
            assert!(err.contains("--speculative-config is not supported for qwen3_5 on a GPU"), "{err}");
            assert!(err.contains("run without it") && !err.contains('\n'), "{err}");
        }
    }
}

/// `iris inspect`'s counts equal transformers' (text model; the MoE's active count leaves out
/// the routed experts a token is not sent to).
#[test]
fn qwen35_and_gemma4_parameter_counts_match_transformers() {
    for name in ["tiny-qwen3.5", "tiny-qwen3.5-moe", "tiny-gemma4", "tiny-gemma4-moe", "tiny-gemma4-unified"] {
        let cfg = iris::loader::read_config(&fixture(name)).unwrap().1;
        let j = reference_json(name);
        assert_eq!(cfg.parameter_count(), j["n_text_params"].as_u64().unwrap(), "{name} total");
        assert_eq!(cfg.active_parameter_count(), j["n_active_text_params"].as_u64().unwrap(), "{name} active");
    }
}

macro_rules! parity_tests {
    ($($m:ident => $name:literal),*) => {$(
        mod $m {
            #[test]
            fn hidden_states_and_logits_match_transformers() {
                super::check_layers($name);
            }
            #[test]
            fn greedy_tokens_match_transformers() {
                super::check_greedy($name);
            }
            #[test]
            fn prompt_logprobs_match_transformers() {
                super::check_prompt_logprobs($name);
            }
            #[test]
            fn chat_template_ids_match_transformers() {
                super::check_chat_template($name);
            }
        }
    )*};
}

parity_tests!(
    llama => "tiny-llama",
    qwen2 => "tiny-qwen2",
    qwen3 => "tiny-qwen3",
    gemma3 => "tiny-gemma3",
    qwen35 => "tiny-qwen3.5",
    qwen35_moe => "tiny-qwen3.5-moe",
    gemma4 => "tiny-gemma4",
    gemma4_moe => "tiny-gemma4-moe",
    gemma4_unified => "tiny-gemma4-unified"
);
