//! AVX2 + FMA + F16C kernels. The 8-row packers here also serve the AVX-512 level.
//!
//! Functions with `#[target_feature]` may only run on a CPU with those features: the dispatcher
//! in `mod.rs` checks the level once per call before anything here is reached.

use std::arch::x86_64::*;

use sluice_backend::{Dtype, MatRef, WeightFormat};

use super::{grow, portable, scalar, Ctx, Gemm, Kind, Scratch};

pub(super) const DT_F32: u8 = 0;
pub(super) const DT_F16: u8 = 1;
pub(super) const DT_BF16: u8 = 2;

/// Whether this CPU runs the code in this module (checked by the safe `Gemm` entry points).
pub(super) fn cpu_ok() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// Eight elements of dtype `DT` at `p`, as f32.
///
/// # Safety
/// `8 * size` bytes must be readable at `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) unsafe fn ld8<const DT: u8>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees the 16 or 32 bytes read here are readable.
    unsafe {
        match DT {
            DT_F32 => _mm256_loadu_ps(p as *const f32),
            DT_F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p as *const __m128i),
            ))),
        }
    }
}

/// [`ld8`] with the dtype chosen at run time.
///
/// # Safety
/// As [`ld8`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ld8_dyn(dt: Dtype, p: *const u8) -> __m256 {
    // SAFETY: forwarded from the caller.
    unsafe {
        match dt {
            Dtype::F32 => ld8::<DT_F32>(p),
            Dtype::F16 => ld8::<DT_F16>(p),
            Dtype::Bf16 => ld8::<DT_BF16>(p),
        }
    }
}

#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// mxfp4 rows `r0..r1` dotted with `c.tokens` (at most `DECODE_MAX_TOKENS`) tokens. Per group
/// of 32 columns: its 16 code bytes split into nibbles, each nibble to twice its FP4 value as a
/// byte by one table shuffle (FP4 doubled is a whole number up to 12), interleaved back into
/// column order, widened to floats; dotted with each token's 32 values and scaled by half the
/// group's power of two.
#[target_feature(enable = "avx2,fma")]
pub(super) fn mxfp4_rows(c: &Ctx, r0: usize, r1: usize, res: &mut [f32]) {
    let (cols, n, tokens) = (c.w.cols, r1 - r0, c.tokens);
    let groups = cols / sluice_backend::MXFP4_GROUP;
    let rb = cols / 2;
    assert!(
        tokens <= super::DECODE_MAX_TOKENS,
        "decode takes at most DECODE_MAX_TOKENS"
    );
    assert!(c.x.len() >= tokens * cols && res.len() >= tokens * n);
    let lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    let nibble = _mm_set1_epi8(0x0F);
    for r in r0..r1 {
        let row = &c.w.data[r * rb..(r + 1) * rb];
        let exps = &c.w.scales[r * groups..(r + 1) * groups];
        let mut acc = [_mm256_setzero_ps(); super::DECODE_MAX_TOKENS];
        for (g, &e) in exps.iter().enumerate() {
            // SAFETY: `row` holds `groups * 16` bytes; this reads bytes `g * 16..g * 16 + 16`.
            let v = unsafe { _mm_loadu_si128(row.as_ptr().add(g * 16) as *const __m128i) };
            let even = _mm_shuffle_epi8(lut, _mm_and_si128(v, nibble));
            let odd = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16::<4>(v), nibble));
            let (a, b) = (_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd));
            let w = [
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(a))),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(b))),
            ];
            let scale = _mm256_set1_ps(0.5 * sluice_backend::e8m0_to_f32(e));
            for (t, a) in acc.iter_mut().enumerate().take(tokens) {
                let x = c.x[t * cols + g * 32..t * cols + g * 32 + 32].as_ptr();
                // SAFETY: `x` points at 32 values of token `t` (the slice just taken).
                let d = unsafe {
                    let d = _mm256_mul_ps(w[0], _mm256_loadu_ps(x));
                    let d = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(x.add(8)), d);
                    let d = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(x.add(16)), d);
                    _mm256_fmadd_ps(w[3], _mm256_loadu_ps(x.add(24)), d)
                };
                *a = _mm256_fmadd_ps(d, scale, *a);
            }
        }
        for (t, a) in acc.iter().enumerate().take(tokens) {
            res[t * n + r - r0] = hsum(*a);
        }
    }
}

/// `sum a[i] * b[i]` over equal lengths, in four vector accumulators.
#[target_feature(enable = "avx2,fma")]
pub(super) fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load reads elements `i..i + 8` with `i + 8 <= n` of both slices.
    unsafe {
        while i + 32 <= n {
            for (u, a) in acc.iter_mut().enumerate() {
                let j = i + 8 * u;
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(j)), _mm256_loadu_ps(pb.add(j)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i)),
                _mm256_loadu_ps(pb.add(i)),
                acc[0],
            );
            i += 8;
        }
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    hsum(v) + a[i..].iter().zip(&b[i..]).map(|(x, y)| x * y).sum::<f32>()
}

/// `[q . k[0], .., q . k[3]]` over equal lengths: each chunk of `q` is loaded once for the four
/// keys, each key summed in two vector accumulators.
#[target_feature(enable = "avx2,fma")]
pub(super) fn dot4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
    let n = q.len();
    assert!(k.iter().all(|k| k.len() == n));
    let mut acc = [[_mm256_setzero_ps(); 2]; 4];
    let mut i = 0;
    // SAFETY: every load reads elements `i..i + 8` with `i + 8 <= n` of slices of length `n`.
    unsafe {
        while i + 16 <= n {
            let q0 = _mm256_loadu_ps(q.as_ptr().add(i));
            let q1 = _mm256_loadu_ps(q.as_ptr().add(i + 8));
            for (a, k) in acc.iter_mut().zip(&k) {
                a[0] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k.as_ptr().add(i)), a[0]);
                a[1] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k.as_ptr().add(i + 8)), a[1]);
            }
            i += 16;
        }
        while i + 8 <= n {
            let q0 = _mm256_loadu_ps(q.as_ptr().add(i));
            for (a, k) in acc.iter_mut().zip(&k) {
                a[0] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k.as_ptr().add(i)), a[0]);
            }
            i += 8;
        }
    }
    // The four sums reduced together: lane pairs, then halves.
    let s: [__m256; 4] = std::array::from_fn(|j| _mm256_add_ps(acc[j][0], acc[j][1]));
    let t01 = _mm256_hadd_ps(s[0], s[1]);
    let t23 = _mm256_hadd_ps(s[2], s[3]);
    let t = _mm256_hadd_ps(t01, t23);
    let r = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
    let mut out = [0f32; 4];
    // SAFETY: `out` holds 4 floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), r) };
    for (o, k) in out.iter_mut().zip(&k) {
        *o += q[i..].iter().zip(&k[i..]).map(|(x, y)| x * y).sum::<f32>();
    }
    out
}

/// `out += sum_p w[p] * rows[p * stride..][..out.len()]`, each element's products added in
/// order of `p` (as repeated [`axpy`] would, with the same roundings), the sums held in
/// registers 64 elements at a time.
/// Added onto `out` as it is (a continuation over more rows gives the same bits as one call).
#[target_feature(enable = "avx2,fma")]
pub(super) fn weighted_rows(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    let (n, hd) = (w.len(), out.len());
    assert!(n == 0 || (n - 1) * stride + hd <= rows.len());
    let mut c = 0;
    while c < hd {
        let width = (hd - c).min(64) / 8 * 8;
        if width == 0 {
            break;
        }
        let vecs = width / 8;
        let mut acc: [__m256; 8] = std::array::from_fn(|j| {
            if j < vecs {
                // SAFETY: `c + 8 j + 8 <= hd == out.len()` for `j < vecs`.
                unsafe { _mm256_loadu_ps(out.as_ptr().add(c + 8 * j)) }
            } else {
                _mm256_setzero_ps()
            }
        });
        for (p, &wp) in w.iter().enumerate() {
            let wv = _mm256_set1_ps(wp);
            for (j, a) in acc.iter_mut().enumerate().take(vecs) {
                // SAFETY: elements `p * stride + c + 8 j..+ 8` with `c + 8 j + 8 <= hd` lie inside
                // row `p < n` of `rows` (asserted above).
                let v = unsafe { _mm256_loadu_ps(rows.as_ptr().add(p * stride + c + 8 * j)) };
                *a = _mm256_fmadd_ps(wv, v, *a);
            }
        }
        for (j, a) in acc.iter().enumerate().take(vecs) {
            // SAFETY: `c + 8 j + 8 <= hd == out.len()`.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * j), *a) };
        }
        c += width;
    }
    for (p, &wp) in w.iter().enumerate() {
        for (o, &v) in out[c..]
            .iter_mut()
            .zip(&rows[p * stride + c..p * stride + hd])
        {
            *o += wp * v;
        }
    }
}

/// `y += alpha * x` over equal lengths.
#[target_feature(enable = "avx2,fma")]
pub(super) fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    assert_eq!(x.len(), y.len());
    let n = x.len();
    let av = _mm256_set1_ps(alpha);
    let mut i = 0;
    // SAFETY: every access covers elements `i..i + 8` with `i + 8 <= n` of both slices.
    unsafe {
        while i + 8 <= n {
            let py = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                py,
                _mm256_fmadd_ps(av, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(py)),
            );
            i += 8;
        }
    }
    for (o, &v) in y[i..].iter_mut().zip(&x[i..]) {
        *o += alpha * v;
    }
}

/// `e^x` for 8 lanes (Cephes' `expf`: `2^n` times a degree-5 polynomial on `[-ln2/2, ln2/2]`,
/// within 2 ulp of the correctly rounded value); inputs are clamped to `[-88.38, 88.38]`.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-88.376_26)),
        _mm256_set1_ps(88.376_26),
    );
    let n = _mm256_floor_ps(_mm256_fmadd_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
        _mm256_set1_ps(0.5),
    ));
    // x - n ln2, with ln2 split in two so that the first product is exact.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        5e-1,
    ] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let p = _mm256_add_ps(
        _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    // 2^n: n is in [-127, 128] after the clamp; its biased exponent fits the field except
    // at the ends, where the result only needs to be tiny or huge.
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(p, _mm256_castsi256_ps(e))
}

