//! The CPU's attention cache in every [`KvFormat`], and attention over the compact ones: each
//! run of positions is expanded to f32 once for all the query heads that share its kv head, and
//! a few rows' positions are split over the threads (decoding a long context), their partial
//! softmaxes combined at the end.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use sluice_backend::kv::{quantize_q4, quantize_q8};
use sluice_backend::{AttentionSpec, KvFormat};

use crate::backend::CpuAct;
use crate::{kernels, team};

/// One side (keys or values) of a cache: `[len, kv_heads * head_dim]` values in its format.
#[derive(Debug, Clone)]
enum Rows {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
    /// Per group of values: its codes, and one scale.
    Q8 {
        q: Vec<i8>,
        d: Vec<f16>,
    },
    /// Per group: `group.div_ceil(2)` bytes of codes, a scale and a minimum.
    Q4 {
        q: Vec<u8>,
        d: Vec<f16>,
        min: Vec<f16>,
    },
}

impl Rows {
    fn new(format: KvFormat) -> Self {
        match format {
            KvFormat::F32 => Rows::F32(Vec::new()),
            KvFormat::F16 => Rows::F16(Vec::new()),
            KvFormat::Bf16 => Rows::Bf16(Vec::new()),
            KvFormat::Q8 => Rows::Q8 {
                q: Vec::new(),
                d: Vec::new(),
            },
            KvFormat::Q4 => Rows::Q4 {
                q: Vec::new(),
                d: Vec::new(),
                min: Vec::new(),
            },
        }
    }

    /// Appends `x` (whole groups).
    fn push(&mut self, x: &[f32], group: usize) {
        match self {
            Rows::F32(v) => v.extend_from_slice(x),
            Rows::F16(v) => {
                let at = v.len();
                v.resize(at + x.len(), f16::ZERO);
                v[at..].convert_from_f32_slice(x);
            }
            Rows::Bf16(v) => {
                let at = v.len();
                v.resize(at + x.len(), bf16::ZERO);
                v[at..].convert_from_f32_slice(x);
            }
            Rows::Q8 { q, d } => {
                for g in x.chunks_exact(group) {
                    let at = q.len();
                    q.resize(at + group, 0);
                    d.push(quantize_q8(g, &mut q[at..]));
                }
            }
            Rows::Q4 { q, d, min } => {
                let bytes = group.div_ceil(2);
                for g in x.chunks_exact(group) {
                    let at = q.len();
                    q.resize(at + bytes, 0);
                    let (s, m) = quantize_q4(g, &mut q[at..]);
                    d.push(s);
                    min.push(m);
                }
            }
        }
    }

    /// Keeps the first `values` values (whole groups).
    fn truncate(&mut self, values: usize, group: usize) {
        let groups = values / group;
        match self {
            Rows::F32(v) => v.truncate(values),
            Rows::F16(v) => v.truncate(values),
            Rows::Bf16(v) => v.truncate(values),
            Rows::Q8 { q, d } => {
                q.truncate(values);
                d.truncate(groups);
            }
            Rows::Q4 { q, d, min } => {
                q.truncate(groups * group.div_ceil(2));
                d.truncate(groups);
                min.truncate(groups);
            }
        }
    }

    /// `out.len()` values from value `start` on (both whole groups), as f32.
    fn load(&self, start: usize, out: &mut [f32], group: usize) {
        let n = out.len();
        match self {
            Rows::F32(v) => out.copy_from_slice(&v[start..start + n]),
            // half's slice conversions use F16C where the CPU has it.
            Rows::F16(v) => v[start..start + n].convert_to_f32_slice(out),
            Rows::Bf16(v) => v[start..start + n].convert_to_f32_slice(out),
            Rows::Q8 { q, d } => {
                let first = start / group;
                for (i, (o, q)) in out
                    .chunks_exact_mut(group)
                    .zip(q[start..start + n].chunks_exact(group))
                    .enumerate()
                {
                    let s = d[first + i].to_f32();
                    for (o, q) in o.iter_mut().zip(q) {
                        *o = *q as f32 * s;
                    }
                }
            }
            Rows::Q4 { q, d, min } => {
                let (first, bytes) = (start / group, group.div_ceil(2));
                for (i, o) in out.chunks_exact_mut(group).enumerate() {
                    let g = first + i;
                    let (s, m) = (d[g].to_f32(), min[g].to_f32());
                    let codes = &q[g * bytes..(g + 1) * bytes];
                    for (j, o) in o.iter_mut().enumerate() {
                        *o = ((codes[j / 2] >> (4 * (j % 2))) & 15) as f32 * s + m;
                    }
                }
            }
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Rows::F32(v) => v.len() * 4,
            Rows::F16(v) => v.len() * 2,
            Rows::Bf16(v) => v.len() * 2,
            Rows::Q8 { q, d } => q.len() + d.len() * 2,
            Rows::Q4 { q, d, min } => q.len() + (d.len() + min.len()) * 2,
        }
    }
}

/// Keys and values of one layer, `[len, kv_heads * head_dim]` each in the cache's format, grown
/// as tokens arrive (reserving the context up front would commit memory for it on every
/// request).
#[derive(Debug, Clone)]
pub struct CpuKvCache {
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    format: KvFormat,
    group: usize,
    len: usize,
    keys: Rows,
    values: Rows,
}

impl CpuKvCache {
    pub(crate) fn new(kv_heads: usize, head_dim: usize, format: KvFormat) -> Self {
        CpuKvCache {
            kv_heads,
            head_dim,
            format,
            group: KvFormat::group(head_dim),
            len: 0,
            keys: Rows::new(format),
            values: Rows::new(format),
        }
    }

