//! The integer 4-bit product for many tokens (`Kernels::Fast`, prefill): llama.cpp's arithmetic
//! for Q4 x Q8 with a layout made for it.
//!
//! Each token's activations are quantized once per call to 8 bits per block of 32 values (one
//! scale `d = max |x| / 127` each, as ggml's Q8 blocks and the GPU's fast prefill). A task packs
//! 16 rows at a time into a panel whose 32-bit lanes are rows: for every 8 columns, one vector of
//! the 8 rows' low nibbles (their even columns) and one of their high nibbles (odd columns), for
//! each half of the 16 rows. A token's 4 even and 4 odd bytes of those columns are broadcast to
//! every lane, so one `vpdpbusd` (AVX-512 VNNI on 256-bit vectors; else AVX2 `vpmaddubsw`,
//! summed in 16 bits over the block and then by `vpmaddwd`) adds 4 products to each of 8 rows.
//! The integer sums of a block meet the float world once per block and token: `y += s_row d_tok
//! sum(q x_q)`, then `y += b_row sum(x)` once per group. Against the decode kernel run in passes
//! of 4 tokens (one lane per word of one row, a float scale per 8 products) that is a third of
//! the instructions per product. The effect of the rounding on the logits is bounded by the
//! engine's fast-kernel tests.

use super::{Ctx, Level, Scratch};

/// Values that share one activation scale.
pub(crate) const QBLOCK: usize = 32;
/// Rows per panel: two vectors of 8 rows' lanes.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const NR: usize = 16;
/// Panel bytes per 8 columns: the low and the high nibbles of 16 rows' 32-bit words.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const STEP_BYTES: usize = 2 * 4 * NR;

/// Activations quantized for [`rows`]: `x[32 b..32 b + 32]` become `round(x / d_b)` in `q`
/// with `d[b] = max |x| / 127`, each 8 values stored as their 4 even ones then their 4 odd
/// ones (the columns a word's low and high nibbles hold). `x.len()` must be a multiple of 32;
/// a block with a non-finite value gets a NaN scale, so the output is not finite, as in the
/// exact path.
pub(crate) fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32]) {
    assert!(x.len().is_multiple_of(QBLOCK) && q.len() == x.len() && d.len() * QBLOCK == x.len());
    #[cfg(target_arch = "x86_64")]
    if super::avx2::cpu_ok() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above); the lengths were asserted.
        unsafe { x86::quantize_blocks(x, q, d) };
        return;
    }
    for (b, db) in d.iter_mut().enumerate() {
        let r = b * QBLOCK..(b + 1) * QBLOCK;
        *db = quantize_block(&x[r.clone()], &mut q[r]);
    }
}

/// One block of [`quantize_blocks`]: writes its 32 bytes and returns its scale.
pub(crate) fn quantize_block(vals: &[f32], q: &mut [i8]) -> f32 {
    assert!(vals.len() == QBLOCK && q.len() == QBLOCK);
    let amax = if vals.iter().all(|v| v.is_finite()) {
        vals.iter().fold(0f32, |a, &v| a.max(v.abs()))
    } else {
        f32::NAN
    };
    let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    for (i, &v) in vals.iter().enumerate() {
        let k = i % 8;
        q[i - k + (k % 2) * 4 + k / 2] = super::round_to_i8(v * inv);
    }
    amax / 127.0
}

