//! Automatic prefix caching's index: which physical block holds the keys and values of which
//! full block of tokens, and which of those blocks no sequence holds any more (kept, evicted
//! least recently used first when the pool needs a block).
//!
//! A full block is named by a hash chained over its parent's hash and everything that
//! determines its keys and values: its tokens, the images whose embeddings some of them are
//! (by pixel hash, with which part of each image), their rotary positions when they are not
//! the plain index (M-RoPE), and, in the chain's root, the pool's format (dense dtype or
//! TurboQuant bits, float layers, key scales, float window), its block size and the model.
//! Two blocks with the same hash hold the same keys and values, so a sequence whose prompt
//! starts with cached blocks can reference them instead of computing them. A full block is
//! never written again, so shared blocks need no copy on write.
//!
//! The hash is SHA-256: a collision would silently give a sequence another prompt's keys, so
//! the chance must be nil, not small.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};

use super::block_id::BlockId;
use super::cache::KvCacheSpec;
use super::format::TqSpec;

/// The name of a full block of tokens with everything before it (see the module doc).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl std::fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A run of one image's embedding rows inside a block: rows `offset..offset + len` of the
/// image whose pixels hash to `key`, in the block's order of image tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSpan {
    pub key: [u8; 32],
    pub offset: u32,
    pub len: u32,
}

/// What besides its tokens a block's keys depend on.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlockExtra<'a> {
    /// Per token, its three-axis rotary position, for a sequence with images (None: the
    /// plain index, implied by the block's place in the chain).
    pub positions: Option<&'a [[u32; 3]]>,
    /// The images among the block's tokens, in order.
    pub images: &'a [ImageSpan],
}

/// The chain's root for a pool: its format and the model it serves. Blocks of pools that differ
/// in any of these never share a hash.
pub fn root_hash(spec: &KvCacheSpec, tq: Option<&TqSpec>, model: &str) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"iris-prefix-root-v1");
    put_str(&mut h, model);
    h.update((spec.block_size as u64).to_le_bytes());
    put_str(&mut h, &spec.dtype.to_string());
    match tq {
        None => h.update([0u8]),
        Some(t) => {
            h.update([1u8, t.bits.key, t.bits.value]);
            h.update((t.float_window as u64).to_le_bytes());
            h.update((t.skip_layers.len() as u64).to_le_bytes());
            for &l in &t.skip_layers {
                h.update((l as u64).to_le_bytes());
            }
            h.update((t.key_scales.len() as u64).to_le_bytes());
            for layer in &t.key_scales {
                h.update((layer.len() as u64).to_le_bytes());
                for s in layer {
                    h.update(s.to_bits().to_le_bytes());
                }
            }
        }
    }
    BlockHash(h.finalize().into())
}

/// The hash of a full block of `tokens` after the block named `parent` (the root for the first).
pub fn block_hash(parent: &BlockHash, tokens: &[u32], extra: BlockExtra<'_>) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"iris-block");
    h.update(parent.0);
    h.update((tokens.len() as u64).to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    match extra.positions {
        None => h.update([0u8]),
        Some(p) => {
            h.update([1u8]);
            h.update((p.len() as u64).to_le_bytes());
            for axes in p {
                for a in axes {
                    h.update(a.to_le_bytes());
                }
            }
        }
    }
    h.update((extra.images.len() as u64).to_le_bytes());
    for s in extra.images {
        h.update(s.key);
        h.update(s.offset.to_le_bytes());
        h.update(s.len.to_le_bytes());
    }
    BlockHash(h.finalize().into())
}

fn put_str(h: &mut Sha256, s: &str) {
    h.update((s.len() as u64).to_le_bytes());
    h.update(s.as_bytes());
}

/// The hash -> block index and the least-recently-used order of the cached blocks nobody
/// holds. Reference counts live in the allocator; this only knows which blocks have a name.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    by_hash: HashMap<BlockHash, BlockId>,
    /// Per block, the hash it is cached under.
    hash_of: Vec<Option<BlockHash>>,
    /// Cached blocks no sequence holds, by the tick they were released at: first out first.
    evictable: BTreeMap<u64, BlockId>,
    /// Per block, its key in `evictable` while it is there.
    released_at: Vec<Option<u64>>,
    clock: u64,
    /// Cached blocks handed out for other keys so far.
    pub evictions: u64,
}

