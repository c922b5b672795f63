//! The narrow interface between model code and the hardware that runs it.
//!
//! Model forward passes (in `sluice-models`) are written against [`Backend`] alone: they never see
//! whether activations live in host memory or on a GPU. A backend owns the objects a forward pass
//! touches: activations ([`Backend::Act`], always f32 `[rows, cols]`, one row per token), weights
//! ([`Backend::Weight`], a matrix in any [`WeightFormat`], made from a [`HostMatrix`]), a layer's
//! routed experts ([`Backend::Experts`]), the expert choice ([`Backend::Routing`]) and the
//! per-request caches ([`Backend::KvCache`], [`Backend::LinearState`]).
//!
//! Design points, each for a device that computes asynchronously in its own memory:
//! * **Nothing comes back to the host unless asked**: [`Backend::to_host`] (logits) and
//!   [`Backend::read_routing`] (needed only when experts stream from disk) are the only reads.
//!   Routing stays on the backend: [`Backend::route`] feeds [`Backend::moe`] directly.
//! * **Failure is sticky**: operations on activations return no `Result` (an asynchronous device
//!   learns of a failure later); the backend records the first one and reports it from
//!   [`Backend::synchronize`] and from every host read. Allocating calls return [`BackendError`].
//! * **Memory**: [`Backend::memory`] says what is free where the backend allocates;
//!   [`Backend::zeros`] makes activations without a host copy; KV caches are told their capacity.
//! * **Experts**: resident ones are uploaded once, per layer, in the backend's own layout
//!   ([`Backend::experts`]). Streamed ones come from an [`ExpertSource`] as host memory and are
//!   made usable by [`Backend::stage_expert`] (zero-copy on the CPU; an asynchronous upload into
//!   device memory on a GPU, which may keep them resident for later tokens:
//!   [`Backend::staged_expert`]).
//! * **Family-specific operations** (the Gated DeltaNet of Qwen3.5 / Qwen3-Next) have host
//!   fallbacks built on [`reference`], so a new backend can start from the core operations.
//!
//! [`reference`] defines what every operation computes; [`conformance`] checks a backend against
//! it on random inputs (the CPU backend runs it in its tests; a new backend must pass it too).

#![forbid(unsafe_code)]

mod error;
mod experts;
mod rope;
mod tiers;
mod weight;

pub mod conformance;
pub mod kv;
pub mod reference;

pub use error::BackendError;
pub use experts::{
    ExpertError, ExpertErrorKind, ExpertKey, ExpertLayer, ExpertSource, HostExpert, MatrixShape,
};
pub use kv::KvFormat;
pub use reference::HostLinearState;
pub use rope::{Rope, Yarn};
pub use tiers::{ExpertCachePlan, ExpertCacheStats, HostPinner, PinnedRegion};
pub use weight::{
    e8m0_to_f32, Dtype, HostBytes, HostMatrix, MatRef, WeightError, WeightFormat, FP4_E2M1,
    MXFP4_GROUP,
};

/// The experts chosen for each token, in host memory: `experts[t * k + j]` with weight
/// `weights[t * k + j]`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostRouting {
    /// Experts per token.
    pub k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

/// The sigmoid router of DeepSeek-V3 and GLM-4.5 (`noaux_tc`): experts are chosen by
/// `sigmoid(logit) + bias` within the best `top_groups` of `groups` equal groups (a group's score:
/// the sum of its two best), and weighted by their `sigmoid(logit)`, optionally renormalised to sum
/// to one, then scaled by `scale`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SigmoidRouting {
    pub groups: usize,
    pub top_groups: usize,
    pub normalize: bool,
    pub scale: f32,
}

/// What a sampler needs of one row of logits when it keeps only the best few tokens: the `n` best
/// columns with their values (see [`Backend::top_logits`]) and the values at a few named columns.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogits {
    /// `(column, value)`, best first: larger values first, the lower column among equals, NaN
    /// after every number.
    pub top: Vec<(u32, f32)>,
    /// The values at the columns asked for, in their order.
    pub at: Vec<f32>,
}

impl HostRouting {
    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.k).unwrap_or(0)
    }

    /// The routed experts of the batch, distinct and ascending.
    pub fn distinct(&self) -> Vec<u32> {
        let mut used = self.experts.clone();
        used.sort_unstable();
        used.dedup();
        used
    }
}

