//! Plain reference implementations of the backend operations on host memory: written for
//! clarity, accumulating in f64. They define what each [`crate::Backend`] operation computes;
//! the conformance suite ([`crate::conformance`]) holds every backend to them, and the default
//! (host fallback) implementations of the family-specific operations use them.
//!
//! Activations are f32 `[rows, cols]`, row-major, as in the trait.

use crate::weight::{e8m0_to_f32, FP4_E2M1, MXFP4_GROUP};
use crate::{Activation, DeltaNetDims, Dtype, FfnWeights, HostRouting, MatRef, WeightFormat};

/// Element `i` of a little-endian array of `dt`.
pub fn load(dt: Dtype, bytes: &[u8], i: usize) -> f32 {
    let b = |n: usize| &bytes[i * n..(i + 1) * n];
    match dt {
        Dtype::F32 => f32::from_le_bytes(b(4).try_into().expect("4 bytes")),
        Dtype::F16 => half::f16::from_le_bytes(b(2).try_into().expect("2 bytes")).to_f32(),
        Dtype::Bf16 => half::bf16::from_le_bytes(b(2).try_into().expect("2 bytes")).to_f32(),
    }
}

/// Row `r` of `w` as f32 (affine: `scale * q + bias` per group, in f32 as MLX computes it).
pub fn dequantize_row(w: &MatRef, r: usize) -> Vec<f32> {
    match w.format {
        WeightFormat::Dense(dt) => (0..w.cols)
            .map(|c| load(dt, w.data, r * w.cols + c))
            .collect(),
        WeightFormat::Affine {
            bits,
            group_size,
            scale_dtype,
        } => {
            let row = &w.data[r * w.row_bytes()..(r + 1) * w.row_bytes()];
            let groups = w.cols / group_size;
            (0..w.cols)
                .map(|c| {
                    let bit = c * bits as usize;
                    let word = u32::from_le_bytes(row[bit / 32 * 4..][..4].try_into().unwrap());
                    // A value may straddle two words (3, 5, 6 bits).
                    let mut q = (word as u64) >> (bit % 32);
                    if bit % 32 + bits as usize > 32 {
                        let next =
                            u32::from_le_bytes(row[bit / 32 * 4 + 4..][..4].try_into().unwrap());
                        q |= (next as u64) << (32 - bit % 32);
                    }
                    let q = (q & ((1u64 << bits) - 1)) as f32;
                    let g = r * groups + c / group_size;
                    load(scale_dtype, w.scales, g) * q + load(scale_dtype, w.biases, g)
                })
                .collect()
        }
        WeightFormat::Mxfp4 => {
            let row = &w.data[r * w.row_bytes()..(r + 1) * w.row_bytes()];
            let groups = w.cols / MXFP4_GROUP;
            (0..w.cols)
                .map(|c| {
                    let q = (row[c / 2] >> (4 * (c % 2))) & 15;
                    let e = w.scales[r * groups + c / MXFP4_GROUP];
                    FP4_E2M1[q as usize] * e8m0_to_f32(e)
                })
                .collect()
        }
    }
}

/// `x W^T`: `x` is `[rows, w.cols]`, the result `[rows, w.rows]`.
pub fn matmul(x: &[f32], rows: usize, w: &MatRef) -> Vec<f32> {
    assert_eq!(x.len(), rows * w.cols);
    let mut out = vec![0.0; rows * w.rows];
    for o in 0..w.rows {
        let wr = dequantize_row(w, o);
        for t in 0..rows {
            let xr = &x[t * w.cols..(t + 1) * w.cols];
            let acc: f64 = xr.iter().zip(&wr).map(|(&a, &b)| a as f64 * b as f64).sum();
            out[t * w.rows + o] = acc as f32;
        }
    }
    out
}

