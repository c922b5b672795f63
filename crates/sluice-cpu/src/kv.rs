//! The CPU's attention cache in every [`KvFormat`], and the attention that reads it in bulk:
//! a prompt's rows walk the positions tile by tile, each tile read (and expanded to f32) once
//! for a block of rows and every query head sharing its kv head; a few rows over a long or
//! compact cache split the positions over the threads, their partial softmaxes combined at the
//! end.

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

/// Positions a prompt's task holds at a time (256 KiB of f32 keys at a head of 256: they stay
/// in L2 while every row and head of the task reads them).
const TILE: usize = 256;
/// Rows a prompt's task attends for at most.
const BLOCK_ROWS: usize = 16;
/// Scores a prompt's task keeps at most (4 MiB): fewer rows per task at long contexts.
const BLOCK_SCORES: usize = 1 << 20;

/// Memory the prompt tasks of rayon's threads hold at once beside the pass's activations, at
/// contexts up to `context` positions: each its scores (for groups of up to 64 query heads per
/// kv head) and a tile expanded from a compact cache (heads of up to 512).
pub fn prompt_scratch_bytes(context: usize) -> u64 {
    let scores = BLOCK_SCORES.min(BLOCK_ROWS * 64 * context);
    (rayon::current_num_threads() * 4 * (scores + (TILE + RUN) * 512)) as u64
}

/// Causal grouped-query attention of a prompt's rows `q` (positions `first..`) over a `cache`
/// of any format that already holds their keys and values, as `spec` says.
///
/// One task per block of rows and kv head walks the visible positions tile by tile, so each
/// tile is read from memory (and, compact, expanded) once for all its rows and heads instead of
/// once per row: past a few thousand positions attending row by row is bound by memory. Per row
/// and head the arithmetic is that of the row alone (its scores by runs of [`RUN`] positions
/// from its first visible one, one softmax, the values by the same runs), so the result does not
/// depend on the blocks, the tiles or the thread count.
pub(crate) fn prompt_attention(
    q: &CpuAct,
    cache: &CpuKvCache,
    first: usize,
    spec: AttentionSpec<'_, Vec<f32>>,
) -> CpuAct {
    let (heads, scale) = (spec.heads, spec.scale);
    let (hd, kvh) = (cache.head_dim, cache.kv_heads);
    let group = heads / kvh;
    let rows = q.rows;
    if rows == 0 {
        return CpuAct::zeros(0, q.cols);
    }
    let longest = first + rows - spec.first_visible(first + rows - 1);
    // Enough tasks for twice the threads where the rows allow it.
    let block = (BLOCK_SCORES / (group * longest))
        .min(rows * kvh / (2 * team::thread_count()))
        .clamp(1, BLOCK_ROWS);
    let blocks = rows.div_ceil(block);
    // [kv head][block][row of the block][group * hd], rows past the last left unused.
    let mut by_kv = vec![0f32; kvh * blocks * block * group * hd];
    team::chunks_mut(&mut by_kv, block * group * hd, |i, out| {
        let (kv, r0) = (i / blocks, (i % blocks) * block);
        // Per row of the block: its visible positions `start..end`, and where its scores begin.
        let spans: Vec<(usize, usize)> = (r0..rows.min(r0 + block))
            .map(|r| (spec.first_visible(first + r), first + r + 1))
            .collect();
        let at: Vec<usize> = spans
            .iter()
            .scan(0, |total, &(s, e)| {
                let at = *total;
                *total += group * (e - s);
                Some(at)
            })
            .collect();
        let (s, e) = spans[spans.len() - 1];
        let mut scores = vec![0f32; at[at.len() - 1] + group * (e - s)];
        let mut buf = Vec::new();
        walk_tiles(
            cache,
            true,
            kv,
            &spans,
            &mut buf,
            |j, a, m, keys, stride| {
                let (start, end) = spans[j];
                let r = r0 + j;
                let qg = &q.data[r * q.cols + kv * group * hd..][..group * hd];
                for (h, qh) in qg.chunks_exact(hd).enumerate() {
                    let s = &mut scores[at[j] + h * (end - start) + (a - start)..][..m];
                    kernels::scaled_dots(qh, keys, stride, scale, s);
                }
            },
        );
        for (j, &(start, end)) in spans.iter().enumerate() {
            let n = end - start;
            for (h, s) in scores[at[j]..][..group * n].chunks_exact_mut(n).enumerate() {
                softmax_weights(s, spec.sinks.map(|s| s[kv * group + h]));
            }
        }
        walk_tiles(
            cache,
            false,
            kv,
            &spans,
            &mut buf,
            |j, a, m, values, stride| {
                let (start, end) = spans[j];
                let o = &mut out[j * group * hd..][..group * hd];
                for (h, oh) in o.chunks_exact_mut(hd).enumerate() {
                    let w = &scores[at[j] + h * (end - start) + (a - start)..][..m];
                    kernels::add_weighted_rows(w, values, stride, oh);
                }
            },
        );
    });
    let mut out = CpuAct::zeros(rows, heads * hd);
    for (r, row) in out.data.chunks_exact_mut(heads * hd).enumerate() {
        for (kv, o) in row.chunks_exact_mut(group * hd).enumerate() {
            let (b, j) = (r / block, r % block);
            o.copy_from_slice(&by_kv[((kv * blocks + b) * block + j) * group * hd..][..group * hd]);
        }
    }
    out
}