/// Shapes of a Gated DeltaNet (linear attention) layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeltaNetDims {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    /// How value heads share key heads (`value_heads` is a multiple of `key_heads`).
    pub value_order: ValueHeadOrder,
}

/// The order of a Gated DeltaNet's value heads relative to its key heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ValueHeadOrder {
    /// Hugging Face's: the value heads of key head 0 first, then those of key head 1, ...
    /// (value head `h` reads key head `h / (value_heads / key_heads)`).
    #[default]
    Grouped,
    /// llama.cpp's GGUF files (its converter permutes them so that a broadcast repeats the key
    /// heads): value head `h` reads key head `h % key_heads`.
    Tiled,
}

impl DeltaNetDims {
    /// Channels of the convolved projection: q, k and v.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    /// The key head (of q and k) that value head `h` reads.
    pub fn key_head(&self, h: usize) -> usize {
        match self.value_order {
            ValueHeadOrder::Grouped => h / (self.value_heads / self.key_heads).max(1),
            ValueHeadOrder::Tiled => h % self.key_heads.max(1),
        }
    }
}

/// The three projections of one SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct FfnWeights<W> {
    pub gate: W,
    pub up: W,
    pub down: W,
}

/// What one attention call computes beyond causal grouped-query attention.
#[derive(Debug)]
pub struct AttentionSpec<'a, V> {
    /// Query heads (a multiple of the cache's kv heads).
    pub heads: usize,
    /// Scores are `scale * q.k`.
    pub scale: f32,
    /// Sliding-window attention: the row at position `p` sees the keys at positions
    /// `p + 1 - window ..= p` (gpt-oss's sliding layers, Mistral's). `None`: every earlier key.
    pub window: Option<usize>,
    /// Attention sinks (gpt-oss): one logit per query head that joins each row's softmax (not
    /// scaled) and takes its share of the weight for no value.
    pub sinks: Option<&'a V>,
}

impl<V> Clone for AttentionSpec<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for AttentionSpec<'_, V> {}

impl<'a, V> AttentionSpec<'a, V> {
    /// Plain causal attention over every cached position.
    pub fn new(heads: usize, scale: f32) -> Self {
        AttentionSpec {
            heads,
            scale,
            window: None,
            sinks: None,
        }
    }

    /// The first key position a query row at `position` sees.
    pub fn first_visible(&self, position: usize) -> usize {
        match self.window {
            Some(w) => (position + 1).saturating_sub(w.max(1)),
            None => 0,
        }
    }
}

/// The nonlinearity between a gated feed-forward block's gate and up projections and its down
/// projection.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Activation {
    /// `silu(gate) * up` (SwiGLU).
    #[default]
    Silu,
    /// gpt-oss's clamped SwiGLU: with `g = min(gate, limit)` and `u = clamp(up, -limit, limit)`,
    /// `g * sigmoid(alpha * g) * (u + 1)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

impl Activation {
    /// The activation of one gate value and one up value.
    pub fn apply(self, gate: f32, up: f32) -> f32 {
        match self {
            Activation::Silu => gate / (1.0 + (-gate).exp()) * up,
            Activation::ClampedSwiglu { alpha, limit } => {
                let g = gate.min(limit);
                let u = up.clamp(-limit, limit);
                g / (1.0 + (-alpha * g).exp()) * (u + 1.0)
            }
        }
    }
}

/// How a layer's routed experts compute, beyond `down(silu(gate x) * up x)`: the activation and
/// optional per-expert biases (gpt-oss), resident on the backend even when the experts stream.
#[derive(Debug)]
pub struct ExpertFfn<'a, V> {
    pub activation: Activation,
    /// `gate` and `up`: `[experts * inter]`, `down`: `[experts * hidden]`, expert `e`'s biases
    /// at `e * width`.
    pub biases: Option<&'a FfnWeights<V>>,
}

impl<V> Clone for ExpertFfn<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for ExpertFfn<'_, V> {}

impl<V> ExpertFfn<'_, V> {
    /// SwiGLU without biases: every family but gpt-oss.
    pub const SWIGLU: Self = ExpertFfn {
        activation: Activation::Silu,
        biases: None,
    };
}

/// The weights of a Gated DeltaNet mixer between its input projections and `out_proj`
/// ([`Backend::gated_delta_net`]).
#[derive(Debug)]
pub struct DeltaNetWeights<'a, V> {
    /// `[channels, conv_kernel]`, taps oldest first.
    pub conv1d: &'a V,
    pub a_log: &'a V,
    pub dt_bias: &'a V,
    /// The gated norm's weight, `[value_dim]`.
    pub norm: &'a V,
    pub eps: f32,
}

