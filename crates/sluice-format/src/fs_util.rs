//! Sizes of a model directory's files.

use std::path::Path;

/// Total bytes of the `*.safetensors` files directly in `dir` (0 if it cannot be read).
pub fn safetensors_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}
