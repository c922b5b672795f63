//! Forward passes of the model families sluice runs, one file per architecture, written against
//! [`sluice_backend::Backend`] so that the same code runs on every backend.
//!
//! [`load`] reads a [`ModelDir`], picks the architecture from its `model_type`, checks every
//! tensor's shape and format against the config, and returns a [`CausalLm`]. Routed experts are
//! either loaded with the rest or, when an [`ExpertSource`] is given (a packed directory's expert
//! store), fetched from it layer by layer as tokens are routed: model code sees only the trait.
//!
//! Layout: [`loader`] reads weights by name; [`moe`] is the MoE block every architecture shares
//! (router, routed experts, shared expert, next-layer prefetch) and [`experts`] where its experts
//! live; [`decoder`] the embedding, final norm and output head around the layers. Each
//! architecture file (`qwen3_moe.rs`, `qwen3_5_moe.rs`, `mixtral.rs`, `glm4_moe.rs`,
//! `deepseek_v3.rs`, `gpt_oss.rs`) holds its config, its attention and its forward pass, top to
//! bottom.

#![forbid(unsafe_code)]

use std::sync::Arc;

use sluice_backend::{Backend, BackendError, ExpertError, ExpertSource, Yarn};
use sluice_format::{FormatError, ModelDir};

pub use decoder::StateDims;
pub use experts::Experts;

mod decoder;
pub mod deepseek_v3;
pub mod experts;
pub mod glm4_moe;
pub mod gpt_oss;
mod loader;
pub mod mixtral;
mod moe;
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
        source: BackendError,
    },
    /// The backend failed while running (out of memory, a device error).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// Streamed experts could not be fetched (an I/O error, a damaged file).
    #[error(transparent)]
    Experts(#[from] ExpertError),
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
    /// Bytes one request's state holds: attention caches grow by `state_bytes_per_token` per
    /// position (in `kv_format`), recurrent states (f32) are `state_bytes_fixed` from the start.
    pub state_bytes_per_token: usize,
    pub state_bytes_fixed: usize,
    /// Working memory of a forward pass per token it runs at once (prefill passes): an
    /// estimate by the shapes (see `StateDims::pass_bytes`).
    pub pass_bytes_per_token: usize,
    /// How attention caches store keys and values ([`CausalLm::set_kv_format`]).
    pub kv_format: sluice_backend::KvFormat,
    /// Key and value entries the attention caches add per position, over all layers.
    pub kv_values_per_token: usize,
    /// The size of the cached heads.
    pub kv_head_dim: usize,
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
    /// While a pass may be taken back ([`State::begin_log`]): the inputs each recurrent layer's
    /// update got, per layer (empty for other layers), so that [`CausalLm::take_back`] can redo
    /// those updates for the rows kept instead of running them again.
    pub log: Option<Vec<Vec<B::Act>>>,
    /// While kept ([`State::keep_hidden`]): the final hidden states of the positions run, what
    /// a multi-token predictor drafts from ([`CausalLm::mtp`]).
    pub hidden: Option<HiddenLog<B>>,
}

/// The final hidden states (after the final norm: what the output head reads) of a run of
/// positions, one `[rows, hidden]` block per forward pass.
pub struct HiddenLog<B: Backend> {
    /// `(first position, rows)`, contiguous and in order.
    blocks: Vec<(usize, B::Act)>,
}

impl<B: Backend> HiddenLog<B> {
    /// The positions held.
    pub fn covered(&self, backend: &B) -> std::ops::Range<usize> {
        match (self.blocks.first(), self.blocks.last()) {
            (Some((first, _)), Some((last, rows))) => *first..last + backend.shape(rows).0,
            _ => 0..0,
        }
    }

    /// Keeps `rows`, the hidden states of positions `first..`: positions at or after `first`
    /// held before (a pass since taken back) are dropped, and a gap before `first` drops all.
    fn record(&mut self, backend: &B, first: usize, rows: B::Act) {
        self.truncate(backend, first);
        if self.covered(backend).end != first {
            self.blocks.clear();
        }
        self.blocks.push((first, rows));
    }

