//! Forward passes of the model families sluice runs, one file per architecture, written against
//! [`sluice_backend::Backend`] so that the same code runs on every backend.
//!
//! [`load`] reads a [`ModelDir`], picks the architecture from its `model_type`, checks every
//! tensor's shape and format against the config, and returns a [`CausalLm`].

use std::sync::Arc;

use sluice_backend::{Backend, HostMatrix, WeightError};
use sluice_format::{FormatError, ModelDir, QuantConfig};

pub mod qwen3_moe;

/// Errors while loading or running a model. Every message names what was wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error("{file}: {msg}")]
    Config { file: String, msg: String },
    #[error("tensor `{tensor}`: {source}")]
    Weight {
        tensor: String,
        #[source]
        source: WeightError,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Input(String),
}

/// Facts about a loaded model that the engine and the CLI need.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub max_context: usize,
    pub experts: usize,
    pub experts_per_token: usize,
    /// Bytes of weights that every token reads (embeddings excluded).
    pub dense_bytes: usize,
    /// Bytes of all routed experts.
    pub expert_bytes: usize,
    pub weight_format: String,
}

/// What one layer remembers between calls for one request.
pub enum LayerState<B: Backend> {
    Attention(B::KvCache),
}

/// Everything a request carries between forward calls: the caches of every layer and the number
/// of positions consumed so far.
pub struct State<B: Backend> {
    pub layers: Vec<LayerState<B>>,
    pub position: usize,
}

/// A causal language model: tokens in, logits out.
pub trait CausalLm<B: Backend>: Send + Sync {
    fn info(&self) -> &ModelInfo;
    fn new_state(&self) -> State<B>;
    /// Runs `tokens` (at positions `state.position..`) and advances the state. Returns logits
    /// `[tokens.len(), vocab]` if `all_logits`, else `[1, vocab]` for the last token only.
    fn forward(
        &self,
        state: &mut State<B>,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<B::Act, ModelError>;
    /// Overrides the number of routed experts per token (`1..=experts`).
    fn set_experts_per_token(&mut self, k: usize) -> Result<(), ModelError>;
    fn backend(&self) -> &B;
}

/// Loads the model in `dir` for `backend`.
pub fn load<B: Backend + 'static>(
    dir: &ModelDir,
    backend: Arc<B>,
) -> Result<Box<dyn CausalLm<B>>, ModelError> {
    match dir.model_type()? {
        "qwen3_moe" => Ok(Box::new(qwen3_moe::Qwen3Moe::load(dir, backend)?)),
        other => Err(ModelError::Unsupported(format!(
            "{}: model_type `{other}` is not supported (supported: qwen3_moe)",
            dir.path.join("config.json").display()
        ))),
    }
}

/// Reads weights by name, checks their shapes, and hands them to the backend.
pub(crate) struct Loader<'a, B: Backend> {
    pub dir: &'a ModelDir,
    pub backend: &'a B,
    pub quant: Option<&'a QuantConfig>,
    /// Running totals for [`ModelInfo`].
    pub bytes: usize,
}

impl<'a, B: Backend> Loader<'a, B> {
    pub fn new(dir: &'a ModelDir, backend: &'a B) -> Self {
        Loader {
            dir,
            backend,
            quant: dir.quantization.as_ref(),
            bytes: 0,
        }
    }

    pub fn upload(&mut self, prefix: &str, m: HostMatrix) -> Result<B::Weight, ModelError> {
        self.bytes += m.nbytes();
        self.backend.weight(m).map_err(|source| ModelError::Weight {
            tensor: prefix.to_string(),
            source,
        })
    }

    /// The matrix of module `prefix`, `[out, in]`.
    pub fn matrix(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<B::Weight, ModelError> {
        let m = self
            .dir
            .tensors
            .matrix(prefix, self.quant, Some((out, inp)))?;
        self.upload(prefix, m)
    }

    /// The experts of a stacked `[experts, out, in]` tensor, one matrix each.
    pub fn matrix_stack(
        &mut self,
        prefix: &str,
        experts: usize,
        out: usize,
        inp: usize,
    ) -> Result<Vec<B::Weight>, ModelError> {
        let ms = self
            .dir
            .tensors
            .matrix_stack(prefix, self.quant, Some((experts, out, inp)))?;
        ms.into_iter().map(|m| self.upload(prefix, m)).collect()
    }

    /// A stacked `[experts, out, in]` tensor as host matrices, before any upload.
    pub fn host_stack(
        &self,
        prefix: &str,
        experts: usize,
        out: usize,
        inp: usize,
    ) -> Result<Vec<HostMatrix>, ModelError> {
        Ok(self
            .dir
            .tensors
            .matrix_stack(prefix, self.quant, Some((experts, out, inp)))?)
    }

    pub fn vector(&mut self, name: &str, len: usize) -> Result<B::Vector, ModelError> {
        let v = self.dir.tensors.vector_f32(name, Some(len))?;
        self.bytes += len * 4;
        Ok(self.backend.vector(&v))
    }

    pub fn has(&self, name: &str) -> bool {
        self.dir.tensors.contains(name)
    }
}

/// Returns a config error naming config.json.
pub(crate) fn config_error(dir: &ModelDir, msg: impl Into<String>) -> ModelError {
    ModelError::Config {
        file: dir.path.join("config.json").display().to_string(),
        msg: msg.into(),
    }
}
