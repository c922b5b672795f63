//! The narrow interface between model code and the hardware that runs it.
//!
//! Model forward passes (in `sluice-models`) are written against [`Backend`] alone: they never see
//! whether activations live in host memory or on a GPU. A backend owns three kinds of object:
//! activations ([`Backend::Act`], always f32 `[rows, cols]`, one row per token), weights
//! ([`Backend::Weight`], a matrix in any [`WeightFormat`], made from a [`HostMatrix`]) and
//! per-request attention caches ([`Backend::KvCache`]).
//!
//! The only operations that bring data back to the host are [`Backend::to_host`] (logits) and
//! [`Backend::route`] (the expert choice, which the host needs in order to fetch expert weights).

mod weight;

pub use weight::{Dtype, HostBytes, HostMatrix, MatRef, WeightError, WeightFormat};

/// The experts chosen for each token: `experts[t * k + j]` with weight `weights[t * k + j]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Experts per token.
    pub k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routing {
    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.k).unwrap_or(0)
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
}

impl DeltaNetDims {
    /// Channels of the convolved projection: q, k and v.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
}

/// The three projections of one SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`.
pub struct FfnWeights<W> {
    pub gate: W,
    pub up: W,
    pub down: W,
}

/// A compute backend. All activations are f32; weights keep their stored format.
pub trait Backend: Send + Sync {
    /// Activations `[rows, cols]` in f32, row-major, one row per token.
    type Act: Send;
    /// A weight matrix `[out, in]`, resident where this backend computes.
    type Weight: Send + Sync;
    /// A 1-D f32 parameter (norm weights, biases).
    type Vector: Send + Sync;
    /// Keys and values of one attention layer for one request. `Clone` so a request's state can
    /// be saved and resumed (the server's prompt cache).
    type KvCache: Send + Clone;
    /// Convolution window and recurrent state of one linear-attention (Gated DeltaNet) layer for
    /// one request.
    type LinearState: Send + Clone;

    /// Short human-readable description, e.g. `cpu (avx512, 2 threads)`.
    fn describe(&self) -> String;

    fn weight(&self, m: HostMatrix) -> Result<Self::Weight, WeightError>;
    fn vector(&self, v: &[f32]) -> Self::Vector;
    fn kv_cache(&self, kv_heads: usize, head_dim: usize) -> Self::KvCache;
    /// Number of positions held by a cache.
    fn kv_len(&self, cache: &Self::KvCache) -> usize;
    /// Drops every position at or after `len` (to rewind a request).
    fn kv_truncate(&self, cache: &mut Self::KvCache, len: usize);

    /// A zeroed linear-attention state: a window of `conv_kernel - 1` inputs of `conv_channels`,
    /// and a `[value_dim, key_dim]` matrix per value head.
    fn linear_state(&self, dims: &DeltaNetDims) -> Self::LinearState;

    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> Self::Act;
    fn to_host(&self, a: &Self::Act) -> Vec<f32>;
    fn shape(&self, a: &Self::Act) -> (usize, usize);
    /// Rows `[start, start + len)` of `a` as a new activation.
    fn slice_rows(&self, a: &Self::Act, start: usize, len: usize) -> Self::Act;

