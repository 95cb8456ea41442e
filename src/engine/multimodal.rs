//! What a sequence with images carries: its images, the three-axis positions computed at
//! admission, and (once its first chunk is scheduled) the image embeddings that replace its
//! image tokens. Plus the engine's cache of embeddings by image content.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::Tensor;

use crate::kv::ImageSpan;
use crate::media::PixelValues;
use crate::models::{PromptPositions, VisionModel};

/// A preprocessed image handed to the engine with a request.
#[derive(Debug, Clone)]
pub struct ImageInput {
    pub pixels: Arc<PixelValues>,
    /// Content key: images with equal keys share cached embeddings.
    pub key: [u8; 32],
}

impl ImageInput {
    pub fn new(pixels: PixelValues) -> Self {
        let key = pixels.content_key();
        ImageInput { pixels: Arc::new(pixels), key }
    }
}

pub struct MultiModalState {
    /// Until the sequence's first step encodes them.
    pub images: Vec<ImageInput>,
    /// Positions of the prompt's tokens; later tokens continue at `index + delta`.
    pub positions: PromptPositions,
    /// Prompt indices of the image tokens, ascending; the k-th takes embedding row k.
    pub image_rows: Vec<usize>,
    /// Per image in order, its content key and how many embedding rows (image tokens) it has:
    /// what names a block's image tokens for the prefix cache (kept after `images` is emptied).
    pub image_keys: Vec<([u8; 32], usize)>,
    /// `[image_rows.len(), hidden]`, computed when the sequence is first scheduled and kept
    /// across preemption.
    pub embeds: Option<Tensor>,
}

impl MultiModalState {
    pub fn position(&self, index: usize) -> [u32; 3] {
        match self.positions.positions.get(index) {
            Some(p) => *p,
            None => [(index as i64 + self.positions.delta) as u32; 3],
        }
    }

    /// The runs `[start, end)` of consecutive image tokens in the prompt (an image each, or
    /// adjacent images together), in order.
    pub fn image_runs(&self) -> Vec<(usize, usize)> {
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &i in &self.image_rows {
            match runs.last_mut() {
                Some((_, end)) if *end == i => *end += 1,
                _ => runs.push((i, i + 1)),
            }
        }
        runs
    }

    /// Embedding rows `k0..k1` for the image tokens among prompt indices `range`.
    pub fn embed_rows_in(&self, range: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let k0 = self.image_rows.partition_point(|&i| i < range.start);
        let k1 = self.image_rows.partition_point(|&i| i < range.end);
        k0..k1
    }

    /// The parts of images among prompt indices `range`, in order (for the block's hash).
    pub fn image_spans(&self, range: std::ops::Range<usize>) -> Vec<ImageSpan> {
        let rows = self.embed_rows_in(range);
        let mut spans = Vec::new();
        let mut first = 0; // the image's first embedding row
        for &(key, n) in &self.image_keys {
            let (lo, hi) = (rows.start.max(first), rows.end.min(first + n));
            if lo < hi {
                spans.push(ImageSpan { key, offset: (lo - first) as u32, len: (hi - lo) as u32 });
            }
            first += n;
        }
        spans
    }
}

/// Image embeddings by content key, least recently used evicted beyond a byte budget.
pub struct EmbedCache {
    entries: HashMap<[u8; 32], (Tensor, u64)>,
    bytes: usize,
    capacity: usize,
    clock: u64,
    pub hits: u64,
    pub misses: u64,
}

impl EmbedCache {
    pub fn new(capacity_bytes: usize) -> Self {
        EmbedCache { entries: HashMap::new(), bytes: 0, capacity: capacity_bytes, clock: 0, hits: 0, misses: 0 }
    }

