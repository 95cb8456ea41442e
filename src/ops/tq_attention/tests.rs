use std::sync::Arc;

use super::*;
use crate::batch::{AttentionMeta, SeqSlice};
use crate::ops::turboquant::{Codebook, FloatWindow, LayerCodecs};
use candle_core::{DType, Device};

fn randn(shape: (usize, usize, usize), seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut unit = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..shape.0 * shape.1 * shape.2)
        .map(|_| ((-2.0 * unit().ln()).sqrt() * (std::f64::consts::TAU * unit()).cos()) as f32)
        .collect()
}

fn layer(
    d: usize,
    hkv: usize,
    slots: usize,
    bits: (u8, u8),
    window: usize,
    rings: usize,
    float: DType,
) -> TqLayerCache {
    let dev = Device::Cpu;
    let codecs = LayerCodecs::for_layer(
        3,
        d,
        &Arc::new(Codebook::lloyd_max(d, bits.0)),
        &Arc::new(Codebook::lloyd_max(d, bits.1)),
    );
    let floats = || Tensor::zeros((rings * window, hkv, d), float, &dev).unwrap();
    TqLayerCache {
        k: Tensor::zeros((slots, hkv, codecs.key.row_bytes()), DType::U8, &dev).unwrap(),
        v: Tensor::zeros((slots, hkv, codecs.value.row_bytes()), DType::U8, &dev).unwrap(),
        window: (window > 0).then(|| FloatWindow { len: window, k: floats(), v: floats() }),
        device: None,
        codecs,
    }
}

fn attn(meta: &AttentionMeta, hq: usize, hkv: usize, d: usize, window: Option<usize>) -> PagedAttention<'_> {
    PagedAttention {
        meta,
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: d,
        scale: 1.0 / (d as f32).sqrt(),
        window,
        softcap: None,
        isa: crate::simd::Isa::active(),
        bidirectional: false,
    }
}

/// Every slot's vectors decoded back to floats: `[slots, hkv, d]`.
fn dequantize(codes: &Tensor, codec: &TqCodec) -> Vec<f32> {
    let (d, row) = (codec.dim(), codec.row_bytes());
    let bytes: Vec<u8> = codes.flatten_all().unwrap().to_vec1().unwrap();
    let mut out = vec![0f32; bytes.len() / row * d];
    let mut y = vec![0f32; d];
    for (r, o) in bytes.chunks_exact(row).zip(out.chunks_exact_mut(d)) {
        codec.decode(r, o, &mut y);
    }
    out
}

