use super::*;
use crate::batch::SeqSlice;
use candle_core::{DType, Device};

/// Attention computed directly from each sequence's keys and values by position, in f64
/// (rows in one of the meta's bidirectional ranges read to its end).
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &[f32],
    k_at: &dyn Fn(usize, usize, usize) -> Vec<f32>,
    v_at: &dyn Fn(usize, usize, usize) -> Vec<f32>,
    meta: &AttentionMeta,
    hq: usize,
    hkv: usize,
    d: usize,
    scale: f64,
    window: Option<usize>,
    softcap: Option<f64>,
) -> Vec<f32> {
    let mut out = vec![0f32; q.len()];
    for t in 0..meta.num_rows() {
        let si = meta.row_seq[t] as usize;
        let seq = &meta.seqs[si];
        let pos = seq.first_position() + t - seq.q_start;
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let ranges = meta.bidirectional.as_ref().map_or(&[][..], |r| &r[si][..]);
        let end = ranges.iter().find(|&&(a, b)| a <= pos && pos < b).map_or(pos + 1, |&(_, b)| b);
        for h in 0..hq {
            let g = h / (hq / hkv);
            let qh = &q[(t * hq + h) * d..(t * hq + h + 1) * d];
            let s: Vec<f64> = (lo..end)
                .map(|j| k_at(si, j, g).iter().zip(qh).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale)
                .map(|x| softcap.map_or(x, |c| (x / c).tanh() * c))
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let z: f64 = e.iter().sum();
            for (jj, j) in (lo..end).enumerate() {
                let vj = v_at(si, j, g);
                for c in 0..d {
                    out[(t * hq + h) * d + c] += (e[jj] / z * vj[c] as f64) as f32;
                }
            }
        }
    }
    out
}

/// The op on every instruction set this CPU has against `reference`: each output within 1e-5
/// (outputs are averages of values of about unit size), all with the portable kernel's bits.
fn assert_matches_reference(
    meta: &AttentionMeta,
    q: &Tensor,
    (kc, vc): (&Tensor, &Tensor),
    (hq, hkv, d): (usize, usize, usize),
    (window, softcap, bidirectional): (Option<usize>, Option<f64>, bool),
    case: &str,
) {
    let bs = meta.block_size;
    let kv: Vec<f32> = kc.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let vv: Vec<f32> = vc.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    let slot = |si: usize, j: usize| meta.seqs[si].block_table[j / bs] as usize * bs + j % bs;
    let k_at = |si: usize, j: usize, g: usize| kv[(slot(si, j) * hkv + g) * d..][..d].to_vec();
    let v_at = |si: usize, j: usize, g: usize| vv[(slot(si, j) * hkv + g) * d..][..d].to_vec();
    let scale = 1.0 / (d as f64).sqrt();
    let qv: Vec<f32> = q.flatten_all().unwrap().to_vec1().unwrap();
    let want = reference(&qv, &k_at, &v_at, meta, hq, hkv, d, scale, window, softcap);
    let mut portable: Option<Vec<u32>> = None;
    for isa in Isa::available().into_iter().rev() {
        let op = PagedAttention {
            meta,
            num_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            scale: scale as f32,
            window,
            softcap: softcap.map(|c| c as f32),
            isa,
            bidirectional,
        };
        let got: Vec<f32> = op.forward(q, kc, vc).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-5, "{case} {isa:?}: row {} head {}: {a} vs {b}", i / (hq * d), i / d % hq);
        }
        let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
        match &portable {
            None => portable = Some(bits),
            Some(p) => assert!(p == &bits, "{case}: {isa:?} differs from the portable kernel"),
        }
    }
}

