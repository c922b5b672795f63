//! Kernels against a straightforward f64 reference, at every SIMD level this CPU has.

use sluice_backend::{Dtype, MatRef, WeightFormat};

use super::*;

/// splitmix64: small, deterministic, good enough for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[lo, hi)`.
    fn f32(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32(lo, hi)).collect()
    }
}

fn encode(dt: Dtype, v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() * dt.size());
    for &x in v {
        match dt {
            Dtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&half::f16::from_f32(x).to_bits().to_le_bytes()),
            Dtype::Bf16 => out.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes()),
        }
    }
    out
}

fn decode64(dt: Dtype, bytes: &[u8], i: usize) -> f64 {
    match dt {
        Dtype::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()) as f64,
        Dtype::F16 => half::f16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f64(),
        Dtype::Bf16 => half::bf16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]).to_f64(),
    }
}

/// A random matrix whose three byte buffers each start `offset` bytes into their allocation.
struct TestMat {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    offset: usize,
    data: Vec<u8>,
    scales: Vec<u8>,
    biases: Vec<u8>,
}

impl TestMat {
    fn new(format: WeightFormat, rows: usize, cols: usize, offset: usize, rng: &mut Rng) -> Self {
        let pad = |mut v: Vec<u8>| {
            let mut out = vec![0xA5u8; offset];
            out.append(&mut v);
            out
        };
        let (data, scales, biases) = match format {
            WeightFormat::Dense(dt) => (
                encode(dt, &rng.vec(rows * cols, -1.0, 1.0)),
                Vec::new(),
                Vec::new(),
            ),
            WeightFormat::Affine {
                bits,
                group_size,
                scale_dtype,
            } => {
                let n = rows * format.row_bytes(cols);
                let data: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                let ng = rows * cols / group_size;
                let s = rng.vec(ng, 0.002, 0.05);
                let half = (1u32 << (bits - 1)) as f32;
                let b: Vec<f32> = s.iter().map(|&s| -s * half * rng.f32(0.8, 1.2)).collect();
                (data, encode(scale_dtype, &s), encode(scale_dtype, &b))
            }
            WeightFormat::Mxfp4 => {
                let n = rows * format.row_bytes(cols);
                let data: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                let ng = rows * cols / sluice_backend::MXFP4_GROUP;
                let e: Vec<u8> = (0..ng).map(|_| 118 + (rng.next() % 8) as u8).collect();
                (data, e, Vec::new())
            }
        };
        TestMat {
            format,
            rows,
            cols,
            offset,
            data: pad(data),
            scales: pad(scales),
            biases: pad(biases),
        }
    }

    fn view(&self) -> MatRef<'_> {
        let o = self.offset;
        let m = MatRef {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: &self.data[o..],
            scales: &self.scales[o.min(self.scales.len())..],
            biases: &self.biases[o.min(self.biases.len())..],
        };
        m.validate().unwrap();
        m
    }
}

/// Element `[r, c]` of `m`, straight from the definition of the format (bit by bit).
fn ref_weight(m: &MatRef, r: usize, c: usize) -> f64 {
    let rb = m.format.row_bytes(m.cols);
    let row = &m.data[r * rb..(r + 1) * rb];
    match m.format {
        WeightFormat::Dense(dt) => decode64(dt, row, c),
        WeightFormat::Affine {
            bits,
            group_size,
            scale_dtype,
        } => {
            let bits = bits as usize;
            let mut q = 0u32;
            for i in 0..bits {
                let bit = c * bits + i;
                q |= (((row[bit / 8] >> (bit % 8)) & 1) as u32) << i;
            }
            let g = r * (m.cols / group_size) + c / group_size;
            decode64(scale_dtype, m.scales, g) * q as f64 + decode64(scale_dtype, m.biases, g)
        }
        WeightFormat::Mxfp4 => {
            // E2M1: sign, two exponent bits (bias 1), one mantissa bit; exponent 0 subnormal.
            let q = (row[c / 2] >> (4 * (c % 2))) & 15;
            let (sign, exp, man) = (q >> 3, (q >> 1) & 3, q & 1);
            let v = match exp {
                0 => 0.5 * man as f64,
                e => (1.0 + 0.5 * man as f64) * 2f64.powi(e as i32 - 1),
            };
            let g = r * (m.cols / 32) + c / 32;
            let scale = 2f64.powi(m.scales[g] as i32 - 127);
            if sign == 1 {
                -v * scale
            } else {
                v * scale
            }
        }
    }
}

fn ref_matmul(m: &MatRef, x: &[f32], tokens: usize) -> Vec<f64> {
    let mut out = vec![0f64; tokens * m.rows];
    for r in 0..m.rows {
        let w: Vec<f64> = (0..m.cols).map(|c| ref_weight(m, r, c)).collect();
        for t in 0..tokens {
            let xt = &x[t * m.cols..(t + 1) * m.cols];
            out[t * m.rows + r] = w.iter().zip(xt).map(|(a, &b)| a * b as f64).sum();
        }
    }
    out
}

/// `Err` with a description if `got` differs from `want` by more than `1e-5 * max |want|`.
fn compare(got: &[f32], want: &[f64]) -> Result<(), String> {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f64, |a, &b| a.max(b.abs())).max(1e-30);
    let tol = 1e-5 * scale;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        if err.is_nan() || err > tol {
            return Err(format!(
                "element {i}: got {g}, want {w} (error {err:.3e}, tolerance {tol:.3e})"
            ));
        }
    }
    Ok(())
}

fn run(level: Level, kernels: Kernels, w: &MatRef, x: &[f32], tokens: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; tokens * w.rows];
    matmul_batch_at(
        level,
        kernels,
        &mut [MatmulJob {
            w: *w,
            x,
            tokens,
            out: &mut out,
        }],
    );
    out
}

fn check(level: Level, m: &TestMat, tokens: usize, rng: &mut Rng) {
    let w = m.view();
    let x = rng.vec(tokens * w.cols, -1.0, 1.0);
    let got = run(level, Kernels::Exact, &w, &x, tokens);
    let want = ref_matmul(&w, &x, tokens);
    if let Err(e) = compare(&got, &want) {
        panic!(
            "{} [{} x {}] {} tokens, offset {}, level {}: {e}",
            w.format,
            w.rows,
            w.cols,
            tokens,
            m.offset,
            level.name()
        );
    }
}

const DTYPES: [Dtype; 3] = [Dtype::F32, Dtype::F16, Dtype::Bf16];