/// Attention on codes equals attention on the dequantized cache (f64 reference), for two
/// sequences in one call (a 5-row chunk after a 30-token prefix, a decode at 40; blocks
/// out of order), GQA, head dims with Hadamard and dense rotations, sliding windows, and
/// float windows whose keys come from the rings and from the step's own rows. Without a
/// float window it is also checked against the dense op run on the dequantized cache.
#[test]
fn codes_match_dequantize_then_attend() {
    let dev = Device::Cpu;
    let (bs, hq, hkv) = (4, 6, 2);
    // Short contexts (one softmax segment), and long ones: a chunk of 20 rows ending at
    // 600 and a decode at 700 span several segments.
    let short = vec![
        SeqSlice { q_start: 0, q_len: 5, context_len: 35, block_table: (0..9).rev().collect() },
        SeqSlice { q_start: 5, q_len: 1, context_len: 41, block_table: (9..20).collect() },
    ];
    let long = vec![
        SeqSlice { q_start: 0, q_len: 20, context_len: 600, block_table: (0..150).rev().collect() },
        SeqSlice { q_start: 20, q_len: 1, context_len: 701, block_table: (150..326).collect() },
    ];
    let cases = [(32, (3, 4), &short), (64, (2, 3), &short), (80, (4, 4), &short), (128, (3, 4), &short)];
    let cases = cases.into_iter().chain([(256, (2, 2), &short), (64, (3, 4), &long), (96, (4, 3), &long)]);
    for (d, bits, seqs) in cases {
        for sliding in [None, Some(7), Some(300)] {
            for fw in [0, 3, 9] {
                let mut meta = AttentionMeta::new(bs, seqs.clone());
                if fw > 0 {
                    meta.set_float_window(fw, vec![1, 0]).unwrap();
                }
                let slots = meta.seqs.iter().map(|s| s.block_table.len()).sum::<usize>() * bs;
                let c = layer(d, hkv, slots, bits, fw, 2, DType::F32);
                // Original keys and values of every slot, all quantized into the cache.
                let (ko, vo) = (randn((slots, hkv, d), d as u64), randn((slots, hkv, d), d as u64 + 1));
                let all: Vec<u32> = (0..slots as u32).collect();
                let kt = Tensor::from_vec(ko.clone(), (slots, hkv, d), &dev).unwrap();
                let vt = Tensor::from_vec(vo.clone(), (slots, hkv, d), &dev).unwrap();
                // Half the cases scale the keys' channels (as calibration does).
                let key_scale: Option<Vec<f32>> =
                    (fw != 3).then(|| (0..hkv * d).map(|i| 0.3 + (i as f32 * 0.37).sin().abs() * 2.0).collect());
                let scale = key_scale.as_deref();
                c.k.inplace_op2(&kt, &TqWrite { slot_mapping: &all, codec: &c.codecs.key, scale, device: None })
                    .unwrap();
                c.v.inplace_op2(
                    &vt,
                    &TqWrite { slot_mapping: &all, codec: &c.codecs.value, scale: None, device: None },
                )
                .unwrap();
                let mut kd = dequantize(&c.k, &c.codecs.key);
                if let Some(s) = scale {
                    for (i, x) in kd.iter_mut().enumerate() {
                        *x /= s[i % (hkv * d)];
                    }
                }
                let vd = dequantize(&c.v, &c.codecs.value);
                let slot = |si: usize, j: usize| meta.seqs[si].block_table[j / bs] as usize * bs + j % bs;
                // The float rows: this step's from the originals, older ones in the rings.
                let rows = meta.num_rows();
                let pick = |src: &[f32]| -> Vec<f32> {
                    meta.slot_mapping.iter().flat_map(|&s| src[s as usize * hkv * d..][..hkv * d].to_vec()).collect()
                };
                let (new_k, new_v) = (pick(&ko), pick(&vo));
                let (new_kt, new_vt) = (
                    Tensor::from_vec(new_k, (rows, hkv, d), &dev).unwrap(),
                    Tensor::from_vec(new_v, (rows, hkv, d), &dev).unwrap(),
                );
                if let Some(w) = &c.window {
                    let mut rk = vec![0f32; 2 * fw * hkv * d];
                    let mut rv = rk.clone();
                    for (si, s) in meta.seqs.iter().enumerate() {
                        let first = s.first_position();
                        for j in first.saturating_sub(fw)..first {
                            let r = meta.window.as_ref().unwrap().rings[si] as usize * fw + j % fw;
                            rk[r * hkv * d..][..hkv * d].copy_from_slice(&ko[slot(si, j) * hkv * d..][..hkv * d]);
                            rv[r * hkv * d..][..hkv * d].copy_from_slice(&vo[slot(si, j) * hkv * d..][..hkv * d]);
                        }
                    }
                    let shape = (2 * fw, hkv, d);
                    w.k.slice_set(&Tensor::from_vec(rk, shape, &dev).unwrap(), 0, 0).unwrap();
                    w.v.slice_set(&Tensor::from_vec(rv, shape, &dev).unwrap(), 0, 0).unwrap();
                }
                let q = Tensor::randn(0f32, 1.0, (rows, hq, d), &dev).unwrap();
                let qv: Vec<f32> = q.flatten_all().unwrap().to_vec1().unwrap();
                let a = attn(&meta, hq, hkv, d, sliding);
                // The op with attention `a`, over the cache and this step's float rows.
                let run = |a: PagedAttention<'_>| -> Vec<f32> {
                    let float = c.window.as_ref().map(|w| FloatInputs {
                        len: fw,
                        ring_k: &w.k,
                        ring_v: &w.v,
                        new_k: &new_kt,
                        new_v: &new_vt,
                    });
                    let op = TqAttention {
                        attn: a,
                        key: &c.codecs.key,
                        value: &c.codecs.value,
                        key_scale: scale,
                        float,
                        device: None,
                    };
                    op.forward(&q, &c.k, &c.v).unwrap().flatten_all().unwrap().to_vec1().unwrap()
                };
                let got = run(a);

                // f64 reference: row at p reads j in (p - fw, p] from the originals.
                let mut want = vec![0f64; got.len()];
                for t in 0..rows {
                    let si = meta.row_seq[t] as usize;
                    let s = &meta.seqs[si];
                    let p = s.first_position() + t - s.q_start;
                    let lo = sliding.map_or(0, |w| (p + 1).saturating_sub(w));
                    for h in 0..hq {
                        let g = h / (hq / hkv);
                        let at = |src_f: &[f32], src_q: &[f32], j: usize| -> Vec<f64> {
                            let src = if p - j < fw { src_f } else { src_q };
                            src[(slot(si, j) * hkv + g) * d..][..d].iter().map(|x| *x as f64).collect()
                        };
                        let qh = &qv[(t * hq + h) * d..][..d];
                        let sc: Vec<f64> = (lo..=p)
                            .map(|j| {
                                let k = at(&ko, &kd, j);
                                k.iter().zip(qh).map(|(a, b)| a * *b as f64).sum::<f64>() / (d as f64).sqrt()
                            })
                            .collect();
                        let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                        let z: f64 = e.iter().sum();
                        for (jj, j) in (lo..=p).enumerate() {
                            let v = at(&vo, &vd, j);
                            for i in 0..d {
                                want[(t * hq + h) * d + i] += e[jj] / z * v[i];
                            }
                        }
                    }
                }
                let err = got.iter().zip(&want).map(|(a, b)| (*a as f64 - b).abs()).fold(0.0, f64::max);
                assert!(err < 1e-4, "d={d} bits={bits:?} sliding={sliding:?} float window {fw}: max error {err}");
                // Every instruction set this CPU has gives the same bits.
                for isa in crate::simd::Isa::available() {
                    let other = run(PagedAttention { isa, ..attn(&meta, hq, hkv, d, sliding) });
                    assert!(
                        other.iter().map(|v| v.to_bits()).eq(got.iter().map(|v| v.to_bits())),
                        "d={d} bits={bits:?} sliding={sliding:?} float window {fw}: {isa:?} differs"
                    );
                }

                if fw == 0 {
                    let kdt = Tensor::from_vec(kd.clone(), (slots, hkv, d), &dev).unwrap();
                    let vdt = Tensor::from_vec(vd.clone(), (slots, hkv, d), &dev).unwrap();
                    let dense: Vec<f32> = attn(&meta, hq, hkv, d, sliding)
                        .forward(&q, &kdt, &vdt)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    let err = got.iter().zip(&dense).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(err < 1e-4, "d={d} bits={bits:?} sliding={sliding:?}: {err} from the dense op");
                }
            }
        }
    }
}

