use super::*;
use sluice_backend::reference::dequantize_row;

const AFFINE: [&str; 13] = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
    "IQ4_XS", "MXFP4",
];

fn ty(name: &str) -> GgmlType {
    (0..64)
        .filter_map(GgmlType::from_id)
        .find(|t| t.name() == name)
        .expect("a ggml type")
}

/// Byte offsets of the f16 `d`/`dmin` (`m`) fields in a block.
fn f16_fields(name: &str) -> &'static [usize] {
    match name {
        "Q4_0" | "Q5_0" | "Q8_0" | "IQ4_NL" | "IQ4_XS" => &[0],
        "Q4_1" | "Q5_1" | "Q4_K" | "Q5_K" => &[0, 2],
        "Q2_K" => &[80, 82],
        "Q3_K" => &[108],
        "Q6_K" => &[208],
        "MXFP4" => &[],
        _ => unreachable!(),
    }
}

/// Whether ggml computes a value as `a * (q - k)` (or `a * book[q]`), whose zeros take the sign
/// of `a` where the affine form's are +0.0 (the module docs); elsewhere even zeros agree bit for
/// bit.
fn zero_sign_may_differ(name: &str) -> bool {
    matches!(
        name,
        "Q4_0" | "Q5_0" | "Q8_0" | "Q3_K" | "Q6_K" | "IQ4_NL" | "IQ4_XS"
    )
}

/// splitmix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A finite f16: often a special (zeros, subnormals, extremes), else any finite bits; with
    /// `max_exp`, biased exponents above it are pulled down (keeps legacy biases in f16).
    fn f16(&mut self, max_exp: u16) -> u16 {
        const SPECIAL: [u16; 10] = [
            0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xB800,
        ];
        let r = self.next();
        let mut bits = if r.is_multiple_of(5) {
            SPECIAL[(r >> 8) as usize % SPECIAL.len()]
        } else {
            loop {
                let b = (r >> 16) as u16 ^ self.next() as u16;
                if b & 0x7C00 != 0x7C00 {
                    break b;
                }
            }
        };
        if (bits >> 10) & 0x1F > max_exp {
            bits = (bits & 0x83FF) | (max_exp << 10);
        }
        bits
    }
}

/// `blocks` random blocks of `name`: random quant bytes, random finite f16 fields.
fn random_blocks(name: &str, blocks: usize, rng: &mut Rng, max_exp: u16) -> Vec<u8> {
    let t = ty(name);
    let bb = t.block_bytes() as usize;
    let mut bytes: Vec<u8> = (0..blocks * bb).map(|_| rng.next() as u8).collect();
    for block in bytes.chunks_exact_mut(bb) {
        for &at in f16_fields(name) {
            block[at..at + 2].copy_from_slice(&rng.f16(max_exp).to_le_bytes());
        }
        if name == "MXFP4" {
            // E8M0 scales 2^(e - 128), kept below where 12 * 2^(e - 128) overflows f32.
            block[0] = (rng.next() % 251) as u8;
        }
    }
    bytes
}

/// Row `r` of the affine matrix, as the backend's reference computes it.
fn affine_rows(parts: AffineParts) -> Vec<Vec<f32>> {
    let m = parts.into_matrix();
    (0..m.rows)
        .map(|r| dequantize_row(&m.as_ref(), r))
        .collect()
}