/// Token counts that cover decode (1..=4), chunked decode, and the packed micro-kernel with
/// every tail of its 6- and 8-token tiles.
const TOKENS: [usize; 16] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 40, 41, 44, 45, 47];

#[test]
fn levels_are_detected() {
    let levels = available_levels();
    assert_eq!(levels[0], Level::Scalar);
    assert!(levels.contains(&level()));
    assert_eq!(simd_level(), level().name());
}

#[test]
fn comparison_detects_errors() {
    let mut rng = Rng(1);
    let m = TestMat::new(WeightFormat::Dense(Dtype::F32), 5, 40, 1, &mut rng);
    let w = m.view();
    let x = rng.vec(3 * 40, -1.0, 1.0);
    let want = ref_matmul(&w, &x, 3);
    let mut got = run(Level::Scalar, Kernels::Exact, &w, &x, 3);
    compare(&got, &want).unwrap();
    got[7] += 1e-3 * got[7].abs().max(1.0);
    assert!(compare(&got, &want).is_err());
    got[7] = f32::NAN;
    assert!(compare(&got, &want).is_err());
}

#[test]
fn dense_every_dtype_every_level() {
    let mut rng = Rng(2);
    for level in available_levels() {
        for dt in DTYPES {
            for (rows, cols) in [(1, 1), (7, 13), (37, 77), (70, 300), (33, 520)] {
                let m = TestMat::new(WeightFormat::Dense(dt), rows, cols, 1 + rows % 3, &mut rng);
                for tokens in TOKENS {
                    check(level, &m, tokens, &mut rng);
                }
            }
        }
    }
}

/// 4- and 8-bit affine formats with every group size (of their fast paths) and scale dtype,
/// and their group sizes.
fn affine_4_and_8_bits() -> Vec<(WeightFormat, usize)> {
    let mut v = Vec::new();
    for (bits, sizes) in [(4, &[32, 64, 128][..]), (8, &[16, 32, 64, 128])] {
        for &gs in sizes {
            for sdt in DTYPES {
                let format = WeightFormat::Affine {
                    bits,
                    group_size: gs,
                    scale_dtype: sdt,
                };
                v.push((format, gs));
            }
        }
    }
    v
}

#[test]
fn affine_4_and_8_bits_every_group_scale_dtype_and_level() {
    let mut rng = Rng(3);
    for level in available_levels() {
        for (format, gs) in affine_4_and_8_bits() {
            // Column counts of 1, 3 and 5 groups (partial SIMD blocks, several `KC` blocks
            // with a short last one; for group 16, steps of 2 and 4 groups with every tail)
            // and odd row counts.
            for (i, (rows, ngroups)) in [(3, 1), (37, 3), (45, 5)].into_iter().enumerate() {
                let m = TestMat::new(format, rows, gs * ngroups, 1 + i, &mut rng);
                for tokens in TOKENS {
                    check(level, &m, tokens, &mut rng);
                }
            }
        }
    }
}

/// gpt-oss's mxfp4 at every level, decode and prefill token counts, against the format's
/// definition bit by bit.
#[test]
fn mxfp4_every_level() {
    let mut rng = Rng(31);
    for level in available_levels() {
        for (i, (rows, cols)) in [(3, 32), (37, 96), (45, 320), (9, 2880)]
            .into_iter()
            .enumerate()
        {
            let m = TestMat::new(WeightFormat::Mxfp4, rows, cols, 1 + i, &mut rng);
            for tokens in TOKENS {
                check(level, &m, tokens, &mut rng);
            }
        }
    }
}

#[test]
fn affine_long_rows() {
    // Columns beyond several `KC` blocks and every 128-column block alignment; for group 16,
    // a last `KC` block of 1 group and one of 14 (scales transposed 8 groups at a time), with
    // every scale dtype.
    let mut rng = Rng(4);
    for level in available_levels() {
        for (bits, gs, cols, sdt) in [
            (4, 32, 1056, Dtype::Bf16),
            (4, 64, 1088, Dtype::Bf16),
            (4, 128, 1152, Dtype::Bf16),
            (8, 32, 800, Dtype::Bf16),
            (8, 16, 784, Dtype::F32),
            (8, 16, 992, Dtype::F16),
            (8, 16, 800, Dtype::Bf16),
        ] {
            let format = WeightFormat::Affine {
                bits,
                group_size: gs,
                scale_dtype: sdt,
            };
            let m = TestMat::new(format, 67, cols, 3, &mut rng);
            for tokens in [1, 2, 4, 7, 64] {
                check(level, &m, tokens, &mut rng);
            }
        }
    }
}

#[test]
fn every_token_count_up_to_60() {
    let mut rng = Rng(10);
    let format = WeightFormat::Affine {
        bits: 4,
        group_size: 32,
        scale_dtype: Dtype::Bf16,
    };
    let m = TestMat::new(format, 50, 96, 1, &mut rng);
    for level in available_levels() {
        for tokens in 1..=60 {
            check(level, &m, tokens, &mut rng);
        }
    }
}

#[test]
fn many_tokens() {
    let mut rng = Rng(5);
    for level in available_levels() {
        for format in [
            WeightFormat::Affine {
                bits: 4,
                group_size: 64,
                scale_dtype: Dtype::Bf16,
            },
            WeightFormat::Affine {
                bits: 8,
                group_size: 32,
                scale_dtype: Dtype::F16,
            },
            WeightFormat::Affine {
                bits: 8,
                group_size: 16,
                scale_dtype: Dtype::F32,
            },
            WeightFormat::Dense(Dtype::Bf16),
        ] {
            // 130 rows: two row blocks plus a partial one; 300 tokens: many tiles plus a tail.
            let m = TestMat::new(format, 130, 320, 2, &mut rng);
            for tokens in [64, 300] {
                check(level, &m, tokens, &mut rng);
            }
        }
    }
}

#[test]
fn empty_shapes() {
    let mut rng = Rng(11);
    for level in available_levels() {
        for (rows, cols) in [(0, 16), (5, 0), (0, 0)] {
            let m = TestMat::new(WeightFormat::Dense(Dtype::F32), rows, cols, 1, &mut rng);
            for tokens in [0, 1, 3, 50] {
                check(level, &m, tokens, &mut rng);
            }
        }
    }
}

