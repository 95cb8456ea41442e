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

/// Image and text requests to a vision-language model: eight requests (image prompts of one
/// and two images, text prompts, repeated images) arriving at different steps, image prompts
/// prefilled in chunks of at most 16 tokens that cut through their image-token runs, next to
/// other sequences' decodes, with preemption; each gives exactly the tokens it gives alone.
fn check_vl(name: &str) {
    use iris::engine::{ImageInput, Request};
    use iris::media::{decode_image, DecodeLimits};

    let path = fixture(name);
    let r = reference(name);
    let j = reference_json(name);
    let vision = iris::loader::load(&path, &candle_core::Device::Cpu, candle_core::DType::F32).unwrap().vision.unwrap();
    let case = |c: &str| -> (Vec<u32>, Vec<ImageInput>) {
        let images = j["cases"][c]["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| {
                let bytes = std::fs::read(path.join(f.as_str().unwrap())).unwrap();
                ImageInput::new(vision.preprocess(&decode_image(&bytes, &DecodeLimits::default()).unwrap()).unwrap())
            })
            .collect();
        (ids(&r[&format!("{c}.input_ids")]), images)
    };
    let vocab = iris::loader::read_config(&path).unwrap().1.vocab_size as u32;
    let text = prompts(vocab - 64); // below the special tokens
    let reqs: Vec<(Vec<u32>, Vec<ImageInput>)> = vec![
        case("multi"),
        (text[3].clone(), vec![]),
        case("single"),
        case("nonsquare"),
        (text[1].clone(), vec![]),
        case("single"), // the same image again: its embeddings come from the cache
        (text[5].clone(), vec![]),
        case("multi"),
    ];
    let run = |engine: &mut iris::engine::Engine, which: &[usize], arrivals: &[usize]| -> Vec<Vec<u32>> {
        let mut ids = vec![None; which.len()];
        let mut outs = vec![Vec::new(); which.len()];
        let (mut done, mut step) = (0, 0);
        while done < which.len() {
            for (slot, &i) in which.iter().enumerate() {
                if ids[slot].is_none() && arrivals[slot] <= step {
                    let (p, imgs) = &reqs[i];
                    let req = Request { prompt_tokens: p.clone(), params: greedy(8 + i % 4) };
                    ids[slot] = Some(engine.add_request_with_images(req, imgs.clone()).unwrap());
                }
            }
            for u in engine.step().unwrap() {
                let slot = ids.iter().position(|x| *x == Some(u.id)).unwrap();
                outs[slot].extend(u.token.map(|t| t.token));
                done += u.finish.is_some() as usize;
            }
            step += 1;
            assert!(step < 10_000, "engine did not finish");
        }
        outs
    };
    let solo: Vec<Vec<u32>> = (0..reqs.len())
        .map(|i| {
            let mut e =
                engine_with(&path, EngineOptions { kv_memory: Some(1 << 20), block_size: 4, ..Default::default() });
            run(&mut e, &[i], &[0]).remove(0)
        })
        .collect();
    let bytes_per_block = {
        let cfg = iris::loader::read_config(&path).unwrap().1;
        iris::kv::KvCacheSpec::bytes_per_token(&cfg, iris::kv::KvDtype::F32) * 4
    };
    let opts = EngineOptions {
        kv_memory: Some(60 * bytes_per_block as u64),
        block_size: 4,
        max_num_batched_tokens: 16,
        max_num_seqs: 6,
        max_model_len: Some(140),
        ..Default::default()
    };
    let mut engine = engine_with(&path, opts);
    let all: Vec<usize> = (0..reqs.len()).collect();
    let mixed = run(&mut engine, &all, &[0, 0, 1, 3, 4, 6, 9, 15]);
    assert!(engine.stats.preemptions > 0, "{name}: the test meant to force preemption but none happened");
    assert!(engine.embed_cache().hits > 0, "{name}: the repeated images should hit the embedding cache");
    for (i, (m, s)) in mixed.iter().zip(&solo).enumerate() {
        assert_eq!(m, s, "{name}: request {i} ({} images) differs in a mixed batch", reqs[i].1.len());
    }
    let sched = engine.scheduler();
    assert_eq!(sched.allocator.num_free(), sched.allocator.num_blocks());
}

#[test]
fn qwen2_vl_is_batch_invariant() {
    check_vl("tiny-qwen2-vl");
}

#[test]
fn qwen2_5_vl_is_batch_invariant() {
    check_vl("tiny-qwen2.5-vl");
}
