//! CPU kernels over [`MatRef`] weights. Activations are f32; weights stay in their stored format.
//!
//! Public entry points are multi-threaded (rayon's global pool) and pick the widest SIMD the CPU
//! has at run time. Nothing in a weight's bytes is assumed to be aligned.
//!
//! # Design
//!
//! * **Decode** (few tokens): one pass over the weights per `DECODE_MAX_TOKENS` (4) tokens,
//!   each row dotted with those tokens at once. For affine weights `y_r = sum_g s_g * dot(q_g,
//!   x_g) + sum_g b_g * xsum_g`, with the per-group sums of `x` computed once per call; scales and
//!   biases are converted for 16 rows at a time and the bias term joins the row's vector
//!   accumulator. For 4-bit weights `x` is permuted once per call into the "nibble-major" order a
//!   vector of `u32` words yields nibble by nibble, so a row costs per vector of 8 (16) weights:
//!   AVX2 `and` (nibble `k` masked in place; `x` carries the `2^-4k`), convert and FMA; AVX-512
//!   shift and one `vpermps` table lookup (nibble to float) and FMA. Up to the `GEMM_MIN_TOKENS_*`
//!   thresholds, more tokens run as several such passes over blocks of 32 rows (cache-resident).
//!   8-bit weights in groups of 16 (GGUF's Q6_K as converted at load) are too short a group to
//!   pay for a sum per group and token: each group's codes are scaled once for all tokens and
//!   the products summed over the whole row (the bias term as above).
//! * **Prefill** (many tokens): each task dequantizes up to `NCB` rows, `KC` columns at a time,
//!   into a thread-local buffer packed as `[column][NR rows]` panels (8x8 transposes of words),
//!   and a register-tiled micro-kernel (`MR` tokens x `NR` rows: 6x16 AVX2, 8x32 AVX-512)
//!   multiplies every token against it. Each weight byte is read and dequantized once per call.
//! * **Threads**: the rows of all jobs of a call are cut into one flat list of tasks, sized so that
//!   there are a few per thread and each is large enough that rayon's overhead does not show;
//!   small calls run on the calling thread. Jobs sharing the same `x` share its preparation.
//!   A decoded token's experts (gate/up, activation, down) are one such list ([`ffn_batch`]):
//!   down tasks start as soon as their expert's gate/up rows are done, with no barrier between.
//! * **SIMD**: AVX-512 (F), AVX2 (+FMA+F16C), NEON and a portable fallback, chosen once at run
//!   time. `SLUICE_SIMD=scalar|avx2|avx512|neon` forces a lower level; `SLUICE_GEMM_MIN_TOKENS=N`
//!   overrides the decode/prefill threshold (for tuning).
//! * Activations and accumulation stay f32 (the tests hold every path to 1e-5 of the largest
//!   output against an f64 reference), unless the caller asks for [`Kernels::Fast`]: then 4-bit
//!   products (decode and prefill) quantize each token's activations once per call to 8 bits
//!   per word of 8 values (one scale each) and sum nibble x byte products in integers, 32 weight
//!   bytes at a time (`vpdpbusd` on 256-bit vectors with AVX-512 VNNI, else AVX2 `vpmaddubsw`
//!   and `vpmaddwd`), about a quarter of the instructions of the float path per weight byte,
//!   so decode is bound by memory instead of by the core. From `IGEMM_MIN_TOKENS` tokens on,
//!   4-bit products take the integer prefill ([`igemm`]): activations quantized per 32 values
//!   (ggml's Q8 blocks), weights packed 16 rows at a time with a row per 32-bit lane, integer
//!   sums scaled once per block and token.
//! * **Formats** with their own kernels: f32, f16, bf16, 4-bit affine in groups of 32, 64 or
//!   128 and 8-bit affine in groups of 16, 32, 64 or 128 (scales and biases in f32, f16 or
//!   bf16). 2-, 3-, 5- and 6-bit affine in groups of 16, 32, 64 or 128 ([`Kind::QBits`]: GGUF's
//!   Q2_K/Q3_K/Q5_x as converted, MLX's other widths) decode on AVX2/AVX-512 by unpacking each
//!   row's codes to one byte each (a byte shuffle, a 16-bit multiply and shift per 16 codes,
//!   into a thread-local buffer that stays in L1) and running the 8-bit decode kernels on them,
//!   bias term included; their prefill and the portable level take the generic path. Every
//!   other affine format (4 bits in groups of 16, other group sizes) goes through a generic
//!   scalar dequantizer and the same drivers. mxfp4 (gpt-oss's experts) is `QAny` with a decode
//!   kernel of its own (AVX2, also at the AVX-512 level: per group of 32 two nibble table
//!   shuffles to bytes, widened to floats; portable: a byte-pair table) and prefill through the
//!   generic packer (2 AVX2 cores, 2880 x 2880: decode 7.6 GB/s against 15.9 for q4 g64;
//!   prefill of 64 tokens 115 against 174 GFLOP/s).

// Every unsafe operation sits in its own `unsafe` block with a `SAFETY:` comment, also inside
// `unsafe fn`s.
#![deny(unsafe_op_in_unsafe_fn)]

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod ffn;
mod igemm;
#[cfg(target_arch = "aarch64")]
mod neon;
mod portable;
#[cfg(test)]
mod tests;

use std::cell::RefCell;
use std::sync::OnceLock;

use sluice_backend::{Dtype, MatRef, WeightFormat};

pub use ffn::{ffn_batch, FfnJob};

/// One `out = x W^T` product: `x` is `[tokens, w.cols]`, `out` is `[tokens, w.rows]`.
pub struct MatmulJob<'a> {
    pub w: MatRef<'a>,
    pub x: &'a [f32],
    pub tokens: usize,
    pub out: &'a mut [f32],
}

/// How activations meet quantized weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    /// f32 activations and accumulation: equal to the reference implementations to ~1e-6.
    #[default]
    Exact,
    /// 4-bit products with activations quantized to 8 bits (per 8 values for decode, per 32
    /// for prompts) and summed in integers (see the module doc); every other product as in
    /// `Exact`. An approximation whose effect on the logits is measured by the engine's tests.
    Fast,
}

impl Kernels {
    pub fn name(self) -> &'static str {
        match self {
            Kernels::Exact => "exact",
            Kernels::Fast => "fast",
        }
    }
}

impl std::str::FromStr for Kernels {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "exact" => Ok(Kernels::Exact),
            "fast" => Ok(Kernels::Fast),
            _ => Err(format!("unknown kernels `{s}` (use exact or fast)")),
        }
    }
}

/// `out = x W^T` with `x` `[tokens, w.cols]` and `out` `[tokens, w.rows]`.
pub fn matmul(kernels: Kernels, w: &MatRef, x: &[f32], tokens: usize, out: &mut [f32]) {
    matmul_batch(
        kernels,
        &mut [MatmulJob {
            w: *w,
            x,
            tokens,
            out,
        }],
    );
}