/// [`super::silu_apply`] through [`exp8`].
#[target_feature(enable = "avx2,fma")]
pub(super) fn silu_apply(x: &mut [f32], other: &[f32], mode: super::Silu) {
    use super::Silu;
    let n = x.len();
    assert!(mode == Silu::Alone || other.len() == n);
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    // SAFETY: every access covers elements `i..i + 8` with `i + 8 <= n` of `x`, and of `other`
    // (asserted as long) when the mode reads it.
    unsafe {
        while i + 8 <= n {
            let px = x.as_mut_ptr().add(i);
            let xv = _mm256_loadu_ps(px);
            let (g, m) = match mode {
                Silu::Alone => (xv, None),
                Silu::TimesOther => (xv, Some(_mm256_loadu_ps(other.as_ptr().add(i)))),
                Silu::OfOther => (_mm256_loadu_ps(other.as_ptr().add(i)), Some(xv)),
            };
            let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            let silu = _mm256_div_ps(g, _mm256_add_ps(one, e));
            _mm256_storeu_ps(px, m.map_or(silu, |m| _mm256_mul_ps(silu, m)));
            i += 8;
        }
    }
    super::silu_apply_scalar(&mut x[i..], other.get(i..).unwrap_or(&[]), mode);
}

/// [`super::delta_rule_step`]: each row's two dot products in four vector accumulators.
#[target_feature(enable = "avx2,fma")]
pub(super) fn delta_rule_step(
    s: &mut [f32],
    k: &[f32],
    q: &[f32],
    v: &[f32],
    (g, beta): (f32, f32),
    y: &mut [f32],
) {
    let dk = k.len();
    assert!(q.len() == dk && s.len() == v.len() * dk && y.len() == v.len());
    let whole = dk / 8 * 8;
    let gv = _mm256_set1_ps(g);
    for ((row, &vi), yi) in s.chunks_exact_mut(dk).zip(v).zip(y.iter_mut()) {
        let (ps, pk, pq) = (row.as_mut_ptr(), k.as_ptr(), q.as_ptr());
        // Decay, and the row's projection on k.
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut j = 0;
        // SAFETY: every access covers elements `j..j + 8` with `j + 8 <= dk`, and `row`, `k`
        // and `q` all have `dk` elements.
        unsafe {
            while j + 32 <= dk {
                for (u, a) in acc.iter_mut().enumerate() {
                    let sv = _mm256_mul_ps(_mm256_loadu_ps(ps.add(j + 8 * u)), gv);
                    _mm256_storeu_ps(ps.add(j + 8 * u), sv);
                    *a = _mm256_fmadd_ps(sv, _mm256_loadu_ps(pk.add(j + 8 * u)), *a);
                }
                j += 32;
            }
            while j + 8 <= dk {
                let sv = _mm256_mul_ps(_mm256_loadu_ps(ps.add(j)), gv);
                _mm256_storeu_ps(ps.add(j), sv);
                acc[0] = _mm256_fmadd_ps(sv, _mm256_loadu_ps(pk.add(j)), acc[0]);
                j += 8;
            }
        }
        let mut kv = hsum(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        for (sv, &kj) in row[whole..].iter_mut().zip(&k[whole..]) {
            *sv *= g;
            kv += *sv * kj;
        }
        // The step toward v along k, and the row's read-out by q.
        let delta = (vi - kv) * beta;
        let dv = _mm256_set1_ps(delta);
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut j = 0;
        // SAFETY: as above.
        unsafe {
            while j + 32 <= dk {
                for (u, a) in acc.iter_mut().enumerate() {
                    let at = j + 8 * u;
                    let sv = _mm256_fmadd_ps(
                        dv,
                        _mm256_loadu_ps(pk.add(at)),
                        _mm256_loadu_ps(ps.add(at)),
                    );
                    _mm256_storeu_ps(ps.add(at), sv);
                    *a = _mm256_fmadd_ps(sv, _mm256_loadu_ps(pq.add(at)), *a);
                }
                j += 32;
            }
            while j + 8 <= dk {
                let sv =
                    _mm256_fmadd_ps(dv, _mm256_loadu_ps(pk.add(j)), _mm256_loadu_ps(ps.add(j)));
                _mm256_storeu_ps(ps.add(j), sv);
                acc[0] = _mm256_fmadd_ps(sv, _mm256_loadu_ps(pq.add(j)), acc[0]);
                j += 8;
            }
        }
        let mut out = hsum(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        for ((sv, &kj), &qj) in row[whole..].iter_mut().zip(&k[whole..]).zip(&q[whole..]) {
            *sv += delta * kj;
            out += *sv * qj;
        }
        *yi = out;
    }
}

/// [`super::quantize_q4i`] for whole words (`x.len()` a multiple of 8), with the same
/// results: the scale and its inverse are divided as there, and `vcvtps2dq` rounds to nearest
/// even as the scalar code does. A word with a non-finite value takes the scalar code.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `xq` and `xd` must be as `quantize_q4i` asserts.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_q4i_words(x: &[f32], bpb: usize, xq: &mut [i8], xd: &mut [f32]) {
    let words = x.len() / 8;
    assert!(xd.len() >= words && xq.len() >= xd.len() * 8);
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // After packing to 16 bits, code `k` is the low byte of lane `k` (every code fits a byte):
    // bytes 0, 4, 8, 12 are the even values', 2, 6, 10, 14 the odd ones'.
    let order = _mm_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1);
    // Word `w`'s codes from its values and the inverse of its scale.
    let store = |w: usize, v: __m256, inv: __m256, xq: &mut [i8]| {
        let q = _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
        let q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
        let pair = _mm_cvtsi128_si64(_mm_shuffle_epi8(q16, order)) as u64;
        let at = super::q4i_word_offset(bpb, w);
        xq[at..at + 4].copy_from_slice(&(pair as u32).to_le_bytes().map(|b| b as i8));
        xq[at + bpb..at + bpb + 4]
            .copy_from_slice(&((pair >> 32) as u32).to_le_bytes().map(|b| b as i8));
    };
    // One word: a word with a non-finite value takes the scalar code.
    let one = |w: usize, xq: &mut [i8], xd: &mut [f32]| {
        // SAFETY: the callers pass words `w < words`, inside `x`.
        let v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * w)) };
        // `v - v` is 0 for finite values, NaN otherwise.
        let finite = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
            _mm256_sub_ps(v, v),
            _mm256_setzero_ps(),
        )) == 0xFF;
        if !finite {
            xd[w] = super::quantize_word(&x[8 * w..8 * w + 8], bpb, w, xq);
            return;
        }
        let a = _mm256_and_ps(v, abs_mask);
        let m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
        xd[w] = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        store(w, v, _mm256_set1_ps(inv), xq);
    };
    let mut w = 0;
    // Eight words at a time: their maxima reduced together, their scales divided as vectors
    // (the same IEEE divisions as one word at a time below).
    while w + 8 <= words {
        // SAFETY: words `w..w + 8` are inside `x`.
        let v: [__m256; 8] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * (w + i))) });
        // `v - v` is 0 for finite values, NaN otherwise.
        let bad = v.iter().fold(_mm256_setzero_ps(), |b, &v| {
            let d = _mm256_sub_ps(v, v);
            _mm256_or_ps(b, _mm256_cmp_ps::<_CMP_UNORD_Q>(d, d))
        });
        if _mm256_movemask_ps(bad) != 0 {
            for i in w..w + 8 {
                one(i, xq, xd);
            }
            w += 8;
            continue;
        }
        let a = v.map(|v| _mm256_and_ps(v, abs_mask));
        // Lane i of the result is the maximum of a[i]'s eight lanes.
        let pairs = |a0: __m256, a1: __m256| {
            _mm256_max_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1))
        };
        let quads = |t01: __m256, t23: __m256| {
            _mm256_max_ps(
                _mm256_shuffle_ps::<0b0100_0100>(t01, t23),
                _mm256_shuffle_ps::<0b1110_1110>(t01, t23),
            )
        };
        let lo = quads(pairs(a[0], a[1]), pairs(a[2], a[3]));
        let hi = quads(pairs(a[4], a[5]), pairs(a[6], a[7]));
        let amax = _mm256_max_ps(
            _mm256_permute2f128_ps::<0x20>(lo, hi),
            _mm256_permute2f128_ps::<0x31>(lo, hi),
        );
        // SAFETY: `xd` holds at least `words` scales.
        unsafe {
            _mm256_storeu_ps(
                xd.as_mut_ptr().add(w),
                _mm256_div_ps(amax, _mm256_set1_ps(127.0)),
            )
        };
        let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(amax, _mm256_setzero_ps());
        let inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(127.0), amax), positive);
        for (i, &v) in v.iter().enumerate() {
            let lane = _mm256_permutevar8x32_ps(inv, _mm256_set1_epi32(i as i32));
            store(w + i, v, lane, xq);
        }
        w += 8;
    }
    while w < words {
        one(w, xq, xd);
        w += 1;
    }
}

/// `out.len()` elements of `dt` from `bytes`, as f32 (a chunk of rows' scales or biases), with
/// the dtype fixed outside the loop.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn cvt_row(dt: Dtype, bytes: &[u8], out: &mut [f32]) {
    match dt {
        Dtype::F32 => cvt_row_as::<DT_F32>(bytes, out),
        Dtype::F16 => cvt_row_as::<DT_F16>(bytes, out),
        Dtype::Bf16 => cvt_row_as::<DT_BF16>(bytes, out),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn cvt_row_as<const DT: u8>(bytes: &[u8], out: &mut [f32]) {
    let (n, sz) = (out.len(), if DT == DT_F32 { 4 } else { 2 });
    assert!(bytes.len() >= n * sz);
    let mut i = 0;
    // SAFETY: elements `i..i + 8` (`+ 16`) lie inside both `bytes` (asserted above) and `out`.
    unsafe {
        while i + 16 <= n {
            let (src, dst) = (bytes.as_ptr().add(i * sz), out.as_mut_ptr().add(i));
            _mm256_storeu_ps(dst, ld8::<DT>(src));
            _mm256_storeu_ps(dst.add(8), ld8::<DT>(src.add(8 * sz)));
            i += 16;
        }
        while i + 8 <= n {
            _mm256_storeu_ps(
                out.as_mut_ptr().add(i),
                ld8::<DT>(bytes.as_ptr().add(i * sz)),
            );
            i += 8;
        }
    }
    let dt = match DT {
        DT_F32 => Dtype::F32,
        DT_F16 => Dtype::F16,
        _ => Dtype::Bf16,
    };
    for (j, o) in out.iter_mut().enumerate().skip(i) {
        *o = scalar(dt, bytes, j);
    }
}

/// Lane sums of `bias[g] * xsum[t * groups + g]` (`bias`: one row's `groups` biases as f32),
/// for each token `t < NT`: the bias term of an affine row, before the final horizontal sum.
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(super) fn bias_part<const NT: usize>(
    bias: &[f32],
    xsum: &[f32],
    groups: usize,
) -> [__m256; NT] {
    assert!(bias.len() >= groups && xsum.len() >= NT * groups);
    let mut acc = [_mm256_setzero_ps(); NT];
    let mut g = 0;
    // SAFETY: groups `g..g + 8 <= groups` are inside `bias` and every token's row of `xsum`;
    // the masked loads of the tail touch only groups `< groups`.
    unsafe {
        while g + 8 <= groups {
            let b = _mm256_loadu_ps(bias.as_ptr().add(g));
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(b, _mm256_loadu_ps(xsum.as_ptr().add(t * groups + g)), *a);
            }
            g += 8;
        }
        if g < groups {
            let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            let m = _mm256_cmpgt_epi32(_mm256_set1_epi32((groups - g) as i32), lane);
            let b = _mm256_maskload_ps(bias.as_ptr().add(g), m);
            for (t, a) in acc.iter_mut().enumerate() {
                let xs = _mm256_maskload_ps(xsum.as_ptr().add(t * groups + g), m);
                *a = _mm256_fmadd_ps(b, xs, *a);
            }
        }
    }
    acc
}