/// `got == want` bit for bit, except that `+0.0` may stand for `-0.0` where `zeros` allows.
fn assert_same(got: &[f32], want: &[f32], zeros: bool, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = g.to_bits() == w.to_bits() || (zeros && g == 0.0 && w == 0.0);
        assert!(
            ok,
            "{what}: value {i}: {g:e} ({:#010x}) vs ggml {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

fn check_random(name: &str, rows: usize, cols: usize, seed: u64, max_exp: u16) -> Dtype {
    let mut rng = Rng(seed);
    let t = ty(name);
    let blocks = rows * cols / t.block_elements() as usize;
    let bytes = random_blocks(name, blocks, &mut rng, max_exp);
    let parts = to_affine(t, &bytes, rows, cols).unwrap();
    let WeightFormat::Affine { scale_dtype, .. } = parts.format else {
        panic!("not affine")
    };
    let row_bytes = bytes.len() / rows;
    for (r, got) in affine_rows(parts).iter().enumerate() {
        let want = dequantize(t, &bytes[r * row_bytes..][..row_bytes], cols).unwrap();
        let what = format!("{name} {rows}x{cols} seed {seed} row {r}");
        assert_same(got, &want, zero_sign_may_differ(name), &what);
    }
    scale_dtype
}

#[test]
fn affine_equals_ggml_on_random_blocks() {
    for (i, name) in AFFINE.into_iter().enumerate() {
        let be = ty(name).block_elements() as usize;
        for (k, (rows, cols)) in [(3, 512), (3, be), (1, 2 * be), (5, 4 * be)]
            .into_iter()
            .enumerate()
        {
            let seed = 1000 * i as u64 + k as u64;
            let dt = check_random(name, rows, cols, seed, 30);
            if be == QK_K {
                assert_eq!(dt, Dtype::F32, "{name}");
            }
        }
    }
}

#[test]
fn legacy_scales_are_f16_when_they_fit() {
    for name in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"] {
        // |d| < 2 (biased exponent at most 15): every derived bias fits f16.
        assert_eq!(check_random(name, 4, 256, 7, 15), Dtype::F16, "{name}");
    }
    // A d whose bias -8d, -16d, -128d overflows f16: the same values, with f32 scales.
    for (name, d) in [("Q4_0", 8192.0), ("Q5_0", 4096.0), ("Q8_0", 512.0)] {
        let t = ty(name);
        let mut bytes = random_blocks(name, 4, &mut Rng(3), 15);
        bytes[t.block_bytes() as usize * 2..][..2]
            .copy_from_slice(&f16::from_f32(-d).to_le_bytes());
        let parts = to_affine(t, &bytes, 2, 64).unwrap();
        assert!(
            matches!(
                parts.format,
                WeightFormat::Affine {
                    scale_dtype: Dtype::F32,
                    ..
                }
            ),
            "{name}"
        );
        let got: Vec<f32> = affine_rows(parts).concat();
        assert_same(&got, &dequantize(t, &bytes, 128).unwrap(), true, name);
        // Just below the limit, f16 still holds it.
        let below = f16::from_bits(f16::from_f32(d).to_bits() - 1).to_f32();
        bytes[t.block_bytes() as usize * 2..][..2]
            .copy_from_slice(&f16::from_f32(below).to_le_bytes());
        let parts = to_affine(t, &bytes, 2, 64).unwrap();
        assert!(
            matches!(
                parts.format,
                WeightFormat::Affine {
                    scale_dtype: Dtype::F16,
                    ..
                }
            ),
            "{name}"
        );
    }
}

/// Blocks and values written by scripts/make_ggml_block_vectors.py from gguf-py's numpy
/// dequantisers: `<TYPE>.bin` is the raw blocks, then their values as little-endian f32.
#[test]
fn ggml_port_equals_gguf_py() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/ggml_blocks");
    for name in AFFINE.into_iter().chain(["F16", "BF16"]) {
        let t = ty(name);
        let file = std::fs::read(dir.join(format!("{name}.bin"))).unwrap();
        let (be, bb) = (t.block_elements() as usize, t.block_bytes() as usize);
        let blocks = file.len() / (bb + 4 * be);
        assert_eq!(blocks * (bb + 4 * be), file.len(), "{name}: file size");
        assert!(blocks >= 4, "{name}: {blocks} blocks");
        let (bytes, values) = file.split_at(blocks * bb);
        let want: Vec<f32> = values
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let n = blocks * be;
        assert_same(&dequantize(t, bytes, n).unwrap(), &want, false, name);
        if affine_layout(t).is_some() {
            let got = affine_rows(to_affine(t, bytes, 1, n).unwrap()).concat();
            assert_same(&got, &want, zero_sign_may_differ(name), name);
        }
    }
}

