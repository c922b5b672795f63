//! The contract every backend must meet: each operation against [`crate::reference`] on random
//! inputs, edge shapes included (one row, odd row counts around kernel thresholds, partial
//! rotary, grouped-query attention over a cache that is extended, rewound and cloned, routing
//! ties, experts split over several calls, DeltaNet states carried between calls).
//!
//! A backend crate runs it with [`conformance_tests!`](crate::conformance_tests), which expands
//! to one `#[test]` per check. Each check panics with the operation, the case and the error on
//! failure. Tolerances are relative to the largest reference value: f32 arithmetic lands far
//! under the default [`Tolerance`]; a backend that rounds activations (tensor cores in bf16) may
//! pass a looser one for matrix products and says so in its tests.

use crate::reference::{self, HostLinearState};
use crate::{
    Activation, AttentionSpec, Backend, DeltaNetDims, DeltaNetWeights, Dtype, ExpertFfn, ExpertKey,
    FfnWeights, HostBytes, HostMatrix, HostRouting, KvFormat, MatRef, Rope, SigmoidRouting,
    ValueHeadOrder, WeightFormat,
};

/// How far a backend may stray from the reference, relative to the largest reference value.
#[derive(Debug, Clone, Copy)]
pub struct Tolerance {
    /// Matrix products, embeddings and everything built on them (MoE, feed-forward).
    pub matmul: f32,
    /// Everything else (norms, rotary, attention, DeltaNet, routing weights).
    pub other: f32,
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance {
            matmul: 2e-5,
            other: 2e-5,
        }
    }
}

/// A small deterministic generator (splitmix64), so a failure reproduces.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    pub fn vec(&mut self, n: usize, lo: f32, hi: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform(lo, hi)).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

fn encode(dt: Dtype, v: &[f32]) -> Vec<u8> {
    match dt {
        Dtype::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Dtype::F16 => v
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect(),
        Dtype::Bf16 => v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect(),
    }
}

/// A random `[rows, cols]` matrix in `format`: dense values in [-1, 1); affine codes uniform,
/// scales of either sign and biases small, as trained checkpoints have.
pub fn random_matrix(rng: &mut Rng, format: WeightFormat, rows: usize, cols: usize) -> HostMatrix {
    let data_len = rows * format.row_bytes(cols);
    let (data, scales, biases) = match format {
        WeightFormat::Dense(dt) => (encode(dt, &rng.vec(rows * cols, -1.0, 1.0)), vec![], vec![]),
        WeightFormat::Affine {
            group_size,
            scale_dtype,
            ..
        } => {
            let groups = rows * cols / group_size;
            let data = (0..data_len).map(|_| rng.next_u64() as u8).collect();
            let scales: Vec<f32> = (0..groups)
                .map(|_| rng.uniform(0.01, 0.1) * if rng.below(2) == 0 { 1.0 } else { -1.0 })
                .collect();
            (
                data,
                encode(scale_dtype, &scales),
                encode(scale_dtype, &rng.vec(groups, -0.1, 0.1)),
            )
        }
        // Codes uniform, exponents 2^-8..2^-2 (values up to 6 * 2^-2).
        WeightFormat::Mxfp4 => (
            (0..data_len).map(|_| rng.next_u64() as u8).collect(),
            (0..rows * cols / crate::MXFP4_GROUP)
                .map(|_| 119 + rng.below(7) as u8)
                .collect(),
            vec![],
        ),
    };
    HostMatrix::new(
        format,
        rows,
        cols,
        HostBytes::from_vec(data),
        HostBytes::from_vec(scales),
        HostBytes::from_vec(biases),
    )
    .expect("a consistent random matrix")
}

/// Weight formats every backend must run: what the supported checkpoints ship (bf16/f16/f32;
/// MLX affine 4- and 8-bit with groups of 32, 64 and 128 and bf16, f16 or f32 scales; gpt-oss's
/// mxfp4).
pub fn required_formats() -> Vec<WeightFormat> {
    let mut v = vec![
        WeightFormat::Dense(Dtype::F32),
        WeightFormat::Dense(Dtype::F16),
        WeightFormat::Dense(Dtype::Bf16),
        WeightFormat::Mxfp4,
    ];
    for bits in [4, 8] {
        for group_size in [32, 64, 128] {
            for scale_dtype in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
                v.push(WeightFormat::Affine {
                    bits,
                    group_size,
                    scale_dtype,
                });
            }
        }
    }
    v
}

/// Formats a backend may refuse with [`crate::BackendError::Unsupported`] (other affine widths).
pub fn optional_formats() -> Vec<WeightFormat> {
    [2, 3, 5, 6]
        .into_iter()
        .map(|bits| WeightFormat::Affine {
            bits,
            group_size: 64,
            scale_dtype: Dtype::Bf16,
        })
        .collect()
}

/// Panics unless `got` is within `tol * max|want|` of `want` everywhere (and both are finite).
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    let mut worst = (0.0f32, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: element {i} is {g} (reference {w})");
        let d = (g - w).abs();
        if d > worst.0 {
            worst = (d, i);
        }
    }
    assert!(
        worst.0 <= tol * max_ref,
        "{what}: max|diff| {} at element {} (got {}, want {}) > {tol} x max|ref| {max_ref}",
        worst.0,
        worst.1,
        got[worst.1],
        want[worst.1]
    );
}

fn host<B: Backend>(b: &B, a: &B::Act) -> Vec<f32> {
    b.to_host(a).expect("to_host")
}

/// Activations, memory facts and synchronisation.
pub fn activations<B: Backend>(b: &B, _tol: Tolerance) {
    let m = b.memory();
    assert!(m.total > 0 && m.free <= m.total, "memory() = {m:?}");
    let mut rng = Rng::new(1);
    let data = rng.vec(7 * 13, -2.0, 2.0);
    let a = b.act_from_host(&data, 7, 13);
    assert_eq!(b.shape(&a), (7, 13));
    assert_eq!(host(b, &a), data, "act_from_host/to_host round trip");
    let z = b.zeros(5, 3);
    assert_eq!((b.shape(&z), host(b, &z)), ((5, 3), vec![0.0; 15]), "zeros");
    let s = b.slice_rows(&a, 2, 3);
    assert_eq!(b.shape(&s), (3, 13));
    assert_eq!(host(b, &s), data[2 * 13..5 * 13], "slice_rows");
    let one = b.slice_rows(&a, 6, 1);
    let c = b.concat_rows(&[&s, &a, &one]);
    assert_eq!(b.shape(&c), (11, 13));
    let want = [&data[2 * 13..5 * 13], &data[..], &data[6 * 13..]].concat();
    assert_eq!(host(b, &c), want, "concat_rows");
    assert_eq!(
        host(b, &b.concat_rows(&[&a])),
        data,
        "concat_rows of one part"
    );

    // argmax_rows: random rows of a vocabulary's width, and rows with planted ties (the lowest
    // column wins), NaN (never wins), infinities, all NaN (0) and all equal (0).
    let vocab = 151_936;
    for rows in [1, 3] {
        let mut logits = rng.vec(rows * vocab, -8.0, 8.0);
        if rows == 3 {
            let row1 = &mut logits[vocab..2 * vocab];
            row1[77_001] = 30.0;
            row1[77_000] = f32::NAN;
            row1[150_000] = 30.0;
            row1[90_000] = 30.0;
            logits[2 * vocab + 5] = f32::INFINITY;
            logits[2 * vocab + 4] = f32::NEG_INFINITY;
        }
        let got = b
            .argmax_rows(&b.act_from_host(&logits, rows, vocab))
            .expect("argmax_rows");
        let want: Vec<u32> = logits.chunks(vocab).map(reference::argmax).collect();
        assert_eq!(got, want, "argmax_rows over {rows} rows of {vocab}");
        if rows == 3 {
            assert_eq!((want[1], want[2]), (77_001, 5), "planted maxima");
        }
    }
    let special = [
        vec![f32::NAN; 300],
        vec![-1.5; 300],
        (0..300)
            .map(|i| if i % 2 == 0 { f32::NAN } else { -(i as f32) })
            .collect(),
    ];
    for row in &special {
        let got = b
            .argmax_rows(&b.act_from_host(row, 1, row.len()))
            .expect("argmax_rows");
        assert_eq!(
            got,
            vec![reference::argmax(row)],
            "argmax_rows of {:?}..",
            &row[..4]
        );
    }
    assert_eq!(reference::argmax(&special[2]), 1);

    // top_logits: the best columns in rank order (ties to the lower column, NaN last) and the
    // values at named columns, on a vocabulary-wide row with planted ties and non-finite values.
    let mut row = rng.vec(2 * vocab, -8.0, 8.0);
    for (c, v) in [
        (7, 9.0),
        (3, 9.0),
        (500, f32::NAN),
        (9000, 8.5),
        (9001, 8.5),
        (12, f32::INFINITY),
    ] {
        row[vocab + c] = v;
    }
    let logits = b.act_from_host(&row, 2, vocab);
    for (n, cols) in [(1, vec![]), (21, vec![3, 500, 70_000]), (257, vec![9001])] {
        let got = b.top_logits(&logits, 1, n, &cols).expect("top_logits");
        let want = reference::top_logits(&row[vocab..], n, &cols);
        assert_eq!(got.top.len(), n, "top_logits: {n} columns");
        assert_eq!(got.top, want.top, "top_logits: the best {n}");
        let same = got
            .at
            .iter()
            .zip(&want.at)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "top_logits at {cols:?}: {:?} vs {:?}",
            got.at, want.at
        );
    }
    // Several rows at once answer as each alone, in the order asked.
    let asked: [(usize, usize, &[u32]); 4] = [
        (1, 21, &[3, 500, 70_000]),
        (0, 1, &[]),
        (1, 257, &[9001]),
        (0, 40, &[5, 7]),
    ];
    let together = b.top_logits_rows(&logits, &asked).expect("top_logits_rows");
    assert_eq!(
        together.len(),
        asked.len(),
        "top_logits_rows: an answer each"
    );
    for (&(r, n, cols), got) in asked.iter().zip(&together) {
        let want = reference::top_logits(&row[r * vocab..(r + 1) * vocab], n, cols);
        assert_eq!(got.top, want.top, "top_logits_rows: row {r}, the best {n}");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&got.at),
            bits(&want.at),
            "top_logits_rows: row {r} at {cols:?}"
        );
    }
    // Rows that stress the selection: heavy ties at the edge (few distinct values), signed
    // zeros (+0 ranks above -0, as total_cmp has it), NaN among the asked-for columns, n up to
    // and past what a device may sort, and more columns than the row has.
    let bits = |t: &[(u32, f32)]| t.iter().map(|&(c, v)| (c, v.to_bits())).collect::<Vec<_>>();
    let few_values: Vec<f32> = (0..5000).map(|_| rng.below(7) as f32 - 3.0).collect();
    // Wide enough that a device may select in stages over parts of the row: ties across parts.
    let few_values_wide: Vec<f32> = (0..40_000).map(|_| rng.below(7) as f32 - 3.0).collect();
    // Mostly NaN, 9 000 columns (the last part short): NaN ties across parts fill larger n.
    let nan_wide: Vec<f32> = (0..9_000)
        .map(|i| {
            if i % 23 == 0 {
                (i % 101) as f32
            } else {
                f32::NAN
            }
        })
        .collect();
    let zeros: Vec<f32> = (0..700)
        .map(|i| match i % 3 {
            0 => 0.0,
            1 => -0.0,
            _ => -1e-30,
        })
        .collect();
    let with_nan: Vec<f32> = (0..300)
        .map(|i| match i % 4 {
            0 => f32::NAN,
            1 => f32::NEG_INFINITY,
            2 => i as f32,
            _ => -(i as f32),
        })
        .collect();
    for (name, row) in [
        ("few values", &few_values),
        ("few values, wide", &few_values_wide),
        ("signed zeros", &zeros),
        ("NaN", &with_nan),
        ("NaN, wide", &nan_wide),
    ] {
        let logits = b.act_from_host(row, 1, row.len());
        for n in [1, 37, 299, 300, 700, 1024, 1025, 6000] {
            let cols = [0, 5, 299, 4999, 70_000];
            let got = b.top_logits(&logits, 0, n, &cols).expect("top_logits");
            let want = reference::top_logits(row, n, &cols);
            assert_eq!(got.top.len(), n.min(row.len()), "top_logits {name}: {n}");
            assert_eq!(
                bits(&got.top),
                bits(&want.top),
                "top_logits {name}: the best {n}"
            );
            let at = |t: &[f32]| t.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(at(&got.at), at(&want.at), "top_logits {name} at {cols:?}");
        }
    }
    let best = reference::top_logits(&row[vocab..], 4, &[]).top;
    assert_eq!(
        best.iter().map(|t| t.0).collect::<Vec<_>>(),
        [12, 3, 7, 9000],
        "reference top_logits order"
    );
    let v = rng.vec(9, -1.0, 1.0);
    assert_eq!(
        b.vector_to_host(&b.vector(&v).expect("vector"))
            .expect("vector_to_host"),
        v,
        "vector round trip"
    );
    b.synchronize().expect("synchronize");
}

