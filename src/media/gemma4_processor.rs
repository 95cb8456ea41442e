//! Gemma 4's image processor (`Gemma4ImageProcessor`, equal to transformers' PIL backend): resize
//! keeping the aspect ratio so the image holds at most `max_soft_tokens` pooled cells of k x k
//! patches, each side rounded down to a multiple of k * patch (small images grow); bicubic;
//! rescale to [0, 1] (no normalization by default); cut into patches row by row, each patch's
//! values (row, column, channel) with the channel innermost. No padding rows: the tower runs on
//! an image's own patches, which transformers' padded form reproduces exactly (padding rows are
//! masked as keys and dropped before pooling).

use std::path::Path;

use serde_json::Value;

use super::decode::ImageError;
use super::pixels::{PixelValues, RgbImage};
use super::resize::resize_bicubic;
use crate::config::positive_int;
use crate::weights::WeightsError;

/// The budgets transformers accepts for `max_soft_tokens`.
const SOFT_TOKEN_BUDGETS: [usize; 5] = [70, 140, 280, 560, 1120];

#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4ImageProcessor {
    pub patch_size: usize,
    pub pooling_kernel_size: usize,
    pub max_soft_tokens: usize,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl Default for Gemma4ImageProcessor {
    fn default() -> Self {
        Gemma4ImageProcessor {
            patch_size: 16,
            pooling_kernel_size: 3,
            max_soft_tokens: 280,
            do_resize: true,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: false,
            image_mean: [0.0; 3],
            image_std: [1.0; 3],
        }
    }
}

