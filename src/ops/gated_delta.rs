//! The Gated DeltaNet recurrence of one sequence's rows, on the host, in f32: the CPU reference
//! (and, for now, the only implementation). For each row t, in order:
//!
//!   y_t  = silu(sum_j w[:, j] * x_{t-K+1+j})       causal depthwise conv over time (the conv
//!                                                  state holds x_{t-K+1} .. x_{t-1} before t)
//!   q, k, v = split(y_t);  q^ = q / |q| / sqrt(Dk),  k^ = k / |k|   (per key head, |x| with eps 1e-6)
//!   g = -exp(A_log) * softplus(a_t + dt_bias),  beta = sigmoid(b_t)      per value head
//!   per value head h (key head h / (Hv / Hk)), state S [Dk, Dv]:
//!     S = exp(g) S;   S += k^ (beta (v - S^T k^))^T;   o_t = S^T q^
//!
//! Each row depends on the rows before it only through the state, so a sequence computed in
//! chunks of any size, or token by token, gives the same bits as in one piece (the same
//! operations in the same order), and nothing depends on other sequences.
//!
//! A verify step (a sequence's last token and its drafts) can also keep the state after each
//! row (`RowStates`): restoring the state after the last accepted row and running on from
//! there gives the bits the sequence would have had without the rejected rows.

use rayon::prelude::*;

use crate::config::LinearAttnConfig;

/// A layer's fixed parameters, in f32.
pub struct DeltaParams<'a> {
    /// `[conv_dim, K]`.
    pub conv_weight: &'a [f32],
    /// `-exp(A_log)`, `[Hv]`.
    pub neg_a: &'a [f32],
    /// `[Hv]`.
    pub dt_bias: &'a [f32],
}

/// torch's softplus (beta 1, threshold 20: linear above it).
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `x / sqrt(sum x^2 + 1e-6) * scale` in place (transformers' `l2norm`, as FLA computes it).
fn l2norm(x: &mut [f32], scale: f32) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv * scale);
}

/// Where `run_sequence_recording` keeps the state after each row but the last (the last one's
/// is the state left in place): `conv` `[n - 1, K - 1, conv_dim]` and `ssm` `[n - 1, Hv, Dk, Dv]`,
/// or longer (the rest is left alone); shorter, only the rows that fit are kept.
pub struct RowStates<'a> {
    pub conv: &'a mut [f32],
    pub ssm: &'a mut [f32],
}

/// Runs `n` rows of one sequence: `qkv` `[n, conv_dim]` (the projection, before the conv), `a`
/// and `b` `[n, Hv]`; `conv_state` and `ssm_state` (`LinearAttnConfig::state_len`) are read as the state
/// before the first row and left as the state after the last. Returns `o` `[n, Hv * Dv]`.
pub fn run_sequence(
    dims: &LinearAttnConfig,
    p: &DeltaParams,
    conv_state: &mut [f32],
    ssm_state: &mut [f32],
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
) -> Vec<f32> {
    run_sequence_recording(dims, p, conv_state, ssm_state, qkv, a, b, None)
}

