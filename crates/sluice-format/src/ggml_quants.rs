//! ggml's quantised blocks (the tensors of a llama.cpp GGUF file): a port of ggml's reference
//! dequantisers (`dequantize_row_*` in ggml-quants.c, which define what the blocks mean), and an
//! exact conversion of the types that are affine at heart into sluice's MLX-affine format, so that
//! the engine's affine kernels run them unchanged.
//!
//! Every type [`to_affine`] takes computes each value as ggml does in one of two shapes:
//! `a * q - b` with `a`, `b` the same f32 numbers the affine form stores (then the affine
//! `scale * q + bias` is the same operations on the same operands), or `a * (q - k)` with a
//! product that is exact in f32 (an f16 times integers of at most 13 bits together); then
//! `a * q + (-k * a)` is exact too (`a * q` fits the 24-bit significand, `-k * a` is a power-of-two
//! multiple, and their sum `a * (q - k)` is representable, so the addition does not round). Hence
//! the same f32 bits, fused multiply-add or not, with one exception: where ggml's product is
//! zero it takes the sign of `a` (`-0.0` for a negative scale), while the affine sum of two
//! opposite terms is `+0.0`. The types and their mappings are listed at [`to_affine`].

use half::{bf16, f16};
use sluice_backend::{Dtype, HostBytes, HostMatrix, WeightFormat};

use crate::gguf::GgmlType;

/// Values per K-quant super-block.
const QK_K: usize = 256;

/// An affine matrix converted from ggml blocks: the same values as ggml's dequantisation, bit
/// for bit (up to the sign of zeros, see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct AffineParts {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// `rows * cols * bits / 8` bytes, each row a little-endian bit stream.
    pub data: Vec<u8>,
    /// `[rows, cols / group_size]` of the format's scale dtype, little-endian.
    pub scales: Vec<u8>,
    pub biases: Vec<u8>,
}

impl AffineParts {
    pub fn into_matrix(self) -> HostMatrix {
        HostMatrix::new(
            self.format,
            self.rows,
            self.cols,
            HostBytes::from_vec(self.data),
            HostBytes::from_vec(self.scales),
            HostBytes::from_vec(self.biases),
        )
        .expect("to_affine sizes its parts to the shape")
    }
}

/// Whether [`to_affine`] takes `ty` (the types with an exact affine form).
pub fn has_affine_form(ty: GgmlType) -> bool {
    affine_layout(ty).is_some()
}

/// Bits per weight of `ty`'s affine form: its codes plus a scale and a bias per group (f16 for
/// the 32-blocks, as they normally convert; f32 for the 256-blocks).
pub fn affine_bits_per_weight(ty: GgmlType) -> Option<f64> {
    let (bits, group) = affine_layout(ty)?;
    let scale_bits = if ty.block_elements() == 32 { 16 } else { 32 };
    Some(bits as f64 + 2.0 * scale_bits as f64 / group as f64)
}

/// The format of `ty`'s affine form with F32 scales, which does not depend on the data (the
/// 32-blocks' F16 scales do): what a matrix of `ty` streamed from a GGUF converts to (see
/// [`to_affine_f32`]). `None` for a type with no affine form.
pub fn affine_format_f32(ty: GgmlType) -> Option<WeightFormat> {
    let (bits, group) = affine_layout(ty)?;
    Some(WeightFormat::Affine {
        bits: bits as u32,
        group_size: group,
        scale_dtype: Dtype::F32,
    })
}

/// [`to_affine`] with the scales and biases always F32 (widened from F16 where it picked that,
/// exactly), so that the result has the format [`affine_format_f32`] announced.
pub fn to_affine_f32(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Result<AffineParts, String> {
    let mut parts = to_affine(ty, bytes, rows, cols)?;
    if let WeightFormat::Affine {
        scale_dtype: scale_dtype @ Dtype::F16,
        ..
    } = &mut parts.format
    {
        *scale_dtype = Dtype::F32;
        let widen = |v: &[u8]| -> Vec<u8> {
            v.chunks_exact(2)
                .flat_map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32().to_le_bytes())
                .collect()
        };
        parts.scales = widen(&parts.scales);
        parts.biases = widen(&parts.biases);
    }
    Ok(parts)
}

