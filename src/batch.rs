//! One engine step's input: the scheduled tokens of every sequence, flattened.
//!
//! There is no padding and no batch-wide offset: every token carries its own position, and
//! every sequence its own slice of the batch, context length and block table. A sequence
//! therefore computes the same values whatever else shares its step.

use candle_core::{Device, Tensor};

/// Where one sequence's tokens sit in the flat batch, and what they attend to.
#[derive(Debug, Clone)]
pub struct SeqSlice {
    /// First row of this sequence in the flat batch.
    pub q_start: usize,
    /// Rows scheduled for it this step (a prefill chunk, or 1 for a decode).
    pub q_len: usize,
    /// Tokens in its cache after this step, the new ones included.
    pub context_len: usize,
    /// Physical block ids holding its tokens, in order.
    pub block_table: Vec<u32>,
}

impl SeqSlice {
    /// Absolute position of the first scheduled token.
    pub fn first_position(&self) -> usize {
        self.context_len - self.q_len
    }
}

/// Attention metadata for a paged KV cache.
#[derive(Debug, Clone)]
pub struct AttentionMeta {
    pub block_size: usize,
    pub seqs: Vec<SeqSlice>,
    /// Cache slot (block * block_size + offset) each row's key and value go to.
    pub slot_mapping: Vec<u32>,
    /// Index into `seqs` for each row.
    pub row_seq: Vec<u32>,
    /// A TurboQuant cache's float window, when it has one (`set_float_window`).
    pub window: Option<WindowMeta>,
    /// Per sequence, its state slot in a hybrid model's recurrent layers (None: no such layers,
    /// or not given; a recurrent layer then refuses the step).
    pub state_slots: Option<Vec<u32>>,
    /// Per sequence, whether a recurrent layer keeps its state after each of its rows but the
    /// last in its slot's checkpoints (a verify step's sequences with drafts, so that rejected
    /// rows can be undone; `RecurrentState::restore`). None: no sequence does.
    pub state_checkpoints: Option<Vec<bool>>,
    /// Per sequence, position ranges `[start, end)` within its context whose rows also see the
    /// later rows of their range, on the layers that ask for it (Gemma 4's sliding layers see
    /// a whole image at once when the config says `use_bidirectional_attention: "vision"`).
    /// None: every layer is causal. Each range ends inside the step's context.
    pub bidirectional: Option<Vec<Vec<(usize, usize)>>>,
    /// The same metadata in device memory, for kernels that run there (`upload`); None on CPU.
    pub device: Option<DeviceAttentionMeta>,
}

/// Where a step's rows sit in the rings of a TurboQuant cache's float window (the most recent
/// `len` keys and values of each running sequence, unquantized; see `ops::turboquant::FloatWindow`).
#[derive(Debug, Clone)]
pub struct WindowMeta {
    pub len: usize,
    /// Per sequence, its ring.
    pub rings: Vec<u32>,
    /// Per row, its ring row (`ring * len + position % len`) when its position is among its
    /// sequence's last `len` after the step, else `NO_SLOT` (a longer prompt chunk's first
    /// rows leave the window within the step).
    pub slots: Vec<u32>,
}

/// A slot that means "do not store this row": padding rows (CUDA graphs run fixed batch sizes),
/// rows that leave a float window.
pub const NO_SLOT: u32 = u32::MAX;

/// Sequences computing at least this many rows in a step are prompt chunks: on a GPU their
/// attention runs in tiles of rows (`MetaLayout::tiles`) with tensor cores.
pub const PREFILL_MIN_ROWS: usize = 16;
/// Rows per prompt-chunk tile.
pub const PREFILL_TILE_ROWS: usize = 64;

/// A prompt-chunk tile: `PREFILL_TILE_ROWS` rows (fewer at a chunk's end) of one sequence, and
/// how its attention's keys may be split over blocks of the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillTile {
    pub seq: usize,
    /// The tile's first row.
    pub row: usize,
    /// The most blocks its keys are split over (1: not split); `prefill_splits`.
    pub splits: usize,
    /// Where its split blocks' partial states start in the step's scratch, in units of
    /// `PREFILL_TILE_ROWS` rows (0 when not split).
    pub part: usize,
}

/// The most blocks a prompt chunk's tiles split their keys over: enough that the chunk's tiles
/// take about 16 blocks per query head together, as long as each block still reads 4 key tiles
/// of 64 (`PF_MIN_SPLIT_TILES` in prefill_attention.cu, which also bounds it by the layer's
/// window), and at most 8. A chunk of few rows over a long cached context (a conversation's
/// turn after a prefix-cache hit) would otherwise run on a few of the GPU's ~130
/// multiprocessors. It depends on the chunk alone (its rows and context), so a row's result
/// does not depend on the rest of the batch.
pub fn prefill_splits(q_len: usize, context_len: usize) -> usize {
    let tiles = q_len.div_ceil(PREFILL_TILE_ROWS);
    16usize.div_ceil(tiles).min(context_len.div_ceil(64) / 4).clamp(1, 8)
}

