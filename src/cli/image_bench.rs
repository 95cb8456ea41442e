//! `iris bench` on a vision-language model: the image side. One image (a file, or a generated
//! test image of a given size) in a one-turn chat prompt: preprocessing time, the vision
//! tower's time per image, and the time to first token of the image prompt with the tower
//! included (the embedding cache is emptied before each run, so every run encodes).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use serde::Serialize;

use super::stats::median;
use crate::engine::{expand_image_tokens, Engine, ImageInput, Request, SamplingParams};
use crate::media::{decode_image, DecodeLimits, PixelValues, RgbImage};
use crate::models::VisionModel;
use crate::tokenizer::{ChatMessage, ContentPart};

/// Where the benchmark image comes from.
#[derive(Debug, Clone)]
pub enum ImageSource {
    File(PathBuf),
    /// A generated image of this width and height.
    Generated(usize, usize),
}

/// `WxH` (e.g. `448x448`).
pub fn parse_size(s: &str) -> Result<(usize, usize), String> {
    let (w, h) = s.split_once(['x', 'X']).ok_or_else(|| format!("`{s}` is not WIDTHxHEIGHT (e.g. 448x448)"))?;
    let dim = |v: &str| v.trim().parse::<usize>().ok().filter(|&d| d > 0 && d <= 16384);
    match (dim(w), dim(h)) {
        (Some(w), Some(h)) => Ok((w, h)),
        _ => Err(format!("`{s}`: width and height must be whole numbers from 1 to 16384")),
    }
}

#[derive(Debug, Serialize, Clone)]
pub struct ImageBench {
    /// The image as given (before the processor resizes it).
    pub width: usize,
    pub height: usize,
    /// Embeddings the vision tower produces for it (= image tokens in the prompt).
    pub image_tokens: usize,
    pub prompt_len: usize,
    /// Decoded image -> patches (resize, rescale, normalize).
    pub preprocess_ms: f64,
    /// The vision tower (patches -> merged embeddings), per image.
    pub vision_ms_per_image: f64,
    /// Submission of the image prompt -> its first token: tower, prefill and sampling.
    pub ttft_ms: f64,
}

/// A smooth gradient with a fine checker on top: not constant, so no stage can shortcut it.
fn generated(width: usize, height: usize) -> RgbImage {
    let mut data = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        for x in 0..width {
            let check = if (x / 7 + y / 5) % 2 == 0 { 40 } else { 0 };
            data.push(((x * 255) / width.max(1)) as u8);
            data.push(((y * 255) / height.max(1)) as u8);
            data.push((((x + y) * 97 % 216) + check) as u8);
        }
    }
    RgbImage::new(width, height, data)
}

/// The benchmark image.
pub fn load_image(source: &ImageSource) -> anyhow::Result<RgbImage> {
    Ok(match source {
        ImageSource::Generated(w, h) => generated(*w, *h),
        ImageSource::File(p) => {
            let bytes = std::fs::read(p).with_context(|| format!("cannot read {}", p.display()))?;
            decode_image(&bytes, &DecodeLimits::default()).with_context(|| format!("{}", p.display()))?
        }
    })
}

/// `image` with its colours shifted by `variant` steps: another picture (another content
/// hash) of the same size for each variant, the image itself for 0.
pub fn variant(image: &RgbImage, variant: usize) -> RgbImage {
    let mut out = image.clone();
    if variant > 0 {
        for px in out.data.chunks_mut(3) {
            px[2] = px[2].wrapping_add((variant * 37) as u8);
        }
    }
    out
}

/// A one-turn chat prompt ("Describe this image.") holding `pixels` (processed), with the
/// model's image tokens expanded.
pub fn image_prompt(engine: &Engine, vision: &dyn VisionModel, pixels: &PixelValues) -> anyhow::Result<Vec<u32>> {
    let msg = ChatMessage::parts("user", vec![ContentPart::image(), ContentPart::text("Describe this image.")]);
    let tok = engine.tokenizer().clone();
    let text = tok.apply_chat_template(&[msg], true).context("cannot render the chat template")?;
    expand_image_tokens(&tok.encode(&text, false)?, vision, &[vision.num_image_tokens(pixels)])
        .map_err(|e| anyhow::anyhow!("the chat template did not place the image: {e}"))
}

pub fn run(engine: &mut Engine, source: &ImageSource, repeats: usize) -> anyhow::Result<ImageBench> {
    let vision = engine.vision().cloned().context("this model does not take images (--image, --image-size)")?;
    let image = load_image(source)?;
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    let mut preprocess = Vec::with_capacity(repeats);
    let mut pixels = None;
    for _ in 0..repeats {
        let t = Instant::now();
        pixels = Some(vision.preprocess(&image)?);
        preprocess.push(ms(t));
    }
    let pixels = pixels.context("--repeats must be positive")?;
    let image_tokens = vision.num_image_tokens(&pixels);
    let prompt = image_prompt(engine, vision.as_ref(), &pixels)?;

    // Warm-up, then the tower alone.
    vision.encode(&pixels)?;
    let mut tower = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let t = Instant::now();
        let e = vision.encode(&pixels)?;
        e.device().synchronize()?;
        tower.push(ms(t));
    }

    let params = SamplingParams { max_tokens: 1, ignore_eos: true, ..SamplingParams::default() };
    let mut ttft = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        engine.clear_embed_cache();
        let t = Instant::now();
        let req = Request { prompt_tokens: prompt.clone(), params: params.clone() };
        engine.add_request_with_images(req, vec![ImageInput::new(pixels.clone())])?;
        let mut first = None;
        while engine.has_work() {
            for u in engine.step()? {
                if u.token.is_some() {
                    first.get_or_insert_with(|| ms(t));
                }
            }
        }
        ttft.push(first.context("the image prompt produced no token")?);
    }
    Ok(ImageBench {
        width: image.width,
        height: image.height,
        image_tokens,
        prompt_len: prompt.len(),
        preprocess_ms: median(preprocess),
        vision_ms_per_image: median(tower),
        ttft_ms: median(ttft),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_or_say_why_not() {
        assert_eq!(parse_size("448x448"), Ok((448, 448)));
        assert_eq!(parse_size("896X600"), Ok((896, 600)));
        assert!(parse_size("448").is_err());
        assert!(parse_size("0x10").is_err());
        assert!(parse_size("axb").is_err());
    }
}