impl<V> Clone for DeltaNetWeights<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<V> Copy for DeltaNetWeights<'_, V> {}

/// The memory a backend allocates from (host RAM for the CPU, device memory for a GPU), bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryInfo {
    pub free: u64,
    pub total: u64,
}

/// A compute backend. All activations are f32; weights keep their stored format.
///
/// Shapes are the caller's responsibility (model code checks configs and tensors at load); an
/// operation given inconsistent shapes may panic.
pub trait Backend: Send + Sync {
    /// Activations `[rows, cols]` in f32, row-major, one row per token.
    type Act: Send;
    /// A weight matrix `[out, in]`, resident where this backend computes.
    type Weight: Send + Sync;
    /// A 1-D f32 parameter (norm weights, biases, conv taps).
    type Vector: Send + Sync;
    /// All routed experts of one MoE layer, resident, addressed by expert id.
    type Experts: Send + Sync;
    /// One streamed expert made usable (see [`Backend::stage_expert`]).
    type StagedExpert: Send + Sync;
    /// The expert choice of a batch, where this backend computed it.
    type Routing: Send;
    /// Keys and values of one attention layer for one request. `Clone` so a request's state can
    /// be saved and resumed (the server's prompt cache).
    type KvCache: Send + Clone;
    /// Convolution window and recurrent state of one linear-attention (Gated DeltaNet) layer for
    /// one request.
    type LinearState: Send + Clone;

    /// Short human-readable description, e.g. `cpu (avx512, 2 threads)`.
    fn describe(&self) -> String;
    /// Free and total bytes of the memory this backend allocates from.
    fn memory(&self) -> MemoryInfo;
    /// Whether this backend computes in memory of its own (a GPU's), apart from host RAM: where
    /// a VRAM budget applies.
    fn has_device_memory(&self) -> bool {
        false
    }
    /// Working memory a forward pass holds beside its activations whatever its length, at
    /// contexts up to `context` positions, in the memory [`Backend::memory`] reports (the CPU's
    /// per-thread attention scores of a prompt).
    fn pass_scratch_bytes(&self, _context: usize) -> u64 {
        0
    }
    /// The most rows a forward pass computes each with the arithmetic of a single decoded row
    /// (more rows may switch to prompt kernels, which round differently). A speculative pass
    /// checks at most this many tokens, so that it keeps exactly what decoding would.
    fn decode_rows(&self) -> usize {
        usize::MAX
    }
    /// Waits until queued work has finished and reports the first failure since the last call.
    fn synchronize(&self) -> Result<(), BackendError>;

    // ---- weights -------------------------------------------------------------------------