/// `matmul` in every required format (and the optional ones the backend accepts) for row counts
/// around the usual decode/prefill thresholds.
pub fn matmul<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(2);
    let required = required_formats();
    for format in required.iter().chain(&optional_formats()) {
        for (out, inp) in [(1, 256), (37, 128), (96, 512)] {
            let m = random_matrix(&mut rng, *format, out, inp);
            let w = match b.weight(m.clone()) {
                Ok(w) => w,
                Err(crate::BackendError::Unsupported(_)) if !required.contains(format) => {
                    break;
                }
                Err(e) => panic!("weight({format}, [{out}, {inp}]): {e}"),
            };
            for rows in [1, 2, 3, 4, 5, 8, 9, 17, 33, 64, 130] {
                let x = rng.vec(rows * inp, -1.0, 1.0);
                let got = host(b, &b.matmul(&b.act_from_host(&x, rows, inp), &w));
                let want = reference::matmul(&x, rows, &m.as_ref());
                assert_close(
                    &format!("matmul {format} [{out}, {inp}] x {rows} rows"),
                    &got,
                    &want,
                    tol.matmul,
                );
            }
        }
        // Several matrices of one input: each as if alone.
        let inp = 256;
        let ms =
            [(64, inp), (8, inp), (33, inp)].map(|(o, i)| random_matrix(&mut rng, *format, o, i));
        let Ok(ws) = ms
            .iter()
            .map(|m| b.weight(m.clone()))
            .collect::<Result<Vec<_>, _>>()
        else {
            continue;
        };
        for rows in [1, 3, 8, 9] {
            let x = rng.vec(rows * inp, -1.0, 1.0);
            let xa = b.act_from_host(&x, rows, inp);
            let got = b.matmuls(&xa, [&ws[0], &ws[1], &ws[2]]);
            for (i, (g, m)) in got.iter().zip(&ms).enumerate() {
                assert_close(
                    &format!("matmuls {format}: matrix {i} of 3, {rows} rows"),
                    &host(b, g),
                    &reference::matmul(&x, rows, &m.as_ref()),
                    tol.matmul,
                );
            }
        }
        // A shared expert with its one-row gate, added onto an output: against the reference,
        // and bit for bit the backend's own calls one by one (a fused version keeps them).
        let (hidden, inter) = (256, 128);
        let parts = [
            (inter, hidden),
            (inter, hidden),
            (hidden, inter),
            (1, hidden),
        ]
        .map(|(o, i)| random_matrix(&mut rng, *format, o, i));
        let Ok(ws) = parts
            .iter()
            .map(|m| b.weight(m.clone()))
            .collect::<Result<Vec<_>, _>>()
        else {
            continue;
        };
        let mut ws = ws.into_iter();
        let mut next = || ws.next().expect("four weights");
        let ffn = FfnWeights {
            gate: next(),
            up: next(),
            down: next(),
        };
        let shared_gate = &next();
        let (gate, up, down) = (&ffn.gate, &ffn.up, &ffn.down);
        for rows in [1, 2, 8, 9] {
            let x = rng.vec(rows * hidden, -1.0, 1.0);
            let y0 = rng.vec(rows * hidden, -1.0, 1.0);
            let xa = b.act_from_host(&x, rows, hidden);
            let mut got = b.act_from_host(&y0, rows, hidden);
            b.add_shared_expert(&mut got, &xa, &ffn, shared_gate);
            let mut own = b.act_from_host(&y0, rows, hidden);
            let [g, u] = b.matmuls(&xa, [gate, up]);
            let mut s = b.matmul(&b.swiglu(&g, &u), down);
            b.sigmoid_mul(&mut s, &b.matmul(&xa, shared_gate));
            b.add_assign(&mut own, &s);
            let got = host(b, &got);
            assert_eq!(
                got,
                host(b, &own),
                "add_shared_expert {format}, {rows} rows: the same bits as its parts"
            );
            let h = reference::swiglu(
                &reference::matmul(&x, rows, &parts[0].as_ref()),
                &reference::matmul(&x, rows, &parts[1].as_ref()),
            );
            let mut s = reference::matmul(&h, rows, &parts[2].as_ref());
            let sg = reference::matmul(&x, rows, &parts[3].as_ref());
            reference::sigmoid_mul(&mut s, hidden, &sg, 1);
            let want: Vec<f32> = y0.iter().zip(&s).map(|(a, b)| a + b).collect();
            assert_close(
                &format!("add_shared_expert {format}, {rows} rows"),
                &got,
                &want,
                tol.matmul,
            );
        }
    }
}

/// `moe_with_shared`: the routed experts plus a gated shared expert, against the reference. The
/// cases reach a backend's fused decode path (the shared expert one more expert of each row: 4-bit
/// experts of width 512 at 3 and 8 experts a token, a few rows) and the shapes and row counts it
/// declines (width 128, many rows, a shared expert of another shape or format).
pub fn moe_with_shared<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(11);
    let q4 = WeightFormat::Affine {
        bits: 4,
        group_size: 64,
        scale_dtype: Dtype::Bf16,
    };
    let q8 = WeightFormat::Affine {
        bits: 8,
        group_size: 64,
        scale_dtype: Dtype::Bf16,
    };
    // (experts' format, shared expert's format, its gate's format, experts, hidden, width, k)
    let cases = [
        (q4, q4, q8, 16, 256, 512, 8),
        (q4, q4, WeightFormat::Dense(Dtype::Bf16), 16, 256, 512, 3),
        (q4, q4, q8, 8, 128, 128, 4),
        (q4, q8, q8, 16, 256, 512, 8),
        (
            WeightFormat::Dense(Dtype::Bf16),
            WeightFormat::Dense(Dtype::Bf16),
            WeightFormat::Dense(Dtype::Bf16),
            8,
            128,
            64,
            2,
        ),
    ];
    for (format, shared_format, gate_format, n, h, i, k) in cases {
        let host_experts = random_experts(&mut rng, format, n, h, i);
        let resident = b.experts(host_experts.clone()).expect("experts");
        let parts =
            [(i, h), (i, h), (h, i)].map(|(o, c)| random_matrix(&mut rng, shared_format, o, c));
        let scale = random_matrix(&mut rng, gate_format, 1, h);
        let weight = |m: &HostMatrix| b.weight(m.clone()).expect("weight");
        let shared = FfnWeights {
            gate: weight(&parts[0]),
            up: weight(&parts[1]),
            down: weight(&parts[2]),
        };
        let gate = weight(&scale);
        let refs = expert_refs(&host_experts);
        for rows in [1, 2, 8, 9] {
            let x = rng.vec(rows * h, -1.0, 1.0);
            let xa = b.act_from_host(&x, rows, h);
            let logits = rng.vec(rows * n, -3.0, 3.0);
            let routing = b.route(&b.act_from_host(&logits, rows, n), k, true);
            let host_routing = b.read_routing(&routing).expect("read_routing");
            let routed = reference::moe(&x, rows, &host_routing, &refs, Activation::Silu, None);
            let hs = reference::swiglu(
                &reference::matmul(&x, rows, &parts[0].as_ref()),
                &reference::matmul(&x, rows, &parts[1].as_ref()),
            );
            let mut s = reference::matmul(&hs, rows, &parts[2].as_ref());
            let sg = reference::matmul(&x, rows, &scale.as_ref());
            reference::sigmoid_mul(&mut s, h, &sg, 1);
            let want: Vec<f32> = routed.iter().zip(&s).map(|(r, s)| r + s).collect();
            // Each part within the matmul tolerance of its own largest value, as the moe and
            // add_shared_expert checks hold them: the sum within the sum of those bounds.
            let max = |v: &[f32]| v.iter().fold(0f32, |m, x| m.max(x.abs()));
            let parts = (max(&routed) + max(&s)) / max(&want).max(1e-30);
            let got =
                b.moe_with_shared(&xa, &routing, &resident, ExpertFfn::SWIGLU, &shared, &gate);
            assert_close(
                &format!(
                    "moe_with_shared {format} experts, shared {shared_format} gated by \
                     {gate_format}, width {i}, {rows} rows, top {k}"
                ),
                &host(b, &got),
                &want,
                tol.matmul * parts.max(1.0),
            );
        }
    }
}

