//! Forward passes of the model families sluice runs, one file per architecture, written against
//! [`sluice_backend::Backend`] so that the same code runs on every backend.
//!
//! [`load`] reads a [`ModelDir`], picks the architecture from its `model_type`, checks every
//! tensor's shape and format against the config, and returns a [`CausalLm`].

use std::sync::Arc;

use sluice_backend::{Backend, FfnWeights, HostMatrix, WeightError};
use sluice_format::{FormatError, ModelDir, QuantConfig};
use sluice_store::ExpertStore;

pub use experts::Experts;

pub mod experts;
pub mod qwen3_5_moe;
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
    Linear(B::LinearState),
}

impl<B: Backend> Clone for LayerState<B> {
    fn clone(&self) -> Self {
        match self {
            LayerState::Attention(kv) => LayerState::Attention(kv.clone()),
            LayerState::Linear(s) => LayerState::Linear(s.clone()),
        }
    }
}

/// Everything a request carries between forward calls: the caches of every layer and the number
/// of positions consumed so far.
pub struct State<B: Backend> {
    pub layers: Vec<LayerState<B>>,
    pub position: usize,
}

impl<B: Backend> Clone for State<B> {
    fn clone(&self) -> Self {
        State {
            layers: self.layers.clone(),
            position: self.position,
        }
    }
}

impl<B: Backend> State<B> {
    /// Whether the state can be rewound to an earlier position: attention caches can drop
    /// positions, recurrent (linear-attention) states cannot.
    pub fn can_rewind(&self) -> bool {
        self.layers
            .iter()
            .all(|l| matches!(l, LayerState::Attention(_)))
    }

    /// Rewinds to `len` positions. Returns false (and changes nothing) when `len` is past the
    /// current position or a layer is recurrent.
    pub fn rewind(&mut self, backend: &B, len: usize) -> bool {
        if len > self.position || !self.can_rewind() {
            return false;
        }
        for layer in &mut self.layers {
            if let LayerState::Attention(kv) = layer {
                backend.kv_truncate(kv, len);
            }
        }
        self.position = len;
        true
    }
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
    load_with_store(dir, backend, None)
}

