//! A sequence's tokens do not depend on what else is in its batch: 10 prompts of different
//! lengths arriving at different steps, prefilled in chunks next to other sequences' decodes,
//! with a KV pool small enough to force preemption, each give exactly the tokens they give
//! alone (f32, greedy; and seeded sampling).

mod common;

use common::*;
use iris::engine::build::EngineOptions;
use iris::engine::SamplingParams;

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    // Deterministic pseudo-random token ids; lengths 3..=45 straddle block and chunk sizes.
    let lens = [3, 17, 9, 45, 1, 30, 12, 24, 7, 38];
    let mut x: u64 = 0x9e3779b97f4a7c15;
    lens.iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % (vocab as u64 - 10)) as u32 + 5
                })
                .collect()
        })
        .collect()
}

fn check(name: &str) {
    let _gpu = gpu_lock();
    let path = fixture(name);
    let vocab = iris::loader::read_config(&path).unwrap().1.vocab_size as u32;
    let ps = prompts(vocab);
    let reqs: Vec<(Vec<u32>, SamplingParams)> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut params = greedy(12 + i % 5);
            if i % 3 == 2 {
                // Seeded sampling must be batch-invariant too.
                params.temperature = 0.8;
                params.top_p = 0.9;
                params.seed = Some(1000 + i as u64);
            }
            (p.clone(), params)
        })
        .collect();

    let solo: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let mut e =
                engine_with(&path, EngineOptions { kv_memory: Some(1 << 20), block_size: 4, ..Default::default() });
            run_requests(&mut e, std::slice::from_ref(r), &[0]).remove(0)
        })
        .collect();

    // 24 blocks of 4 tokens cannot hold all ten sequences (up to 45 + 16 tokens each):
    // the scheduler must preempt. A budget of 16 tokens per step chunks the long prompts.
    let bytes_per_block = {
        let cfg = iris::loader::read_config(&path).unwrap().1;
        iris::kv::KvCacheSpec::bytes_per_token(&cfg, iris::kv::KvDtype::F32) * 4
    };
    let opts = EngineOptions {
        kv_memory: Some(24 * bytes_per_block as u64),
        block_size: 4,
        max_num_batched_tokens: 16,
        max_num_seqs: 8,
        max_model_len: Some(90),
        ..Default::default()
    };
    let mut engine = engine_with(&path, opts);
    let arrivals = [0, 0, 1, 2, 3, 3, 5, 8, 13, 21];
    let mixed = run_requests(&mut engine, &reqs, &arrivals);
    assert!(engine.stats.preemptions > 0, "{name}: the test meant to force preemption but none happened");
    for (i, (m, s)) in mixed.iter().zip(&solo).enumerate() {
        assert_eq!(m, s, "{name}: request {i} (prompt of {} tokens) differs in a mixed batch", ps[i].len());
    }
    // Every block is back once all sequences are done.
    let sched = engine.scheduler();
    assert_eq!(sched.allocator.num_free(), sched.allocator.num_blocks());
}

#[test]
fn llama_is_batch_invariant() {
    check("tiny-llama");
}

#[test]
fn qwen3_is_batch_invariant() {
    check("tiny-qwen3");
}

#[test]
fn gemma3_is_batch_invariant() {
    check("tiny-gemma3");
}