/// Where each part of a step's metadata sits in its device copy (u32 offsets): `slot_mapping
/// [rows]` at 0, `row_seq [rows]`, `positions [rows]`, the float window's `ring_slots [rows]`
/// (`NO_SLOT` without one), per sequence `(q_start, q_len, context_len, offset of its block
/// table)` `[4 seqs]`, the float window's `rings [seqs]` (0 without one), each sequence's
/// recurrent `state_slots [seqs]` (`NO_SLOT` without them, and for padding), `row_end [rows]` (the
/// end of the bidirectional range a row lies in, else 0), the prompt-chunk tiles `(sequence,
/// first row, splits, part)` `[4 num_tiles]` (`PrefillTile`), then the block tables end to end. Everything
/// a step's kernels read is in it, so a CUDA graph replays a step by rewriting this buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaLayout {
    pub rows: usize,
    pub row_seq: usize,
    pub positions: usize,
    pub ring_slots: usize,
    pub seq_info: usize,
    pub rings: usize,
    pub state_slots: usize,
    pub row_end: usize,
    pub tiles: usize,
    pub num_tiles: usize,
    /// Units of partial states the prompt-chunk tiles' key splits need (`PrefillTile::part`).
    pub split_units: usize,
    /// The most blocks a tile splits its keys over (1 without prompt chunks).
    pub max_splits: usize,
    pub block_tables: usize,
}

impl MetaLayout {
    /// The layout of `rows` rows, `seqs` sequences and the prompt-chunk tiles `tiles`.
    pub fn new(rows: usize, seqs: usize, tiles: &[PrefillTile]) -> Self {
        let num_tiles = tiles.len();
        let split_units = tiles.iter().filter(|t| t.splits > 1).map(|t| t.part + t.splits).max().unwrap_or(0);
        let max_splits = tiles.iter().map(|t| t.splits).max().unwrap_or(1);
        let rings = 4 * rows + 4 * seqs;
        let state_slots = rings + seqs;
        let row_end = state_slots + seqs;
        let tiles_at = row_end + rows;
        MetaLayout {
            rows,
            row_seq: rows,
            positions: 2 * rows,
            ring_slots: 3 * rows,
            seq_info: 4 * rows,
            rings,
            state_slots,
            row_end,
            tiles: tiles_at,
            num_tiles,
            split_units,
            max_splits,
            block_tables: tiles_at + 4 * num_tiles,
        }
    }

    /// Sequences the layout has room for (the step's and any padding).
    pub fn seqs(&self) -> usize {
        self.state_slots - self.rings
    }
}

/// A step's attention metadata in device memory (one u32 tensor laid out as `layout` says).
#[derive(Debug, Clone)]
pub struct DeviceAttentionMeta {
    pub data: Tensor,
    pub layout: MetaLayout,
}

impl DeviceAttentionMeta {
    /// Slots given on the host, in device memory: the metadata of a write to them.
    pub fn slots(slots: &[u32], device: &Device) -> candle_core::Result<Self> {
        // One spare entry: an empty write still has a tensor to point at.
        let data: Vec<u32> = slots.iter().copied().chain([NO_SLOT]).collect();
        Ok(DeviceAttentionMeta {
            data: Tensor::new(data.as_slice(), device)?,
            layout: MetaLayout::new(slots.len(), 0, &[]),
        })
    }

    /// Each row's position, `[rows]` u32 on the device.
    pub fn positions(&self) -> candle_core::Result<Tensor> {
        self.data.narrow(0, self.layout.positions, self.layout.rows)
    }
}

impl AttentionMeta {
    pub fn new(block_size: usize, seqs: Vec<SeqSlice>) -> Self {
        let total: usize = seqs.iter().map(|s| s.q_len).sum();
        let mut slot_mapping = Vec::with_capacity(total);
        let mut row_seq = Vec::with_capacity(total);
        for (i, s) in seqs.iter().enumerate() {
            for pos in s.first_position()..s.context_len {
                let block = s.block_table[pos / block_size];
                slot_mapping.push(block * block_size as u32 + (pos % block_size) as u32);
                row_seq.push(i as u32);
            }
        }
        AttentionMeta {
            block_size,
            seqs,
            slot_mapping,
            row_seq,
            window: None,
            state_slots: None,
            state_checkpoints: None,
            bidirectional: None,
            device: None,
        }
    }