/// RMS normalisation of every chunk of `weight.len()` values, scaled by `weight`.
/// Index of the largest value, the lowest index among equals; NaN never wins (all NaN: 0).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NAN;
    for (i, &v) in row.iter().enumerate() {
        if !v.is_nan() && (best_v.is_nan() || v > best_v) {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

/// The `n` best columns of `row` (larger values first, the lower column among equals, NaN after
/// every number) with their values, and the values at `cols` (NaN for a column past the end).
pub fn top_logits(row: &[f32], n: usize, cols: &[u32]) -> crate::TopLogits {
    use std::cmp::Ordering;
    use std::collections::BinaryHeap;
    /// Ordered worst first (the top of a max-heap is the one to drop).
    struct Worst(u32, f32);
    impl Worst {
        fn rank(&self, other: &Self) -> Ordering {
            // Less = better: numbers before NaN, larger values first, lower columns first.
            match (self.1.is_nan(), other.1.is_nan()) {
                (false, false) => other.1.total_cmp(&self.1).then(self.0.cmp(&other.0)),
                (a, b) => a.cmp(&b).then(self.0.cmp(&other.0)),
            }
        }
    }
    impl PartialEq for Worst {
        fn eq(&self, other: &Self) -> bool {
            self.rank(other) == Ordering::Equal
        }
    }
    impl Eq for Worst {}
    impl PartialOrd for Worst {
        fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
            Some(self.cmp(other))
        }
    }
    impl Ord for Worst {
        fn cmp(&self, other: &Self) -> Ordering {
            self.rank(other)
        }
    }
    // One pass with a bounded heap: cheap for the few columns a sampler asks for.
    let n = n.min(row.len());
    let mut heap = BinaryHeap::with_capacity(n + 1);
    for (i, &v) in row.iter().enumerate() {
        let e = Worst(i as u32, v);
        if heap.len() < n {
            heap.push(e);
        } else if let Some(mut worst) = heap.peek_mut() {
            if e < *worst {
                *worst = e;
            }
        }
    }
    let top = heap
        .into_sorted_vec()
        .into_iter()
        .map(|w| (w.0, w.1))
        .collect();
    crate::TopLogits {
        top,
        at: cols
            .iter()
            .map(|&c| row.get(c as usize).copied().unwrap_or(f32::NAN))
            .collect(),
    }
}

pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let n = weight.len();
    assert!(x.len().is_multiple_of(n));
    x.chunks(n)
        .flat_map(|v| {
            let ms = v.iter().map(|&a| a as f64 * a as f64).sum::<f64>() / n as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            v.iter()
                .zip(weight)
                .map(move |(&a, &w)| (a as f64 * inv * w as f64) as f32)
        })
        .collect()
}

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `silu(gate) * up`.
pub fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len());
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| (silu(g as f64) * u as f64) as f32)
        .collect()
}

/// [`crate::Rope`] of every head; row `r` is at position `first_position + r`. Frequencies and
/// angles in f32, as MLX and transformers compute them (the angle's rounding shows at long
/// positions).
pub fn rope(x: &mut [f32], cols: usize, rope: crate::Rope, first_position: usize) {
    let half = rope.rotary_dim / 2;
    let inv_freq = rope.inv_freq();
    for (r, row) in x.chunks_mut(cols).enumerate() {
        let pos = (first_position + r) as f32;
        for head in row.chunks_mut(rope.head_dim) {
            for (i, &freq) in inv_freq.iter().enumerate() {
                let (sin, cos) = ((pos * freq) as f64).sin_cos();
                let (a, b) = (head[i] as f64, head[i + half] as f64);
                head[i] = (a * cos - b * sin) as f32;
                head[i + half] = (b * cos + a * sin) as f32;
            }
        }
    }
}