/// Several independent products run as one parallel job (the experts of an MoE layer).
pub fn matmul_batch(kernels: Kernels, jobs: &mut [MatmulJob<'_>]) {
    matmul_batch_at(level(), kernels, jobs);
}

/// `sum a[i] * b[i]` (attention scores) with the widest SIMD the CPU has.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: lengths differ");
    match level() {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => {
            // SAFETY: `level()` returns these levels only when the CPU has AVX2 and FMA.
            unsafe { avx2::dot(a, b) }
        }
        _ => {
            let mut acc = [0f32; 8];
            let mut chunks = a.chunks_exact(8).zip(b.chunks_exact(8));
            for (x, y) in &mut chunks {
                for k in 0..8 {
                    acc[k] += x[k] * y[k];
                }
            }
            let tail = a.len() / 8 * 8;
            let rest: f32 = a[tail..].iter().zip(&b[tail..]).map(|(x, y)| x * y).sum();
            acc.iter().sum::<f32>() + rest
        }
    }
}

/// `scale * (q . rows[p * stride..][..q.len()])` for `p < out.len()` (attention's scores) with
/// the widest SIMD the CPU has, four rows at a time.
pub fn scaled_dots(q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    let (n, hd) = (out.len(), q.len());
    assert!(
        n == 0 || (n - 1) * stride + hd <= rows.len(),
        "scaled_dots: rows too short"
    );
    let row = |p: usize| &rows[p * stride..p * stride + hd];
    let mut p = 0;
    #[cfg(target_arch = "x86_64")]
    if matches!(level(), Level::Avx2 | Level::Avx512) {
        while p + 4 <= n {
            // SAFETY: `level()` returns these levels only when the CPU has AVX2 and FMA.
            let d = unsafe { avx2::dot4(q, [row(p), row(p + 1), row(p + 2), row(p + 3)]) };
            for (o, d) in out[p..p + 4].iter_mut().zip(d) {
                *o = d * scale;
            }
            p += 4;
        }
    }
    for (i, o) in out.iter_mut().enumerate().skip(p) {
        *o = dot(q, row(i)) * scale;
    }
}

/// `y += alpha * x` (attention's weighted values) with the widest SIMD the CPU has.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len(), "axpy: lengths differ");
    match level() {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => {
            // SAFETY: `level()` returns these levels only when the CPU has AVX2 and FMA.
            unsafe { avx2::axpy(alpha, x, y) }
        }
        _ => {
            for (o, &v) in y.iter_mut().zip(x) {
                *o += alpha * v;
            }
        }
    }
}

/// `gate = silu(gate) * up` elementwise (SwiGLU); `exp` is a vectorised polynomial on x86
/// (within 2 ulp of `f32::exp`).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: lengths differ");
    silu_apply(gate, up, Silu::TimesOther);
}

/// `x = silu(x) = x / (1 + e^-x)` elementwise, `exp` as in [`silu_mul`].
pub fn silu(x: &mut [f32]) {
    silu_apply(x, &[], Silu::Alone);
}

/// `x = silu(gate) * x` elementwise (a gated norm's output), `exp` as in [`silu_mul`].
pub fn mul_silu(x: &mut [f32], gate: &[f32]) {
    assert_eq!(x.len(), gate.len(), "mul_silu: lengths differ");
    silu_apply(x, gate, Silu::OfOther);
}

/// Which SiLU [`silu_apply`] writes into `x`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Silu {
    /// `silu(x)`.
    Alone,
    /// `silu(x) * other`.
    TimesOther,
    /// `silu(other) * x`.
    OfOther,
}

fn silu_apply(x: &mut [f32], other: &[f32], mode: Silu) {
    match level() {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => {
            // SAFETY: `level()` returns these levels only when the CPU has AVX2 and FMA.
            unsafe { avx2::silu_apply(x, other, mode) }
        }
        _ => silu_apply_scalar(x, other, mode),
    }
}

/// [`silu_apply`] one value at a time (the SIMD kernels' tails too).
pub(crate) fn silu_apply_scalar(x: &mut [f32], other: &[f32], mode: Silu) {
    let silu = |g: f32| g / (1.0 + (-g).exp());
    match mode {
        Silu::Alone => x.iter_mut().for_each(|v| *v = silu(*v)),
        Silu::TimesOther => x
            .iter_mut()
            .zip(other)
            .for_each(|(v, &o)| *v = silu(*v) * o),
        Silu::OfOther => x.iter_mut().zip(other).for_each(|(v, &o)| *v *= silu(o)),
    }
}

/// One token of the gated delta rule for one value head. `s` is the head's state, `v.len()`
/// rows of `k.len()` (key dimension): each row `s_i` decays by `g`, moves toward `v[i]` along
/// `k` (`s_i += beta * (v[i] - s_i . k) * k`), and is read out as `y[i] = s_i . q`. The dot
/// products are SIMD sums on x86 (their rounding differs from a sum in order by a few ulp).
pub fn delta_rule_step(
    s: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    (g, beta): (f32, f32),
    y: &mut [f32],
) {
    delta_rule_step_at(level(), s, k, q, v, (g, beta), y);
}

/// [`delta_rule_step`] at a given SIMD level (tests cover every level).
pub(crate) fn delta_rule_step_at(
    level: Level,
    s: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    (g, beta): (f32, f32),
    y: &mut [f32],
) {
    let dk = k.len();
    assert!(
        dk > 0 && q.len() == dk && s.len() == v.len() * dk && y.len() == v.len(),
        "delta_rule_step: shapes differ"
    );
    assert!(
        supported(level),
        "SIMD level {} not supported",
        level.name()
    );
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => {
            // SAFETY: `supported(level)` (asserted above) holds for these levels only when the
            // CPU has AVX2 and FMA.
            unsafe { avx2::delta_rule_step(s, k, q, v, (g, beta), y) }
        }
        _ => {
            for ((row, &vi), yi) in s.chunks_exact_mut(dk).zip(v).zip(y.iter_mut()) {
                let mut kv = 0.0;
                for (sv, &kj) in row.iter_mut().zip(k) {
                    *sv *= g;
                    kv += *sv * kj;
                }
                let delta = (vi - kv) * beta;
                let mut out = 0.0;
                for ((sv, &kj), &qj) in row.iter_mut().zip(k).zip(q) {
                    *sv += delta * kj;
                    out += *sv * qj;
                }
                *yi = out;
            }
        }
    }
}

/// `out = sum_p w[p] * rows[p * stride..][..out.len()]` (attention's weighted values), with
/// the same roundings as [`axpy`] applied for each `p` in turn from zero, the sums kept in
/// registers.
pub fn weighted_rows(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    out.fill(0.0);
    add_weighted_rows(w, rows, stride, out);
}

/// `out += sum_p w[p] * rows[p * stride..][..out.len()]`: [`weighted_rows`] continued (calls
/// over consecutive runs of rows give the bits of one call over all of them).
pub fn add_weighted_rows(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let (n, hd) = (w.len(), out.len());
    assert!(
        n == 0 || (n - 1) * stride + hd <= rows.len(),
        "weighted_rows: rows too short"
    );
    match level() {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => {
            // SAFETY: `level()` returns these levels only when the CPU has AVX2 and FMA.
            unsafe { avx2::weighted_rows(w, rows, stride, out) }
        }
        _ => {
            for (p, &wp) in w.iter().enumerate() {
                for (o, &v) in out.iter_mut().zip(&rows[p * stride..p * stride + hd]) {
                    *o += wp * v;
                }
            }
        }
    }
}

