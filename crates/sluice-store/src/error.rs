//! The store's error type.

use std::path::PathBuf;

/// Errors of the store, each naming the block and the file.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Manifest(#[from] crate::manifest::ManifestError),
    /// The checkpoint's expert tensors could not be laid out (unpacked checkpoints).
    #[error(transparent)]
    Format(#[from] sluice_format::FormatError),
    #[error("opening {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("layer {layer} expert {expert}: {msg} ({path} at offset {offset}); {hint}")]
    Block {
        layer: usize,
        expert: u32,
        msg: String,
        path: PathBuf,
        offset: u64,
        /// What to do about it.
        hint: &'static str,
    },
    #[error("{0}")]
    Layout(String),
    #[error("layer {0} has no streamed experts in {1}")]
    NoLayer(usize, PathBuf),
    #[error("expert {expert} is out of range for layer {layer} ({experts} experts)")]
    Expert {
        layer: usize,
        expert: u32,
        experts: usize,
    },
    #[error("{0}")]
    Memory(String),
}