/// Causal grouped-query attention: `q` `[rows, heads * head_dim]` at positions
/// `past..past + rows` over `keys`/`values` `[past + rows, kv_heads * head_dim]`, each row seeing
/// the last `window` positions (`None`: all), with one sink logit per head joining its softmax.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let width = kv_heads * head_dim;
    let rows = q.len() / (heads * head_dim);
    let total = keys.len() / width;
    let past = total - rows;
    let group = heads / kv_heads;
    let mut out = vec![0.0; rows * heads * head_dim];
    for r in 0..rows {
        for h in 0..heads {
            let kv = h / group;
            let qv = &q[(r * heads + h) * head_dim..][..head_dim];
            let n = past + r + 1;
            let first = window.map_or(0, |w| n.saturating_sub(w.max(1)));
            let scores: Vec<f64> = (first..n)
                .map(|p| {
                    let k = &keys[p * width + kv * head_dim..][..head_dim];
                    qv.iter()
                        .zip(k)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let sink = sinks.map(|s| s[h] as f64);
            let max = scores
                .iter()
                .copied()
                .chain(sink)
                .fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
            for d in 0..head_dim {
                let acc: f64 = (first..n)
                    .map(|p| e[p - first] / sum * values[p * width + kv * head_dim + d] as f64)
                    .sum();
                out[(r * heads + h) * head_dim + d] = acc as f32;
            }
        }
    }
    out
}

/// `x * sigmoid(gate)`; a one-column `gate` scales whole rows.
pub fn sigmoid_mul(x: &mut [f32], cols: usize, gate: &[f32], gate_cols: usize) {
    for (r, row) in x.chunks_mut(cols).enumerate() {
        for (c, v) in row.iter_mut().enumerate() {
            let g = if gate_cols == 1 {
                gate[r]
            } else {
                gate[r * gate_cols + c]
            };
            *v = (*v as f64 * sigmoid(g as f64)) as f32;
        }
    }
}

/// Splits every chunk of `chunk` values after its first `first`: (all first parts, all rests).
pub fn split_chunks(x: &[f32], chunk: usize, first: usize) -> (Vec<f32>, Vec<f32>) {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for c in x.chunks(chunk) {
        a.extend_from_slice(&c[..first]);
        b.extend_from_slice(&c[first..]);
    }
    (a, b)
}

/// [`crate::Backend::join_chunks`]: chunks of `a` and `b` interleaved.
pub fn join_chunks(a: &[f32], a_chunk: usize, b: &[f32], b_chunk: usize) -> Vec<f32> {
    assert!(a_chunk > 0 && b_chunk > 0, "join_chunks: empty chunks");
    assert_eq!(
        a.len() / a_chunk,
        b.len() / b_chunk,
        "join_chunks: chunk counts differ"
    );
    a.chunks(a_chunk)
        .zip(b.chunks(b_chunk))
        .flat_map(|(x, y)| x.iter().chain(y).copied())
        .collect()
}

/// [`crate::Backend::matmul_heads`]: `x` `[rows, heads * w.cols]`, `w` `[heads * out, in]`.
pub fn matmul_heads(x: &[f32], rows: usize, w: &MatRef, heads: usize) -> Vec<f32> {
    assert!(
        heads > 0 && w.rows.is_multiple_of(heads),
        "matmul_heads: rows per head"
    );
    let (inp, out) = (w.cols, w.rows / heads);
    assert_eq!(x.len(), rows * heads * inp, "matmul_heads: input width");
    let mut y = vec![0.0; rows * heads * out];
    for h in 0..heads {
        let xh: Vec<f32> = (0..rows)
            .flat_map(|r| &x[(r * heads + h) * inp..(r * heads + h + 1) * inp])
            .copied()
            .collect();
        let yh = matmul(&xh, rows, &w.rows(h * out..(h + 1) * out));
        for r in 0..rows {
            y[(r * heads + h) * out..(r * heads + h + 1) * out]
                .copy_from_slice(&yh[r * out..(r + 1) * out]);
        }
    }
    y
}

/// Softmax over each row of router logits, top `k` (the lower index wins a tie), optionally
/// renormalised to sum to one.
pub fn route(logits: &[f32], experts: usize, k: usize, normalize: bool) -> HostRouting {
    let mut out = HostRouting {
        k,
        experts: Vec::new(),
        weights: Vec::new(),
    };
    for row in logits.chunks(experts) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s)) as f64;
        let e: Vec<f64> = row.iter().map(|&s| (s as f64 - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|&a, &b| e[b].total_cmp(&e[a]).then(a.cmp(&b)));
        let chosen = &order[..k];
        let total: f64 = chosen.iter().map(|&i| e[i] / sum).sum();
        for &i in chosen {
            out.experts.push(i as u32);
            let p = e[i] / sum;
            out.weights
                .push((if normalize { p / total } else { p }) as f32);
        }
    }
    out
}

