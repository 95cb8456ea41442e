//! The patch image processor of Qwen2-VL (`Qwen2VLImageProcessor`) and GLM-4.xV
//! (`Glm4vImageProcessor`), equal to transformers' PIL backend: resize so both sides are
//! multiples of patch * merge (28) and the area is within [min_pixels, max_pixels] (the two
//! models' `smart_resize` differ, see `ResizeRule`), bicubic; rescale to [0, 1]; normalize; cut
//! into 14x14 patches grouped by 2x2 merge blocks, each repeated over the temporal patch of 2
//! frames.

use std::path::Path;

use serde_json::Value;

use super::decode::ImageError;
use super::pixels::{PixelValues, RgbImage};
use super::resize::resize_bicubic;
use crate::config::positive_int;
use crate::weights::WeightsError;

const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// How the target size is chosen (each model's `smart_resize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResizeRule {
    /// Qwen2-VL: round each side to the factor, then scale the area into the pixel bounds.
    Qwen2Vl,
    /// GLM-4.xV: sides shorter than the factor are first scaled up (truncated to integers),
    /// and the bounds count the pixels of both frames of the temporal patch.
    Glm4v,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessor {
    pub rule: ResizeRule,
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub rescale_factor: f64,
    pub do_normalize: bool,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
}

impl Default for ImageProcessor {
    fn default() -> Self {
        ImageProcessor {
            rule: ResizeRule::Qwen2Vl,
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            do_resize: true,
            do_rescale: true,
            rescale_factor: 1.0 / 255.0,
            do_normalize: true,
            image_mean: CLIP_MEAN.map(|v| v as f32),
            image_std: CLIP_STD.map(|v| v as f32),
        }
    }
}

impl ImageProcessor {
    /// The model's defaults (transformers' processor class attributes).
    pub fn defaults(rule: ResizeRule) -> Self {
        match rule {
            ResizeRule::Qwen2Vl => Self::default(),
            ResizeRule::Glm4v => {
                ImageProcessor { rule, min_pixels: 112 * 112, max_pixels: 28 * 28 * 15000, ..Self::default() }
            }
        }
    }