/// `embed` gathers dequantised rows, repeats and the last id included.
pub fn embed<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(3);
    for format in required_formats() {
        let m = random_matrix(&mut rng, format, 50, 128);
        let t = b.weight(m.clone()).expect("weight");
        let tokens = [0u32, 49, 7, 7, 23];
        let got = host(b, &b.embed(&t, &tokens));
        let want: Vec<f32> = tokens
            .iter()
            .flat_map(|&r| reference::dequantize_row(&m.as_ref(), r as usize))
            .collect();
        assert_close(&format!("embed {format}"), &got, &want, tol.matmul);
    }
}

/// The elementwise and normalising operations.
pub fn elementwise<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(4);
    for (rows, cols, norm) in [(1, 64, 64), (5, 256, 256), (3, 512, 128)] {
        let x = rng.vec(rows * cols, -3.0, 3.0);
        let y = rng.vec(rows * cols, -3.0, 3.0);
        let w = rng.vec(norm, 0.5, 1.5);
        let (xa, ya) = (
            b.act_from_host(&x, rows, cols),
            b.act_from_host(&y, rows, cols),
        );
        let wv = b.vector(&w).expect("vector");
        let case = format!("[{rows}, {cols}], norm over {norm}");
        assert_close(
            &format!("rms_norm {case}"),
            &host(b, &b.rms_norm(&xa, &wv, 1e-6)),
            &reference::rms_norm(&x, &w, 1e-6),
            tol.other,
        );
        let mut h = b.act_from_host(&x, rows, cols);
        let normed = b.add_rms_norm(&mut h, &ya, &wv, 1e-5);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, c)| a + c).collect();
        assert_close(
            &format!("add_rms_norm sum {case}"),
            &host(b, &h),
            &sum,
            tol.other,
        );
        assert_close(
            &format!("add_rms_norm {case}"),
            &host(b, &normed),
            &reference::rms_norm(&sum, &w, 1e-5),
            tol.other,
        );
        let mut h = b.act_from_host(&x, rows, cols);
        b.add_assign(&mut h, &ya);
        assert_close(&format!("add_assign {case}"), &host(b, &h), &sum, tol.other);
        let bias = rng.vec(cols, -1.0, 1.0);
        let mut h = b.act_from_host(&x, rows, cols);
        b.add_bias(&mut h, &b.vector(&bias).expect("vector"));
        let biased: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, a)| a + bias[i % cols])
            .collect();
        assert_close(
            &format!("add_bias {case}"),
            &host(b, &h),
            &biased,
            tol.other,
        );
        assert_close(
            &format!("swiglu {case}"),
            &host(b, &b.swiglu(&xa, &ya)),
            &reference::swiglu(&x, &y),
            tol.other,
        );
        for gate_cols in [cols, 1] {
            let g = rng.vec(rows * gate_cols, -4.0, 4.0);
            let mut got = b.act_from_host(&x, rows, cols);
            b.sigmoid_mul(&mut got, &b.act_from_host(&g, rows, gate_cols));
            let mut want = x.clone();
            reference::sigmoid_mul(&mut want, cols, &g, gate_cols);
            assert_close(
                &format!("sigmoid_mul {case}, gate of {gate_cols} columns"),
                &host(b, &got),
                &want,
                tol.other,
            );
        }
        let (first, rest) = b.split_chunks(&xa, norm, norm / 4);
        let (wf, wr) = reference::split_chunks(&x, norm, norm / 4);
        assert_eq!(b.shape(&first), (rows, cols / norm * (norm / 4)));
        assert_eq!(
            (host(b, &first), host(b, &rest)),
            (wf, wr),
            "split_chunks {case}"
        );
    }
}

/// Rotary embedding: whole and partial heads (MLA's 64 of 576 among them), three thetas, far
/// positions, YaRN frequencies.
pub fn rope<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(5);
    let yarn = Some(crate::Yarn {
        factor: 40.0,
        original_max_position: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
    });
    for (head_dim, rotary_dim) in [(64, 64), (128, 32), (256, 64), (576, 64)] {
        for (theta, first, yarn) in [
            (1e4f32, 0usize, None),
            (1e7, 1000, None),
            (1e6, 40_000, None),
            (1e4, 5000, yarn),
        ] {
            let rope = Rope {
                yarn,
                ..Rope::new(head_dim, rotary_dim, theta)
            };
            for rows in [1, 7] {
                let cols = 4 * head_dim;
                let x = rng.vec(rows * cols, -1.0, 1.0);
                let mut got = b.act_from_host(&x, rows, cols);
                b.rope(&mut got, rope, first);
                let mut want = x.clone();
                reference::rope(&mut want, cols, rope, first);
                let case = format!("{rope:?} at {first}, {rows} rows");
                assert_close(&format!("rope {case}"), &host(b, &got), &want, tol.other);
                let w = rng.vec(head_dim, 0.5, 1.5);
                let (xa, wv) = (
                    b.act_from_host(&x, rows, cols),
                    b.vector(&w).expect("vector"),
                );
                let fused = b.rms_norm_rope(&xa, &wv, 1e-6, rope, first);
                let mut want = reference::rms_norm(&x, &w, 1e-6);
                reference::rope(&mut want, cols, rope, first);
                assert_close(
                    &format!("rms_norm_rope {case}"),
                    &host(b, &fused),
                    &want,
                    tol.other,
                );
            }
        }
    }
}

/// `attention_rope_segments` (several requests, each through its own cache of its own length)
/// against `attention_rope` on each request's rows alone: requests decoding one token each (as
/// many as a device launch takes, and more), and requests of several rows.
pub fn attention_segments<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(61);
    for (heads, kv_heads, hd, rotary) in [(32, 4, 128, 128), (16, 1, 64, 32), (8, 2, 256, 64)] {
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let norms = (
            b.vector(&rng.vec(hd, 0.5, 1.5)).expect("vector"),
            b.vector(&rng.vec(hd, 0.5, 1.5)).expect("vector"),
        );
        let rope = Rope::new(hd, rotary, 10_000.0);
        for rows in [vec![1; 3], vec![1; 9], vec![2, 1, 3]] {
            // Each request's cache holds a different number of positions first.
            let mut caches: Vec<B::KvCache> = rows
                .iter()
                .enumerate()
                .map(|(i, _)| {
                    let mut c = b
                        .kv_cache(kv_heads, hd, 256, KvFormat::F32)
                        .expect("kv_cache");
                    let n = 1 + (i * 37) % 150;
                    let act =
                        |w: usize, rng: &mut Rng| b.act_from_host(&rng.vec(n * w, -2.0, 2.0), n, w);
                    let (q, k, v) = (act(qw, &mut rng), act(kw, &mut rng), act(kw, &mut rng));
                    b.attention_rope(
                        &q,
                        &k,
                        &v,
                        Some((&norms.0, &norms.1)),
                        1e-6,
                        rope,
                        &mut c,
                        AttentionSpec::new(heads, scale),
                    );
                    c
                })
                .collect();
            // Two steps: the second sees the first one's keys and values.
            for step in 0..2 {
                let total: usize = rows.iter().sum();
                let q = rng.vec(total * qw, -2.0, 2.0);
                let k = rng.vec(total * kw, -2.0, 2.0);
                let v = rng.vec(total * kw, -2.0, 2.0);
                let mut alone = Vec::new();
                let mut first = 0;
                for (c, &n) in caches.iter().zip(&rows) {
                    let mut c = c.clone();
                    let part =
                        |x: &[f32], w: usize| b.act_from_host(&x[first * w..(first + n) * w], n, w);
                    let o = b.attention_rope(
                        &part(&q, qw),
                        &part(&k, kw),
                        &part(&v, kw),
                        Some((&norms.0, &norms.1)),
                        1e-6,
                        rope,
                        &mut c,
                        AttentionSpec::new(heads, scale),
                    );
                    alone.extend(host(b, &o));
                    first += n;
                }
                let lens: Vec<usize> = caches.iter().map(|c| b.kv_len(c)).collect();
                let mut refs: Vec<&mut B::KvCache> = caches.iter_mut().collect();
                let got = b.attention_rope_segments(
                    &b.act_from_host(&q, total, qw),
                    &b.act_from_host(&k, total, kw),
                    &b.act_from_host(&v, total, kw),
                    Some((&norms.0, &norms.1)),
                    1e-6,
                    rope,
                    &mut refs,
                    &rows,
                    AttentionSpec::new(heads, scale),
                );
                assert_eq!(b.shape(&got), (total, qw));
                assert_close(
                    &format!(
                        "attention_rope_segments {rows:?} ({heads}, {kv_heads}, {hd}) step {step}"
                    ),
                    &host(b, &got),
                    &alone,
                    tol.other,
                );
                for ((c, n), len) in caches.iter().zip(&rows).zip(lens) {
                    assert_eq!(b.kv_len(c), len + n, "each cache grows by its rows");
                }
            }
        }
    }
}