/// [`crate::SigmoidRouting`] of each row of router logits with the selection `bias`: experts chosen
/// by `sigmoid + bias` within the best groups (a group scores the sum of its two best; groups
/// outside count as 0, as transformers and mlx-lm do), ties to the lower index, weighted by their
/// sigmoid.
pub fn route_sigmoid(
    logits: &[f32],
    bias: &[f32],
    k: usize,
    how: crate::SigmoidRouting,
) -> HostRouting {
    let experts = bias.len();
    let per_group = experts / how.groups;
    let mut out = HostRouting {
        k,
        experts: Vec::new(),
        weights: Vec::new(),
    };
    let by_value = |v: &[f64]| {
        let mut order: Vec<usize> = (0..v.len()).collect();
        order.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
        order
    };
    for row in logits.chunks(experts) {
        let sig: Vec<f64> = row.iter().map(|&s| sigmoid(s as f64)).collect();
        let mut choice: Vec<f64> = sig.iter().zip(bias).map(|(s, &b)| s + b as f64).collect();
        if how.groups > 1 {
            let group_scores: Vec<f64> = choice
                .chunks(per_group)
                .map(|g| by_value(g)[..2].iter().map(|&i| g[i]).sum())
                .collect();
            let kept = &by_value(&group_scores)[..how.top_groups];
            for (g, part) in choice.chunks_mut(per_group).enumerate() {
                if !kept.contains(&g) {
                    part.fill(0.0);
                }
            }
        }
        let chosen = &by_value(&choice)[..k];
        let total: f64 = chosen.iter().map(|&i| sig[i]).sum();
        for &i in chosen {
            let w = if how.normalize && k > 1 {
                sig[i] / total
            } else {
                sig[i]
            };
            out.experts.push(i as u32);
            out.weights.push((w * how.scale as f64) as f32);
        }
    }
    out
}

/// `activation(gate, up)` elementwise, in f64.
pub fn activate(activation: Activation, gate: &[f32], up: &[f32]) -> Vec<f32> {
    assert_eq!(gate.len(), up.len());
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| {
            let (g, u) = (g as f64, u as f64);
            (match activation {
                Activation::Silu => silu(g) * u,
                Activation::ClampedSwiglu { alpha, limit } => {
                    let (limit, alpha) = (limit as f64, alpha as f64);
                    let g = g.min(limit);
                    g * sigmoid(alpha * g) * (u.clamp(-limit, limit) + 1.0)
                }
            }) as f32
        })
        .collect()
}

/// `sum_j weight_j * ffn_{expert_j}(x)` per row, `experts[e]` the weights of expert `e`, with
/// `activation` and the optional per-expert `biases` (as [`crate::ExpertFfn`]).
pub fn moe(
    x: &[f32],
    rows: usize,
    routing: &HostRouting,
    experts: &[FfnWeights<MatRef>],
    activation: Activation,
    biases: Option<&FfnWeights<Vec<f32>>>,
) -> Vec<f32> {
    let cols = x.len() / rows.max(1);
    let mut out = vec![0.0f64; rows * cols];
    let add = |y: &mut [f32], bias: Option<&Vec<f32>>, e: usize| {
        if let Some(b) = bias {
            let n = y.len();
            y.iter_mut()
                .zip(&b[e * n..(e + 1) * n])
                .for_each(|(v, b)| *v += b);
        }
    };
    for r in 0..rows {
        let xr = &x[r * cols..(r + 1) * cols];
        for j in 0..routing.k {
            let id = routing.experts[r * routing.k + j] as usize;
            let e = &experts[id];
            let w = routing.weights[r * routing.k + j] as f64;
            let (mut g, mut u) = (matmul(xr, 1, &e.gate), matmul(xr, 1, &e.up));
            add(&mut g, biases.map(|b| &b.gate), id);
            add(&mut u, biases.map(|b| &b.up), id);
            let h = activate(activation, &g, &u);
            let mut y = matmul(&h, 1, &e.down);
            add(&mut y, biases.map(|b| &b.down), id);
            for (o, v) in out[r * cols..(r + 1) * cols].iter_mut().zip(y) {
                *o += w * v as f64;
            }
        }
    }
    out.into_iter().map(|v| v as f32).collect()
}

