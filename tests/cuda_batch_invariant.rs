//! `--batch-invariant` on CUDA with bf16 weights (the GPU's usual type, where cuBLAS and the
//! GEMV kernel round differently by row count): every request's tokens and logprobs have the
//! same bits alone, in a batch that admits the others at different steps with chunked prefill,
//! and with n-gram-style speculation (K + 1 verify rows a sequence) at K = 1, 2, 4. A test
//! binary of its own: the setting is process-wide (`iris::device::set_batch_invariant`).
//! Compiled only with `--features cuda`; run by scripts/gpu-check.sh.
#![cfg(feature = "cuda")]

mod common;

use candle_core::DType;
use common::*;
use iris::engine::build::EngineOptions;
use iris::engine::{Drafter, Engine, ReplayDrafter, Request, SamplingParams, SpeculativeConfig};

/// Each request's tokens, and the bits of their logprobs with the top 5's ids and logprobs.
type Run = Vec<(Vec<u32>, Vec<u32>)>;

fn run(engine: &mut Engine, reqs: &[(Vec<u32>, SamplingParams)], arrivals: &[usize]) -> Run {
    let mut ids = vec![None; reqs.len()];
    let mut out: Run = vec![(Vec::new(), Vec::new()); reqs.len()];
    let (mut done, mut step) = (0, 0);
    while done < reqs.len() {
        for (i, (prompt, params)) in reqs.iter().enumerate() {
            if ids[i].is_none() && arrivals[i] <= step {
                let r = Request { prompt_tokens: prompt.clone(), params: params.clone() };
                ids[i] = Some(engine.add_request(r).unwrap());
            }
        }
        for u in engine.step().unwrap() {
            let i = ids.iter().position(|x| *x == Some(u.id)).unwrap();
            if let Some(t) = &u.token {
                out[i].0.push(t.token);
                out[i].1.push(t.logprob.to_bits());
                out[i].1.extend(t.top_logprobs.iter().flat_map(|&(id, l)| [id, l.to_bits()]));
            }
            done += u.finish.is_some() as usize;
        }
        step += 1;
        assert!(step < 100_000, "engine did not finish");
    }
    out
}

/// Greedy requests with logprobs for prompts of 3 to 45 tokens that repeat themselves.
fn requests(vocab: u32) -> Vec<(Vec<u32>, SamplingParams)> {
    let prompts = repeating_prompts(vocab, &[3, 17, 9, 45, 6, 30, 12, 24], 0x2545f4914f6cdd1d);
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p, SamplingParams { logprobs: Some(5), ..greedy(10 + i % 4 * 3) }))
        .collect()
}

/// `IRIS_TEST_BATCH_INVARIANT=0` builds the engines without the setting: the test then fails,
/// which shows it can (docs/benchmarks.md has the run).
fn options() -> EngineOptions {
    EngineOptions {
        dtype: DType::BF16,
        batch_invariant: std::env::var("IRIS_TEST_BATCH_INVARIANT").map_or(true, |v| v != "0"),
        kv_memory: Some(1 << 21),
        block_size: 4,
        max_num_seqs: 8,
        // Prompts split over steps, beside other sequences' decodes.
        max_num_batched_tokens: 24,
        ..Default::default()
    }
}

#[test]
fn bf16_logits_do_not_depend_on_the_batch_or_on_speculation() {
    let _gpu = gpu_lock();
    if !on_gpu() {
        return;
    }
    for name in TINY_MODELS {
        let path = fixture(name);
        let vocab = iris::loader::read_config(&path).unwrap().1.vocab_size as u32;
        let reqs = requests(vocab);
        let alone: Run = reqs
            .iter()
            .map(|r| run(&mut engine_with(&path, options()), std::slice::from_ref(r), &[0]).remove(0))
            .collect();
        let arrivals: Vec<usize> = (0..reqs.len()).map(|i| i * 2).collect();
        let batched = run(&mut engine_with(&path, options()), &reqs, &arrivals);
        for (i, (a, b)) in alone.iter().zip(&batched).enumerate() {
            assert_eq!(a.0, b.0, "{name}: request {i}'s tokens differ in a batch");
            assert_eq!(a.1, b.1, "{name}: request {i}'s logprobs differ in a batch");
        }
        // Drafts from each request's own output with every fifth token changed: accepted up to
        // the change, rejected there, so verify steps of every length run.
        for k in [1, 2, 4] {
            let opts = EngineOptions {
                speculative: Some(SpeculativeConfig { num_tokens: k, lookup_min: 1, lookup_max: 3, adaptive: false }),
                ..options()
            };
            let mut e = engine_with(&path, opts);
            let recorded = reqs
                .iter()
                .zip(&alone)
                .map(|((p, _), (out, _))| {
                    let changed = out.iter().enumerate().map(|(j, &t)| if j % 5 == 3 { t ^ 1 } else { t });
                    (p.len(), p.iter().copied().chain(changed).collect())
                })
                .collect();
            e.set_drafter(Drafter::Replay(ReplayDrafter::new(k, recorded))).unwrap();
            let spec = run(&mut e, &reqs, &arrivals);
            let s = &e.stats.spec;
            let (drafted, accepted) = (s.num_draft_tokens, s.num_accepted_tokens);
            assert!(accepted > 0 && accepted < drafted, "{name} K={k}: {accepted} of {drafted} drafts accepted");
            for (i, (a, b)) in alone.iter().zip(&spec).enumerate() {
                assert_eq!(a.0, b.0, "{name} K={k}: request {i}'s tokens differ with speculation");
                assert_eq!(a.1, b.1, "{name} K={k}: request {i}'s logprobs differ with speculation");
            }
        }
    }
}

/// With the setting, every 16-bit product with K in whole 16-wide steps takes the invariant
/// kernels, at any row count.
#[test]
fn every_row_count_takes_the_invariant_products() {
    use iris::ops::invariant_matmul::InvariantMatmul;
    if !on_gpu() {
        return;
    }
    iris::device::set_batch_invariant(true);
    let dev = device();
    let t = |m: usize, k: usize| candle_core::Tensor::zeros((m, k), DType::BF16, &dev).unwrap();
    for m in [1, 8, 64, 65, 4096] {
        assert!(InvariantMatmul::applies(&t(m, 64), &t(32, 64)), "{m} rows");
    }
    assert!(!InvariantMatmul::applies(&t(1, 40), &t(32, 40)));
}

/// f32 on CUDA runs cuBLAS and the GEMV kernel, which `--batch-invariant` does not replace: refused.
#[test]
fn f32_on_cuda_is_refused() {
    let _gpu = gpu_lock();
    if !on_gpu() {
        return;
    }
    let opts = EngineOptions { dtype: DType::F32, ..options() };
    let err = iris::engine::build::build_engine(&fixture("tiny-llama"), &device(), &opts).err().expect("refused");
    assert!(err.to_string().contains("--batch-invariant on CUDA takes --dtype bf16 or f16"), "{err}");
}
