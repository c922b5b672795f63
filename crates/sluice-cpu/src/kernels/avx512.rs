//! AVX-512 (F) kernels. Packing reuses the AVX2 8-row packers (every AVX-512 CPU has AVX2).
//!
//! 4-bit decode turns nibbles into floats with one `vpermps` per 16 lanes: the permute reads
//! only the low 4 bits of each index, so after the shift no mask or int-to-float conversion is
//! needed (the table holds `0.0..=15.0`).

use std::arch::x86_64::*;

use sluice_backend::{Dtype, WeightFormat};

use super::avx2::{
    self, chunk_scales, nt_dispatch, q4i_rows_vnni, row_codes, DT_BF16, DT_F16, DT_F32, PREFETCH,
    ROW_CHUNK,
};
use super::{grow, portable, scalar, Ctx, Gemm, Kind, Scratch};

/// Whether this CPU runs the code in this module (checked by the safe `Gemm` entry points).
fn cpu_ok() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| avx2::cpu_ok() && is_x86_feature_detected!("avx512f"))
}

/// Whether the integer 4-bit decode can use VNNI (`vpdpbusd` on 256-bit vectors).
pub(super) fn has_vnni() -> bool {
    use std::sync::OnceLock;
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        cpu_ok() && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni")
    })
}

/// Sixteen elements of dtype `DT` at `p`, as f32.
///
/// # Safety
/// `16 * size` bytes must be readable at `p`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
#[inline]
unsafe fn ld16<const DT: u8>(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees the 32 or 64 bytes read here are readable.
    unsafe {
        match DT {
            DT_F32 => _mm512_loadu_ps(p as *const f32),
            DT_F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p as *const __m256i),
            ))),
        }
    }
}

/// Mat-vec over rows `r0..r1` for all tokens (`res`: `tokens` rows of `r1 - r0`).
///
/// # Safety
/// The CPU must support AVX-512F, AVX2, FMA and F16C. `c` must be a validated job with at most
/// `DECODE_MAX_TOKENS` tokens, prepared for the AVX-512 level.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn decode_rows(c: &Ctx, r0: usize, r1: usize, res: &mut [f32], s: &mut Scratch) {
    let nt = c.tokens;
    // SAFETY (all calls below): the CPU features are guaranteed by the caller; every kernel
    // checks the shapes it relies on itself.
    unsafe {
        match c.kind {
            // The same accumulators for every token count: a row's sum is then the same
            // alone and in a batch (requests decoding together get their results alone).
            Kind::F32 => nt_dispatch!(nt, dense_rows::<DT_F32, 4>(c, r0, r1, res)),
            Kind::F16 => nt_dispatch!(nt, dense_rows::<DT_F16, 4>(c, r0, r1, res)),
            Kind::Bf16 => nt_dispatch!(nt, dense_rows::<DT_BF16, 4>(c, r0, r1, res)),
            // Integer path (`Kernels::Fast`): the AVX2 kernel's 32-byte blocks, with VNNI where
            // the CPU has it.
            Kind::Q4 { gs, sdt } if !c.xq.is_empty() && has_vnni() => match gs {
                32 => nt_dispatch!(nt, q4i_rows_vnni::<32>(c, sdt, r0, r1, res, s)),
                64 => nt_dispatch!(nt, q4i_rows_vnni::<64>(c, sdt, r0, r1, res, s)),
                _ => nt_dispatch!(nt, q4i_rows_vnni::<128>(c, sdt, r0, r1, res, s)),
            },
            Kind::Q4 { .. } if !c.xq.is_empty() => avx2::decode_rows(c, r0, r1, res, s),
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
            // mxfp4: the AVX2 kernel (its table shuffles are 128 bits wide).
            Kind::QAny if c.w.format == WeightFormat::Mxfp4 => avx2::mxfp4_rows(c, r0, r1, res),
            Kind::QAny => portable::decode_rows(c, r0, r1, res, s),
        }
    }
}