/// Attention over a cache that grows by a prefill then single decode steps, is rewound, and is
/// cloned (the clone must not share storage).
pub fn attention<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(6);
    // (32, 4, 128) is Qwen3-30B-A3B's layout; (16, 1, 64) a group of 16.
    for (heads, kv_heads, hd) in [
        (8, 2, 64),
        (4, 4, 128),
        (16, 1, 32),
        (32, 4, 256),
        (32, 4, 128),
        (16, 1, 64),
    ] {
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let mut cache = b
            .kv_cache(kv_heads, hd, 64, KvFormat::F32)
            .expect("kv_cache");
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        let scale = 1.0 / (hd as f32).sqrt();
        let mut step = |cache: &mut B::KvCache,
                        keys: &mut Vec<f32>,
                        values: &mut Vec<f32>,
                        rows: usize,
                        what: &str| {
            let q = rng.vec(rows * qw, -2.0, 2.0);
            let k = rng.vec(rows * kw, -2.0, 2.0);
            let v = rng.vec(rows * kw, -2.0, 2.0);
            let got = b.attention(
                &b.act_from_host(&q, rows, qw),
                &b.act_from_host(&k, rows, kw),
                &b.act_from_host(&v, rows, kw),
                cache,
                AttentionSpec::new(heads, scale),
            );
            keys.extend_from_slice(&k);
            values.extend_from_slice(&v);
            let want =
                reference::attention(&q, keys, values, heads, kv_heads, hd, scale, None, None);
            assert_close(
                &format!("attention {heads}/{kv_heads} heads of {hd}, {what}"),
                &host(b, &got),
                &want,
                tol.other,
            );
            assert_eq!(b.kv_len(cache), keys.len() / kw, "kv_len after {what}");
        };
        step(&mut cache, &mut keys, &mut values, 5, "prefill of 5");
        for i in 0..3 {
            step(
                &mut cache,
                &mut keys,
                &mut values,
                1,
                &format!("decode step {i}"),
            );
        }
        // A long continuation (a backend may take another path for many rows).
        step(
            &mut cache,
            &mut keys,
            &mut values,
            40,
            "prefill of 40 after 8",
        );
        // A longer one: many tiles of keys and of query rows, ending mid-tile.
        step(
            &mut cache,
            &mut keys,
            &mut values,
            123,
            "prefill of 123 after 48",
        );
        // Decode past 128 positions (a backend may split them over blocks), and for two layouts
        // past 2048 (many positions per block).
        for i in 0..2 {
            step(
                &mut cache,
                &mut keys,
                &mut values,
                1,
                &format!("decode step {i} after 171"),
            );
        }
        if heads <= 8 {
            step(
                &mut cache,
                &mut keys,
                &mut values,
                1900,
                "prefill of 1900 after 173",
            );
            step(
                &mut cache,
                &mut keys,
                &mut values,
                1,
                "decode step after 2073",
            );
        }
        b.kv_truncate(&mut cache, 3);
        keys.truncate(3 * kw);
        values.truncate(3 * kw);
        assert_eq!(b.kv_len(&cache), 3, "kv_len after truncate");
        let saved = cache.clone();
        let (saved_k, saved_v) = (keys.clone(), values.clone());
        step(
            &mut cache,
            &mut keys,
            &mut values,
            2,
            "2 rows after rewinding to 3",
        );
        let mut resumed = saved;
        let (mut k2, mut v2) = (saved_k, saved_v);
        assert_eq!(b.kv_len(&resumed), 3, "a clone keeps its own positions");
        step(&mut resumed, &mut k2, &mut v2, 1, "1 row on a clone");
    }

    // attention_rope: the same bits as rms_norm_rope of q and k, then attention, step by step
    // (full and partial rotary, prefill, decode, a long continuation, then decoding after a
    // rewind and on copies: a backend may keep the cache's length on the device for decode).
    for (heads, kv_heads, hd, rd) in [(8, 2, 64, 64), (4, 2, 128, 32), (16, 4, 256, 64)] {
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let (theta, eps, scale) = (1_000_000.0, 1e-6, 1.0 / (hd as f32).sqrt());
        let q_norm = b.vector(&rng.vec(hd, 0.5, 1.5)).expect("vector");
        let k_norm = b.vector(&rng.vec(hd, 0.5, 1.5)).expect("vector");
        let mut fused = b
            .kv_cache(kv_heads, hd, 16, KvFormat::F32)
            .expect("kv_cache");
        let mut plain = b
            .kv_cache(kv_heads, hd, 16, KvFormat::F32)
            .expect("kv_cache");
        let mut step = |fused: &mut B::KvCache, plain: &mut B::KvCache, rows: usize| {
            let q = b.act_from_host(&rng.vec(rows * qw, -2.0, 2.0), rows, qw);
            let k = b.act_from_host(&rng.vec(rows * kw, -2.0, 2.0), rows, kw);
            let v = b.act_from_host(&rng.vec(rows * kw, -2.0, 2.0), rows, kw);
            let got = b.attention_rope(
                &q,
                &k,
                &v,
                Some((&q_norm, &k_norm)),
                eps,
                Rope::new(hd, rd, theta),
                fused,
                AttentionSpec::new(heads, scale),
            );
            let at = b.kv_len(plain);
            let q = b.rms_norm_rope(&q, &q_norm, eps, Rope::new(hd, rd, theta), at);
            let k = b.rms_norm_rope(&k, &k_norm, eps, Rope::new(hd, rd, theta), at);
            let want = b.attention(&q, &k, &v, plain, AttentionSpec::new(heads, scale));
            assert_eq!(
                host(b, &got),
                host(b, &want),
                "attention_rope {heads}/{kv_heads} heads of {hd} (rotary {rd}), {rows} rows at {at}"
            );
            assert_eq!(b.kv_len(fused), b.kv_len(plain), "attention_rope kv_len");
        };
        for rows in [5, 1, 1, 40, 1, 3, 1, 100, 1, 1] {
            step(&mut fused, &mut plain, rows);
        }
        b.kv_truncate(&mut fused, 6);
        b.kv_truncate(&mut plain, 6);
        for rows in [1, 1] {
            step(&mut fused, &mut plain, rows);
        }
        let (mut fused_copy, mut plain_copy) = (fused.clone(), plain.clone());
        step(&mut fused_copy, &mut plain_copy, 1);
        step(&mut fused, &mut plain, 1);
        step(&mut fused_copy, &mut plain_copy, 1);
        assert_eq!(b.kv_len(&fused_copy), 10, "a copy keeps its own length");
    }
}

/// `attention_rope` and `attention_rope_segments` without q/k norms (Mixtral): rotary alone,
/// then attention, against the host reference, over a prefill, decode steps, and requests
/// decoding together through caches of different lengths.
pub fn attention_without_norms<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(62);
    let yarn = crate::Yarn {
        factor: 40.0,
        original_max_position: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
    };
    // The last: Multi-head Latent Attention's absorbed form (one 576-wide key head, 64 rotated).
    for (heads, kv_heads, hd, rd, yarn) in [
        (8, 2, 128, 128, None),
        (4, 1, 64, 32, None),
        (16, 1, 576, 64, Some(yarn)),
    ] {
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let (theta, scale) = (1_000_000.0, 1.0 / (hd as f32).sqrt());
        let rope = Rope {
            yarn,
            ..Rope::new(hd, rd, theta)
        };
        // Per request: its cache and the host copies of its rotated keys and its values.
        let mut reqs: Vec<(B::KvCache, Vec<f32>, Vec<f32>)> = (0..3)
            .map(|_| {
                (
                    b.kv_cache(kv_heads, hd, 64, KvFormat::F32)
                        .expect("kv_cache"),
                    vec![],
                    vec![],
                )
            })
            .collect();
        let mut expect = |rows: usize, keys: &mut Vec<f32>, values: &mut Vec<f32>| {
            let (mut q, mut k) = (rng.vec(rows * qw, -2.0, 2.0), rng.vec(rows * kw, -2.0, 2.0));
            let v = rng.vec(rows * kw, -2.0, 2.0);
            let (raw_q, raw_k) = (q.clone(), k.clone());
            let at = keys.len() / kw;
            reference::rope(&mut q, qw, rope, at);
            reference::rope(&mut k, kw, rope, at);
            keys.extend_from_slice(&k);
            values.extend_from_slice(&v);
            let want =
                reference::attention(&q, keys, values, heads, kv_heads, hd, scale, None, None);
            (raw_q, raw_k, v, want)
        };
        // Each request alone: a prefill of a different length, then a decode step.
        for (i, rows) in [7, 1, 19, 1, 2, 1].into_iter().enumerate() {
            let (cache, keys, values) = &mut reqs[i / 2];
            let (q, k, v, want) = expect(rows, keys, values);
            let got = b.attention_rope(
                &b.act_from_host(&q, rows, qw),
                &b.act_from_host(&k, rows, kw),
                &b.act_from_host(&v, rows, kw),
                None,
                1e-6,
                rope,
                cache,
                AttentionSpec::new(heads, scale),
            );
            let what = format!("attention_rope without norms {heads}/{kv_heads}x{hd}, {rows} rows");
            assert_close(&what, &host(b, &got), &want, tol.other);
        }
        // Then the three decoding together, twice.
        for step in 0..2 {
            let mut parts = (vec![], vec![], vec![], vec![]);
            for (_, keys, values) in reqs.iter_mut() {
                let (q, k, v, want) = expect(1, keys, values);
                parts.0.extend(q);
                parts.1.extend(k);
                parts.2.extend(v);
                parts.3.extend(want);
            }
            let mut caches: Vec<&mut B::KvCache> = reqs.iter_mut().map(|r| &mut r.0).collect();
            let got = b.attention_rope_segments(
                &b.act_from_host(&parts.0, 3, qw),
                &b.act_from_host(&parts.1, 3, kw),
                &b.act_from_host(&parts.2, 3, kw),
                None,
                1e-6,
                rope,
                &mut caches,
                &[1, 1, 1],
                AttentionSpec::new(heads, scale),
            );
            let what = format!(
                "attention_rope_segments without norms {heads}/{kv_heads}x{hd}, step {step}"
            );
            assert_close(&what, &host(b, &got), &parts.3, tol.other);
        }
    }
}