/// (bits, group size) of the affine form of `ty`, for the types that have an exact one.
fn affine_layout(ty: GgmlType) -> Option<(usize, usize)> {
    Some(match ty.name() {
        "Q4_0" | "Q4_1" => (4, 32),
        "Q5_0" | "Q5_1" => (5, 32),
        "Q8_0" => (8, 32),
        "Q2_K" => (2, 16),
        "Q3_K" => (3, 16),
        "Q4_K" => (4, 32),
        "Q5_K" => (5, 32),
        // 6-bit codes stored as bytes: the CPU's 8-bit kernels run group-16 matrices at full
        // speed, the generic 6-bit path several times slower (a Q4_K_M model, whose Q6_K
        // tensors took that path, decoded at 0.19x llama.cpp on 16 cores).
        "Q6_K" => (8, 16),
        // Codebook types: each code is a signed integer of the book times the group's scale,
        // so the book's integer plus an offset (128, or 12 for MXFP4's) is an exact 8-bit code,
        // with bias -offset * scale.
        "IQ4_NL" | "IQ4_XS" | "MXFP4" => (8, 32),
        _ => return None,
    })
}

/// Checks that `bytes` holds `rows` rows of `cols` values of `ty`; returns the number of blocks.
fn block_count(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> Result<usize, String> {
    let name = ty.name();
    let be = ty.block_elements() as usize;
    if !cols.is_multiple_of(be) {
        return Err(format!(
            "{name}: rows of {cols} values are not whole blocks of {be}"
        ));
    }
    let blocks = rows.checked_mul(cols / be);
    let want = blocks.and_then(|b| b.checked_mul(ty.block_bytes() as usize));
    match (blocks, want) {
        (Some(blocks), Some(want)) if want == bytes.len() => Ok(blocks),
        _ => Err(format!(
            "{name}: {} bytes for {rows} x {cols} values, expected {}",
            bytes.len(),
            want.map_or("more than memory holds".to_string(), |w| w.to_string())
        )),
    }
}

/// Converts `rows` rows of `cols` values stored as consecutive ggml blocks of `ty` (row-major,
/// each row `cols / block_elements` blocks, as in a GGUF tensor whose `dims[0]` is `cols`) into
/// the affine form with the same values.
///
/// | ggml | affine | q (stored) | scale | bias |
/// |------|--------|------------|-------|------|
/// | Q4_0 | 4-bit g32 | nibble | d | -8d |
/// | Q4_1 | 4-bit g32 | nibble | d | m |
/// | Q5_0 | 5-bit g32 | nibble + high bit | d | -16d |
/// | Q5_1 | 5-bit g32 | nibble + high bit | d | m |
/// | Q8_0 | 8-bit g32 | i8 + 128 | d | -128d |
/// | Q2_K | 2-bit g16 | 2 bits | d·(sc&15) | -(dmin·(sc>>4)) |
/// | Q3_K | 3-bit g16 | 2 bits + high bit·4 | d·(sc6-32) | -4·scale |
/// | Q4_K | 4-bit g32 | nibble | d·sc6 | -(dmin·m6) |
/// | Q5_K | 5-bit g32 | nibble + high bit | d·sc6 | -(dmin·m6) |
/// | Q6_K | 8-bit g16 (6-bit codes) | 4 + 2 bits | d·sc8 | -32·scale |
/// | IQ4_NL | 8-bit g32 | book\[nibble\] + 128 | d | -128d |
/// | IQ4_XS | 8-bit g32 | book\[nibble\] + 128 | d·(sc6-32) | -128·scale |
/// | MXFP4 | 8-bit g32 | fp4\[nibble\]·2 + 12 | 2^(e-128) | -12·scale |
///
/// Quants are reordered from ggml's interleaved layouts into consecutive columns. Scales are
/// F16 for the 32-blocks when every scale and bias fits f16 exactly (only a `|d|` above 8188,
/// 4094 or 511.75 for Q4_0, Q5_0, Q8_0 makes the bias overflow; then F32 for the whole matrix),
/// and F32 for the 256-blocks, whose products of an f16 with a 6- or 8-bit scale need up to 18
/// significant bits. A codebook value times its scale (IQ4's 7-bit integers, MXFP4's doubled
/// FP4 values) is exact in f32, and so is the code times the scale plus the bias: ggml's values,
/// bit for bit.
///
/// Errors (one line naming the type): a type with no exact affine form (IQ1-IQ3 decode through
/// lattice codebooks, TQ1_0 and TQ2_0 through ternary packing; Q8_1 and
/// Q8_K are ggml's activation types; F32/F16/BF16 are dense), `cols` not a multiple of the
/// block, a byte length that does not match, or a block whose f16 `d`, `dmin` or `m` is
/// infinite or NaN (a corrupt file: for the `a * (q - k)` types the affine form cannot copy
/// ggml's pattern of NaN and ±inf, so no type converts one; [`dequantize`] still reads it).
pub fn to_affine(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Result<AffineParts, String> {
    let name = ty.name();
    let Some((bits, group)) = affine_layout(ty) else {
        return Err(match name {
            "F32" | "F16" | "BF16" => format!("{name} is dense: it has no affine form"),
            _ => format!("{name} has no exact affine form"),
        });
    };
    let blocks = block_count(ty, bytes, rows, cols)?;
    let bb = ty.block_bytes() as usize;
    let groups = blocks * (ty.block_elements() as usize / group);
    let mut data = vec![0u8; rows * cols * bits / 8];
    let mut scales = vec![0f32; groups];
    let mut biases = vec![0f32; groups];
    let mut parts = Out {
        bits,
        group,
        data: &mut data,
        scales: &mut scales,
        biases: &mut biases,
    };
    match name {
        "Q4_0" => parts.convert::<32>(bytes, bb, |x, q, s, b| {
            let d = f16_at(x, 0);
            nibbles(&x[2..18], q);
            s[0] = d;
            b[0] = -8.0 * d;
        }),
        "Q4_1" => parts.convert::<32>(bytes, bb, |x, q, s, b| {
            nibbles(&x[4..20], q);
            s[0] = f16_at(x, 0);
            b[0] = f16_at(x, 2);
        }),
        "Q5_0" => parts.convert::<32>(bytes, bb, |x, q, s, b| {
            let d = f16_at(x, 0);
            nibbles(&x[6..22], q);
            high_bits(&x[2..6], q);
            s[0] = d;
            b[0] = -16.0 * d;
        }),
        "Q5_1" => parts.convert::<32>(bytes, bb, |x, q, s, b| {
            nibbles(&x[8..24], q);
            high_bits(&x[4..8], q);
            s[0] = f16_at(x, 0);
            b[0] = f16_at(x, 2);
        }),
        "Q8_0" => parts.convert::<32>(bytes, bb, |x, q, s, b| {
            // i8 + 128 as u8 is the byte with its top bit flipped.
            for (q, &v) in q.iter_mut().zip(&x[2..34]) {
                *q = v ^ 0x80;
            }
            let d = f16_at(x, 0);
            s[0] = d;
            b[0] = -128.0 * d;
        }),
        "Q2_K" => parts.convert::<QK_K>(bytes, bb, |x, q, s, b| {
            let (sc, qs) = (&x[..16], &x[16..80]);
            let (d, dmin) = (f16_at(x, 80), f16_at(x, 82));
            // Each half of 128 values: four 2-bit planes of the same 32 bytes.
            for (q, qs) in q.chunks_exact_mut(128).zip(qs.chunks_exact(32)) {
                for (plane, q) in q.chunks_exact_mut(32).enumerate() {
                    for (q, &v) in q.iter_mut().zip(qs) {
                        *q = (v >> (2 * plane)) & 3;
                    }
                }
            }
            for ((s, b), &sc) in s.iter_mut().zip(b.iter_mut()).zip(sc) {
                *s = d * (sc & 0xF) as f32;
                *b = -(dmin * (sc >> 4) as f32);
            }
        }),
        "Q3_K" => parts.convert::<QK_K>(bytes, bb, |x, q, s, b| {
            let (hmask, qs, sc) = (&x[..32], &x[32..96], &x[96..108]);
            let d = f16_at(x, 108);
            // As Q2_K, plus a high bit: bit `plane` of hmask for the 32 values of plane `plane`.
            for (half, (q, qs)) in q.chunks_exact_mut(128).zip(qs.chunks_exact(32)).enumerate() {
                for (plane, q) in q.chunks_exact_mut(32).enumerate() {
                    let hbit = 4 * half + plane;
                    for ((q, &v), &h) in q.iter_mut().zip(qs).zip(hmask) {
                        *q = ((v >> (2 * plane)) & 3) | (((h >> hbit) & 1) << 2);
                    }
                }
            }
            for (g, (s, b)) in s.iter_mut().zip(b.iter_mut()).enumerate() {
                let low = if g < 8 { sc[g] & 0xF } else { sc[g - 8] >> 4 };
                let high = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                let dl = d * ((low | (high << 4)) as i32 - 32) as f32;
                *s = dl;
                *b = -4.0 * dl;
            }
        }),
        "Q4_K" => parts.convert::<QK_K>(bytes, bb, |x, q, s, b| {
            k4_scales(x, s, b);
            for (q, qs) in q.chunks_exact_mut(64).zip(x[16..144].chunks_exact(32)) {
                let (lo, hi) = q.split_at_mut(32);
                for ((lo, hi), &v) in lo.iter_mut().zip(hi).zip(qs) {
                    *lo = v & 0xF;
                    *hi = v >> 4;
                }
            }
        }),
        "Q5_K" => parts.convert::<QK_K>(bytes, bb, |x, q, s, b| {
            k4_scales(x, s, b);
            let qh = &x[16..48];
            for (i, (q, qs)) in q
                .chunks_exact_mut(64)
                .zip(x[48..176].chunks_exact(32))
                .enumerate()
            {
                let (lo, hi) = q.split_at_mut(32);
                for (((lo, hi), &v), &h) in lo.iter_mut().zip(hi).zip(qs).zip(qh) {
                    *lo = (v & 0xF) | (((h >> (2 * i)) & 1) << 4);
                    *hi = (v >> 4) | (((h >> (2 * i + 1)) & 1) << 4);
                }
            }
        }),
        "Q6_K" => parts.convert::<QK_K>(bytes, bb, |x, q, s, b| {
            let (ql, qh, sc) = (&x[..128], &x[128..192], &x[192..208]);
            let d = f16_at(x, 208);
            // Each half of 128 values: quarter k takes the low (k < 2) or high nibbles of
            // ql[32 * (k & 1)..][..32] and bits 2k, 2k+1 of qh.
            for ((q, ql), qh) in q
                .chunks_exact_mut(128)
                .zip(ql.chunks_exact(64))
                .zip(qh.chunks_exact(32))
            {
                for (k, q) in q.chunks_exact_mut(32).enumerate() {
                    let ql = &ql[32 * (k & 1)..][..32];
                    let nib = if k < 2 { 0 } else { 4 };
                    for ((q, &l), &h) in q.iter_mut().zip(ql).zip(qh) {
                        *q = ((l >> nib) & 0xF) | (((h >> (2 * k)) & 3) << 4);
                    }
                }
            }
            for ((s, b), &sc) in s.iter_mut().zip(b.iter_mut()).zip(sc) {
                let scale = d * sc as i8 as f32;
                *s = scale;
                *b = -32.0 * scale;
            }
        }),
        "IQ4_NL" => parts.convert::<32>(bytes, bb, |x, q, s, b| {
            let d = f16_at(x, 0);
            book_codes(&x[2..18], &KVALUES_IQ4NL, 128, q);
            s[0] = d;
            b[0] = -128.0 * d;
        }),
        "IQ4_XS" => parts.convert::<QK_K>(bytes, bb, |x, q, s, b| {
            let d = f16_at(x, 0);
            let groups = q.chunks_exact_mut(32).zip(x[8..136].chunks_exact(16));
            for (ib, ((q, qs), (s, b))) in groups.zip(s.iter_mut().zip(b.iter_mut())).enumerate() {
                let dl = d * (iq4_xs_scale(x, ib) - 32) as f32;
                book_codes(qs, &KVALUES_IQ4NL, 128, q);
                *s = dl;
                *b = -128.0 * dl;
            }
        }),
        "MXFP4" => parts.convert::<32>(bytes, bb, |x, q, s, b| {
            let d = e8m0_to_fp32_half(x[0]);
            book_codes(&x[1..17], &KVALUES_MXFP4, 12, q);
            s[0] = d;
            b[0] = -12.0 * d;
        }),
        _ => unreachable!("affine_layout lists the same types"),
    }
    let per_block = ty.block_elements() as usize / group;
    if let Some(g) =
        (scales.iter().zip(&biases)).position(|(s, b)| !(s.is_finite() && b.is_finite()))
    {
        return Err(format!(
            "{name}: block {} has an infinite or NaN scale",
            g / per_block
        ));
    }
    // K-quant scales are products with 6- or 8-bit integers that rarely fit f16: always F32,
    // so their format does not depend on the data.
    let fits_f16 = |v: &[f32]| {
        v.iter()
            .all(|&x| f16::from_f32(x).to_f32().to_bits() == x.to_bits())
    };
    let scale_dtype = if ty.block_elements() == 32 && fits_f16(&scales) && fits_f16(&biases) {
        Dtype::F16
    } else {
        Dtype::F32
    };
    Ok(AffineParts {
        format: WeightFormat::Affine {
            bits: bits as u32,
            group_size: group,
            scale_dtype,
        },
        rows,
        cols,
        data,
        scales: encode(&scales, scale_dtype),
        biases: encode(&biases, scale_dtype),
    })
}

/// The affine matrix being filled in, block by block.
struct Out<'a> {
    bits: usize,
    group: usize,
    data: &'a mut [u8],
    scales: &'a mut [f32],
    biases: &'a mut [f32],
}

impl Out<'_> {
    /// Runs `unpack` on each block of `bytes` (its `N` quants into `q` in column order, its
    /// groups' scales and biases) and packs the quants.
    fn convert<const N: usize>(
        &mut self,
        bytes: &[u8],
        block_bytes: usize,
        unpack: impl Fn(&[u8], &mut [u8; N], &mut [f32], &mut [f32]),
    ) {
        let mut q = [0u8; N];
        let blocks = bytes.chunks_exact(block_bytes);
        let out = self.data.chunks_exact_mut(N * self.bits / 8);
        let scales = self.scales.chunks_exact_mut(N / self.group);
        let biases = self.biases.chunks_exact_mut(N / self.group);
        for (((x, out), s), b) in blocks.zip(out).zip(scales).zip(biases) {
            unpack(x, &mut q, s, b);
            pack(self.bits, &q, out);
        }
    }
}