    pub(crate) fn width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub fn format(&self) -> KvFormat {
        self.format
    }

    /// Bytes the keys and values take.
    pub fn bytes(&self) -> usize {
        self.keys.bytes() + self.values.bytes()
    }

    /// Appends rows of keys and values (`[rows, width]` each).
    pub(crate) fn append(&mut self, k: &[f32], v: &[f32]) {
        debug_assert_eq!(k.len(), v.len());
        self.keys.push(k, self.group);
        self.values.push(v, self.group);
        self.len += k.len() / self.width();
    }

    pub(crate) fn truncate(&mut self, len: usize) {
        let len = len.min(self.len);
        let values = len * self.width();
        self.keys.truncate(values, self.group);
        self.values.truncate(values, self.group);
        self.len = len;
    }

    /// The keys and values as they are, when stored as f32.
    pub(crate) fn as_f32(&self) -> Option<(&[f32], &[f32])> {
        match (&self.keys, &self.values) {
            (Rows::F32(k), Rows::F32(v)) => Some((k, v)),
            _ => None,
        }
    }

    /// Positions `p..p + out.len() / head_dim` of kv head `kv`, keys or values, as f32 rows of
    /// `head_dim`.
    fn load(&self, keys: bool, p: usize, kv: usize, out: &mut [f32]) {
        let (hd, width) = (self.head_dim, self.width());
        let side = if keys { &self.keys } else { &self.values };
        for (i, row) in out.chunks_exact_mut(hd).enumerate() {
            side.load((p + i) * width + kv * hd, row, self.group);
        }
    }
}

/// Positions a run of keys or values expands to at a time (64 KiB of f32 at a head of 256).
const RUN: usize = 64;
/// The fewest positions a split of one row's attention takes.
const MIN_SPLIT: usize = 256;

/// Causal grouped-query attention of `q` (rows at positions `first..`) over a compact `cache`
/// that already holds their keys and values, as `spec` says.
pub(crate) fn attention(
    q: &CpuAct,
    cache: &CpuKvCache,
    first: usize,
    spec: AttentionSpec<'_, Vec<f32>>,
) -> CpuAct {
    let (heads, scale) = (spec.heads, spec.scale);
    let (hd, kvh) = (cache.head_dim, cache.kv_heads);
    let group = heads / kvh;
    let rows = q.rows;
    // Enough tasks for every thread, each of at least MIN_SPLIT positions.
    let longest = first + rows;
    let splits = (2 * team::thread_count())
        .div_ceil(rows * kvh)
        .min(longest.div_ceil(MIN_SPLIT))
        .max(1);
    // Per (row, kv head, split), per head of the group: the max score, the sum of the
    // exponentials and the unnormalised output.
    let part = hd + 2;
    let mut parts = vec![0f32; rows * kvh * splits * group * part];
    team::chunks_mut(&mut parts, group * part, |i, out| {
        let (rk, split) = (i / splits, i % splits);
        let (r, kv) = (rk / kvh, rk % kvh);
        let start = spec.first_visible(first + r);
        let n = first + r + 1 - start;
        let per = n.div_ceil(splits);
        let lo = start + (split * per).min(n);
        let len = per.min(start + n - lo);
        if len == 0 {
            for o in out.chunks_exact_mut(part) {
                o[0] = f32::NEG_INFINITY;
            }
            return;
        }
        let qg = &q.data[r * q.cols + kv * group * hd..][..group * hd];
        let mut scores = vec![0f32; group * len];
        let mut run = vec![0f32; RUN.min(len) * hd];
        for p0 in (0..len).step_by(RUN) {
            let m = RUN.min(len - p0);
            cache.load(true, lo + p0, kv, &mut run[..m * hd]);
            for (h, s) in scores.chunks_exact_mut(len).enumerate() {
                let qh = &qg[h * hd..(h + 1) * hd];
                kernels::scaled_dots(qh, &run, hd, scale, &mut s[p0..p0 + m]);
            }
        }
        for (s, o) in scores.chunks_exact_mut(len).zip(out.chunks_exact_mut(part)) {
            let max = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let mut sum = 0.0;
            for v in s.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            o[0] = max;
            o[1] = sum;
        }
        for p0 in (0..len).step_by(RUN) {
            let m = RUN.min(len - p0);
            cache.load(false, lo + p0, kv, &mut run[..m * hd]);
            for (s, o) in scores.chunks_exact(len).zip(out.chunks_exact_mut(part)) {
                kernels::add_weighted_rows(&s[p0..p0 + m], &run, hd, &mut o[2..]);
            }
        }
    });
    // Each head's splits combined, its sink joining the softmax.
    let mut out = CpuAct::zeros(rows, heads * hd);
    team::chunks_mut(&mut out.data, hd, |i, o| {
        let (r, h) = (i / heads, i % heads);
        let (kv, j) = (h / group, h % group);
        let split = |s: usize| &parts[(((r * kvh + kv) * splits + s) * group + j) * part..][..part];
        let sink = spec.sinks.map(|s| s[h]);
        let top = (0..splits)
            .map(|s| split(s)[0])
            .chain(sink)
            .fold(f32::NEG_INFINITY, f32::max);
        let mut denom = sink.map_or(0.0, |s| (s - top).exp());
        for s in 0..splits {
            let p = split(s);
            if p[0] == f32::NEG_INFINITY {
                continue;
            }
            let f = (p[0] - top).exp();
            denom += p[1] * f;
            for (o, v) in o.iter_mut().zip(&p[2..]) {
                *o += v * f;
            }
        }
        o.iter_mut().for_each(|v| *v /= denom);
    });
    out
}