/// Row `r` of `w` as f32.
pub fn dequantize_row(w: &MatRef, r: usize, out: &mut [f32]) {
    dequantize_row_at(level(), w, r, out);
}

/// [`dequantize_row`] at a given SIMD level.
pub(crate) fn dequantize_row_at(level: Level, w: &MatRef, r: usize, out: &mut [f32]) {
    assert!(
        supported(level),
        "SIMD level {} not supported",
        level.name()
    );
    assert_eq!(out.len(), w.cols);
    assert!(r < w.rows, "row {r} of a matrix of {} rows", w.rows);
    check_matrix(w);
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => {
            // SAFETY: `level()` only returns these levels when the CPU has AVX2, FMA and F16C,
            // and `check_matrix` validated the byte lengths of `w`.
            unsafe { avx2::dequant_row(w, r, out) }
        }
        _ => portable::dequant_range(w, r, 0, out),
    }
}

/// Element `i` of a little-endian array of `dt`.
pub fn load_scalar(dt: Dtype, bytes: &[u8], i: usize) -> f32 {
    scalar(dt, bytes, i)
}

/// [`load_scalar`], always inlined (for the kernels' scalar edges).
#[inline(always)]
pub(crate) fn scalar(dt: Dtype, bytes: &[u8], i: usize) -> f32 {
    match dt {
        Dtype::F32 => f32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap()),
        Dtype::F16 => {
            half::f16::from_bits(u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]])).to_f32()
        }
        Dtype::Bf16 => {
            half::bf16::from_bits(u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]])).to_f32()
        }
    }
}

/// The SIMD level in use, e.g. `"avx512"`.
pub fn simd_level() -> &'static str {
    level().name()
}

// ---------------------------------------------------------------------------------------------
// SIMD level selection
// ---------------------------------------------------------------------------------------------

/// A SIMD instruction set the kernels are written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    Scalar,
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    Neon,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx512,
}

impl Level {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Level::Scalar => "scalar",
            Level::Neon => "neon",
            Level::Avx2 => "avx2",
            Level::Avx512 => "avx512",
        }
    }

    fn parse(s: &str) -> Option<Level> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "scalar" | "portable" | "none" => Level::Scalar,
            "neon" => Level::Neon,
            "avx2" => Level::Avx2,
            "avx512" | "avx-512" => Level::Avx512,
            _ => return None,
        })
    }
}

/// Every level this CPU can run, best last.
pub(crate) fn available_levels() -> Vec<Level> {
    #[allow(unused_mut)]
    let mut v = vec![Level::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            v.push(Level::Avx2);
            if std::arch::is_x86_feature_detected!("avx512f") {
                v.push(Level::Avx512);
            }
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if std::arch::is_aarch64_feature_detected!("neon") {
            v.push(Level::Neon);
        }
    }
    v
}

fn supported(l: Level) -> bool {
    static AVAIL: OnceLock<Vec<Level>> = OnceLock::new();
    AVAIL.get_or_init(available_levels).contains(&l)
}

/// The level in use: the best available, or a lower one forced by `SLUICE_SIMD`.
pub(crate) fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        let avail = available_levels();
        let best = *avail.last().unwrap();
        match std::env::var("SLUICE_SIMD")
            .ok()
            .as_deref()
            .map(Level::parse)
        {
            Some(Some(l)) if avail.contains(&l) => l,
            _ => best,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Formats
// ---------------------------------------------------------------------------------------------

/// The storage formats the kernels have a dedicated path for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    F32,
    F16,
    Bf16,
    /// 4-bit affine with a group size of 32, 64 or 128.
    Q4 {
        gs: usize,
        sdt: Dtype,
    },
    /// 8-bit affine with a group size of 16, 32, 64 or 128.
    Q8 {
        gs: usize,
        sdt: Dtype,
    },
    /// 2-, 3-, 5- or 6-bit affine with a group size of 16, 32, 64 or 128: decode unpacks each
    /// row's codes to bytes and runs the 8-bit kernels on them (elsewhere as `QAny`).
    QBits {
        bits: u32,
        gs: usize,
        sdt: Dtype,
    },
    /// Any other affine format, and mxfp4 (dequantized by the generic scalar code).
    QAny,
}

impl Kind {
    pub(crate) fn of(f: WeightFormat) -> Kind {
        match f {
            WeightFormat::Dense(Dtype::F32) => Kind::F32,
            WeightFormat::Dense(Dtype::F16) => Kind::F16,
            WeightFormat::Dense(Dtype::Bf16) => Kind::Bf16,
            WeightFormat::Affine {
                bits: 4,
                group_size: gs @ (32 | 64 | 128),
                scale_dtype: sdt,
            } => Kind::Q4 { gs, sdt },
            // Group 16: GGUF's Q6_K blocks, converted at load.
            WeightFormat::Affine {
                bits: 8,
                group_size: gs @ (16 | 32 | 64 | 128),
                scale_dtype: sdt,
            } => Kind::Q8 { gs, sdt },
            // GGUF's Q2_K/Q3_K/Q5_0/Q5_1/Q5_K convert to 2/3/5 bits (group 16 or 32); MLX
            // checkpoints use 2, 3, 5 and 6 bits too.
            WeightFormat::Affine {
                bits: bits @ (2 | 3 | 5 | 6),
                group_size: gs @ (16 | 32 | 64 | 128),
                scale_dtype: sdt,
            } => Kind::QBits { bits, gs, sdt },
            // gpt-oss's experts: the generic dequantizer, for now.
            WeightFormat::Affine { .. } | WeightFormat::Mxfp4 => Kind::QAny,
        }
    }
}