impl Gemma4ImageProcessor {
    /// Reads the `image_processor` section of `processor_config.json` (transformers 5 saves the
    /// processor there), else `preprocessor_config.json`, else the class defaults.
    pub fn from_dir(dir: &Path) -> Result<Self, WeightsError> {
        for (file, section) in [("processor_config.json", Some("image_processor")), ("preprocessor_config.json", None)]
        {
            let path = dir.join(file);
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(WeightsError::io(&path, e)),
            };
            let json: Value = serde_json::from_str(&text)
                .map_err(|e| WeightsError::Config { path: path.clone(), msg: format!("not valid JSON: {e}") })?;
            let json = match section {
                Some(s) => match json.get(s) {
                    Some(v) => v.clone(),
                    None => continue,
                },
                None => json,
            };
            return Self::from_json(&json).map_err(|msg| WeightsError::Config { path, msg });
        }
        Ok(Self::default())
    }

    pub fn from_json(j: &Value) -> Result<Self, String> {
        let d = Self::default();
        let uint = |name: &str, default| positive_int(j.get(name), default, name);
        let flag = |name: &str, default: bool| j.get(name).and_then(Value::as_bool).unwrap_or(default);
        let triple = |name: &str, default: [f32; 3]| -> Result<[f32; 3], String> {
            match j.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Array(a)) if a.len() == 3 => {
                    let v: Option<Vec<f32>> = a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect();
                    v.map(|v| [v[0], v[1], v[2]]).ok_or_else(|| format!("`{name}` must list 3 numbers"))
                }
                Some(_) => Err(format!("`{name}` must list 3 numbers")),
            }
        };
        match j.get("resample").and_then(Value::as_u64) {
            None | Some(3) => {}
            Some(r) => return Err(format!("resample {r} is not supported (only 3, bicubic)")),
        }
        let p = Gemma4ImageProcessor {
            patch_size: uint("patch_size", d.patch_size)?,
            pooling_kernel_size: uint("pooling_kernel_size", d.pooling_kernel_size)?,
            max_soft_tokens: uint("max_soft_tokens", d.max_soft_tokens)?,
            do_resize: flag("do_resize", d.do_resize),
            do_rescale: flag("do_rescale", d.do_rescale),
            rescale_factor: j.get("rescale_factor").and_then(Value::as_f64).unwrap_or(d.rescale_factor),
            do_normalize: flag("do_normalize", d.do_normalize),
            image_mean: triple("image_mean", d.image_mean)?,
            image_std: triple("image_std", d.image_std)?,
        };
        if !SOFT_TOKEN_BUDGETS.contains(&p.max_soft_tokens) {
            return Err(format!("`max_soft_tokens` {} is not one of {SOFT_TOKEN_BUDGETS:?}", p.max_soft_tokens));
        }
        if p.image_std.contains(&0.0) {
            return Err("`image_std` must not contain 0".into());
        }
        Ok(p)
    }

    /// Values per patch: 3 channels x patch x patch.
    pub fn patch_dim(&self) -> usize {
        3 * self.patch_size * self.patch_size
    }

    /// The (height, width) an image is resized to: the largest size of the image's aspect ratio
    /// within `max_soft_tokens * k^2` patches, each side rounded down to a multiple of k * patch;
    /// a side that rounds to nothing takes one unit and the other side its integer multiple.
    /// The float steps are Python's, in the same order, so the sizes match transformers'.
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize), ImageError> {
        if height == 0 || width == 0 {
            return Err(ImageError::Empty { width, height });
        }
        let (p, k) = (self.patch_size, self.pooling_kernel_size);
        let max_patches = self.max_soft_tokens * k * k;
        let target_px = max_patches * p * p;
        let factor = (target_px as f64 / (height * width) as f64).sqrt();
        let side = k * p;
        let mut h = ((factor * height as f64) / side as f64).floor() as usize * side;
        let mut w = ((factor * width as f64) / side as f64).floor() as usize * side;
        let max_side = (max_patches / (k * k)) * side;
        match (h, w) {
            (0, 0) => return Err(ImageError::Empty { width, height }),
            (0, _) => {
                h = side;
                w = (((width as f64 / height as f64).floor() as usize) * side).min(max_side);
            }
            (_, 0) => {
                w = side;
                h = (((height as f64 / width as f64).floor() as usize) * side).min(max_side);
            }
            _ => {}
        }
        if h * w > target_px {
            return Err(ImageError::Unsupported(format!(
                "a {width}x{height} image is too elongated for {max_patches} patches of {p}x{p}"
            )));
        }
        Ok((h, w))
    }

    /// Image tokens (pooled cells) the language model sees for an image of this size.
    pub fn num_image_tokens(&self, height: usize, width: usize) -> Result<usize, ImageError> {
        let (h, w) = if self.do_resize { self.target_size(height, width)? } else { (height, width) };
        let (p, k) = (self.patch_size, self.pooling_kernel_size);
        Ok((h / p) * (w / p) / (k * k))
    }

    pub fn preprocess(&self, img: &RgbImage) -> Result<PixelValues, ImageError> {
        let resized;
        let img = match self.do_resize.then(|| self.target_size(img.height, img.width)).transpose()? {
            Some((h, w)) if (h, w) != (img.height, img.width) => {
                resized = resize_bicubic(img, w, h);
                &resized
            }
            _ => img,
        };
        let (p, k) = (self.patch_size, self.pooling_kernel_size);
        let (h, w) = (img.height, img.width);
        if h % (p * k) != 0 || w % (p * k) != 0 || h == 0 || w == 0 {
            return Err(ImageError::Unsupported(format!(
                "a {w}x{h} image does not split into {0}x{0} pooled patches (enable do_resize)",
                p * k
            )));
        }
        let value = |v: u8, c: usize| {
            // transformers rescales in f64 and rounds to f32 (PIL backend), then normalizes in f32.
            let mut x = if self.do_rescale { (v as f64 * self.rescale_factor) as f32 } else { v as f32 };
            if self.do_normalize {
                x = (x - self.image_mean[c]) / self.image_std[c];
            }
            x
        };
        let (gh, gw) = (h / p, w / p);
        let mut data = Vec::with_capacity(gh * gw * self.patch_dim());
        for y in 0..gh {
            for x in 0..gw {
                for py in 0..p {
                    let start = ((y * p + py) * w + x * p) * 3;
                    data.extend(img.data[start..start + 3 * p].iter().enumerate().map(|(i, &v)| value(v, i % 3)));
                }
            }
        }
        Ok(PixelValues { data, rows: gh * gw, cols: self.patch_dim(), grid_thw: [1, gh, gw] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_sizes_are_transformers_ones() {
        // Sizes transformers 5.24's Gemma4ImageProcessor gives (patch 16, pooling 3).
        let p = Gemma4ImageProcessor::default();
        assert_eq!(p.target_size(768, 1024).unwrap(), (672, 912));
        assert_eq!(p.target_size(1024, 1024).unwrap(), (768, 768));
        assert_eq!(p.target_size(1080, 1920).unwrap(), (576, 1056));
        assert_eq!(p.target_size(224, 224).unwrap(), (768, 768));
        // The narrow branch: one unit high, the width its integer multiple.
        assert_eq!(p.target_size(10, 2000).unwrap(), (48, 11328));
        let p70 = Gemma4ImageProcessor { max_soft_tokens: 70, ..Default::default() };
        assert_eq!(p70.target_size(10, 2000).unwrap(), (48, 3360));
        assert_eq!(p.num_image_tokens(768, 1024).unwrap(), 266);
        assert!(matches!(p.target_size(0, 5), Err(ImageError::Empty { .. })));
    }

    #[test]
    fn patches_run_row_by_row_with_the_channel_innermost() {
        let p = Gemma4ImageProcessor { patch_size: 2, pooling_kernel_size: 1, do_resize: false, ..Default::default() };
        // A 4x2 (w x h) image whose bytes count up: pixel (x, y) channel c = (y * 4 + x) * 3 + c.
        let img = RgbImage::new(4, 2, (0..24).collect());
        let px = p.preprocess(&img).unwrap();
        assert_eq!((px.rows, px.cols, px.grid_thw), (2, 12, [1, 1, 2]));
        let want: Vec<f32> =
            [0, 1, 2, 3, 4, 5, 12, 13, 14, 15, 16, 17].iter().map(|&v| (v as f64 / 255.0) as f32).collect();
        assert_eq!(&px.data[..12], &want[..]);
        assert_eq!(px.data[12], (6.0f64 / 255.0) as f32);
    }

    #[test]
    fn reads_the_processor_section_and_refuses_odd_budgets() {
        let j = serde_json::json!({"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70});
        let p = Gemma4ImageProcessor::from_json(&j).unwrap();
        assert_eq!((p.patch_size, p.pooling_kernel_size, p.max_soft_tokens), (4, 2, 70));
        assert!(Gemma4ImageProcessor::from_json(&serde_json::json!({"max_soft_tokens": 100})).is_err());
        assert!(Gemma4ImageProcessor::from_json(&serde_json::json!({"resample": 2})).is_err());
    }
}