    /// One row of `table` per token (dequantised).
    fn embed(&self, table: &Self::Weight, tokens: &[u32]) -> Self::Act;
    /// `x W^T`: `[rows, in] -> [rows, out]`.
    fn matmul(&self, x: &Self::Act, w: &Self::Weight) -> Self::Act;
    /// RMS-normalises every contiguous chunk of `weight.len()` values (a whole row, or one head)
    /// and scales it by `weight`.
    fn rms_norm(&self, x: &Self::Act, weight: &Self::Vector, eps: f32) -> Self::Act;
    fn add_assign(&self, x: &mut Self::Act, y: &Self::Act);
    /// `silu(gate) * up`, elementwise.
    fn swiglu(&self, gate: &Self::Act, up: &Self::Act) -> Self::Act;
    /// Rotary embedding, rotate-half (GPT-NeoX) form, on the first `rotary_dim` of each head of
    /// `head_dim` values; row `i` is at position `first_position + i`.
    fn rope(
        &self,
        x: &mut Self::Act,
        head_dim: usize,
        rotary_dim: usize,
        theta: f32,
        first_position: usize,
    );
    /// Appends `k`, `v` (`[rows, kv_heads * head_dim]`) to `cache` and returns causal grouped-query
    /// attention of `q` (`[rows, heads * head_dim]`) over everything cached, scaled by `scale`.
    fn attention(
        &self,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        cache: &mut Self::KvCache,
        heads: usize,
        scale: f32,
    ) -> Self::Act;
    /// `x * sigmoid(gate)`, elementwise; or, if `gate` has one column, each row of `x` scaled by
    /// the sigmoid of its gate.
    fn sigmoid_mul(&self, x: &mut Self::Act, gate: &Self::Act);
    /// Views each row as consecutive chunks of `chunk` values and splits every chunk after its
    /// first `first` values: returns (all the first parts, all the rest), each concatenated.
    fn split_chunks(&self, x: &Self::Act, chunk: usize, first: usize) -> (Self::Act, Self::Act);
    /// The columns of `parts` side by side (all with the same number of rows).
    fn concat_cols(&self, parts: &[&Self::Act]) -> Self::Act;
    /// Depthwise causal 1-D convolution over time, then SiLU. `weight` is `[channels, kernel]`
    /// (taps oldest first); the inputs before the first row come from the state's window, which
    /// is updated to the last `kernel - 1` inputs.
    fn causal_conv1d_silu(
        &self,
        x: &Self::Act,
        weight: &Self::Vector,
        state: &mut Self::LinearState,
    ) -> Self::Act;
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
    ) -> Self::Act;
    /// `silu(z) * rms_norm(x) * weight`, normalising each chunk of `weight.len()` values.
    fn rms_norm_gated(
        &self,
        x: &Self::Act,
        z: &Self::Act,
        weight: &Self::Vector,
        eps: f32,
    ) -> Self::Act;
    /// Softmax over router logits `[rows, experts]`, top-`k` per row, optionally renormalised
    /// to sum to one. Brings the choice to the host.
    fn route(&self, logits: &Self::Act, k: usize, normalize: bool) -> Routing;
    /// `sum_j weight_j * ffn_{expert_j}(x)` per row, with `experts[e]` the weights of expert `e`.
    fn moe(
        &self,
        x: &Self::Act,
        routing: &Routing,
        experts: &[FfnWeights<Self::Weight>],
    ) -> Self::Act {
        let (rows, cols) = self.shape(x);
        let mut used: Vec<u32> = routing.experts.clone();
        used.sort_unstable();
        used.dedup();
        let present: Vec<(u32, &FfnWeights<Self::Weight>)> =
            used.iter().map(|&e| (e, &experts[e as usize])).collect();
        let mut out = self.act_from_host(&vec![0.0; rows * cols], rows, cols);
        self.moe_accumulate(x, routing, &present, &mut out);
        out
    }
    /// Adds `weight_j * ffn_{expert_j}(x)` to `out` for the routed (row, expert) pairs whose
    /// expert is in `experts` (expert id and weights, ascending ids); pairs of other experts are
    /// skipped. Each row accumulates in ascending expert id, so splitting the experts of a call
    /// into ascending runs over several calls gives bit-identical results (a streamed expert
    /// cache smaller than the experts a batch needs relies on this).
    fn moe_accumulate(
        &self,
        x: &Self::Act,
        routing: &Routing,
        experts: &[(u32, &FfnWeights<Self::Weight>)],
        out: &mut Self::Act,
    );
    /// A dense SwiGLU feed-forward block.
    fn ffn(&self, x: &Self::Act, w: &FfnWeights<Self::Weight>) -> Self::Act {
        let gate = self.matmul(x, &w.gate);
        let up = self.matmul(x, &w.up);
        self.matmul(&self.swiglu(&gate, &up), &w.down)
    }
}
