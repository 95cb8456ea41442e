//! Encoded image bytes (PNG, JPEG, WebP, GIF: its first frame) -> RGB, within limits set
//! before decoding so that a decompression bomb or a corrupt file is an error, not an OOM.

use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader};

use super::pixels::RgbImage;

/// Bounds on what a request may make the server decode.
#[derive(Debug, Clone, Copy)]
pub struct DecodeLimits {
    /// Largest encoded size accepted.
    pub max_bytes: usize,
    /// Largest width * height accepted (checked from the header, before decoding).
    pub max_pixels: u64,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        // 20 MB and 8K x 8K, well above what a vision tower is fed after resizing.
        DecodeLimits { max_bytes: 20 << 20, max_pixels: 8192 * 8192 }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ImageError {
    #[error("the image is {size} bytes, more than the limit of {max} bytes")]
    TooManyBytes { size: usize, max: usize },
    #[error("the image is {width}x{height} pixels, more than the limit of {max} pixels")]
    TooManyPixels { width: u32, height: u32, max: u64 },
    #[error("unsupported image format (PNG, JPEG, WebP and GIF are accepted)")]
    UnknownFormat,
    #[error("the image cannot be decoded: {0}")]
    Corrupt(String),
    #[error("the image has an empty side ({width}x{height})")]
    Empty { width: usize, height: usize },
    #[error("the image's aspect ratio {ratio:.1} is more than 200")]
    AspectRatio { ratio: f64 },
    #[error("{0}")]
    Unsupported(String),
}

/// Decodes `bytes` into RGB. Transparency is composited onto white, as transformers does
/// before preprocessing.
pub fn decode_image(bytes: &[u8], limits: &DecodeLimits) -> Result<RgbImage, ImageError> {
    if bytes.len() > limits.max_bytes {
        return Err(ImageError::TooManyBytes { size: bytes.len(), max: limits.max_bytes });
    }
    let reader =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| ImageError::Corrupt(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP | ImageFormat::Gif) => {}
        _ => return Err(ImageError::UnknownFormat),
    }
    let (width, height) = reader.into_dimensions().map_err(|e| ImageError::Corrupt(e.to_string()))?;
    if width as u64 * height as u64 > limits.max_pixels {
        return Err(ImageError::TooManyPixels { width, height, max: limits.max_pixels });
    }
    let mut reader =
        ImageReader::new(Cursor::new(bytes)).with_guessed_format().map_err(|e| ImageError::Corrupt(e.to_string()))?;
    let mut l = image::Limits::default();
    l.max_image_width = Some(width);
    l.max_image_height = Some(height);
    // The decoded frame (at most 8 bytes per pixel) plus decoder scratch space.
    l.max_alloc = Some(limits.max_pixels.saturating_mul(16).max(64 << 20));
    reader.limits(l);
    let img = reader.decode().map_err(|e| ImageError::Corrupt(e.to_string()))?;
    if img.width() == 0 || img.height() == 0 {
        return Err(ImageError::Empty { width: img.width() as usize, height: img.height() as usize });
    }
    Ok(to_rgb(img))
}

fn to_rgb(img: DynamicImage) -> RgbImage {
    let (w, h) = (img.width() as usize, img.height() as usize);
    if !img.color().has_alpha() {
        return RgbImage::new(w, h, img.into_rgb8().into_raw());
    }
    let rgba = img.into_rgba8().into_raw();
    let data = rgba.chunks_exact(4).flat_map(over_white).collect();
    RgbImage::new(w, h, data)
}