    fn weight(&self, m: HostMatrix) -> Result<Self::Weight, BackendError>;
    fn vector(&self, v: &[f32]) -> Result<Self::Vector, BackendError>;
    fn vector_to_host(&self, v: &Self::Vector) -> Result<Vec<f32>, BackendError>;
    /// The routed experts of one layer, `experts[e]` being expert `e`; all of the same shapes.
    fn experts(&self, experts: Vec<HostExpert>) -> Result<Self::Experts, BackendError>;
    /// Makes expert `key`, fetched from an [`ExpertSource`], usable by
    /// [`Backend::moe_accumulate`]. The CPU uses the host memory in place (keeping the source's
    /// lease alive); a GPU starts an upload that later operations wait for, and may keep the
    /// copy for later calls. A backend may hold on to `host` until its copy has finished, at the
    /// latest until the next [`Backend::synchronize`] (or host read).
    fn stage_expert(
        &self,
        key: ExpertKey,
        host: HostExpert,
    ) -> Result<Self::StagedExpert, BackendError>;
    /// Expert `key` as staged by an earlier [`Backend::stage_expert`], when this backend still
    /// holds it (so it needs no fetch). The CPU holds none.
    fn staged_expert(&self, key: ExpertKey) -> Option<Self::StagedExpert> {
        let _ = key;
        None
    }
    /// Whether [`Backend::staged_expert`] would find `key` (without counting a use).
    fn holds_expert(&self, key: ExpertKey) -> bool {
        let _ = key;
        false
    }
    /// Sets up the backend's own cache of streamed experts (a GPU keeps them in its memory
    /// between calls, so [`Backend::staged_expert`] finds them): for experts of at most
    /// `expert_bytes` each, `experts` of them in the model, within `budget` bytes of this
    /// backend's memory in all (what is in use already counts; `None`: the free memory less a
    /// margin). `None` for a backend that keeps no experts (the CPU).
    fn plan_expert_cache(
        &self,
        budget: Option<u64>,
        expert_bytes: u64,
        experts: usize,
    ) -> Result<Option<ExpertCachePlan>, BackendError> {
        let _ = (budget, expert_bytes, experts);
        Ok(None)
    }
    /// The counters of that cache, when there is one.
    fn expert_cache_stats(&self) -> Option<ExpertCacheStats> {
        None
    }
    /// Page-locks host memory that [`Backend::stage_expert`] will copy from (the expert store's
    /// cache), where that makes copies faster; `None` where it does not matter (the CPU).
    fn host_pinner(&self) -> Option<std::sync::Arc<dyn HostPinner>> {
        None
    }
    /// The routed experts of decoder layer `layer` kept in `source`'s host memory and computed
    /// from there (a GPU reading page-locked memory over its link in place, the most used of
    /// them cached in its own memory), when `source` can hold every expert at once and this
    /// backend can read its memory: then a call needs no routing read and no copy of its own.
    /// The result keeps the source's experts held while it lives. `None` (the default): the
    /// caller streams them through [`Backend::stage_expert`] instead.
    fn experts_in_host(
        &self,
        source: &std::sync::Arc<dyn ExpertSource>,
        layer: usize,
    ) -> Result<Option<Self::Experts>, BackendError> {
        let _ = (source, layer);
        Ok(None)
    }

    // ---- per-request caches ------------------------------------------------------------------

