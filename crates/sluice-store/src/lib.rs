//! The expert store: packed expert files, a budgeted expert cache, parallel reads, prefetch and
//! stats.
//!
//! A packed model directory (written by [`pack`]) holds the resident tensors in
//! `model.safetensors` and every routed expert as one contiguous, 4 KiB-aligned block of
//! `experts.bin`, described by `experts.json` ([`manifest::Manifest`]).

mod error;
pub mod io;
pub mod manifest;
pub mod pack;
pub mod policy;
mod slots;
mod source;
mod stats;
pub mod store;
pub mod unpacked;

pub use error::StoreError;
pub use manifest::{Manifest, MANIFEST_FILE};
pub use policy::Policy;
pub use stats::StoreStats;
pub use store::{ExpertStore, FetchedExpert, StoreOptions};
pub use unpacked::UnpackedLayout;