    /// Gives each sequence its float-window ring (`rings[i]` for `seqs[i]`) in a TurboQuant
    /// cache whose window holds `len` positions; updates the device copy if there is one.
    pub fn set_float_window(&mut self, len: usize, rings: Vec<u32>) -> candle_core::Result<()> {
        if len == 0 || rings.len() != self.seqs.len() {
            candle_core::bail!(
                "a float window of {len} positions needs a ring per sequence ({} for {})",
                rings.len(),
                self.seqs.len()
            );
        }
        let mut slots = Vec::with_capacity(self.num_rows());
        for (s, &ring) in self.seqs.iter().zip(&rings) {
            let keep = s.context_len.saturating_sub(len);
            slots.extend((s.first_position()..s.context_len).map(|p| {
                if p >= keep {
                    (ring as usize * len + p % len) as u32
                } else {
                    NO_SLOT
                }
            }));
        }
        self.window = Some(WindowMeta { len, rings, slots });
        match self.device.as_ref().map(|d| d.data.device().clone()) {
            Some(device) => self.upload(&device),
            None => Ok(()),
        }
    }

    /// Gives each sequence its state slot (`slots[i]` for `seqs[i]`) in recurrent layers.
    pub fn set_state_slots(&mut self, slots: Vec<u32>) -> candle_core::Result<()> {
        if slots.len() != self.seqs.len() {
            candle_core::bail!("{} state slots for {} sequences", slots.len(), self.seqs.len());
        }
        self.state_slots = Some(slots);
        match self.device.as_ref().map(|d| d.data.device().clone()) {
            Some(device) => self.upload(&device),
            None => Ok(()),
        }
    }

    /// Marks the sequences whose recurrent states are kept after each row (`record[i]` for
    /// `seqs[i]`; see `state_checkpoints`).
    pub fn set_state_checkpoints(&mut self, record: Vec<bool>) -> candle_core::Result<()> {
        if record.len() != self.seqs.len() {
            candle_core::bail!("state checkpoints marked for {} sequences of {}", record.len(), self.seqs.len());
        }
        self.state_checkpoints = record.iter().any(|&r| r).then_some(record);
        Ok(())
    }

    /// Gives sequence i the ranges `spans[i]` whose rows see each other both ways (see
    /// `bidirectional`); each must lie within its context.
    pub fn set_bidirectional(&mut self, spans: Vec<Vec<(usize, usize)>>) -> candle_core::Result<()> {
        if spans.len() != self.seqs.len() {
            candle_core::bail!("bidirectional ranges for {} sequences of {}", spans.len(), self.seqs.len());
        }
        for (s, ranges) in self.seqs.iter().zip(&spans) {
            if let Some(&(a, b)) = ranges.iter().find(|&&(a, b)| a >= b || b > s.context_len) {
                candle_core::bail!("bidirectional range {a}..{b} outside a context of {}", s.context_len);
            }
        }
        self.bidirectional = spans.iter().any(|r| !r.is_empty()).then_some(spans);
        Ok(())
    }

    /// Copies the metadata to `device` for the kernels there; nothing to do on the CPU.
    pub fn upload(&mut self, device: &Device) -> candle_core::Result<()> {
        if device.is_cpu() {
            return Ok(());
        }
        let layout = MetaLayout::new(self.num_rows(), self.seqs.len(), &self.prefill_tiles());
        let data = Tensor::new(self.packed(&layout).as_slice(), device)?;
        self.device = Some(DeviceAttentionMeta { data, layout });
        Ok(())
    }