/// Dense rows dotted with `NT` tokens, `U` accumulators per token.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2, FMA and F16C; `c.w` must be validated, of dtype `DT`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let dt = match DT {
        DT_F32 => Dtype::F32,
        DT_F16 => Dtype::F16,
        _ => Dtype::Bf16,
    };
    for r in r0..r1 {
        let row = &w.data[r * rb..(r + 1) * rb];
        let rp = row.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); NT]; U];
        let mut i = 0;
        // SAFETY: every load reads columns `i..i + 16` with `i + 16 <= cols`: inside the row
        // (`cols * sz` bytes) and inside each token's `cols` floats of `x`.
        unsafe {
            while i + 16 * U <= cols {
                for (u, acc) in acc.iter_mut().enumerate() {
                    let wv = ld16::<DT>(rp.add((i + 16 * u) * sz));
                    for (t, a) in acc.iter_mut().enumerate() {
                        let xv = _mm512_loadu_ps(x.add(t * cols + i + 16 * u));
                        *a = _mm512_fmadd_ps(wv, xv, *a);
                    }
                }
                i += 16 * U;
            }
            while i + 16 <= cols {
                let wv = ld16::<DT>(rp.add(i * sz));
                for (t, a) in acc[0].iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x.add(t * cols + i)), *a);
                }
                i += 16;
            }
        }
        for t in 0..NT {
            let mut v = acc[0][t];
            for a in &acc[1..] {
                v = _mm512_add_ps(v, a[t]);
            }
            let mut y = _mm512_reduce_add_ps(v);
            for j in i..cols {
                y += scalar(dt, row, j) * c.x[t * cols + j];
            }
            res[t * n + r - r0] = y;
        }
    }
}

/// One 128-column block of a 4-bit row (`v`: 16 words) against `NT` permuted tokens at `xb`
/// (stride `ldxp`), scaled per lane by `sv` and added to `y`.
///
/// # Safety
/// 128 floats must be readable at `xb + t * ldxp` for every `t < NT`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn q4_block<const NT: usize>(
    v: __m512i,
    xb: *const f32,
    ldxp: usize,
    sv: __m512,
    y: &mut [__m512; NT],
) {
    let table = _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    );
    let mut a0 = [_mm512_setzero_ps(); NT];
    let mut a1 = [_mm512_setzero_ps(); NT];
    macro_rules! step {
        ($k:literal, $acc:ident) => {{
            // `vpermps` uses only the low 4 bits of each index: the nibble.
            let q = _mm512_permutexvar_ps(_mm512_srli_epi32::<{ 4 * $k }>(v), table);
            for (t, a) in $acc.iter_mut().enumerate() {
                // SAFETY: the caller guarantees 128 readable floats per token at `xb`.
                let xv = unsafe { _mm512_loadu_ps(xb.add(t * ldxp + 16 * $k)) };
                *a = _mm512_fmadd_ps(q, xv, *a);
            }
        }};
    }
    step!(0, a0);
    step!(1, a1);
    step!(2, a0);
    step!(3, a1);
    step!(4, a0);
    step!(5, a1);
    step!(6, a0);
    step!(7, a1);
    for t in 0..NT {
        y[t] = _mm512_fmadd_ps(_mm512_add_ps(a0[t], a1[t]), sv, y[t]);
    }
}

/// Scales of the 16 lanes (words) of 128-column block `b`: `sp` is the row's scales as f32.
///
/// # Safety
/// `sp` must have `4 * b + 4` readable floats.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn q4_scales<const GS: usize>(sp: *const f32, b: usize) -> __m512 {
    // SAFETY: forwarded from the caller (at most `sp[4b..4b + 4]` is read).
    unsafe {
        match GS {
            // 4 words per group: lanes 4i..4i+4 take scale 4b + i.
            32 => _mm512_permutexvar_ps(
                _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                _mm512_castps128_ps512(_mm_loadu_ps(sp.add(4 * b))),
            ),
            // 8 words per group: lanes 8i..8i+8 take scale 2b + i.
            64 => _mm512_permutexvar_ps(
                _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                _mm512_castps128_ps512(_mm_loadu_ps(sp.add(2 * b))),
            ),
            _ => _mm512_set1_ps(*sp.add(b)),
        }
    }
}

