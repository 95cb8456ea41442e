//! The pieces of a softmax computed per segment of positions and merged in order (the online
//! softmax of flash attention), on the CPU: the dense op's and the TurboQuant op's.

use crate::simd::{axpy_f32, exp_sub_sum, max_f32};

/// Folds a segment's partial (m, l, acc) into a running softmax state (M, L, total): the
/// online softmax merge, segment after segment in position order.
#[inline(always)]
pub fn fold(state: &mut [f32], part: &[f32]) {
    let m = part[0];
    if m == f32::NEG_INFINITY {
        return;
    }
    let mn = state[0].max(m);
    let (x, y) = ((state[0] - mn).exp(), (m - mn).exp());
    let (head, total) = state.split_at_mut(2);
    total.iter_mut().for_each(|t| *t *= x);
    axpy_f32(total, y, &part[2..]);
    head[1] = head[1] * x + part[1] * y;
    head[0] = mn;
}

/// In place: s <- exp(s - max s); returns (max, sum): a softmax before its division, which
/// the attention on TurboQuant codes merges per segment. Vectorised (`simd::exp_sub_sum`),
/// with the same bits on every machine.
#[inline(always)]
pub fn exp_shifted(s: &mut [f32]) -> (f32, f32) {
    let m = max_f32(s);
    (m, exp_sub_sum(s, m))
}