/// gpt-oss's attention: a sliding window and attention sinks, separately and together, through
/// `attention` over a prefill longer than the window, decode steps (a backend may split a long
/// cache over blocks, some all outside the window), a rewind, and `attention_rope_segments` of
/// requests decoding together at different lengths.
pub fn attention_window_sinks<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(64);
    // (heads, kv heads, head size, window, sinks); gpt-oss: 64/8 heads of 64, window 128.
    for (heads, kv_heads, hd, window, with_sinks) in [
        (8, 2, 64, Some(16), true),
        (8, 2, 64, None, true),
        (4, 4, 128, Some(7), false),
        (16, 2, 64, Some(128), true),
        (4, 1, 64, Some(1), true),
    ] {
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        // Sinks around the scores' range, so that they take a visible share.
        let host_sinks = rng.vec(heads, -1.0, 3.0);
        let sinks = b.vector(&host_sinks).expect("vector");
        let spec = AttentionSpec {
            window,
            sinks: with_sinks.then_some(&sinks),
            ..AttentionSpec::new(heads, scale)
        };
        let name =
            format!("attention {heads}/{kv_heads}x{hd}, window {window:?}, sinks {with_sinks}");
        let host_sinks = with_sinks.then_some(&host_sinks[..]);
        let mut cache = b
            .kv_cache(kv_heads, hd, 64, KvFormat::F32)
            .expect("kv_cache");
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for (i, rows) in [5, 1, 40, 1, 1, 123, 1, 300, 1].into_iter().enumerate() {
            let q = rng.vec(rows * qw, -2.0, 2.0);
            let k = rng.vec(rows * kw, -2.0, 2.0);
            let v = rng.vec(rows * kw, -2.0, 2.0);
            let got = b.attention(
                &b.act_from_host(&q, rows, qw),
                &b.act_from_host(&k, rows, kw),
                &b.act_from_host(&v, rows, kw),
                &mut cache,
                spec,
            );
            keys.extend_from_slice(&k);
            values.extend_from_slice(&v);
            let want = reference::attention(
                &q, &keys, &values, heads, kv_heads, hd, scale, window, host_sinks,
            );
            let what = format!("{name}, step {i}: {rows} rows");
            assert_close(&what, &host(b, &got), &want, tol.other);
            if i == 6 {
                b.kv_truncate(&mut cache, 30);
                keys.truncate(30 * kw);
                values.truncate(30 * kw);
            }
        }
        // Three requests at lengths 3, 20 and 200 decoding together.
        let rope = Rope::new(hd, hd, 10_000.0);
        let mut reqs: Vec<(B::KvCache, Vec<f32>, Vec<f32>)> = Vec::new();
        for len in [3, 20, 200] {
            let mut cache = b
                .kv_cache(kv_heads, hd, 64, KvFormat::F32)
                .expect("kv_cache");
            let (q, k, v) = (
                rng.vec(len * qw, -2.0, 2.0),
                rng.vec(len * kw, -2.0, 2.0),
                rng.vec(len * kw, -2.0, 2.0),
            );
            let q = b.act_from_host(&q, len, qw);
            let ka = b.act_from_host(&k, len, kw);
            let va = b.act_from_host(&v, len, kw);
            let _ = b.attention_rope(&q, &ka, &va, None, 1e-6, rope, &mut cache, spec);
            let mut rotated = k.clone();
            reference::rope(&mut rotated, kw, rope, 0);
            reqs.push((cache, rotated, v));
        }
        for step in 0..2 {
            let mut parts = (vec![], vec![], vec![], vec![]);
            for (_, keys, values) in reqs.iter_mut() {
                let at = keys.len() / kw;
                let (q, k, v) = (
                    rng.vec(qw, -2.0, 2.0),
                    rng.vec(kw, -2.0, 2.0),
                    rng.vec(kw, -2.0, 2.0),
                );
                let (mut rq, mut rk) = (q.clone(), k.clone());
                reference::rope(&mut rq, qw, rope, at);
                reference::rope(&mut rk, kw, rope, at);
                keys.extend_from_slice(&rk);
                values.extend_from_slice(&v);
                parts.3.extend(reference::attention(
                    &rq, keys, values, heads, kv_heads, hd, scale, window, host_sinks,
                ));
                parts.0.extend(q);
                parts.1.extend(k);
                parts.2.extend(v);
            }
            let mut caches: Vec<&mut B::KvCache> = reqs.iter_mut().map(|r| &mut r.0).collect();
            let got = b.attention_rope_segments(
                &b.act_from_host(&parts.0, 3, qw),
                &b.act_from_host(&parts.1, 3, kw),
                &b.act_from_host(&parts.2, 3, kw),
                None,
                1e-6,
                rope,
                &mut caches,
                &[1, 1, 1],
                spec,
            );
            let what = format!("{name}: segments of 3 requests, step {step}");
            assert_close(&what, &host(b, &got), &parts.3, tol.other);
        }
    }
}

/// Attention through caches in every compact format the backend offers ([`Backend::kv_formats`]):
/// against the reference over keys and values as [`crate::kv::round_trip`] gives them back, over
/// prefills, decode steps past several splits of positions, a rewind, a clone, a sliding window with
/// sinks, and requests decoding together; and the cache's rotary prelude
/// ([`Backend::attention_rope`]) within a quantization step of the plain path (a key one ulp
/// apart may round to the next code).
pub fn attention_kv_formats<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(65);
    let formats: Vec<KvFormat> = b
        .kv_formats()
        .iter()
        .copied()
        .filter(|f| f.is_lossy())
        .collect();
    if formats.is_empty() {
        eprintln!(
            "attention_kv_formats: {} keeps f32 caches only",
            b.describe()
        );
    }
    for f in KvFormat::ALL {
        if !b.kv_formats().contains(&f) {
            assert!(
                b.kv_cache(2, 64, 16, f).is_err(),
                "kv_cache takes {f}, which kv_formats does not list"
            );
        }
    }
    for format in formats {
        // (heads, kv heads, head size, window, sinks): Qwen3.5's 16/2x256, Qwen3's 32/4x128,
        // gpt-oss's 64/8x64 with window and sinks (scaled down), a group of 16 of 64, and heads
        // of 48 (groups of 16).
        for (heads, kv_heads, hd, window, with_sinks) in [
            (16, 2, 256, None, false),
            (8, 4, 128, None, false),
            (8, 2, 64, Some(16), true),
            (16, 1, 64, None, false),
            (4, 2, 48, None, true),
        ] {
            let (qw, kw) = (heads * hd, kv_heads * hd);
            let scale = 1.0 / (hd as f32).sqrt();
            let host_sinks = rng.vec(heads, -1.0, 3.0);
            let sinks = b.vector(&host_sinks).expect("vector");
            let spec = AttentionSpec {
                window,
                sinks: with_sinks.then_some(&sinks),
                ..AttentionSpec::new(heads, scale)
            };
            let host_sinks = with_sinks.then_some(&host_sinks[..]);
            let name = format!("{format} cache, {heads}/{kv_heads}x{hd}, window {window:?}");
            let mut cache = match b.kv_cache(kv_heads, hd, 64, format) {
                Ok(c) => c,
                Err(e) => panic!("{name}: the backend lists {format} but refuses it: {e}"),
            };
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            let mut saved = None;
            let steps: &[usize] = if heads <= 8 {
                &[5, 1, 40, 1, 123, 1, 600, 1, 1]
            } else {
                &[5, 1, 40, 1, 123, 1, 300, 1]
            };
            for (i, &rows) in steps.iter().enumerate() {
                let q = rng.vec(rows * qw, -2.0, 2.0);
                let k = rng.vec(rows * kw, -2.0, 2.0);
                let v = rng.vec(rows * kw, -2.0, 2.0);
                let got = b.attention(
                    &b.act_from_host(&q, rows, qw),
                    &b.act_from_host(&k, rows, kw),
                    &b.act_from_host(&v, rows, kw),
                    &mut cache,
                    spec,
                );
                let (mut k, mut v) = (k, v);
                crate::kv::round_trip(format, &mut k, hd);
                crate::kv::round_trip(format, &mut v, hd);
                keys.extend_from_slice(&k);
                values.extend_from_slice(&v);
                let want = reference::attention(
                    &q, &keys, &values, heads, kv_heads, hd, scale, window, host_sinks,
                );
                let what = format!(
                    "{name}, step {i}: {rows} rows at {}",
                    keys.len() / kw - rows
                );
                assert_close(&what, &host(b, &got), &want, tol.other);
                assert_eq!(b.kv_len(&cache), keys.len() / kw, "{what}: kv_len");
                if i == 3 {
                    b.kv_truncate(&mut cache, 30);
                    keys.truncate(30 * kw);
                    values.truncate(30 * kw);
                    saved = Some((cache.clone(), keys.clone(), values.clone()));
                }
            }
            // The clone taken after the rewind kept its own positions.
            let (mut cache, mut keys, mut values) = saved.expect("saved");
            assert_eq!(b.kv_len(&cache), 30, "{name}: a clone keeps its length");
            decode_checked(
                b,
                &mut rng,
                (&mut cache, format, kv_heads, hd),
                (spec, host_sinks),
                (&mut keys, &mut values),
                &format!("{name}: on a clone"),
                tol.other,
            );
        }

        // The rotary prelude, alone and in segments of three requests, against rms_norm_rope
        // then attention through a cache of the same format.
        let step_tol = match format {
            KvFormat::F32 | KvFormat::F16 => 1e-3,
            KvFormat::Bf16 => 1e-2,
            KvFormat::Q8 => 2e-2,
            KvFormat::Q4 => 1e-1,
        };
        for (heads, kv_heads, hd, rd) in [(8, 2, 64, 64), (16, 2, 256, 64), (8, 4, 128, 32)] {
            let (qw, kw) = (heads * hd, kv_heads * hd);
            let (theta, eps, scale) = (1_000_000.0, 1e-6, 1.0 / (hd as f32).sqrt());
            let rope = Rope::new(hd, rd, theta);
            let q_norm = b.vector(&rng.vec(hd, 0.5, 1.5)).expect("vector");
            let k_norm = b.vector(&rng.vec(hd, 0.5, 1.5)).expect("vector");
            let spec = AttentionSpec::new(heads, scale);
            let new = || b.kv_cache(kv_heads, hd, 16, format).expect("kv_cache");
            let mut fused: Vec<B::KvCache> = (0..3).map(|_| new()).collect();
            let mut plain: Vec<B::KvCache> = (0..3).map(|_| new()).collect();
            for (step, rows) in [[7, 1, 20], [1, 1, 1], [1, 1, 1], [3, 1, 1], [1, 1, 1]]
                .into_iter()
                .enumerate()
            {
                let n: usize = rows.iter().sum();
                let q = b.act_from_host(&rng.vec(n * qw, -2.0, 2.0), n, qw);
                let k = b.act_from_host(&rng.vec(n * kw, -2.0, 2.0), n, kw);
                let v = b.act_from_host(&rng.vec(n * kw, -2.0, 2.0), n, kw);
                let got = if step % 2 == 0 {
                    let mut caches: Vec<&mut B::KvCache> = fused.iter_mut().collect();
                    b.attention_rope_segments(
                        &q,
                        &k,
                        &v,
                        Some((&q_norm, &k_norm)),
                        eps,
                        rope,
                        &mut caches,
                        &rows,
                        spec,
                    )
                } else {
                    // One request at a time through attention_rope.
                    let mut outs = Vec::new();
                    let mut at = 0;
                    for (r, cache) in rows.iter().zip(fused.iter_mut()) {
                        let (qr, kr, vr) = (
                            b.slice_rows(&q, at, *r),
                            b.slice_rows(&k, at, *r),
                            b.slice_rows(&v, at, *r),
                        );
                        outs.push(b.attention_rope(
                            &qr,
                            &kr,
                            &vr,
                            Some((&q_norm, &k_norm)),
                            eps,
                            rope,
                            cache,
                            spec,
                        ));
                        at += r;
                    }
                    b.concat_rows(&outs.iter().collect::<Vec<_>>())
                };
                let mut want = Vec::new();
                let mut at = 0;
                for (r, cache) in rows.iter().zip(plain.iter_mut()) {
                    let pos = b.kv_len(cache);
                    let qr = b.rms_norm_rope(&b.slice_rows(&q, at, *r), &q_norm, eps, rope, pos);
                    let kr = b.rms_norm_rope(&b.slice_rows(&k, at, *r), &k_norm, eps, rope, pos);
                    let vr = b.slice_rows(&v, at, *r);
                    want.extend(host(b, &b.attention(&qr, &kr, &vr, cache, spec)));
                    at += r;
                }
                let what = format!(
                    "{format} cache, attention_rope {heads}/{kv_heads}x{hd}, step {step} ({rows:?} rows)"
                );
                assert_close(&what, &host(b, &got), &want, step_tol);
                for (f, p) in fused.iter().zip(&plain) {
                    assert_eq!(b.kv_len(f), b.kv_len(p), "{what}: kv_len");
                }
            }
        }
    }

    // A long cache, past the 8192 positions where a backend may split a decoded token's
    // positions differently: one prefill (not checked), then two decode steps checked, in every
    // format the backend lists. (The prefill looks back 16 positions only, to be cheap: what it
    // stores does not depend on that.)
    let (heads, kv_heads, hd, len) = (2, 1, 64, 8300);
    let (qw, kw) = (heads * hd, kv_heads * hd);
    let spec = AttentionSpec::new(heads, 1.0 / (hd as f32).sqrt());
    for &format in b.kv_formats() {
        let mut cache = b.kv_cache(kv_heads, hd, 64, format).expect("kv_cache");
        let (mut keys, mut values) = (rng.vec(len * kw, -2.0, 2.0), rng.vec(len * kw, -2.0, 2.0));
        b.attention(
            &b.act_from_host(&rng.vec(len * qw, -2.0, 2.0), len, qw),
            &b.act_from_host(&keys, len, kw),
            &b.act_from_host(&values, len, kw),
            &mut cache,
            AttentionSpec {
                window: Some(16),
                ..spec
            },
        );
        crate::kv::round_trip(format, &mut keys, hd);
        crate::kv::round_trip(format, &mut values, hd);
        for step in 0..2 {
            decode_checked(
                b,
                &mut rng,
                (&mut cache, format, kv_heads, hd),
                (spec, None),
                (&mut keys, &mut values),
                &format!("{format} cache of {} positions, step {step}", len + step),
                tol.other,
            );
        }
    }
}

