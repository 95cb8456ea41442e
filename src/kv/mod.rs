//! Paged KV memory: fixed-size blocks handed out by an allocator, one block table per
//! sequence, and per-layer storage of the blocks' keys and values (dense floats or
//! TurboQuant codes). Full blocks may be cached by a hash of their content and prefix
//! (`prefix_cache`) and shared by reference count.

pub mod block_allocator;
pub mod block_id;
pub mod block_table;
pub mod cache;
pub mod calibration;
pub mod format;
pub mod prefix_cache;
pub mod recurrent;
pub mod slots;
pub mod spec;

pub use block_allocator::{BlockAllocator, BlockId};
pub use block_table::BlockTable;
pub use cache::{KvCache, KvCacheSpec, LayerCache, WindowCheckpoint};
pub use format::{KvCacheDtype, KvDtype, KvFormatError, TqBits, TqSpec};
pub use prefix_cache::{BlockExtra, BlockHash, ImageSpan};
pub use recurrent::RecurrentState;
pub use slots::SlotPool;
pub use spec::{CacheGroup, CacheKind, CacheSpec, PoolSize};
