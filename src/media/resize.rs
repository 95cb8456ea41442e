//! Bicubic resampling equal to Pillow's `Image.resize(size, BICUBIC)` on 8-bit RGB, which the
//! reference preprocessing (transformers' PIL backend) uses: a separable convolution with
//! Keys' cubic (a = -0.5) stretched by the scale when shrinking (antialiasing), coefficients
//! in 22-bit fixed point, each pass rounded and clipped to 8 bits. Pillow (>= 11) runs the
//! vertical pass first when the height shrinks by more than twice as many pixels as the
//! width; the order changes the rounding, so it is followed here.

use super::pixels::RgbImage;

const PRECISION_BITS: u32 = 32 - 8 - 2;

fn cubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// For each output index: the first input index, and the fixed-point weights of the inputs
/// from there on.
struct Taps {
    first: Vec<usize>,
    weights: Vec<Vec<i32>>,
}

fn taps(in_size: usize, out_size: usize) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let filter_scale = scale.max(1.0);
    let support = 2.0 * filter_scale;
    let mut first = Vec::with_capacity(out_size);
    let mut weights = Vec::with_capacity(out_size);
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        // C casts truncate toward zero; negative starts are clamped to 0 anyway.
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let w: Vec<f64> = (xmin..xmax).map(|x| cubic((x as f64 - center + 0.5) / filter_scale)).collect();
        let total: f64 = w.iter().sum();
        let fixed = w
            .iter()
            .map(|&v| {
                let v = if total != 0.0 { v / total } else { v };
                let s = v * (1u32 << PRECISION_BITS) as f64;
                (if s < 0.0 { s - 0.5 } else { s + 0.5 }) as i32
            })
            .collect();
        first.push(xmin);
        weights.push(fixed);
    }
    Taps { first, weights }
}

fn clip8(v: i64) -> u8 {
    if v <= 0 {
        0
    } else if v >= (1i64 << PRECISION_BITS << 8) {
        255
    } else {
        (v >> PRECISION_BITS) as u8
    }
}

/// Resizes `img` to `width` x `height` (unchanged when the size is the same, as Pillow).
pub fn resize_bicubic(img: &RgbImage, width: usize, height: usize) -> RgbImage {
    if width == img.width && height == img.height {
        return img.clone();
    }
    let shrink_h = img.height as i64 - height as i64;
    let shrink_w = img.width as i64 - width as i64;
    if shrink_h > 0 && shrink_h > 2 * shrink_w {
        horizontal(&vertical(img, height), width)
    } else {
        vertical(&horizontal(img, width), height)
    }
}

fn horizontal(img: &RgbImage, width: usize) -> RgbImage {
    if width == img.width {
        return img.clone();
    }
    let t = taps(img.width, width);
    let mut out = vec![0u8; img.height * width * 3];
    for y in 0..img.height {
        let row = &img.data[y * img.width * 3..(y + 1) * img.width * 3];
        for x in 0..width {
            for c in 0..3 {
                let mut acc = 1i64 << (PRECISION_BITS - 1);
                for (k, &w) in t.weights[x].iter().enumerate() {
                    acc += row[(t.first[x] + k) * 3 + c] as i64 * w as i64;
                }
                out[(y * width + x) * 3 + c] = clip8(acc);
            }
        }
    }
    RgbImage::new(width, img.height, out)
}

fn vertical(img: &RgbImage, height: usize) -> RgbImage {
    if height == img.height {
        return img.clone();
    }
    let (t, width) = (taps(img.height, height), img.width);
    let mut out = vec![0u8; height * width * 3];
    for y in 0..height {
        for x in 0..width {
            for c in 0..3 {
                let mut acc = 1i64 << (PRECISION_BITS - 1);
                for (k, &w) in t.weights[y].iter().enumerate() {
                    acc += img.data[((t.first[y] + k) * width + x) * 3 + c] as i64 * w as i64;
                }
                out[(y * width + x) * 3 + c] = clip8(acc);
            }
        }
    }
    RgbImage::new(width, height, out)
}