    /// The metadata laid out as `layout`, which may have more rows and sequences than this
    /// step: those are padding (slot NO_SLOT, position 0), r rows per padding sequence (the
    /// padding rows over the padding sequences), each with a context of its r rows in block 0,
    /// whose table entries follow the real tables.
    pub fn packed(&self, layout: &MetaLayout) -> Vec<u32> {
        let t = self.num_rows();
        let pad_seqs = layout.seqs() - self.seqs.len();
        let r = if pad_seqs == 0 { 1 } else { (layout.rows - t) / pad_seqs };
        debug_assert!(pad_seqs == 0 || r * pad_seqs == layout.rows - t, "padding rows split evenly");
        let tables: usize = self.seqs.iter().map(|s| s.block_table.len()).sum();
        let pad_blocks = r.div_ceil(self.block_size).max(1);
        let mut data = Vec::with_capacity(layout.block_tables + tables + pad_blocks);
        data.extend_from_slice(&self.slot_mapping);
        data.resize(layout.row_seq, NO_SLOT);
        data.extend_from_slice(&self.row_seq);
        data.extend((0..layout.rows - t).map(|p| (self.seqs.len() + p / r) as u32));
        for s in &self.seqs {
            data.extend((s.first_position()..s.context_len).map(|p| p as u32));
        }
        data.resize(layout.ring_slots, 0);
        if let Some(w) = &self.window {
            data.extend_from_slice(&w.slots);
        }
        data.resize(layout.seq_info, NO_SLOT);
        let mut offset = 0;
        for s in &self.seqs {
            data.extend([s.q_start, s.q_len, s.context_len, offset].map(|v| v as u32));
            offset += s.block_table.len();
        }
        for p in 0..pad_seqs {
            data.extend([(t + p * r) as u32, r as u32, r as u32, tables as u32]);
        }
        if let Some(w) = &self.window {
            data.extend_from_slice(&w.rings);
        }
        data.resize(layout.state_slots, 0);
        if let Some(slots) = &self.state_slots {
            data.extend_from_slice(slots);
        }
        data.resize(layout.row_end, NO_SLOT);
        if let Some(spans) = &self.bidirectional {
            for (s, ranges) in self.seqs.iter().zip(spans) {
                data.extend(
                    (s.first_position()..s.context_len)
                        .map(|p| ranges.iter().find(|&&(a, b)| (a..b).contains(&p)).map_or(0, |&(_, b)| b as u32)),
                );
            }
        }
        data.resize(layout.tiles, 0);
        data.extend(
            self.prefill_tiles()
                .iter()
                .take(layout.num_tiles)
                .flat_map(|t| [t.seq, t.row, t.splits, t.part].map(|v| v as u32)),
        );
        for s in &self.seqs {
            data.extend_from_slice(&s.block_table);
        }
        data.extend(std::iter::repeat_n(0, pad_blocks));
        data
    }

    /// The same step with every sequence computing `r` rows (`r` at least each one's), so that
    /// a CUDA graph of `r` rows per sequence can run a step whose sequences verify different
    /// numbers of drafts. A sequence's extra rows follow its real ones, at the next positions;
    /// they write no key or value (`NO_SLOT`, no ring row) and their table is extended with
    /// block 0, whose values they may read; their outputs are ignored. Every kernel places a
    /// row at `context_len - q_len + offset`, so each real row attends exactly as before.
    /// Also returns where each real row sits in the padded step.
    pub fn rows_padded_to(&self, r: usize) -> (AttentionMeta, Vec<u32>) {
        let bs = self.block_size;
        let (mut slot_mapping, mut row_seq, mut real) = (Vec::new(), Vec::new(), Vec::new());
        let mut window_slots = Vec::new();
        let mut seqs = Vec::with_capacity(self.seqs.len());
        for (i, s) in self.seqs.iter().enumerate() {
            let pad = r.saturating_sub(s.q_len);
            let rows = s.q_start..s.q_start + s.q_len;
            real.extend((i * r..i * r + s.q_len).map(|x| x as u32));
            slot_mapping.extend_from_slice(&self.slot_mapping[rows.clone()]);
            slot_mapping.extend(std::iter::repeat_n(NO_SLOT, pad));
            row_seq.extend(std::iter::repeat_n(i as u32, s.q_len + pad));
            if let Some(w) = &self.window {
                window_slots.extend_from_slice(&w.slots[rows]);
                window_slots.extend(std::iter::repeat_n(NO_SLOT, pad));
            }
            let context_len = s.context_len + pad;
            let mut block_table = s.block_table.clone();
            block_table.resize(block_table.len().max(context_len.div_ceil(bs)), 0);
            seqs.push(SeqSlice { q_start: i * r, q_len: s.q_len + pad, context_len, block_table });
        }
        let window =
            self.window.as_ref().map(|w| WindowMeta { len: w.len, rings: w.rings.clone(), slots: window_slots });
        // Padding rows would run a recurrence; a recurrent model never pads (it runs op by op).
        // Padded steps are decodes and verifies: no image rows, nothing bidirectional.
        let meta = AttentionMeta {
            block_size: bs,
            seqs,
            slot_mapping,
            row_seq,
            window,
            state_slots: None,
            state_checkpoints: None,
            bidirectional: None,
            device: None,
        };
        (meta, real)
    }

    pub fn num_rows(&self) -> usize {
        self.slot_mapping.len()
    }

