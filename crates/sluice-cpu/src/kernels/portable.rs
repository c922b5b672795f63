//! Portable kernels: plain Rust that compiles everywhere (and that LLVM vectorizes with the
//! target's baseline SIMD). Also the generic path for the affine formats without a dedicated
//! kernel (unusual widths and group sizes) at every level, and for 2, 3, 5 and 6 bits in
//! prefill and at the levels without an unpacker (see `Kind::QBits`).

use sluice_backend::{e8m0_to_f32, Dtype, MatRef, WeightFormat, FP4_E2M1, MXFP4_GROUP};

use super::{grow, scalar, Ctx, Gemm, Scratch};

/// Converts `out.len()` little-endian elements of `dt` from `bytes` to f32.
pub(crate) fn convert(dt: Dtype, bytes: &[u8], out: &mut [f32]) {
    let n = out.len();
    match dt {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes[..n * 4].chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes[..n * 2].chunks_exact(2)) {
                *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        Dtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(bytes[..n * 2].chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
    }
}

/// Columns `c0..c0 + out.len()` of row `r` of `w`, as f32.
pub(crate) fn dequant_range(w: &MatRef, r: usize, c0: usize, out: &mut [f32]) {
    let c1 = c0 + out.len();
    assert!(r < w.rows && c1 <= w.cols);
    let rb = w.row_bytes();
    let row = &w.data[r * rb..(r + 1) * rb];
    match w.format {
        WeightFormat::Dense(dt) => convert(dt, &row[c0 * dt.size()..c1 * dt.size()], out),
        WeightFormat::Mxfp4 => {
            let groups = w.cols / MXFP4_GROUP;
            let mut c = c0;
            while c < c1 {
                let g = c / MXFP4_GROUP;
                let ge = ((g + 1) * MXFP4_GROUP).min(c1);
                let s = e8m0_to_f32(w.scales[r * groups + g]);
                if c.is_multiple_of(2) && ge.is_multiple_of(2) {
                    // Whole bytes: both values of each through the pair table.
                    let o = &mut out[c - c0..ge - c0];
                    for (pair, &b) in o.chunks_exact_mut(2).zip(&row[c / 2..ge / 2]) {
                        let [a, b] = FP4_PAIRS[b as usize];
                        pair[0] = a * s;
                        pair[1] = b * s;
                    }
                } else {
                    for (i, v) in out[c - c0..ge - c0].iter_mut().enumerate() {
                        let e = c + i;
                        let q = (row[e / 2] >> ((e & 1) * 4)) & 15;
                        *v = FP4_E2M1[q as usize] * s;
                    }
                }
                c = ge;
            }
        }
        WeightFormat::Affine {
            bits,
            group_size: gs,
            scale_dtype: sdt,
        } => {
            let groups = w.cols / gs;
            let bits = bits as usize;
            let mask = (1u32 << bits) - 1;
            let mut c = c0;
            while c < c1 {
                let g = c / gs;
                let ge = ((g + 1) * gs).min(c1);
                let s = scalar(sdt, w.scales, r * groups + g);
                let b = scalar(sdt, w.biases, r * groups + g);
                let o = &mut out[c - c0..ge - c0];
                match bits {
                    8 => {
                        for (v, &q) in o.iter_mut().zip(&row[c..ge]) {
                            *v = s * q as f32 + b;
                        }
                    }
                    4 => {
                        for (i, v) in o.iter_mut().enumerate() {
                            let e = c + i;
                            let q = (row[e / 2] >> ((e & 1) * 4)) & 15;
                            *v = s * q as f32 + b;
                        }
                    }
                    _ => {
                        // The row is one little-endian bit stream; an element spans at most two
                        // bytes.
                        for (i, v) in o.iter_mut().enumerate() {
                            let bit = (c + i) * bits;
                            let lo = row[bit / 8] as u32;
                            let hi = row.get(bit / 8 + 1).copied().unwrap_or(0) as u32;
                            let q = ((hi << 8 | lo) >> (bit % 8)) & mask;
                            *v = s * q as f32 + b;
                        }
                    }
                }
                c = ge;
            }
        }
    }
}

/// `sum a[i] * b[i]` with 16 independent partial sums (vectorizable).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 16];
    let mut ca = a.chunks_exact(16);
    let mut cb = b.chunks_exact(16);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for j in 0..16 {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

/// Mat-vec over rows `r0..r1` for all tokens: each row is dequantized once, then dotted with
/// every token. `res` is `tokens` rows of `r1 - r0`.
pub(crate) fn decode_rows(c: &Ctx, r0: usize, r1: usize, res: &mut [f32], s: &mut Scratch) {
    if c.w.format == WeightFormat::Mxfp4 {
        return mxfp4_rows(c, r0, r1, res);
    }
    let (cols, n) = (c.w.cols, r1 - r0);
    let row = grow(&mut s.a, cols);
    for r in r0..r1 {
        dequant_range(&c.w, r, 0, row);
        for t in 0..c.tokens {
            res[t * n + r - r0] = dot(row, &c.x[t * cols..(t + 1) * cols]);
        }
    }
}

/// Each byte's two FP4 values, the lower nibble's first.
static FP4_PAIRS: [[f32; 2]; 256] = {
    let mut t = [[0f32; 2]; 256];
    let mut b = 0;
    while b < 256 {
        t[b] = [FP4_E2M1[b & 15], FP4_E2M1[b >> 4]];
        b += 1;
    }
    t
};

/// Decode of mxfp4 rows `r0..r1` for `c.tokens` tokens: per group of 32 columns its codes to
/// floats through a byte-pair table, dotted with each token's 32 values in 8 lanes, scaled by
/// the group's power of two (the levels without a kernel of their own).
pub(crate) fn mxfp4_rows(c: &Ctx, r0: usize, r1: usize, res: &mut [f32]) {
    let (cols, n, tokens) = (c.w.cols, r1 - r0, c.tokens);
    assert!(
        tokens <= super::DECODE_MAX_TOKENS,
        "decode takes at most DECODE_MAX_TOKENS"
    );
    let groups = cols / MXFP4_GROUP;
    let rb = cols / 2;
    for r in r0..r1 {
        let row = &c.w.data[r * rb..(r + 1) * rb];
        let exps = &c.w.scales[r * groups..(r + 1) * groups];
        let mut acc = [0f32; super::DECODE_MAX_TOKENS];
        for (g, (codes, &e)) in row.chunks_exact(16).zip(exps).enumerate() {
            let mut w = [0f32; 32];
            for (pair, &b) in w.chunks_exact_mut(2).zip(codes) {
                pair.copy_from_slice(&FP4_PAIRS[b as usize]);
            }
            let scale = e8m0_to_f32(e);
            for (t, a) in acc.iter_mut().enumerate().take(tokens) {
                let x = &c.x[t * cols + g * 32..t * cols + g * 32 + 32];
                let mut lanes = [0f32; 8];
                for (wc, xc) in w.chunks_exact(8).zip(x.chunks_exact(8)) {
                    for j in 0..8 {
                        lanes[j] += wc[j] * xc[j];
                    }
                }
                *a += scale * lanes.iter().sum::<f32>();
            }
        }
        for (t, a) in acc.iter().enumerate().take(tokens) {
            res[t * n + r - r0] = *a;
        }
    }
}

/// The portable packed micro-kernel.
pub(crate) struct PortableGemm;

/// Packs rows `rb..rb + nv` (repeating the last valid row up to `nr` rows), columns `k0..k0 +
/// kc`, into `dst[p * ld + off + i]` through the generic scalar dequantizer.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pack_generic(
    c: &Ctx,
    rb: usize,
    nv: usize,
    nr: usize,
    k0: usize,
    kc: usize,
    dst: &mut [f32],
    ld: usize,
    off: usize,
    tmp: &mut [f32],
) {
    let tmp = &mut tmp[..kc];
    for i in 0..nr {
        if i < nv {
            dequant_range(&c.w, rb + i, k0, tmp);
        }
        for (p, &v) in tmp.iter().enumerate() {
            dst[p * ld + off + i] = v;
        }
    }
}

impl Gemm for PortableGemm {
    const NR: usize = 8;
    const MR: usize = 4;

    fn pack(c: &Ctx, rb: usize, nv: usize, k0: usize, kc: usize, dst: &mut [f32], tmp: &mut [f32]) {
        pack_generic(c, rb, nv, Self::NR, k0, kc, dst, Self::NR, 0, tmp);
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
        const NR: usize = PortableGemm::NR;
        const MR: usize = PortableGemm::MR;
        assert!((1..=MR).contains(&m));
        let mut acc = [[0f32; NR]; MR];
        let rows: [&[f32]; MR] = std::array::from_fn(|i| {
            if i < m {
                &a[i * lda..i * lda + kc]
            } else {
                &a[..0]
            }
        });
        for (p, bv) in b[..kc * NR].chunks_exact(NR).enumerate() {
            for i in 0..m {
                let av = rows[i][p];
                for j in 0..NR {
                    acc[i][j] += av * bv[j];
                }
            }
        }
        for (i, acc) in acc.iter().enumerate().take(m) {
            let dst = &mut c[i * ldc..i * ldc + NR];
            if first {
                dst.copy_from_slice(acc);
            } else {
                for (d, v) in dst.iter_mut().zip(acc) {
                    *d += v;
                }
            }
        }
    }
}