/// Three sequences in one call: a 5-token chunk after a 30-token cached prefix, a decode
/// at position 40, and a 21-token chunk after 39 (several tiles of rows, spans across
/// 16-key groups); blocks deliberately out of order. Every head size the models use (and
/// 48, which has no compile-time size), GQA, sliding windows, softcap, f32, bf16 and f16
/// caches.
#[test]
fn matches_direct_attention_for_every_head_dim() {
    let dev = Device::Cpu;
    let (bs, hq, hkv) = (4, 6, 2);
    let cases = [32, 48, 64, 80, 96, 128, 256].into_iter().flat_map(|d| {
        [(None, None), (Some(7), None), (Some(20), Some(5.0)), (None, Some(3.0))].map(|(w, c)| (d, w, c))
    });
    for (d, window, softcap) in cases {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let seqs = vec![
                SeqSlice { q_start: 0, q_len: 5, context_len: 35, block_table: (0..9).rev().collect() },
                SeqSlice { q_start: 5, q_len: 1, context_len: 41, block_table: (9..20).collect() },
                SeqSlice { q_start: 6, q_len: 21, context_len: 60, block_table: (20..35).rev().collect() },
                // Contexts over several softmax segments: a prompt chunk and a decode.
                SeqSlice { q_start: 27, q_len: 20, context_len: 600, block_table: (35..185).rev().collect() },
                SeqSlice { q_start: 47, q_len: 1, context_len: 701, block_table: (185..361).collect() },
            ];
            let meta = AttentionMeta::new(bs, seqs);
            let slots = 361 * bs;
            let kc = Tensor::randn(0f32, 1.0, (slots, hkv, d), &dev).unwrap().to_dtype(dtype).unwrap();
            let vc = Tensor::randn(0f32, 1.0, (slots, hkv, d), &dev).unwrap().to_dtype(dtype).unwrap();
            let q = Tensor::randn(0f32, 1.0, (meta.num_rows(), hq, d), &dev).unwrap();
            let case = format!("d={d} window={window:?} softcap={softcap:?} {dtype:?}");
            assert_matches_reference(&meta, &q, (&kc, &vc), (hq, hkv, d), (window, softcap, false), &case);
        }
    }
}

/// The tiled kernel against the direct computation where its blocking has edges: GQA groups
/// of 1, 3 and 7 query heads (blocks of heads that cut rows), head sizes 64 to 256, prompt
/// chunks that leave a partial tile (37 rows: 16 + 16 + 5) over contexts that are multiples
/// of neither the key block (64), the softmax segment (256) nor the cache block (16); causal
/// edges, windows wider and narrower than a tile (a tile's rows then share no position), a
/// softcap, an image range seen both ways across a tile border, and a lone decode row.
#[test]
fn tiles_match_direct_attention_at_their_edges() {
    let dev = Device::Cpu;
    let (bs, hkv) = (16, 2);
    let cases = [1, 3, 7].into_iter().flat_map(|group| [64, 80, 128, 256].map(move |d| (group, d)));
    for (group, d) in cases {
        let hq = hkv * group;
        for (window, softcap, bidi) in
            [(None, None, false), (Some(50), None, false), (Some(5), Some(4.0), false), (None, None, true)]
        {
            let seqs = vec![
                SeqSlice { q_start: 0, q_len: 37, context_len: 337, block_table: (0..22).rev().collect() },
                SeqSlice { q_start: 37, q_len: 1, context_len: 299, block_table: (22..41).collect() },
                SeqSlice { q_start: 38, q_len: 20, context_len: 20, block_table: (41..43).collect() },
            ];
            let mut meta = AttentionMeta::new(bs, seqs);
            if bidi {
                // Positions 310..330 of the first sequence (its rows 10..30: across the border
                // of its first two tiles), and 3..9 of the third.
                meta.set_bidirectional(vec![vec![(310, 330)], vec![], vec![(3, 9)]]).unwrap();
            }
            let slots = 43 * bs;
            let kc = Tensor::randn(0f32, 1.0, (slots, hkv, d), &dev).unwrap();
            let vc = Tensor::randn(0f32, 1.0, (slots, hkv, d), &dev).unwrap();
            let q = Tensor::randn(0f32, 1.0, (meta.num_rows(), hq, d), &dev).unwrap();
            let case = format!("group={group} d={d} window={window:?} softcap={softcap:?} bidi={bidi}");
            assert_matches_reference(&meta, &q, (&kc, &vc), (hq, hkv, d), (window, softcap, bidi), &case);
        }
    }
}