/// One Gated DeltaNet layer's memory in host memory: the last `conv_kernel - 1` inputs of the
/// convolution (`[conv_kernel - 1, conv_channels]`) and per value head a `[value_dim, key_dim]`
/// state matrix. Backends without their own DeltaNet kernels use it as their `LinearState`.
#[derive(Debug, Clone, PartialEq)]
pub struct HostLinearState {
    pub dims: DeltaNetDims,
    pub conv: Vec<f32>,
    pub recurrent: Vec<f32>,
}

impl HostLinearState {
    /// The zero state.
    pub fn new(dims: &DeltaNetDims) -> Self {
        HostLinearState {
            dims: *dims,
            conv: vec![0.0; dims.conv_kernel.saturating_sub(1) * dims.conv_channels()],
            recurrent: vec![0.0; dims.value_heads * dims.value_dim * dims.key_dim],
        }
    }
}

/// Depthwise causal convolution over time (taps oldest first, `weight` `[channels, kernel]`),
/// then SiLU; the window continues from and is saved to `state`.
pub fn causal_conv1d_silu(x: &[f32], weight: &[f32], state: &mut HostLinearState) -> Vec<f32> {
    let (c, k) = (state.dims.conv_channels(), state.dims.conv_kernel);
    let mut input = state.conv.clone();
    input.extend_from_slice(x);
    let rows = x.len() / c;
    let mut out = vec![0.0; rows * c];
    for t in 0..rows {
        for ch in 0..c {
            let acc: f64 = (0..k)
                .map(|j| weight[ch * k + j] as f64 * input[(t + j) * c + ch] as f64)
                .sum();
            out[t * c + ch] = silu(acc) as f32;
        }
    }
    state.conv = input[input.len() - (k - 1) * c..].to_vec();
    out
}

fn softplus(x: f64) -> f64 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The gated delta rule (see [`crate::Backend::gated_delta_rule`]).
pub fn gated_delta_rule(
    qkv: &[f32],
    a: &[f32],
    b: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    state: &mut HostLinearState,
) -> Vec<f32> {
    let d = state.dims;
    let (hk, hv, dk, dv) = (d.key_heads, d.value_heads, d.key_dim, d.value_dim);
    let width = d.conv_channels();
    let rows = qkv.len() / width;
    let mut out = vec![0.0; rows * hv * dv];
    let l2 = |v: &[f32], scale: f64| -> Vec<f64> {
        let inv = scale / (v.iter().map(|&x| x as f64 * x as f64).sum::<f64>() + 1e-6).sqrt();
        v.iter().map(|&x| x as f64 * inv).collect()
    };
    let mut s: Vec<f64> = state.recurrent.iter().map(|&v| v as f64).collect();
    for t in 0..rows {
        let row = &qkv[t * width..(t + 1) * width];
        for h in 0..hv {
            let kh = d.key_head(h);
            let q = l2(&row[kh * dk..][..dk], 1.0 / (dk as f64).sqrt());
            let k = l2(&row[hk * dk + kh * dk..][..dk], 1.0);
            let v = &row[2 * hk * dk + h * dv..][..dv];
            let g = (-(a_log[h] as f64).exp() * softplus(a[t * hv + h] as f64 + dt_bias[h] as f64))
                .exp();
            let beta = sigmoid(b[t * hv + h] as f64);
            let sh = &mut s[h * dv * dk..(h + 1) * dv * dk];
            for i in 0..dv {
                let si = &mut sh[i * dk..(i + 1) * dk];
                si.iter_mut().for_each(|x| *x *= g);
                let kv: f64 = si.iter().zip(&k).map(|(x, y)| x * y).sum();
                let delta = (v[i] as f64 - kv) * beta;
                si.iter_mut().zip(&k).for_each(|(x, y)| *x += delta * y);
                out[t * hv * dv + h * dv + i] =
                    si.iter().zip(&q).map(|(x, y)| x * y).sum::<f64>() as f32;
            }
        }
    }
    state.recurrent = s.into_iter().map(|v| v as f32).collect();
    out
}