/// Lane sums of `bias[g] * xsum[t * groups + g]` (`bias`: one row's `groups` biases as f32),
/// for each token `t < NT`: the bias term of an affine row, before the final horizontal sum.
#[target_feature(enable = "avx512f")]
#[inline]
fn bias_part<const NT: usize>(bias: &[f32], xsum: &[f32], groups: usize) -> [__m512; NT] {
    assert!(bias.len() >= groups && xsum.len() >= NT * groups);
    let mut acc = [_mm512_setzero_ps(); NT];
    let mut g = 0;
    while g < groups {
        let m: __mmask16 = if groups - g >= 16 {
            0xFFFF
        } else {
            (1u16 << (groups - g)) - 1
        };
        // SAFETY: the masked loads touch only groups `g..min(g + 16, groups)`, inside `bias`
        // and every token's row of `xsum`.
        unsafe {
            let b = _mm512_maskz_loadu_ps(m, bias.as_ptr().add(g));
            for (t, a) in acc.iter_mut().enumerate() {
                let xs = _mm512_maskz_loadu_ps(m, xsum.as_ptr().add(t * groups + g));
                *a = _mm512_fmadd_ps(b, xs, *a);
            }
        }
        g += 16;
    }
    acc
}

/// 4-bit rows (group size `GS`) against `NT` tokens permuted in blocks of 16 words.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2, FMA and F16C; `c` must be a validated 4-bit job with
/// group size `GS` and `NT` tokens, prepared for this level.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let nblk = cols / 128;
    // Words in a last partial block (0, 4, 8 or 12: columns are a multiple of the group size).
    let tail_words = (cols % 128) / 8;
    assert!(c.tokens == NT && r1 <= w.rows && rb * 2 == cols && cols.is_multiple_of(GS));
    assert!(ldxp >= cols.div_ceil(128) * 128 && xp.len() >= NT * ldxp);
    assert!(xsum.len() >= NT * groups && res.len() >= NT * n);
    let tail_mask: __mmask16 = (1u16 << tail_words).wrapping_sub(1);
    let sfb = grow(&mut s.a, ROW_CHUNK * groups + 16);
    let bfb = grow(&mut s.b, ROW_CHUNK * groups);
    let mut ch = r0;
    while ch < r1 {
        let nc = ROW_CHUNK.min(r1 - ch);
        chunk_scales(w, sdt, ch, nc, 16, sfb, bfb);
        for i in 0..nc {
            let r = ch + i;
            let row = &w.data[r * rb..(r + 1) * rb];
            let mut y = bias_part::<NT>(&bfb[i * groups..(i + 1) * groups], xsum, groups);
            let sf = &sfb[i * groups..(i + 1) * groups + 16];
            let (rp, xq, sp) = (row.as_ptr(), xp.as_ptr(), sf.as_ptr());
            // SAFETY: block `b < nblk` reads row bytes `64b..64b + 64` (the row has `cols / 2
            // >= 64 * nblk`); the tail's masked load reads only its `tail_words` words, the
            // rest of the row. Tokens' permuted rows have `ldxp >= 128 * nblk` (+128 with a
            // tail) floats. Scale reads stay below `4 * nblk + 4 <= groups + 4`, and `sf` has
            // `groups + 16`.
            unsafe {
                for b in 0..nblk {
                    if PREFETCH > 0 {
                        _mm_prefetch::<_MM_HINT_T0>(rp.wrapping_add(64 * b + PREFETCH) as *const i8);
                    }
                    let v = _mm512_loadu_si512(rp.add(64 * b) as *const __m512i);
                    q4_block::<NT>(v, xq.add(128 * b), ldxp, q4_scales::<GS>(sp, b), &mut y);
                }
                if tail_words > 0 {
                    let v = _mm512_maskz_loadu_epi32(tail_mask, rp.add(64 * nblk) as *const i32);
                    // Lanes past the row get a zero scale.
                    let sv = _mm512_maskz_mov_ps(tail_mask, q4_scales::<GS>(sp, nblk));
                    q4_block::<NT>(v, xq.add(128 * nblk), ldxp, sv, &mut y);
                }
            }
            for t in 0..NT {
                res[t * n + r - r0] = _mm512_reduce_add_ps(y[t]);
            }
        }
        ch += nc;
    }
}