/// Pillow's `alpha_composite(white, pixel)` then RGB, in its fixed-point arithmetic.
fn over_white(p: &[u8]) -> [u8; 3] {
    let a = p[3] as u32;
    if a == 0 {
        return [255, 255, 255];
    }
    const PRECISION_BITS: u32 = 7;
    let shift_div_255 = |v: u32| ((v >> 8) + v) >> 8;
    // Background alpha is 255, so the output alpha (times 255) is 255 * 255.
    let out_a255 = a * 255 + 255 * (255 - a);
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / out_a255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let mix = |c: u8| {
        let t = c as u32 * coef1 + 255 * coef2;
        (shift_div_255(t + (0x80 << PRECISION_BITS)) >> PRECISION_BITS) as u8
    };
    [mix(p[0]), mix(p[1]), mix(p[2])]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(width: u32, height: u32, color: image::ExtendedColorType, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        image::ImageEncoder::write_image(image::codecs::png::PngEncoder::new(&mut out), data, width, height, color)
            .expect("encode");
        out
    }

    #[test]
    fn decodes_rgb_gray_and_alpha() {
        let rgb = png(2, 1, image::ExtendedColorType::Rgb8, &[1, 2, 3, 4, 5, 6]);
        assert_eq!(decode_image(&rgb, &DecodeLimits::default()).unwrap().data, vec![1, 2, 3, 4, 5, 6]);
        let gray = png(1, 1, image::ExtendedColorType::L8, &[7]);
        assert_eq!(decode_image(&gray, &DecodeLimits::default()).unwrap().data, vec![7, 7, 7]);
        // opaque, fully transparent, half transparent
        let rgba = png(3, 1, image::ExtendedColorType::Rgba8, &[10, 20, 30, 255, 10, 20, 30, 0, 0, 100, 200, 128]);
        let got = decode_image(&rgba, &DecodeLimits::default()).unwrap().data;
        assert_eq!(&got[..6], &[10, 20, 30, 255, 255, 255]);
        // Pillow gives (127, 177, 227) for this pixel over white.
        assert_eq!(&got[6..], &[127, 177, 227]);
    }

    #[test]
    fn decodes_jpeg_webp_and_gif() {
        use image::codecs::{gif::GifEncoder, jpeg::JpegEncoder, webp::WebPEncoder};
        use image::ImageEncoder;
        let rgb: Vec<u8> = (0..6 * 4 * 3).map(|i| (i * 7 % 256) as u8).collect();
        let enc = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut out = Vec::new();
            f(&mut out);
            decode_image(&out, &DecodeLimits::default()).expect("decodes")
        };
        let jpeg = enc(&|o| JpegEncoder::new(o).write_image(&rgb, 6, 4, image::ExtendedColorType::Rgb8).unwrap());
        assert_eq!((jpeg.width, jpeg.height), (6, 4)); // lossy: size only
        let webp =
            enc(&|o| WebPEncoder::new_lossless(o).write_image(&rgb, 6, 4, image::ExtendedColorType::Rgb8).unwrap());
        assert_eq!(webp.data, rgb);
        // GIF stores a palette: a first frame of few colours comes back exactly.
        let flat: Vec<u8> =
            (0..24).flat_map(|i| if i % 2 == 0 { [255, 0, 0, 255] } else { [0, 0, 255, 255] }).collect();
        let gif = enc(&|o| GifEncoder::new(o).write_image(&flat, 6, 4, image::ExtendedColorType::Rgba8).unwrap());
        let want: Vec<u8> = flat.chunks(4).flat_map(|p| [p[0], p[1], p[2]]).collect();
        assert_eq!(gif.data, want);
    }

    #[test]
    fn limits_and_garbage_are_errors() {
        let rgb = png(4, 4, image::ExtendedColorType::Rgb8, &[0; 48]);
        let tight = DecodeLimits { max_bytes: 1 << 20, max_pixels: 15 };
        assert!(matches!(decode_image(&rgb, &tight), Err(ImageError::TooManyPixels { width: 4, height: 4, .. })));
        let small = DecodeLimits { max_bytes: 10, max_pixels: 100 };
        assert!(matches!(decode_image(&rgb, &small), Err(ImageError::TooManyBytes { .. })));
        assert_eq!(decode_image(b"not an image at all", &DecodeLimits::default()), Err(ImageError::UnknownFormat));
        let mut truncated = rgb.clone();
        truncated.truncate(rgb.len() / 2);
        assert!(matches!(decode_image(&truncated, &DecodeLimits::default()), Err(ImageError::Corrupt(_))));
    }
}