/// 2-, 3-, 5- and 6-bit affine formats (unpacked to bytes for the 8-bit kernels in decode)
/// with every group size and scale dtype, decode (1..=4 tokens), chunked decode and prefill;
/// rows long enough for the unpacker's main loop (32 codes at a time) and its tails.
#[test]
fn affine_other_widths_every_group_scale_dtype_and_level() {
    let mut rng = Rng(13);
    for level in available_levels() {
        for bits in [2, 3, 5, 6] {
            for gs in [16, 32, 64, 128] {
                for sdt in DTYPES {
                    let format = WeightFormat::Affine {
                        bits,
                        group_size: gs,
                        scale_dtype: sdt,
                    };
                    assert_eq!(Kind::of(format), Kind::QBits { bits, gs, sdt });
                    // Column counts of 1, 3 and 5 groups (and at least 32 for whole words).
                    for (i, (rows, ngroups)) in [(3, 1), (21, 3), (18, 5)].into_iter().enumerate() {
                        let cols = (gs * ngroups).next_multiple_of(32);
                        let m = TestMat::new(format, rows, cols, 1 + i, &mut rng);
                        for tokens in [1, 2, 3, 4, 5, 9, 17] {
                            check(level, &m, tokens, &mut rng);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn affine_other_widths_long_rows_many_tasks() {
    // Rows of many unpacker steps with every tail (16 codes or none), enough rows for several
    // tasks, decode and chunked decode.
    let mut rng = Rng(14);
    for level in available_levels() {
        for (bits, gs, cols, sdt) in [
            (2, 16, 1040, Dtype::F16),
            (3, 16, 1056, Dtype::F32),
            (5, 32, 2080, Dtype::F32),
            (5, 32, 2048, Dtype::F16),
            (6, 64, 1088, Dtype::Bf16),
            (6, 16, 1040, Dtype::F32),
            (3, 128, 1152, Dtype::Bf16),
        ] {
            let format = WeightFormat::Affine {
                bits,
                group_size: gs,
                scale_dtype: sdt,
            };
            let m = TestMat::new(format, 300, cols, 3, &mut rng);
            for tokens in [1, 2, 3, 4, 7] {
                check(level, &m, tokens, &mut rng);
            }
        }
    }
}

#[test]
fn generic_affine_bits() {
    let mut rng = Rng(6);
    for level in available_levels() {
        for bits in [2, 3, 4, 5, 6, 8] {
            for gs in [16, 32, 64] {
                let format = WeightFormat::Affine {
                    bits,
                    group_size: gs,
                    scale_dtype: Dtype::Bf16,
                };
                // `cols * bits` must fill whole u32 words.
                let cols = 2 * gs.max(32);
                let m = TestMat::new(format, 19, cols, 3, &mut rng);
                for tokens in [1, 3, 7] {
                    check(level, &m, tokens, &mut rng);
                }
            }
        }
    }
}

#[test]
fn dequantize_row_every_format_and_level() {
    let mut rng = Rng(7);
    let mut formats: Vec<WeightFormat> = DTYPES.iter().map(|&d| WeightFormat::Dense(d)).collect();
    for bits in [2, 3, 4, 5, 6, 8] {
        for gs in [16, 32, 64, 128] {
            for sdt in DTYPES {
                formats.push(WeightFormat::Affine {
                    bits,
                    group_size: gs,
                    scale_dtype: sdt,
                });
            }
        }
    }
    for level in available_levels() {
        for &format in &formats {
            let m = TestMat::new(format, 5, 384, 1, &mut rng);
            let w = m.view();
            let mut row = vec![f32::NAN; w.cols];
            for r in 0..w.rows {
                dequantize_row_at(level, &w, r, &mut row);
                let want: Vec<f64> = (0..w.cols).map(|c| ref_weight(&w, r, c)).collect();
                if let Err(e) = compare(&row, &want) {
                    panic!("{format} row {r}, level {}: {e}", level.name());
                }
            }
        }
    }
    // The public entry point (at the level in use).
    let m = TestMat::new(WeightFormat::Dense(Dtype::Bf16), 2, 9, 2, &mut rng);
    let w = m.view();
    let mut row = vec![0f32; 9];
    dequantize_row(&w, 1, &mut row);
    let want: Vec<f64> = (0..9).map(|c| ref_weight(&w, 1, c)).collect();
    compare(&row, &want).unwrap();
}

#[test]
fn batch_of_mixed_jobs() {
    let mut rng = Rng(8);
    let q4 = WeightFormat::Affine {
        bits: 4,
        group_size: 64,
        scale_dtype: Dtype::Bf16,
    };
    let q8 = WeightFormat::Affine {
        bits: 8,
        group_size: 32,
        scale_dtype: Dtype::F32,
    };
    let q3 = WeightFormat::Affine {
        bits: 3,
        group_size: 32,
        scale_dtype: Dtype::F16,
    };
    let q8g16 = WeightFormat::Affine {
        bits: 8,
        group_size: 16,
        scale_dtype: Dtype::F32,
    };
    let mats: Vec<TestMat> = [
        (q4, 96, 256),
        (q4, 96, 256),
        (q8, 40, 96),
        (q8g16, 33, 272),
        (WeightFormat::Dense(Dtype::F32), 13, 29),
        (q4, 300, 192),
        (q3, 17, 64),
        (WeightFormat::Dense(Dtype::F16), 70, 64),
        (q4, 0, 64),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (f, r, c))| TestMat::new(f, r, c, i % 4, &mut rng))
    .collect();
    let tokens = [1, 1, 3, 4, 5, 9, 2, 1, 2];
    // Jobs 0 and 1 share their input (as gate and up projections do).
    let mut xs: Vec<Vec<f32>> = mats
        .iter()
        .zip(tokens)
        .map(|(m, t)| rng.vec(t * m.cols, -1.0, 1.0))
        .collect();
    xs[1] = xs[0].clone();
    for level in available_levels() {
        let views: Vec<MatRef> = mats.iter().map(|m| m.view()).collect();
        let mut outs: Vec<Vec<f32>> = views
            .iter()
            .zip(tokens)
            .map(|(w, t)| vec![f32::NAN; t * w.rows])
            .collect();
        {
            let mut jobs: Vec<MatmulJob> = views
                .iter()
                .zip(&mut outs)
                .enumerate()
                .map(|(i, (w, out))| MatmulJob {
                    w: *w,
                    x: if i == 1 { &xs[0] } else { &xs[i] },
                    tokens: tokens[i],
                    out,
                })
                .collect();
            matmul_batch_at(level, Kernels::Exact, &mut jobs);
        }
        for (i, w) in views.iter().enumerate() {
            let want = ref_matmul(w, &xs[i], tokens[i]);
            if let Err(e) = compare(&outs[i], &want) {
                panic!("job {i} ({}), level {}: {e}", w.format, level.name());
            }
        }
    }
}

#[test]
fn public_matmul_many_rows_uses_threads_correctly() {
    // Enough rows for many tasks on every level; checks the task split and the output layout.
    let mut rng = Rng(9);
    let format = WeightFormat::Affine {
        bits: 4,
        group_size: 64,
        scale_dtype: Dtype::Bf16,
    };
    let m = TestMat::new(format, 1500, 512, 1, &mut rng);
    let w = m.view();
    for tokens in [1, 3, 70] {
        let x = rng.vec(tokens * w.cols, -1.0, 1.0);
        let mut out = vec![f32::NAN; tokens * w.rows];
        matmul(Kernels::Exact, &w, &x, tokens, &mut out);
        compare(&out, &ref_matmul(&w, &x, tokens)).unwrap();
        // The integer prefill too (rows past many panels and tasks, tokens past many tiles),
        // against the f64 reference of its arithmetic.
        if use_igemm(level(), Kernels::Fast, Kind::of(w.format), tokens) {
            matmul(Kernels::Fast, &w, &x, tokens, &mut out);
            compare(&out, &ref_matmul_q4_blocks(&w, &x, tokens)).unwrap();
        }
    }
}

#[test]
fn q8_group16_many_rows_and_tasks_every_level() {
    // 8-bit group 16 (GGUF's Q6_K as converted): rows for several tasks per thread, 17 groups
    // a row (a tail after the steps of 2 and of 4 groups), decode, chunked decode and prefill.
    let mut rng = Rng(12);
    for sdt in DTYPES {
        let format = WeightFormat::Affine {
            bits: 8,
            group_size: 16,
            scale_dtype: sdt,
        };
        assert_eq!(
            Kind::of(format),
            Kind::Q8 { gs: 16, sdt },
            "group 16 takes the 8-bit fast paths"
        );
        let q4g16 = WeightFormat::Affine {
            bits: 4,
            group_size: 16,
            scale_dtype: sdt,
        };
        assert_eq!(Kind::of(q4g16), Kind::QAny, "4-bit group 16 stays generic");
        let m = TestMat::new(format, 1500, 272, 1, &mut rng);
        for level in available_levels() {
            for tokens in [1, 2, 3, 4, 9, 40] {
                check(level, &m, tokens, &mut rng);
            }
        }
    }
}

#[test]
fn permutation_is_the_nibble_order() {
    let x: Vec<f32> = (0..96).map(|i| i as f32).collect();
    let mut dst = vec![-1f32; 128];
    permute_q4(&x, 8, false, &mut dst);
    // Block 0: word j, nibble k -> position 8k + j.
    assert_eq!(dst[0], 0.0);
    assert_eq!(dst[1], 8.0);
    assert_eq!(dst[8], 1.0);
    assert_eq!(dst[8 * 7 + 7], 63.0);
    // Block 1 holds 32 real columns (words 0..4) and zeros.
    assert_eq!(dst[64 + 8 + 3], 64.0 + 25.0);
    assert_eq!(dst[64 + 8 + 4], 0.0);
    // Scaled: nibble k times 2^-4k, except the last.
    permute_q4(&x, 8, true, &mut dst);
    assert_eq!(dst[8], 1.0 / 16.0);
    assert_eq!(dst[8 * 6 + 1], 14.0 / 16f32.powi(6));
    assert_eq!(dst[8 * 7 + 7], 63.0);
}

/// Code, scale and bias of element `[r, c]` of an affine `m`.
fn ref_affine(m: &MatRef, r: usize, c: usize) -> (f64, f64, f64) {
    let WeightFormat::Affine {
        bits,
        group_size,
        scale_dtype,
    } = m.format
    else {
        panic!("not affine");
    };
    let rb = m.format.row_bytes(m.cols);
    let row = &m.data[r * rb..(r + 1) * rb];
    let bits = bits as usize;
    let mut q = 0u32;
    for i in 0..bits {
        let bit = c * bits + i;
        q |= (((row[bit / 8] >> (bit % 8)) & 1) as u32) << i;
    }
    let g = r * (m.cols / group_size) + c / group_size;
    (
        q as f64,
        decode64(scale_dtype, m.scales, g),
        decode64(scale_dtype, m.biases, g),
    )
}

/// One token's outputs of an affine `m` in f64: the scale part against the rounded
/// activations `xhat`, the bias part against exact `x`.
fn ref_affine_rows(m: &MatRef, x: &[f32], xhat: &[f64], out: &mut [f64]) {
    for (r, o) in out.iter_mut().enumerate() {
        *o = (0..m.cols)
            .map(|c| {
                let (q, s, b) = ref_affine(m, r, c);
                s * q * xhat[c] + b * x[c] as f64
            })
            .sum();
    }
}

/// What the integer 4-bit decode computes, in f64: the scale part against the activations as
/// `quantize_q4i` rounds them (read back from its layout), the bias part against exact `x`.
fn ref_matmul_q4i(m: &MatRef, x: &[f32], tokens: usize, bpb: usize) -> Vec<f64> {
    let cols = m.cols;
    let ld = cols.div_ceil(2 * bpb) * 2 * bpb;
    let mut out = vec![0f64; tokens * m.rows];
    for t in 0..tokens {
        let xt = &x[t * cols..(t + 1) * cols];
        let (mut xq, mut xd) = (vec![0i8; ld], vec![0f32; ld / 8]);
        quantize_q4i(xt, bpb, &mut xq, &mut xd);
        let xhat: Vec<f64> = (0..cols)
            .map(|e| {
                let (blk, i) = (e / (2 * bpb), e % (2 * bpb));
                xq[blk * 2 * bpb + (i % 2) * bpb + i / 2] as f64 * xd[e / 8] as f64
            })
            .collect();
        ref_affine_rows(m, xt, &xhat, &mut out[t * m.rows..(t + 1) * m.rows]);
    }
    out
}

/// What the integer 4-bit prefill computes, in f64: the scale part against the activations as
/// `igemm::quantize_blocks` rounds them (per 32 values, read back from its layout), the bias
/// part against exact `x`.
fn ref_matmul_q4_blocks(m: &MatRef, x: &[f32], tokens: usize) -> Vec<f64> {
    let cols = m.cols;
    let mut out = vec![0f64; tokens * m.rows];
    for t in 0..tokens {
        let xt = &x[t * cols..(t + 1) * cols];
        let (mut xq, mut xd) = (vec![0i8; cols], vec![0f32; cols / 32]);
        for (b, d) in xd.iter_mut().enumerate() {
            *d = igemm::quantize_block(&xt[32 * b..32 * b + 32], &mut xq[32 * b..32 * b + 32]);
        }
        let xhat: Vec<f64> = (0..cols)
            .map(|e| {
                let k = e % 8;
                xq[e - k + (k % 2) * 4 + k / 2] as f64 * xd[e / 32] as f64
            })
            .collect();
        ref_affine_rows(m, xt, &xhat, &mut out[t * m.rows..(t + 1) * m.rows]);
    }
    out
}

/// `Kernels::Fast` at `level`: the integer path (4-bit products on x86: the decode kernels
/// below `IGEMM_MIN_TOKENS` tokens, the integer prefill from there) equals its own f64
/// reference as tightly as the exact path equals the exact one, and stays within the
/// quantization error of the exact reference; every other product is the exact path.
fn check_fast(level: Level, m: &TestMat, tokens: usize, rng: &mut Rng) {
    let w = m.view();
    let x = rng.vec(tokens * w.cols, -1.0, 1.0);
    let got = run(level, Kernels::Fast, &w, &x, tokens);
    let exact = ref_matmul(&w, &x, tokens);
    let what = || {
        format!(
            "{} [{} x {}] {tokens} tokens, level {}",
            w.format,
            w.rows,
            w.cols,
            level.name()
        )
    };
    let integer = integer_q4(level, Kernels::Fast, Kind::of(w.format));
    if !integer {
        compare(&got, &exact).unwrap_or_else(|e| panic!("{}: {e}", what()));
        return;
    }
    // Activations share a scale per word (decode) or per 32 values (prefill).
    let (want, span) = if use_igemm(level, Kernels::Fast, Kind::of(w.format), tokens) {
        (ref_matmul_q4_blocks(&w, &x, tokens), 32)
    } else {
        (ref_matmul_q4i(&w, &x, tokens, q4i_block_bytes(level)), 8)
    };
    compare(&got, &want).unwrap_or_else(|e| panic!("{} (integer path): {e}", what()));
    // Rounding moves each activation by at most half its step (max |x| / 127 over the values
    // sharing its scale), so an output moves by at most the sum of |scale x code| times that
    // over its row.
    let scale = exact.iter().fold(0f64, |a, &b| a.max(b.abs()));
    for t in 0..tokens {
        let xt = &x[t * w.cols..(t + 1) * w.cols];
        let half_step: Vec<f64> = xt
            .chunks(span)
            .map(|v| v.iter().fold(0f64, |a, &b| a.max(b.abs() as f64)) / 254.0)
            .collect();
        for r in 0..w.rows {
            let bound: f64 = (0..w.cols)
                .map(|c| {
                    let (q, s, _) = ref_affine(&w, r, c);
                    (s * q).abs() * half_step[c / span]
                })
                .sum();
            let (g, e) = (got[t * w.rows + r] as f64, exact[t * w.rows + r]);
            assert!(
                (g - e).abs() <= bound + 1e-5 * scale,
                "{}: row {r} token {t}: {g} vs exact {e}, bound {bound}",
                what()
            );
        }
    }
}

#[test]
fn fast_kernels_every_format_group_and_level() {
    let mut rng = Rng(21);
    for level in available_levels() {
        for (format, gs) in affine_4_and_8_bits() {
            for (i, (rows, ngroups)) in [(3, 1), (37, 3), (21, 9)].into_iter().enumerate() {
                let m = TestMat::new(format, rows, gs * ngroups, 1 + i, &mut rng);
                for tokens in [1, 2, 3, 4, 5, 9, 15, 16, 17, 18, 19, 40] {
                    check_fast(level, &m, tokens, &mut rng);
                }
            }
        }
        let m = TestMat::new(WeightFormat::Dense(Dtype::Bf16), 9, 80, 0, &mut rng);
        check_fast(level, &m, 2, &mut rng);
    }
}

#[test]
fn fast_kernels_long_rows_and_both_x86_flavours() {
    let mut rng = Rng(22);
    for (gs, cols) in [(32, 1056), (64, 2048), (64, 768), (128, 1152)] {
        let format = WeightFormat::Affine {
            bits: 4,
            group_size: gs,
            scale_dtype: Dtype::Bf16,
        };
        let m = TestMat::new(format, 67, cols, 2, &mut rng);
        for level in available_levels() {
            for tokens in [1, 4, 7, 21] {
                check_fast(level, &m, tokens, &mut rng);
            }
        }
        #[cfg(target_arch = "x86_64")]
        if available_levels().contains(&Level::Avx512) {
            // AVX-512 (with VNNI where the CPU has it) and AVX2 sum the same integers and
            // scale them in the same order: identical results, decode and prefill.
            let w = m.view();
            for tokens in [3, 21] {
                let x = rng.vec(tokens * w.cols, -1.0, 1.0);
                let wide = run(Level::Avx512, Kernels::Fast, &w, &x, tokens);
                let narrow = run(Level::Avx2, Kernels::Fast, &w, &x, tokens);
                assert_eq!(wide, narrow, "group {gs}, {cols} columns, {tokens} tokens");
                let want = if tokens >= IGEMM_MIN_TOKENS {
                    ref_matmul_q4_blocks(&w, &x, tokens)
                } else {
                    ref_matmul_q4i(&w, &x, tokens, 32)
                };
                compare(&wide, &want).unwrap();
            }
        }
    }
}

#[test]
fn q4i_quantization_layout_and_non_finite_values() {
    let x: Vec<f32> = (0..72).map(|i| i as f32 - 20.0).collect();
    let (mut xq, mut xd) = (vec![9i8; 128], vec![9f32; 16]);
    quantize_q4i(&x, 32, &mut xq, &mut xd);
    // Word 0 holds -20..-13: its scale is 20/127 and -20 becomes -127.
    assert_eq!(xd[0], 20.0 / 127.0);
    assert_eq!(xq[0], -127);
    // Block 0 (64 values): even values first, odd ones 32 bytes later.
    assert_eq!(xq[1], (-18.0f32 * 127.0 / 20.0).round() as i8);
    assert_eq!(xq[32], (-19.0f32 * 127.0 / 20.0).round() as i8);
    // Word 7 holds 36..43: 43 is +127.
    assert_eq!(xd[7], 43.0 / 127.0);
    assert_eq!(xq[32 + 31], 127);
    // Block 1 holds values 64..72 (44..51), then zero padding.
    assert_eq!(xq[64 + 32 + 3], 127);
    assert_eq!(xq[64 + 4], 0);
    assert!(xd[9..].iter().all(|&d| d == 0.0));
    // A word of zeros has scale 0; a NaN or infinity makes its word's scale NaN.
    let mut y = vec![0f32; 64];
    y[9] = f32::INFINITY;
    y[20] = f32::NAN;
    quantize_q4i(&y, 32, &mut xq[..64], &mut xd[..8]);
    assert_eq!(xd[0], 0.0);
    assert!(xd[1].is_nan() && xd[2].is_nan());
    assert_eq!(xd[3], 0.0);
}

#[test]
fn q4i_quantization_simd_equals_scalar() {
    let mut rng = Rng(23);
    for bpb in [32, 64] {
        // Values on a grid of halves hit rounding ties; a partial last word takes the scalar
        // code in both.
        let mut x = rng.vec(1003, -3.0, 3.0);
        for v in x.iter_mut().step_by(7) {
            *v = (*v * 2.0).round() / 2.0;
        }
        // A NaN, an infinity, and a word of zeros, inside and outside blocks of eight words.
        x[40] = f32::NAN;
        x[700] = f32::INFINITY;
        x[512..520].fill(0.0);
        let ld = x.len().div_ceil(2 * bpb) * 2 * bpb;
        let (mut xq, mut xd) = (vec![0i8; ld], vec![0f32; ld / 8]);
        quantize_q4i(&x, bpb, &mut xq, &mut xd);
        let (mut sq, mut sd) = (vec![0i8; ld], vec![0f32; ld / 8]);
        for (w, vals) in x.chunks(8).enumerate() {
            sd[w] = quantize_word(vals, bpb, w, &mut sq);
        }
        assert_eq!(xq, sq, "codes, blocks of {bpb}");
        for (a, b) in xd.iter().zip(&sd) {
            assert!(a == b || (a.is_nan() && b.is_nan()), "scales {a} vs {b}");
        }
        assert!(xd[5].is_nan() && xd[87].is_nan() && xd[64] == 0.0);
    }
}

#[test]
fn block_quantization_layout_and_non_finite_values() {
    let x: Vec<f32> = (0..64).map(|i| i as f32 - 20.0).collect();
    let (mut q, mut d) = (vec![9i8; 64], vec![9f32; 2]);
    igemm::quantize_blocks(&x, &mut q, &mut d);
    // Block 0 holds -20..11: its scale is 20/127 and -20 becomes -127.
    assert_eq!(d[0], 20.0 / 127.0);
    assert_eq!(q[0], -127);
    // Each 8 values: the even ones, then the odd ones.
    assert_eq!(q[1], (-18.0f32 * 127.0 / 20.0).round() as i8);
    assert_eq!(q[4], (-19.0f32 * 127.0 / 20.0).round() as i8);
    assert_eq!(q[8 + 4], (-11.0f32 * 127.0 / 20.0).round() as i8);
    // Block 1 holds 12..43: 43 is +127, at the last odd place.
    assert_eq!(d[1], 43.0 / 127.0);
    assert_eq!(q[63], 127);
    assert_eq!(q[32], (12.0f32 * 127.0 / 43.0).round() as i8);
    // A block of zeros has scale 0; a NaN or infinity makes its block's scale NaN.
    let mut y = vec![0f32; 96];
    y[40] = f32::INFINITY;
    y[70] = f32::NAN;
    let (mut q, mut d) = (vec![9i8; 96], vec![9f32; 3]);
    igemm::quantize_blocks(&y, &mut q, &mut d);
    assert_eq!(d[0], 0.0);
    assert!(q[..32].iter().all(|&v| v == 0));
    assert!(d[1].is_nan() && d[2].is_nan());
}

#[test]
fn block_quantization_simd_equals_scalar() {
    let mut rng = Rng(24);
    // Values on a grid of halves hit rounding ties.
    let mut x = rng.vec(32 * 41, -3.0, 3.0);
    for v in x.iter_mut().step_by(7) {
        *v = (*v * 2.0).round() / 2.0;
    }
    x[100] = f32::NAN;
    let (mut q, mut d) = (vec![0i8; x.len()], vec![0f32; x.len() / 32]);
    igemm::quantize_blocks(&x, &mut q, &mut d);
    let (mut sq, mut sd) = (vec![0i8; x.len()], vec![0f32; x.len() / 32]);
    for (b, d) in sd.iter_mut().enumerate() {
        *d = igemm::quantize_block(&x[32 * b..32 * b + 32], &mut sq[32 * b..32 * b + 32]);
    }
    assert_eq!(q, sq);
    for (a, b) in d.iter().zip(&sd) {
        assert!(a == b || (a.is_nan() && b.is_nan()), "scales {a} vs {b}");
    }
    assert!(d[3].is_nan());
}

/// (rows, row length, stride) for the attention helpers over strided rows: none, one, fewer and
/// more than a run of four, row lengths with and without vector tails.
const STRIDED_ROWS: [(usize, usize, usize); 8] = [
    (0, 128, 512),
    (1, 128, 128),
    (7, 128, 512),
    (37, 128, 512),
    (9, 72, 80),
    (37, 72, 80),
    (5, 13, 13),
    (9, 13, 13),
];

#[test]
fn weighted_rows_equals_repeated_axpy() {
    let mut rng = Rng(26);
    for (n, hd, stride) in STRIDED_ROWS {
        let rows = rng.vec((n.max(1) - 1) * stride + hd, -1.0, 1.0);
        let w = rng.vec(n, 0.0, 1.0);
        let mut want = vec![0f32; hd];
        for (p, &wp) in w.iter().enumerate() {
            axpy(wp, &rows[p * stride..p * stride + hd], &mut want);
        }
        let mut got = vec![f32::NAN; hd];
        weighted_rows(&w, &rows, stride, &mut got);
        assert_eq!(got, want, "{n} rows of {hd}, stride {stride}");
    }
}

#[test]
fn scaled_dots_equal_the_f64_dot() {
    let mut rng = Rng(27);
    for (n, hd, stride) in STRIDED_ROWS {
        let rows = rng.vec((n.max(1) - 1) * stride + hd, -1.0, 1.0);
        let q = rng.vec(hd, -1.0, 1.0);
        let mut got = vec![f32::NAN; n];
        scaled_dots(&q, &rows, stride, 0.125, &mut got);
        for (p, &g) in got.iter().enumerate() {
            let want: f64 = q
                .iter()
                .zip(&rows[p * stride..p * stride + hd])
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>()
                * 0.125;
            assert!(
                (g as f64 - want).abs() <= 1e-5,
                "{n} rows of {hd}, row {p}: {g} vs {want}"
            );
        }
    }
}

#[test]
fn silu_mul_is_within_a_few_ulp_of_f64() {
    let mut rng = Rng(31);
    // Ordinary values, the exp clamp's neighbourhood, and the lengths' scalar tails.
    let mut gate = rng.vec(4099, -30.0, 30.0);
    gate.extend([
        0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 88.5, -88.5, 100.0, -100.0, -1e4, 1e4,
    ]);
    let up: Vec<f32> = (0..gate.len())
        .map(|i| if i % 7 == 0 { 1.0 } else { rng.f32(-2.0, 2.0) })
        .collect();
    let mut got = gate.clone();
    silu_mul(&mut got, &up);
    for (i, ((&g, &u), &r)) in gate.iter().zip(&up).zip(&got).enumerate() {
        let (g64, u64) = (g as f64, u as f64);
        let want = g64 / (1.0 + (-g64).exp()) * u64;
        let tol = 4.0 * f32::EPSILON as f64 * want.abs() + 1e-37;
        assert!(
            (r as f64 - want).abs() <= tol,
            "index {i}: silu({g}) * {u} = {r}, want {want}"
        );
    }
    // Non-finite inputs: NaN stays NaN (the clamp must not hide it), silu(inf) = inf.
    let mut nf = vec![f32::NAN, f32::INFINITY, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    silu_mul(&mut nf, &[1.0; 8]);
    assert!(nf[0].is_nan());
    assert_eq!(nf[1], f32::INFINITY);
}

#[test]
fn silu_is_within_a_few_ulp_of_f64() {
    let mut rng = Rng(37);
    let mut x = rng.vec(1029, -30.0, 30.0);
    x.extend([
        0.0, -0.0, 1e-30, -1e-30, 87.0, -87.0, 88.5, -88.5, -1e4, 1e4,
    ]);
    let mut got = x.clone();
    silu(&mut got);
    for (i, (&v, &r)) in x.iter().zip(&got).enumerate() {
        let want = v as f64 / (1.0 + (-v as f64).exp());
        let tol = 4.0 * f32::EPSILON as f64 * want.abs() + 1e-37;
        assert!(
            (r as f64 - want).abs() <= tol,
            "index {i}: silu({v}) = {r}, want {want}"
        );
    }
    // The gated norm's form: y = silu(gate) * y.
    let y0 = rng.vec(x.len(), -2.0, 2.0);
    let mut y = y0.clone();
    mul_silu(&mut y, &x);
    for (i, ((&g, &v), &r)) in x.iter().zip(&y0).zip(&y).enumerate() {
        let want = g as f64 / (1.0 + (-g as f64).exp()) * v as f64;
        let tol = 4.0 * f32::EPSILON as f64 * want.abs() + 1e-37;
        assert!(
            (r as f64 - want).abs() <= tol,
            "index {i}: silu({g}) * {v} = {r}, want {want}"
        );
    }
}

/// Three tokens of the gated delta rule on one head, at every SIMD level, against the same
/// steps in f64; key dimensions with and without scalar tails.
#[test]
fn delta_rule_step_every_level_matches_f64() {
    let mut rng = Rng(41);
    for dk in [128, 40, 13, 8, 1] {
        let dv = 5;
        let s0 = rng.vec(dv * dk, -1.0, 1.0);
        let steps: Vec<_> = (0..3)
            .map(|_| {
                let (k, q, v) = (
                    rng.vec(dk, -1.0, 1.0),
                    rng.vec(dk, -1.0, 1.0),
                    rng.vec(dv, -2.0, 2.0),
                );
                (k, q, v, rng.f32(0.5, 1.0), rng.f32(0.0, 1.0))
            })
            .collect();
        let mut want: Vec<f64> = s0.iter().map(|&x| x as f64).collect();
        let mut want_y = Vec::new();
        for (k, q, v, g, beta) in &steps {
            for (i, row) in want.chunks_exact_mut(dk).enumerate() {
                row.iter_mut().for_each(|x| *x *= *g as f64);
                let kv: f64 = row.iter().zip(k).map(|(a, &b)| a * b as f64).sum();
                let delta = (v[i] as f64 - kv) * *beta as f64;
                row.iter_mut()
                    .zip(k)
                    .for_each(|(a, &b)| *a += delta * b as f64);
                want_y.push(row.iter().zip(q).map(|(a, &b)| a * b as f64).sum::<f64>());
            }
        }
        for level in available_levels() {
            let (mut s, mut ys) = (s0.clone(), Vec::new());
            for (k, q, v, g, beta) in &steps {
                let mut y = vec![0.0; dv];
                delta_rule_step_at(level, &mut s, k, q, v, (*g, *beta), &mut y);
                ys.extend(y);
            }
            let close = |a: f32, b: f64| (a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs());
            for (i, (&a, &b)) in s.iter().zip(&want).enumerate() {
                assert!(
                    close(a, b),
                    "{}, dk {dk}: state {i}: {a} vs {b}",
                    level.name()
                );
            }
            for (i, (&a, &b)) in ys.iter().zip(&want_y).enumerate() {
                assert!(
                    close(a, b),
                    "{}, dk {dk}: output {i}: {a} vs {b}",
                    level.name()
                );
            }
        }
    }
}

/// SwiGLU through the same kernel the backend uses (so both sides round alike).
fn test_activation(_: usize, h: &mut [f32], u: &[f32]) {
    silu_mul(h, u);
}

/// `ffn_batch` against its definition: two `matmul_batch` calls with the activations between
/// them, bit for bit; experts of several formats and token counts (none included), on a team
/// of 4 threads, at every level and both kernel choices.
#[test]
fn ffn_batch_equals_gate_up_activation_down() {
    let mut rng = Rng(21);
    let q4 = WeightFormat::Affine {
        bits: 4,
        group_size: 64,
        scale_dtype: Dtype::Bf16,
    };
    let q8 = WeightFormat::Affine {
        bits: 8,
        group_size: 32,
        scale_dtype: Dtype::F16,
    };
    let (hidden, inter) = (512, 320);
    // (format, tokens): enough weight bytes that the step runs on the team.
    let experts = [
        (q4, 1),
        (q8, 1),
        (q4, 3),
        (q4, 0),
        (WeightFormat::Dense(Dtype::Bf16), 2),
    ];
    let mats: Vec<[TestMat; 3]> = experts
        .iter()
        .enumerate()
        .map(|(i, &(f, _))| {
            [
                TestMat::new(f, inter, hidden, i % 3, &mut rng),
                TestMat::new(f, inter, hidden, 0, &mut rng),
                TestMat::new(f, hidden, inter, 1, &mut rng),
            ]
        })
        .collect();
    let shared = rng.vec(hidden, -1.0, 1.0);
    // Experts 0 and 1 read the same input (a decoded token's experts do).
    let xs: Vec<Vec<f32>> = experts
        .iter()
        .enumerate()
        .map(|(i, &(_, t))| match i {
            0 | 1 => shared.clone(),
            _ => rng.vec(t * hidden, -1.0, 1.0),
        })
        .collect();
    let x_of = |i: usize| if i < 2 { &shared[..] } else { &xs[i][..] };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    for level in available_levels() {
        for kernels in [Kernels::Exact, Kernels::Fast] {
            let zeros = |n: usize| -> Vec<Vec<f32>> {
                experts
                    .iter()
                    .map(|&(_, t)| vec![f32::NAN; t * n])
                    .collect()
            };
            // The definition.
            let (mut h, mut u, mut want) = (zeros(inter), zeros(inter), zeros(hidden));
            {
                let mut jobs = Vec::new();
                for (i, (hi, ui)) in h.iter_mut().zip(&mut u).enumerate() {
                    for (w, out) in [(mats[i][0].view(), hi), (mats[i][1].view(), ui)] {
                        let (x, tokens) = (x_of(i), experts[i].1);
                        jobs.push(MatmulJob { w, x, tokens, out });
                    }
                }
                pool.install(|| matmul_batch_at(level, kernels, &mut jobs));
            }
            for (i, (hi, ui)) in h.iter_mut().zip(&u).enumerate() {
                test_activation(i, hi, ui);
            }
            {
                let mut jobs: Vec<MatmulJob> = (0..experts.len())
                    .zip(&mut want)
                    .map(|(i, out)| MatmulJob {
                        w: mats[i][2].view(),
                        x: &h[i],
                        tokens: experts[i].1,
                        out,
                    })
                    .collect();
                pool.install(|| matmul_batch_at(level, kernels, &mut jobs));
            }
            // One step.
            let (mut h2, mut u2, mut got) = (zeros(inter), zeros(inter), zeros(hidden));
            {
                let mut jobs: Vec<FfnJob> = h2
                    .iter_mut()
                    .zip(&mut u2)
                    .zip(&mut got)
                    .enumerate()
                    .map(|(i, ((h, u), out))| FfnJob {
                        gate: mats[i][0].view(),
                        up: mats[i][1].view(),
                        down: mats[i][2].view(),
                        x: x_of(i),
                        tokens: experts[i].1,
                        h,
                        u,
                        out,
                    })
                    .collect();
                pool.install(|| ffn::ffn_batch_at(level, kernels, &mut jobs, &test_activation));
            }
            for i in 0..experts.len() {
                let same = |a: &[f32], b: &[f32]| {
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                };
                assert!(
                    same(&got[i], &want[i]) && same(&h2[i], &h[i]),
                    "expert {i}, level {}, kernels {}: fused step differs",
                    level.name(),
                    kernels.name()
                );
            }
        }
    }
}

/// A panicking activation fails the step (the panic is raised again) instead of leaving the
/// down tasks waiting for an expert that never becomes ready.
#[test]
fn ffn_batch_raises_a_panicking_activation() {
    let mut rng = Rng(22);
    let f = WeightFormat::Affine {
        bits: 4,
        group_size: 64,
        scale_dtype: Dtype::Bf16,
    };
    let (hidden, inter, n) = (512, 384, 4);
    let mats: Vec<[TestMat; 3]> = (0..n)
        .map(|_| {
            [
                TestMat::new(f, inter, hidden, 0, &mut rng),
                TestMat::new(f, inter, hidden, 0, &mut rng),
                TestMat::new(f, hidden, inter, 0, &mut rng),
            ]
        })
        .collect();
    let x = rng.vec(hidden, -1.0, 1.0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(4)
        .build()
        .unwrap();
    let (mut h, mut u, mut out) = (
        vec![vec![0f32; inter]; n],
        vec![vec![0f32; inter]; n],
        vec![vec![0f32; hidden]; n],
    );
    let mut jobs: Vec<FfnJob> = h
        .iter_mut()
        .zip(&mut u)
        .zip(&mut out)
        .enumerate()
        .map(|(i, ((h, u), out))| FfnJob {
            gate: mats[i][0].view(),
            up: mats[i][1].view(),
            down: mats[i][2].view(),
            x: &x,
            tokens: 1,
            h,
            u,
            out,
        })
        .collect();
    let activate = |j: usize, h: &mut [f32], u: &[f32]| {
        assert!(j != 1, "activation of expert 1 fails");
        silu_mul(h, u);
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        pool.install(|| ffn_batch(Kernels::Fast, &mut jobs, &activate))
    }));
    assert!(result.is_err(), "the panic must reach the caller");
}

#[test]
fn fast_decode_rows_do_not_depend_on_their_neighbours() {
    // The 4- and 8-bit decode kernels walk a task's rows as several streams at once: a row's
    // result must be the bits it has alone, whatever rows share its task (threads cut tasks
    // freely).
    let mut rng = Rng(23);
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let shapes = [
        (4, 32, 1056),
        (4, 64, 2048),
        (4, 128, 384),
        (8, 32, 96),
        (8, 64, 2048),
    ];
    for (bits, gs, cols) in shapes {
        let format = WeightFormat::Affine {
            bits,
            group_size: gs,
            scale_dtype: Dtype::Bf16,
        };
        for rows in [1, 2, 3, 17, 37, 67] {
            let m = TestMat::new(format, rows, cols, 0, &mut rng);
            let w = m.view();
            let (rb, sb) = (format.row_bytes(cols), format.scale_row_bytes(cols));
            for level in available_levels() {
                for tokens in [1, 3] {
                    let x = rng.vec(tokens * cols, -1.0, 1.0);
                    let all = one_thread.install(|| run(level, Kernels::Fast, &w, &x, tokens));
                    for r in 0..rows {
                        let row = MatRef {
                            rows: 1,
                            data: &w.data[r * rb..(r + 1) * rb],
                            scales: &w.scales[r * sb..(r + 1) * sb],
                            biases: &w.biases[r * sb..(r + 1) * sb],
                            ..w
                        };
                        let alone = run(level, Kernels::Fast, &row, &x, tokens);
                        for t in 0..tokens {
                            assert_eq!(
                                all[t * rows + r].to_bits(),
                                alone[t].to_bits(),
                                "{bits} bits, group {gs}, {rows} x {cols}, row {r}, token {t}, \
                                 level {}",
                                level.name()
                            );
                        }
                    }
                }
            }
        }
    }
}