/// One token decoded through `cache` (which holds `keys` and `values`, rounded as its format
/// stores them; the new token's are appended) checked against the reference attention.
fn decode_checked<B: Backend>(
    b: &B,
    rng: &mut Rng,
    (cache, format, kv_heads, hd): (&mut B::KvCache, KvFormat, usize, usize),
    (spec, host_sinks): (AttentionSpec<'_, B::Vector>, Option<&[f32]>),
    (keys, values): (&mut Vec<f32>, &mut Vec<f32>),
    what: &str,
    tol: f32,
) {
    let (qw, kw) = (spec.heads * hd, kv_heads * hd);
    let q = rng.vec(qw, -2.0, 2.0);
    let (mut k, mut v) = (rng.vec(kw, -2.0, 2.0), rng.vec(kw, -2.0, 2.0));
    let got = b.attention(
        &b.act_from_host(&q, 1, qw),
        &b.act_from_host(&k, 1, kw),
        &b.act_from_host(&v, 1, kw),
        cache,
        spec,
    );
    crate::kv::round_trip(format, &mut k, hd);
    crate::kv::round_trip(format, &mut v, hd);
    keys.extend_from_slice(&k);
    values.extend_from_slice(&v);
    let want = reference::attention(
        &q,
        keys,
        values,
        spec.heads,
        kv_heads,
        hd,
        spec.scale,
        spec.window,
        host_sinks,
    );
    assert_close(what, &host(b, &got), &want, tol);
}

/// `join_chunks` (the inverse of `split_chunks`) and `matmul_heads` (one product per head) in
/// every weight format, with the shapes of Multi-head Latent Attention's absorbed projections.
pub fn matmul_heads<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(63);
    for (rows, a_chunk, b_chunk, chunks) in [(1, 64, 512, 16), (5, 3, 8, 2), (2, 512, 64, 1)] {
        let (xa, xb) = (
            rng.vec(rows * chunks * a_chunk, -1.0, 1.0),
            rng.vec(rows * chunks * b_chunk, -1.0, 1.0),
        );
        let got = b.join_chunks(
            &b.act_from_host(&xa, rows, chunks * a_chunk),
            a_chunk,
            &b.act_from_host(&xb, rows, chunks * b_chunk),
            b_chunk,
        );
        let case = format!("join_chunks {rows} rows of {chunks} x ({a_chunk} + {b_chunk})");
        assert_eq!(
            b.shape(&got),
            (rows, chunks * (a_chunk + b_chunk)),
            "{case}"
        );
        let want = reference::join_chunks(&xa, a_chunk, &xb, b_chunk);
        assert_eq!(host(b, &got), want, "{case}");
    }
    let required = required_formats();
    for format in required.iter().chain(&optional_formats()) {
        // (heads, out, in): embed_q's [512, 128] and unembed_out's [128, 512] per head, and odd.
        for (heads, out, inp) in [(16, 512, 128), (16, 128, 512), (3, 5, 128)] {
            let m = random_matrix(&mut rng, *format, heads * out, inp);
            let w = match b.weight(m.clone()) {
                Ok(w) => w,
                Err(crate::BackendError::Unsupported(_)) if !required.contains(format) => break,
                Err(e) => panic!("weight({format}, [{}, {inp}]): {e}", heads * out),
            };
            for rows in [1, 2, 9, 40] {
                let x = rng.vec(rows * heads * inp, -1.0, 1.0);
                let got = b.matmul_heads(&b.act_from_host(&x, rows, heads * inp), &w, heads);
                let want = reference::matmul_heads(&x, rows, &m.as_ref(), heads);
                assert_close(
                    &format!("matmul_heads {format} {heads} x [{out}, {inp}], {rows} rows"),
                    &host(b, &got),
                    &want,
                    tol.matmul,
                );
            }
        }
    }
}

/// Sigmoid routing with a selection bias, in groups or not (GLM-4.5's and DeepSeek-V3's shapes):
/// exact choices (a planted tie goes to the lower index) and weights.
pub fn route_sigmoid<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(8);
    for (rows, experts, k, groups, top_groups) in [
        (1, 8, 2, 1, 1),
        (5, 128, 8, 1, 1),
        (3, 160, 8, 1, 1),
        (4, 256, 8, 8, 4),
        (2, 64, 6, 8, 3),
        (3, 32, 1, 4, 2),
    ] {
        let mut logits = rng.vec(rows * experts, -4.0, 4.0);
        let mut bias = rng.vec(experts, -0.2, 0.2);
        // Experts 0 and 1 alike in every row: a tie wherever they stand.
        bias[1] = bias[0];
        for r in 0..rows {
            logits[r * experts + 1] = logits[r * experts];
        }
        for (normalize, scale) in [(true, 2.5), (false, 1.0)] {
            let how = SigmoidRouting {
                groups,
                top_groups,
                normalize,
                scale,
            };
            let routing = b.route_sigmoid(
                &b.act_from_host(&logits, rows, experts),
                &b.vector(&bias).expect("vector"),
                k,
                how,
            );
            let got = b.read_routing(&routing).expect("read_routing");
            let want = reference::route_sigmoid(&logits, &bias, k, how);
            let case = format!("route_sigmoid {rows} rows of {experts} experts, top {k}, {how:?}");
            assert_eq!(
                (got.k, &got.experts),
                (want.k, &want.experts),
                "{case}: experts"
            );
            assert_close(&case, &got.weights, &want.weights, tol.other);
        }
    }
}

