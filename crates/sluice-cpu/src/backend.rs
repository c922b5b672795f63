//! [`Backend`] on the host CPU, its parallel steps run by a team of spinning threads
//! ([`crate::team`]).

use sluice_backend::{
    Activation, AttentionSpec, Backend, BackendError, ExpertFfn, ExpertKey, FfnWeights, HostExpert,
    HostLinearState, HostMatrix, HostRouting, KvFormat, MemoryInfo, Rope, SigmoidRouting,
};

use std::borrow::Cow;
use std::sync::Mutex;

use crate::kernels::{self, Kernels, MatmulJob};
use crate::kv::{self, softmax_weights, CpuKvCache};
use crate::{profile, team};

/// f32 activations `[rows, cols]`, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuAct {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuAct {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        CpuAct {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

#[derive(Debug, Default, Clone, Copy)]
pub struct CpuBackend {
    kernels: Kernels,
}

impl CpuBackend {
    /// The exact kernels: equal to the reference implementations to ~1e-6.
    pub fn new() -> Self {
        CpuBackend::default()
    }

    /// A backend whose quantized products run with `kernels` (see [`Kernels`]).
    pub fn with_kernels(kernels: Kernels) -> Self {
        CpuBackend { kernels }
    }

    pub fn kernels(&self) -> Kernels {
        self.kernels
    }
}

impl Backend for CpuBackend {
    type Act = CpuAct;
    type Weight = HostMatrix;
    type Vector = Vec<f32>;
    type Experts = Vec<FfnWeights<HostMatrix>>;
    type StagedExpert = FfnWeights<HostMatrix>;
    type Routing = HostRouting;
    type KvCache = CpuKvCache;
    type LinearState = HostLinearState;

    fn describe(&self) -> String {
        let threads = rayon::current_num_threads();
        format!(
            "cpu ({}, {} kernels, {threads} thread{})",
            kernels::simd_level(),
            self.kernels.name(),
            if threads == 1 { "" } else { "s" }
        )
    }

    fn memory(&self) -> MemoryInfo {
        host_memory()
    }

    fn pass_scratch_bytes(&self, context: usize) -> u64 {
        kv::prompt_scratch_bytes(context)
    }

    fn decode_rows(&self) -> usize {
        kernels::max_decode_tokens()
    }

    fn synchronize(&self) -> Result<(), BackendError> {
        Ok(())
    }

    fn weight(&self, m: HostMatrix) -> Result<HostMatrix, BackendError> {
        m.as_ref().validate()?;
        Ok(m)
    }

    fn vector(&self, v: &[f32]) -> Result<Vec<f32>, BackendError> {
        Ok(v.to_vec())
    }

    fn vector_to_host(&self, v: &Vec<f32>) -> Result<Vec<f32>, BackendError> {
        Ok(v.clone())
    }

    fn experts(&self, experts: Vec<HostExpert>) -> Result<Self::Experts, BackendError> {
        for e in &experts {
            for m in [&e.gate, &e.up, &e.down] {
                m.as_ref().validate()?;
            }
        }
        Ok(experts)
    }

    fn stage_expert(
        &self,
        _key: ExpertKey,
        host: HostExpert,
    ) -> Result<FfnWeights<HostMatrix>, BackendError> {
        for m in [&host.gate, &host.up, &host.down] {
            m.as_ref().validate()?;
        }
        Ok(host)
    }

    fn kv_cache(
        &self,
        kv_heads: usize,
        head_dim: usize,
        _capacity: usize,
        format: KvFormat,
    ) -> Result<CpuKvCache, BackendError> {
        Ok(CpuKvCache::new(kv_heads, head_dim, format))
    }