/// One sequence's 23 tokens written and attended in one chunk, in chunks of 7, and one at
/// a time give bit-identical outputs, with and without a float window (bf16 rings too).
#[test]
fn prefill_equals_token_by_token() {
    // 23 tokens, one softmax segment; 600 tokens, three.
    for n in [23, 600] {
        prefill_equals_token_by_token_for(n);
    }
}

fn prefill_equals_token_by_token_for(n: usize) {
    let dev = Device::Cpu;
    let (bs, hq, hkv, d) = (4, 4, 2, 64);
    let (ks, vs, qs) = (randn((n, hkv, d), 1), randn((n, hkv, d), 2), randn((n, hq, d), 3));
    let configs = [(0, DType::F32, None), (5, DType::F32, None), (6, DType::BF16, Some(9)), (4, DType::F32, Some(300))];
    for (fw, ring_dtype, sliding) in configs {
        let run = |chunk: usize| -> Vec<f32> {
            let table: Vec<u32> = (0..n.div_ceil(bs) as u32).rev().collect();
            let mut c = layer(d, hkv, table.len() * bs, (3, 4), fw, 3, ring_dtype);
            if fw == 5 {
                c.codecs.key_scale = Some((0..hkv * d).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect());
            }
            let mut out = Vec::new();
            let mut start = 0;
            while start < n {
                let end = (start + chunk).min(n);
                let seq = SeqSlice { q_start: 0, q_len: end - start, context_len: end, block_table: table.clone() };
                let mut meta = AttentionMeta::new(bs, vec![seq]);
                if fw > 0 {
                    meta.set_float_window(fw, vec![2]).unwrap();
                }
                let rows = |src: &[f32], h: usize| {
                    Tensor::from_vec(src[start * h * d..end * h * d].to_vec(), (end - start, h, d), &dev).unwrap()
                };
                let o = write_and_attend(
                    attn(&meta, hq, hkv, d, sliding),
                    &c,
                    &rows(&qs, hq),
                    &rows(&ks, hkv),
                    &rows(&vs, hkv),
                )
                .unwrap();
                out.extend(o.flatten_all().unwrap().to_vec1::<f32>().unwrap());
                start = end;
            }
            out
        };
        let whole = run(n);
        assert_eq!(whole, run(1), "n={n} float window {fw}: token by token differs from one prefill");
        assert_eq!(whole, run(7), "n={n} float window {fw}: chunks of 7 differ from one prefill");
    }
}