/// `silu(z) * rms_norm(x) * weight`, per chunk of `weight.len()` values.
pub fn rms_norm_gated(x: &[f32], z: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    rms_norm(x, weight, eps)
        .into_iter()
        .zip(z)
        .map(|(v, &g)| (v as f64 * silu(g as f64)) as f32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ValueHeadOrder;

    /// Value heads in llama.cpp's tiled order, with every per-value-head input permuted the way
    /// its converter permutes them, give the grouped order's outputs permuted alike.
    #[test]
    fn tiled_value_heads_are_grouped_ones_permuted() {
        let (hk, hv, dk, dv) = (2, 6, 4, 3);
        let grouped = DeltaNetDims {
            key_heads: hk,
            value_heads: hv,
            key_dim: dk,
            value_dim: dv,
            conv_kernel: 4,
            value_order: ValueHeadOrder::Grouped,
        };
        let tiled = DeltaNetDims {
            value_order: ValueHeadOrder::Tiled,
            ..grouped
        };
        // Tiled head j * hk + i is grouped head i * (hv / hk) + j.
        let per_k = hv / hk;
        let perm: Vec<usize> = (0..hv).map(|n| (n % hk) * per_k + n / hk).collect();
        let mut seed = 7u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
        };
        let rows = 3;
        let width = grouped.conv_channels();
        let qkv: Vec<f32> = (0..rows * width).map(|_| next()).collect();
        let a: Vec<f32> = (0..rows * hv).map(|_| next()).collect();
        let b: Vec<f32> = (0..rows * hv).map(|_| next()).collect();
        let a_log: Vec<f32> = (0..hv).map(|_| next()).collect();
        let dt_bias: Vec<f32> = (0..hv).map(|_| next()).collect();
        let heads = |x: &[f32], n: usize, size: usize| -> Vec<f32> {
            (0..x.len() / (n * size))
                .flat_map(|t| {
                    perm.iter()
                        .flat_map(move |&h| (0..size).map(move |i| (t, h, i)))
                        .map(|(t, h, i)| x[(t * n + h) * size + i])
                        .collect::<Vec<_>>()
                })
                .collect()
        };
        let qk = 2 * hk * dk;
        let qkv_tiled: Vec<f32> = (0..rows)
            .flat_map(|t| {
                let row = &qkv[t * width..(t + 1) * width];
                let mut r = row[..qk].to_vec();
                r.extend(heads(&row[qk..], hv, dv));
                r
            })
            .collect();
        let mut sg = HostLinearState::new(&grouped);
        let mut st = HostLinearState::new(&tiled);
        let want = gated_delta_rule(&qkv, &a, &b, &a_log, &dt_bias, &mut sg);
        let got = gated_delta_rule(
            &qkv_tiled,
            &heads(&a, hv, 1),
            &heads(&b, hv, 1),
            &heads(&a_log, hv, 1),
            &heads(&dt_bias, hv, 1),
            &mut st,
        );
        assert_eq!(got, heads(&want, hv, dv));
        assert_eq!(st.recurrent, heads(&sg.recurrent, hv, dv * dk));
        // And the orders differ: grouped dims on the tiled inputs give something else.
        let mut sx = HostLinearState::new(&grouped);
        let other = gated_delta_rule(
            &qkv_tiled,
            &heads(&a, hv, 1),
            &heads(&b, hv, 1),
            &heads(&a_log, hv, 1),
            &heads(&dt_bias, hv, 1),
            &mut sx,
        );
        assert_ne!(other, got);
    }
}