    /// Reads `preprocessor_config.json`, else the `image_processor` section of
    /// `processor_config.json` (where transformers 5 saves a whole processor), else the
    /// model's defaults when neither file is there.
    pub fn from_dir(dir: &Path, rule: ResizeRule) -> Result<Self, WeightsError> {
        for (file, section) in [("preprocessor_config.json", None), ("processor_config.json", Some("image_processor"))]
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
                None => &json,
                Some(key) => match json.get(key).filter(|v| v.is_object()) {
                    Some(v) => v,
                    // A processor without an image processor says nothing about images.
                    None => continue,
                },
            };
            return Self::from_json(json, rule).map_err(|msg| WeightsError::Config { path, msg });
        }
        Ok(Self::defaults(rule))
    }

    pub fn from_json(j: &Value, rule: ResizeRule) -> Result<Self, String> {
        let d = Self::defaults(rule);
        let uint = |v: Option<&Value>, name: &str, default| positive_int(v, default, name);
        let flag = |name: &str, default: bool| j.get(name).and_then(Value::as_bool).unwrap_or(default);
        let triple = |name: &str, default: [f32; 3]| -> Result<[f32; 3], String> {
            match j.get(name) {
                None | Some(Value::Null) => Ok(default),
                Some(Value::Array(a)) if a.len() == 3 => {
                    let v: Option<Vec<f32>> = a.iter().map(|x| x.as_f64().map(|x| x as f32)).collect();
                    v.map(|v| [v[0], v[1], v[2]]).ok_or_else(|| format!("`{name}` must list 3 numbers"))
                }
                Some(Value::Number(n)) => Ok([n.as_f64().unwrap_or(0.0) as f32; 3]),
                Some(_) => Err(format!("`{name}` must list 3 numbers")),
            }
        };
        // `min_pixels` / `max_pixels` override `size`, as in transformers.
        let size = j.get("size");
        let min_pixels = uint(
            j.get("min_pixels").or_else(|| size.and_then(|s| s.get("shortest_edge"))),
            "min_pixels",
            d.min_pixels,
        )?;
        let max_pixels =
            uint(j.get("max_pixels").or_else(|| size.and_then(|s| s.get("longest_edge"))), "max_pixels", d.max_pixels)?;
        if min_pixels > max_pixels {
            return Err(format!("min_pixels {min_pixels} is more than max_pixels {max_pixels}"));
        }
        match j.get("resample").and_then(Value::as_u64) {
            None | Some(3) => {}
            Some(r) => return Err(format!("resample {r} is not supported (only 3, bicubic)")),
        }
        let p = ImageProcessor {
            rule,
            min_pixels,
            max_pixels,
            patch_size: uint(j.get("patch_size"), "patch_size", d.patch_size)?,
            temporal_patch_size: uint(j.get("temporal_patch_size"), "temporal_patch_size", d.temporal_patch_size)?,
            merge_size: uint(j.get("merge_size"), "merge_size", d.merge_size)?,
            do_resize: flag("do_resize", true),
            do_rescale: flag("do_rescale", true),
            rescale_factor: j.get("rescale_factor").and_then(Value::as_f64).unwrap_or(d.rescale_factor),
            do_normalize: flag("do_normalize", true),
            image_mean: triple("image_mean", d.image_mean)?,
            image_std: triple("image_std", d.image_std)?,
        };
        if p.image_std.contains(&0.0) {
            return Err("`image_std` must not contain 0".into());
        }
        Ok(p)
    }

    /// The (height, width) an image is resized to: multiples of patch * merge, area within
    /// [min_pixels, max_pixels], aspect ratio kept as closely as possible. The float steps are
    /// Python's, in the same order, so the sizes match transformers' exactly.
    pub fn target_size(&self, height: usize, width: usize) -> Result<(usize, usize), ImageError> {
        if height == 0 || width == 0 {
            return Err(ImageError::Empty { width, height });
        }
        let factor = (self.patch_size * self.merge_size) as f64;
        let (mut h, mut w) = (height as f64, width as f64);
        // GLM scales a side shorter than the factor up first (and truncates, as `int()`).
        if self.rule == ResizeRule::Glm4v && (h < factor || w < factor) {
            let scale = (factor / h).max(factor / w);
            h = (h * scale).trunc();
            w = (w * scale).trunc();
        }
        let ratio = h.max(w) / h.min(w);
        if ratio.is_nan() || ratio > 200.0 {
            return Err(ImageError::AspectRatio { ratio });
        }
        // GLM counts both frames of the temporal patch against the bounds.
        let frames = match self.rule {
            ResizeRule::Qwen2Vl => 1.0,
            ResizeRule::Glm4v => self.temporal_patch_size as f64,
        };
        // Python's round() rounds halves to even.
        let mut h_bar = (h / factor).round_ties_even() * factor;
        let mut w_bar = (w / factor).round_ties_even() * factor;
        if frames * h_bar * w_bar > self.max_pixels as f64 {
            let beta = (frames * h * w / self.max_pixels as f64).sqrt();
            h_bar = factor.max((h / beta / factor).floor() * factor);
            w_bar = factor.max((w / beta / factor).floor() * factor);
        } else if frames * h_bar * w_bar < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (frames * h * w)).sqrt();
            h_bar = (h * beta / factor).ceil() * factor;
            w_bar = (w * beta / factor).ceil() * factor;
        }
        if h_bar < 1.0 || w_bar < 1.0 {
            return Err(ImageError::Empty { width: w_bar as usize, height: h_bar as usize });
        }
        Ok((h_bar as usize, w_bar as usize))
    }

    /// Image tokens the language model sees for an image of this size.
    pub fn num_image_tokens(&self, height: usize, width: usize) -> Result<usize, ImageError> {
        let (h, w) = if self.do_resize { self.target_size(height, width)? } else { (height, width) };
        Ok((h / self.patch_size) * (w / self.patch_size) / (self.merge_size * self.merge_size))
    }

    pub fn preprocess(&self, img: &RgbImage) -> Result<PixelValues, ImageError> {
        let resized;
        let img = if self.do_resize {
            let (h, w) = self.target_size(img.height, img.width)?;
            resized = resize_bicubic(img, w, h);
            &resized
        } else {
            img
        };
        let (ps, m, tp) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        if img.height % (ps * m) != 0 || img.width % (ps * m) != 0 {
            return Err(ImageError::Unsupported(format!(
                "a {}x{} image does not split into {}x{} merged patches (enable do_resize)",
                img.width,
                img.height,
                ps * m,
                ps * m
            )));
        }
        // Channel-first float image, as transformers computes it: rescale in f64 then f32,
        // normalize in f32.
        let (h, w) = (img.height, img.width);
        let mut chw = vec![0f32; 3 * h * w];
        for (i, px) in img.data.chunks_exact(3).enumerate() {
            for c in 0..3 {
                let mut v = if self.do_rescale { (px[c] as f64 * self.rescale_factor) as f32 } else { px[c] as f32 };
                if self.do_normalize {
                    v = (v - self.image_mean[c]) / self.image_std[c];
                }
                chw[c * h * w + i] = v;
            }
        }
        let (gh, gw) = (h / ps, w / ps);
        let cols = 3 * tp * ps * ps;
        let mut data = Vec::with_capacity(gh * gw * cols);
        // Rows in merge-block order: (block row, block col, row in block, col in block).
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let (y0, x0) = ((bh * m + mh) * ps, (bw * m + mw) * ps);
                        for c in 0..3 {
                            for _ in 0..tp {
                                for y in y0..y0 + ps {
                                    let row = c * h * w + y * w;
                                    data.extend_from_slice(&chw[row + x0..row + x0 + ps]);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(PixelValues { data, rows: gh * gw, cols, grid_thw: [1, gh, gw] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_branches() {
        let p = ImageProcessor { min_pixels: 56 * 56, max_pixels: 84 * 84, ..Default::default() };
        assert_eq!(p.target_size(56, 56).unwrap(), (56, 56));
        // 70 / 28 = 2.5 rounds to 2 (half to even), 90 / 28 = 3.2 to 3
        assert_eq!(p.target_size(70, 90).unwrap(), (56, 84));
        assert_eq!(p.target_size(120, 72).unwrap(), (84, 56));
        assert_eq!(p.target_size(20, 30).unwrap(), (56, 84));
        assert!(matches!(p.target_size(1, 201), Err(ImageError::AspectRatio { .. })));
        assert!(matches!(p.target_size(0, 5), Err(ImageError::Empty { .. })));
        assert_eq!(p.num_image_tokens(70, 90).unwrap(), 6);
    }

    #[test]
    fn glm_smart_resize_branches() {
        // transformers' Glm4vImageProcessor sizes for these bounds and images.
        let p = ImageProcessor {
            min_pixels: 2 * 56 * 56,
            max_pixels: 2 * 84 * 84,
            ..ImageProcessor::defaults(ResizeRule::Glm4v)
        };
        assert_eq!(p.target_size(56, 56).unwrap(), (56, 56));
        assert_eq!(p.target_size(70, 90).unwrap(), (56, 84));
        assert_eq!(p.target_size(120, 72).unwrap(), (84, 56));
        // 20x30 is first scaled to 28x42, then up to the minimum area
        assert_eq!(p.target_size(20, 30).unwrap(), (56, 84));
        // both sides below the factor: 5x27 -> 28x151 (151.2 truncated) -> 28x140
        assert_eq!(p.target_size(5, 27).unwrap(), (28, 140));
        assert!(matches!(p.target_size(1, 300), Err(ImageError::AspectRatio { .. })));
        assert_eq!(ImageProcessor::defaults(ResizeRule::Glm4v).target_size(20, 30).unwrap(), (84, 112));
    }

    #[test]
    fn reads_both_config_forms() {
        let a = ImageProcessor::from_json(
            &serde_json::json!({"size": {"shortest_edge": 100, "longest_edge": 200}}),
            ResizeRule::Qwen2Vl,
        )
        .unwrap();
        assert_eq!((a.min_pixels, a.max_pixels), (100, 200));
        let b = ImageProcessor::from_json(&serde_json::json!({"min_pixels": 10, "max_pixels": 20, "size": {"shortest_edge": 100, "longest_edge": 200}}), ResizeRule::Qwen2Vl).unwrap();
        assert_eq!((b.min_pixels, b.max_pixels), (10, 20));
        assert!(ImageProcessor::from_json(&serde_json::json!({"resample": 2}), ResizeRule::Qwen2Vl).is_err());
        assert!(ImageProcessor::from_json(&serde_json::json!({"patch_size": 0}), ResizeRule::Glm4v).is_err());
    }
}