/// Like [`load`], with the routed experts streamed from `store` (required for a packed
/// directory, whose resident file holds no experts).
pub fn load_with_store<B: Backend + 'static>(
    dir: &ModelDir,
    backend: Arc<B>,
    store: Option<ExpertStore>,
) -> Result<Box<dyn CausalLm<B>>, ModelError> {
    match dir.model_type()? {
        "qwen3_moe" => Ok(Box::new(qwen3_moe::Qwen3Moe::load(dir, backend, store)?)),
        "qwen3_5_moe" | "qwen3_5_moe_text" | "qwen3_next" => Ok(Box::new(
            qwen3_5_moe::Qwen35Moe::load(dir, backend, store)?,
        )),
        other => Err(ModelError::Unsupported(format!(
            "{}: model_type `{other}` is not supported (supported: qwen3_moe, qwen3_5_moe, qwen3_next)",
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
    /// Streams the routed experts when set.
    pub store: Option<ExpertStore>,
}

impl<'a, B: Backend> Loader<'a, B> {
    pub fn new(dir: &'a ModelDir, backend: &'a B) -> Self {
        Loader {
            dir,
            backend,
            quant: dir.quantization.as_ref(),
            bytes: 0,
            store: None,
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
        self.vector_plus(name, len, 0.0)
    }

    /// A 1-D tensor with `offset` added to every element (zero-centred norms store `w - 1`).
    pub fn vector_plus(
        &mut self,
        name: &str,
        len: usize,
        offset: f32,
    ) -> Result<B::Vector, ModelError> {
        let mut v = self.dir.tensors.vector_f32(name, Some(len))?;
        if offset != 0.0 {
            v.iter_mut().for_each(|w| *w += offset);
        }
        self.bytes += len * 4;
        Ok(self.backend.vector(&v))
    }

    /// The routed experts under `mlp` (e.g. `model.layers.0.mlp`), `[hidden -> inter -> hidden]`
    /// each, from whichever layout the checkpoint uses: mlx-community's stacked
    /// `switch_mlp.{gate,up,down}_proj`, the official per-expert `experts.{e}.*`, or transformers
    /// 5's fused `experts.gate_up_proj` (`[E, 2 * inter, hidden]`, gate rows first) and
    /// `experts.down_proj`.
    pub fn experts(
        &mut self,
        layer: usize,
        mlp: &str,
        experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Experts<B>, ModelError> {
        if let Some(store) = &self.store {
            let m = store.manifest();
            let bad = |msg: String| ModelError::Config {
                file: store
                    .dir()
                    .join(sluice_store::MANIFEST_FILE)
                    .display()
                    .to_string(),
                msg,
            };
            let l = m
                .layer(layer)
                .ok_or_else(|| bad(format!("no experts for layer {layer} (`{mlp}`)")))?;
            let want = [(inter, hidden), (inter, hidden), (hidden, inter)];
            let got: Vec<(usize, usize)> = l.projections.iter().map(|p| (p.rows, p.cols)).collect();
            if l.experts != experts || got != want {
                return Err(bad(format!(
                    "layer {layer}: {} experts of shapes {got:?}, the config needs {experts} of {want:?}",
                    l.experts
                )));
            }
            self.bytes += (l.block_bytes * l.experts as u64) as usize;
            return Ok(Experts::Streamed {
                store: store.clone(),
                layer,
            });
        }
        self.resident_experts(mlp, experts, hidden, inter)
            .map(Experts::Resident)
    }

    fn resident_experts(
        &mut self,
        mlp: &str,
        experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Vec<FfnWeights<B::Weight>>, ModelError> {
        let (e, h, i) = (experts, hidden, inter);
        let stacked = format!("{mlp}.switch_mlp");
        if self.has(&format!("{stacked}.gate_proj.weight")) {
            let gate = self.matrix_stack(&format!("{stacked}.gate_proj"), e, i, h)?;
            let up = self.matrix_stack(&format!("{stacked}.up_proj"), e, i, h)?;
            let down = self.matrix_stack(&format!("{stacked}.down_proj"), e, h, i)?;
            return Ok(gate
                .into_iter()
                .zip(up)
                .zip(down)
                .map(|((gate, up), down)| FfnWeights { gate, up, down })
                .collect());
        }
        let fused = format!("{mlp}.experts.gate_up_proj");
        if self.has(&fused) {
            let gate_up = self.host_stack(&fused, e, 2 * i, h)?;
            let down = self.matrix_stack(&format!("{mlp}.experts.down_proj"), e, h, i)?;
            return gate_up
                .into_iter()
                .zip(down)
                .map(|(gu, down)| {
                    Ok(FfnWeights {
                        gate: self.upload(&fused, gu.rows(0..i))?,
                        up: self.upload(&fused, gu.rows(i..2 * i))?,
                        down,
                    })
                })
                .collect();
        }
        (0..e)
            .map(|x| self.ffn(&format!("{mlp}.experts.{x}"), h, i))
            .collect()
    }

    /// A dense SwiGLU block `{prefix}.{gate,up,down}_proj`.
    pub fn ffn(
        &mut self,
        prefix: &str,
        hidden: usize,
        inter: usize,
    ) -> Result<FfnWeights<B::Weight>, ModelError> {
        Ok(FfnWeights {
            gate: self.matrix(&format!("{prefix}.gate_proj"), inter, hidden)?,
            up: self.matrix(&format!("{prefix}.up_proj"), inter, hidden)?,
            down: self.matrix(&format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }

    pub fn has(&self, name: &str) -> bool {
        self.dir.tensors.contains(name)
    }
}

/// Rejects empty input, ids outside the vocabulary and overlong contexts.
pub(crate) fn check_tokens(
    tokens: &[u32],
    position: usize,
    info: &ModelInfo,
) -> Result<(), ModelError> {
    if tokens.is_empty() {
        return Err(ModelError::Input("no tokens to run".into()));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= info.vocab_size) {
        return Err(ModelError::Input(format!(
            "token id {t} is outside the vocabulary (size {})",
            info.vocab_size
        )));
    }
    if position + tokens.len() > info.max_context {
        return Err(ModelError::Input(format!(
            "{} positions exceed the model's context of {}",
            position + tokens.len(),
            info.max_context
        )));
    }
    Ok(())
}

/// The final norm and the output head: on the last row only unless `all_logits`.
pub(crate) fn output_logits<B: Backend>(
    b: &B,
    h: B::Act,
    all_logits: bool,
    norm: &B::Vector,
    eps: f32,
    head: &B::Weight,
) -> B::Act {
    let (rows, _) = b.shape(&h);
    let h = if !all_logits && rows > 1 {
        b.slice_rows(&h, rows - 1, 1)
    } else {
        h
    };
    b.matmul(&b.rms_norm(&h, norm, eps), head)
}

/// Sets the routed experts per token after checking it against the model's expert count.
pub(crate) fn set_experts_per_token(info: &mut ModelInfo, k: usize) -> Result<(), ModelError> {
    if k == 0 || k > info.experts {
        return Err(ModelError::Input(format!(
            "experts per token must be between 1 and {} for this model, not {k}",
            info.experts
        )));
    }
    info.experts_per_token = k;
    Ok(())
}

pub(crate) fn describe_quant(dir: &ModelDir) -> String {
    match &dir.quantization {
        Some(q) => format!("{}-bit affine, group {}", q.bits, q.group_size),
        None => "unquantised".into(),
    }
}

/// Returns a config error naming config.json.
pub(crate) fn config_error(dir: &ModelDir, msg: impl Into<String>) -> ModelError {
    ModelError::Config {
        file: dir.path.join("config.json").display().to_string(),
        msg: msg.into(),
    }
}