/// Bytes ahead of the current position that the x86 decode kernels (4-bit and 8-bit) prefetch
/// their weights (one contiguous stream; 0 disables). A core must keep about latency x its share
/// of the DRAM bandwidth in flight: on the AVX-512 Xeons measured (a 2-core VM and a 16-core host;
/// Qwen3-30B-A3B shape, 4-bit), 4096 decoded 5-6% faster than 2048 at 8 and 16 threads and ~10%
/// on 2; 1024 and none were slower (-6%, -20%), 6144 and more no better.
pub(super) const PREFETCH: usize = 4096;

/// Rows converted per batch of scales and biases in the affine decode kernels.
pub(super) const ROW_CHUNK: usize = 16;

/// The scales and biases of rows `ch..ch + nc` of the affine matrix `w` (scale dtype `sdt`) as
/// f32: into `scales`, followed by `pad` zeros (for kernels that read a block's scales past a
/// row's last group), and `biases`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn chunk_scales(
    w: &MatRef,
    sdt: Dtype,
    ch: usize,
    nc: usize,
    pad: usize,
    scales: &mut [f32],
    biases: &mut [f32],
) {
    let srb = w.format.scale_row_bytes(w.cols);
    let n = nc * (srb / sdt.size());
    cvt_row(sdt, &w.scales[ch * srb..(ch + nc) * srb], &mut scales[..n]);
    cvt_row(sdt, &w.biases[ch * srb..(ch + nc) * srb], &mut biases[..n]);
    scales[n..n + pad].fill(0.0);
}

/// Asks for the cache lines of `bytes[start..start + len]` (clamped to `bytes`) ahead of use:
/// the integer decode kernels fetch the next chunk's scales and biases while they work on this
/// one (the hardware prefetchers follow the weights' stream, not these short bursts).
#[inline]
pub(super) fn prefetch_bytes(bytes: &[u8], start: usize, len: usize) {
    let end = (start + len).min(bytes.len());
    let mut i = start;
    while i < end {
        // SAFETY: a prefetch is a hint that never faults; `i < bytes.len()` anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(i) as *const i8) };
        i += 64;
    }
}

macro_rules! nt_dispatch {
    ($nt:expr, $f:ident :: < $($g:tt),* > ( $($arg:expr),* )) => {
        match $nt {
            1 => $f::<1, $($g),*>($($arg),*),
            2 => $f::<2, $($g),*>($($arg),*),
            3 => $f::<3, $($g),*>($($arg),*),
            4 => $f::<4, $($g),*>($($arg),*),
            n => unreachable!("{n} tokens in a decode kernel"),
        }
    };
}
pub(super) use nt_dispatch;

/// Mat-vec over rows `r0..r1` for all tokens (`res`: `tokens` rows of `r1 - r0`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C. `c` must be a validated job with at most
/// `DECODE_MAX_TOKENS` tokens, prepared for the AVX2 level.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode_rows(c: &Ctx, r0: usize, r1: usize, res: &mut [f32], s: &mut Scratch) {
    let nt = c.tokens;
    // SAFETY (all calls below): the CPU features are guaranteed by the caller; every kernel
    // checks the shapes it relies on itself.
    unsafe {
        match c.kind {
            // The same accumulators for every token count: a row's sum is then the same
            // alone and in a batch (requests decoding together get their results alone).
            Kind::F32 => nt_dispatch!(nt, dense_rows::<DT_F32, 2>(c, r0, r1, res)),
            Kind::F16 => nt_dispatch!(nt, dense_rows::<DT_F16, 2>(c, r0, r1, res)),
            Kind::Bf16 => nt_dispatch!(nt, dense_rows::<DT_BF16, 2>(c, r0, r1, res)),
            // Integer path (`Kernels::Fast`).
            Kind::Q4 { gs, sdt } if !c.xq.is_empty() => match gs {
                32 => nt_dispatch!(nt, q4i_rows::<32>(c, sdt, r0, r1, res, s)),
                64 => nt_dispatch!(nt, q4i_rows::<64>(c, sdt, r0, r1, res, s)),
                _ => nt_dispatch!(nt, q4i_rows::<128>(c, sdt, r0, r1, res, s)),
            },
            Kind::Q4 { gs, sdt } => match gs {
                32 => nt_dispatch!(nt, q4_rows::<32>(c, sdt, r0, r1, res, s)),
                64 => nt_dispatch!(nt, q4_rows::<64>(c, sdt, r0, r1, res, s)),
                _ => nt_dispatch!(nt, q4_rows::<128>(c, sdt, r0, r1, res, s)),
            },
            Kind::Q8 { gs: 16, sdt } => match nt {
                1 => q8g16_rows::<1, 4, 8>(c, sdt, r0, r1, res, s),
                _ => nt_dispatch!(nt, q8g16_rows::<2, 8>(c, sdt, r0, r1, res, s)),
            },
            Kind::Q8 { gs, sdt } => match gs {
                32 => nt_dispatch!(nt, q8_rows::<32, 8>(c, sdt, r0, r1, res, s)),
                64 => nt_dispatch!(nt, q8_rows::<64, 8>(c, sdt, r0, r1, res, s)),
                _ => nt_dispatch!(nt, q8_rows::<128, 8>(c, sdt, r0, r1, res, s)),
            },
            Kind::QBits { bits, gs, sdt } => match bits {
                2 => qbits_rows::<2>(c, gs, sdt, r0, r1, res, s),
                3 => qbits_rows::<3>(c, gs, sdt, r0, r1, res, s),
                5 => qbits_rows::<5>(c, gs, sdt, r0, r1, res, s),
                _ => qbits_rows::<6>(c, gs, sdt, r0, r1, res, s),
            },
            Kind::QAny if c.w.format == WeightFormat::Mxfp4 => mxfp4_rows(c, r0, r1, res),
            Kind::QAny => portable::decode_rows(c, r0, r1, res, s),
        }
    }
}

/// Dense rows dotted with `NT` tokens, `U` accumulators per token.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `c.w` must be validated and of dtype `DT`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dense_rows<const NT: usize, const DT: u8, const U: usize>(
    c: &Ctx,
    r0: usize,
    r1: usize,
    res: &mut [f32],
) {
    let (w, cols, n) = (&c.w, c.w.cols, r1 - r0);
    let sz = if DT == DT_F32 { 4 } else { 2 };
    let rb = w.row_bytes();
    assert!(c.tokens == NT && r1 <= w.rows && rb == cols * sz);
    assert!(c.x.len() >= NT * cols && res.len() >= NT * n);
    let x = c.x.as_ptr();
    for r in r0..r1 {
        let row = &w.data[r * rb..(r + 1) * rb];
        let rp = row.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); NT]; U];
        let mut i = 0;
        // SAFETY: every load reads columns `i..i + 8` with `i + 8 <= cols`: inside the row
        // (`cols * sz` bytes) and inside each token's `cols` floats of `x`.
        unsafe {
            while i + 8 * U <= cols {
                for (u, acc) in acc.iter_mut().enumerate() {
                    let wv = ld8::<DT>(rp.add((i + 8 * u) * sz));
                    for (t, a) in acc.iter_mut().enumerate() {
                        let xv = _mm256_loadu_ps(x.add(t * cols + i + 8 * u));
                        *a = _mm256_fmadd_ps(wv, xv, *a);
                    }
                }
                i += 8 * U;
            }
            while i + 8 <= cols {
                let wv = ld8::<DT>(rp.add(i * sz));
                for (t, a) in acc[0].iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.add(t * cols + i)), *a);
                }
                i += 8;
            }
        }
        let dt = match DT {
            DT_F32 => Dtype::F32,
            DT_F16 => Dtype::F16,
            _ => Dtype::Bf16,
        };
        for t in 0..NT {
            let mut v = acc[0][t];
            for a in &acc[1..] {
                v = _mm256_add_ps(v, a[t]);
            }
            let mut y = hsum(v);
            for j in i..cols {
                y += scalar(dt, row, j) * c.x[t * cols + j];
            }
            res[t * n + r - r0] = y;
        }
    }
}

/// One 64-column block of a 4-bit row (`v`: 8 words) against `NT` permuted, scaled tokens at
/// `xb` (stride `ldxp`), scaled per lane by `sv` and added to `y`. Nibble `k < 7` is taken as
/// `v & (15 << 4k)` = `q * 2^4k` (the permuted `x` carries the `2^-4k`), the last by a shift.
///
/// # Safety
/// 64 floats must be readable at `xb + t * ldxp` for every `t < NT`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q4_block<const NT: usize>(
    v: __m256i,
    xb: *const f32,
    ldxp: usize,
    sv: __m256,
    y: &mut [__m256; NT],
) {
    let mut a0 = [_mm256_setzero_ps(); NT];
    let mut a1 = [_mm256_setzero_ps(); NT];
    macro_rules! step {
        ($k:literal, $q:expr, $acc:ident) => {{
            let q = _mm256_cvtepi32_ps($q);
            for (t, a) in $acc.iter_mut().enumerate() {
                // SAFETY: the caller guarantees 64 readable floats per token at `xb`.
                let xv = unsafe { _mm256_loadu_ps(xb.add(t * ldxp + 8 * $k)) };
                *a = _mm256_fmadd_ps(q, xv, *a);
            }
        }};
    }
    macro_rules! nib {
        ($k:literal) => {
            _mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * $k)))
        };
    }
    step!(0, nib!(0), a0);
    step!(1, nib!(1), a1);
    step!(2, nib!(2), a0);
    step!(3, nib!(3), a1);
    step!(4, nib!(4), a0);
    step!(5, nib!(5), a1);
    step!(6, nib!(6), a0);
    step!(7, _mm256_srli_epi32::<28>(v), a1);
    for t in 0..NT {
        y[t] = _mm256_fmadd_ps(_mm256_add_ps(a0[t], a1[t]), sv, y[t]);
    }
}

