//! Resampling of a learned 2-D table to an image's patch grid, as the vision towers' position
//! embeddings do it:
//! - bicubic at arbitrary points, as PyTorch's CPU `grid_sample(mode="bicubic",
//!   padding_mode="border", align_corners=False)` computes it (GLM-4.xV);
//! - bilinear onto a whole grid with corners aligned, as `interpolate(mode="bilinear",
//!   align_corners=True)` does and transformers' gather-and-weight form of it computes it
//!   (Qwen3.5: `get_vision_interpolation_indices_and_weights`).
//!
//! The float steps follow torch's in order, so results agree to f32 rounding.

/// The cubic convolution kernel's parameter (torch's and Keys').
const A: f32 = -0.75;

/// Samples `table` (`[height, width, channels]`, row-major) at points `(x, y)` given in
/// normalized coordinates (-1 and 1 are the outer edges of the first and last cells). Returns
/// `[points, channels]`.
pub fn bicubic_border(table: &[f32], height: usize, width: usize, channels: usize, points: &[(f32, f32)]) -> Vec<f32> {
    assert_eq!(table.len(), height * width * channels, "table size");
    let mut out = vec![0f32; points.len() * channels];
    if height == 0 || width == 0 {
        return out;
    }
    // Border padding: every tap outside the table reads the nearest edge cell.
    let clip = |v: f32, size: usize| v.max(0.0).min((size - 1) as f32) as usize;
    for (p, &(gx, gy)) in points.iter().enumerate() {
        let x = unnormalize(gx, width);
        let y = unnormalize(gy, height);
        let (ix, iy) = (x.floor(), y.floor());
        let cx = cubic_coefficients(x - ix);
        let cy = cubic_coefficients(y - iy);
        let cols: [usize; 4] = std::array::from_fn(|j| clip(ix - 1.0 + j as f32, width));
        let rows: [usize; 4] = std::array::from_fn(|i| clip(iy - 1.0 + i as f32, height));
        let dst = &mut out[p * channels..(p + 1) * channels];
        for (c, o) in dst.iter_mut().enumerate() {
            let at = |r: usize, col: usize| table[(r * width + col) * channels + c];
            let along_x: [f32; 4] = std::array::from_fn(|i| {
                cx[0] * at(rows[i], cols[0])
                    + cx[1] * at(rows[i], cols[1])
                    + cx[2] * at(rows[i], cols[2])
                    + cx[3] * at(rows[i], cols[3])
            });
            *o = cy[0] * along_x[0] + cy[1] * along_x[1] + cy[2] * along_x[2] + cy[3] * along_x[3];
        }
    }
    out
}

/// A normalized coordinate to a position in cells (`align_corners=False`).
fn unnormalize(g: f32, size: usize) -> f32 {
    (g + 1.0) * (size as f32 / 2.0) - 0.5
}

/// Weights of the four taps at offsets -1, 0, 1, 2 for a point `t` in [0, 1) past tap 0.
fn cubic_coefficients(t: f32) -> [f32; 4] {
    let outer = |x: f32| ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A; // 1 <= |x| < 2
    let inner = |x: f32| ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0; // |x| <= 1
    [outer(t + 1.0), inner(t), inner(1.0 - t), outer(2.0 - t)]
}

/// Samples `table` (`[side_h, side_w, channels]`, row-major) bilinearly at the cells `places`
/// (row, column) of a `grid` (rows, columns) stretched over it corner to corner: cell (0, 0)
/// reads the table's first entry and the last cell its last. Returns `[places, channels]`.
pub fn bilinear_corners(
    table: &[f32],
    (side_h, side_w): (usize, usize),
    channels: usize,
    grid: (usize, usize),
    places: &[(usize, usize)],
) -> Vec<f32> {
    assert_eq!(table.len(), side_h * side_w * channels, "table size");
    let mut out = vec![0f32; places.len() * channels];
    if side_h == 0 || side_w == 0 {
        return out;
    }
    for (p, &(row, col)) in places.iter().enumerate() {
        let (rows, row_w) = corner_taps(row, grid.0, side_h);
        let (cols, col_w) = corner_taps(col, grid.1, side_w);
        let dst = &mut out[p * channels..(p + 1) * channels];
        // The four taps in transformers' order (row tap major), each weight a product in f32,
        // summed one after another.
        for (i, &r) in rows.iter().enumerate() {
            for (j, &c) in cols.iter().enumerate() {
                let weight = row_w[i] * col_w[j];
                let src = &table[(r * side_w + c) * channels..][..channels];
                for (o, &v) in dst.iter_mut().zip(src) {
                    *o += v * weight;
                }
            }
        }
    }
    out
}

