//! What every architecture here shares around its layers: the token embedding, the final norm
//! and the output head (tied to the embedding or not), the checks on the input tokens, and the
//! model's [`ModelInfo`].

use std::sync::Arc;

use sluice_backend::{Backend, KvFormat};

use crate::loader::Loader;
use crate::{
    CausalLm, Checkpoint, LayerState, ModelError, ModelInfo, MultiTokenPredictor, Segment, State,
};

/// What an architecture file gives: its [`Decoder`] (the ends and the model's facts), its layers'
/// forward pass and a new request's state. [`CausalLm`] follows from these.
pub(crate) trait Architecture<B: Backend>: Send + Sync {
    fn decoder(&self) -> &Decoder<B>;
    fn decoder_mut(&mut self) -> &mut Decoder<B>;
    /// The hidden states after the last layer, for the rows of every segment in order; every
    /// segment's state advanced by its tokens.
    fn layers(&self, segments: &mut [Segment<'_, B>]) -> Result<B::Act, ModelError>;
    /// The state of a new request (empty caches, position 0).
    fn new_state(&self) -> Result<State<B>, ModelError>;
    /// Redoes recurrent layer `layer`'s update of `state` over `inputs`, the first rows of what
    /// its forward pass logged ([`State::record`]). Only architectures with recurrent layers
    /// that log their inputs implement it ([`CausalLm::take_back`] runs the rows again else).
    fn replay_recurrent(&self, _layer: usize, _state: &mut B::LinearState, _inputs: &[B::Act]) {}
    /// The checkpoint's multi-token-prediction layer, if it has one ([`CausalLm::mtp`]).
    fn mtp(&self) -> Result<Option<&dyn MultiTokenPredictor<B>>, ModelError> {
        Ok(None)
    }
}

impl<B: Backend + 'static, M: Architecture<B>> CausalLm<B> for M {
    fn forward(
        &self,
        state: &mut State<B>,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<B::Act, ModelError> {
        let h = self.layers(&mut [Segment { state, tokens }])?;
        let d = self.decoder();
        if state.hidden.is_none() {
            return Ok(d.logits(h, all_logits));
        }
        let normed = d.final_norm(&h);
        let rows = d.backend().slice_rows(&normed, 0, tokens.len());
        state.record_hidden(d.backend(), state.position - tokens.len(), rows);
        Ok(d.head(normed, all_logits))
    }

    fn forward_batch(&self, segments: &mut [Segment<'_, B>]) -> Result<B::Act, ModelError> {
        let h = self.layers(segments)?;
        let d = self.decoder();
        if segments.iter().all(|s| s.state.hidden.is_none()) {
            return Ok(d.last_logits(h, segments));
        }
        let (b, normed) = (d.backend(), d.final_norm(&h));
        let mut row = 0;
        let mut last = Vec::with_capacity(segments.len());
        for s in segments.iter_mut() {
            let n = s.tokens.len();
            if s.state.hidden.is_some() {
                let first = s.state.position - n;
                s.state
                    .record_hidden(b, first, b.slice_rows(&normed, row, n));
            }
            last.push(b.slice_rows(&normed, row + n - 1, 1));
            row += n;
        }
        Ok(d.head(b.concat_rows(&last.iter().collect::<Vec<_>>()), true))
    }

    fn mtp(&self) -> Result<Option<&dyn MultiTokenPredictor<B>>, ModelError> {
        Architecture::mtp(self)
    }

    fn new_state(&self) -> Result<State<B>, ModelError> {
        Architecture::new_state(self)
    }

    fn info(&self) -> &ModelInfo {
        self.decoder().info()
    }

    fn set_experts_per_token(&mut self, k: usize) -> Result<(), ModelError> {
        self.decoder_mut().set_experts_per_token(k)
    }

    fn set_kv_format(&mut self, format: KvFormat) -> Result<(), ModelError> {
        self.decoder_mut().set_kv_format(format)
    }

    fn backend(&self) -> &B {
        self.decoder().backend()
    }

    fn take_back(
        &self,
        state: &mut State<B>,
        checkpoint: Checkpoint<B>,
        kept: &[u32],
    ) -> Result<bool, ModelError> {
        let b = self.backend();
        if state.log_covers(b, kept.len()) {
            return Ok(
                state.take_back_with(b, checkpoint, kept.len(), |i, s, inputs| {
                    self.replay_recurrent(i, s, inputs)
                }),
            );
        }
        crate::restore_and_run_again(self, state, checkpoint, kept)
    }
}

/// The config facts a decoder is built with.
pub(crate) struct Dims {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: usize,
    pub max_context: usize,
    pub experts: usize,
    pub experts_per_token: usize,
    pub rms_norm_eps: f32,
    pub state: StateDims,
}

/// What one request's state holds, from a model's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateDims {
    /// Key and value entries the attention caches add per position, over all layers.
    pub kv_values_per_token: usize,
    /// The size of the cached heads (how the compact formats group values).
    pub kv_head_dim: usize,
    /// Bytes of the recurrent states (f32), there from the start.
    pub fixed_bytes: usize,
    /// f32 values a forward pass holds at once per token it runs (see [`pass_values`]).
    pub pass_values_per_token: usize,
}

impl StateDims {
    /// Bytes of the state at `tokens` positions with caches in `format`.
    pub fn bytes(&self, format: KvFormat, tokens: usize) -> u64 {
        self.fixed_bytes as u64
            + format.bytes(self.kv_values_per_token, self.kv_head_dim) as u64 * tokens as u64
    }

    /// Working memory of a forward pass over `tokens` tokens at once (a prefill pass).
    pub fn pass_bytes(&self, tokens: usize) -> u64 {
        4 * self.pass_values_per_token as u64 * tokens as u64
    }
}

/// Values a forward pass holds at once per token, estimated from the shapes: the residual stream
/// with its norm and the mixer's and feed-forward's outputs (4 x `hidden`), the widest token
/// mixer's projections (`mixer`), and the feed-forward's rows (`ffn`: [`moe_values`] or a dense
/// MLP's 3 x intermediate, the larger). On the Qwen3.5-35B-A3B shape this gives 268 kB per token;
/// measured: 216 kB (the CPU, peak RSS of passes of 8192 and 512 tokens) to ~250 kB.
pub(crate) fn pass_values(hidden: usize, mixer: usize, ffn: usize) -> usize {
    4 * hidden + mixer + ffn
}

/// [`pass_values`]' feed-forward part of a MoE: each of the `k` experts' gate, up and activation
/// rows and its output row, and a shared expert's three rows.
pub(crate) fn moe_values(k: usize, moe_inter: usize, hidden: usize, shared_inter: usize) -> usize {
    k * (3 * moe_inter + hidden) + 3 * shared_inter
}

/// [`pass_values`]' mixer part of attention: queries (twice with an output gate), keys, values and
/// the output, twice (a prompt's is computed by blocks of rows, then gathered).
pub(crate) fn attention_values(
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    gated: bool,
) -> usize {
    heads * head_dim * (3 + usize::from(gated)) + 2 * kv_heads * head_dim
}

/// The weights before and after the layers.
pub(crate) struct Ends<B: Backend> {
    pub embed_tokens: B::Weight,
    pub norm: B::Vector,
    /// `None` when tied to `embed_tokens`.
    pub lm_head: Option<B::Weight>,
}

pub(crate) struct Decoder<B: Backend> {
    backend: Arc<B>,
    info: ModelInfo,
    eps: f32,
    ends: Ends<B>,
}

impl<B: Backend> Decoder<B> {
    /// Once every weight is loaded (the counts in `ld` are final).
    pub fn new(ld: &Loader<B>, backend: Arc<B>, dims: Dims, ends: Ends<B>) -> Self {
        let (dense_bytes, expert_bytes) = ld.counted();
        let info = ModelInfo {
            model_type: dims.model_type,
            vocab_size: dims.vocab_size,
            hidden_size: dims.hidden_size,
            layers: dims.layers,
            max_context: dims.max_context,
            experts: dims.experts,
            experts_per_token: dims.experts_per_token,
            dense_bytes,
            expert_bytes,
            state_bytes_per_token: KvFormat::F32
                .bytes(dims.state.kv_values_per_token, dims.state.kv_head_dim),
            state_bytes_fixed: dims.state.fixed_bytes,
            pass_bytes_per_token: 4 * dims.state.pass_values_per_token,
            kv_format: KvFormat::F32,
            kv_values_per_token: dims.state.kv_values_per_token,
            kv_head_dim: dims.state.kv_head_dim,
            weight_format: match (&ld.dir.stored_as, &ld.dir.quantization) {
                (Some(stored), _) => stored.clone(),
                (None, Some(q)) => format!("{}-bit affine, group {}", q.bits, q.group_size),
                (None, None) => "unquantised".into(),
            },
        };
        Decoder {
            backend,
            info,
            eps: dims.rms_norm_eps,
            ends,
        }
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn experts_per_token(&self) -> usize {
        self.info.experts_per_token
    }

    pub fn eps(&self) -> f32 {
        self.eps
    }

    /// Sets the routed experts per token after checking it against the model's expert count.
    pub fn set_experts_per_token(&mut self, k: usize) -> Result<(), ModelError> {
        if k == 0 || k > self.info.experts {
            return Err(ModelError::Input(format!(
                "experts per token must be between 1 and {} for this model, not {k}",
                self.info.experts
            )));
        }
        self.info.experts_per_token = k;
        Ok(())
    }

    /// Sets how new requests' attention caches store their keys and values.
    pub fn set_kv_format(&mut self, format: KvFormat) -> Result<(), ModelError> {
        let offered = self.backend.kv_formats();
        if !offered.contains(&format) {
            let names: Vec<&str> = offered.iter().map(|f| f.name()).collect();
            return Err(ModelError::Unsupported(format!(
                "a {format} KV cache on {}: it keeps {}",
                self.backend.describe(),
                names.join(", ")
            )));
        }
        let info = &mut self.info;
        info.kv_format = format;
        info.state_bytes_per_token = format.bytes(info.kv_values_per_token, info.kv_head_dim);
        Ok(())
    }

    /// An empty attention cache for one layer, sized for the model's context.
    pub fn attention_state(
        &self,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<LayerState<B>, ModelError> {
        Ok(LayerState::Attention(self.backend.kv_cache(
            kv_heads,
            head_dim,
            self.info.max_context,
            self.info.kv_format,
        )?))
    }

    /// A new request's state when every one of `layers` layers is attention.
    pub fn attention_only_state(
        &self,
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<State<B>, ModelError> {
        let layers = (0..layers)
            .map(|_| self.attention_state(kv_heads, head_dim))
            .collect::<Result<_, _>>()?;
        Ok(State::new(layers, 0))
    }

    /// The embeddings of every segment's tokens, one after another, after rejecting empty input,
    /// ids outside the vocabulary and overlong contexts.
    pub fn embed(&self, segments: &[Segment<'_, B>]) -> Result<B::Act, ModelError> {
        if segments.is_empty() {
            return Err(ModelError::Input("no requests to run".into()));
        }
        for s in segments {
            self.check_input(s.state, s.tokens)?;
        }
        let tokens: Vec<u32> = match segments {
            [one] => one.tokens.to_vec(),
            _ => segments
                .iter()
                .flat_map(|s| s.tokens.iter().copied())
                .collect(),
        };
        Ok(self.backend.embed(&self.ends.embed_tokens, &tokens))
    }

    fn check_input(&self, state: &State<B>, tokens: &[u32]) -> Result<(), ModelError> {
        let info = &self.info;
        if tokens.is_empty() {
            return Err(ModelError::Input("no tokens to run".into()));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(ModelError::Input(format!(
                "token id {t} is outside the vocabulary (size {})",
                info.vocab_size
            )));
        }
        if state.position + tokens.len() > info.max_context {
            return Err(ModelError::Input(format!(
                "{} positions exceed the model's context of {}",
                state.position + tokens.len(),
                info.max_context
            )));
        }
        if state.layers.len() != info.layers {
            return Err(wrong_state());
        }
        Ok(())
    }

    /// After the last layer: its MLP output (`mlp_out`, not yet added) added to `h`, and every
    /// segment's position advanced by its tokens.
    pub fn end_layers(
        &self,
        mut h: B::Act,
        mlp_out: Option<B::Act>,
        segments: &mut [Segment<'_, B>],
    ) -> B::Act {
        if let Some(mlp) = mlp_out {
            self.backend.add_assign(&mut h, &mlp);
        }
        for s in segments {
            s.state.position += s.tokens.len();
        }
        h
    }

    /// The logits of each segment's last row of `h` (the rows of all segments, in order).
    pub fn last_logits(&self, h: B::Act, segments: &[Segment<'_, B>]) -> B::Act {
        let b = self.backend.as_ref();
        if segments.len() == 1 {
            return self.logits(h, false);
        }
        let mut end = 0;
        let last: Vec<B::Act> = segments
            .iter()
            .map(|s| {
                end += s.tokens.len();
                b.slice_rows(&h, end - 1, 1)
            })
            .collect();
        let h = b.concat_rows(&last.iter().collect::<Vec<_>>());
        self.logits(h, true)
    }

    /// The final norm and the output head: on the last row only unless `all_logits`.
    pub fn logits(&self, h: B::Act, all_logits: bool) -> B::Act {
        let b = self.backend.as_ref();
        let (rows, _) = b.shape(&h);
        let h = if !all_logits && rows > 1 {
            b.slice_rows(&h, rows - 1, 1)
        } else {
            h
        };
        self.head(self.final_norm(&h), true)
    }

    /// The final norm of every row of `h`: the model's final hidden states.
    pub fn final_norm(&self, h: &B::Act) -> B::Act {
        self.backend.rms_norm(h, &self.ends.norm, self.eps)
    }

    /// The output head over final hidden states `normed`: on the last row only unless `all_rows`.
    pub fn head(&self, normed: B::Act, all_rows: bool) -> B::Act {
        let b = self.backend.as_ref();
        let (rows, _) = b.shape(&normed);
        let normed = match !all_rows && rows > 1 {
            true => b.slice_rows(&normed, rows - 1, 1),
            false => normed,
        };
        // Tied models use the embeddings even if a stray `lm_head` is stored, as mlx-lm and
        // transformers do (the loaders only keep a head when untied).
        let head = self
            .ends
            .lm_head
            .as_ref()
            .unwrap_or(&self.ends.embed_tokens);
        b.matmul(&normed, head)
    }

    /// The embeddings of `tokens`, after rejecting ids outside the vocabulary.
    pub fn embed_tokens(&self, tokens: &[u32]) -> Result<B::Act, ModelError> {
        let vocab = self.info.vocab_size;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Input(format!(
                "token id {t} is outside the vocabulary (size {vocab})"
            )));
        }
        Ok(self.backend.embed(&self.ends.embed_tokens, tokens))
    }
}

/// A state made by another model (or with another layer layout) was passed in.
pub(crate) fn wrong_state() -> ModelError {
    ModelError::Input("state does not belong to this model".into())
}

/// Runs `f` on each segment's rows of `inputs` with the segment's state, and stacks the results
/// in segment order: the parts of a layer that keep per-request state (attention caches,
/// recurrent states). One segment runs on `inputs` as they are.
pub(crate) fn per_segment<B: Backend, const N: usize>(
    b: &B,
    inputs: [&B::Act; N],
    segments: &mut [Segment<'_, B>],
    mut f: impl FnMut([&B::Act; N], &mut State<B>) -> Result<B::Act, ModelError>,
) -> Result<B::Act, ModelError> {
    if let [one] = segments {
        return f(inputs, one.state);
    }
    let mut outs = Vec::with_capacity(segments.len());
    let mut row = 0;
    for s in segments.iter_mut() {
        let n = s.tokens.len();
        let parts = inputs.map(|a| b.slice_rows(a, row, n));
        outs.push(f(parts.each_ref(), s.state)?);
        row += n;
    }
    Ok(b.concat_rows(&outs.iter().collect::<Vec<_>>()))
}

/// Each segment's attention cache of layer `layer`, and its row count.
pub(crate) fn attention_caches<'s, B: Backend>(
    segments: &'s mut [Segment<'_, B>],
    layer: usize,
) -> Result<(Vec<&'s mut B::KvCache>, Vec<usize>), ModelError> {
    let rows = segments.iter().map(|s| s.tokens.len()).collect();
    let caches = segments
        .iter_mut()
        .map(|s| match &mut s.state.layers[layer] {
            LayerState::Attention(cache) => Ok(cache),
            LayerState::Linear(_) => Err(wrong_state()),
        })
        .collect::<Result<_, _>>()?;
    Ok((caches, rows))
}