/// The 32 low-nibble-first values of Q4_0/Q4_1/Q5_*: value j is the low nibble of byte j, value
/// j + 16 its high nibble.
fn nibbles(qs: &[u8], q: &mut [u8; 32]) {
    let (lo, hi) = q.split_at_mut(16);
    for ((lo, hi), &v) in lo.iter_mut().zip(hi).zip(qs) {
        *lo = v & 0xF;
        *hi = v >> 4;
    }
}

/// ggml's `kvalues_iq4nl`: the 16 values of IQ4_NL's and IQ4_XS's codebook.
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// ggml's `kvalues_mxfp4`: the FP4 (E2M1) values, doubled to integers (hence the half scale).
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The 32 codes of a codebook block: value j is the book's entry for the low nibble of byte j,
/// value j + 16 for its high nibble; each plus `offset`, which makes it a byte.
fn book_codes(qs: &[u8], book: &[i8; 16], offset: i16, q: &mut [u8]) {
    let code = |n: u8| (book[n as usize] as i16 + offset) as u8;
    let (lo, hi) = q.split_at_mut(16);
    for ((lo, hi), &v) in lo.iter_mut().zip(hi).zip(qs) {
        *lo = code(v & 0xF);
        *hi = code(v >> 4);
    }
}

/// IQ4_XS's 6-bit scale of sub-block `ib`: 4 bits from `scales_l` (bytes 4..8), 2 from the
/// little-endian `scales_h` (bytes 2..4).
fn iq4_xs_scale(x: &[u8], ib: usize) -> i32 {
    let scales_h = u16::from_le_bytes([x[2], x[3]]);
    let low = (x[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
    let high = ((scales_h >> (2 * ib)) & 3) as u8;
    (low | (high << 4)) as i32
}

/// ggml's `GGML_E8M0_TO_FP32_HALF`: 2^(e - 128), subnormal below e = 2.
fn e8m0_to_fp32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// Adds Q5_0/Q5_1's fifth bits: bit j of the little-endian `qh` belongs to value j.
fn high_bits(qh: &[u8], q: &mut [u8; 32]) {
    let qh = u32::from_le_bytes(qh.try_into().expect("4 bytes"));
    for (j, q) in q.iter_mut().enumerate() {
        *q |= (((qh >> j) & 1) << 4) as u8;
    }
}

/// Q4_K/Q5_K's eight groups: scale `d * sc`, bias `-(dmin * m)`.
fn k4_scales(x: &[u8], s: &mut [f32], b: &mut [f32]) {
    let (d, dmin) = (f16_at(x, 0), f16_at(x, 2));
    for (g, (s, b)) in s.iter_mut().zip(b.iter_mut()).enumerate() {
        let (sc, m) = scale_min_k4(g, &x[4..16]);
        *s = d * sc as f32;
        *b = -(dmin * m as f32);
    }
}

/// Packs `q` (each below `2^bits`) into a little-endian bit stream.
fn pack(bits: usize, q: &[u8], out: &mut [u8]) {
    match bits {
        8 => out.copy_from_slice(q),
        4 => {
            for (o, p) in out.iter_mut().zip(q.chunks_exact(2)) {
                *o = p[0] | (p[1] << 4);
            }
        }
        2 => {
            for (o, p) in out.iter_mut().zip(q.chunks_exact(4)) {
                *o = p[0] | (p[1] << 2) | (p[2] << 4) | (p[3] << 6);
            }
        }
        // 3, 5, 6: eight values fill `bits` whole bytes.
        _ => {
            for (o, p) in out.chunks_exact_mut(bits).zip(q.chunks_exact(8)) {
                let acc =
                    (p.iter().enumerate()).fold(0u64, |a, (k, &v)| a | (v as u64) << (k * bits));
                o.copy_from_slice(&acc.to_le_bytes()[..bits]);
            }
        }
    }
}

fn encode(v: &[f32], dt: Dtype) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dt.size());
    for &x in v {
        match dt {
            Dtype::F16 => out.extend_from_slice(&f16::from_f32(x).to_le_bytes()),
            _ => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
    out
}

/// The f16 at byte `at` of `x`, as f32 (exact, as ggml's `GGML_FP16_TO_FP32`).
fn f16_at(x: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([x[at], x[at + 1]]).to_f32()
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j` of a Q4_K/Q5_K block.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// ggml's reference dequantisation of `n` values of `ty` (a port of its `dequantize_row_*`, loop
/// for loop and operation for operation, so the same f32 bits), and of F32/F16/BF16. Err (one
/// line naming the type) for other types, `n` not a multiple of the block, or a byte length
/// that does not match.
pub fn dequantize(ty: GgmlType, bytes: &[u8], n: usize) -> Result<Vec<f32>, String> {
    let name = ty.name();
    let supported = matches!(name, "F32" | "F16" | "BF16") || affine_layout(ty).is_some();
    if !supported {
        return Err(format!("dequantising {name} is not supported"));
    }
    block_count(ty, bytes, 1, n)?;
    let mut y = vec![0f32; n];
    let bb = ty.block_bytes() as usize;
    let be = ty.block_elements() as usize;
    let blocks = bytes.chunks_exact(bb).zip(y.chunks_exact_mut(be));
    match name {
        "F32" => blocks.for_each(|(x, y)| y[0] = f32::from_le_bytes(x.try_into().expect("4"))),
        "F16" => blocks.for_each(|(x, y)| y[0] = f16_at(x, 0)),
        "BF16" => blocks.for_each(|(x, y)| y[0] = bf16::from_le_bytes([x[0], x[1]]).to_f32()),
        "Q4_0" => blocks.for_each(|(x, y)| q4_0(x, y)),
        "Q4_1" => blocks.for_each(|(x, y)| q4_1(x, y)),
        "Q5_0" => blocks.for_each(|(x, y)| q5_0(x, y)),
        "Q5_1" => blocks.for_each(|(x, y)| q5_1(x, y)),
        "Q8_0" => blocks.for_each(|(x, y)| q8_0(x, y)),
        "Q2_K" => blocks.for_each(|(x, y)| q2_k(x, y)),
        "Q3_K" => blocks.for_each(|(x, y)| q3_k(x, y)),
        "Q4_K" => blocks.for_each(|(x, y)| q4_k(x, y)),
        "Q5_K" => blocks.for_each(|(x, y)| q5_k(x, y)),
        "Q6_K" => blocks.for_each(|(x, y)| q6_k(x, y)),
        "IQ4_NL" => blocks.for_each(|(x, y)| iq4_nl(x, y)),
        "IQ4_XS" => blocks.for_each(|(x, y)| iq4_xs(x, y)),
        "MXFP4" => blocks.for_each(|(x, y)| mxfp4(x, y)),
        _ => unreachable!("checked above"),
    }
    Ok(y)
}

// One block each: `x` its bytes, `y` its values. The loops mirror the C so that the two read side
// by side.

fn q4_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qs = &x[2..18];
    for j in 0..16 {
        let x0 = (qs[j] & 0x0F) as i32 - 8;
        let x1 = (qs[j] >> 4) as i32 - 8;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

fn q4_1(x: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(x, 0), f16_at(x, 2));
    let qs = &x[4..20];
    for j in 0..16 {
        let x0 = (qs[j] & 0x0F) as i32;
        let x1 = (qs[j] >> 4) as i32;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

fn q5_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qh = u32::from_le_bytes(x[2..6].try_into().expect("4 bytes"));
    let qs = &x[6..22];
    for j in 0..16 {
        let xh_0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh_1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = ((qs[j] & 0x0F) | xh_0) as i32 - 16;
        let x1 = ((qs[j] >> 4) | xh_1) as i32 - 16;
        y[j] = x0 as f32 * d;
        y[j + 16] = x1 as f32 * d;
    }
}

fn q5_1(x: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(x, 0), f16_at(x, 2));
    let qh = u32::from_le_bytes(x[4..8].try_into().expect("4 bytes"));
    let qs = &x[8..24];
    for j in 0..16 {
        let xh_0 = (((qh >> j) << 4) & 0x10) as u8;
        let xh_1 = ((qh >> (j + 12)) & 0x10) as u8;
        let x0 = ((qs[j] & 0x0F) | xh_0) as i32;
        let x1 = ((qs[j] >> 4) | xh_1) as i32;
        y[j] = x0 as f32 * d + m;
        y[j + 16] = x1 as f32 * d + m;
    }
}

fn q8_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    for j in 0..32 {
        y[j] = x[2 + j] as i8 as f32 * d;
    }
}

fn iq4_nl(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qs = &x[2..18];
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}

fn iq4_xs(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    for ib in 0..QK_K / 32 {
        let dl = d * (iq4_xs_scale(x, ib) - 32) as f32;
        let qs = &x[8 + 16 * ib..][..16];
        let y = &mut y[32 * ib..][..32];
        for j in 0..16 {
            y[j] = dl * KVALUES_IQ4NL[(qs[j] & 0xF) as usize] as f32;
            y[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
        }
    }
}

fn mxfp4(x: &[u8], y: &mut [f32]) {
    let d = e8m0_to_fp32_half(x[0]);
    let qs = &x[1..17];
    for j in 0..16 {
        y[j] = KVALUES_MXFP4[(qs[j] & 0x0F) as usize] as f32 * d;
        y[j + 16] = KVALUES_MXFP4[(qs[j] >> 4) as usize] as f32 * d;
    }
}

fn q2_k(x: &[u8], y: &mut [f32]) {
    let scales = &x[..16];
    let d = f16_at(x, 80);
    let min = f16_at(x, 82);
    let mut q = &x[16..80];
    let mut y = y.iter_mut();
    let mut is = 0;
    for _n in (0..QK_K).step_by(128) {
        let mut shift = 0;
        for _j in 0..4 {
            let sc = scales[is];
            is += 1;
            let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
            for &v in &q[..16] {
                *y.next().expect("256 values") = dl * ((v >> shift) & 3) as i8 as f32 - ml;
            }
            let sc = scales[is];
            is += 1;
            let (dl, ml) = (d * (sc & 0xF) as f32, min * (sc >> 4) as f32);
            for &v in &q[16..32] {
                *y.next().expect("256 values") = dl * ((v >> shift) & 3) as i8 as f32 - ml;
            }
            shift += 2;
        }
        q = &q[32..];
    }
}

fn q3_k(x: &[u8], y: &mut [f32]) {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let hm = &x[..32];
    let mut q = &x[32..96];
    let d_all = f16_at(x, 108);
    let word = |k: usize| u32::from_le_bytes(x[96 + 4 * k..100 + 4 * k].try_into().expect("4"));
    let mut aux = [word(0), word(1), word(2), 0];
    let tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4);
    aux[3] = ((aux[1] >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4);
    aux[0] = (aux[0] & KMASK2) | ((tmp & KMASK1) << 4);
    aux[1] = (aux[1] & KMASK2) | (((tmp >> 2) & KMASK1) << 4);
    // `(const int8_t *)aux` on a little-endian machine.
    let mut scales = [0i8; 16];
    for (s, b) in scales
        .iter_mut()
        .zip(aux.iter().flat_map(|w| w.to_le_bytes()))
    {
        *s = b as i8;
    }
    let mut y = y.iter_mut();
    let mut is = 0;
    let mut m = 1u8;
    for _n in (0..QK_K).step_by(128) {
        let mut shift = 0;
        for _j in 0..4 {
            for half in [0, 16] {
                let dl = d_all * (scales[is] as i32 - 32) as f32;
                is += 1;
                for l in half..half + 16 {
                    let v = ((q[l] >> shift) & 3) as i8 as i32 - if hm[l] & m != 0 { 0 } else { 4 };
                    *y.next().expect("256 values") = dl * v as f32;
                }
            }
            shift += 2;
            m <<= 1;
        }
        q = &q[32..];
    }
}

fn q4_k(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let min = f16_at(x, 2);
    let scales = &x[4..16];
    let mut q = &x[16..144];
    let mut y = y.iter_mut();
    let mut is = 0;
    for _j in (0..QK_K).step_by(64) {
        let (sc, m) = scale_min_k4(is, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for &v in &q[..32] {
            *y.next().expect("256 values") = d1 * (v & 0xF) as f32 - m1;
        }
        for &v in &q[..32] {
            *y.next().expect("256 values") = d2 * (v >> 4) as f32 - m2;
        }
        q = &q[32..];
        is += 2;
    }
}

fn q5_k(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let min = f16_at(x, 2);
    let scales = &x[4..16];
    let qh = &x[16..48];
    let mut ql = &x[48..176];
    let mut y = y.iter_mut();
    let mut is = 0;
    let (mut u1, mut u2) = (1u8, 2u8);
    for _j in (0..QK_K).step_by(64) {
        let (sc, m) = scale_min_k4(is, scales);
        let (d1, m1) = (d * sc as f32, min * m as f32);
        let (sc, m) = scale_min_k4(is + 1, scales);
        let (d2, m2) = (d * sc as f32, min * m as f32);
        for l in 0..32 {
            let h = if qh[l] & u1 != 0 { 16 } else { 0 };
            *y.next().expect("256 values") = d1 * ((ql[l] & 0xF) as i32 + h) as f32 - m1;
        }
        for l in 0..32 {
            let h = if qh[l] & u2 != 0 { 16 } else { 0 };
            *y.next().expect("256 values") = d2 * ((ql[l] >> 4) as i32 + h) as f32 - m2;
        }
        ql = &ql[32..];
        is += 2;
        u1 <<= 2;
        u2 <<= 2;
    }
}

fn q6_k(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 208);
    let (mut ql, mut qh, mut sc) = (&x[..128], &x[128..192], &x[192..208]);
    for y in y.chunks_exact_mut(128) {
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i8 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            y[l] = d * sc[is] as i8 as f32 * q1 as f32;
            y[l + 32] = d * sc[is + 2] as i8 as f32 * q2 as f32;
            y[l + 64] = d * sc[is + 4] as i8 as f32 * q3 as f32;
            y[l + 96] = d * sc[is + 6] as i8 as f32 * q4 as f32;
        }
        ql = &ql[64..];
        qh = &qh[32..];
        sc = &sc[8..];
    }
}

#[cfg(test)]
#[path = "ggml_quants_tests.rs"]
mod tests;