/// Scales of the 8 lanes (words) of 64-column block `b`: `sp` is the row's scales as f32.
///
/// # Safety
/// `sp` must have `2 * b + 2` readable floats (group size 32), `b + 1` (64) or `b / 2 + 1` (128).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn q4_scales<const GS: usize>(sp: *const f32, b: usize) -> __m256 {
    // SAFETY: forwarded from the caller.
    unsafe {
        match GS {
            32 => _mm256_blend_ps::<0xF0>(
                _mm256_set1_ps(*sp.add(2 * b)),
                _mm256_set1_ps(*sp.add(2 * b + 1)),
            ),
            64 => _mm256_set1_ps(*sp.add(b)),
            _ => _mm256_set1_ps(*sp.add(b / 2)),
        }
    }
}

/// 4-bit rows (group size `GS`) against `NT` tokens permuted (and scaled) in blocks of 8 words.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `c` must be a validated 4-bit job with group size
/// `GS` and `NT` tokens, prepared for this level.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_rows<const NT: usize, const GS: usize>(
    c: &Ctx,
    sdt: Dtype,
    r0: usize,
    r1: usize,
    res: &mut [f32],
    s: &mut Scratch,
) {
    let w = &c.w;
    let (cols, n) = (w.cols, r1 - r0);
    let groups = cols / GS;
    let rb = w.row_bytes();
    let (xp, ldxp, xsum) = (c.xp, c.ldxp, c.xsum);
    let nblk = cols / 64;
    let tail = !cols.is_multiple_of(64);
    assert!(c.tokens == NT && r1 <= w.rows && rb * 2 == cols && cols.is_multiple_of(GS));
    assert!(ldxp >= cols.div_ceil(64) * 64 && xp.len() >= NT * ldxp);
    assert!(xsum.len() >= NT * groups && res.len() >= NT * n);
    // Only group size 32 can leave half a block (32 columns) over.
    assert!(!tail || GS == 32);
    let sfb = grow(&mut s.a, ROW_CHUNK * groups + 8);
    let bfb = grow(&mut s.b, ROW_CHUNK * groups);
    let mut ch = r0;
    while ch < r1 {
        let nc = ROW_CHUNK.min(r1 - ch);
        chunk_scales(w, sdt, ch, nc, 8, sfb, bfb);
        for i in 0..nc {
            let r = ch + i;
            let row = &w.data[r * rb..(r + 1) * rb];
            let mut y = bias_part::<NT>(&bfb[i * groups..(i + 1) * groups], xsum, groups);
            let sf = &sfb[i * groups..(i + 1) * groups + 8];
            let (rp, xq, sp) = (row.as_ptr(), xp.as_ptr(), sf.as_ptr());
            // SAFETY: block `b < nblk` reads row bytes `32b..32b + 32` (the row has `cols / 2
            // >= 32 * nblk`), the tail reads the last 16; tokens' permuted rows have `ldxp >=
            // 64 * (nblk + 1)` floats when there is a tail, else `>= 64 * nblk`; scale reads
            // stay below `groups + 2` and `sf` has `groups + 8`.
            unsafe {
                for b in 0..nblk {
                    if PREFETCH > 0 && b % 2 == 0 {
                        _mm_prefetch::<_MM_HINT_T0>(rp.wrapping_add(32 * b + PREFETCH) as *const i8);
                    }
                    let v = _mm256_loadu_si256(rp.add(32 * b) as *const __m256i);
                    q4_block::<NT>(v, xq.add(64 * b), ldxp, q4_scales::<GS>(sp, b), &mut y);
                }
                if tail {
                    let v = _mm256_zextsi128_si256(_mm_loadu_si128(
                        rp.add(32 * nblk) as *const __m128i
                    ));
                    // Lanes 4..8 are past the row: give them a zero scale.
                    let sv =
                        _mm256_blend_ps::<0xF0>(q4_scales::<GS>(sp, nblk), _mm256_setzero_ps());
                    q4_block::<NT>(v, xq.add(64 * nblk), ldxp, sv, &mut y);
                }
            }
            for t in 0..NT {
                res[t * n + r - r0] = hsum(y[t]);
            }
        }
        ch += nc;
    }
}

/// The most streams [`decode_streams`] may ask for.
const MAX_STREAMS: usize = 4;

/// Streams the 4- and 8-bit decode kernels walk a task's rows as (the 8-bit ones at most 2): 2,
/// or `SLUICE_DECODE_STREAMS` (1-4, read once; for tuning). Two streams keep twice the bytes in
/// flight per core. Qwen3-30B-A3B shape, tg: 4-bit +13-16% on a 2-core Xeon VM (3 and 4 streams
/// no better than 2); on the lent 16-core Xeon +23% at 2 threads, +16% at 4, +1.5% at 8 and +3%
/// at 16 (within its noise); 8-bit there +13% at 2 threads, +3% at 8, +1.5% at 16.
pub(super) fn decode_streams() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("SLUICE_DECODE_STREAMS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(2)
            .clamp(1, MAX_STREAMS)
    })
}

/// A task's rows `r0..r0 + n` cut into up to [`MAX_STREAMS`] contiguous streams of `na` rows
/// each (the last may have fewer), walked [`ROW_CHUNK`] rows of every stream at a time: the
/// bookkeeping the multi-stream decode kernels share.
#[derive(Clone, Copy)]
pub(super) struct Streams {
    r0: usize,
    n: usize,
    ns: usize,
    na: usize,
}

impl Streams {
    /// Rows `r0..r1` as `ns` streams (at least 1, at most [`MAX_STREAMS`] and one per row).
    pub(super) fn new(r0: usize, r1: usize, ns: usize) -> Self {
        let n = r1 - r0;
        let ns = ns.clamp(1, MAX_STREAMS).min(n.max(1));
        Self {
            r0,
            n,
            ns,
            na: n.div_ceil(ns),
        }
    }

    /// How many streams.
    pub(super) fn count(&self) -> usize {
        self.ns
    }

    /// Asks for the start of every stream of `w` (rows of `w.row_bytes()`): its first
    /// [`PREFETCH`] bytes, which the kernels' own prefetches (that far ahead of their reads)
    /// never cover, and its first chunk's scales and biases (`srb` bytes a row). Tasks are
    /// short at many threads (down to 16 KiB), so a task's start is a good part of its reads.
    /// Lent 16-core Xeon, Qwen3-30B-A3B shape at 4 bits, tg, on against off in one call: faster
    /// in all 6 pairs, 16 threads +5% / +2%, 8 threads +5% and more, 4 +3%, 2 +6%; on the 2-core
    /// VM within its noise (first 8 layers, 6 alternating pairs: mean 39.97 tok/s on, 39.32 off).
    pub(super) fn warm(&self, w: &MatRef, srb: usize) {
        let rb = w.row_bytes();
        for k in 0..self.ns {
            let first = self.r0 + k * self.na;
            let rows = self.na.min(self.n.saturating_sub(k * self.na));
            prefetch_bytes(w.data, first * rb, PREFETCH.min(rows * rb));
            prefetch_bytes(w.scales, first * srb, ROW_CHUNK.min(rows) * srb);
            prefetch_bytes(w.biases, first * srb, ROW_CHUNK.min(rows) * srb);
        }
    }

    /// The chunks in order; each holds `ROW_CHUNK` rows of every stream (fewer at the end).
    pub(super) fn chunks(self) -> impl Iterator<Item = Chunk> {
        (0..self.na).step_by(ROW_CHUNK).map(move |i0| {
            let nca = ROW_CHUNK.min(self.na - i0);
            let rows = std::array::from_fn(|k| {
                if k < self.ns {
                    nca.min(self.n.saturating_sub(k * self.na).saturating_sub(i0))
                } else {
                    0
                }
            });
            Chunk { s: self, i0, rows }
        })
    }
}

/// One chunk of [`Streams`]: `rows(k)` rows of stream `k` from row `first(k)`.
pub(super) struct Chunk {
    s: Streams,
    i0: usize,
    rows: [usize; MAX_STREAMS],
}

impl Chunk {
    /// Rows of stream `k` in this chunk (non-increasing in `k`; 0 past the last stream).
    pub(super) fn rows(&self, k: usize) -> usize {
        self.rows[k]
    }

    /// The first row (of the matrix) of stream `k` in this chunk.
    pub(super) fn first(&self, k: usize) -> usize {
        self.s.r0 + k * self.s.na + self.i0
    }

    /// The most rows a stream has in this chunk (stream 0's).
    pub(super) fn len(&self) -> usize {
        self.rows[0]
    }

    /// How many streams have an `i`-th row in this chunk (the first that many).
    pub(super) fn live(&self, i: usize) -> usize {
        self.rows.iter().filter(|&&c| c > i).count()
    }
}