fn check_matrix(w: &MatRef) {
    if let Err(e) = w.validate() {
        panic!("invalid weight matrix: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// Tuning constants
// ---------------------------------------------------------------------------------------------

/// The decode kernels take up to this many tokens per pass over the weights (more tokens run in
/// several passes over small blocks of rows, re-read from cache).
pub(crate) const DECODE_MAX_TOKENS: usize = 4;
/// From this many tokens on, products run through the packed micro-kernel (below, the decode
/// kernels in passes of `DECODE_MAX_TOKENS`): both cost about the same per token, the packing
/// is what the micro-kernel must amortize. Measured on a 16 x [768, 2048] q4 expert batch: the
/// two paths tie at ~16 tokens on Zen 3 (AVX2) and on Sapphire Rapids (AVX-512).
const GEMM_MIN_TOKENS_AVX512: usize = 16;
const GEMM_MIN_TOKENS_AVX2: usize = 16;

/// `SLUICE_GEMM_MIN_TOKENS` (read once) overrides the thresholds above and
/// `IGEMM_MIN_TOKENS`, for tuning.
fn gemm_min_tokens_override() -> Option<usize> {
    static N: OnceLock<Option<usize>> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("SLUICE_GEMM_MIN_TOKENS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map(|n: usize| n.max(DECODE_MAX_TOKENS + 1))
    })
}

/// Whether a product of `tokens` tokens runs through the packed micro-kernel at `level`.
/// Never for the integer 4-bit path: its decode kernel, in passes of `DECODE_MAX_TOKENS`
/// tokens over blocks of rows, outruns the f32 micro-kernel at every token count (1 thread,
/// Zen 4, 2048 x 2048: 137 against 109 GFLOP/s at 512 tokens, 2.4x at 16-32 tokens), and
/// from `IGEMM_MIN_TOKENS` on the integer prefill takes over.
fn use_gemm(level: Level, kernels: Kernels, kind: Kind, tokens: usize) -> bool {
    if integer_q4(level, kernels, kind) {
        return false;
    }
    let min = match level {
        Level::Avx512 => GEMM_MIN_TOKENS_AVX512,
        Level::Avx2 => GEMM_MIN_TOKENS_AVX2,
        // The portable decode takes any number of tokens in one pass (NEON's too).
        Level::Scalar | Level::Neon => return tokens > DECODE_MAX_TOKENS,
    };
    tokens >= gemm_min_tokens_override().unwrap_or(min)
}
/// From this many tokens on, integer 4-bit products run through [`igemm`] (x86). Below it the
/// decode kernels' passes win: each panel is packed once per call, and with few tokens the
/// packing is not paid back (1 thread, Zen 4, 16 experts of 768 x 2048 from DRAM: 2.9 against
/// 2.5 ms at 8 tokens, a tie at 12-16, 8.4 against 9.3 ms at 32).
const IGEMM_MIN_TOKENS: usize = 16;

/// The most tokens a product computes with the decode kernels (per token the same arithmetic
/// as one token alone): below the integer prefill's threshold.
pub fn max_decode_tokens() -> usize {
    gemm_min_tokens_override()
        .unwrap_or(IGEMM_MIN_TOKENS)
        .saturating_sub(1)
        .max(1)
}

/// Whether a product of `tokens` tokens runs through the integer prefill ([`igemm`]).
fn use_igemm(level: Level, kernels: Kernels, kind: Kind, tokens: usize) -> bool {
    integer_q4(level, kernels, kind)
        && matches!(level, Level::Avx2 | Level::Avx512)
        && tokens >= gemm_min_tokens_override().unwrap_or(IGEMM_MIN_TOKENS)
}

/// How one product runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// The mat-vec kernels, in passes of `DECODE_MAX_TOKENS` tokens.
    Decode,
    /// The packed f32 micro-kernel.
    Gemm,
    /// The integer 4-bit prefill.
    IntGemm,
}

fn path(level: Level, kernels: Kernels, kind: Kind, tokens: usize) -> Path {
    if use_igemm(level, kernels, kind, tokens) {
        Path::IntGemm
    } else if use_gemm(level, kernels, kind, tokens) {
        Path::Gemm
    } else {
        Path::Decode
    }
}

/// Columns per packed block (a multiple of 128, so blocks start on whole words and groups; with
/// groups of 16 a block spans up to 16 groups).
pub(crate) const KC: usize = 256;
/// Rows packed at once by a prefill task (a multiple of every level's `NR`): each token tile
/// of `x` is reused against this many rows while it is in L1.
pub(crate) const NCB: usize = 256;
/// Prefill tasks are cut in multiples of this many rows.
const GEMM_ROW_UNIT: usize = 64;
/// The smallest task worth handing to another thread, in weight bytes (or equivalent work).
const MIN_TASK_COST: usize = 48 << 10;
/// The smallest decode task (the last ones of a step).
const MIN_DECODE_TASK_COST: usize = 16 << 10;
/// From this many activation values in a call (a prompt), its activations are prepared before
/// the products, in parallel; below it (decoding), by the first task that needs each input.
const PARALLEL_PREP_VALUES: usize = 1 << 16;
/// Below this much work in a whole call, no thread is woken.
const SERIAL_COST: usize = 96 << 10;

// ---------------------------------------------------------------------------------------------
// Per-call preparation of activations
// ---------------------------------------------------------------------------------------------

/// What a job's activations are turned into once per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PrepKind {
    None,
    /// Per-group sums of `x` (affine decode).
    Sums {
        gs: usize,
    },
    /// Per-group sums and `x` permuted into nibble-major blocks of `wpb` u32 words (see
    /// [`permute_q4`]).
    Q4 {
        gs: usize,
        wpb: usize,
        scaled: bool,
    },
    /// Per-group sums and `x` quantized to 8 bits in blocks of `bpb` weight bytes (see
    /// [`quantize_q4i`]).
    Q4Int {
        gs: usize,
        bpb: usize,
    },
    /// Per-group sums and `x` quantized to 8 bits per 32 values (see
    /// [`igemm::quantize_blocks`]).
    Q4Blocks {
        gs: usize,
    },
}

/// Activations prepared for one or more jobs (jobs sharing the same `x` share it).
#[derive(Default)]
pub(crate) struct Prep {
    /// Permuted activations, `tokens` rows of `ldxp` (4-bit decode only).
    pub xp: Vec<f32>,
    pub ldxp: usize,
    /// Per-group sums of `x`, `tokens` rows of `groups`.
    pub xsum: Vec<f32>,
    /// 8-bit activations (integer 4-bit products only), `tokens` rows of `ldxq`.
    pub xq: Vec<i8>,
    pub ldxq: usize,
    /// The scales of `xq`: one per word (8 values) for the decode kernels, `tokens` rows of
    /// `ldxq / 8`; one per 32 values for the integer prefill, `tokens` rows of `ldxq / 32`.
    pub xd: Vec<f32>,
}

/// Words per permutation block of the 4-bit decode kernel of each level (0: no permutation),
/// and whether nibble `k` of the block is pre-scaled by `2^-4k` (see [`permute_q4`]).
fn q4_layout(level: Level) -> (usize, bool) {
    match level {
        Level::Avx512 => (16, false),
        Level::Avx2 => (8, true),
        Level::Neon => (4, false),
        Level::Scalar => (0, false),
    }
}

/// Weight bytes per block of the integer 4-bit decode kernel at `level` (0: none). AVX-512 runs
/// the AVX2 kernel's 32-byte blocks (with VNNI where it can): 64-byte blocks decoded ~9%
/// slower on Zen 4 (2 threads, Qwen3-30B-A3B shape).
pub(crate) fn q4i_block_bytes(level: Level) -> usize {
    match level {
        Level::Avx2 | Level::Avx512 => 32,
        Level::Scalar | Level::Neon => 0,
    }
}

/// Whether products of `kind` weights take the integer 4-bit kernels.
pub(crate) fn integer_q4(level: Level, kernels: Kernels, kind: Kind) -> bool {
    kernels == Kernels::Fast && matches!(kind, Kind::Q4 { .. }) && q4i_block_bytes(level) > 0
}