/// Caches of another shape than `[slots, kv heads, head dim]` are refused (the kernels
/// read them by raw offsets), as are query heads that do not group over the kv heads.
#[test]
fn caches_of_the_wrong_shape_are_refused() {
    let dev = Device::Cpu;
    let seq = SeqSlice { q_start: 0, q_len: 1, context_len: 4, block_table: vec![0] };
    let meta = AttentionMeta::new(4, vec![seq]);
    let q = Tensor::zeros((1, 4, 16), DType::F32, &dev).unwrap();
    let op = |hkv| PagedAttention {
        meta: &meta,
        num_heads: 4,
        num_kv_heads: hkv,
        head_dim: 16,
        scale: 0.25,
        window: None,
        softcap: None,
        isa: Isa::active(),
        bidirectional: false,
    };
    for dtype in [DType::F32, DType::BF16] {
        let good = Tensor::zeros((4, 2, 16), dtype, &dev).unwrap();
        assert!(op(2).forward(&q, &good, &good).is_ok());
        for bad in [(4, 1, 32), (4, 4, 8), (2, 2, 32)] {
            let k = Tensor::zeros(bad, dtype, &dev).unwrap();
            let err = op(2).forward(&q, &k, &k).unwrap_err().to_string();
            assert!(err.contains("caches must be"), "{bad:?}: {err}");
        }
        let flat = Tensor::zeros(128, dtype, &dev).unwrap();
        assert!(op(2).forward(&q, &flat, &flat).is_err());
        assert!(op(2).forward(&q, &good, &Tensor::zeros((4, 2, 8), dtype, &dev).unwrap()).is_err());
        assert!(op(3).forward(&q, &good, &good).is_err());
    }
}

/// A row's output has the same bits however its prompt is cut into steps (whole, in
/// chunks of 5, 16 and 100, token by token), so however the op tiles its rows and whether
/// its segments are folded within a tile or by the merge loop of a lone row.
#[test]
fn rows_have_the_same_bits_in_any_tile() {
    let dev = Device::Cpu;
    let (bs, hq, hkv) = (4, 6, 2);
    // 45 positions: one softmax segment; 600: three (and a window across their borders).
    let cases = [
        (45usize, 64, None, None, DType::F32),
        (45, 80, Some(20), None, DType::BF16),
        (45, 48, None, Some(5.0), DType::F16),
        (45, 128, Some(9), Some(5.0), DType::F32),
        (600, 64, None, None, DType::F32),
        (600, 80, Some(300), Some(5.0), DType::BF16),
    ];
    for (n, d, window, softcap, dtype) in cases {
        let table: Vec<u32> = (0..n.div_ceil(bs) as u32).rev().collect();
        let shape = (table.len() * bs, hkv, d);
        let kc = Tensor::randn(0f32, 1.0, shape, &dev).unwrap().to_dtype(dtype).unwrap();
        let vc = Tensor::randn(0f32, 1.0, shape, &dev).unwrap().to_dtype(dtype).unwrap();
        let qv: Vec<f32> =
            Tensor::randn(0f32, 1.0, (n, hq, d), &dev).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let run = |chunk: usize| -> Vec<f32> {
            let mut out = Vec::new();
            for start in (0..n).step_by(chunk) {
                let end = (start + chunk).min(n);
                let seq = SeqSlice { q_start: 0, q_len: end - start, context_len: end, block_table: table.clone() };
                let meta = AttentionMeta::new(bs, vec![seq]);
                let q =
                    Tensor::from_vec(qv[start * hq * d..end * hq * d].to_vec(), (end - start, hq, d), &dev).unwrap();
                let op = PagedAttention {
                    meta: &meta,
                    num_heads: hq,
                    num_kv_heads: hkv,
                    head_dim: d,
                    scale: 1.0 / (d as f32).sqrt(),
                    window,
                    softcap,
                    isa: Isa::active(),
                    bidirectional: false,
                };
                out.extend(op.forward(&q, &kc, &vc).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap());
            }
            out
        };
        let whole = run(n);
        for chunk in [1, 5, 16, 100] {
            assert!(
                whole.iter().map(|x| x.to_bits()).eq(run(chunk).iter().map(|x| x.to_bits())),
                "n={n} d={d} window={window:?} softcap={softcap:?} {dtype:?}: chunks of {chunk} differ"
            );
        }
    }
}