/// The integer 4-bit decode (`Kernels::Fast`) in blocks of 32 weight bytes, in two flavours
/// that differ only in how a block's 64 nibble x byte products become 8 lane sums (one lane per
/// word, scaled per lane), so one macro writes both: `$dot(lo, hi, xe, xo)` takes the low and
/// high nibbles as bytes and the even and odd activations.
///
/// A task's rows are walked as [`decode_streams`] streams, a contiguous part each, a row of
/// each at a time: more bytes in flight per core for the same work; each row is summed in the
/// same order as alone, so the results are the same bits.
macro_rules! q4i_rows {
    ($name:ident, $rows_at:ident, $features:literal, $dot:ident) => {
        /// `NS` rows at once (row `k` at `rp[k]`, its scales at `sp[k]`), each accumulated onto
        /// `y[k]` (one vector per token).
        ///
        /// # Safety
        /// As [`$name`]'s: every `rp[k]` has `nblk` blocks of 32 bytes (and 16 more with `tail`),
        /// every `sp[k]` the scales `q4_scales` reads for blocks `..=nblk`; `xq`/`xd` hold `NT`
        /// tokens at strides `ldxq`/`ldxd` with `nblk` (+ 1 with `tail`) blocks each.
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $rows_at<const NT: usize, const GS: usize, const NS: usize>(
            rp: [*const u8; NS],
            sp: [*const f32; NS],
            y: &mut [[__m256; NT]; NS],
            xq: *const i8,
            xd: *const f32,
            (ldxq, ldxd): (usize, usize),
            nblk: usize,
            tail: bool,
        ) {
            let nibble = _mm256_set1_epi8(0x0F);
            // SAFETY: forwarded from the caller (see above).
            unsafe {
                let block = |y: &mut [__m256; NT], b: usize, v: __m256i, sv: __m256| {
                    let lo = _mm256_and_si256(v, nibble);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), nibble);
                    for (t, y) in y.iter_mut().enumerate() {
                        let xb = xq.add(t * ldxq + 64 * b);
                        let xe = _mm256_loadu_si256(xb as *const __m256i);
                        let xo = _mm256_loadu_si256(xb.add(32) as *const __m256i);
                        let sum = _mm256_cvtepi32_ps($dot(lo, hi, xe, xo));
                        let d = _mm256_mul_ps(sv, _mm256_loadu_ps(xd.add(t * ldxd + 8 * b)));
                        *y = _mm256_fmadd_ps(sum, d, *y);
                    }
                };
                for b in 0..nblk {
                    for k in 0..NS {
                        if PREFETCH > 0 && b % 2 == 0 {
                            _mm_prefetch::<_MM_HINT_T0>(
                                rp[k].wrapping_add(32 * b + PREFETCH) as *const i8
                            );
                        }
                        let v = _mm256_loadu_si256(rp[k].add(32 * b) as *const __m256i);
                        block(&mut y[k], b, v, q4_scales::<GS>(sp[k], b));
                    }
                }
                if tail {
                    for k in 0..NS {
                        let v = _mm256_zextsi128_si256(_mm_loadu_si128(
                            rp[k].add(32 * nblk) as *const __m128i
                        ));
                        // Lanes 4..8 are past the row: give them a zero scale.
                        let sv = _mm256_blend_ps::<0xF0>(
                            q4_scales::<GS>(sp[k], nblk),
                            _mm256_setzero_ps(),
                        );
                        block(&mut y[k], nblk, v, sv);
                    }
                }
            }
        }

        /// 4-bit rows (group size `GS`) against `NT` tokens quantized to 8 bits in blocks of 32
        /// weight bytes (see `quantize_q4i`), products summed in 32-bit integers per word.
        ///
        /// # Safety
        /// The CPU must support the features enabled here; `c` must be a validated 4-bit job
        /// with group size `GS` and `NT` tokens, prepared by `quantize_q4i` with 32-byte blocks.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<const NT: usize, const GS: usize>(
            c: &Ctx,
            sdt: Dtype,
            r0: usize,
            r1: usize,
            res: &mut [f32],
            s: &mut Scratch,
        ) {
            let w = &c.w;
            let (cols, n) = (w.cols, r1 - r0);
            let groups = cols / GS;
            let (rb, srb) = (w.row_bytes(), groups * sdt.size());
            let (ldxq, ldxd, xsum) = (c.ldxq, c.ldxq / 8, c.xsum);
            let nblk = cols / 64;
            let tail = !cols.is_multiple_of(64);
            assert!(c.tokens == NT && r1 <= w.rows && rb * 2 == cols && cols.is_multiple_of(GS));
            assert!(ldxq >= cols.div_ceil(64) * 64 && c.xq.len() >= NT * ldxq);
            assert!(c.xd.len() >= NT * ldxd && xsum.len() >= NT * groups && res.len() >= NT * n);
            // Only group size 32 can leave half a block (32 columns) over.
            assert!(!tail || GS == 32);
            let streams = Streams::new(r0, r1, decode_streams());
            streams.warm(w, srb);
            let per = ROW_CHUNK * groups + 8;
            let sfs = grow(&mut s.a, MAX_STREAMS * per);
            let bfs = grow(&mut s.b, MAX_STREAMS * ROW_CHUNK * groups);
            let (xq, xd) = (c.xq.as_ptr() as *const i8, c.xd.as_ptr());
            let row = |r: usize| w.data[r * rb..(r + 1) * rb].as_ptr();
            for chunk in streams.chunks() {
                for k in 0..streams.count() {
                    let (ch, nc) = (chunk.first(k), chunk.rows(k));
                    if nc > 0 {
                        let (sf, bf) = (&mut sfs[k * per..], &mut bfs[k * ROW_CHUNK * groups..]);
                        chunk_scales(w, sdt, ch, nc, 8, sf, bf);
                        prefetch_bytes(w.scales, (ch + nc) * srb, ROW_CHUNK * srb);
                        prefetch_bytes(w.biases, (ch + nc) * srb, ROW_CHUNK * srb);
                    }
                }
                for i in 0..chunk.len() {
                    let r = |k: usize| chunk.first(k) + i;
                    let y0 = |k: usize| {
                        let bf = &bfs[k * ROW_CHUNK * groups + i * groups..][..groups];
                        bias_part::<NT>(bf, xsum, groups)
                    };
                    let sp = |k: usize| sfs[k * per + i * groups..][..groups + 8].as_ptr();
                    // SAFETY: each row pointer is a whole row of `w` (`rb = cols / 2` bytes, so
                    // `nblk` blocks of 32 and the tail's 16); its scales slice has `groups + 8`
                    // floats, past any block's reads; every token's activations have `ldxq >=
                    // 64 * (nblk + 1)` bytes with a tail (else `64 * nblk`) and `ldxq / 8` scales
                    // (asserted above).
                    macro_rules! rows {
                        ($m:literal) => {{
                            let mut y: [[__m256; NT]; $m] = std::array::from_fn(y0);
                            unsafe {
                                $rows_at::<NT, GS, $m>(
                                    std::array::from_fn(|k| row(r(k))),
                                    std::array::from_fn(sp),
                                    &mut y,
                                    xq,
                                    xd,
                                    (ldxq, ldxd),
                                    nblk,
                                    tail,
                                )
                            };
                            for (k, y) in y.iter().enumerate() {
                                for t in 0..NT {
                                    res[t * n + r(k) - r0] = hsum(y[t]);
                                }
                            }
                        }};
                    }
                    match chunk.live(i) {
                        1 => rows!(1),
                        2 => rows!(2),
                        3 => rows!(3),
                        _ => rows!(4),
                    }
                }
            }
        }
    };
}

/// Lane sums of a block's products with AVX2: `vpmaddubsw` multiplies nibbles (unsigned) by
/// activations (signed) and adds pairs to 16 bits (at most 2 x 15 x 127, so the low and high
/// halves add without saturating), `vpmaddwd` adds pairs to 32 bits.
#[target_feature(enable = "avx2")]
#[inline]
fn dot_maddubs(lo: __m256i, hi: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
    let pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

/// Lane sums of a block's products with AVX-512 VNNI on 256-bit vectors: four u8 x i8 products
/// per instruction and lane. (Measured on Zen 4, 30B shape: 256-bit blocks decode ~9% faster
/// than 512-bit ones, 2 threads; 18.5-19.4 against 13.6-16.1 GB/s on a cold expert batch, 1
/// thread. Unaligned 64-byte loads splitting cache lines is a guess at why.)
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
fn dot_vnni(lo: __m256i, hi: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xe), hi, xo)
}

q4i_rows!(q4i_rows, q4i_rows_at, "avx2,fma,f16c", dot_maddubs);
q4i_rows!(
    q4i_rows_vnni,
    q4i_rows_vnni_at,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    dot_vnni
);
/// The shuffle and multipliers that turn 16 `BITS`-bit codes (little-endian bit stream, the
/// first at bit 0 of the 16 bytes loaded into both halves of a vector) into 16 u16 lanes: lane
/// `j` takes bytes `jB/8` and `jB/8 + 1` (`B = BITS`), and multiplying by `2^(16 - B - jB%8)`
/// moves its code to the top `B` bits of the lane (the bits above it fall off), whence one
/// shift right by `16 - B` brings it down.
struct Unpack<const BITS: usize>;

impl<const BITS: usize> Unpack<BITS> {
    const SHUF: [u8; 32] = {
        let mut t = [0u8; 32];
        let mut j = 0;
        while j < 16 {
            let lo = (j * BITS / 8) as u8;
            t[2 * j] = lo;
            t[2 * j + 1] = lo + 1;
            j += 1;
        }
        t
    };
    const MUL: [u16; 16] = {
        let mut t = [0u16; 16];
        let mut j = 0;
        while j < 16 {
            t[j] = 1 << (16 - BITS - (j * BITS) % 8);
            j += 1;
        }
        t
    };
}

/// 16 codes of `BITS` bits from the first `2 * BITS` of the 16 bytes at `p`, as u16 lanes.
///
/// # Safety
/// The CPU must support AVX2; 16 bytes must be readable at `p`.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack16<const BITS: usize>(p: *const u8, shuf: __m256i, mul: __m256i) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at `p`.
    let v = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p as *const __m128i)) };
    let v = _mm256_mullo_epi16(_mm256_shuffle_epi8(v, shuf), mul);
    _mm256_srl_epi16(v, _mm_cvtsi32_si128(16 - BITS as i32))
}

/// The `BITS`-bit codes of `src` (a row's little-endian bit stream, `2 <= BITS <= 6`) as one
/// byte each into `dst` (`dst.len()` codes, a multiple of 16, all of them in `src`). Prefetches
/// `src` `PREFETCH` bytes ahead, as the 8-bit kernels do their rows.
#[target_feature(enable = "avx2")]
pub(super) fn unpack_codes<const BITS: usize>(src: &[u8], dst: &mut [u8]) {
    let n = dst.len();
    assert!((2..=6).contains(&BITS) && n.is_multiple_of(16) && n * BITS <= 8 * src.len());
    // SAFETY: `SHUF` and `MUL` are 32 bytes each.
    let (shuf, mul) = unsafe {
        (
            _mm256_loadu_si256(Unpack::<BITS>::SHUF.as_ptr() as *const __m256i),
            _mm256_loadu_si256(Unpack::<BITS>::MUL.as_ptr() as *const __m256i),
        )
    };
    let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
    // Codes `32k..32k + 32` are bytes `4Bk..4B(k + 1)` of `src`; the two loads of 16 bytes
    // (at `4Bk` and `4Bk + 2B`) stay inside `src` while `4Bk + 2B + 16 <= src.len()`.
    let mut i = 0;
    while i + 32 <= n && (i + 16) * BITS / 8 + 16 <= src.len() {
        let b = i * BITS / 8;
        _mm_prefetch::<_MM_HINT_T0>(sp.wrapping_add(b + PREFETCH) as *const i8);
        // SAFETY: the loads read bytes `b..b + 2B + 16` of `src` (checked by the loop
        // condition); the store writes codes `i..i + 32 <= n` of `dst`.
        unsafe {
            let a = unpack16::<BITS>(sp.add(b), shuf, mul);
            let c = unpack16::<BITS>(sp.add(b + 2 * BITS), shuf, mul);
            // Qwords [a0..8, c0..8, a8..16, c8..16] put in order.
            let v = _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi16(a, c));
            _mm256_storeu_si256(dp.add(i) as *mut __m256i, v);
        }
        i += 32;
    }
    // The last codes, 16 at a time, from a copy padded to 16 readable bytes.
    while i < n {
        let b = i * BITS / 8;
        let mut buf = [0u8; 16];
        buf[..2 * BITS].copy_from_slice(&src[b..b + 2 * BITS]);
        // SAFETY: `buf` has 16 bytes; the store writes codes `i..i + 16 <= n` of `dst`.
        unsafe {
            let a = unpack16::<BITS>(buf.as_ptr(), shuf, mul);
            let v = _mm256_permute4x64_epi64::<0xD8>(_mm256_packus_epi16(a, a));
            _mm_storeu_si128(dp.add(i) as *mut __m128i, _mm256_castsi256_si128(v));
        }
        i += 16;
    }
}

