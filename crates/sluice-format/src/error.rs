//! The one error type of this crate. Every message is a single line that names the file (and
//! the tensor, where there is one), says what was expected and, where it helps, how to fix it.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("model directory {} does not exist", .0.display())]
    NoDir(PathBuf),

    #[error("{} is not a directory (pass the model directory, not a file in it)", .0.display())]
    NotADir(PathBuf),

    /// A file the model directory must have is absent.
    #[error("no {name} in {}: {hint}", dir.display())]
    MissingFile {
        dir: PathBuf,
        name: String,
        hint: String,
    },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// A JSON file that does not parse; serde's message carries the line and column.
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    /// Parsed JSON (config.json, the shard index, ...) whose content is not what is expected.
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },

    /// A safetensors file whose header is malformed.
    #[error("{}: {msg}", path.display())]
    Safetensors { path: PathBuf, msg: String },

    #[error(
        "{} is truncated: tensor `{name}` needs bytes up to {needed} of the data section but the file has only {have} (re-download or re-convert the file)",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        name: String,
        needed: usize,
        have: usize,
    },

    #[error(
        "no weights in {}: expected model.safetensors or model.safetensors.index.json",
        dir.display()
    )]
    NoWeights { dir: PathBuf },

    #[error("tensor `{name}` is in both {} and {} (mixed checkpoints in one directory? remove the stray file)", first.display(), second.display())]
    DuplicateTensor {
        name: String,
        first: PathBuf,
        second: PathBuf,
    },

    /// `similar` is empty or starts with `; similar: `.
    #[error("tensor `{name}` not found in {} ({count} tensors{similar})", dir.display())]
    TensorNotFound {
        name: String,
        dir: PathBuf,
        count: usize,
        similar: String,
    },

    /// A tensor that exists but is not what the caller asked for (dtype, shape, quantisation).
    #[error("tensor `{name}` in {}: {msg}", file.display())]
    Tensor {
        name: String,
        file: PathBuf,
        msg: String,
    },

    /// Routed-expert tensors that are not in a layout sluice reads, or do not fit together
    /// (see [`crate::experts`]).
    #[error("tensor `{tensor}`: {msg}")]
    ExpertLayout { tensor: String, msg: String },
}
