//! M-RoPE positions of a prompt (Qwen2-VL's `get_rope_index`; GLM-4.xV's gives the same for
//! images): text tokens count up on all three axes; an image's tokens share one temporal
//! position and take their row and column in the merged patch grid, offset by where the image
//! starts; the text after an image continues from the largest position used so far, plus one.

use crate::media::PixelValues;

/// A prompt's three-axis positions, and the shift that continues them for later tokens:
/// token `i >= prompt length` sits at `i + delta` on every axis.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptPositions {
    pub positions: Vec<[u32; 3]>,
    pub delta: i64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PositionError {
    #[error("the prompt has more image tokens than its {0} image(s) take")]
    TooManyImageTokens(usize),
    #[error("image {index} takes {expected} image tokens but the prompt has a run of {found} there")]
    WrongRun { index: usize, expected: usize, found: usize },
    #[error("the prompt has image tokens for {found} of its {images} image(s)")]
    TooFewImageTokens { found: usize, images: usize },
    #[error("image {index}: {reason}")]
    BadPixels { index: usize, reason: String },
}

/// Checks that preprocessed images fit a vision tower's patches (`patch_dim` values per patch,
/// grids that split into `merge` x `merge` blocks) before their positions are computed.
pub fn check_pixels(images: &[&PixelValues], patch_dim: usize, merge: usize) -> Result<(), PositionError> {
    for (index, p) in images.iter().enumerate() {
        let [t, h, w] = p.grid_thw;
        if p.cols != patch_dim || p.rows != t * h * w || p.rows == 0 || h % merge != 0 || w % merge != 0 {
            return Err(PositionError::BadPixels {
                index,
                reason: format!(
                    "[{}, {}] pixel values with grid {:?} do not fit this model's patches",
                    p.rows, p.cols, p.grid_thw
                ),
            });
        }
        if p.data.len() != p.rows * p.cols {
            return Err(PositionError::BadPixels { index, reason: "pixel data has the wrong length".into() });
        }
    }
    Ok(())
}

/// `grids[k]` is image k's patch grid (t, h, w) before merging; each image's tokens are one
/// contiguous run of `image_token` in the prompt, in image order.
pub fn prompt_positions(
    tokens: &[u32],
    image_token: u32,
    grids: &[[usize; 3]],
    merge: usize,
) -> Result<PromptPositions, PositionError> {
    let mut positions = Vec::with_capacity(tokens.len());
    let mut next = 0u32; // the position after the largest one so far
    let mut image = 0;
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] != image_token {
            positions.push([next; 3]);
            next += 1;
            i += 1;
            continue;
        }
        let [t, h, w] = *grids.get(image).ok_or(PositionError::TooManyImageTokens(grids.len()))?;
        let (h, w) = (h / merge, w / merge);
        let n = t * h * w;
        let run = tokens[i..].iter().take_while(|&&x| x == image_token).count();
        // A run may hold several adjacent images, never part of one.
        if run < n {
            return Err(PositionError::WrongRun { index: image, expected: n, found: run });
        }
        for ti in 0..t as u32 {
            for hi in 0..h as u32 {
                for wi in 0..w as u32 {
                    positions.push([next + ti, next + hi, next + wi]);
                }
            }
        }
        next += t.max(h).max(w) as u32;
        image += 1;
        i += n;
    }
    if image != grids.len() {
        return Err(PositionError::TooFewImageTokens { found: image, images: grids.len() });
    }
    Ok(PromptPositions { delta: next as i64 - tokens.len() as i64, positions })
}

/// A model with 1-D positions (Gemma 4): every token counts up, image tokens too; the image
/// runs are checked as above (`tokens_per_image[k]` tokens of image k, in order).
pub fn flat_prompt_positions(
    tokens: &[u32],
    image_token: u32,
    tokens_per_image: &[usize],
) -> Result<PromptPositions, PositionError> {
    // A 1 x n grid unmerged is a run of n tokens.
    let grids: Vec<[usize; 3]> = tokens_per_image.iter().map(|&n| [1, 1, n]).collect();
    prompt_positions(tokens, image_token, &grids, 1)?;
    Ok(PromptPositions { positions: (0..tokens.len() as u32).map(|i| [i; 3]).collect(), delta: 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3.5's positions for a prompt with two images are transformers' `get_rope_index`
    /// (tests/fixtures/qwen35_mrope.json; `layers::rotary`'s tests check the cos/sin at them).
    #[test]
    fn qwen35_prompt_positions_are_transformers() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/qwen35_mrope.json");
        let f: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let get = |k: &str| f[k].clone();
        let tokens: Vec<u32> = serde_json::from_value(get("tokens")).unwrap();
        let grids: Vec<[usize; 3]> = serde_json::from_value(get("grids")).unwrap();
        let want: Vec<[u32; 3]> = serde_json::from_value(get("positions")).unwrap();
        let merge = get("merge").as_u64().unwrap() as usize;
        let image = get("image_token").as_u64().unwrap() as u32;
        let p = prompt_positions(&tokens, image, &grids, merge).unwrap();
        assert_eq!(p.positions, want);
        assert_eq!(p.delta, get("delta").as_i64().unwrap());
    }

    #[test]
    fn text_then_image_then_text() {
        // 2 text tokens, a 4x6 patch grid (2x3 merged tokens), 2 text tokens
        let toks = [1, 2, 9, 9, 9, 9, 9, 9, 3, 4];
        let p = prompt_positions(&toks, 9, &[[1, 4, 6]], 2).unwrap();
        assert_eq!(&p.positions[..2], &[[0; 3], [1; 3]]);
        assert_eq!(&p.positions[2..5], &[[2, 2, 2], [2, 2, 3], [2, 2, 4]]);
        assert_eq!(&p.positions[5..8], &[[2, 3, 2], [2, 3, 3], [2, 3, 4]]);
        assert_eq!(&p.positions[8..], &[[5; 3], [6; 3]]);
        assert_eq!(p.delta, 7 - 10);
    }

    #[test]
    fn mismatched_images_are_errors() {
        assert!(matches!(prompt_positions(&[9, 9], 9, &[[1, 4, 4]], 2), Err(PositionError::WrongRun { .. })));
        assert_eq!(
            prompt_positions(&[1, 2], 9, &[[1, 2, 2]], 2),
            Err(PositionError::TooFewImageTokens { found: 0, images: 1 })
        );
        assert_eq!(prompt_positions(&[9], 9, &[], 2), Err(PositionError::TooManyImageTokens(0)));
    }

    #[test]
    fn flat_positions_count_up_through_images() {
        let p = flat_prompt_positions(&[1, 9, 9, 2, 9, 3], 9, &[2, 1]).unwrap();
        assert_eq!(p.positions, (0..6).map(|i| [i; 3]).collect::<Vec<_>>());
        assert_eq!(p.delta, 0);
        assert!(matches!(flat_prompt_positions(&[9, 2], 9, &[2]), Err(PositionError::WrongRun { .. })));
        assert!(flat_prompt_positions(&[1, 2], 9, &[1]).is_err());
    }
}