impl PrefixIndex {
    pub fn new(num_blocks: usize) -> Self {
        PrefixIndex {
            by_hash: HashMap::new(),
            hash_of: vec![None; num_blocks],
            evictable: BTreeMap::new(),
            released_at: vec![None; num_blocks],
            clock: 0,
            evictions: 0,
        }
    }

    /// The block cached under `hash`.
    pub fn get(&self, hash: &BlockHash) -> Option<BlockId> {
        self.by_hash.get(hash).copied()
    }

    pub fn is_cached(&self, b: BlockId) -> bool {
        self.hash_of[b.0 as usize].is_some()
    }

    /// Names `b` (held, fully computed) `hash`. A hash already cached keeps its block (the
    /// same keys computed twice, by sequences that ran side by side); a block keeps its first name.
    pub fn insert(&mut self, b: BlockId, hash: BlockHash) -> bool {
        if self.by_hash.contains_key(&hash) || self.hash_of[b.0 as usize].is_some() {
            return false;
        }
        self.by_hash.insert(hash, b);
        self.hash_of[b.0 as usize] = Some(hash);
        true
    }

    /// Cached blocks nobody holds.
    pub fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    /// Number of blocks with a name.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The last holder of cached block `b` let it go: it may be evicted from now on, after
    /// every block released before it.
    pub fn push_evictable(&mut self, b: BlockId) {
        self.clock += 1;
        self.evictable.insert(self.clock, b);
        self.released_at[b.0 as usize] = Some(self.clock);
    }

    /// A sequence takes cached block `b` again: it is not evictable while held.
    pub fn take_evictable(&mut self, b: BlockId) {
        if let Some(t) = self.released_at[b.0 as usize].take() {
            self.evictable.remove(&t);
        }
    }