/// Rows `r0..r1` of a 4-bit job prepared by [`quantize_blocks`] (`c.xq`: `tokens` rows of
/// `c.ldxq` bytes, `c.xd`: their block scales, `c.xsum`: per-group sums), for every token.
pub(crate) fn rows(level: Level, c: &Ctx, r0: usize, r1: usize, s: &mut Scratch) {
    #[cfg(target_arch = "x86_64")]
    if matches!(level, Level::Avx2 | Level::Avx512) {
        let vnni = level == Level::Avx512 && super::avx512::has_vnni();
        // SAFETY: the dispatcher runs these levels only on CPUs with AVX2, FMA and F16C, and
        // the VNNI kernels only where the CPU has AVX-512 VL and VNNI.
        unsafe { x86::rows(vnni, c, r0, r1, s) };
        return;
    }
    unreachable!(
        "the integer prefill runs on x86 only (level {})",
        level.name()
    );
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::avx2::{load_t8, load_words_t8};
    use super::super::{grow, Ctx, Kind, Scratch};
    use super::{NR, QBLOCK, STEP_BYTES};

    /// Tokens per kernel call: with VNNI 4 x 2 integer and 4 x 2 float accumulators (AVX-512
    /// has 32 vector registers); AVX2's 16 registers hold 2 x 2 of each.
    const MR_VNNI: usize = 4;
    const MR_AVX2: usize = 2;

    /// [`super::quantize_blocks`] with the same results: scale and inverse divided as there,
    /// `vcvtps2dq` rounding to nearest even as `round_to_i8` does. A block with a non-finite
    /// value takes the scalar code.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA; the lengths must be as `quantize_blocks` asserts.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_blocks(x: &[f32], q: &mut [i8], d: &mut [f32]) {
        assert!(q.len() == x.len() && d.len() * QBLOCK == x.len());
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        // After packing to 16 bits, value `k` of a word is the low byte of lane `k`: its even
        // values first, then its odd ones.
        let order = _mm_setr_epi8(0, 4, 8, 12, 2, 6, 10, 14, -1, -1, -1, -1, -1, -1, -1, -1);
        for (b, db) in d.iter_mut().enumerate() {
            // SAFETY: block `b` (32 values) is inside `x` (`d.len() * 32 == x.len()`).
            let v: [__m256; 4] =
                std::array::from_fn(|j| unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * b + 8 * j)) });
            let a = v.map(|v| _mm256_and_ps(v, abs_mask));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            // `v - v` is 0 for finite values, NaN otherwise.
            let finite = v.iter().all(|&v| {
                _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(
                    _mm256_sub_ps(v, v),
                    _mm256_setzero_ps(),
                )) == 0xFF
            });
            if !finite {
                let r = 32 * b..32 * b + 32;
                *db = super::quantize_block(&x[r.clone()], &mut q[r]);
                continue;
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            *db = amax / 127.0;
            let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            for (j, v) in v.iter().enumerate() {
                let w = _mm256_cvtps_epi32(_mm256_mul_ps(*v, inv));
                let w16 =
                    _mm_packs_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
                let bytes = _mm_shuffle_epi8(w16, order);
                // SAFETY: bytes `32 b + 8 j..+ 8` are inside `q` (`q.len() == x.len()`).
                unsafe {
                    _mm_storel_epi64(q.as_mut_ptr().add(32 * b + 8 * j) as *mut __m128i, bytes)
                };
            }
        }
    }

    /// Packs the nibbles of rows `rb..rb + nv` (`1 <= nv <= 16`, missing rows repeat the last)
    /// into `codes`: for step `s` (columns `8 s..8 s + 8`, word `s` of each row), bytes `128 s +
    /// 64 h..+ 32` are the low nibbles of rows `8 h..8 h + 8` (a lane per row) and the next 32
    /// their high nibbles.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn pack_codes(c: &Ctx, rb: usize, nv: usize, codes: &mut [u8]) {
        let steps = c.w.cols / 8;
        let rbytes = c.w.row_bytes();
        assert!((1..=NR).contains(&nv) && rb + nv <= c.w.rows && codes.len() >= steps * STEP_BYTES);
        let low = _mm256_set1_epi8(0x0F);
        for h in 0..2 {
            let srcs: [&[u8]; 8] = std::array::from_fn(|i| {
                let r = rb + (8 * h + i).min(nv - 1);
                &c.w.data[r * rbytes..(r + 1) * rbytes]
            });
            let mut wc = 0;
            while wc < steps {
                let cnt = 8.min(steps - wc);
                let t = load_words_t8(&srcs, wc, cnt);
                for (j, t) in t.iter().enumerate().take(cnt) {
                    let w = _mm256_castps_si256(*t);
                    let lo = _mm256_and_si256(w, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi32::<4>(w), low);
                    let at = (wc + j) * STEP_BYTES + 64 * h;
                    // SAFETY: `at + 64 <= steps * STEP_BYTES <= codes.len()` (asserted above).
                    unsafe {
                        _mm256_storeu_si256(codes.as_mut_ptr().add(at) as *mut __m256i, lo);
                        _mm256_storeu_si256(codes.as_mut_ptr().add(at + 32) as *mut __m256i, hi);
                    }
                }
                wc += cnt;
            }
        }
    }

    /// The scales and biases of rows `rb..rb + nv` (missing rows repeat the last) as f32:
    /// `scales[g * NR + i]` is row `rb + i`'s for group `g`, and so are the biases.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn panel_scales(c: &Ctx, rb: usize, nv: usize, scales: &mut [f32], biases: &mut [f32]) {
        let Kind::Q4 { gs, sdt } = c.kind else {
            unreachable!("integer prefill of a {:?} matrix", c.kind)
        };
        let groups = c.w.cols / gs;
        assert!(scales.len() >= groups * NR && biases.len() >= groups * NR);
        let mut t = [0f32; 64];
        for h in 0..2 {
            let rows: [usize; 8] = std::array::from_fn(|i| rb + (8 * h + i).min(nv - 1));
            for (src, dst) in [(c.w.scales, &mut *scales), (c.w.biases, &mut *biases)] {
                let mut g0 = 0;
                while g0 < groups {
                    let ng = 8.min(groups - g0);
                    load_t8(sdt, src, &rows, groups, g0, ng, &mut t);
                    for g in 0..ng {
                        let at = (g0 + g) * NR + 8 * h;
                        dst[at..at + 8].copy_from_slice(&t[8 * g..8 * g + 8]);
                    }
                    g0 += ng;
                }
            }
        }
    }

    /// A panel as the kernels read it.
    struct Panel<'a> {
        codes: &'a [u8],
        scales: &'a [f32],
        biases: &'a [f32],
    }

    /// Tokens `t0..` of the quantized activations.
    struct Acts<'a> {
        q: &'a [i8],
        ldq: usize,
        d: &'a [f32],
        sums: &'a [f32],
        t0: usize,
    }

    /// The two flavours of the kernel differ in how a step's products reach the block's
    /// integer accumulator (`$step`) and how that becomes 32-bit sums (`$finish`).
    macro_rules! igemm_kernel {
        ($name:ident, $features:literal, $step:ident, $finish:ident) => {
            /// `out[m * NR + i]` = row `i` of the panel against token `t0 + m` (`m < M`), over
            /// `cols` columns with `bpg` blocks of 32 per group; `ahead` is asked for in L2 on
            /// the way.
            ///
            /// # Safety
            /// The CPU must support the features enabled here.
            #[target_feature(enable = $features)]
            unsafe fn $name<const M: usize>(
                p: &Panel,
                a: &Acts,
                ahead: &[u8],
                cols: usize,
                bpg: usize,
                out: &mut [f32],
            ) {
                let nblk = cols / QBLOCK;
                let groups = nblk / bpg;
                let t0 = a.t0;
                assert!(cols.is_multiple_of(QBLOCK) && bpg > 0 && nblk.is_multiple_of(bpg));
                assert!(p.codes.len() >= cols / 8 * STEP_BYTES && p.scales.len() >= groups * NR);
                assert!(p.biases.len() >= groups * NR && out.len() >= M * NR && a.ldq >= cols);
                assert!(a.q.len() >= (t0 + M) * a.ldq && a.d.len() >= (t0 + M) * nblk);
                assert!(a.sums.len() >= (t0 + M) * groups);
                let mut f = [[_mm256_setzero_ps(); 2]; M];
                let pc = p.codes.as_ptr();
                let pf_per_block = ahead.len().div_ceil(64 * nblk);
                // SAFETY: step `s < cols / 8` reads panel bytes `128 s..128 s + 128` and each
                // token's activation bytes `8 s..8 s + 8` inside its row of `ldq >= cols`;
                // block `b < nblk` reads its group's scales and each token's scale `b`, group
                // `g < groups` scales and biases `16 g..+ 16` and each token's sum `g`; the stores write
                // `out[..M * NR]`. All asserted above.
                unsafe {
                    let xq = a.q.as_ptr().add(t0 * a.ldq);
                    for b in 0..nblk {
                        for l in
                            b * pf_per_block..((b + 1) * pf_per_block).min(ahead.len().div_ceil(64))
                        {
                            // A prefetch never faults; the line is inside `ahead` anyway.
                            _mm_prefetch::<_MM_HINT_T1>(ahead.as_ptr().add(64 * l) as *const i8);
                        }
                        let mut acc = [[_mm256_setzero_si256(); 2]; M];
                        for j in 0..4 {
                            let s = 4 * b + j;
                            let sp = pc.add(s * STEP_BYTES);
                            let lo0 = _mm256_loadu_si256(sp as *const __m256i);
                            let hi0 = _mm256_loadu_si256(sp.add(32) as *const __m256i);
                            let lo1 = _mm256_loadu_si256(sp.add(64) as *const __m256i);
                            let hi1 = _mm256_loadu_si256(sp.add(96) as *const __m256i);
                            for (m, acc) in acc.iter_mut().enumerate() {
                                let xp = xq.add(m * a.ldq + 8 * s);
                                let xe = _mm256_set1_epi32((xp as *const i32).read_unaligned());
                                let xo =
                                    _mm256_set1_epi32((xp.add(4) as *const i32).read_unaligned());
                                acc[0] = $step(acc[0], lo0, hi0, xe, xo);
                                acc[1] = $step(acc[1], lo1, hi1, xe, xo);
                            }
                        }
                        let g = b / bpg;
                        let s0 = _mm256_loadu_ps(p.scales.as_ptr().add(g * NR));
                        let s1 = _mm256_loadu_ps(p.scales.as_ptr().add(g * NR + 8));
                        for (m, (f, acc)) in f.iter_mut().zip(&acc).enumerate() {
                            let d = _mm256_set1_ps(*a.d.get_unchecked((t0 + m) * nblk + b));
                            let v0 = _mm256_cvtepi32_ps($finish(acc[0]));
                            let v1 = _mm256_cvtepi32_ps($finish(acc[1]));
                            f[0] = _mm256_fmadd_ps(v0, _mm256_mul_ps(s0, d), f[0]);
                            f[1] = _mm256_fmadd_ps(v1, _mm256_mul_ps(s1, d), f[1]);
                        }
                        if (b + 1) % bpg == 0 {
                            let b0 = _mm256_loadu_ps(p.biases.as_ptr().add(g * NR));
                            let b1 = _mm256_loadu_ps(p.biases.as_ptr().add(g * NR + 8));
                            for (m, f) in f.iter_mut().enumerate() {
                                let xs =
                                    _mm256_set1_ps(*a.sums.get_unchecked((t0 + m) * groups + g));
                                f[0] = _mm256_fmadd_ps(b0, xs, f[0]);
                                f[1] = _mm256_fmadd_ps(b1, xs, f[1]);
                            }
                        }
                    }
                    for (m, f) in f.iter().enumerate() {
                        _mm256_storeu_ps(out.as_mut_ptr().add(m * NR), f[0]);
                        _mm256_storeu_ps(out.as_mut_ptr().add(m * NR + 8), f[1]);
                    }
                }
            }
        };
    }

    /// A step with VNNI: 4 products per lane and instruction, added in 32 bits.
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    #[inline]
    fn step_vnni(acc: __m256i, lo: __m256i, hi: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, lo, xe), hi, xo)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn finish_vnni(acc: __m256i) -> __m256i {
        acc
    }

    /// A step with AVX2: nibble x byte products added in pairs to 16 bits (at most 2 x 15 x
    /// 127 each, so a block's 4 steps, 16 products per lane half, stay below 2^15).
    #[target_feature(enable = "avx2")]
    #[inline]
    fn step_avx2(acc: __m256i, lo: __m256i, hi: __m256i, xe: __m256i, xo: __m256i) -> __m256i {
        let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
        _mm256_add_epi16(acc, p)
    }

    #[target_feature(enable = "avx2")]
    #[inline]
    fn finish_avx2(acc: __m256i) -> __m256i {
        _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
    }

    igemm_kernel!(
        kernel_vnni,
        "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
        step_vnni,
        finish_vnni
    );
    igemm_kernel!(kernel_avx2, "avx2,fma,f16c", step_avx2, finish_avx2);

    /// [`super::rows`] on x86.
    ///
    /// # Safety
    /// The CPU must support AVX2, FMA and F16C, and with `vnni` AVX-512 VL and VNNI.
    pub(super) unsafe fn rows(vnni: bool, c: &Ctx, r0: usize, r1: usize, s: &mut Scratch) {
        let Kind::Q4 { gs, .. } = c.kind else {
            unreachable!("integer prefill of a {:?} matrix", c.kind)
        };
        let (cols, tokens) = (c.w.cols, c.tokens);
        let (nblk, groups) = (cols / QBLOCK, cols / gs);
        assert!(cols.is_multiple_of(gs) && gs.is_multiple_of(QBLOCK) && r0 <= r1 && r1 <= c.w.rows);
        assert!(c.ldxq >= cols && c.xq.len() >= tokens * c.ldxq && c.xd.len() >= tokens * nblk);
        if s.codes.len() < cols / 8 * STEP_BYTES {
            s.codes.resize(cols / 8 * STEP_BYTES, 0);
        }
        let scales = grow(&mut s.a, groups * NR);
        let biases = grow(&mut s.b, groups * NR);
        let n = r1 - r0;
        let mut res = std::mem::take(&mut s.d);
        let out = grow(&mut res, n * tokens);
        let mr = if vnni { MR_VNNI } else { MR_AVX2 };
        let mut tile = [0f32; MR_VNNI * NR];
        let acts = |t0| Acts {
            q: c.xq,
            ldq: c.ldxq,
            d: c.xd,
            sums: c.xsum,
            t0,
        };
        let mut rb = r0;
        while rb < r1 {
            let nv = NR.min(r1 - rb);
            // SAFETY: the caller guarantees AVX2, FMA and F16C.
            unsafe { pack_codes(c, rb, nv, &mut s.codes) };
            // SAFETY: the caller guarantees AVX2, FMA and F16C.
            unsafe { panel_scales(c, rb, nv, scales, biases) };
            // The next panel's rows stream in while this one is multiplied, a share per kernel
            // call: packing reads 16 rows at once, too many streams for the hardware
            // prefetchers to follow.
            let next = (rb + nv).min(r1)..(rb + nv + NR).min(r1);
            let rbytes = c.w.row_bytes();
            let ahead = &c.w.data[next.start * rbytes..next.end * rbytes];
            let share = ahead.len().div_ceil(tokens.div_ceil(mr) * 64) * 64;
            let p = Panel {
                codes: &s.codes,
                scales,
                biases,
            };
            let mut t0 = 0;
            while t0 < tokens {
                let m = mr.min(tokens - t0);
                let a = acts(t0);
                let first = (t0 / mr * share).min(ahead.len());
                let pf = &ahead[first..(first + share).min(ahead.len())];
                let bpg = gs / QBLOCK;
                // SAFETY: the caller guarantees the features of the flavour it asked for; the
                // kernels check the shapes they rely on.
                unsafe {
                    match (vnni, m) {
                        (true, 4) => kernel_vnni::<4>(&p, &a, pf, cols, bpg, &mut tile),
                        (true, 3) => kernel_vnni::<3>(&p, &a, pf, cols, bpg, &mut tile),
                        (true, 2) => kernel_vnni::<2>(&p, &a, pf, cols, bpg, &mut tile),
                        (true, _) => kernel_vnni::<1>(&p, &a, pf, cols, bpg, &mut tile),
                        (false, 2) => kernel_avx2::<2>(&p, &a, pf, cols, bpg, &mut tile),
                        (false, _) => kernel_avx2::<1>(&p, &a, pf, cols, bpg, &mut tile),
                    }
                }
                for i in 0..m {
                    let dst = (t0 + i) * n + rb - r0;
                    out[dst..dst + nv].copy_from_slice(&tile[i * NR..i * NR + nv]);
                }
                t0 += m;
            }
            rb += nv;
        }
        c.store(r0, r1, out);
        s.d = res;
    }
}