fn prep_kind(level: Level, kernels: Kernels, kind: Kind, tokens: usize) -> PrepKind {
    if use_gemm(level, kernels, kind, tokens) || level == Level::Scalar {
        return PrepKind::None;
    }
    match kind {
        Kind::Q4 { gs, .. } if use_igemm(level, kernels, kind, tokens) => PrepKind::Q4Blocks { gs },
        Kind::Q4 { gs, .. } if integer_q4(level, kernels, kind) => PrepKind::Q4Int {
            gs,
            bpb: q4i_block_bytes(level),
        },
        Kind::Q4 { gs, .. } => {
            let (wpb, scaled) = q4_layout(level);
            PrepKind::Q4 { gs, wpb, scaled }
        }
        Kind::Q8 { gs, .. } => PrepKind::Sums { gs },
        Kind::QBits { gs, .. } if matches!(level, Level::Avx2 | Level::Avx512) => {
            PrepKind::Sums { gs }
        }
        _ => PrepKind::None,
    }
}

/// `x` permuted for the 4-bit decode kernels: in each block of `8 * wpb` columns, element
/// `8 * j + k` (word `j`, nibble `k`) goes to position `k * wpb + j`. The last block is padded
/// with zeros. `dst.len()` must be `cols` rounded up to a multiple of `8 * wpb`.
///
/// With `scaled`, nibbles `k < 7` are multiplied by `2^-4k`: a kernel may then take nibble `k`
/// as `word & (15 << 4k)` (that is `q * 2^4k`) without shifting it down. Powers of two are
/// exact, so the products are the same (unless `|x| < 2^-102`, where `x * 2^-24` is subnormal).
pub(crate) fn permute_q4(x: &[f32], wpb: usize, scaled: bool, dst: &mut [f32]) {
    let bw = 8 * wpb;
    debug_assert_eq!(dst.len(), x.len().div_ceil(bw) * bw);
    let f: [f32; 8] = std::array::from_fn(|k| {
        if scaled && k < 7 {
            (-4.0 * k as f32).exp2()
        } else {
            1.0
        }
    });
    for (b, blk) in dst.chunks_exact_mut(bw).enumerate() {
        let base = b * bw;
        if base + bw <= x.len() {
            let src = &x[base..base + bw];
            for j in 0..wpb {
                for k in 0..8 {
                    blk[k * wpb + j] = src[8 * j + k] * f[k];
                }
            }
        } else {
            for j in 0..wpb {
                for k in 0..8 {
                    blk[k * wpb + j] = x.get(base + 8 * j + k).copied().unwrap_or(0.0) * f[k];
                }
            }
        }
    }
}

/// `x` quantized for the integer 4-bit decode kernels. Each word's 8 values (one u32 of MLX
/// nibbles) become `round(x / d)` with their own `d = max |x| / 127` (`xd[word]`): finer than
/// ggml's blocks of 32, for the same cost in the kernel, which applies one scale per word lane
/// anyway. The bytes are laid out per block of `bpb` weight bytes (`2 * bpb` values) in the
/// order a block's nibbles come out of a vector: the even values (low nibbles) first, then the
/// odd ones. `xq.len()` must be `x.len()` rounded up to `2 * bpb`, and `xd.len()` an eighth
/// of it; the padding is zeros. Non-finite activations give non-finite scales, so they reach
/// the output as they would in the exact path.
pub(crate) fn quantize_q4i(x: &[f32], bpb: usize, xq: &mut [i8], xd: &mut [f32]) {
    assert!(bpb.is_power_of_two() && bpb >= 4, "blocks of {bpb} bytes");
    let be = 2 * bpb;
    assert_eq!(xq.len(), x.len().div_ceil(be) * be);
    assert_eq!(xd.len() * 8, xq.len());
    xq.fill(0);
    xd.fill(0.0);
    let full = x.len() / 8;
    #[cfg(target_arch = "x86_64")]
    let done = if avx2::cpu_ok() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above); the lengths were asserted.
        unsafe { avx2::quantize_q4i_words(&x[..full * 8], bpb, xq, xd) };
        full
    } else {
        0
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    for (w, vals) in x.chunks(8).enumerate().skip(done) {
        xd[w] = quantize_word(vals, bpb, w, xq);
    }
}

/// Word `w` of [`quantize_q4i`] (up to 8 values): writes its bytes and returns its scale.
/// Word `w` of block `blk` (4 bytes of weights) meets values `8w..8w + 8`: its even values go to
/// bytes `4w..4w + 4` of the block's first half, its odd ones to the second half.
pub(crate) fn quantize_word(vals: &[f32], bpb: usize, w: usize, xq: &mut [i8]) -> f32 {
    let amax = vals.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let amax = if vals.iter().all(|v| v.is_finite()) {
        amax
    } else {
        f32::NAN
    };
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    let at = q4i_word_offset(bpb, w);
    for (k, &v) in vals.iter().enumerate() {
        xq[at + (k % 2) * bpb + k / 2] = round_to_i8(v * inv);
    }
    amax / 127.0
}

/// Where word `w`'s first even value goes in [`quantize_q4i`]'s layout (`bpb` a power of two
/// of at least 4: shifts instead of divisions, which were most of the quantization's time).
#[inline]
pub(crate) fn q4i_word_offset(bpb: usize, w: usize) -> usize {
    debug_assert!(bpb.is_power_of_two() && bpb >= 4);
    let wpb = bpb / 4;
    (w >> wpb.trailing_zeros()) * 2 * bpb + (w & (wpb - 1)) * 4
}

/// `v` (|v| <= 127, or NaN) rounded to the nearest integer, ties to even. Adding and removing
/// 1.5 x 2^23 rounds in the FPU's default mode: `f32::round` is a library call on baseline
/// x86-64 and took more time than the rest of the quantization.
#[inline]
fn round_to_i8(v: f32) -> i8 {
    const MAGIC: f32 = 12_582_912.0;
    // `as` saturates and maps NaN to 0.
    ((v + MAGIC) - MAGIC) as i8
}

/// The sum of `v` in eight interleaved partial sums (a form the compiler vectorizes; a plain
/// `sum()` is one serial chain of additions).
fn sum_f32(v: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
}

/// One token's share of a [`PrepKind::Q4Blocks`] preparation: its values, their codes, block
/// scales and group sums.
struct BlockRow<'a> {
    x: &'a [f32],
    q: &'a mut [i8],
    d: &'a mut [f32],
    s: &'a mut [f32],
}