    /// The metadata of only the last `counts[i]` rows of each sequence i (sequences with none
    /// left out), for layers that attend without storing: the same contexts and tables, no
    /// float window or state slots. And the rows kept, as indices into this step's rows.
    pub fn tail(&self, counts: &[usize]) -> candle_core::Result<(AttentionMeta, Vec<u32>)> {
        if counts.len() != self.seqs.len() {
            candle_core::bail!("output rows for {} sequences of {}", counts.len(), self.seqs.len());
        }
        let (mut seqs, mut kept, mut ranges) = (Vec::new(), Vec::new(), Vec::new());
        for (i, (s, &n)) in self.seqs.iter().zip(counts).enumerate() {
            if n == 0 {
                continue;
            }
            if n > s.q_len {
                candle_core::bail!("{n} output rows of a sequence computing {}", s.q_len);
            }
            let first = s.q_start + s.q_len - n;
            seqs.push(SeqSlice { q_start: kept.len(), q_len: n, ..s.clone() });
            kept.extend((first..first + n).map(|r| r as u32));
            if let Some(b) = &self.bidirectional {
                ranges.push(b[i].clone());
            }
        }
        let mut meta = AttentionMeta::new(self.block_size, seqs);
        if self.bidirectional.is_some() {
            meta.set_bidirectional(ranges)?;
        }
        if let Some(d) = &self.device {
            meta.upload(d.data.device())?;
        }
        Ok((meta, kept))
    }

    /// The tiles of PREFILL_TILE_ROWS rows of the prompt chunks, in row order, their split
    /// blocks' partial states one after another.
    pub fn prefill_tiles(&self) -> Vec<PrefillTile> {
        let mut part = 0;
        let mut tiles = Vec::new();
        for (seq, s) in self.seqs.iter().enumerate().filter(|(_, s)| s.q_len >= PREFILL_MIN_ROWS) {
            let splits = prefill_splits(s.q_len, s.context_len);
            for row in (s.q_start..s.q_start + s.q_len).step_by(PREFILL_TILE_ROWS) {
                tiles.push(PrefillTile { seq, row, splits, part: if splits > 1 { part } else { 0 } });
                if splits > 1 {
                    part += splits;
                }
            }
        }
        tiles
    }
}

/// Token positions for rotary embeddings, one per row.
#[derive(Debug, Clone)]
pub enum Positions {
    Flat(Vec<u32>),
    /// M-RoPE (temporal, height, width) per row; each sequence computed its own at admission.
    MRope(Vec<[u32; 3]>),
}