/// The codes of row `r` of `w`, one byte each: the row itself for 8-bit weights, else unpacked
/// into `buf` (grown to `cols` bytes).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn row_codes<'a, const BITS: usize>(
    w: &'a MatRef,
    r: usize,
    buf: &'a mut Vec<u8>,
) -> &'a [u8] {
    let (rb, cols) = (w.row_bytes(), w.cols);
    let row = &w.data[r * rb..(r + 1) * rb];
    if BITS == 8 {
        return row;
    }
    if buf.len() < cols {
        buf.resize(cols, 0);
    }
    let dst = &mut buf[..cols];
    match BITS {
        2 => unpack_codes::<2>(row, dst),
        3 => unpack_codes::<3>(row, dst),
        5 => unpack_codes::<5>(row, dst),
        _ => unpack_codes::<6>(row, dst),
    }
    dst
}

/// Decode of 2-, 3-, 5- and 6-bit rows ([`Kind::QBits`]): each row's codes are unpacked to
/// bytes ([`unpack_codes`]) and go through the 8-bit kernels.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `c` must be a validated job of `BITS`-bit weights
/// with group size `gs` and at most `DECODE_MAX_TOKENS` tokens, prepared with per-group sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qbits_rows<const BITS: usize>(
    c: &Ctx,
    gs: usize,
    sdt: Dtype,
    r0: usize,
    r1: usize,
    res: &mut [f32],
    s: &mut Scratch,
) {
    let nt = c.tokens;
    // SAFETY: forwarded from the caller; the kernels check the shapes themselves.
    unsafe {
        match gs {
            16 => match nt {
                1 => q8g16_rows::<1, 4, BITS>(c, sdt, r0, r1, res, s),
                _ => nt_dispatch!(nt, q8g16_rows::<2, BITS>(c, sdt, r0, r1, res, s)),
            },
            32 => nt_dispatch!(nt, q8_rows::<32, BITS>(c, sdt, r0, r1, res, s)),
            64 => nt_dispatch!(nt, q8_rows::<64, BITS>(c, sdt, r0, r1, res, s)),
            _ => nt_dispatch!(nt, q8_rows::<128, BITS>(c, sdt, r0, r1, res, s)),
        }
    }
}

/// The 8-bit decode driver (group sizes 32-128) for one vector width: `$groups` is that
/// width's `q8_groups`, `$bias` its `bias_part`, `$reduce` its horizontal sum; the rows are
/// walked as up to [`Q8_MAX_STREAMS`] streams (see [`Streams`]).
macro_rules! q8_rows_driver {
    ($features:literal, $groups:ident, $bias:ident, $reduce:ident) => {
        /// 8-bit rows (group size `GS`) against `NT` tokens in natural order.
        ///
        /// # Safety
        /// The CPU must support the features enabled here; `c` must be a validated 8-bit job
        /// with group size `GS` and `NT` tokens, prepared with per-group sums.
        #[target_feature(enable = $features)]
        unsafe fn q8_rows<const NT: usize, const GS: usize, const BITS: usize>(
            c: &Ctx,
            sdt: Dtype,
            r0: usize,
            r1: usize,
            res: &mut [f32],
            s: &mut Scratch,
        ) {
            let w = &c.w;
            let (cols, n) = (w.cols, r1 - r0);
            let groups = cols / GS;
            let rb = w.row_bytes();
            let xsum = c.xsum;
            assert!(
                c.tokens == NT && r1 <= w.rows && rb * 8 == cols * BITS && cols.is_multiple_of(GS)
            );
            assert!(c.x.len() >= NT * cols && xsum.len() >= NT * groups && res.len() >= NT * n);
            let x = c.x.as_ptr();
            // Unpacked codes (BITS < 8) share one buffer: one stream.
            let ns = if BITS == 8 {
                super::avx2::decode_streams().min(super::avx2::Q8_MAX_STREAMS)
            } else {
                1
            };
            let streams = super::avx2::Streams::new(r0, r1, ns);
            if BITS == 8 {
                streams.warm(w, w.format.scale_row_bytes(cols));
            }
            let per = ROW_CHUNK * groups;
            let sfs = grow(&mut s.a, super::avx2::Q8_MAX_STREAMS * per);
            let bfs = grow(&mut s.b, super::avx2::Q8_MAX_STREAMS * per);
            for chunk in streams.chunks() {
                for k in 0..streams.count() {
                    if chunk.rows(k) > 0 {
                        let (sf, bf) = (&mut sfs[k * per..], &mut bfs[k * per..]);
                        chunk_scales(w, sdt, chunk.first(k), chunk.rows(k), 0, sf, bf);
                    }
                }
                for i in 0..chunk.len() {
                    let r = |k: usize| chunk.first(k) + i;
                    let y0 = |k: usize| {
                        $bias::<NT>(&bfs[k * per + i * groups..][..groups], xsum, groups)
                    };
                    let sf = |k: usize| &sfs[k * per + i * groups..][..groups];
                    if chunk.live(i) == 2 {
                        let mut y = [y0(0), y0(1)];
                        let rp = [w.data[r(0) * rb..].as_ptr(), w.data[r(1) * rb..].as_ptr()];
                        // SAFETY: both rows are whole rows of `w` (8-bit: `cols` bytes each);
                        // `x` has `cols` floats per token (asserted above).
                        unsafe { $groups::<NT, GS, 2>(rp, [sf(0), sf(1)], &mut y, x, cols, false) };
                        for (k, y) in y.iter().enumerate() {
                            for t in 0..NT {
                                res[t * n + r(k) - r0] = $reduce(y[t]);
                            }
                        }
                    } else {
                        let row = row_codes::<BITS>(w, r(0), &mut s.codes);
                        let mut y = [y0(0)];
                        // SAFETY: `row` has `cols` codes (a row of `w`, or its codes unpacked to
                        // bytes), `x` `cols` floats per token (asserted above).
                        unsafe {
                            $groups::<NT, GS, 1>([row.as_ptr()], [sf(0)], &mut y, x, cols, BITS < 8)
                        };
                        for t in 0..NT {
                            res[t * n + r(0) - r0] = $reduce(y[0][t]);
                        }
                    }
                }
            }
        }
    };
}
pub(super) use q8_rows_driver;

q8_rows_driver!("avx2,fma,f16c", q8_groups, bias_part, hsum);

/// The most streams the 8-bit decode walks a task's rows as ([`decode_streams`]).
pub(super) const Q8_MAX_STREAMS: usize = 2;

/// `NS` rows of 8-bit codes at once (row `k` at `rp[k]`, its group scales `sf[k]`), each
/// accumulated onto `y[k]`, group by group; `unpacked`: the codes are in cache already (no
/// prefetch).
///
/// # Safety
/// The CPU must support AVX2 and FMA; every `rp[k]` has `cols` bytes, `x` `cols` floats per token
/// for `NT` tokens, and `sf[k]` one scale per group of `GS`.
#[target_feature(enable = "avx2,fma,f16c")]
// `g` walks the groups of several rows (and their scales) at once.
#[allow(clippy::needless_range_loop)]
unsafe fn q8_groups<const NT: usize, const GS: usize, const NS: usize>(
    rp: [*const u8; NS],
    sf: [&[f32]; NS],
    y: &mut [[__m256; NT]; NS],
    x: *const f32,
    cols: usize,
    unpacked: bool,
) {
    for g in 0..cols / GS {
        for k in 0..NS {
            if !unpacked {
                _mm_prefetch::<_MM_HINT_T0>(rp[k].wrapping_add(g * GS + PREFETCH) as *const i8);
            }
            let mut a0 = [_mm256_setzero_ps(); NT];
            let mut a1 = [_mm256_setzero_ps(); NT];
            let mut j = g * GS;
            // SAFETY: columns `j..j + 16` stay inside group `g`, so inside the row and each
            // token's `cols` floats (the caller's contract).
            unsafe {
                while j < (g + 1) * GS {
                    let q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        rp[k].add(j) as *const __m128i,
                    )));
                    let q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        rp[k].add(j + 8) as *const __m128i,
                    )));
                    for t in 0..NT {
                        let xt = x.add(t * cols + j);
                        a0[t] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(xt), a0[t]);
                        a1[t] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(xt.add(8)), a1[t]);
                    }
                    j += 16;
                }
            }
            let sv = _mm256_set1_ps(sf[k][g]);
            for t in 0..NT {
                y[k][t] = _mm256_fmadd_ps(_mm256_add_ps(a0[t], a1[t]), sv, y[k][t]);
            }
        }
    }
}