    pub fn get(&mut self, key: &[u8; 32]) -> Option<Tensor> {
        self.clock += 1;
        match self.entries.get_mut(key) {
            Some((t, used)) => {
                *used = self.clock;
                self.hits += 1;
                Some(t.clone())
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    pub fn insert(&mut self, key: [u8; 32], t: Tensor) {
        let size = t.elem_count() * t.dtype().size_in_bytes();
        if size > self.capacity {
            return;
        }
        self.clock += 1;
        if let Some((old, _)) = self.entries.insert(key, (t, self.clock)) {
            self.bytes -= old.elem_count() * old.dtype().size_in_bytes();
        }
        self.bytes += size;
        while self.bytes > self.capacity {
            let Some((&oldest, _)) = self.entries.iter().min_by_key(|(_, (_, used))| *used) else { break };
            if let Some((t, _)) = self.entries.remove(&oldest) {
                self.bytes -= t.elem_count() * t.dtype().size_in_bytes();
            }
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// A rendered chat prompt has one image token per image; the model takes `counts[k]` of
/// them for image k, as `vision.placeholder` lays them out (transformers' processor expands
/// them the same way).
pub fn expand_image_tokens(tokens: &[u32], vision: &dyn VisionModel, counts: &[usize]) -> Result<Vec<u32>, String> {
    let image_token = vision.image_token_id();
    let found = tokens.iter().filter(|&&t| t == image_token).count();
    if found != counts.len() {
        return Err(format!("the prompt has {found} image placeholder(s) for {} image(s)", counts.len()));
    }
    let mut out = Vec::with_capacity(tokens.len() + counts.iter().sum::<usize>());
    let mut next = counts.iter();
    for &t in tokens {
        match (t == image_token).then(|| next.next()).flatten() {
            Some(&n) => out.extend(vision.placeholder(n)),
            None => out.push(t),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expands_each_placeholder_by_its_count() {
        /// A model whose image token is 9, with or without markers 7 .. 8 around each image.
        struct Stub(bool);
        impl VisionModel for Stub {
            fn image_token_id(&self) -> u32 {
                9
            }
            fn preprocess(&self, _: &crate::media::RgbImage) -> Result<PixelValues, crate::media::ImageError> {
                unreachable!()
            }
            fn num_image_tokens(&self, _: &PixelValues) -> usize {
                unreachable!()
            }
            fn placeholder(&self, n: usize) -> Vec<u32> {
                let body = std::iter::repeat_n(9, n);
                if self.0 {
                    std::iter::once(7).chain(body).chain([8]).collect()
                } else {
                    body.collect()
                }
            }
            fn prompt_positions(
                &self,
                _: &[u32],
                _: &[&PixelValues],
            ) -> Result<PromptPositions, crate::models::PositionError> {
                unreachable!()
            }
            fn encode(&self, _: &PixelValues) -> candle_core::Result<Tensor> {
                unreachable!()
            }
        }
        assert_eq!(expand_image_tokens(&[1, 9, 2, 9], &Stub(false), &[2, 3]).unwrap(), vec![1, 9, 9, 2, 9, 9, 9]);
        assert_eq!(expand_image_tokens(&[1, 9, 2], &Stub(true), &[2]).unwrap(), vec![1, 7, 9, 9, 8, 2]);
        assert!(expand_image_tokens(&[1, 9], &Stub(false), &[2, 3]).is_err());
        assert!(expand_image_tokens(&[1, 2], &Stub(false), &[1]).is_err());
    }

    #[test]
    fn cache_evicts_least_recently_used_beyond_budget() {
        let t = |v: f32| Tensor::new(&[v; 4], &candle_core::Device::Cpu).unwrap(); // 16 bytes
        let mut c = EmbedCache::new(40);
        c.insert([1; 32], t(1.0));
        c.insert([2; 32], t(2.0));
        assert!(c.get(&[1; 32]).is_some()); // 1 is now more recent than 2
        c.insert([3; 32], t(3.0)); // 48 bytes > 40: evicts 2
        assert!(c.get(&[2; 32]).is_none());
        assert!(c.get(&[1; 32]).is_some() && c.get(&[3; 32]).is_some());
        assert_eq!((c.len(), c.hits, c.misses), (2, 3, 1));
        // Cleared, the whole budget is free again: two entries fit without evicting.
        c.clear();
        assert!(c.is_empty() && c.get(&[1; 32]).is_none());
        c.insert([4; 32], t(4.0));
        c.insert([5; 32], t(5.0));
        assert_eq!(c.len(), 2);
    }
}