impl Positions {
    pub fn len(&self) -> usize {
        match self {
            Positions::Flat(p) => p.len(),
            Positions::MRope(p) => p.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Rows whose input is an image embedding instead of their token's embedding.
#[derive(Clone)]
pub struct ImageRows {
    /// `[T]` u32: row i of the model input is row `source[i]` of `[token embeddings; embeds]`.
    source: Tensor,
    /// `[n, hidden]` embeddings of the image rows, in row order.
    embeds: Tensor,
}

impl ImageRows {
    /// `rows[k]` (ascending) takes `embeds[k]`; `num_rows` is the batch size.
    pub fn new(rows: &[u32], embeds: Tensor, num_rows: usize) -> candle_core::Result<Self> {
        if rows.len() != embeds.dim(0)? {
            candle_core::bail!("{} image rows for {} image embeddings", rows.len(), embeds.dim(0)?);
        }
        let mut source: Vec<u32> = (0..num_rows as u32).collect();
        for (k, &r) in rows.iter().enumerate() {
            let slot = source
                .get_mut(r as usize)
                .ok_or_else(|| candle_core::Error::Msg(format!("image row {r} outside a batch of {num_rows}")))?;
            *slot = (num_rows + k) as u32;
        }
        let source = Tensor::new(source.as_slice(), embeds.device())?;
        Ok(ImageRows { source, embeds })
    }

    fn to_device(&mut self, device: &Device) -> candle_core::Result<()> {
        self.source = self.source.to_device(device)?;
        self.embeds = self.embeds.to_device(device)?;
        Ok(())
    }

    /// `ids` (`[T]` u32) with the image rows' ids replaced by `with`.
    pub fn replace_ids(&self, ids: &Tensor, with: u32) -> candle_core::Result<Tensor> {
        let num_rows = ids.dim(0)?;
        let is_image = self.source.ge(num_rows as u32)?;
        is_image.where_cond(&Tensor::full(with, num_rows, ids.device())?, ids)
    }

    /// Token embeddings `[T, hidden]` with the image rows replaced.
    pub fn merge(&self, token_embeds: &Tensor) -> candle_core::Result<Tensor> {
        let embeds = self.embeds.to_dtype(token_embeds.dtype())?;
        Tensor::cat(&[token_embeds, &embeds], 0)?.index_select(&self.source, 0)
    }
}

/// A step's model input. A clone shares its tensors.
#[derive(Clone)]
pub struct Batch {
    /// Token ids, `[T]` u32.
    pub token_ids: Tensor,
    pub positions: Positions,
    pub attn: AttentionMeta,
    /// Image embeddings placed at image-pad rows (vision-language models).
    pub images: Option<ImageRows>,
    /// Per sequence, how many of its last rows the step reads the output of (sampled and
    /// verified rows; 0 for a prompt chunk that samples nothing). None: every row (prompt
    /// logprobs, tests). Layers that store no keys or values may compute only these rows.
    pub output_rows: Option<Vec<usize>>,
}

impl Batch {
    /// Builds a batch of text tokens: `tokens[i]` are the new tokens of `seqs[i]`.
    pub fn from_tokens(
        device: &Device,
        block_size: usize,
        seqs: Vec<SeqSlice>,
        tokens: &[u32],
    ) -> candle_core::Result<Self> {
        let mut attn = AttentionMeta::new(block_size, seqs);
        attn.upload(device)?;
        if tokens.len() != attn.num_rows() {
            candle_core::bail!("batch has {} tokens for {} scheduled rows", tokens.len(), attn.num_rows());
        }
        let positions = attn.seqs.iter().flat_map(|s| (s.first_position()..s.context_len).map(|p| p as u32)).collect();
        Ok(Batch {
            token_ids: Tensor::new(tokens, device)?,
            positions: Positions::Flat(positions),
            attn,
            images: None,
            output_rows: None,
        })
    }

    /// A batch with explicit per-row positions and, optionally, image embeddings.
    pub fn new(
        device: &Device,
        block_size: usize,
        seqs: Vec<SeqSlice>,
        tokens: &[u32],
        positions: Positions,
        images: Option<ImageRows>,
    ) -> candle_core::Result<Self> {
        let mut attn = AttentionMeta::new(block_size, seqs);
        attn.upload(device)?;
        if tokens.len() != attn.num_rows() || positions.len() != attn.num_rows() {
            candle_core::bail!(
                "batch has {} tokens and {} positions for {} scheduled rows",
                tokens.len(),
                positions.len(),
                attn.num_rows()
            );
        }
        Ok(Batch { token_ids: Tensor::new(tokens, device)?, positions, attn, images, output_rows: None })
    }

    /// The input embeddings: token embeddings with any image rows replaced.
    pub fn input_embeds(&self, token_embeds: Tensor) -> candle_core::Result<Tensor> {
        match &self.images {
            Some(img) => img.merge(&token_embeds),
            None => Ok(token_embeds),
        }
    }

    pub fn num_rows(&self) -> usize {
        self.attn.num_rows()
    }

    /// What a copy of this batch on another device (`copy_on`) needs read to the host
    /// beforehand, on the batch's own thread: its token ids and image rows. Read from another
    /// rank's thread (tensor parallelism), they could wait behind a collective queued on this
    /// batch's device that waits for that very rank.
    pub fn host_parts(&self) -> candle_core::Result<(Vec<u32>, Option<ImageRows>)> {
        let images = self.images.clone().map(|mut img| img.to_device(&Device::Cpu).map(|()| img)).transpose()?;
        Ok((self.token_ids.to_vec1::<u32>()?, images))
    }

    /// A copy of this batch on `device` (another rank's, under tensor parallelism), from its
    /// `host_parts`.
    pub fn copy_on(
        &self,
        device: &Device,
        (ids, images): &(Vec<u32>, Option<ImageRows>),
    ) -> candle_core::Result<Batch> {
        let mut attn = self.attn.clone();
        attn.upload(device)?;
        let images = images.clone().map(|mut img| img.to_device(device).map(|()| img)).transpose()?;
        Ok(Batch {
            token_ids: Tensor::new(ids.as_slice(), device)?,
            positions: self.positions.clone(),
            attn,
            images,
            output_rows: self.output_rows.clone(),
        })
    }

    /// Moves a batch built on the host to `device`: the token ids, any image rows and the
    /// attention metadata.
    pub fn to_device(&mut self, device: &Device) -> candle_core::Result<()> {
        self.token_ids = self.token_ids.to_device(device)?;
        if let Some(img) = &mut self.images {
            img.to_device(device)?;
        }
        self.attn.upload(device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// What another rank's copy of a batch is made of: its token ids and image rows, read to
    /// the host, then placed on the rank's device; its input embeddings are the original's.
    #[test]
    fn a_copy_from_host_parts_keeps_the_image_rows() {
        let dev = Device::Cpu;
        let seq = SeqSlice { q_start: 0, q_len: 4, context_len: 4, block_table: vec![0] };
        let embeds = Tensor::new(&[[7f32, 7.0], [8.0, 8.0]], &dev).unwrap();
        let images = ImageRows::new(&[1, 2], embeds, 4).unwrap();
        let positions = Positions::Flat(vec![0, 1, 2, 3]);
        let batch = Batch::new(&dev, 4, vec![seq], &[5, 0, 0, 6], positions, Some(images)).unwrap();
        let copy = batch.copy_on(&dev, &batch.host_parts().unwrap()).unwrap();
        let tokens =
            |b: &Batch| b.token_ids.to_dtype(DType::F32).unwrap().unsqueeze(1).unwrap().repeat((1, 2)).unwrap();
        let rows = |b: &Batch| b.input_embeds(tokens(b)).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(rows(&copy), [[5.0, 5.0], [7.0, 7.0], [8.0, 8.0], [6.0, 6.0]]);
        assert_eq!(rows(&copy), rows(&batch));
    }

    /// A prompt chunk longer than the window and a decode: the chunk's first rows leave the
    /// window within the step (no ring row), the rest go to `ring * len + position % len`;
    /// the device copy holds them, and each sequence's ring, where its layout says, with
    /// padding rows and sequences writing nothing and reading ring 0.
    /// Few rows over a long context split the most; a chunk of many tiles, or one over a short
    /// context, not at all; the split tiles' partial states follow each other.
    #[test]
    fn prompt_chunk_tiles_split_by_their_own_rows_and_context() {
        assert_eq!(prefill_splits(16, 30_000), 8);
        assert_eq!(prefill_splits(144, 1424), 5); // 3 tiles: 6 wanted, 22 key tiles allow 5
        assert_eq!(prefill_splits(144, 600), 2);
        assert_eq!(prefill_splits(45, 300), 1);
        assert_eq!(prefill_splits(1024, 30_000), 1);
        assert_eq!(prefill_splits(2048, 30_000), 1);
        let seq = |q_start, q_len, context_len: usize| SeqSlice {
            q_start,
            q_len,
            context_len,
            block_table: (0..context_len.div_ceil(16) as u32).collect(),
        };
        let m = AttentionMeta::new(16, vec![seq(0, 1, 900), seq(1, 130, 2000), seq(131, 40, 300), seq(171, 20, 4000)]);
        let tiles = m.prefill_tiles();
        let t: Vec<_> = tiles.iter().map(|t| (t.seq, t.row, t.splits, t.part)).collect();
        assert_eq!(t, [(1, 1, 6, 0), (1, 65, 6, 6), (1, 129, 6, 12), (2, 131, 1, 0), (3, 171, 8, 18)]);
        let l = MetaLayout::new(m.num_rows(), 4, &tiles);
        assert_eq!((l.num_tiles, l.split_units, l.max_splits), (5, 26, 8));
        let data = m.packed(&l);
        assert_eq!(&data[l.tiles + 16..l.tiles + 20], &[3, 171, 8, 18]);
    }

    #[test]
    fn float_window_rows_and_rings_are_packed_where_the_layout_says() {
        let seqs = vec![
            SeqSlice { q_start: 0, q_len: 6, context_len: 8, block_table: vec![0, 1] },
            SeqSlice { q_start: 6, q_len: 1, context_len: 11, block_table: vec![2, 3, 4] },
        ];
        let mut meta = AttentionMeta::new(4, seqs);
        assert!(meta.set_float_window(4, vec![3]).is_err(), "a ring per sequence");
        assert!(meta.set_float_window(0, vec![3, 1]).is_err(), "a window of no positions");
        meta.set_float_window(4, vec![3, 1]).unwrap();
        let w = meta.window.as_ref().unwrap();
        // Positions 2..8 of the first sequence, 4..8 kept (ring 3 starts at row 12); position
        // 10 of the second (ring 1 starts at row 4; 10 % 4 = 2).
        assert_eq!(w.slots, vec![NO_SLOT, NO_SLOT, 12, 13, 14, 15, 6]);
        let layout = MetaLayout::new(9, 3, &[]);
        let data = meta.packed(&layout);
        assert_eq!(&data[layout.ring_slots..layout.ring_slots + 7], &w.slots[..]);
        assert_eq!(&data[layout.ring_slots + 7..layout.seq_info], &[NO_SLOT, NO_SLOT]);
        assert_eq!(&data[layout.rings..layout.state_slots], &[3, 1, 0]);
        assert!(data[layout.row_end..layout.tiles].iter().all(|&e| e == 0), "no image ranges");
        assert_eq!(&data[layout.seq_info..layout.seq_info + 4], &[0, 6, 8, 0]);
        assert_eq!(&data[layout.block_tables..], &[0, 1, 2, 3, 4, 0]);
        // Without a window: no ring rows, ring 0.
        let plain = AttentionMeta::new(4, meta.seqs.clone()).packed(&layout);
        assert!(plain[layout.ring_slots..layout.seq_info].iter().all(|&s| s == NO_SLOT));
        assert!(plain[layout.rings..layout.state_slots].iter().all(|&r| r == 0));
        // State slots: each sequence's, NO_SLOT for the padding sequence and without them.
        assert!(plain[layout.state_slots..layout.row_end].iter().all(|&s| s == NO_SLOT));
        let mut hybrid = AttentionMeta::new(4, meta.seqs.clone());
        hybrid.set_state_slots(vec![5, 2]).unwrap();
        assert_eq!(&hybrid.packed(&layout)[layout.state_slots..layout.row_end], &[5, 2, NO_SLOT]);
    }

    /// A row inside an image's bidirectional range carries the range's end, every other row 0,
    /// where the layout says (the CUDA kernels read a row up to that end).
    #[test]
    fn bidirectional_range_ends_are_packed_per_row() {
        let seqs = vec![
            SeqSlice { q_start: 0, q_len: 6, context_len: 8, block_table: vec![0, 1] },
            SeqSlice { q_start: 6, q_len: 1, context_len: 11, block_table: vec![2, 3, 4] },
        ];
        let mut meta = AttentionMeta::new(4, seqs);
        assert!(meta.set_bidirectional(vec![vec![(3, 9)], vec![]]).is_err(), "past the context");
        meta.set_bidirectional(vec![vec![(3, 6)], vec![(9, 11)]]).unwrap();
        let layout = MetaLayout::new(8, 3, &[]);
        let data = meta.packed(&layout);
        // Rows are positions 2..8 of the first sequence, then position 10 of the second.
        assert_eq!(&data[layout.row_end..layout.row_end + 7], &[0, 6, 6, 6, 0, 0, 11]);
        assert!(data[layout.row_end + 7..layout.tiles].iter().all(|&e| e == 0), "padding rows");
    }

    /// A step mixing a decode and a verify of two drafts, padded to 3 rows per sequence: the
    /// decode's two extra rows write nothing, sit at the positions after its context (block 0
    /// where its table ends) and are not real rows; the real rows keep their slots, positions
    /// and ring rows.
    #[test]
    fn rows_padded_to_keeps_each_real_row_where_it_attends() {
        let seqs = vec![
            SeqSlice { q_start: 0, q_len: 1, context_len: 8, block_table: vec![5, 6] },
            SeqSlice { q_start: 1, q_len: 3, context_len: 6, block_table: vec![2, 3] },
        ];
        let mut meta = AttentionMeta::new(4, seqs);
        meta.set_float_window(4, vec![1, 0]).unwrap();
        let (padded, real) = meta.rows_padded_to(3);
        assert_eq!(real, vec![0, 3, 4, 5]);
        assert_eq!(padded.slot_mapping, vec![27, NO_SLOT, NO_SLOT, 11, 12, 13]);
        assert_eq!(padded.row_seq, vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(padded.seqs[0].context_len, 10);
        assert_eq!(padded.seqs[0].first_position(), 7, "the decode row keeps its position");
        assert_eq!(padded.seqs[0].block_table, vec![5, 6, 0]);
        assert_eq!(padded.seqs[1].block_table, vec![2, 3]);
        assert_eq!((padded.seqs[1].q_start, padded.seqs[1].first_position()), (3, 3));
        let w = padded.window.as_ref().unwrap();
        assert_eq!(w.slots, vec![7, NO_SLOT, NO_SLOT, 3, 0, 1]);
        assert_eq!(w.slots[..1], meta.window.as_ref().unwrap().slots[..1]);
    }

    /// A verify step's graph layout: two sequences of 3 rows padded to four; each padding
    /// sequence has 3 rows of its own, writing nothing, over the padding block table.
    #[test]
    fn padding_sequences_take_as_many_rows_as_the_real_ones() {
        let seqs = vec![
            SeqSlice { q_start: 0, q_len: 3, context_len: 9, block_table: vec![5, 6, 7] },
            SeqSlice { q_start: 3, q_len: 3, context_len: 3, block_table: vec![2] },
        ];
        let meta = AttentionMeta::new(4, seqs);
        let layout = MetaLayout::new(12, 4, &[]);
        let data = meta.packed(&layout);
        assert_eq!(&data[..12], &[26, 27, 28, 8, 9, 10, NO_SLOT, NO_SLOT, NO_SLOT, NO_SLOT, NO_SLOT, NO_SLOT]);
        assert_eq!(&data[layout.row_seq..layout.positions], &[0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]);
        assert_eq!(&data[layout.positions..layout.positions + 6], &[6, 7, 8, 0, 1, 2]);
        assert_eq!(&data[layout.seq_info..layout.rings], &[0, 3, 9, 0, 3, 3, 3, 3, 6, 3, 3, 4, 9, 3, 3, 4]);
        assert_eq!(&data[layout.block_tables..], &[5, 6, 7, 2, 0]);
    }
}