    /// Forgets the least recently released cached block and hands it out for new keys.
    pub fn evict_lru(&mut self) -> Option<BlockId> {
        let (_, b) = self.evictable.pop_first()?;
        self.evictions += 1;
        self.released_at[b.0 as usize] = None;
        if let Some(h) = self.hash_of[b.0 as usize].take() {
            self.by_hash.remove(&h);
        }
        Some(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::format::{KvDtype, TqBits};

    fn spec(dtype: KvDtype, block_size: usize) -> KvCacheSpec {
        KvCacheSpec { block_size, num_blocks: 8, dtype }
    }

    #[test]
    fn hash_chain_names_content_and_context() {
        let root = root_hash(&spec(KvDtype::F32, 4), None, "llama");
        let none = BlockExtra::default();
        let a = block_hash(&root, &[1, 2, 3, 4], none);
        assert_eq!(a, block_hash(&root, &[1, 2, 3, 4], none), "same tokens, same parent: same hash");
        assert_ne!(a, block_hash(&root, &[1, 2, 3, 5], none), "a different token");
        // The same tokens after a different parent are a different block.
        let b = block_hash(&a, &[5, 6, 7, 8], none);
        let other_parent = block_hash(&root, &[9, 2, 3, 4], none);
        assert_ne!(b, block_hash(&other_parent, &[5, 6, 7, 8], none));

        // Images: same pixels, same hash; different pixels or a different part of the image, not.
        let span = |key: u8, offset: u32| [ImageSpan { key: [key; 32], offset, len: 4 }];
        let pad = [7, 7, 7, 7];
        let img = |s: &[ImageSpan]| block_hash(&root, &pad, BlockExtra { positions: None, images: s });
        let (s1, s1b, s2, s1o) = (span(1, 0), span(1, 0), span(2, 0), span(1, 4));
        assert_eq!(img(&s1), img(&s1b));
        assert_ne!(img(&s1), img(&s2));
        assert_ne!(img(&s1), img(&s1o));
        assert_ne!(img(&s1), block_hash(&root, &pad, none));
        // Positions: three-axis positions are part of the name, and differ from the plain index.
        const P1: [[u32; 3]; 4] = [[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 3, 3]];
        const P2: [[u32; 3]; 4] = [[0, 0, 0], [1, 1, 1], [2, 2, 2], [3, 4, 4]];
        let (p1, p2) = (P1, P2);
        let at = |p: &[[u32; 3]]| block_hash(&root, &pad, BlockExtra { positions: Some(p), images: &[] });
        assert_eq!(at(&p1), at(&P1));
        assert_ne!(at(&p1), at(&p2));
        assert_ne!(at(&p1), block_hash(&root, &pad, none));
    }

    #[test]
    fn format_settings_and_model_change_the_root() {
        let dense = root_hash(&spec(KvDtype::F32, 4), None, "m");
        assert_eq!(dense, root_hash(&spec(KvDtype::F32, 4), None, "m"));
        assert_ne!(dense, root_hash(&spec(KvDtype::Bf16, 4), None, "m"), "dtype");
        assert_ne!(dense, root_hash(&spec(KvDtype::F32, 8), None, "m"), "block size");
        assert_ne!(dense, root_hash(&spec(KvDtype::F32, 4), None, "n"), "model");
        let tq = TqSpec::new(TqBits { key: 3, value: 4 });
        let k3v4 = root_hash(&spec(KvDtype::F32, 4), Some(&tq), "m");
        assert_ne!(dense, k3v4, "TurboQuant against dense");
        let variants = [
            TqSpec::new(TqBits { key: 4, value: 4 }),
            TqSpec { skip_layers: vec![0], ..tq.clone() },
            TqSpec { float_window: 8, ..tq.clone() },
            TqSpec { key_scales: vec![vec![1.0, 2.0]], ..tq.clone() },
        ];
        for v in &variants {
            assert_ne!(k3v4, root_hash(&spec(KvDtype::F32, 4), Some(v), "m"), "{v:?}");
        }
        // Rings are per-sequence storage, not part of what a block holds.
        assert_eq!(k3v4, root_hash(&spec(KvDtype::F32, 4), Some(&TqSpec { window_rings: 9, ..tq }), "m"));
    }

    #[test]
    fn evicts_least_recently_released_first_and_forgets_its_name() {
        let mut ix = PrefixIndex::new(4);
        let h = |i: u8| BlockHash([i; 32]);
        for i in 0..3u32 {
            assert!(ix.insert(BlockId(i), h(i as u8)));
        }
        assert!(!ix.insert(BlockId(3), h(0)), "a cached hash keeps its block");
        assert!(!ix.insert(BlockId(0), h(9)), "a block keeps its first name");
        ix.push_evictable(BlockId(2));
        ix.push_evictable(BlockId(0));
        ix.push_evictable(BlockId(1));
        // Block 2 was taken again (a cache hit): it is not evictable while held.
        ix.take_evictable(BlockId(2));
        assert_eq!(ix.num_evictable(), 2);
        assert_eq!(ix.evict_lru(), Some(BlockId(0)));
        assert_eq!(ix.get(&h(0)), None, "an evicted block loses its name");
        assert_eq!(ix.get(&h(1)), Some(BlockId(1)));
        ix.push_evictable(BlockId(2));
        assert_eq!(ix.evict_lru(), Some(BlockId(1)));
        assert_eq!(ix.evict_lru(), Some(BlockId(2)));
        assert_eq!(ix.evict_lru(), None);
        assert!(ix.is_empty());
    }
}
