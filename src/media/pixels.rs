//! An image as decoded (`RgbImage`) and as a model takes it (`PixelValues`).

/// An 8-bit RGB image, row-major `[height, width, 3]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: usize,
    pub height: usize,
    pub data: Vec<u8>,
}

impl RgbImage {
    pub fn new(width: usize, height: usize, data: Vec<u8>) -> Self {
        debug_assert_eq!(data.len(), width * height * 3);
        RgbImage { width, height, data }
    }
}

/// A preprocessed image: flattened patches `[rows, cols]` (row-major) and the patch grid
/// (temporal, height, width) they form.
#[derive(Debug, Clone, PartialEq)]
pub struct PixelValues {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
    pub grid_thw: [usize; 3],
}

impl PixelValues {
    /// A content key for the image-embedding cache: equal pixels give equal keys.
    pub fn content_key(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        for v in self.grid_thw {
            h.update((v as u64).to_le_bytes());
        }
        let mut buf = Vec::with_capacity(4096 * 4);
        for chunk in self.data.chunks(4096) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|v| v.to_le_bytes()));
            h.update(&buf);
        }
        h.finalize().into()
    }
}