#[test]
fn q4_0_by_hand() {
    // d = -0.5; byte j holds j in its low nibble and 15 - j in its high one.
    let mut block = f16::from_f32(-0.5).to_le_bytes().to_vec();
    block.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    #[rustfmt::skip]
    let want = [
        // values 0..16: (j - 8) * -0.5
        4.0, 3.5, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5, -0.0, -0.5, -1.0, -1.5, -2.0, -2.5, -3.0, -3.5,
        // values 16..32: (15 - j - 8) * -0.5
        -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5, -0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0,
    ];
    let t = ty("Q4_0");
    assert_same(&dequantize(t, &block, 32).unwrap(), &want, false, "Q4_0");
    let parts = to_affine(t, &block, 1, 32).unwrap();
    let f16s = |b: &[u8]| f16::from_le_bytes([b[0], b[1]]).to_f32();
    assert_eq!(
        parts.format,
        WeightFormat::Affine {
            bits: 4,
            group_size: 32,
            scale_dtype: Dtype::F16
        }
    );
    assert_eq!((f16s(&parts.scales), f16s(&parts.biases)), (-0.5, 4.0));
    // Byte i packs columns 2i, 2i + 1: 0 | 1 << 4, 2 | 3 << 4, ..., then (from column 16, the
    // high nibbles) 15 | 14 << 4, 13 | 12 << 4, ...
    assert_eq!(&parts.data[..2], &[0x10, 0x32]);
    assert_eq!(&parts.data[8..10], &[0xEF, 0xCD]);
    // The two -0.0 above come out +0.0 (the only difference).
    assert_same(&affine_rows(parts)[0], &want, true, "Q4_0 affine");
}

#[test]
fn q4_k_by_hand() {
    // d = 0.5, dmin = 0.25; sub-blocks 0..4 take scale/min from the low 6 bits of bytes 0..8,
    // 4..8 from the nibbles of bytes 8..12 plus the top two bits of bytes 0..8.
    let mut block = Vec::new();
    block.extend(f16::from_f32(0.5).to_le_bytes());
    block.extend(f16::from_f32(0.25).to_le_bytes());
    block.extend([
        1 | (1 << 6),
        2,
        3,
        63, // scales 0..4; top bits give scale 4 +16
        0,
        4 | (2 << 6),
        5,
        6, // mins 0..4; top bits give min 5 +32
        0x21,
        0x44,
        0x05,
        0xF0, // scale 4..8 low / min 4..8 high nibbles
    ]);
    // Quants: byte l of chunk c is (l % 16) in the low nibble, 15 - l % 16 in the high one.
    for _c in 0..4 {
        block.extend((0..32u8).map(|l| (l % 16) | ((15 - l % 16) << 4)));
    }
    // (scale, min) per sub-block: d * sc, dmin * m.
    let sm = [
        (0.5, 0.0),  // sc 1, m 0
        (1.0, 1.0),  // sc 2, m 4
        (1.5, 1.25), // sc 3, m 5
        (31.5, 1.5), // sc 63, m 6
        (8.5, 0.5),  // sc 1 | 1 << 4 = 17, m 2
        (2.0, 9.0),  // sc 4, m 4 | 2 << 4 = 36
        (2.5, 0.0),  // sc 5, m 0
        (0.0, 3.75), // sc 0, m 15
    ];
    let t = ty("Q4_K");
    let y = dequantize(t, &block, 256).unwrap();
    // Sub-block 2c takes the low nibbles of chunk c, 2c + 1 the high ones.
    let expect = |g: usize, l: usize| {
        let q = if g.is_multiple_of(2) {
            l % 16
        } else {
            15 - l % 16
        } as f32;
        sm[g].0 * q - sm[g].1
    };
    for (i, &v) in y.iter().enumerate() {
        assert_eq!(v.to_bits(), expect(i / 32, i % 32).to_bits(), "value {i}");
    }
    // A few written out: 0.5*0 - 0, 0.5*5 - 0, 1.0*15 - 1, 31.5*13 - 1.5, 8.5*7 - 0.5, 2.0*0 - 9,
    // 0*15 - 3.75.
    let spots = [
        (0, 0.0),
        (5, 2.5),
        (32, 14.0),
        (98, 408.0),
        (135, 59.0),
        (175, -9.0),
        (224, -3.75),
    ];
    for (i, v) in spots {
        assert_eq!(y[i], v, "value {i}");
    }
    let parts = to_affine(t, &block, 1, 256).unwrap();
    assert_eq!(
        parts.format,
        WeightFormat::Affine {
            bits: 4,
            group_size: 32,
            scale_dtype: Dtype::F32
        }
    );
    let f32s = |b: &[u8]| -> Vec<f32> {
        b.chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };
    assert_eq!(f32s(&parts.scales), sm.map(|(s, _)| s));
    assert_eq!(f32s(&parts.biases), sm.map(|(_, m)| -m));
    assert_same(&affine_rows(parts)[0], &y, false, "Q4_K affine");
}

