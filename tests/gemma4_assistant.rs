//! The Gemma 4 assistant drafter (`gemma4_assistant`) against transformers 5.24
//! (tests/fixtures/tiny-gemma4-assistant, scripts/make_gemma4_assistant_fixture.py): its draft
//! logits over the target's cache, alone and batched; config refusals.

mod common;

use candle_core::{DType, Device, Tensor};
use common::{device, fixture, reference, reference_json, rel_err};
use iris::batch::{AttentionMeta, Batch, Positions, SeqSlice};
use iris::kv::{KvCache, KvCacheSpec, KvDtype};
use iris::loader::LoadedModel;
use iris::models::gemma4::{AssistantError, Gemma4Assistant};

const BS: usize = 4;

/// Prefills each prompt into its own blocks of one cache; returns the cache, each prompt's
/// block table and each prompt's last final hidden row.
fn prefill(m: &LoadedModel, dev: &Device, prompts: &[Vec<u32>]) -> (KvCache, Vec<Vec<u32>>, Vec<Tensor>) {
    let blocks: Vec<usize> = prompts.iter().map(|p| p.len().div_ceil(BS) + 1).collect();
    let spec = KvCacheSpec { block_size: BS, num_blocks: blocks.iter().sum(), dtype: KvDtype::F32 };
    let kv = KvCache::new(m.config(), spec, dev).unwrap();
    let (mut tables, mut rows, mut next) = (Vec::new(), Vec::new(), 0u32);
    for (p, &nb) in prompts.iter().zip(&blocks) {
        // Reversed block order: paging must not assume adjacency.
        let table: Vec<u32> = (next..next + nb as u32).rev().collect();
        next += nb as u32;
        let seq = SeqSlice { q_start: 0, q_len: p.len(), context_len: p.len(), block_table: table.clone() };
        let positions = Positions::Flat((0..p.len() as u32).collect());
        let batch = Batch::new(dev, BS, vec![seq], p, positions, None).unwrap();
        let h = m.model.forward(&batch, &kv, None).unwrap();
        rows.push(h.narrow(0, p.len() - 1, 1).unwrap());
        tables.push(table);
    }
    (kv, tables, rows)
}

fn argmax(t: &Tensor) -> Vec<u32> {
    t.argmax(1).unwrap().to_vec1::<u32>().unwrap()
}

/// Drafts `k` tokens for every prompt in one batch per step; returns each step's logits `[S, V]`.
fn draft(prompts: &[Vec<u32>], k: usize) -> (Vec<u32>, Vec<Tensor>) {
    let dev = device();
    let m = iris::loader::load(&fixture("tiny-gemma4"), &dev, DType::F32).unwrap();
    let a = Gemma4Assistant::load(&fixture("tiny-gemma4-assistant"), m.config(), &dev, DType::F32).unwrap();
    let (kv, tables, rows) = prefill(&m, &dev, prompts);
    let mut hidden = Tensor::cat(&rows, 0).unwrap();
    let first = argmax(&m.model.logits(&hidden).unwrap());
    let seqs = prompts
        .iter()
        .zip(tables)
        .enumerate()
        .map(|(i, (p, t))| SeqSlice { q_start: i, q_len: 1, context_len: p.len(), block_table: t })
        .collect();
    let meta = AttentionMeta::new(BS, seqs);
    let positions: Vec<u32> = prompts.iter().map(|p| p.len() as u32).collect();
    let (mut last, mut out) = (first.clone(), Vec::new());
    for _ in 0..k {
        let embeds = m.model.input_embeddings(&Tensor::new(last.as_slice(), &dev).unwrap()).unwrap();
        let step = a.step(&embeds, &hidden, &positions, &kv, &meta).unwrap();
        last = argmax(&step.logits);
        hidden = step.hidden;
        out.push(step.logits);
    }
    (first, out)
}

fn check(cases: &[&str]) {
    let r = reference("tiny-gemma4-assistant");
    let info = reference_json("tiny-gemma4-assistant");
    let prompts: Vec<Vec<u32>> = cases.iter().map(|c| common::json_ids(&info["cases"][c]["prompt"])).collect();
    let k = info["num_draft_steps"].as_u64().unwrap() as usize;
    let (first, steps) = draft(&prompts, k);
    for (i, c) in cases.iter().enumerate() {
        assert_eq!(first[i] as u64, info["cases"][c]["first_token"].as_u64().unwrap(), "{c}: target's first token");
        let want = &r[&format!("{c}.draft_logits")];
        let tokens = common::ids(&r[&format!("{c}.draft_tokens")]);
        for (s, logits) in steps.iter().enumerate() {
            let got = logits.narrow(0, i, 1).unwrap().squeeze(0).unwrap();
            let err = rel_err(&got, &want.get(s).unwrap());
            assert!(err <= 1e-4, "{c} step {s}: draft logits relative error {err}");
            assert_eq!(argmax(&got.unsqueeze(0).unwrap())[0], tokens[s], "{c} step {s}: draft token");
        }
    }
}

#[test]
fn draft_logits_match_transformers_short_prompt() {
    check(&["short"]);
}

#[test]
fn draft_logits_match_transformers_past_the_sliding_window() {
    check(&["long"]);
}

#[test]
fn draft_logits_match_transformers_batched_mixed_lengths() {
    check(&["long", "short"]);
}

fn load_err(dir: &std::path::Path, target: &str) -> String {
    let dev = device();
    let m = iris::loader::load(&fixture(target), &dev, DType::F32).unwrap();
    match Gemma4Assistant::load(dir, m.config(), &dev, DType::F32) {
        Ok(_) => panic!("{} loaded for {target}", dir.display()),
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.contains('\n'), "one line: {msg}");
            let _: &AssistantError = &e;
            msg
        }
    }
}

#[test]
fn refuses_mismatched_targets_and_non_assistants() {
    // Not a Gemma 4 target.
    let msg = load_err(&fixture("tiny-gemma4-assistant"), "tiny-gemma3");
    assert!(msg.contains("Gemma 4 target"), "{msg}");
    // A Gemma 4 target of another width (the MoE fixture is 64 wide too: edit the drafter).
    let wide = common::copy_with_config(&fixture("tiny-gemma4-assistant"), "g4a-wide", |c| {
        c["backbone_hidden_size"] = 96.into();
    });
    let msg = load_err(wide.path(), "tiny-gemma4");
    assert!(msg.contains("backbone_hidden_size is 96") && msg.contains("64"), "{msg}");
    let vocab = common::copy_with_config(&fixture("tiny-gemma4-assistant"), "g4a-vocab", |c| {
        c["text_config"]["vocab_size"] = 2048.into();
    });
    let msg = load_err(vocab.path(), "tiny-gemma4");
    assert!(msg.contains("vocab_size"), "{msg}");
    // The target itself is no assistant.
    let msg = load_err(&fixture("tiny-gemma4"), "tiny-gemma4");
    assert!(msg.contains("not a Gemma 4 assistant"), "{msg}");
    // No such directory.
    let msg = load_err(std::path::Path::new("/nonexistent/assistant"), "tiny-gemma4");
    assert!(msg.contains("cannot read"), "{msg}");
}
