//! The expert store: packed expert files, a budgeted expert cache, parallel reads, prefetch and
//! stats.
//!
//! A packed model directory (written by [`pack()`]) holds the resident tensors in
//! `model.safetensors` and every routed expert as one contiguous, 4 KiB-aligned block of
//! `experts.bin`, described by `experts.json` ([`Manifest`]). An unpacked checkpoint can stream
//! its experts too ([`UnpackedLayout`]): each block is then gathered from the shards.
//!
//! The modules, each with one job (→ lists the others it uses besides `error`; there is no
//! cycle):
//! - `store`: [`ExpertStore`], which block goes in which cache slot and when (fetch, prefetch,
//!   eviction, completion) → `slots`, `source`, `stats`, `policy`, `io`, `manifest`, `unpacked`,
//!   `verify`;
//! - `verify`: [`Verify`], when a block read is checked against its checksum, and the record of
//!   the blocks checked since the file last changed → `manifest`;
//! - `slots`: the slots' memory and the state of each slot (empty, loading, ready, failed) →
//!   `manifest`;
//! - `source`: where blocks come from, `experts.bin` or the shards: which reads fill a slot, and
//!   which file and offset to name when one fails → `io`, `unpacked`, `manifest`;
//! - `unpacked`: the block layout and reads of an unpacked checkpoint, from
//!   [`sluice_format::experts`] → `manifest`;
//! - `pack`: `sluice pack`, writing `experts.bin`/`experts.json` from the same scan →
//!   `manifest`, `mtp`;
//! - `mtp`: `sluice pack --mtp-from`, an official checkpoint's multi-token-prediction layer
//!   converted to the packed model's layout and MLX affine quantisation;
//! - `manifest`: the `experts.json` format and the block layout;
//! - `io`: the reader (io_uring or a pread pool) into caller-provided memory; crate-private
//!   but for its options, since its `submit` is `unsafe` (`bench` is a safe way in for
//!   `examples/read_bench.rs`);
//! - `expert_source`: [`ExpertStore`] as the models see it, a
//!   [`sluice_backend::ExpertSource`] → `store`, `manifest`;
//! - `policy`: eviction policies; `stats`: [`StoreStats`] and the per-expert [`ExpertMap`]; `error`: [`StoreError`] (→
//!   `manifest`).

mod error;
mod expert_source;
mod io;
mod manifest;
mod mtp;
mod pack;
mod policy;
mod slots;
mod source;
mod stats;
mod store;
mod unpacked;
mod verify;

#[doc(hidden)]
pub mod bench;

pub use error::StoreError;
pub use io::{IoKind, ReadFault, ReadFaults, ReaderOptions};
pub use manifest::{
    checksum, FormatSpec, LayerExperts, Manifest, ManifestError, Part, Projection, BLOCK_ALIGN,
    EXPERTS_FILE, MANIFEST_FILE,
};
pub use mtp::{affine_dequantize, affine_quantize, AffineQuantized};
pub use pack::{pack, pack_with_mtp, PackError, PackOptions, PackSummary};
pub use policy::Policy;
pub use stats::{ExpertEvent, ExpertMap, StoreStats};
pub use store::{ExpertStore, FetchedExpert, Pinner, StoreOptions};
pub use unpacked::UnpackedLayout;
pub use verify::Verify;