    /// Drops the positions at or after `end`.
    fn truncate(&mut self, backend: &B, end: usize) {
        self.blocks.retain(|(first, _)| *first < end);
        if let Some((first, rows)) = self.blocks.last_mut() {
            let n = backend.shape(rows).0;
            if *first + n > end {
                *rows = backend.slice_rows(rows, 0, end - *first);
            }
        }
    }

    /// The rows of positions `range`, if all are held.
    pub fn rows(&self, backend: &B, range: std::ops::Range<usize>) -> Option<B::Act> {
        let covered = self.covered(backend);
        if range.is_empty() || range.start < covered.start || range.end > covered.end {
            return None;
        }
        let parts: Vec<B::Act> = (self.blocks.iter())
            .filter_map(|(first, rows)| {
                let end = first + backend.shape(rows).0;
                let (from, to) = (range.start.max(*first), range.end.min(end));
                (from < to).then(|| backend.slice_rows(rows, from - first, to - from))
            })
            .collect();
        Some(match parts.len() {
            1 => parts.into_iter().next().expect("one part"),
            _ => backend.concat_rows(&parts.iter().collect::<Vec<_>>()),
        })
    }

    /// Forgets the positions before `position` (read by the predictor already).
    pub fn forget_before(&mut self, backend: &B, position: usize) {
        self.blocks
            .retain(|(first, rows)| first + backend.shape(rows).0 > position);
        if let Some((first, rows)) = self.blocks.first_mut() {
            if *first < position {
                let skip = position - *first;
                *rows = backend.slice_rows(rows, skip, backend.shape(rows).0 - skip);
                *first = position;
            }
        }
    }
}

impl<B: Backend> State<B> {
    /// A state of `layers` at `position`, with no log.
    pub fn new(layers: Vec<LayerState<B>>, position: usize) -> State<B> {
        State {
            layers,
            position,
            log: None,
            hidden: None,
        }
    }

    /// Starts keeping the final hidden state of every position run from now on
    /// ([`State::hidden`]).
    pub fn keep_hidden(&mut self) {
        self.hidden = Some(HiddenLog { blocks: Vec::new() });
    }

    /// Records `rows` as the hidden states of positions `first..`, if they are kept.
    pub fn record_hidden(&mut self, backend: &B, first: usize, rows: B::Act) {
        if let Some(log) = &mut self.hidden {
            log.record(backend, first, rows);
        }
    }

    /// Starts keeping the inputs of the recurrent layers' updates (see [`State::log`]); the
    /// next forward pass fills it.
    pub fn begin_log(&mut self) {
        self.log = Some((0..self.layers.len()).map(|_| Vec::new()).collect());
    }

    /// Records `inputs` as layer `layer`'s update inputs of this pass, if a log is kept.
    pub fn record(&mut self, backend: &B, layer: usize, inputs: &[&B::Act]) {
        if let Some(entry) = self.log.as_mut().and_then(|log| log.get_mut(layer)) {
            *entry = inputs
                .iter()
                .map(|a| backend.slice_rows(a, 0, backend.shape(a).0))
                .collect();
        }
    }
}

impl<B: Backend> Clone for State<B> {
    /// A copy of the caches; the logs stay with the original.
    fn clone(&self) -> Self {
        State::new(self.layers.clone(), self.position)
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

/// Where a [`State`] was, for [`State::restore`]: its position and copies of its recurrent
/// layers' states (attention caches are truncated instead, so they are not copied).
pub struct Checkpoint<B: Backend> {
    position: usize,
    linear: Vec<Option<B::LinearState>>,
}

impl<B: Backend> Checkpoint<B> {
    /// Whether this checkpoint was taken of a state with `state`'s layer kinds.
    fn fits(&self, state: &State<B>) -> bool {
        self.linear.len() == state.layers.len()
            && (state.layers.iter().zip(&self.linear))
                .all(|(l, s)| matches!(l, LayerState::Linear(_)) == s.is_some())
    }

    /// The position the state was at.
    pub fn position(&self) -> usize {
        self.position
    }
}

impl<B: Backend> State<B> {
    /// A checkpoint of the state as it is now (see [`State::restore`]).
    pub fn checkpoint(&self) -> Checkpoint<B> {
        let linear = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Linear(s) => Some(s.clone()),
                LayerState::Attention(_) => None,
            })
            .collect();
        Checkpoint {
            position: self.position,
            linear,
        }
    }