#[test]
fn bad_input_is_an_error() {
    let q4k = ty("Q4_K");
    let block = random_blocks("Q4_K", 2, &mut Rng(1), 30);
    let err = |r: Result<AffineParts, String>| r.unwrap_err();
    // Wrong lengths, partial blocks, shapes that overflow.
    assert_eq!(
        err(to_affine(q4k, &block[1..], 1, 512)),
        "Q4_K: 287 bytes for 1 x 512 values, expected 288"
    );
    assert_eq!(
        err(to_affine(q4k, &block, 2, 512)),
        "Q4_K: 288 bytes for 2 x 512 values, expected 576"
    );
    assert_eq!(
        err(to_affine(q4k, &block, 2, 288)),
        "Q4_K: rows of 288 values are not whole blocks of 256"
    );
    assert!(err(to_affine(q4k, &block, usize::MAX, 512)).contains("more than memory holds"));
    assert!(dequantize(q4k, &block, 511)
        .unwrap_err()
        .contains("not whole blocks"));
    assert!(dequantize(q4k, &block, 256)
        .unwrap_err()
        .contains("expected 144"));
    assert!(dequantize(ty("F16"), &[0; 3], 2)
        .unwrap_err()
        .contains("expected 4"));
    // Types without an exact affine form, and dense ones.
    for name in ["IQ2_XXS", "IQ3_S", "IQ1_M", "TQ1_0", "Q8_1", "Q8_K"] {
        let t = ty(name);
        let bytes = vec![0; t.block_bytes() as usize];
        let n = t.block_elements() as usize;
        assert_eq!(
            err(to_affine(t, &bytes, 1, n)),
            format!("{name} has no exact affine form")
        );
        assert!(dequantize(t, &bytes, n).unwrap_err().contains(name));
    }
    assert_eq!(
        err(to_affine(ty("BF16"), &[0; 2], 1, 1)),
        "BF16 is dense: it has no affine form"
    );
    // Non-finite scales.
    for (name, at) in [("Q4_0", 0), ("Q4_1", 2), ("Q2_K", 82), ("Q6_K", 208)] {
        let t = ty(name);
        let mut bytes = random_blocks(name, 3, &mut Rng(2), 15);
        bytes[t.block_bytes() as usize + at..][..2].copy_from_slice(&f16::INFINITY.to_le_bytes());
        let n = 3 * t.block_elements() as usize;
        assert_eq!(
            err(to_affine(t, &bytes, 1, n)),
            format!("{name}: block 1 has an infinite or NaN scale")
        );
        assert_eq!(dequantize(t, &bytes, n).unwrap().len(), n);
    }
    // Empty is fine.
    assert_eq!(to_affine(q4k, &[], 0, 256).unwrap().data.len(), 0);
    assert!(dequantize(q4k, &[], 0).unwrap().is_empty());
}

#[test]
fn dense_types_dequantize() {
    let bytes = [0x00, 0x3C, 0x00, 0xC0]; // f16 1, -2
    assert_eq!(dequantize(ty("F16"), &bytes, 2).unwrap(), [1.0, -2.0]);
    assert_eq!(
        dequantize(ty("BF16"), &[0x80, 0x3F, 0x00, 0xC0], 2).unwrap(),
        [1.0, -2.0]
    );
    assert_eq!(
        dequantize(ty("F32"), &1.5f32.to_le_bytes(), 1).unwrap(),
        [1.5]
    );
}