/// `run_sequence`, also copying the state after each row but the last into `record` (the
/// same operations: the outputs and the final state are the same bits).
#[allow(clippy::too_many_arguments)]
pub fn run_sequence_recording(
    dims: &LinearAttnConfig,
    p: &DeltaParams,
    conv_state: &mut [f32],
    ssm_state: &mut [f32],
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    record: Option<RowStates>,
) -> Vec<f32> {
    let (c, kk, hv) = (dims.conv_dim(), dims.conv_kernel, dims.num_value_heads);
    let (dk, dv, kd) = (dims.key_head_dim, dims.value_head_dim, dims.key_dim());
    let n = qkv.len() / c;
    // The conv window: the state's K - 1 rows, then the new rows.
    let mut window = Vec::with_capacity((kk - 1 + n) * c);
    window.extend_from_slice(conv_state);
    window.extend_from_slice(qkv);
    let mut y = vec![0f32; n * c];
    for t in 0..n {
        for ch in 0..c {
            let w = &p.conv_weight[ch * kk..(ch + 1) * kk];
            let acc = (0..kk).fold(0f32, |acc, j| acc + w[j] * window[(t + j) * c + ch]);
            y[t * c + ch] = silu(acc);
        }
    }
    conv_state.copy_from_slice(&window[n * c..]);
    // Per value head, where its state goes after each row but the last (none: not recording).
    let mut head_records: Vec<Vec<&mut [f32]>> = (0..hv).map(|_| Vec::new()).collect();
    if let Some(rec) = record.filter(|_| !conv_state.is_empty()) {
        let cl = conv_state.len();
        // The conv state after row t is the window's K - 1 rows that end at t.
        for (t, dst) in rec.conv.chunks_exact_mut(cl).take(n.saturating_sub(1)).enumerate() {
            dst.copy_from_slice(&window[(t + 1) * c..(t + 1) * c + cl]);
        }
        let rows = n.saturating_sub(1) * hv;
        for (i, dst) in rec.ssm.chunks_exact_mut(dk * dv).take(rows).enumerate() {
            head_records[i % hv].push(dst);
        }
    }
    // q^ and k^ per key head, in place.
    let q_scale = 1.0 / (dk as f32).sqrt();
    for row in y.chunks_mut(c) {
        for h in 0..dims.num_key_heads {
            l2norm(&mut row[h * dk..(h + 1) * dk], q_scale);
            l2norm(&mut row[kd + h * dk..kd + (h + 1) * dk], 1.0);
        }
    }
    let group = hv / dims.num_key_heads;
    // Each value head's recurrence on its own state; heads are independent.
    let per_head: Vec<Vec<f32>> = ssm_state
        .par_chunks_mut(dk * dv)
        .zip(head_records.into_par_iter())
        .enumerate()
        .map(|(h, (s, mut rec))| {
            let kh = h / group;
            let mut out = vec![0f32; n * dv];
            let mut kv = vec![0f32; dv];
            for t in 0..n {
                let row = &y[t * c..(t + 1) * c];
                let (q, k) = (&row[kh * dk..(kh + 1) * dk], &row[kd + kh * dk..kd + (kh + 1) * dk]);
                let v = &row[2 * kd + h * dv..2 * kd + (h + 1) * dv];
                let decay = (p.neg_a[h] * softplus(a[t * hv + h] + p.dt_bias[h])).exp();
                let beta = 1.0 / (1.0 + (-b[t * hv + h]).exp());
                s.iter_mut().for_each(|x| *x *= decay);
                kv.iter_mut().for_each(|x| *x = 0.0);
                for (i, &ki) in k.iter().enumerate() {
                    for (acc, &sv) in kv.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                        *acc += sv * ki;
                    }
                }
                // delta = beta (v - S^T k^), kept in kv.
                kv.iter_mut().zip(v).for_each(|(x, &vj)| *x = beta * (vj - *x));
                for (i, &ki) in k.iter().enumerate() {
                    for (sv, &d) in s[i * dv..(i + 1) * dv].iter_mut().zip(&kv) {
                        *sv += ki * d;
                    }
                }
                if let Some(dst) = rec.get_mut(t) {
                    dst.copy_from_slice(s);
                }
                let o = &mut out[t * dv..(t + 1) * dv];
                for (i, &qi) in q.iter().enumerate() {
                    for (acc, &sv) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                        *acc += sv * qi;
                    }
                }
            }
            out
        })
        .collect();
    let mut o = vec![0f32; n * hv * dv];
    for (h, out) in per_head.iter().enumerate() {
        for t in 0..n {
            o[(t * hv + h) * dv..(t * hv + h + 1) * dv].copy_from_slice(&out[t * dv..(t + 1) * dv]);
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    const DIMS: LinearAttnConfig =
        LinearAttnConfig { num_key_heads: 2, num_value_heads: 4, key_head_dim: 8, value_head_dim: 6, conv_kernel: 4 };

    /// Runs `rows` rows from a zero state in pieces of `chunk`, returning outputs and the states.
    fn run_in_chunks(chunk: usize, rows: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let d = DIMS;
        let (c, hv) = (d.conv_dim(), d.num_value_heads);
        let (w, neg_a, dt) = (noise(c * 4, 1), noise(hv, 2), noise(hv, 3));
        let p = DeltaParams { conv_weight: &w, neg_a: &neg_a, dt_bias: &dt };
        let (qkv, a, b) = (noise(rows * c, 4), noise(rows * hv, 5), noise(rows * hv, 6));
        let (cl, sl) = d.state_len();
        let (mut cs, mut ss) = (vec![0f32; cl], vec![0f32; sl]);
        let mut out = Vec::new();
        let mut t = 0;
        while t < rows {
            let m = chunk.min(rows - t);
            out.extend(run_sequence(
                &d,
                &p,
                &mut cs,
                &mut ss,
                &qkv[t * c..(t + m) * c],
                &a[t * hv..(t + m) * hv],
                &b[t * hv..(t + m) * hv],
            ));
            t += m;
        }
        (out, cs, ss)
    }

    /// The state carries everything: any chunking gives the bits of one piece, and the
    /// outputs are not trivially zero.
    #[test]
    fn chunks_of_any_size_give_the_same_bits() {
        let whole = run_in_chunks(usize::MAX, 13);
        assert!(whole.0.iter().any(|v| v.abs() > 1e-3));
        for chunk in 1..13 {
            assert_eq!(run_in_chunks(chunk, 13), whole, "chunk {chunk}");
        }
    }

    /// A verify step's recorded states: its outputs and final state are the plain run's bits,
    /// and for every row r, the state after r restored and run on with other rows gives the
    /// bits of a sequence that never saw the rows after r.
    #[test]
    fn recorded_row_states_restore_exactly() {
        let d = DIMS;
        let (c, hv) = (d.conv_dim(), d.num_value_heads);
        let (cl, sl) = d.state_len();
        let (w, neg_a, dt) = (noise(c * 4, 1), noise(hv, 2), noise(hv, 3));
        let p = DeltaParams { conv_weight: &w, neg_a: &neg_a, dt_bias: &dt };
        // Rows: 6 before (the prompt), 5 in the verify step, 4 after (what follows instead of
        // the verify step's rejected rows).
        let rows = |n: usize, seed: u32| (noise(n * c, seed), noise(n * hv, seed + 1), noise(n * hv, seed + 2));
        let (pq, pa, pb) = rows(6, 10);
        let (vq, va, vb) = rows(5, 20);
        let (aq, aa, ab) = rows(4, 30);
        let (mut cs, mut ss) = (vec![0f32; cl], vec![0f32; sl]);
        run_sequence(&d, &p, &mut cs, &mut ss, &pq, &pa, &pb);
        let (prompt_conv, prompt_ssm) = (cs.clone(), ss.clone());
        let plain = run_sequence(&d, &p, &mut cs, &mut ss, &vq, &va, &vb);
        let plain_state = (cs, ss);

        let (mut cs, mut ss) = (prompt_conv.clone(), prompt_ssm.clone());
        let (mut rc, mut rs) = (vec![f32::NAN; 4 * cl], vec![f32::NAN; 4 * sl]);
        let rec = RowStates { conv: &mut rc, ssm: &mut rs };
        let recorded = run_sequence_recording(&d, &p, &mut cs, &mut ss, &vq, &va, &vb, Some(rec));
        assert!(plain.iter().zip(&recorded).all(|(a, b)| a.to_bits() == b.to_bits()), "outputs changed");
        assert_eq!((cs, ss), plain_state, "the final state changed");

        for kept in 1..5 {
            // The detour: the state after row kept - 1, taken from the record.
            let (mut cs, mut ss) = (rc[(kept - 1) * cl..kept * cl].to_vec(), rs[(kept - 1) * sl..kept * sl].to_vec());
            let after = run_sequence(&d, &p, &mut cs, &mut ss, &aq, &aa, &ab);
            // Without it: the prompt, the kept rows, then the same rows.
            let (mut ws, mut wss) = (prompt_conv.clone(), prompt_ssm.clone());
            run_sequence(&d, &p, &mut ws, &mut wss, &vq[..kept * c], &va[..kept * hv], &vb[..kept * hv]);
            let want = run_sequence(&d, &p, &mut ws, &mut wss, &aq, &aa, &ab);
            assert!(after.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{kept} rows kept");
            assert_eq!((cs, ss), (ws, wss), "{kept} rows kept: the state differs");
        }
        // The rows after the verify step's first differ from those a restored state gives.
        let (mut cs, mut ss) = plain_state;
        assert_ne!(run_sequence(&d, &p, &mut cs, &mut ss, &aq, &aa, &ab), {
            let (mut cs, mut ss) = (rc[..cl].to_vec(), rs[..sl].to_vec());
            run_sequence(&d, &p, &mut cs, &mut ss, &aq, &aa, &ab)
        });
    }

    /// A value head uses the key head h / (Hv / Hk): with the second key head's q and k
    /// zeroed in the input, heads 2 and 3 see zero keys (nothing written) and give zeros.
    #[test]
    fn value_heads_share_their_key_head_in_order() {
        let d = DIMS;
        let (c, hv, kd, dk) = (d.conv_dim(), d.num_value_heads, d.key_dim(), d.key_head_dim);
        let w = vec![1.0; c * 4];
        let (neg_a, dt) = (vec![-0.5; hv], vec![0.1; hv]);
        let p = DeltaParams { conv_weight: &w, neg_a: &neg_a, dt_bias: &dt };
        let mut qkv = noise(3 * c, 7);
        for t in 0..3 {
            for i in dk..kd {
                qkv[t * c + i] = 0.0;
                qkv[t * c + kd + i] = 0.0;
            }
        }
        let (cl, sl) = d.state_len();
        let (mut cs, mut ss) = (vec![0f32; cl], vec![0f32; sl]);
        let o = run_sequence(&d, &p, &mut cs, &mut ss, &qkv, &noise(3 * hv, 8), &noise(3 * hv, 9));
        let dv = d.value_head_dim;
        for t in 0..3 {
            let head = |h: usize| &o[(t * hv + h) * dv..(t * hv + h + 1) * dv];
            assert!(head(0).iter().chain(head(1)).any(|v| v.abs() > 1e-4), "row {t}: heads 0-1 read key head 0");
            assert!(head(2).iter().chain(head(3)).all(|&v| v == 0.0), "row {t}: heads 2-3 read key head 1");
        }
    }
}