    /// Takes the state back to `checkpoint`, taken from it at an earlier or the same position
    /// and not rewound past since: attention caches drop the positions after it, recurrent
    /// layers get their copies back. Returns false (and changes nothing) if the state is
    /// behind the checkpoint or has other layers.
    pub fn restore(&mut self, backend: &B, checkpoint: Checkpoint<B>) -> bool {
        if checkpoint.position > self.position || !checkpoint.fits(self) {
            return false;
        }
        for (layer, saved) in self.layers.iter_mut().zip(checkpoint.linear) {
            match (layer, saved) {
                (LayerState::Attention(kv), _) => backend.kv_truncate(kv, checkpoint.position),
                (LayerState::Linear(s), Some(saved)) => *s = saved,
                (LayerState::Linear(_), None) => {}
            }
        }
        self.position = checkpoint.position;
        true
    }

    /// Whether the log holds every recurrent layer's inputs for at least `rows` rows.
    pub fn log_covers(&self, backend: &B, rows: usize) -> bool {
        let Some(log) = &self.log else {
            return false;
        };
        log.len() == self.layers.len()
            && (self.layers.iter().zip(log)).all(|(l, inputs)| match l {
                LayerState::Linear(_) => {
                    !inputs.is_empty() && inputs.iter().all(|a| backend.shape(a).0 >= rows)
                }
                LayerState::Attention(_) => true,
            })
    }

    /// Takes the state back to `checkpoint` plus `kept` of the positions run since, using the
    /// log of that pass (ending it): attention caches drop the positions after those, and each
    /// recurrent layer gets its copy back and `replay(layer, state, inputs)` redoes its update
    /// over the first `kept` rows of its logged inputs. Returns false (and changes nothing but
    /// the log) where [`State::restore`] would, or when the log does not cover the kept rows.
    pub fn take_back_with(
        &mut self,
        backend: &B,
        checkpoint: Checkpoint<B>,
        kept: usize,
        mut replay: impl FnMut(usize, &mut B::LinearState, &[B::Act]),
    ) -> bool {
        let target = checkpoint.position + kept;
        let covered = self.log_covers(backend, kept);
        let Some(log) = self.log.take() else {
            return false;
        };
        if target > self.position || !checkpoint.fits(self) || !covered {
            return false;
        }
        let layers = self.layers.iter_mut().zip(checkpoint.linear).zip(log);
        for (i, ((layer, saved), inputs)) in layers.enumerate() {
            match (layer, saved) {
                (LayerState::Attention(kv), _) => backend.kv_truncate(kv, target),
                (LayerState::Linear(s), Some(saved)) => {
                    *s = saved;
                    if kept > 0 {
                        let rows: Vec<B::Act> = inputs
                            .iter()
                            .map(|a| backend.slice_rows(a, 0, kept))
                            .collect();
                        replay(i, s, &rows);
                    }
                }
                (LayerState::Linear(_), None) => {}
            }
        }
        self.position = target;
        true
    }
}

/// One request's share of a batched forward call ([`CausalLm::forward_batch`]): its state and
/// the tokens it runs next (a prompt chunk, or the one token it decodes).
pub struct Segment<'a, B: Backend> {
    pub state: &'a mut State<B>,
    pub tokens: &'a [u32],
}