/// Decode of 2-, 3-, 5- and 6-bit rows ([`Kind::QBits`]): each row's codes are unpacked to
/// bytes ([`avx2::unpack_codes`]) and go through the 8-bit kernels.
///
/// # Safety
/// The CPU must support AVX-512F, AVX2, FMA and F16C; `c` must be a validated job of
/// `BITS`-bit weights with group size `gs` and at most `DECODE_MAX_TOKENS` tokens, prepared
/// with per-group sums.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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

avx2::q8_rows_driver!(
    "avx512f,avx2,fma,f16c",
    q8_groups,
    bias_part,
    _mm512_reduce_add_ps
);

/// `NS` rows of 8-bit codes at once (row `k` at `rp[k]`, its group scales `sf[k]`), each
/// accumulated onto `y[k]`, group by group; `unpacked`: the codes are in cache already (no
/// prefetch).
///
/// # Safety
/// The CPU must support AVX-512F, AVX2 and FMA; every `rp[k]` has `cols` bytes, `x` `cols` floats
/// per token for `NT` tokens, and `sf[k]` one scale per group of `GS`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
// `g` walks the groups of several rows (and their scales) at once.
#[allow(clippy::needless_range_loop)]
unsafe fn q8_groups<const NT: usize, const GS: usize, const NS: usize>(
    rp: [*const u8; NS],
    sf: [&[f32]; NS],
    y: &mut [[__m512; NT]; NS],
    x: *const f32,
    cols: usize,
    unpacked: bool,
) {
    for g in 0..cols / GS {
        for k in 0..NS {
            if !unpacked {
                _mm_prefetch::<_MM_HINT_T0>(rp[k].wrapping_add(g * GS + PREFETCH) as *const i8);
            }
            let mut a0 = [_mm512_setzero_ps(); NT];
            let mut a1 = [_mm512_setzero_ps(); NT];
            let mut j = g * GS;
            // SAFETY: columns `j..j + 32` stay inside group `g` (a multiple of 32 columns), so
            // inside the row and each token's `cols` floats (the caller's contract).
            unsafe {
                while j < (g + 1) * GS {
                    let q0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        rp[k].add(j) as *const __m128i,
                    )));
                    let q1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        rp[k].add(j + 16) as *const __m128i,
                    )));
                    for t in 0..NT {
                        let xt = x.add(t * cols + j);
                        a0[t] = _mm512_fmadd_ps(q0, _mm512_loadu_ps(xt), a0[t]);
                        a1[t] = _mm512_fmadd_ps(q1, _mm512_loadu_ps(xt.add(16)), a1[t]);
                    }
                    j += 32;
                }
            }
            let sv = _mm512_set1_ps(sf[k][g]);
            for t in 0..NT {
                y[k][t] = _mm512_fmadd_ps(_mm512_add_ps(a0[t], a1[t]), sv, y[k][t]);
            }
        }
    }
}

/// 8-bit rows of group size 16 against `NT` tokens in natural order. A group is one vector of
/// 16 codes: too short to pay for a sum per group and token that is then scaled (as
/// [`q8_rows`] does), so each group's codes are scaled once, for all tokens, and the products
/// summed over the whole row: per 16 weights a conversion and a multiply, then an FMA per
/// token. Steps of 4 groups spread over `U` accumulators per token (4 for one token, whose
/// chains of FMAs would otherwise wait on their latency).
///
/// # Safety
/// The CPU must support AVX-512F, AVX2, FMA and F16C; `c` must be a validated 8-bit job with
/// group size 16 and `NT` tokens, prepared with per-group sums.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
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
    let steps = groups / 4;
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
            let mut acc = [[_mm512_setzero_ps(); NT]; U];
            // SAFETY: every group read has `g < groups`: its codes are row bytes `16g..16g +
            // 16 <= cols` (the row has `cols`), its activations columns `16g..16g + 16` of
            // each token's `cols` floats, its scale element `g` of `sf` (`groups` floats).
            unsafe {
                let group = |g: usize, a: &mut [__m512; NT]| {
                    let q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                        rp.add(GS * g) as *const __m128i,
                    )));
                    let wv = _mm512_mul_ps(q, _mm512_set1_ps(*sp.add(g)));
                    for (t, a) in a.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x.add(t * cols + GS * g)), *a);
                    }
                };
                for st in 0..steps {
                    if BITS == 8 {
                        _mm_prefetch::<_MM_HINT_T0>(
                            rp.wrapping_add(64 * st + PREFETCH) as *const i8
                        );
                    }
                    for v in 0..4 {
                        group(4 * st + v, &mut acc[v % U]);
                    }
                }
                for g in 4 * steps..groups {
                    group(g, &mut acc[0]);
                }
            }
            for t in 0..NT {
                let mut v = y[t];
                for a in &acc {
                    v = _mm512_add_ps(v, a[t]);
                }
                res[t * n + r - r0] = _mm512_reduce_add_ps(v);
            }
        }
        ch += nc;
    }
}