/// Calls `visit(j, a, m, rows, stride)` for every run of row `j` (`spans[j]`: its visible
/// positions): `m` positions from `a`, as f32 rows `stride` apart from `rows[0]`; in order of
/// position within each row, tile by tile over all of them.
fn walk_tiles(
    cache: &CpuKvCache,
    keys: bool,
    kv: usize,
    spans: &[(usize, usize)],
    buf: &mut Vec<f32>,
    mut visit: impl FnMut(usize, usize, usize, &[f32], usize),
) {
    let (hd, width) = (cache.head_dim, cache.width());
    let lo = spans.iter().map(|s| s.0).min().unwrap_or(0);
    let hi = spans.iter().map(|s| s.1).max().unwrap_or(0);
    // Row j's runs that begin in `t0..t1`: from `start + RUN * k` on.
    let runs = |(start, end): (usize, usize), t0: usize, t1: usize| {
        let from = start + t0.saturating_sub(start).div_ceil(RUN) * RUN;
        (from..end.min(t1))
            .step_by(RUN)
            .map(move |a| (a, RUN.min(end - a)))
    };
    let stored = cache.as_f32().map(|(k, v)| if keys { k } else { v });
    for t0 in (lo..hi).step_by(TILE) {
        let t1 = t0 + TILE;
        let (rows, stride, base) = match stored {
            Some(rows) => (&rows[kv * hd..], width, 0),
            None => {
                // The positions this tile's runs cover, expanded once.
                let need = spans
                    .iter()
                    .flat_map(|&s| runs(s, t0, t1).map(|(a, m)| a + m))
                    .max()
                    .unwrap_or(t0);
                buf.resize((need - t0) * hd, 0.0);
                cache.load(keys, t0, kv, buf);
                (&buf[..], hd, t0)
            }
        };
        for (j, &span) in spans.iter().enumerate() {
            for (a, m) in runs(span, t0, t1) {
                visit(j, a, m, &rows[(a - base) * stride..], stride);
            }
        }
    }
}

/// Attention scores in place to their softmax weights (max subtracted, divided by the sum), with
/// an attention sink's logit joining the softmax where there is one.
pub(crate) fn softmax_weights(scores: &mut [f32], sink: Option<f32>) {
    let max = scores
        .iter()
        .chain(&sink)
        .fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = sink.map_or(0.0, |s| (s - max).exp());
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    scores.iter_mut().for_each(|s| *s /= sum);
}