    /// An empty attention cache that will hold at most `capacity` positions, storing its keys
    /// and values in `format` (one of [`Backend::kv_formats`]; what it holds is what
    /// [`kv::round_trip`] gives).
    fn kv_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        format: KvFormat,
    ) -> Result<Self::KvCache, BackendError>;
    /// The cache formats [`Backend::kv_cache`] takes.
    fn kv_formats(&self) -> &'static [KvFormat] {
        &[KvFormat::F32]
    }
    /// Number of positions held by a cache.
    fn kv_len(&self, cache: &Self::KvCache) -> usize;
    /// Drops every position at or after `len` (to rewind a request).
    fn kv_truncate(&self, cache: &mut Self::KvCache, len: usize);
    /// A zeroed linear-attention state: a window of `conv_kernel - 1` inputs of `conv_channels`,
    /// and a `[value_dim, key_dim]` matrix per value head.
    fn linear_state(&self, dims: &DeltaNetDims) -> Result<Self::LinearState, BackendError> {
        self.linear_state_from_host(HostLinearState::new(dims))
    }
    fn linear_state_to_host(&self, s: &Self::LinearState) -> Result<HostLinearState, BackendError>;
    fn linear_state_from_host(&self, s: HostLinearState)
        -> Result<Self::LinearState, BackendError>;

    // ---- activations -------------------------------------------------------------------------

    fn zeros(&self, rows: usize, cols: usize) -> Self::Act;
    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> Self::Act;
    fn to_host(&self, a: &Self::Act) -> Result<Vec<f32>, BackendError>;
    fn shape(&self, a: &Self::Act) -> (usize, usize);
    /// Rows `[start, start + len)` of `a` as a new activation.
    fn slice_rows(&self, a: &Self::Act, start: usize, len: usize) -> Self::Act;
    /// `parts` stacked in order, their rows one after another (all of one width; at least one
    /// part). A batch of requests runs as one activation and is cut back apart with
    /// [`Backend::slice_rows`] where each needs its own state.
    fn concat_rows(&self, parts: &[&Self::Act]) -> Self::Act;
    /// The greedy choice of each row of `logits`: the column of its largest value, the lowest
    /// among equals; NaN never wins (a row of NaN gives 0) ([`reference::argmax`]). A device
    /// backend answers with one id per row instead of the whole row.
    fn argmax_rows(&self, logits: &Self::Act) -> Result<Vec<u32>, BackendError> {
        let (_, cols) = self.shape(logits);
        let host = self.to_host(logits)?;
        Ok(host.chunks(cols.max(1)).map(reference::argmax).collect())
    }
    /// The `n` best columns of row `row` of `logits` and the values at `cols`
    /// ([`reference::top_logits`]): what a top-k sampler needs, without the whole row leaving
    /// a device. The default reads the row to the host.
    fn top_logits(
        &self,
        logits: &Self::Act,
        row: usize,
        n: usize,
        cols: &[u32],
    ) -> Result<TopLogits, BackendError> {
        let (rows, width) = self.shape(logits);
        assert!(row < rows, "top_logits: row {row} of {rows}");
        let host = self.to_host(logits)?;
        Ok(reference::top_logits(
            &host[row * width..(row + 1) * width],
            n,
            cols,
        ))
    }
    /// [`Backend::top_logits`] for several rows of `logits` at once, `(row, n, cols)` each (a
    /// batch's sampled rows), so that a device can answer them with one transfer instead of one
    /// each. The default asks row by row.
    fn top_logits_rows(
        &self,
        logits: &Self::Act,
        requests: &[(usize, usize, &[u32])],
    ) -> Result<Vec<TopLogits>, BackendError> {
        requests
            .iter()
            .map(|&(row, n, cols)| self.top_logits(logits, row, n, cols))
            .collect()
    }

    // ---- operations ------------------------------------------------------------------------

    /// One row of `table` per token (dequantised).
    fn embed(&self, table: &Self::Weight, tokens: &[u32]) -> Self::Act;
    /// `x W^T`: `[rows, in] -> [rows, out]`.
    fn matmul(&self, x: &Self::Act, w: &Self::Weight) -> Self::Act;
    /// `x W^T` for each of `weights` (one input, say q, k and v): one pass on backends that
    /// batch them.
    fn matmuls<const N: usize>(
        &self,
        x: &Self::Act,
        weights: [&Self::Weight; N],
    ) -> [Self::Act; N] {
        weights.map(|w| self.matmul(x, w))
    }
    /// RMS-normalises every contiguous chunk of `weight.len()` values (a whole row, or one head)
    /// and scales it by `weight`.
    fn rms_norm(&self, x: &Self::Act, weight: &Self::Vector, eps: f32) -> Self::Act;
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act);
    /// `bias` (one value per column) added to every row of `x`.
    fn add_bias(&self, x: &mut Self::Act, bias: &Self::Vector);
    /// `h += y`, then the RMS norm of the new `h` (the residual step of a pre-norm decoder; one
    /// pass on backends that fuse it).
    fn add_rms_norm(
        &self,
        h: &mut Self::Act,
        y: &Self::Act,
        weight: &Self::Vector,
        eps: f32,
    ) -> Self::Act {
        self.add_assign(h, y);
        self.rms_norm(h, weight, eps)
    }
    /// `silu(gate) * up`, elementwise.
    fn swiglu(&self, gate: &Self::Act, up: &Self::Act) -> Self::Act;
    /// [`Rope`] (rotate-half, GPT-NeoX form) of every head of `x`; row `i` is at position
    /// `first_position + i`.
    fn rope(&self, x: &mut Self::Act, rope: Rope, first_position: usize);
    /// `rms_norm` of every head (`weight` has `head_dim` values) followed by `rope`: the q and k
    /// normalisation of Qwen3 attention, one pass on backends that fuse it.
    fn rms_norm_rope(
        &self,
        x: &Self::Act,
        weight: &Self::Vector,
        eps: f32,
        rope: Rope,
        first_position: usize,
    ) -> Self::Act {
        let mut y = self.rms_norm(x, weight, eps);
        self.rope(&mut y, rope, first_position);
        y
    }
    /// Appends `k`, `v` (`[rows, kv_heads * head_dim]`) to `cache` and returns causal grouped-query
    /// attention of `q` (`[rows, heads * head_dim]`) over what is cached, as `spec` says.
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        cache: &mut Self::KvCache,
        spec: AttentionSpec<'_, Self::Vector>,
    ) -> Self::Act;
    /// Attention with its prelude: `q` and `k` each through [`Backend::rms_norm_rope`] with
    /// its norm weight (`norms`: q's, k's; `None`: no norm, [`Backend::rope`] alone) and `rope`
    /// at the cache's next positions, then
    /// [`Backend::attention`]. Backends that fuse the norms, the rotations and the cache writes
    /// give the same values.
    #[allow(clippy::too_many_arguments)]
    fn attention_rope(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        norms: Option<(&Self::Vector, &Self::Vector)>,
        eps: f32,
        rope: Rope,
        cache: &mut Self::KvCache,
        spec: AttentionSpec<'_, Self::Vector>,
    ) -> Self::Act {
        let position = self.kv_len(cache);
        let (q, k) = norm_rope_qk(self, q, k, norms, eps, rope, position);
        self.attention(&q, &k, v, cache, spec)
    }
    /// [`Backend::attention_rope`] for several requests at once: `q`, `k` and `v` hold their
    /// rows one request after another, `rows[i]` of them attending through `caches[i]`; the
    /// outputs are stacked the same way. The default ([`attention_rope_by_parts`]) cuts the rows
    /// apart and stacks the results; a device backend can attend in place instead.
    #[allow(clippy::too_many_arguments)]
    fn attention_rope_segments(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        norms: Option<(&Self::Vector, &Self::Vector)>,
        eps: f32,
        rope: Rope,
        caches: &mut [&mut Self::KvCache],
        rows: &[usize],
        spec: AttentionSpec<'_, Self::Vector>,
    ) -> Self::Act {
        attention_rope_by_parts(self, q, k, v, norms, eps, rope, caches, rows, spec)
    }
    /// `x * sigmoid(gate)`, elementwise; or, if `gate` has one column, each row of `x` scaled by
    /// the sigmoid of its gate.
    fn sigmoid_mul(&self, x: &mut Self::Act, gate: &Self::Act);
    /// Views each row as consecutive chunks of `chunk` values and splits every chunk after its
    /// first `first` values: returns (all the first parts, all the rest), each concatenated.
    fn split_chunks(&self, x: &Self::Act, chunk: usize, first: usize) -> (Self::Act, Self::Act);
    /// The inverse of [`Backend::split_chunks`]: each row of `a` seen as chunks of `a_chunk`
    /// values and each row of `b` as as many chunks of `b_chunk`, interleaved chunk by chunk (`a`'s
    /// first).
    fn join_chunks(
        &self,
        a: &Self::Act,
        a_chunk: usize,
        b: &Self::Act,
        b_chunk: usize,
    ) -> Self::Act;
    /// One product per head: `x` `[rows, heads * in]` and `w` `[heads * out, in]`, head `h`'s
    /// `in` columns of `x` times its `out` rows of `w` (transposed) give its `out` columns of the
    /// result `[rows, heads * out]` (Multi-head Latent Attention's absorbed projections).
    fn matmul_heads(&self, x: &Self::Act, w: &Self::Weight, heads: usize) -> Self::Act;
    /// Softmax over router logits `[rows, experts]`, top-`k` per row (the lower index wins a
    /// tie), optionally renormalised to sum to one.
    fn route(&self, logits: &Self::Act, k: usize, normalize: bool) -> Self::Routing;
    /// [`SigmoidRouting`] of router logits `[rows, experts]` with the per-expert selection
    /// `bias`, top `k` (the lower index wins a tie).
    fn route_sigmoid(
        &self,
        logits: &Self::Act,
        bias: &Self::Vector,
        k: usize,
        how: SigmoidRouting,
    ) -> Self::Routing;
    /// `route` of the router's logits `x gate^T` (one pass on backends that fuse them).
    fn route_matmul(
        &self,
        x: &Self::Act,
        gate: &Self::Weight,
        k: usize,
        normalize: bool,
    ) -> Self::Routing {
        self.route(&self.matmul(x, gate), k, normalize)
    }
    /// The routing in host memory (a synchronisation point: needed only to fetch streamed
    /// experts).
    fn read_routing(&self, routing: &Self::Routing) -> Result<HostRouting, BackendError>;
    /// `sum_j weight_j * ffn_{expert_j}(x)` per row over resident experts, each computing as
    /// `ffn` says.
    fn moe(
        &self,
        x: &Self::Act,
        routing: &Self::Routing,
        experts: &Self::Experts,
        ffn: ExpertFfn<'_, Self::Vector>,
    ) -> Self::Act;
    /// Adds `weight_j * ffn_{expert_j}(x)` to `out` for the routed (row, expert) pairs whose
    /// expert is in `experts` (expert id and staged weights, ascending ids); pairs of other
    /// experts are skipped. Each row accumulates in ascending expert id, so splitting the experts
    /// of a call into ascending runs over several calls gives bit-identical results (a streamed
    /// expert cache smaller than the experts a batch needs relies on this).
    fn moe_accumulate(
        &self,
        x: &Self::Act,
        routing: &Self::Routing,
        experts: &[(u32, &Self::StagedExpert)],
        ffn: ExpertFfn<'_, Self::Vector>,
        out: &mut Self::Act,
    );
    /// A dense SwiGLU feed-forward block.
    fn ffn(&self, x: &Self::Act, w: &FfnWeights<Self::Weight>) -> Self::Act {
        let [gate, up] = self.matmuls(x, [&w.gate, &w.up]);
        self.matmul(&self.swiglu(&gate, &up), &w.down)
    }
    /// `y += sigmoid(x gate^T) * ffn(x)`: a shared expert scaled by its one-row `gate`, added to
    /// the routed experts' output (Qwen3.5, Qwen3-Next). A backend may fuse the SwiGLU, the gate
    /// and the sum into the down projection; the default is those calls one by one. (Ungated
    /// shared experts, as GLM-4.5's, are `add_assign` of `ffn`.)
    fn add_shared_expert(
        &self,
        y: &mut Self::Act,
        x: &Self::Act,
        w: &FfnWeights<Self::Weight>,
        gate: &Self::Weight,
    ) {
        let mut s = self.ffn(x, w);
        self.sigmoid_mul(&mut s, &self.matmul(x, gate));
        self.add_assign(y, &s);
    }
    /// [`Backend::moe`] plus a gated shared expert (what [`Backend::add_shared_expert`] adds),
    /// per row. A backend may compute the shared expert in the routed experts' launches, as one
    /// more expert of every row; the default is the two calls.
    fn moe_with_shared(
        &self,
        x: &Self::Act,
        routing: &Self::Routing,
        experts: &Self::Experts,
        ffn: ExpertFfn<'_, Self::Vector>,
        shared: &FfnWeights<Self::Weight>,
        gate: &Self::Weight,
    ) -> Self::Act {
        let mut y = self.moe(x, routing, experts, ffn);
        self.add_shared_expert(&mut y, x, shared, gate);
        y
    }

    // ---- Gated DeltaNet (Qwen3.5, Qwen3-Next) ------------------------------------------------
    //
    // Host fallbacks over [`reference`]: correct everywhere, slow on a device (each call copies
    // its inputs and the state to the host and back). Backends override them.

    /// Depthwise causal 1-D convolution over time, then SiLU. `weight` is `[channels, kernel]`
    /// (taps oldest first); the inputs before the first row come from the state's window, which
    /// is updated to the last `kernel - 1` inputs.
    fn causal_conv1d_silu(
        &self,
        x: &Self::Act,
        weight: &Self::Vector,
        state: &mut Self::LinearState,
    ) -> Self::Act {
        let (rows, cols) = self.shape(x);
        let (Ok(xh), Ok(w), Ok(mut s)) = (
            self.to_host(x),
            self.vector_to_host(weight),
            self.linear_state_to_host(state),
        ) else {
            return self.zeros(rows, cols); // the failure is already recorded
        };
        let y = reference::causal_conv1d_silu(&xh, &w, &mut s);
        if let Ok(s) = self.linear_state_from_host(s) {
            *state = s;
        }
        self.act_from_host(&y, rows, cols)
    }
    /// The gated delta rule over `qkv` (`[rows, 2 * key_heads * key_dim + value_heads *
    /// value_dim]`, the convolved projection): q and k are L2-normalised (q also scaled by
    /// `key_dim^-0.5`), value head `j` reads key head `j / (value_heads / key_heads)`, and per
    /// value head the state `S` (`[value_dim, key_dim]`) evolves as
    /// `S *= g; S += ((v - S k) * beta) k^T; y = S q` with
    /// `g = exp(-exp(a_log) * softplus(a + dt_bias))`, `beta = sigmoid(b)`. Returns `y`,
    /// `[rows, value_heads * value_dim]`.
    fn gated_delta_rule(
        &self,
        qkv: &Self::Act,
        a: &Self::Act,
        b: &Self::Act,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
        state: &mut Self::LinearState,
    ) -> Self::Act {
        let (rows, _) = self.shape(qkv);
        let (Ok(mut s), Ok(q), Ok(ah), Ok(bh), Ok(al), Ok(dt)) = (
            self.linear_state_to_host(state),
            self.to_host(qkv),
            self.to_host(a),
            self.to_host(b),
            self.vector_to_host(a_log),
            self.vector_to_host(dt_bias),
        ) else {
            let (_, hv) = self.shape(a);
            return self.zeros(rows, hv); // the failure is already recorded
        };
        let cols = s.dims.value_heads * s.dims.value_dim;
        let y = reference::gated_delta_rule(&q, &ah, &bh, &al, &dt, &mut s);
        if let Ok(s) = self.linear_state_from_host(s) {
            *state = s;
        }
        self.act_from_host(&y, rows, cols)
    }
    /// The Gated DeltaNet between its input projections and `out_proj`, over one sequence's rows
    /// with its state: `causal_conv1d_silu` of `qkv`, `gated_delta_rule`, then `rms_norm_gated`
    /// of the result with `z`. One decode step of this is a few KB of inputs beside the state, so
    /// a backend whose launches cost more than that work fuses them; the default is the three
    /// calls.
    fn gated_delta_net(
        &self,
        qkv: &Self::Act,
        z: &Self::Act,
        a: &Self::Act,
        b: &Self::Act,
        w: DeltaNetWeights<'_, Self::Vector>,
        state: &mut Self::LinearState,
    ) -> Self::Act {
        let qkv = self.causal_conv1d_silu(qkv, w.conv1d, state);
        let y = self.gated_delta_rule(&qkv, a, b, w.a_log, w.dt_bias, state);
        self.rms_norm_gated(&y, z, w.norm, w.eps)
    }
    /// `silu(z) * rms_norm(x) * weight`, normalising each chunk of `weight.len()` values.
    fn rms_norm_gated(
        &self,
        x: &Self::Act,
        z: &Self::Act,
        weight: &Self::Vector,
        eps: f32,
    ) -> Self::Act {
        let (rows, cols) = self.shape(x);
        let (Ok(xh), Ok(zh), Ok(w)) = (
            self.to_host(x),
            self.to_host(z),
            self.vector_to_host(weight),
        ) else {
            return self.zeros(rows, cols); // the failure is already recorded
        };
        self.act_from_host(&reference::rms_norm_gated(&xh, &zh, &w, eps), rows, cols)
    }
}