/// 8-bit rows of group size 16 against `NT` tokens in natural order. A group is two vectors of
/// 8 codes: too few to pay for a sum per group and token that is then scaled (as [`q8_rows`]
/// does), so each group's codes are scaled once, for all tokens, and the products summed over
/// the whole row: per 8 weights a conversion and a multiply, then an FMA per token. Steps of
/// 2 groups (4 vectors) spread over `U` accumulators per token (4 for one token, whose chains
/// of FMAs would otherwise wait on their latency).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `c` must be a validated 8-bit job with group size
/// 16 and `NT` tokens, prepared with per-group sums.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8g16_rows<const NT: usize, const U: usize, const BITS: usize>(
    c: &Ctx,
    sdt: Dtype,
    r0: usize,
    r1: usize,
    res: &mut [f32],
    s: &mut Scratch,
) {
    const GS: usize = 16;
    let w = &c.w;
    let (cols, n) = (w.cols, r1 - r0);
    let groups = cols / GS;
    let rb = w.row_bytes();
    let xsum = c.xsum;
    assert!(c.tokens == NT && r1 <= w.rows && rb * 8 == cols * BITS && cols.is_multiple_of(GS));
    assert!(c.x.len() >= NT * cols && xsum.len() >= NT * groups && res.len() >= NT * n);
    assert!((1..=4).contains(&U));
    let x = c.x.as_ptr();
    let sfb = grow(&mut s.a, ROW_CHUNK * groups);
    let bfb = grow(&mut s.b, ROW_CHUNK * groups);
    let steps = groups / 2;
    let mut ch = r0;
    while ch < r1 {
        let nc = ROW_CHUNK.min(r1 - ch);
        chunk_scales(w, sdt, ch, nc, 0, sfb, bfb);
        for i in 0..nc {
            let r = ch + i;
            let row = row_codes::<BITS>(w, r, &mut s.codes);
            let y = bias_part::<NT>(&bfb[i * groups..(i + 1) * groups], xsum, groups);
            let sf = &sfb[i * groups..(i + 1) * groups];
            let (rp, sp) = (row.as_ptr(), sf.as_ptr());
            let mut acc = [[_mm256_setzero_ps(); NT]; U];
            // SAFETY: every half group read has `g < groups` and `h < 2`: its codes are row
            // bytes `16g + 8h..16g + 8h + 8 <= cols` (the row has `cols`), its activations the
            // same columns of each token's `cols` floats, its scale element `g` of `sf`
            // (`groups` floats).
            unsafe {
                let half = |g: usize, h: usize, a: &mut [__m256; NT]| {
                    let j = GS * g + 8 * h;
                    let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                        rp.add(j) as *const __m128i
                    )));
                    let wv = _mm256_mul_ps(q, _mm256_set1_ps(*sp.add(g)));
                    for (t, a) in a.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.add(t * cols + j)), *a);
                    }
                };
                for st in 0..steps {
                    if BITS == 8 && st % 2 == 0 {
                        _mm_prefetch::<_MM_HINT_T0>(
                            rp.wrapping_add(32 * st + PREFETCH) as *const i8
                        );
                    }
                    for v in 0..4 {
                        half(2 * st + v / 2, v % 2, &mut acc[v % U]);
                    }
                }
                if groups % 2 == 1 {
                    half(groups - 1, 0, &mut acc[0]);
                    half(groups - 1, 1, &mut acc[1 % U]);
                }
            }
            for t in 0..NT {
                let mut v = y[t];
                for a in &acc {
                    v = _mm256_add_ps(v, a[t]);
                }
                res[t * n + r - r0] = hsum(v);
            }
        }
        ch += nc;
    }
}

/// Row `r` of `w` as f32 (natural order).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `w` must be validated.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequant_row(w: &MatRef, r: usize, out: &mut [f32]) {
    let cols = w.cols;
    assert!(r < w.rows && out.len() == cols);
    let rb = w.row_bytes();
    let row = &w.data[r * rb..(r + 1) * rb];
    let op = out.as_mut_ptr();
    match Kind::of(w.format) {
        k @ (Kind::F32 | Kind::F16 | Kind::Bf16) => {
            let dt = match k {
                Kind::F32 => Dtype::F32,
                Kind::F16 => Dtype::F16,
                _ => Dtype::Bf16,
            };
            cvt_row(dt, row, out);
        }
        Kind::Q4 { gs, sdt } => {
            let groups = cols / gs;
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            let mask = _mm256_set1_epi32(15);
            for g in 0..groups {
                let s = _mm256_set1_ps(scalar(sdt, w.scales, r * groups + g));
                let b = _mm256_set1_ps(scalar(sdt, w.biases, r * groups + g));
                for wi in g * gs / 8..(g + 1) * gs / 8 {
                    let word = u32::from_le_bytes(row[4 * wi..4 * wi + 4].try_into().unwrap());
                    let q = _mm256_and_si256(
                        _mm256_srlv_epi32(_mm256_set1_epi32(word as i32), shifts),
                        mask,
                    );
                    // SAFETY: word `wi` holds columns `8wi..8wi + 8 <= cols` of `out`.
                    unsafe {
                        _mm256_storeu_ps(
                            op.add(8 * wi),
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, b),
                        )
                    };
                }
            }
        }
        Kind::Q8 { gs, sdt } => {
            let groups = cols / gs;
            for g in 0..groups {
                let s = _mm256_set1_ps(scalar(sdt, w.scales, r * groups + g));
                let b = _mm256_set1_ps(scalar(sdt, w.biases, r * groups + g));
                for i in (g * gs..(g + 1) * gs).step_by(8) {
                    // SAFETY: columns `i..i + 8` are inside group `g`, so inside the row's
                    // `cols` bytes and `out`.
                    unsafe {
                        let q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                            row.as_ptr().add(i) as *const __m128i
                        ));
                        _mm256_storeu_ps(op.add(i), _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, b));
                    }
                }
            }
        }
        Kind::QBits { .. } | Kind::QAny => portable::dequant_range(w, r, 0, out),
    }
}

// ---------------------------------------------------------------------------------------------
// Prefill: packing and micro-kernel
// ---------------------------------------------------------------------------------------------

/// Transposes an 8x8 matrix of 32-bit elements held in 8 vectors (row `i` in `v[i]`).
#[target_feature(enable = "avx2")]
#[inline]
fn transpose8(v: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(v[0], v[1]);
    let t1 = _mm256_unpackhi_ps(v[0], v[1]);
    let t2 = _mm256_unpacklo_ps(v[2], v[3]);
    let t3 = _mm256_unpackhi_ps(v[2], v[3]);
    let t4 = _mm256_unpacklo_ps(v[4], v[5]);
    let t5 = _mm256_unpackhi_ps(v[4], v[5]);
    let t6 = _mm256_unpacklo_ps(v[6], v[7]);
    let t7 = _mm256_unpackhi_ps(v[6], v[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}

/// Packs rows `rb..rb + nv` of `c.w` (`1 <= nv <= 8`; missing rows repeat the last) and
/// columns `k0..k0 + kc` into `dst[p * ld + off + i]` (`i < 8`). `k0` must be a multiple of 64.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) fn pack_sub(
    c: &Ctx,
    rb: usize,
    nv: usize,
    k0: usize,
    kc: usize,
    dst: &mut [f32],
    ld: usize,
    off: usize,
    tmp: &mut [f32],
) {
    assert!((1..=8).contains(&nv) && rb + nv <= c.w.rows && k0 + kc <= c.w.cols && kc > 0);
    assert!(k0.is_multiple_of(64) && kc <= 256 && off + 8 <= ld);
    assert!(dst.len() >= (kc - 1) * ld + off + 8 && tmp.len() >= kc.max(256));
    let mut rows = [0usize; 8];
    for (i, r) in rows.iter_mut().enumerate() {
        *r = rb + i.min(nv - 1);
    }
    match c.kind {
        Kind::Q4 { gs, sdt } => pack8_affine::<4>(c, gs, sdt, &rows, k0, kc, dst, ld, off, tmp),
        Kind::Q8 { gs, sdt } => pack8_affine::<8>(c, gs, sdt, &rows, k0, kc, dst, ld, off, tmp),
        Kind::F32 => pack8_dense::<DT_F32>(c, &rows, k0, kc, dst, ld, off),
        Kind::F16 => pack8_dense::<DT_F16>(c, &rows, k0, kc, dst, ld, off),
        Kind::Bf16 => pack8_dense::<DT_BF16>(c, &rows, k0, kc, dst, ld, off),
        Kind::QBits { bits, gs, sdt } => match bits {
            2 => pack8_affine::<2>(c, gs, sdt, &rows, k0, kc, dst, ld, off, tmp),
            3 => pack8_affine::<3>(c, gs, sdt, &rows, k0, kc, dst, ld, off, tmp),
            5 => pack8_affine::<5>(c, gs, sdt, &rows, k0, kc, dst, ld, off, tmp),
            _ => pack8_affine::<6>(c, gs, sdt, &rows, k0, kc, dst, ld, off, tmp),
        },
        Kind::QAny => portable::pack_generic(c, rb, nv, 8, k0, kc, dst, ld, off, tmp),
    }
}

/// Elements `g0..g0 + ng` (`ng <= 8`) of rows `rows` of a `[rows, groups]` array of `dt`,
/// transposed: `out[g * 8 + i]` is element `g0 + g` of row `rows[i]`. `rows` are consecutive.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn load_t8(
    dt: Dtype,
    bytes: &[u8],
    rows: &[usize; 8],
    groups: usize,
    g0: usize,
    ng: usize,
    out: &mut [f32],
) {
    let ssz = dt.size();
    assert!(ng <= 8 && out.len() >= 8 * ng && g0 + ng <= groups);
    if rows
        .iter()
        .all(|&r| (r * groups + g0 + 8) * ssz <= bytes.len())
    {
        let mut v = [_mm256_setzero_ps(); 8];
        for (i, v) in v.iter_mut().enumerate() {
            // SAFETY: 8 elements from element `rows[i] * groups + g0` are inside `bytes`
            // (checked above).
            *v = unsafe { ld8_dyn(dt, bytes.as_ptr().add((rows[i] * groups + g0) * ssz)) };
        }
        let t = transpose8(v);
        for (g, t) in t.iter().enumerate().take(ng) {
            // SAFETY: `out` has `8 * ng` floats (asserted above).
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * g), *t) };
        }
    } else {
        // The last rows of the array: no room to read 8 elements past each row's start.
        for (i, &r) in rows.iter().enumerate() {
            for g in 0..ng {
                out[g * 8 + i] = scalar(dt, bytes, r * groups + g0 + g);
            }
        }
    }
}

/// Eight rows (`srcs[i]`, each at least `4 * (wc + cnt)` bytes) of words `wc..wc + cnt`
/// (`cnt <= 8`) loaded and transposed: lane `i` of result `j` is word `wc + j` of row `i`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(super) fn load_words_t8(srcs: &[&[u8]; 8], wc: usize, cnt: usize) -> [__m256; 8] {
    assert!(cnt <= 8 && srcs.iter().all(|s| s.len() >= 4 * (wc + cnt)));
    let mut v = [_mm256_setzero_ps(); 8];
    if cnt == 8 {
        for (v, src) in v.iter_mut().zip(srcs) {
            // SAFETY: words `wc..wc + 8` are inside `src` (asserted above).
            *v = unsafe { _mm256_loadu_ps(src.as_ptr().add(4 * wc) as *const f32) };
        }
    } else {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let m = _mm256_cmpgt_epi32(_mm256_set1_epi32(cnt as i32), lane);
        for (v, src) in v.iter_mut().zip(srcs) {
            // SAFETY: the masked load reads only words `wc..wc + cnt`, inside `src`.
            *v = unsafe { _mm256_maskload_ps(src.as_ptr().add(4 * wc) as *const f32, m) };
        }
    }
    transpose8(v)
}