/// Routing: exact choices (ties go to the lower index) and weights, with and without
/// renormalisation.
pub fn route<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(7);
    for (rows, experts, k) in [(1, 8, 1), (2, 6, 6), (3, 32, 4), (9, 128, 8), (2, 512, 10)] {
        // Multiples of 1/8 keep distinct logits distinct after any softmax rounding; each row
        // gets a planted tie.
        let mut logits: Vec<f32> = (0..rows * experts)
            .map(|_| (rng.below(64) as f32 - 32.0) / 8.0)
            .collect();
        for r in 0..rows {
            let (a, c) = (rng.below(experts), rng.below(experts));
            logits[r * experts + c] = logits[r * experts + a];
        }
        for normalize in [false, true] {
            let routing = b.route(&b.act_from_host(&logits, rows, experts), k, normalize);
            let got = b.read_routing(&routing).expect("read_routing");
            let want = reference::route(&logits, experts, k, normalize);
            let case =
                format!("route {rows} rows of {experts} experts, top {k}, normalize {normalize}");
            assert_eq!(
                (got.k, &got.experts),
                (want.k, &want.experts),
                "{case}: experts"
            );
            assert_close(&case, &got.weights, &want.weights, tol.other);
        }
    }
}

/// A `[rows, cols]` matrix in `format` whose values are in [-1, 1) and multiples of 1/8 (dense)
/// or of 2^-(bits-1) (affine: that scale, bias -1), with row `tie_b` a copy of row `tie_a`:
/// products with inputs in {-1, 0, 1} are exact in f32 in any order of summation.
fn exact_matrix(
    rng: &mut Rng,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    (tie_a, tie_b): (usize, usize),
) -> HostMatrix {
    let row_bytes = format.row_bytes(cols);
    let (mut data, scales, biases) = match format {
        WeightFormat::Dense(dt) => {
            let v: Vec<f32> = (0..rows * cols)
                .map(|_| (rng.below(16) as f32 - 8.0) / 8.0)
                .collect();
            (encode(dt, &v), vec![], vec![])
        }
        WeightFormat::Affine {
            bits,
            group_size,
            scale_dtype,
        } => {
            let groups = rows * cols / group_size;
            let scale = 1.0 / (1u32 << (bits - 1)) as f32;
            (
                (0..rows * row_bytes)
                    .map(|_| rng.next_u64() as u8)
                    .collect(),
                encode(scale_dtype, &vec![scale; groups]),
                encode(scale_dtype, &vec![-1.0; groups]),
            )
        }
        // Values multiples of 2^-4 in [-0.75, 0.75] (scale 2^-3).
        WeightFormat::Mxfp4 => (
            (0..rows * row_bytes)
                .map(|_| rng.next_u64() as u8)
                .collect(),
            vec![124; rows * cols / crate::MXFP4_GROUP],
            vec![],
        ),
    };
    data.copy_within(
        tie_a * row_bytes..(tie_a + 1) * row_bytes,
        tie_b * row_bytes,
    );
    HostMatrix::new(
        format,
        rows,
        cols,
        HostBytes::from_vec(data),
        HostBytes::from_vec(scales),
        HostBytes::from_vec(biases),
    )
    .expect("a consistent matrix")
}

/// `route_matmul` (the router's product and the routing, fused where a backend fuses them) on
/// exact products, against the reference: the same experts, ties to the lower index.
pub fn route_matmul<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(11);
    let formats = [
        WeightFormat::Dense(Dtype::F32),
        WeightFormat::Dense(Dtype::Bf16),
        WeightFormat::Affine {
            bits: 8,
            group_size: 64,
            scale_dtype: Dtype::Bf16,
        },
        WeightFormat::Affine {
            bits: 4,
            group_size: 32,
            scale_dtype: Dtype::F16,
        },
    ];
    for format in formats {
        for (rows, experts, k) in [(1, 128, 8), (3, 256, 8), (9, 40, 4), (70, 32, 2)] {
            let cols = 256;
            let tie = (rng.below(experts / 2), experts / 2 + rng.below(experts / 2));
            let w = exact_matrix(&mut rng, format, experts, cols, tie);
            let x: Vec<f32> = (0..rows * cols)
                .map(|_| rng.below(3) as f32 - 1.0)
                .collect();
            let wb = b.weight(w.clone()).expect("weight");
            let want_logits = reference::matmul(&x, rows, &w.as_ref());
            for normalize in [false, true] {
                let xa = b.act_from_host(&x, rows, cols);
                let got = b
                    .read_routing(&b.route_matmul(&xa, &wb, k, normalize))
                    .expect("read_routing");
                let want = reference::route(&want_logits, experts, k, normalize);
                let case = format!(
                    "route_matmul {format}, {rows} rows of {experts} experts, top {k}, \
                     normalize {normalize}"
                );
                assert_eq!(
                    (got.k, &got.experts),
                    (want.k, &want.experts),
                    "{case}: experts"
                );
                assert_close(&case, &got.weights, &want.weights, tol.other);
            }
        }
    }
}

/// The reference's view of host experts.
fn expert_refs(experts: &[FfnWeights<HostMatrix>]) -> Vec<FfnWeights<MatRef<'_>>> {
    experts
        .iter()
        .map(|e| FfnWeights {
            gate: e.gate.as_ref(),
            up: e.up.as_ref(),
            down: e.down.as_ref(),
        })
        .collect()
}

fn random_experts(
    rng: &mut Rng,
    format: WeightFormat,
    n: usize,
    h: usize,
    i: usize,
) -> Vec<FfnWeights<HostMatrix>> {
    (0..n)
        .map(|_| FfnWeights {
            gate: random_matrix(rng, format, i, h),
            up: random_matrix(rng, format, i, h),
            down: random_matrix(rng, format, h, i),
        })
        .collect()
}

/// The MoE over resident experts, over staged experts in one call, and over staged experts split
/// into ascending runs (which must be bit-identical to one call); the dense feed-forward block.
pub fn moe<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(8);
    let q4 = |group_size, scale_dtype| WeightFormat::Affine {
        bits: 4,
        group_size,
        scale_dtype,
    };
    // (format, experts, hidden, expert width). The 4-bit cases beyond the first reach the
    // column loops of wide decode kernels (a down width over 768, one under a warp's 256), and
    // the real models' expert width (768: 48 threads per row of a column-spread kernel). The
    // mxfp4 cases (gpt-oss's experts) and the first run with gpt-oss's clamped SwiGLU and
    // biases as well (below).
    let cases = [
        (q4(64, Dtype::Bf16), 16, 128, 64),
        (WeightFormat::Mxfp4, 16, 128, 64),
        (WeightFormat::Mxfp4, 8, 256, 768),
        (
            WeightFormat::Affine {
                bits: 8,
                group_size: 32,
                scale_dtype: Dtype::F16,
            },
            16,
            128,
            64,
        ),
        (WeightFormat::Dense(Dtype::Bf16), 16, 128, 64),
        (WeightFormat::Dense(Dtype::F16), 16, 128, 64),
        (q4(128, Dtype::Bf16), 8, 256, 1024),
        (q4(32, Dtype::F32), 8, 288, 96),
        (q4(64, Dtype::Bf16), 16, 256, 768),
        // Rows too long for one warp (as Mixtral's 14336): the decode kernel cuts them into
        // column slices, here three of uneven length (at four experts per token).
        (q4(64, Dtype::Bf16), 8, 64, 4224),
    ];
    for (layer, (format, n, h, i)) in cases.into_iter().enumerate() {
        let host_experts = random_experts(&mut rng, format, n, h, i);
        let resident = b.experts(host_experts.clone()).expect("experts");
        // gpt-oss's activation (a limit low enough that random inputs reach it) and biases.
        let host_biases = FfnWeights {
            gate: rng.vec(n * i, -0.2, 0.2),
            up: rng.vec(n * i, -0.2, 0.2),
            down: rng.vec(n * h, -0.2, 0.2),
        };
        let biases = FfnWeights {
            gate: b.vector(&host_biases.gate).expect("vector"),
            up: b.vector(&host_biases.up).expect("vector"),
            down: b.vector(&host_biases.down).expect("vector"),
        };
        let clamped = Activation::ClampedSwiglu {
            alpha: 1.702,
            limit: 0.25,
        };
        let mut ffns = vec![(ExpertFfn::SWIGLU, None, "swiglu")];
        if layer < 3 {
            let with_biases = ExpertFfn {
                activation: clamped,
                biases: Some(&biases),
            };
            ffns.push((with_biases, Some(&host_biases), "clamped swiglu + biases"));
        }
        // 150 rows: two tiles of 64 pairs for most experts on a tiled backend.
        for (rows, k) in [(1, 4), (3, 2), (11, 8), (150, 8)] {
            for &(ffn, host_ffn_biases, ffn_name) in &ffns {
                let x = rng.vec(rows * h, -1.0, 1.0);
                let xa = b.act_from_host(&x, rows, h);
                let logits = rng.vec(rows * n, -3.0, 3.0);
                let routing = b.route(&b.act_from_host(&logits, rows, n), k, true);
                let host_routing = b.read_routing(&routing).expect("read_routing");
                let refs = expert_refs(&host_experts);
                let want = reference::moe(
                    &x,
                    rows,
                    &host_routing,
                    &refs,
                    ffn.activation,
                    host_ffn_biases,
                );
                let case = format!("{format}, {rows} rows, top {k}, {ffn_name}");
                assert_close(
                    &format!("moe {case}"),
                    &host(b, &b.moe(&xa, &routing, &resident, ffn)),
                    &want,
                    tol.matmul,
                );

                let used = host_routing.distinct();
                let staged: Vec<(u32, B::StagedExpert)> = used
                    .iter()
                    .map(|&e| {
                        let key = ExpertKey { layer, expert: e };
                        (
                            e,
                            b.stage_expert(key, host_experts[e as usize].clone())
                                .expect("stage_expert"),
                        )
                    })
                    .collect();
                let pairs: Vec<(u32, &B::StagedExpert)> =
                    staged.iter().map(|(e, s)| (*e, s)).collect();
                let mut whole = b.zeros(rows, h);
                b.moe_accumulate(&xa, &routing, &pairs, ffn, &mut whole);
                let whole = host(b, &whole);
                assert_close(&format!("moe_accumulate {case}"), &whole, &want, tol.matmul);
                let mut split = b.zeros(rows, h);
                for run in pairs.chunks(3) {
                    b.moe_accumulate(&xa, &routing, run, ffn, &mut split);
                }
                assert_eq!(
                    host(b, &split),
                    whole,
                    "moe_accumulate {case}: runs of 3 experts differ from one call"
                );
                // A backend that keeps staged experts must hand back the same ones.
                let kept: Vec<(u32, B::StagedExpert)> = used
                    .iter()
                    .filter_map(|&e| {
                        b.staged_expert(ExpertKey { layer, expert: e })
                            .map(|s| (e, s))
                    })
                    .collect();
                if kept.len() == used.len() {
                    let pairs: Vec<(u32, &B::StagedExpert)> =
                        kept.iter().map(|(e, s)| (*e, s)).collect();
                    let mut again = b.zeros(rows, h);
                    b.moe_accumulate(&xa, &routing, &pairs, ffn, &mut again);
                    assert_eq!(
                        host(b, &again),
                        whole,
                        "moe_accumulate {case}: kept staged experts"
                    );
                }
            }
        }
        let e = &host_experts[0];
        let ffn = FfnWeights {
            gate: b.weight(e.gate.clone()).expect("weight"),
            up: b.weight(e.up.clone()).expect("weight"),
            down: b.weight(e.down.clone()).expect("weight"),
        };
        // Decode-sized and prompt-sized calls: against the reference, and bit for bit the
        // backend's own calls one by one (a fused version keeps them).
        for rows in [1, 2, 4, 9, 33] {
            let x = rng.vec(rows * h, -1.0, 1.0);
            let xa = b.act_from_host(&x, rows, h);
            let got = host(b, &b.ffn(&xa, &ffn));
            let [g, u] = b.matmuls(&xa, [&ffn.gate, &ffn.up]);
            let own = b.matmul(&b.swiglu(&g, &u), &ffn.down);
            assert_eq!(
                got,
                host(b, &own),
                "ffn {format}, {rows} rows: the same bits as its parts"
            );
            let hid = reference::swiglu(
                &reference::matmul(&x, rows, &e.gate.as_ref()),
                &reference::matmul(&x, rows, &e.up.as_ref()),
            );
            assert_close(
                &format!("ffn {format}, {rows} rows"),
                &got,
                &reference::matmul(&hid, rows, &e.down.as_ref()),
                tol.matmul,
            );
        }
    }
}