    fn kv_formats(&self) -> &'static [KvFormat] {
        &KvFormat::ALL
    }

    fn kv_len(&self, cache: &CpuKvCache) -> usize {
        cache.len()
    }

    fn kv_truncate(&self, cache: &mut CpuKvCache, len: usize) {
        cache.truncate(len);
    }

    fn linear_state_to_host(&self, s: &HostLinearState) -> Result<HostLinearState, BackendError> {
        Ok(s.clone())
    }

    fn linear_state_from_host(&self, s: HostLinearState) -> Result<HostLinearState, BackendError> {
        Ok(s)
    }

    fn zeros(&self, rows: usize, cols: usize) -> CpuAct {
        CpuAct::zeros(rows, cols)
    }

    fn act_from_host(&self, data: &[f32], rows: usize, cols: usize) -> CpuAct {
        assert_eq!(data.len(), rows * cols);
        CpuAct {
            data: data.to_vec(),
            rows,
            cols,
        }
    }

    fn to_host(&self, a: &CpuAct) -> Result<Vec<f32>, BackendError> {
        Ok(a.data.clone())
    }

    fn shape(&self, a: &CpuAct) -> (usize, usize) {
        (a.rows, a.cols)
    }

    fn slice_rows(&self, a: &CpuAct, start: usize, len: usize) -> CpuAct {
        let _span = profile::span("slice_rows");
        CpuAct {
            data: a.data[start * a.cols..(start + len) * a.cols].to_vec(),
            rows: len,
            cols: a.cols,
        }
    }

    fn concat_rows(&self, parts: &[&CpuAct]) -> CpuAct {
        let _span = profile::span("concat_rows");
        let cols = parts.first().expect("concat_rows of no parts").cols;
        assert!(
            parts.iter().all(|p| p.cols == cols),
            "concat_rows: widths differ"
        );
        CpuAct {
            data: parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
            rows: parts.iter().map(|p| p.rows).sum(),
            cols,
        }
    }

    fn embed(&self, table: &HostMatrix, tokens: &[u32]) -> CpuAct {
        let _span = profile::span("embed");
        let w = table.as_ref();
        let mut out = CpuAct::zeros(tokens.len(), w.cols);
        let work = out.data.len();
        team::chunks_mut_sized(&mut out.data, w.cols, work, |i, row| {
            kernels::dequantize_row(&w, tokens[i] as usize, row)
        });
        out
    }

    fn matmul(&self, x: &CpuAct, w: &HostMatrix) -> CpuAct {
        let _span = profile::span("matmul");
        let w = w.as_ref();
        assert_eq!(x.cols, w.cols, "matmul: input width does not match weight");
        let mut out = CpuAct::zeros(x.rows, w.rows);
        kernels::matmul(self.kernels, &w, &x.data, x.rows, &mut out.data);
        out
    }

    fn matmuls<const N: usize>(&self, x: &CpuAct, weights: [&HostMatrix; N]) -> [CpuAct; N] {
        let _span = profile::span("matmuls");
        let mut outs = weights.map(|w| {
            assert_eq!(x.cols, w.cols, "matmuls: input width does not match weight");
            CpuAct::zeros(x.rows, w.rows)
        });
        // One parallel step for all of them (the activations are prepared once).
        let mut jobs: Vec<MatmulJob> = weights
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| MatmulJob {
                w: w.as_ref(),
                x: &x.data,
                tokens: x.rows,
                out: &mut out.data,
            })
            .collect();
        kernels::matmul_batch(self.kernels, &mut jobs);
        drop(jobs);
        outs
    }

    fn ffn(&self, x: &CpuAct, w: &FfnWeights<HostMatrix>) -> CpuAct {
        let _span = profile::span("ffn");
        if x.rows > kernels::max_decode_tokens() {
            // A prompt: products as separate steps, each input prepared up front.
            let [gate, up] = self.matmuls(x, [&w.gate, &w.up]);
            return self.matmul(&self.swiglu(&gate, &up), &w.down);
        }
        // Decoding (a shared expert, a dense layer): gate/up, SwiGLU and down in one parallel
        // step, as the routed experts run; the same bits as the three calls above.
        assert_eq!(
            x.cols, w.gate.cols,
            "ffn: input width does not match weight"
        );
        let (inter, rows) = (w.gate.rows, x.rows);
        let (mut h, mut u) = (vec![0.0; rows * inter], vec![0.0; rows * inter]);
        let mut out = CpuAct::zeros(rows, w.down.rows);
        let mut jobs = [kernels::FfnJob {
            gate: w.gate.as_ref(),
            up: w.up.as_ref(),
            down: w.down.as_ref(),
            x: &x.data,
            tokens: rows,
            h: &mut h,
            u: &mut u,
            out: &mut out.data,
        }];
        kernels::ffn_batch(self.kernels, &mut jobs, &|_, h, u| kernels::silu_mul(h, u));
        out
    }

    fn rms_norm(&self, x: &CpuAct, weight: &Vec<f32>, eps: f32) -> CpuAct {
        let _span = profile::span("rms_norm");
        let n = weight.len();
        assert!(
            x.cols.is_multiple_of(n),
            "rms_norm: width is not a multiple of the norm size"
        );
        // Written by the team into fresh (untouched) memory: a prompt's copy of `x` made on one
        // thread, page faults included, cost more than the norm itself.
        let mut out = CpuAct::zeros(x.rows, x.cols);
        let work = 2 * out.data.len();
        team::chunks_mut_sized(&mut out.data, n, work, |i, o| {
            let v = &x.data[i * n..(i + 1) * n];
            let ms = kernels::dot(v, v) / n as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, a), w) in o.iter_mut().zip(v).zip(weight) {
                *o = *a * inv * w;
            }
        });
        out
    }

    fn add_assign(&self, x: &mut CpuAct, y: &CpuAct) {
        let _span = profile::span("add_assign");
        assert_eq!((x.rows, x.cols), (y.rows, y.cols));
        let work = 2 * x.data.len();
        team::chunks_mut_sized(&mut x.data, ELEMENTWISE_CHUNK, work, |i, a| {
            let b = &y.data[i * ELEMENTWISE_CHUNK..][..a.len()];
            a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        });
    }

    fn add_bias(&self, x: &mut CpuAct, bias: &Vec<f32>) {
        let _span = profile::span("add_bias");
        assert_eq!(x.cols, bias.len(), "one bias per column");
        for row in x.data.chunks_mut(x.cols) {
            row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
        }
    }

    fn swiglu(&self, gate: &CpuAct, up: &CpuAct) -> CpuAct {
        let _span = profile::span("swiglu");
        assert_eq!((gate.rows, gate.cols), (up.rows, up.cols));
        let mut out = gate.clone();
        kernels::silu_mul(&mut out.data, &up.data);
        out
    }

    fn rope(&self, x: &mut CpuAct, rope: Rope, first_position: usize) {
        let _span = profile::span("rope");
        let (head_dim, rotary_dim) = (rope.head_dim, rope.rotary_dim);
        assert!(
            rotary_dim <= head_dim
                && rotary_dim.is_multiple_of(2)
                && x.cols.is_multiple_of(head_dim)
        );
        let half = rotary_dim / 2;
        let inv_freq = rope.inv_freq();
        let (cols, work) = (x.cols, x.data.len());
        team::chunks_mut_sized(&mut x.data, cols, work, |r, row| {
            let pos = (first_position + r) as f32;
            let (sin, cos): (Vec<f32>, Vec<f32>) =
                inv_freq.iter().map(|f| (pos * f).sin_cos()).unzip();
            for head in row.chunks_mut(head_dim) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        });
    }

    fn attention(
        &self,
        q: &CpuAct,
        k: &CpuAct,
        v: &CpuAct,
        cache: &mut CpuKvCache,
        spec: AttentionSpec<'_, Vec<f32>>,
    ) -> CpuAct {
        let _span = profile::span("attention");
        let (heads, scale) = (spec.heads, spec.scale);
        let (hd, kvh) = (cache.head_dim, cache.kv_heads);
        if let Some(s) = spec.sinks {
            assert_eq!(s.len(), heads, "one attention sink per head");
        }
        assert_eq!(k.cols, kvh * hd);
        assert_eq!(v.cols, kvh * hd);
        assert_eq!(q.cols, heads * hd);
        assert!(heads.is_multiple_of(kvh));
        let first = cache.len();
        cache.append(&k.data, &v.data);
        if q.rows >= PROMPT_ROWS {
            return kv::prompt_attention(q, cache, first, spec);
        }
        let group = heads / kvh;
        let Some((keys, values)) = cache.as_f32() else {
            return kv::attention(q, cache, first, spec);
        };
        // Decoding a long context: the query heads sharing a kv head read its keys and values
        // from memory once between them, split over the threads, instead of once per head.
        if group > 1 && first + q.rows >= LONG_DECODE {
            return kv::attention(q, cache, first, spec);
        }
        let width = cache.width();
        let mut out = CpuAct::zeros(q.rows, q.cols);
        // One task per (row, head): each attends to positions 0..=first + row (keys and values
        // read for each head).
        let work = q.rows * heads * (first + q.rows) * 2 * hd;
        team::chunks_mut_sized(&mut out.data, hd, work, |i, o| {
            let (r, h) = (i / heads, i % heads);
            let kv = h / group;
            let qv = &q.data[r * q.cols + h * hd..][..hd];
            let start = spec.first_visible(first + r);
            let n = first + r + 1 - start;
            let (kr, vr) = (
                &keys[start * width + kv * hd..],
                &values[start * width + kv * hd..],
            );
            let mut scores = vec![0f32; n];
            kernels::scaled_dots(qv, kr, width, scale, &mut scores);
            softmax_weights(&mut scores, spec.sinks.map(|s| s[h]));
            kernels::weighted_rows(&scores, vr, width, o);
        });
        out
    }

    fn sigmoid_mul(&self, x: &mut CpuAct, gate: &CpuAct) {
        let _span = profile::span("sigmoid_mul");
        assert_eq!(x.rows, gate.rows);
        let work = 2 * x.data.len();
        if gate.cols == 1 {
            team::chunks_mut_sized(&mut x.data, x.cols.max(1), work, |r, row| {
                let s = sigmoid(gate.data[r]);
                row.iter_mut().for_each(|a| *a *= s);
            });
        } else {
            assert_eq!(x.cols, gate.cols);
            team::chunks_mut_sized(&mut x.data, ELEMENTWISE_CHUNK, work, |i, a| {
                let g = &gate.data[i * ELEMENTWISE_CHUNK..][..a.len()];
                a.iter_mut().zip(g).for_each(|(a, g)| *a *= sigmoid(*g));
            });
        }
    }

    fn join_chunks(&self, a: &CpuAct, a_chunk: usize, b: &CpuAct, b_chunk: usize) -> CpuAct {
        let _span = profile::span("join_chunks");
        assert_eq!(a.rows, b.rows, "join_chunks: row counts differ");
        let data = sluice_backend::reference::join_chunks(&a.data, a_chunk, &b.data, b_chunk);
        let cols = a.cols + b.cols;
        CpuAct {
            data,
            rows: a.rows,
            cols,
        }
    }

    fn matmul_heads(&self, x: &CpuAct, w: &HostMatrix, heads: usize) -> CpuAct {
        let _span = profile::span("matmul_heads");
        assert!(
            heads > 0 && w.rows.is_multiple_of(heads),
            "matmul_heads: rows per head"
        );
        let (inp, out) = (w.cols, w.rows / heads);
        assert_eq!(x.cols, heads * inp, "matmul_heads: input width");
        let w = w.as_ref();
        let mut y = CpuAct::zeros(x.rows, heads * out);
        let (mut xh, mut yh) = (vec![0.0; x.rows * inp], vec![0.0; x.rows * out]);
        for h in 0..heads {
            for r in 0..x.rows {
                let at = r * x.cols + h * inp;
                xh[r * inp..(r + 1) * inp].copy_from_slice(&x.data[at..at + inp]);
            }
            yh.fill(0.0);
            let wh = w.rows(h * out..(h + 1) * out);
            kernels::matmul(self.kernels, &wh, &xh, x.rows, &mut yh);
            for r in 0..x.rows {
                let at = r * y.cols + h * out;
                y.data[at..at + out].copy_from_slice(&yh[r * out..(r + 1) * out]);
            }
        }
        y
    }

    fn split_chunks(&self, x: &CpuAct, chunk: usize, first: usize) -> (CpuAct, CpuAct) {
        let _span = profile::span("split_chunks");
        assert!(first <= chunk && x.cols.is_multiple_of(chunk));
        let (n, rest) = (x.cols / chunk, chunk - first);
        let mut a = CpuAct::zeros(x.rows, n * first);
        let mut b = CpuAct::zeros(x.rows, n * rest);
        // Row by row on the team, each output written where it is first touched.
        let work = 2 * x.data.len();
        let split = |out: &mut CpuAct, from: usize, width: usize| {
            let cols = out.cols;
            team::chunks_mut_sized(&mut out.data, cols.max(1), work, |r, row| {
                let src = x.row(r).chunks(chunk);
                for (o, c) in row.chunks_mut(width.max(1)).zip(src) {
                    o.copy_from_slice(&c[from..from + width]);
                }
            });
        };
        split(&mut a, 0, first);
        split(&mut b, first, rest);
        (a, b)
    }

    fn causal_conv1d_silu(
        &self,
        x: &CpuAct,
        weight: &Vec<f32>,
        state: &mut HostLinearState,
    ) -> CpuAct {
        let _span = profile::span("causal_conv1d_silu");
        let (c, k) = (state.dims.conv_channels(), state.dims.conv_kernel);
        assert_eq!(x.cols, c);
        assert_eq!(weight.len(), c * k);
        assert_eq!(
            state.conv.len(),
            (k - 1) * c,
            "causal_conv1d_silu: window size"
        );
        // Row i of the window followed by the new inputs ([k - 1 + rows, c]), not copied
        // together: a prompt's copy on one thread cost more than the convolution.
        let window = &state.conv;
        let input_row = |i: usize| match i.checked_sub(k - 1) {
            None => &window[i * c..(i + 1) * c],
            Some(t) => x.row(t),
        };
        let mut out = CpuAct::zeros(x.rows, c);
        team::chunks_mut(&mut out.data, c, |t, row| {
            let rows: Vec<&[f32]> = (0..k).map(|j| input_row(t + j)).collect();
            for ((ch, o), taps) in row.iter_mut().enumerate().zip(weight.chunks_exact(k)) {
                let mut acc = 0.0;
                for (tap, input) in taps.iter().zip(&rows) {
                    acc += tap * input[ch];
                }
                *o = acc;
            }
            // SiLU over the row at once, vectorised: a scalar `exp` per channel cost ~45 us of
            // a Qwen3.5 decode step's 8192 channels on 2 cores.
            kernels::silu(row);
        });
        // The window becomes the last k - 1 inputs, in place: collecting a new ~100 KB vector
        // per layer and token, and freeing the old one (glibc consolidates its heap on frees
        // that large), cost ~100 us of the ~170 us a decode step took here on 2 cores.
        let from_x = x.rows.min(k - 1);
        let conv = &mut state.conv;
        conv.copy_within(from_x * c.., 0);
        let kept = conv.len() - from_x * c;
        conv[kept..].copy_from_slice(&x.data[(x.rows - from_x) * c..]);
        out
    }

    fn gated_delta_rule(
        &self,
        qkv: &CpuAct,
        a: &CpuAct,
        b: &CpuAct,
        a_log: &Vec<f32>,
        dt_bias: &Vec<f32>,
        state: &mut HostLinearState,
    ) -> CpuAct {
        let _span = profile::span("gated_delta_rule");
        let d = state.dims;
        let (hk, hv, dk, dv) = (d.key_heads, d.value_heads, d.key_dim, d.value_dim);
        assert_eq!(qkv.cols, d.conv_channels());
        assert_eq!((a.cols, b.cols), (hv, hv));
        let q_scale = 1.0 / (dk as f32).sqrt();
        let mut out = CpuAct::zeros(qkv.rows, hv * dv);
        // Heads are independent: each carries its own state through all rows.
        let ys: Vec<Mutex<Vec<f32>>> = (0..hv).map(|_| Mutex::new(Vec::new())).collect();
        team::chunks_mut(&mut state.recurrent, dv * dk, |h, s| {
            *ys[h].lock().unwrap_or_else(|p| p.into_inner()) = {
                let kh = d.key_head(h);
                let mut y = vec![0.0; qkv.rows * dv];
                let (mut q, mut k) = (vec![0.0; dk], vec![0.0; dk]);
                for t in 0..qkv.rows {
                    let row = qkv.row(t);
                    l2_normalize(&row[kh * dk..(kh + 1) * dk], q_scale, &mut q);
                    l2_normalize(&row[hk * dk + kh * dk..][..dk], 1.0, &mut k);
                    let v = &row[2 * hk * dk + h * dv..][..dv];
                    let g = (-a_log[h].exp() * softplus(a.row(t)[h] + dt_bias[h])).exp();
                    let beta = sigmoid(b.row(t)[h]);
                    let yt = &mut y[t * dv..(t + 1) * dv];
                    kernels::delta_rule_step(s, &k, &q, v, (g, beta), yt);
                }
                y
            };
        });
        for (h, y) in ys.iter().enumerate() {
            let y = y.lock().unwrap_or_else(|p| p.into_inner());
            for t in 0..qkv.rows {
                out.data[t * hv * dv + h * dv..][..dv].copy_from_slice(&y[t * dv..(t + 1) * dv]);
            }
        }
        out
    }

    fn rms_norm_gated(&self, x: &CpuAct, z: &CpuAct, weight: &Vec<f32>, eps: f32) -> CpuAct {
        let _span = profile::span("rms_norm_gated");
        assert_eq!((x.rows, x.cols), (z.rows, z.cols));
        let mut out = self.rms_norm(x, weight, eps);
        let work = 2 * out.data.len();
        team::chunks_mut_sized(&mut out.data, ELEMENTWISE_CHUNK, work, |i, o| {
            let z = &z.data[i * ELEMENTWISE_CHUNK..][..o.len()];
            kernels::mul_silu(o, z);
        });
        out
    }

    fn route_sigmoid(
        &self,
        logits: &CpuAct,
        bias: &Vec<f32>,
        k: usize,
        how: SigmoidRouting,
    ) -> HostRouting {
        let _span = profile::span("route_sigmoid");
        assert_eq!(logits.cols, bias.len(), "one bias per expert");
        assert!(k >= 1 && k <= bias.len());
        assert!(how.groups >= 1 && bias.len().is_multiple_of(how.groups));
        assert!(how.top_groups >= 1 && how.top_groups <= how.groups);
        // Once per token per layer over a few hundred experts: the reference is fast enough.
        sluice_backend::reference::route_sigmoid(&logits.data, bias, k, how)
    }

    fn route(&self, logits: &CpuAct, k: usize, normalize: bool) -> HostRouting {
        let _span = profile::span("route");
        let e = logits.cols;
        assert!(k >= 1 && k <= e);
        let mut experts = Vec::with_capacity(logits.rows * k);
        let mut weights = Vec::with_capacity(logits.rows * k);
        let mut order: Vec<u32> = Vec::with_capacity(e);
        for r in 0..logits.rows {
            let row = logits.row(r);
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
            let probs: Vec<f32> = row.iter().map(|s| (s - max).exp()).collect();
            let sum: f32 = probs.iter().sum();
            order.clear();
            order.extend(0..e as u32);
            // Highest probability first; the lower index wins a tie (a total order, so picking
            // the k first and sorting only them gives the full sort's first k).
            let first = |a: &u32, b: &u32| {
                probs[*b as usize]
                    .total_cmp(&probs[*a as usize])
                    .then(a.cmp(b))
            };
            order.select_nth_unstable_by(k - 1, first);
            order[..k].sort_unstable_by(first);
            let chosen = &order[..k];
            let total: f32 = chosen.iter().map(|&i| probs[i as usize] / sum).sum();
            for &i in chosen {
                let p = probs[i as usize] / sum;
                experts.push(i);
                weights.push(if normalize { p / total } else { p });
            }
        }
        HostRouting {
            k,
            experts,
            weights,
        }
    }

    fn read_routing(&self, routing: &HostRouting) -> Result<HostRouting, BackendError> {
        Ok(routing.clone())
    }

    fn moe(
        &self,
        x: &CpuAct,
        routing: &HostRouting,
        experts: &Vec<FfnWeights<HostMatrix>>,
        ffn: ExpertFfn<'_, Vec<f32>>,
    ) -> CpuAct {
        let present: Vec<(u32, &FfnWeights<HostMatrix>)> = routing
            .distinct()
            .into_iter()
            .map(|e| (e, &experts[e as usize]))
            .collect();
        let mut out = CpuAct::zeros(x.rows, x.cols);
        self.moe_accumulate(x, routing, &present, ffn, &mut out);
        out
    }

    fn moe_accumulate(
        &self,
        x: &CpuAct,
        routing: &HostRouting,
        experts: &[(u32, &FfnWeights<HostMatrix>)],
        ffn: ExpertFfn<'_, Vec<f32>>,
        out: &mut CpuAct,
    ) {
        let _span = profile::span("moe_accumulate");
        assert_eq!(routing.tokens(), x.rows);
        assert_eq!((out.rows, out.cols), (x.rows, x.cols));
        assert!(
            experts.windows(2).all(|w| w[0].0 < w[1].0),
            "ascending expert ids"
        );
        let part = profile::span("moe: gather");
        // Group the rows by expert so each expert's weights are read once per call.
        let mut rows_of: Vec<Vec<(usize, f32)>> = vec![Vec::new(); experts.len()];
        for (i, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
            if let Ok(slot) = experts.binary_search_by_key(&e, |p| p.0) {
                rows_of[slot].push((i / routing.k, w));
            }
        }
        let ids: Vec<usize> = experts.iter().map(|p| p.0 as usize).collect();
        let experts: Vec<&FfnWeights<HostMatrix>> = experts.iter().map(|p| p.1).collect();
        let active: Vec<usize> = (0..experts.len())
            .filter(|&e| !rows_of[e].is_empty())
            .collect();
        // A prompt's gathers, activations and weighted sums are spread over the team like its
        // products (on the calling thread when small).
        let parallel = routing.experts.len() * x.cols >= PARALLEL_MOE_VALUES;
        // An expert that takes every row in order (always, decoding one token) reads `x` itself:
        // the products then prepare its activations once for all such experts.
        let gather = |i: usize| {
            let rows = &rows_of[active[i]];
            if rows.len() == x.rows && rows.iter().enumerate().all(|(i, r)| r.0 == i) {
                Cow::Borrowed(&x.data[..])
            } else {
                Cow::Owned(
                    rows.iter()
                        .flat_map(|&(r, _)| x.row(r).iter().copied())
                        .collect(),
                )
            }
        };
        let mut inputs: Vec<Cow<[f32]>> = vec![Cow::Borrowed(&x.data[..0]); active.len()];
        if parallel {
            team::chunks_mut(&mut inputs, 1, |i, v| v[0] = gather(i));
        } else {
            for (i, v) in inputs.iter_mut().enumerate() {
                *v = gather(i);
            }
        }
        drop(part);
        let inter: Vec<usize> = active.iter().map(|&e| experts[e].gate.rows).collect();
        // Each active expert's gate, up and down products, cut from one buffer; every value is
        // written by the products before it is read. Decoding reuses the calling thread's
        // buffer: allocating and zeroing it per layer cost ~14 us on 2 cores.
        let sizes: Vec<[usize; 3]> = active
            .iter()
            .zip(&inter)
            .map(|(&e, &n)| {
                let t = rows_of[e].len();
                [t * n, t * n, t * x.cols]
            })
            .collect();
        let total: usize = sizes.iter().flatten().sum();
        let keep = total <= MOE_BUFFER_KEEP;
        // A prompt's buffer (hundreds of MB) comes untouched from the allocator and is first
        // written by the products on the team: zeroing it on this thread cost ~0.3 s a layer.
        let mut buffer = if keep {
            MOE_BUFFER.take()
        } else {
            vec![0.0; total]
        };
        if buffer.len() < total {
            buffer.resize(total, 0.0);
        }
        let (mut gates, mut ups, mut downs) = (Vec::new(), Vec::new(), Vec::new());
        let mut rest = &mut buffer[..total];
        for [g, u, d] in &sizes {
            let (gate, r) = std::mem::take(&mut rest).split_at_mut(*g);
            let (up, r) = r.split_at_mut(*u);
            let (down, r) = r.split_at_mut(*d);
            gates.push(gate);
            ups.push(up);
            downs.push(down);
            rest = r;
        }
        // Expert `id`'s biases of one projection `n` wide, added to each of its rows.
        let add_bias = |out: &mut [f32], bias: Option<&Vec<f32>>, id: usize, n: usize| {
            if let Some(b) = bias {
                let b = &b[id * n..(id + 1) * n];
                for row in out.chunks_exact_mut(n) {
                    row.iter_mut().zip(b).for_each(|(v, b)| *v += b);
                }
            }
        };
        // The i-th active expert's gate products into down's input.
        let activate = |i: usize, gate: &mut [f32], up: &[f32]| {
            let (id, n) = (ids[active[i]], inter[i]);
            let mut up = Cow::Borrowed(up);
            if let Some(b) = ffn.biases {
                add_bias(gate, Some(&b.gate), id, n);
                add_bias(up.to_mut(), Some(&b.up), id, n);
            }
            match ffn.activation {
                Activation::Silu => kernels::silu_mul(gate, &up),
                act => gate
                    .iter_mut()
                    .zip(up.iter())
                    .for_each(|(g, &u)| *g = act.apply(*g, u)),
            }
        };
        if !parallel {
            // Decoding: gate/up, activation and down in one parallel step.
            let _part = profile::span("moe: gate/up, activation, down (one step)");
            let mut jobs: Vec<kernels::FfnJob> = active
                .iter()
                .zip(&inputs)
                .zip(gates.iter_mut().zip(&mut ups).zip(&mut downs))
                .map(|((&e, input), ((h, u), out))| kernels::FfnJob {
                    gate: experts[e].gate.as_ref(),
                    up: experts[e].up.as_ref(),
                    down: experts[e].down.as_ref(),
                    x: input,
                    tokens: rows_of[e].len(),
                    h,
                    u,
                    out,
                })
                .collect();
            kernels::ffn_batch(self.kernels, &mut jobs, &activate);
        } else {
            let part = profile::span("moe: gate/up");
            {
                let mut jobs = Vec::with_capacity(active.len() * 2);
                for (((&e, input), gate), up) in
                    active.iter().zip(&inputs).zip(&mut gates).zip(&mut ups)
                {
                    let tokens = rows_of[e].len();
                    let f = &experts[e];
                    jobs.push(MatmulJob {
                        w: f.gate.as_ref(),
                        x: input,
                        tokens,
                        out: gate,
                    });
                    jobs.push(MatmulJob {
                        w: f.up.as_ref(),
                        x: input,
                        tokens,
                        out: up,
                    });
                }
                kernels::matmul_batch(self.kernels, &mut jobs);
            }
            drop(part);
            let part = profile::span("moe: activation");
            if parallel {
                team::chunks_mut(&mut gates, 1, |i, g| activate(i, g[0], ups[i]));
            } else {
                for (i, gate) in gates.iter_mut().enumerate() {
                    activate(i, gate, ups[i]);
                }
            }
            drop(part);
            let _part = profile::span("moe: down");
            let mut jobs: Vec<MatmulJob> = active
                .iter()
                .zip(&gates)
                .zip(&mut downs)
                .map(|((&e, h), out)| MatmulJob {
                    w: experts[e].down.as_ref(),
                    x: h,
                    tokens: rows_of[e].len(),
                    out,
                })
                .collect();
            kernels::matmul_batch(self.kernels, &mut jobs);
        }
        if let Some(b) = ffn.biases {
            for (i, down) in downs.iter_mut().enumerate() {
                add_bias(down, Some(&b.down), ids[active[i]], x.cols);
            }
        }
        let _part = profile::span("moe: combine");
        // Each row adds its experts' outputs in ascending expert id (the order of `active`).
        let mut parts_of: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); x.rows];
        for (i, &e) in active.iter().enumerate() {
            for (j, &(r, w)) in rows_of[e].iter().enumerate() {
                parts_of[r].push((i, j, w));
            }
        }
        let add = |r: usize, dst: &mut [f32]| {
            for &(i, j, w) in &parts_of[r] {
                kernels::axpy(w, &downs[i][j * x.cols..(j + 1) * x.cols], dst);
            }
        };
        if parallel && x.cols > 0 {
            team::chunks_mut(&mut out.data, x.cols, add);
        } else {
            for r in 0..x.rows {
                add(r, &mut out.data[r * x.cols..(r + 1) * x.cols]);
            }
        }
        if keep {
            MOE_BUFFER.set(buffer);
        }
    }
}