/// `MR = M` tokens x 32 rows micro-kernel.
///
/// # Safety
/// The CPU must support AVX-512F; `a` must have `(M - 1) * lda + kc` readable floats, `b`
/// `32 * kc`, and `c` `(M - 1) * ldc + 32` writable ones.
#[target_feature(enable = "avx512f")]
unsafe fn kern32<const M: usize>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    first: bool,
) {
    let mut acc = [[_mm512_setzero_ps(); 2]; M];
    // SAFETY: every access is within the bounds the caller guarantees.
    unsafe {
        for p in 0..kc {
            let b0 = _mm512_loadu_ps(b.add(32 * p));
            let b1 = _mm512_loadu_ps(b.add(32 * p + 16));
            for (i, acc) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(i * lda + p));
                acc[0] = _mm512_fmadd_ps(av, b0, acc[0]);
                acc[1] = _mm512_fmadd_ps(av, b1, acc[1]);
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            let cp = c.add(i * ldc);
            if first {
                _mm512_storeu_ps(cp, acc[0]);
                _mm512_storeu_ps(cp.add(16), acc[1]);
            } else {
                _mm512_storeu_ps(cp, _mm512_add_ps(_mm512_loadu_ps(cp), acc[0]));
                _mm512_storeu_ps(
                    cp.add(16),
                    _mm512_add_ps(_mm512_loadu_ps(cp.add(16)), acc[1]),
                );
            }
        }
    }
}

/// The AVX-512 packed micro-kernel: panels of 32 rows, 8 tokens per call.
pub(super) struct Avx512Gemm;

impl Gemm for Avx512Gemm {
    const NR: usize = 32;
    const MR: usize = 8;

    fn pack(c: &Ctx, rb: usize, nv: usize, k0: usize, kc: usize, dst: &mut [f32], tmp: &mut [f32]) {
        assert!(cpu_ok());
        for sub in 0..4 {
            let base = 8 * sub;
            if base >= nv {
                for p in 0..kc {
                    dst[p * 32 + base..p * 32 + base + 8].fill(0.0);
                }
            } else {
                // SAFETY: the CPU has AVX2, FMA and F16C (asserted above).
                unsafe {
                    avx2::pack_sub(c, rb + base, (nv - base).min(8), k0, kc, dst, 32, base, tmp)
                };
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
        assert!(cpu_ok() && (1..=8).contains(&m) && kc > 0);
        assert!(a.len() >= (m - 1) * lda + kc && b.len() >= 32 * kc);
        assert!(c.len() >= (m - 1) * ldc + 32);
        let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        // SAFETY: the CPU features and the slice lengths are asserted above.
        unsafe {
            match m {
                1 => kern32::<1>(kc, a, lda, b, c, ldc, first),
                2 => kern32::<2>(kc, a, lda, b, c, ldc, first),
                3 => kern32::<3>(kc, a, lda, b, c, ldc, first),
                4 => kern32::<4>(kc, a, lda, b, c, ldc, first),
                5 => kern32::<5>(kc, a, lda, b, c, ldc, first),
                6 => kern32::<6>(kc, a, lda, b, c, ldc, first),
                7 => kern32::<7>(kc, a, lda, b, c, ldc, first),
                _ => kern32::<8>(kc, a, lda, b, c, ldc, first),
            }
        }
    }
}