/// The two taps along one axis of a `side`-long table for cell `index` of `size`, and their
/// weights: `src = index * (side - 1) / (size - 1)`, taps floor(src) and floor(src) + 1 (kept
/// inside the table), weights the linear hat `max(0, 1 - |src - tap|)`.
fn corner_taps(index: usize, size: usize, side: usize) -> ([usize; 2], [f32; 2]) {
    let src = index as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
    let floor = src.floor();
    let taps = [0.0f32, 1.0].map(|o| ((floor + o) as usize).min(side - 1));
    let weights = [0.0f32, 1.0].map(|o| (1.0 - (src - floor - o).abs()).max(0.0));
    (taps, weights)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_size_is_the_identity_and_constants_stay_constant() {
        // Sampling a 3x4 table at its own cell centres returns it.
        let table: Vec<f32> = (0..12).map(|v| (v * v) as f32 * 0.25 - 3.0).collect();
        let points: Vec<(f32, f32)> = (0..3)
            .flat_map(|h| {
                (0..4).map(move |w| (((w as f32 + 0.5) / 4.0) * 2.0 - 1.0, ((h as f32 + 0.5) / 3.0) * 2.0 - 1.0))
            })
            .collect();
        let got = bicubic_border(&table, 3, 4, 1, &points);
        for (g, t) in got.iter().zip(&table) {
            assert!((g - t).abs() < 1e-5, "{g} vs {t}");
        }
        // The weights sum to 1 anywhere, so a constant table resamples to itself.
        let flat = vec![2.5f32; 5 * 5 * 2];
        for v in bicubic_border(&flat, 5, 5, 2, &[(-1.0, -1.0), (0.13, -0.77), (0.999, 0.4)]) {
            assert!((v - 2.5).abs() < 1e-5);
        }
    }

    #[test]
    fn matches_torch_on_a_known_point() {
        // torch.nn.functional.grid_sample(torch.arange(16.).view(1, 1, 4, 4),
        //     torch.tensor([[[[0.3, -0.6]]]]), mode="bicubic", padding_mode="border",
        //     align_corners=False) == 3.0697494 (the border clips taps on both axes)
        let table: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let got = bicubic_border(&table, 4, 4, 1, &[(0.3, -0.6)])[0];
        assert!((got - 3.069_749_4).abs() < 1e-6, "{got}");
    }

    #[test]
    fn bilinear_corners_matches_torch() {
        // torch.nn.functional.interpolate(torch.arange(25.).view(1, 1, 5, 5) ** 1.5, size=(3, 7),
        //     mode="bilinear", align_corners=True)[0, 0]: rows 1 and 2 at columns 3 and 5.
        let table: Vec<f32> = (0..25).map(|v| (v as f32).powf(1.5)).collect();
        let got = bilinear_corners(&table, (5, 5), 1, (3, 7), &[(1, 3), (2, 5), (0, 0), (2, 6)]);
        let want = [41.569_218, 112.727_92, 0.0, 117.575_51];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} vs {w}");
        }
        // A grid the table's size reads it back; a one-cell axis reads the first entry.
        let places: Vec<(usize, usize)> = (0..5).flat_map(|r| (0..5).map(move |c| (r, c))).collect();
        assert_eq!(bilinear_corners(&table, (5, 5), 1, (5, 5), &places), table);
        assert_eq!(bilinear_corners(&table, (5, 5), 1, (1, 1), &[(0, 0)]), vec![0.0]);
    }
}