/// `q` and `k` of [`Backend::attention_rope`] before attention, rows at `position..`: each through
/// [`Backend::rms_norm_rope`] with its norm, or [`Backend::rope`] alone on a copy when `norms` is
/// `None`.
pub fn norm_rope_qk<B: Backend + ?Sized>(
    b: &B,
    q: &B::Act,
    k: &B::Act,
    norms: Option<(&B::Vector, &B::Vector)>,
    eps: f32,
    rope: Rope,
    position: usize,
) -> (B::Act, B::Act) {
    let prelude = |x: &B::Act, norm: Option<&B::Vector>| match norm {
        Some(w) => b.rms_norm_rope(x, w, eps, rope, position),
        None => {
            let mut y = b.slice_rows(x, 0, b.shape(x).0);
            b.rope(&mut y, rope, position);
            y
        }
    };
    (
        prelude(q, norms.map(|n| n.0)),
        prelude(k, norms.map(|n| n.1)),
    )
}

/// [`Backend::attention_rope_segments`] one request at a time: each request's rows cut out,
/// attended through its cache, and the outputs stacked (one request: no cutting).
#[allow(clippy::too_many_arguments)]
pub fn attention_rope_by_parts<B: Backend + ?Sized>(
    b: &B,
    q: &B::Act,
    k: &B::Act,
    v: &B::Act,
    norms: Option<(&B::Vector, &B::Vector)>,
    eps: f32,
    rope: Rope,
    caches: &mut [&mut B::KvCache],
    rows: &[usize],
    spec: AttentionSpec<'_, B::Vector>,
) -> B::Act {
    assert_eq!(caches.len(), rows.len(), "one cache per request");
    if let [cache] = caches {
        return b.attention_rope(q, k, v, norms, eps, rope, cache, spec);
    }
    let mut outs = Vec::with_capacity(rows.len());
    let mut first = 0;
    for (cache, &n) in caches.iter_mut().zip(rows) {
        let part = |a: &B::Act| b.slice_rows(a, first, n);
        let (q, k, v) = (part(q), part(k), part(v));
        outs.push(b.attention_rope(&q, &k, &v, norms, eps, rope, cache, spec));
        first += n;
    }
    b.concat_rows(&outs.iter().collect::<Vec<_>>())
}