/// Values of MoE product buffers (4 MiB) up to which a thread keeps its buffer between calls
/// (decoding, small batches); a prompt's larger buffers are allocated and freed per call.
const MOE_BUFFER_KEEP: usize = 1 << 20;

thread_local! {
    /// The calling thread's MoE product buffer (see `moe_accumulate`).
    static MOE_BUFFER: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// From this many query rows on, attention runs a task per block of rows and kv head
/// (`kv::prompt_attention`), else per row and head: more tasks for the few rows of decoding.
const PROMPT_ROWS: usize = 16;
/// From this many positions on, decoding attends through `kv::attention` (keys and values read
/// once per kv head; 2048 positions of a head of 256 are 2 MiB, past a core's L2).
const LONG_DECODE: usize = 2048;

/// Values per task of elementwise steps on the team.
const ELEMENTWISE_CHUNK: usize = 1 << 14;

/// From this many routed values (pairs x hidden size) on, an MoE call's gathers and sums run on
/// the team.
const PARALLEL_MOE_VALUES: usize = 1 << 16;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, without overflow for large `x`.
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `out = scale * x / sqrt(sum(x^2) + 1e-6)`.
fn l2_normalize(x: &[f32], scale: f32, out: &mut [f32]) {
    let inv = scale / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    for (o, v) in out.iter_mut().zip(x) {
        *o = v * inv;
    }
}

/// MemAvailable and MemTotal from /proc/meminfo (Linux); elsewhere unknown, reported as zero free.
fn host_memory() -> MemoryInfo {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    let total = field("MemTotal:").unwrap_or(u64::MAX);
    MemoryInfo {
        free: field("MemAvailable:").unwrap_or(0).min(total),
        total,
    }
}