/// A causal language model: tokens in, logits out.
pub trait CausalLm<B: Backend>: Send + Sync {
    fn info(&self) -> &ModelInfo;
    /// The state of a new request (empty caches, position 0).
    fn new_state(&self) -> Result<State<B>, ModelError>;
    /// Runs `tokens` (at positions `state.position..`) and advances the state. Returns logits
    /// `[tokens.len(), vocab]` if `all_logits`, else `[1, vocab]` for the last token only.
    fn forward(
        &self,
        state: &mut State<B>,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<B::Act, ModelError>;
    /// Runs several requests in one pass: their rows go through every product together (each
    /// weight, and each routed expert, read once for all of them), attention and recurrent state
    /// per request. Returns `[segments.len(), vocab]`: each segment's last token's logits. Every
    /// state advances by its segment's tokens; a row's result is its result alone up to the
    /// order of summation.
    fn forward_batch(&self, segments: &mut [Segment<'_, B>]) -> Result<B::Act, ModelError>;
    /// Overrides the number of routed experts per token (`1..=experts`).
    fn set_experts_per_token(&mut self, k: usize) -> Result<(), ModelError>;
    /// How the attention caches of requests started from now on store keys and values (one of
    /// the backend's [`sluice_backend::Backend::kv_formats`]).
    fn set_kv_format(&mut self, format: sluice_backend::KvFormat) -> Result<(), ModelError>;
    fn backend(&self) -> &B;
    /// The model's multi-token-prediction layer, if its checkpoint has one: loaded on first
    /// use (it costs memory only when drafting with it); `Err` if that load failed.
    fn mtp(&self) -> Result<Option<&dyn MultiTokenPredictor<B>>, ModelError> {
        Ok(None)
    }
    /// Takes `state` back to `checkpoint` (taken before the last pass) plus `kept`, the first
    /// tokens that pass ran. This default restores the checkpoint and runs `kept` again; a model
    /// with recurrent layers that logs their inputs ([`State::begin_log`]) redoes only those
    /// layers' updates. Either way the log ends. Returns false when the state cannot go back.
    fn take_back(
        &self,
        state: &mut State<B>,
        checkpoint: Checkpoint<B>,
        kept: &[u32],
    ) -> Result<bool, ModelError> {
        restore_and_run_again(self, state, checkpoint, kept)
    }
}

/// A multi-token-prediction layer (Qwen3.5's and Qwen3-Next's `mtp.*`): from the model's final
/// hidden state at position `p` ([`State::keep_hidden`]) and the token at `p + 1`, the logits of
/// the token at `p + 2`. It has its own attention cache, over positions aligned with the
/// model's. Chained on its own output hidden state and the token it chose, it drafts several
/// tokens.
pub trait MultiTokenPredictor<B: Backend>: Send + Sync {
    /// Its state for a new request: an empty cache at position 0.
    fn new_state(&self) -> Result<State<B>, ModelError>;
    /// Runs rows at positions `state.position..`: row `i` pairs `hidden` row `i` (the model's,
    /// or this layer's own output to chain) with `tokens[i]`. Returns the logits `[rows, vocab]`
    /// if `all_logits`, else `[1, vocab]` of the last row only (a prompt's catch-up needs no
    /// more), and every row's output hidden states `[rows, hidden]`.
    fn forward(
        &self,
        state: &mut State<B>,
        hidden: &B::Act,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<(B::Act, B::Act), ModelError>;
    /// The size of a hidden state.
    fn hidden_size(&self) -> usize;
    /// Bytes of weights a drafted token reads (its routed experts' share only).
    fn weight_bytes(&self) -> usize;
}

/// [`CausalLm::take_back`] without a log: ends it, restores `checkpoint`, runs `kept` again.
pub fn restore_and_run_again<B: Backend, M: CausalLm<B> + ?Sized>(
    model: &M,
    state: &mut State<B>,
    checkpoint: Checkpoint<B>,
    kept: &[u32],
) -> Result<bool, ModelError> {
    state.log = None;
    if !state.restore(model.backend(), checkpoint) {
        return Ok(false);
    }
    if !kept.is_empty() {
        model.forward(state, kept, false)?;
    }
    Ok(true)
}

/// The `model_type`s [`load`] reads, for error messages.
const SUPPORTED: &str =
    "qwen3_moe, qwen3 (dense), qwen3_5_moe, qwen3_5 (dense), qwen3_next, mixtral, glm4_moe, deepseek_v3, kimi_k2, gpt_oss";

/// What a model directory's config says about its experts, read and checked as the architecture
/// reads it, before any weight (e.g. to size an expert cache first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigPlan {
    pub model_type: String,
    /// Routed experts per MoE layer (0 for a dense model).
    pub experts: usize,
    /// Routed experts each token uses, as configured.
    pub experts_per_token: usize,
    /// What one request's state holds.
    pub state: StateDims,
}

/// The [`ConfigPlan`] of `dir`.
pub fn config_plan(dir: &ModelDir) -> Result<ConfigPlan, ModelError> {
    let model_type = dir.model_type()?.to_string();
    let (experts, experts_per_token, state) = match model_type.as_str() {
        "qwen3_moe" | "qwen3" => {
            let c: qwen3_moe::Qwen3MoeConfig = dir.parse_config()?;
            c.check(dir)?;
            (
                c.num_experts,
                c.num_experts_per_tok,
                qwen3_moe::state_dims(&c),
            )
        }
        "qwen3_5_moe" | "qwen3_5_moe_text" | "qwen3_next" | "qwen3_5" | "qwen3_5_text" => {
            let c: qwen3_5_moe::Qwen35MoeConfig = dir.parse_config()?;
            c.check(dir)?;
            (
                c.num_experts,
                c.num_experts_per_tok,
                qwen3_5_moe::state_dims(&c),
            )
        }
        "mixtral" => {
            let c: mixtral::MixtralConfig = dir.parse_config()?;
            c.check(dir)?;
            (
                c.num_local_experts,
                c.num_experts_per_tok,
                mixtral::state_dims(&c),
            )
        }
        "glm4_moe" => {
            let c: glm4_moe::Glm4MoeConfig = dir.parse_config()?;
            c.check(dir)?;
            (
                c.n_routed_experts,
                c.num_experts_per_tok,
                glm4_moe::state_dims(&c),
            )
        }
        "deepseek_v3" | "kimi_k2" => {
            let c: deepseek_v3::DeepseekV3Config = dir.parse_config()?;
            c.check(dir)?;
            (
                c.n_routed_experts,
                c.num_experts_per_tok,
                deepseek_v3::state_dims(&c),
            )
        }
        "gpt_oss" => {
            let c: gpt_oss::GptOssConfig = dir.parse_config()?;
            c.check(dir)?;
            (
                c.num_local_experts,
                c.experts_per_tok(),
                gpt_oss::state_dims(&c),
            )
        }
        other => {
            return Err(ModelError::Unsupported(format!(
                "{}: model_type `{other}` is not supported (supported: {SUPPORTED})",
                dir.path.join("config.json").display()
            )))
        }
    };
    Ok(ConfigPlan {
        model_type,
        experts,
        experts_per_token,
        state,
    })
}

/// Loads the model in `dir` for `backend`, every weight resident.
pub fn load<B: Backend + 'static>(
    dir: &ModelDir,
    backend: Arc<B>,
) -> Result<Box<dyn CausalLm<B>>, ModelError> {
    load_with_experts(dir, backend, None)
}

/// Like [`load`], with the routed experts fetched from `experts` as they are needed (required
/// for a packed directory, whose resident file holds no experts).
pub fn load_with_experts<B: Backend + 'static>(
    dir: &ModelDir,
    backend: Arc<B>,
    experts: Option<Arc<dyn ExpertSource>>,
) -> Result<Box<dyn CausalLm<B>>, ModelError> {
    match dir.model_type()? {
        "qwen3_moe" | "qwen3" => Ok(Box::new(qwen3_moe::Qwen3Moe::load(dir, backend, experts)?)),
        "qwen3_5_moe" | "qwen3_5_moe_text" | "qwen3_next" | "qwen3_5" | "qwen3_5_text" => Ok(
            Box::new(qwen3_5_moe::Qwen35Moe::load(dir, backend, experts)?),
        ),
        "mixtral" => Ok(Box::new(mixtral::Mixtral::load(dir, backend, experts)?)),
        "glm4_moe" => Ok(Box::new(glm4_moe::Glm4Moe::load(dir, backend, experts)?)),
        "deepseek_v3" | "kimi_k2" => Ok(Box::new(deepseek_v3::DeepseekV3::load(
            dir, backend, experts,
        )?)),
        "gpt_oss" => Ok(Box::new(gpt_oss::GptOss::load(dir, backend, experts)?)),
        other => Err(ModelError::Unsupported(format!(
            "{}: model_type `{other}` is not supported (supported: {SUPPORTED})",
            dir.path.join("config.json").display()
        ))),
    }
}

/// The theta of a plain rotary embedding: `rope_theta`, or transformers 5's
/// `rope_parameters.rope_theta`. Any rope scaling in `scalings` (`rope_scaling`,
/// `rope_parameters`) other than the default is an error, as is a missing theta.
pub(crate) fn default_rope_theta(
    dir: &ModelDir,
    rope_theta: Option<f64>,
    scalings: [&Option<serde_json::Value>; 2],
) -> Result<f64, ModelError> {
    for scaling in scalings.into_iter().flatten() {
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if kind != "default" {
            return Err(config_error(
                dir,
                format!("rope scaling `{kind}` is not supported yet (only the default rotary embedding)"),
            ));
        }
    }
    let from_params = scalings[1]
        .as_ref()
        .and_then(|p| p.get("rope_theta"))
        .and_then(|t| t.as_f64());
    rope_theta
        .or(from_params)
        .ok_or_else(|| config_error(dir, "missing `rope_theta`"))
}

/// A rotary embedding's theta and YaRN scaling, if any, from `rope_theta` and `rope_scaling` or
/// transformers 5's `rope_parameters` (`scalings`). Other scaling types are an error.
pub(crate) fn yarn_rope_theta(
    dir: &ModelDir,
    rope_theta: Option<f64>,
    scalings: [&Option<serde_json::Value>; 2],
) -> Result<(f64, Option<YarnConfig>), ModelError> {
    let yarn = scalings.into_iter().flatten().find(|s| {
        s.get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(|t| t.as_str())
            == Some("yarn")
    });
    let Some(y) = yarn else {
        return Ok((default_rope_theta(dir, rope_theta, scalings)?, None));
    };
    let theta = rope_theta
        .or_else(|| y.get("rope_theta").and_then(|t| t.as_f64()))
        .ok_or_else(|| config_error(dir, "missing `rope_theta`"))?;
    let num = |key: &str, default: Option<f64>| {
        y.get(key)
            .and_then(|v| v.as_f64())
            .or(default)
            .ok_or_else(|| config_error(dir, format!("yarn rope scaling needs `{key}`")))
    };
    let factor = num("factor", None)?;
    let original = num("original_max_position_embeddings", None)?;
    if !(factor >= 1.0 && original >= 1.0 && original.fract() == 0.0) {
        return Err(config_error(
            dir,
            format!(
                "yarn rope scaling needs factor >= 1 and a whole original_max_position_embeddings \
                 (got {factor} and {original})"
            ),
        ));
    }
    Ok((
        theta,
        Some(YarnConfig {
            yarn: Yarn {
                factor: factor as f32,
                original_max_position: original as usize,
                beta_fast: num("beta_fast", Some(32.0))? as f32,
                beta_slow: num("beta_slow", Some(1.0))? as f32,
                truncate: y.get("truncate").and_then(|t| t.as_bool()).unwrap_or(true),
            },
            mscale: num("mscale", Some(1.0))?,
            mscale_all_dim: num("mscale_all_dim", Some(0.0))?,
        }),
    ))
}

/// YaRN's frequencies and its two attention temperatures as configured.
#[derive(Debug, Clone, Copy)]
pub(crate) struct YarnConfig {
    pub yarn: Yarn,
    pub mscale: f64,
    pub mscale_all_dim: f64,
}

impl YarnConfig {
    /// YaRN's temperature `0.1 * m * ln(factor) + 1` (1 when the factor is at most 1).
    pub fn temperature(&self, m: f64) -> f64 {
        let f = self.yarn.factor as f64;
        if f <= 1.0 {
            1.0
        } else {
            0.1 * m * f.ln() + 1.0
        }
    }
}

/// Returns a config error naming config.json.
pub(crate) fn config_error(dir: &ModelDir, msg: impl Into<String>) -> ModelError {
    ModelError::Config {
        file: dir.path.join("config.json").display().to_string(),
        msg: msg.into(),
    }
}