fn prepare(pk: PrepKind, x: &[f32], tokens: usize, cols: usize) -> Prep {
    let sums = |gs: usize| {
        let mut s = Vec::with_capacity(tokens * (cols / gs));
        for t in 0..tokens {
            s.extend(x[t * cols..(t + 1) * cols].chunks_exact(gs).map(sum_f32));
        }
        s
    };
    match pk {
        PrepKind::None => Prep::default(),
        PrepKind::Sums { gs } => Prep {
            xsum: sums(gs),
            ..Prep::default()
        },
        PrepKind::Q4 { gs, wpb, scaled } => {
            let ldxp = cols.div_ceil(8 * wpb) * 8 * wpb;
            let mut xp = vec![0f32; tokens * ldxp];
            for t in 0..tokens {
                permute_q4(
                    &x[t * cols..(t + 1) * cols],
                    wpb,
                    scaled,
                    &mut xp[t * ldxp..(t + 1) * ldxp],
                );
            }
            Prep {
                xp,
                ldxp,
                xsum: sums(gs),
                ..Prep::default()
            }
        }
        PrepKind::Q4Int { gs, bpb } => {
            let ldxq = cols.div_ceil(2 * bpb) * 2 * bpb;
            let mut xq = vec![0i8; tokens * ldxq];
            let mut xd = vec![0f32; tokens * ldxq / 8];
            for t in 0..tokens {
                quantize_q4i(
                    &x[t * cols..(t + 1) * cols],
                    bpb,
                    &mut xq[t * ldxq..(t + 1) * ldxq],
                    &mut xd[t * ldxq / 8..(t + 1) * ldxq / 8],
                );
            }
            Prep {
                xsum: sums(gs),
                xq,
                ldxq,
                xd,
                ..Prep::default()
            }
        }
        PrepKind::Q4Blocks { gs } => {
            let (nb, groups) = (cols / igemm::QBLOCK, cols / gs);
            let mut xq = vec![0i8; tokens * cols];
            let mut xd = vec![0f32; tokens * nb];
            let mut xsum = vec![0f32; tokens * groups];
            if cols > 0 {
                // A prompt's activations are quantized by the team, a token per task (on the
                // calling thread when the call is small or already inside a parallel step).
                let mut rows: Vec<BlockRow> = x
                    .chunks_exact(cols)
                    .zip(xq.chunks_exact_mut(cols))
                    .zip(xd.chunks_exact_mut(nb))
                    .zip(xsum.chunks_exact_mut(groups))
                    .map(|(((x, q), d), s)| BlockRow { x, q, d, s })
                    .collect();
                let each = |r: &mut BlockRow| {
                    igemm::quantize_blocks(r.x, r.q, r.d);
                    for (s, g) in r.s.iter_mut().zip(r.x.chunks_exact(gs)) {
                        *s = sum_f32(g);
                    }
                };
                if tokens * cols >= PARALLEL_PREP_VALUES {
                    crate::team::chunks_mut(&mut rows, 1, |_, r| each(&mut r[0]));
                } else {
                    rows.iter_mut().for_each(each);
                }
            }
            Prep {
                xsum,
                xq,
                ldxq: cols,
                xd,
                ..Prep::default()
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Thread-local scratch
// ---------------------------------------------------------------------------------------------

/// Reusable per-thread buffers (grown on demand, never shrunk).
#[derive(Default)]
pub(crate) struct Scratch {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub c: Vec<f32>,
    pub d: Vec<f32>,
    /// The integer prefill's packed panel.
    pub codes: Vec<u8>,
}

/// `v` grown to at least `n` elements, as a slice of exactly `n`.
pub(crate) fn grow(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    if v.len() < n {
        v.resize(n, 0.0);
    }
    &mut v[..n]
}

fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    thread_local! {
        static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    }
    let mut f = Some(f);
    let r = SCRATCH.with(|s| {
        s.try_borrow_mut()
            .ok()
            .map(|mut s| (f.take().unwrap())(&mut s))
    });
    match r {
        Some(r) => r,
        // Re-entered (cannot happen with the code here, but stay correct): use fresh buffers.
        None => (f.take().unwrap())(&mut Scratch::default()),
    }
}

// ---------------------------------------------------------------------------------------------
// Jobs, tasks and the parallel driver
// ---------------------------------------------------------------------------------------------

/// A job as the worker threads see it.
pub(crate) struct Ctx<'a> {
    pub w: MatRef<'a>,
    pub kind: Kind,
    pub x: &'a [f32],
    pub tokens: usize,
    /// Permuted activations (4-bit decode): `tokens` rows of `ldxp`.
    pub xp: &'a [f32],
    pub ldxp: usize,
    /// Per-group sums of `x` (affine decode): `tokens` rows of `cols / group_size`.
    pub xsum: &'a [f32],
    /// 8-bit activations and their scales (integer 4-bit products; empty otherwise), as in
    /// [`Prep`].
    pub xq: &'a [i8],
    pub ldxq: usize,
    pub xd: &'a [f32],
    path: Path,
    out: *mut f32,
    out_len: usize,
}

// SAFETY: `Ctx` is shared between rayon workers only inside `matmul_batch_at`, whose tasks
// write disjoint sets of rows of `out` (each row index belongs to exactly one task), and the
// `&mut [f32]` that `out` comes from is borrowed for the whole parallel section.
unsafe impl Sync for Ctx<'_> {}

impl<'a> Ctx<'a> {
    /// The product `x w^T` into `out` (a pointer and a length: a slice the caller holds
    /// borrowed mutably while tasks run), before its activations are prepared.
    fn new(
        level: Level,
        kernels: Kernels,
        w: MatRef<'a>,
        x: &'a [f32],
        tokens: usize,
        (out, out_len): (*mut f32, usize),
    ) -> Ctx<'a> {
        let kind = Kind::of(w.format);
        Ctx {
            w,
            kind,
            x,
            tokens,
            xp: &[],
            ldxp: 0,
            xsum: &[],
            xq: &[],
            ldxq: 0,
            xd: &[],
            path: path(level, kernels, kind, tokens),
            out,
            out_len,
        }
    }

    /// Writes `res` (`tokens` rows of `r1 - r0` results) to rows `r0..r1` of `out`.
    fn store(&self, r0: usize, r1: usize, res: &[f32]) {
        let n = r1 - r0;
        let rows = self.w.rows;
        assert!(r0 <= r1 && r1 <= rows && res.len() == n * self.tokens);
        assert_eq!(self.out_len, rows * self.tokens);
        for t in 0..self.tokens {
            // SAFETY: `t * rows + r1 <= out_len` (checked above), so the range is inside the
            // `out` slice; rows `r0..r1` belong to this task alone (see `Sync` above), so no
            // other thread touches these elements while the slice lives.
            let dst = unsafe { std::slice::from_raw_parts_mut(self.out.add(t * rows + r0), n) };
            dst.copy_from_slice(&res[t * n..(t + 1) * n]);
        }
    }

    /// Tokens `t0..t0 + nt` of a decode job, for the kernels (results go through `res`
    /// buffers, never through [`Ctx::store`] of the view).
    fn tokens_view(&self, t0: usize, nt: usize) -> Ctx<'a> {
        let cols = self.w.cols;
        let groups = self.xsum.len() / self.tokens.max(1);
        Ctx {
            w: self.w,
            kind: self.kind,
            x: &self.x[t0 * cols..(t0 + nt) * cols],
            tokens: nt,
            xp: &self.xp[(t0 * self.ldxp).min(self.xp.len())..],
            ldxp: self.ldxp,
            xsum: &self.xsum[t0 * groups..(t0 + nt) * groups],
            xq: &self.xq[(t0 * self.ldxq).min(self.xq.len())..],
            ldxq: self.ldxq,
            xd: &self.xd[(t0 * self.ldxq / 8).min(self.xd.len())..],
            path: Path::Decode,
            out: std::ptr::null_mut(),
            out_len: 0,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Task {
    job: usize,
    r0: usize,
    r1: usize,
}

/// Cuts the rows of all jobs into tasks, handed out in order: each about a `2 * threads`-th of
/// the work not yet cut (guided scheduling), so that the first tasks are large and the last
/// ones small, and the threads finish a step together.
fn plan(ctxs: &[Ctx], threads: usize) -> (Vec<Task>, usize) {
    // Work of one row, in "weight byte equivalents": decode streams the row's bytes; prefill
    // spends about one byte's time on every two multiply-adds.
    let row_cost = |c: &Ctx| {
        let bytes = c.w.row_bytes() + 2 * c.w.format.scale_row_bytes(c.w.cols);
        match c.path {
            Path::Gemm => bytes + c.tokens * c.w.cols / 2,
            Path::IntGemm => bytes + c.tokens * c.w.cols / 8,
            Path::Decode => bytes * c.tokens.max(1).div_ceil(2),
        }
        .max(1)
    };
    let total: usize = ctxs.iter().map(|c| c.w.rows * row_cost(c)).sum();
    let mut tasks = Vec::new();
    let mut remaining = total;
    for (job, c) in ctxs.iter().enumerate() {
        let rows = c.w.rows;
        if rows == 0 || c.tokens == 0 {
            continue;
        }
        let (unit, min) = match c.path {
            Path::Gemm => (GEMM_ROW_UNIT, MIN_TASK_COST),
            Path::IntGemm => (16, MIN_TASK_COST),
            Path::Decode => (4, MIN_DECODE_TASK_COST),
        };
        let mut r0 = 0;
        while r0 < rows {
            let target = (remaining / (2 * threads).max(1)).max(min);
            let per = target.div_ceil(row_cost(c)).div_ceil(unit) * unit;
            let r1 = (r0 + per).min(rows);
            tasks.push(Task { job, r0, r1 });
            remaining = remaining.saturating_sub((r1 - r0) * row_cost(c));
            r0 = r1;
        }
    }
    (tasks, total)
}

/// [`matmul_batch`] at a given SIMD level (tests use this to cover every level).
pub(crate) fn matmul_batch_at(level: Level, kernels: Kernels, jobs: &mut [MatmulJob<'_>]) {
    assert!(
        supported(level),
        "SIMD level {} not supported",
        level.name()
    );
    for job in jobs.iter() {
        check_matrix(&job.w);
        assert_eq!(
            job.x.len(),
            job.tokens * job.w.cols,
            "matmul: x has wrong length"
        );
        assert_eq!(
            job.out.len(),
            job.tokens * job.w.rows,
            "matmul: out has wrong length"
        );
    }
    let ctxs: Vec<Ctx> = jobs
        .iter_mut()
        .map(|job| {
            let out = (job.out.as_mut_ptr(), job.out.len());
            Ctx::new(level, kernels, job.w, job.x, job.tokens, out)
        })
        .collect();
    let inputs = Inputs::of(level, kernels, &ctxs);
    let prep = |i: usize| inputs.prepare(i, &ctxs);
    let preps: Vec<OnceLock<Prep>> = inputs.kinds.iter().map(|_| OnceLock::new()).collect();
    let values: usize = inputs.first.iter().map(|&j| ctxs[j].x.len()).sum();
    if values >= PARALLEL_PREP_VALUES {
        // A prompt: prepared before the products, an input per task when there are many (an
        // MoE's experts; a single input's tokens are spread inside `prepare`).
        let _span = crate::profile::span("matmul: preparing activations");
        let mut done: Vec<Prep> = preps.iter().map(|_| Prep::default()).collect();
        if done.len() > 1 {
            crate::team::chunks_mut(&mut done, 1, |i, p| p[0] = prep(i));
        } else {
            done[0] = prep(0);
        }
        for (cell, p) in preps.iter().zip(done) {
            let _ = cell.set(p);
        }
    }
    // Otherwise (decoding) the first task that needs an input prepares it: the experts' inputs
    // are then prepared in parallel, while other tasks already stream weights.
    let threads = crate::team::thread_count();
    let (tasks, total) = plan(&ctxs, threads);
    let profiling = crate::profile::enabled().then(std::time::Instant::now);
    let task_nanos = std::sync::atomic::AtomicU64::new(0);
    let run = |t: &Task| {
        let start = profiling.map(|_| std::time::Instant::now());
        let i = inputs.of[t.job];
        let p = preps[i].get_or_init(|| prep(i));
        run_prepared(level, &ctxs[t.job], p, t.r0, t.r1);
        if let Some(start) = start {
            let nanos = start.elapsed().as_nanos() as u64;
            task_nanos.fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
        }
    };
    let serial = threads <= 1 || tasks.len() <= 1 || total < SERIAL_COST;
    if serial {
        tasks.iter().for_each(run);
    } else {
        crate::team::for_each(tasks.len(), &|i| run(&tasks[i]));
    }
    if let Some(start) = profiling {
        record_products(&ctxs, serial, start, &task_nanos);
    }
}

/// The distinct inputs of a call's products: one per (x, tokens, preparation), so that jobs
/// sharing an input (gate and up; a decoded token's experts) prepare it once.
struct Inputs {
    /// Per input: its preparation and the first product that reads it.
    kinds: Vec<PrepKind>,
    first: Vec<usize>,
    /// Per product: its input.
    of: Vec<usize>,
}

impl Inputs {
    fn of(level: Level, kernels: Kernels, ctxs: &[Ctx]) -> Inputs {
        let mut keys: Vec<(usize, usize, usize, PrepKind)> = Vec::new();
        let (mut kinds, mut first, mut of) = (Vec::new(), Vec::new(), Vec::new());
        for (j, c) in ctxs.iter().enumerate() {
            let pk = prep_kind(level, kernels, c.kind, c.tokens);
            let key = (c.x.as_ptr() as usize, c.x.len(), c.tokens, pk);
            of.push(match keys.iter().position(|k| *k == key) {
                Some(i) => i,
                None => {
                    keys.push(key);
                    kinds.push(pk);
                    first.push(j);
                    keys.len() - 1
                }
            });
        }
        Inputs { kinds, first, of }
    }

    /// Input `i` prepared.
    fn prepare(&self, i: usize, ctxs: &[Ctx]) -> Prep {
        let c = &ctxs[self.first[i]];
        prepare(self.kinds[i], c.x, c.tokens, c.w.cols)
    }
}

/// Rows `r0..r1` of the product `c` with its activations prepared as `p`.
fn run_prepared(level: Level, c: &Ctx, p: &Prep, r0: usize, r1: usize) {
    let c = Ctx {
        xp: &p.xp,
        ldxp: p.ldxp,
        xsum: &p.xsum,
        xq: &p.xq,
        ldxq: p.ldxq,
        xd: &p.xd,
        ..*c
    };
    with_scratch(|s| run_task(level, &c, r0, r1, s));
}

/// The profile's record of one call's products: wall time since `start` with their weight
/// bytes, and the threads' time inside their tasks.
fn record_products(
    ctxs: &[Ctx],
    serial: bool,
    start: std::time::Instant,
    task_nanos: &std::sync::atomic::AtomicU64,
) {
    let bytes: usize = ctxs
        .iter()
        .map(|c| {
            let (f, cols) = (c.w.format, c.w.cols);
            c.w.rows * (c.w.row_bytes() + f.scale_row_bytes(cols) + f.bias_row_bytes(cols))
        })
        .sum();
    let (name, tasks_name) = if serial {
        ("matmul: products on one thread", "matmul: their tasks")
    } else {
        (
            "matmul: products on the team",
            "matmul: their tasks (thread time)",
        )
    };
    crate::profile::record(name, start.elapsed().as_nanos() as u64, bytes as u64);
    let busy = task_nanos.load(std::sync::atomic::Ordering::Relaxed);
    crate::profile::record(tasks_name, busy, 0);
}

fn run_task(level: Level, c: &Ctx, r0: usize, r1: usize, s: &mut Scratch) {
    match c.path {
        Path::Gemm => return gemm_rows(level, c, r0, r1, s),
        Path::IntGemm => return igemm::rows(level, c, r0, r1, s),
        Path::Decode => {}
    }
    let mut res = std::mem::take(&mut s.d);
    let n = r1 - r0;
    let out = grow(&mut res, n * c.tokens);
    if c.tokens <= DECODE_MAX_TOKENS || !matches!(level, Level::Avx2 | Level::Avx512) {
        decode_rows(level, c, r0, r1, out, s);
    } else {
        // Passes of up to `DECODE_MAX_TOKENS` tokens over blocks of rows small enough to stay
        // in cache between passes.
        const RB: usize = 32;
        let mut tmp = [0f32; RB * DECODE_MAX_TOKENS];
        let mut rb = r0;
        while rb < r1 {
            let nb = RB.min(r1 - rb);
            let mut t0 = 0;
            while t0 < c.tokens {
                let nt = DECODE_MAX_TOKENS.min(c.tokens - t0);
                let view = c.tokens_view(t0, nt);
                decode_rows(level, &view, rb, rb + nb, &mut tmp[..nt * nb], s);
                for t in 0..nt {
                    let dst = (t0 + t) * n + rb - r0;
                    out[dst..dst + nb].copy_from_slice(&tmp[t * nb..(t + 1) * nb]);
                }
                t0 += nt;
            }
            rb += nb;
        }
    }
    c.store(r0, r1, out);
    s.d = res;
}

/// Mat-vec over rows `r0..r1` for all (at most `DECODE_MAX_TOKENS`) tokens; `res` is `tokens`
/// rows of `r1 - r0`.
fn decode_rows(level: Level, c: &Ctx, r0: usize, r1: usize, res: &mut [f32], s: &mut Scratch) {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => {
            // SAFETY: `matmul_batch_at` asserted that the CPU supports this level, and the job's
            // shapes were validated there.
            unsafe { avx512::decode_rows(c, r0, r1, res, s) }
        }
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => {
            // SAFETY: as above.
            unsafe { avx2::decode_rows(c, r0, r1, res, s) }
        }
        #[cfg(target_arch = "aarch64")]
        Level::Neon => neon::decode_rows(c, r0, r1, res, s),
        _ => portable::decode_rows(c, r0, r1, res, s),
    }
}

/// The packed micro-kernel path of one SIMD level.
pub(crate) trait Gemm {
    /// Rows per packed panel.
    const NR: usize;
    /// Tokens per micro-kernel call.
    const MR: usize;
    /// Packs rows `rb..rb + nv` (`nv <= NR`; the others repeat row `rb + nv - 1`), columns
    /// `k0..k0 + kc`, of `c.w` into `dst` (`kc * NR`, element `[p * NR + i]` is row `rb + i`,
    /// column `k0 + p`).
    fn pack(c: &Ctx, rb: usize, nv: usize, k0: usize, kc: usize, dst: &mut [f32], tmp: &mut [f32]);
    /// `C[i][j] (+)= sum_p A[i][p] * B[p][j]` for `i < m <= MR`, `j < NR`: `A` is `m` rows of
    /// `lda` (`kc` used), `B` a packed panel of `kc * NR`, `C` `m` rows of `ldc` (`NR` used).
    /// With `first` C is overwritten, else accumulated into.
    #[allow(clippy::too_many_arguments)]
    fn kernel(
        m: usize,
        kc: usize,
        a: &[f32],
        lda: usize,
        b: &[f32],
        c: &mut [f32],
        ldc: usize,
        first: bool,
    );
}

fn gemm_rows(level: Level, c: &Ctx, r0: usize, r1: usize, s: &mut Scratch) {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => gemm_driver::<avx512::Avx512Gemm>(c, r0, r1, s),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => gemm_driver::<avx2::Avx2Gemm>(c, r0, r1, s),
        _ => gemm_driver::<portable::PortableGemm>(c, r0, r1, s),
    }
}

/// Prefill over rows `r0..r1`: blocks of up to `NCB` rows are packed `KC` columns at a time and
/// multiplied against all tokens, accumulating in a thread-local `[tokens, NCB]` tile.
fn gemm_driver<G: Gemm>(c: &Ctx, r0: usize, r1: usize, s: &mut Scratch) {
    let (tokens, k) = (c.tokens, c.w.cols);
    let ncb = NCB.max(G::NR);
    let bp = grow(&mut s.a, ncb.div_ceil(G::NR) * G::NR * KC);
    let tmp = grow(&mut s.b, KC + 64);
    let cb = grow(&mut s.c, tokens * ncb);
    let mut rb0 = r0;
    while rb0 < r1 {
        let nb = ncb.min(r1 - rb0);
        let npanels = nb.div_ceil(G::NR);
        let ldc = npanels * G::NR;
        if k == 0 {
            // No columns: the products are empty sums.
            cb[..tokens * ldc].fill(0.0);
        }
        let mut k0 = 0;
        while k0 < k {
            let kc = KC.min(k - k0);
            for p in 0..npanels {
                let nv = G::NR.min(nb - p * G::NR);
                let dst = &mut bp[p * kc * G::NR..(p + 1) * kc * G::NR];
                G::pack(c, rb0 + p * G::NR, nv, k0, kc, dst, tmp);
            }
            let mut t0 = 0;
            while t0 < tokens {
                let m = G::MR.min(tokens - t0);
                let a = &c.x[t0 * k + k0..];
                for p in 0..npanels {
                    G::kernel(
                        m,
                        kc,
                        a,
                        k,
                        &bp[p * kc * G::NR..(p + 1) * kc * G::NR],
                        &mut cb[t0 * ldc + p * G::NR..],
                        ldc,
                        k0 == 0,
                    );
                }
                t0 += m;
            }
            k0 += kc;
        }
        // Copy the valid columns of the tile out.
        let res = &mut s.d;
        let out = grow(res, tokens * nb);
        for t in 0..tokens {
            out[t * nb..(t + 1) * nb].copy_from_slice(&cb[t * ldc..t * ldc + nb]);
        }
        c.store(rb0, rb0 + nb, out);
        rb0 += nb;
    }
}