/// [`pack_sub`] for affine rows: 4- and 8-bit rows as they are stored, 2/3/5/6-bit rows with
/// the codes of the columns in range unpacked to bytes first ([`unpack_codes`]), which then
/// pack as 8-bit rows do ([`pack8_words`]).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn pack8_affine<const BITS: usize>(
    c: &Ctx,
    gs: usize,
    sdt: Dtype,
    rows: &[usize; 8],
    k0: usize,
    kc: usize,
    dst: &mut [f32],
    ld: usize,
    off: usize,
    st: &mut [f32],
) {
    let w = &c.w;
    let rb = w.row_bytes();
    if BITS == 4 || BITS == 8 {
        let per = 32 / BITS; // elements per word
        let (w0, nw) = (k0 / per, kc / per);
        let mut srcs: [&[u8]; 8] = [&[]; 8];
        for (src, &r) in srcs.iter_mut().zip(rows) {
            *src = &w.data[r * rb + 4 * w0..][..4 * nw];
        }
        pack8_words::<BITS>(c, gs, sdt, rows, &srcs, k0, kc, dst, ld, off, st);
    } else {
        // `k0` is a multiple of 64 and `kc` of the group size (16 or more), so both columns
        // start and end on byte boundaries of the bit stream.
        assert!(k0.is_multiple_of(64) && kc.is_multiple_of(16) && kc <= 256);
        let (b0, nb) = (k0 * BITS / 8, kc * BITS / 8);
        let mut codes = [[0u8; 256]; 8];
        for (buf, &r) in codes.iter_mut().zip(rows) {
            unpack_codes::<BITS>(&w.data[r * rb + b0..][..nb], &mut buf[..kc]);
        }
        let srcs: [&[u8]; 8] = std::array::from_fn(|i| &codes[i][..kc]);
        pack8_words::<8>(c, gs, sdt, rows, &srcs, k0, kc, dst, ld, off, st);
    }
}

/// [`pack8_affine`] given the rows' words of columns `k0..k0 + kc` (`srcs`, `BITS`-bit codes).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
fn pack8_words<const BITS: usize>(
    c: &Ctx,
    gs: usize,
    sdt: Dtype,
    rows: &[usize; 8],
    srcs: &[&[u8]; 8],
    k0: usize,
    kc: usize,
    dst: &mut [f32],
    ld: usize,
    off: usize,
    st: &mut [f32],
) {
    let w = &c.w;
    let per = 32 / BITS; // elements per word
    let groups = w.cols / gs;
    assert!(k0.is_multiple_of(gs) && kc.is_multiple_of(per) && gs.is_multiple_of(per));
    // Scales and biases of the groups in range, transposed to `[group][row]`: the scales in
    // `st[..128]`, the biases in `st[128..256]` (up to 16 groups: `kc <= 256`, groups of 16
    // columns or more), 8 groups per transpose.
    let (g0, ng) = (k0 / gs, kc.div_ceil(gs));
    assert!(ng <= 16 && gs.is_power_of_two() && st.len() >= 256);
    for h in (0..ng).step_by(8) {
        let (m, at) = ((ng - h).min(8), 8 * h);
        load_t8(sdt, w.scales, rows, groups, g0 + h, m, &mut st[at..at + 64]);
        load_t8(
            sdt,
            w.biases,
            rows,
            groups,
            g0 + h,
            m,
            &mut st[128 + at..192 + at],
        );
    }
    // Words per group (a power of two), relative to the first word, which starts group `g0`.
    let wshift = (gs / per).trailing_zeros();
    let nw = kc / per;
    let qmask = _mm256_set1_epi32((1 << BITS) - 1);
    assert!(dst.len() >= (kc - 1) * ld + off + 8);
    let (dp, sp) = (dst.as_mut_ptr(), st.as_ptr());
    let mut wc = 0;
    while wc < nw {
        let cnt = (nw - wc).min(8);
        let t = load_words_t8(srcs, wc, cnt);
        for (j, &tj) in t.iter().enumerate().take(cnt) {
            let tj = _mm256_castps_si256(tj);
            let g = (wc + j) >> wshift;
            // SAFETY: `g < ng <= 16`, so both 8-float reads are inside `st[..256]`; the stores
            // go to columns `(wc + j) * per + k < kc`, and `dst` has `(kc - 1) * ld + off + 8`
            // floats (asserted above).
            unsafe {
                let s = _mm256_loadu_ps(sp.add(8 * g));
                let b = _mm256_loadu_ps(sp.add(128 + 8 * g));
                let base = dp.add((wc + j) * per * ld + off);
                macro_rules! col {
                    ($k:literal) => {
                        if $k < per {
                            let sh = _mm256_set1_epi32(($k * BITS) as i32);
                            let q = _mm256_and_si256(_mm256_srlv_epi32(tj, sh), qmask);
                            let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), s, b);
                            _mm256_storeu_ps(base.add($k * ld), v);
                        }
                    };
                }
                col!(0);
                col!(1);
                col!(2);
                col!(3);
                col!(4);
                col!(5);
                col!(6);
                col!(7);
            }
        }
        wc += cnt;
    }
}

/// [`pack_sub`] for dense rows: 8x8 tiles are converted, transposed and stored.
#[target_feature(enable = "avx2,fma,f16c")]
fn pack8_dense<const DT: u8>(
    c: &Ctx,
    rows: &[usize; 8],
    k0: usize,
    kc: usize,
    dst: &mut [f32],
    ld: usize,
    off: usize,
) {
    let w = &c.w;
    let sz = if DT == DT_F32 { 4 } else { 2 };
    let rb = w.row_bytes();
    let mut srcs: [&[u8]; 8] = [&[]; 8];
    for (src, &r) in srcs.iter_mut().zip(rows) {
        *src = &w.data[r * rb + k0 * sz..][..kc * sz];
    }
    assert!(dst.len() >= (kc - 1) * ld + off + 8);
    let dp = dst.as_mut_ptr();
    let mut p = 0;
    while p + 8 <= kc {
        let mut v = [_mm256_setzero_ps(); 8];
        for (v, src) in v.iter_mut().zip(&srcs) {
            // SAFETY: columns `p..p + 8 <= kc` are inside `src` (`kc` elements).
            *v = unsafe { ld8::<DT>(src.as_ptr().add(p * sz)) };
        }
        let t = transpose8(v);
        for (j, &tj) in t.iter().enumerate() {
            // SAFETY: column `p + j < kc`; `dst` has `(kc - 1) * ld + off + 8` floats.
            unsafe { _mm256_storeu_ps(dp.add((p + j) * ld + off), tj) };
        }
        p += 8;
    }
    let dt = match DT {
        DT_F32 => Dtype::F32,
        DT_F16 => Dtype::F16,
        _ => Dtype::Bf16,
    };
    for q in p..kc {
        for (i, src) in srcs.iter().enumerate() {
            dst[q * ld + off + i] = scalar(dt, src, q);
        }
    }
}

/// `MR = M` tokens x 16 rows micro-kernel.
///
/// # Safety
/// The CPU must support AVX2 and FMA; `a` must have `(M - 1) * lda + kc` readable floats, `b`
/// `16 * kc`, and `c` `(M - 1) * ldc + 16` writable ones.
#[target_feature(enable = "avx2,fma")]
unsafe fn kern16<const M: usize>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    // SAFETY: every access is within the bounds the caller guarantees.
    unsafe {
        for p in 0..kc {
            let b0 = _mm256_loadu_ps(b.add(16 * p));
            let b1 = _mm256_loadu_ps(b.add(16 * p + 8));
            for (i, acc) in acc.iter_mut().enumerate() {
                let av = _mm256_set1_ps(*a.add(i * lda + p));
                acc[0] = _mm256_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm256_fmadd_ps(av, b1, acc[1]);
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let cp = c.add(i * ldc);
            if first {
                _mm256_storeu_ps(cp, acc[0]);
                _mm256_storeu_ps(cp.add(8), acc[1]);
            } else {
                _mm256_storeu_ps(cp, _mm256_add_ps(_mm256_loadu_ps(cp), acc[0]));
                _mm256_storeu_ps(cp.add(8), _mm256_add_ps(_mm256_loadu_ps(cp.add(8)), acc[1]));
            }
        }
    }
}

/// The AVX2 packed micro-kernel: panels of 16 rows, 6 tokens per call.
pub(super) struct Avx2Gemm;

impl Gemm for Avx2Gemm {
    const NR: usize = 16;
    const MR: usize = 6;

    fn pack(c: &Ctx, rb: usize, nv: usize, k0: usize, kc: usize, dst: &mut [f32], tmp: &mut [f32]) {
        assert!(cpu_ok());
        for sub in 0..2 {
            let base = 8 * sub;
            if base >= nv {
                for p in 0..kc {
                    dst[p * 16 + base..p * 16 + base + 8].fill(0.0);
                }
            } else {
                // SAFETY: the CPU has AVX2, FMA and F16C (asserted above).
                unsafe { pack_sub(c, rb + base, (nv - base).min(8), k0, kc, dst, 16, base, tmp) };
            }
        }
    }

    fn kernel(
        m: usize,
        kc: usize,
        a: &[f32],
        lda: usize,
        b: &[f32],
        c: &mut [f32],
        ldc: usize,
        first: bool,
    ) {
        assert!(cpu_ok() && (1..=6).contains(&m) && kc > 0);
        assert!(a.len() >= (m - 1) * lda + kc && b.len() >= 16 * kc);
        assert!(c.len() >= (m - 1) * ldc + 16);
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        // SAFETY: the CPU features and the slice lengths are asserted above.
        unsafe {
            match m {
                1 => kern16::<1>(kc, a, lda, b, c, ldc, first),
                2 => kern16::<2>(kc, a, lda, b, c, ldc, first),
                3 => kern16::<3>(kc, a, lda, b, c, ldc, first),
                4 => kern16::<4>(kc, a, lda, b, c, ldc, first),
                5 => kern16::<5>(kc, a, lda, b, c, ldc, first),
                _ => kern16::<6>(kc, a, lda, b, c, ldc, first),
            }
        }
    }
}