/// The Gated DeltaNet operations: a prefill, then decode steps continuing its state, compared
/// with the reference output and state; the state survives a host round trip.
pub fn delta_net<B: Backend>(b: &B, tol: Tolerance) {
    let mut rng = Rng::new(9);
    for dims in [
        DeltaNetDims {
            key_heads: 2,
            value_heads: 4,
            key_dim: 32,
            value_dim: 16,
            conv_kernel: 4,
            value_order: ValueHeadOrder::Tiled,
        },
        DeltaNetDims {
            key_heads: 4,
            value_heads: 4,
            key_dim: 64,
            value_dim: 64,
            conv_kernel: 2,
            value_order: ValueHeadOrder::Grouped,
        },
        // Qwen3.5's head sizes, two value heads per key head.
        DeltaNetDims {
            key_heads: 2,
            value_heads: 4,
            key_dim: 128,
            value_dim: 128,
            conv_kernel: 4,
            value_order: ValueHeadOrder::Grouped,
        },
        // llama.cpp's order, three value heads per key head.
        DeltaNetDims {
            key_heads: 2,
            value_heads: 6,
            key_dim: 32,
            value_dim: 32,
            conv_kernel: 4,
            value_order: ValueHeadOrder::Tiled,
        },
    ] {
        let c = dims.conv_channels();
        let hv = dims.value_heads;
        let conv_w = rng.vec(c * dims.conv_kernel, -0.5, 0.5);
        let a_log = rng.vec(hv, -1.0, 1.0);
        let dt_bias = rng.vec(hv, -1.0, 1.0);
        let norm_w = rng.vec(dims.value_dim, 0.5, 1.5);
        let (conv_v, a_log_v, dt_v, norm_v) = (
            b.vector(&conv_w).expect("vector"),
            b.vector(&a_log).expect("vector"),
            b.vector(&dt_bias).expect("vector"),
            b.vector(&norm_w).expect("vector"),
        );
        let mut state = b.linear_state(&dims).expect("linear_state");
        assert_eq!(
            b.linear_state_to_host(&state).expect("to host"),
            HostLinearState::new(&dims),
            "a new linear state is zero"
        );
        let mut want_state = HostLinearState::new(&dims);
        // `gated_delta_net` over the same inputs, with a state of its own.
        let mut net_state = b.linear_state(&dims).expect("linear_state");
        for (step, rows) in [6usize, 1, 1, 3, 20].into_iter().enumerate() {
            let case = format!("{dims:?}, step {step} of {rows} rows");
            let x = rng.vec(rows * c, -2.0, 2.0);
            let got = b.causal_conv1d_silu(&b.act_from_host(&x, rows, c), &conv_v, &mut state);
            let want = reference::causal_conv1d_silu(&x, &conv_w, &mut want_state);
            assert_close(
                &format!("causal_conv1d_silu {case}"),
                &host(b, &got),
                &want,
                tol.other,
            );
            let (a, bb) = (rng.vec(rows * hv, -2.0, 2.0), rng.vec(rows * hv, -2.0, 2.0));
            let before = b.linear_state_to_host(&state).expect("to host");
            let y = b.gated_delta_rule(
                &b.act_from_host(&want, rows, c),
                &b.act_from_host(&a, rows, hv),
                &b.act_from_host(&bb, rows, hv),
                &a_log_v,
                &dt_v,
                &mut state,
            );
            let want_y =
                reference::gated_delta_rule(&want, &a, &bb, &a_log, &dt_bias, &mut want_state);
            assert_close(
                &format!("gated_delta_rule {case}"),
                &host(b, &y),
                &want_y,
                tol.other,
            );
            let got_state = b.linear_state_to_host(&state).expect("to host");
            // The tokens one call each give the same bits as one call for all (a backend may
            // take another path for many tokens, but not another answer).
            let mut stepped = b.linear_state_from_host(before).expect("from host");
            let mut stepped_y = Vec::new();
            for t in 0..rows {
                let row = |v: &[f32], w: usize| b.act_from_host(&v[t * w..(t + 1) * w], 1, w);
                let y_t = b.gated_delta_rule(
                    &row(&want, c),
                    &row(&a, hv),
                    &row(&bb, hv),
                    &a_log_v,
                    &dt_v,
                    &mut stepped,
                );
                stepped_y.extend(host(b, &y_t));
            }
            assert_eq!(
                stepped_y,
                host(b, &y),
                "gated_delta_rule {case}: token by token differs from one call"
            );
            assert_eq!(
                b.linear_state_to_host(&stepped).expect("to host").recurrent,
                got_state.recurrent,
                "gated_delta_rule {case}: state token by token differs from one call"
            );
            assert_close(
                &format!("conv window {case}"),
                &got_state.conv,
                &want_state.conv,
                tol.other,
            );
            assert_close(
                &format!("recurrent state {case}"),
                &got_state.recurrent,
                &want_state.recurrent,
                tol.other,
            );
            let z = rng.vec(rows * hv * dims.value_dim, -2.0, 2.0);
            let cols = hv * dims.value_dim;
            let want_out = reference::rms_norm_gated(&want_y, &z, &norm_w, 1e-6);
            assert_close(
                &format!("rms_norm_gated {case}"),
                &host(
                    b,
                    &b.rms_norm_gated(
                        &b.act_from_host(&want_y, rows, cols),
                        &b.act_from_host(&z, rows, cols),
                        &norm_v,
                        1e-6,
                    ),
                ),
                &want_out,
                tol.other,
            );
            let weights = DeltaNetWeights {
                conv1d: &conv_v,
                a_log: &a_log_v,
                dt_bias: &dt_v,
                norm: &norm_v,
                eps: 1e-6,
            };
            let net = b.gated_delta_net(
                &b.act_from_host(&x, rows, c),
                &b.act_from_host(&z, rows, cols),
                &b.act_from_host(&a, rows, hv),
                &b.act_from_host(&bb, rows, hv),
                weights,
                &mut net_state,
            );
            assert_close(
                &format!("gated_delta_net {case}"),
                &host(b, &net),
                &want_out,
                tol.other,
            );
            let net_host = b.linear_state_to_host(&net_state).expect("to host");
            assert_close(
                &format!("gated_delta_net conv window {case}"),
                &net_host.conv,
                &want_state.conv,
                tol.other,
            );
            assert_close(
                &format!("gated_delta_net recurrent state {case}"),
                &net_host.recurrent,
                &want_state.recurrent,
                tol.other,
            );
        }
        let round = b
            .linear_state_from_host(b.linear_state_to_host(&state).expect("to host"))
            .expect("from host");
        assert_eq!(
            b.linear_state_to_host(&round).expect("to host"),
            b.linear_state_to_host(&state).expect("to host"),
            "linear state host round trip"
        );
    }
}

/// A routing in host form (for backends' own tests).
pub fn host_routing(k: usize, experts: Vec<u32>, weights: Vec<f32>) -> HostRouting {
    HostRouting {
        k,
        experts,
        weights,
    }
}

/// One `#[test]` per conformance check for the backend `$make` builds, e.g.
/// `sluice_backend::conformance_tests!(sluice_cpu::CpuBackend::new());`. An optional second
/// argument sets the [`Tolerance`]; attributes after a `;` (such as
/// `#[ignore = "needs a GPU"]`) go on every test.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr $(; $(#[$attr:meta])*)?) => {
        $crate::conformance_tests!($make, $crate::conformance::Tolerance::default() $(; $(#[$attr])*)?);
    };
    ($make:expr, $tol:expr $(; $(#[$attr:meta])*)?) => {
        $crate::conformance_tests!(@each [$($(#[$attr])*)?] $make, $tol;
            activations matmul matmul_heads embed elementwise rope attention attention_segments attention_without_norms attention_window_sinks attention_kv_formats route route_sigmoid route_matmul
            moe moe_with_shared delta_net);
    };
    (@each [$($attrs:tt)*] $make:expr, $tol:expr; $check:ident $($rest:ident)*) => {
        $($attrs)*
        #[test]
        fn $check() {
            let backend = $make;
            $crate::conformance::$check(&backend, $tol);
        }
        $crate::conformance_tests!(@each [$($attrs)*] $make, $tol; $($rest)*);
    };
    (@each [$($attrs:tt)*] $make:expr, $tol:expr;) => {};
}
