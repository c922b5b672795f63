//! NEON kernels (aarch64). Only 4-bit decode has a hand-written kernel; everything else runs the
//! portable code, which LLVM vectorizes with NEON (a baseline feature of aarch64).
//!
//! The 4-bit kernel uses blocks of 4 words (32 columns, never more than one group): vector `k`
//! of a block is `(words >> 4k) & 15`, matched by `x` permuted once per call.

use std::arch::aarch64::*;

use super::{grow, portable, Ctx, Kind, Scratch};

/// Mat-vec over rows `r0..r1` for all tokens (`res`: `tokens` rows of `r1 - r0`).
pub(super) fn decode_rows(c: &Ctx, r0: usize, r1: usize, res: &mut [f32], s: &mut Scratch) {
    let Kind::Q4 { gs, sdt } = c.kind else {
        return portable::decode_rows(c, r0, r1, res, s);
    };
    let w = &c.w;
    let (cols, n, tokens) = (w.cols, r1 - r0, c.tokens);
    let groups = cols / gs;
    let (rb, srb) = (w.row_bytes(), groups * sdt.size());
    let (xp, ldxp, xsum) = (c.xp, c.ldxp, c.xsum);
    let nblk = cols / 32;
    assert!(rb * 2 == cols && cols.is_multiple_of(32) && gs % 32 == 0 && r1 <= w.rows);
    assert!(ldxp >= cols && xp.len() >= tokens * ldxp && xsum.len() >= tokens * groups);
    assert!(res.len() >= tokens * n);
    let sf = grow(&mut s.a, groups);
    let bf = grow(&mut s.b, groups);
    for r in r0..r1 {
        let row = &w.data[r * rb..(r + 1) * rb];
        portable::convert(sdt, &w.scales[r * srb..(r + 1) * srb], sf);
        portable::convert(sdt, &w.biases[r * srb..(r + 1) * srb], bf);
        for t in 0..tokens {
            let x = &xp[t * ldxp..t * ldxp + 32 * nblk];
            // SAFETY: NEON is part of the aarch64 baseline; `q4_dot` checks its bounds.
            let main = unsafe { q4_dot(row, x, sf, gs, nblk) };
            let xs = &xsum[t * groups..(t + 1) * groups];
            let bias: f32 = bf.iter().zip(xs).map(|(b, x)| b * x).sum();
            res[t * n + r - r0] = main + bias;
        }
    }
}

/// `sum_b scale(b) * dot(q_b, x_b)` over the `nblk` 32-column blocks of one 4-bit row.
///
/// # Safety
/// The CPU must support NEON.
#[target_feature(enable = "neon")]
unsafe fn q4_dot(row: &[u8], xp: &[f32], sf: &[f32], gs: usize, nblk: usize) -> f32 {
    assert!(row.len() >= 16 * nblk && xp.len() >= 32 * nblk);
    assert!(sf.len() >= (32 * nblk).div_ceil(gs));
    let mask = vdupq_n_u32(15);
    let mut y = vdupq_n_f32(0.0);
    for b in 0..nblk {
        // SAFETY: bytes `16b..16b + 16` of `row` and floats `32b..32b + 32` of `xp` are in
        // bounds (asserted above).
        let (v, x) = unsafe {
            (
                vreinterpretq_u32_u8(vld1q_u8(row.as_ptr().add(16 * b))),
                xp.as_ptr().add(32 * b),
            )
        };
        // SAFETY: `x` points at 32 readable floats (see above).
        let xs: [float32x4_t; 8] = std::array::from_fn(|k| unsafe { vld1q_f32(x.add(4 * k)) });
        let q0 = vcvtq_f32_u32(vandq_u32(v, mask));
        let q1 = vcvtq_f32_u32(vandq_u32(vshrq_n_u32::<4>(v), mask));
        let q2 = vcvtq_f32_u32(vandq_u32(vshrq_n_u32::<8>(v), mask));
        let q3 = vcvtq_f32_u32(vandq_u32(vshrq_n_u32::<12>(v), mask));
        let q4 = vcvtq_f32_u32(vandq_u32(vshrq_n_u32::<16>(v), mask));
        let q5 = vcvtq_f32_u32(vandq_u32(vshrq_n_u32::<20>(v), mask));
        let q6 = vcvtq_f32_u32(vandq_u32(vshrq_n_u32::<24>(v), mask));
        let q7 = vcvtq_f32_u32(vshrq_n_u32::<28>(v));
        // vfmaq_f32(a, b, c) = a + b * c.
        let mut a0 = vmulq_f32(q0, xs[0]);
        let mut a1 = vmulq_f32(q1, xs[1]);
        a0 = vfmaq_f32(a0, q2, xs[2]);
        a1 = vfmaq_f32(a1, q3, xs[3]);
        a0 = vfmaq_f32(a0, q4, xs[4]);
        a1 = vfmaq_f32(a1, q5, xs[5]);
        a0 = vfmaq_f32(a0, q6, xs[6]);
        a1 = vfmaq_f32(a1, q7, xs[7]);
        y = vfmaq_f32(y, vaddq_f32(a0, a1), vdupq_n_f32(sf[32 * b / gs]));
    }
    vaddvq_f32(y)
}