/// A cache with a float window refuses a step whose metadata gives no rings, rings of another
/// window length, or a ring past the cache's rings, and a step without the rows the window
/// reads; none of them writes a ring.
#[test]
fn float_window_without_its_rings_is_refused() {
    let dev = Device::Cpu;
    let (bs, hq, hkv, d, fw) = (4, 2, 1, 32, 3);
    let c = layer(d, hkv, 16, (3, 4), fw, 2, DType::F32);
    let seq = SeqSlice { q_start: 0, q_len: 2, context_len: 2, block_table: vec![0] };
    let rows = |h: usize, seed: u64| Tensor::from_vec(randn((2, h, d), seed), (2, h, d), &dev).unwrap();
    let (q, k, v) = (rows(hq, 1), rows(hkv, 2), rows(hkv, 3));
    let ring_bits = || c.window.as_ref().unwrap().k.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let before = ring_bits();
    let no_rings = AttentionMeta::new(bs, vec![seq.clone()]);
    let mut other_len = AttentionMeta::new(bs, vec![seq.clone()]);
    other_len.set_float_window(fw + 1, vec![0]).unwrap();
    let mut past_the_rings = AttentionMeta::new(bs, vec![seq.clone()]);
    past_the_rings.set_float_window(fw, vec![2]).unwrap();
    for (what, meta) in [("no rings", &no_rings), ("another length", &other_len), ("ring 2 of 2", &past_the_rings)] {
        let err = write_and_attend(attn(meta, hq, hkv, d, None), &c, &q, &k, &v).unwrap_err().to_string();
        assert!(err.contains("float window"), "{what}: {err}");
    }
    let mut good = AttentionMeta::new(bs, vec![seq]);
    good.set_float_window(fw, vec![1]).unwrap();
    let err = attend_written(attn(&good, hq, hkv, d, None), &c, &q, None).unwrap_err().to_string();
    assert!(err.contains("reads the step's keys and values"), "{err}");
    assert_eq!(ring_bits(), before, "a refused step wrote a ring");
    // The same step with its rings goes through and keeps its rows in ring 1.
    write_and_attend(attn(&good, hq, hkv, d, None), &c, &q, &k, &v).unwrap();
    assert_ne!(ring_bits(), before);
}

/// The 16-lane kernels' 16 dots at once give each key the same bits as their `dot`, which
/// the decode path and the per-key tail use (head dims of 16, 64, 80 and 128, varied
/// magnitudes), on every instruction set this CPU has, all with the same bits.
#[test]
fn dot16_is_sixteen_dots() {
    #[derive(Clone)]
    struct Check(usize);
    impl crate::simd::WithSimd for Check {
        type Output = Vec<u32>;
        fn run<S: crate::simd::Simd>(self, s: S) -> Vec<u32> {
            fn check<S: crate::simd::Simd, const DV: usize>(s: S, d: usize) -> Vec<u32> {
                let k = Lanes::<S, DV>(s);
                let q = randn((1, 1, d), 1);
                let keys: Vec<f32> =
                    randn((16, 1, d), 2).iter().enumerate().map(|(i, x)| x * (1 + i % 5) as f32).collect();
                let mut got = [0f32; 16];
                k.dot16(&q, &keys, &mut got);
                for (i, g) in got.iter().enumerate() {
                    let want = k.dot(&q, &keys[i * d..][..d]);
                    assert_eq!(g.to_bits(), want.to_bits(), "d = {d}, key {i}: {g} against {want}");
                }
                got.iter().map(|v| v.to_bits()).collect()
            }
            match self.0 {
                16 => check::<S, 1>(s, 16),
                64 => check::<S, 4>(s, 64),
                128 => check::<S, 8>(s, 128),
                d => check::<S, 0>(s, d),
            }
        }
    }
    for d in [16, 64, 80, 128] {
        let runs: Vec<_> = crate::simd::Isa::available().into_iter().map(|i| (i, i.run(Check(d)))).collect();
        for (isa, bits) in &runs {
            assert_eq!(bits, &runs[0].1, "d = {d}: {isa:?} against {:?}", runs[0].0);
        }
    }
}

/// The 16-lane kernels' sum of weighted rows with the sums in registers gives the same bits as
/// one `axpy` per row, on every instruction set this CPU has.
#[test]
fn axpy_rows_is_one_axpy_per_row() {
    struct Check;
    impl crate::simd::WithSimd for Check {
        type Output = ();
        fn run<S: crate::simd::Simd>(self, s: S) {
            fn check<S: crate::simd::Simd, const DV: usize>(s: S, d: usize) {
                let k = Lanes::<S, DV>(s);
                let (w, xs, y0) = (randn((1, 1, 13), 3), randn((13, 1, d), 4), randn((1, 1, d), 5));
                let mut got = y0.clone();
                k.axpy_rows(&mut got, &w, &xs);
                let mut want = y0;
                for (i, &wi) in w.iter().enumerate() {
                    k.axpy(&mut want, wi, &xs[i * d..][..d]);
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "d = {d}");
            }
            check::<S, 1>(s, 16);
            check::<S, 4>(s, 64);
            check::<S, 0>(s, 80);
            check::<S, 8>(s, 128);
        }
    }
    for isa in crate::simd::Isa::available() {
        isa.run(Check);
    }
}
