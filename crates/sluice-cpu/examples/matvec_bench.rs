//! Kernel benchmark: decode mat-vecs (GB/s of weight bytes read) and prefill (GFLOP/s), at 1 and
//! 2 threads, against the original naive kernel and a plain memory-read loop.
//!
//! ```text
//! cargo run --release -p sluice-cpu --example matvec_bench \
//!     [-- --quick --no-naive --hot --cold-mib 256 --threads 1,2 --only TEXT --kernels fast|exact]
//! ```
//!
//! Weights are cold: each case rotates over enough distinct copies (at least 256 MiB, far more
//! than most last-level caches; `--cold-mib` for larger ones, such as the lent Xeons' 300 MiB)
//! that every call streams its weights from DRAM, as decode does with a real model. `SLUICE_SIMD=scalar|avx2|avx512` forces a lower SIMD level.

use std::time::{Duration, Instant};

use rayon::prelude::*;
use sluice_backend::{Dtype, MatRef, WeightFormat};
use sluice_cpu::kernels::{self, load_scalar, Kernels, MatmulJob};

// ---------------------------------------------------------------------------------------------
// The original naive kernel (the baseline)
// ---------------------------------------------------------------------------------------------

fn naive_matmul_batch(jobs: &mut [MatmulJob<'_>]) {
    jobs.par_iter_mut().for_each(|job| {
        assert_eq!(job.x.len(), job.tokens * job.w.cols);
        assert_eq!(job.out.len(), job.tokens * job.w.rows);
        let mut row = vec![0f32; job.w.cols];
        for r in 0..job.w.rows {
            naive_dequantize_row(&job.w, r, &mut row);
            for t in 0..job.tokens {
                let x = &job.x[t * job.w.cols..(t + 1) * job.w.cols];
                job.out[t * job.w.rows + r] = row.iter().zip(x).map(|(a, b)| a * b).sum();
            }
        }
    });
}

fn naive_dequantize_row(w: &MatRef, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), w.cols);
    let rb = w.row_bytes();
    let data = &w.data[r * rb..(r + 1) * rb];
    match w.format {
        WeightFormat::Dense(dt) => {
            for (c, o) in out.iter_mut().enumerate() {
                *o = load_scalar(dt, data, c);
            }
        }
        WeightFormat::Mxfp4 => {
            out.copy_from_slice(&sluice_backend::reference::dequantize_row(w, r));
        }
        WeightFormat::Affine {
            bits,
            group_size,
            scale_dtype,
        } => {
            let groups = w.cols / group_size;
            let mask = (1u64 << bits) - 1;
            for (c, o) in out.iter_mut().enumerate() {
                let bit = c * bits as usize;
                let word = |i: usize| {
                    u32::from_le_bytes(data[i * 4..i * 4 + 4].try_into().unwrap()) as u64
                };
                let lo = word(bit / 32);
                let hi = if (bit % 32) + bits as usize > 32 {
                    word(bit / 32 + 1)
                } else {
                    0
                };
                let q = (((hi << 32) | lo) >> (bit % 32)) & mask;
                let g = r * groups + c / group_size;
                let s = load_scalar(scale_dtype, w.scales, g);
                let b = load_scalar(scale_dtype, w.biases, g);
                *o = s * q as f32 + b;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Test matrices
// ---------------------------------------------------------------------------------------------

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn f32(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

fn encode(dt: Dtype, v: impl Iterator<Item = f32>) -> Vec<u8> {
    let mut out = Vec::new();
    for x in v {
        match dt {
            Dtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&half::f16::from_f32(x).to_bits().to_le_bytes()),
            Dtype::Bf16 => out.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes()),
        }
    }
    out
}

struct Mat {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    scales: Vec<u8>,
    biases: Vec<u8>,
}

impl Mat {
    fn new(format: WeightFormat, rows: usize, cols: usize, rng: &mut Rng) -> Mat {
        let (data, scales, biases) = match format {
            WeightFormat::Dense(dt) => (
                encode(dt, (0..rows * cols).map(|_| rng.f32(-0.1, 0.1))),
                Vec::new(),
                Vec::new(),
            ),
            WeightFormat::Affine {
                group_size,
                scale_dtype,
                ..
            } => {
                let ng = rows * cols / group_size;
                (
                    rng.bytes(rows * format.row_bytes(cols)),
                    encode(scale_dtype, (0..ng).map(|_| rng.f32(0.001, 0.02))),
                    encode(scale_dtype, (0..ng).map(|_| rng.f32(-0.1, -0.01))),
                )
            }
            WeightFormat::Mxfp4 => (
                rng.bytes(rows * format.row_bytes(cols)),
                vec![120; rows * cols / sluice_backend::MXFP4_GROUP],
                Vec::new(),
            ),
        };
        Mat {
            format,
            rows,
            cols,
            data,
            scales,
            biases,
        }
    }

    fn view(&self) -> MatRef<'_> {
        let m = MatRef {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
            scales: &self.scales,
            biases: &self.biases,
        };
        m.validate().unwrap();
        m
    }

    fn nbytes(&self) -> usize {
        self.data.len() + self.scales.len() + self.biases.len()
    }
}

const Q4: WeightFormat = WeightFormat::Affine {
    bits: 4,
    group_size: 64,
    scale_dtype: Dtype::Bf16,
};

/// 8-bit as GGUF's Q8_0 converts (group 32, f16 scales) and as its Q6_K does (group 16, f32).
const Q8G32: WeightFormat = WeightFormat::Affine {
    bits: 8,
    group_size: 32,
    scale_dtype: Dtype::F16,
};
const Q8G16: WeightFormat = WeightFormat::Affine {
    bits: 8,
    group_size: 16,
    scale_dtype: Dtype::F32,
};

/// Other widths, as GGUF's Q5_0/Q5_K (5-bit, group 32) and Q3_K (3-bit, group 16) convert
/// (f32 scales), and MLX's 2- and 6-bit checkpoints.
const Q5G32: WeightFormat = WeightFormat::Affine {
    bits: 5,
    group_size: 32,
    scale_dtype: Dtype::F32,
};
const Q3G16: WeightFormat = WeightFormat::Affine {
    bits: 3,
    group_size: 16,
    scale_dtype: Dtype::F32,
};
const Q2G16: WeightFormat = WeightFormat::Affine {
    bits: 2,
    group_size: 16,
    scale_dtype: Dtype::F16,
};
const Q6G64: WeightFormat = WeightFormat::Affine {
    bits: 6,
    group_size: 64,
    scale_dtype: Dtype::Bf16,
};

/// Enough copies of a `batch`-matrix set that together they far exceed the last-level cache.
/// With `hot`, a single set (cache-resident when small enough).
fn copies(
    format: WeightFormat,
    rows: usize,
    cols: usize,
    batch: usize,
    hot: bool,
    cold_mib: usize,
    rng: &mut Rng,
) -> Vec<Vec<Mat>> {
    let one = Mat::new(format, rows, cols, rng);
    let set_bytes = one.nbytes() * batch;
    let sets = if hot {
        1
    } else {
        (cold_mib << 20).div_ceil(set_bytes).clamp(1, 1024)
    };
    let mut first = Some(one);
    (0..sets)
        .map(|_| {
            (0..batch)
                .map(|_| {
                    first
                        .take()
                        .unwrap_or_else(|| Mat::new(format, rows, cols, rng))
                })
                .collect()
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Timing
// ---------------------------------------------------------------------------------------------

/// Seconds per call of `f(i)` (`i` counts calls): the best of several rounds' means, after a
/// warm-up call, so that noise from other processes is filtered out.
fn time(min_time: Duration, max_iters: usize, mut f: impl FnMut(usize)) -> f64 {
    f(0);
    let rounds: u32 = if max_iters <= 3 { 1 } else { 5 };
    let round_time = min_time / rounds;
    let mut best = f64::INFINITY;
    let mut i = 1;
    for _ in 0..rounds {
        let start = Instant::now();
        let mut n = 0;
        while n < max_iters.div_ceil(rounds as usize) && (n < 2 || start.elapsed() < round_time) {
            f(i);
            i += 1;
            n += 1;
        }
        best = best.min(start.elapsed().as_secs_f64() / n as f64);
    }
    best
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// GB/s of a plain read of a large buffer (the DRAM ceiling for decode).
fn read_bandwidth(threads: usize) -> f64 {
    let buf: Vec<u64> = (0..(512usize << 20) / 8).map(|i| i as u64).collect();
    let p = pool(threads);
    let secs = time(Duration::from_millis(500), 20, |_| {
        let s: u64 = p.install(|| {
            buf.par_chunks(1 << 16)
                .map(|c| {
                    // Eight independent sums so the loop is load-bound.
                    let mut acc = [0u64; 8];
                    for ch in c.chunks_exact(8) {
                        for j in 0..8 {
                            acc[j] = acc[j].wrapping_add(ch[j]);
                        }
                    }
                    acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                })
                .reduce(|| 0, |a, b| a.wrapping_add(b))
        });
        std::hint::black_box(s);
    });
    (buf.len() * 8) as f64 / secs / 1e9
}

struct Case {
    name: &'static str,
    format: WeightFormat,
    rows: usize,
    cols: usize,
    batch: usize,
    tokens: usize,
}

struct Opts {
    threads: Vec<usize>,
    naive: bool,
    quick: bool,
    hot: bool,
    /// MiB the copies of a case add up to at least (past the last-level cache).
    cold_mib: usize,
    only: Option<String>,
    kernels: Kernels,
}

fn run_case(case: &Case, o: &Opts, rng: &mut Rng) {
    if let Some(f) = &o.only {
        if !case.name.contains(f.as_str()) {
            return;
        }
    }
    let (naive, quick) = (o.naive, o.quick);
    let sets = copies(
        case.format,
        case.rows,
        case.cols,
        case.batch,
        o.hot,
        o.cold_mib,
        rng,
    );
    let x: Vec<f32> = (0..case.tokens * case.cols)
        .map(|_| rng.f32(-1.0, 1.0))
        .collect();
    let mut outs: Vec<Vec<f32>> = (0..case.batch)
        .map(|_| vec![0f32; case.tokens * case.rows])
        .collect();
    let bytes: usize = sets[0].iter().map(|m| m.nbytes()).sum();
    let flops = 2.0 * (case.batch * case.rows * case.cols * case.tokens) as f64;
    let min_time = Duration::from_millis(if quick { 150 } else { 600 });
    let mut call = |i: usize, naive_path: bool| {
        let set = &sets[i % sets.len()];
        let mut jobs: Vec<MatmulJob> = set
            .iter()
            .zip(outs.iter_mut())
            .map(|(m, out)| MatmulJob {
                w: m.view(),
                x: &x,
                tokens: case.tokens,
                out,
            })
            .collect();
        if naive_path {
            naive_matmul_batch(&mut jobs);
        } else {
            kernels::matmul_batch(o.kernels, &mut jobs);
        }
    };
    for &t in &o.threads {
        let p = pool(t);
        let secs = p.install(|| time(min_time, 100_000, |i| call(i, false)));
        let naive_secs = if naive {
            let max = if flops > 2e9 { 1 } else { 3 };
            Some(p.install(|| time(Duration::from_millis(300), max, |i| call(i, true))))
        } else {
            None
        };
        let rate = if case.tokens <= 32 {
            format!("{:7.2} GB/s", bytes as f64 / secs / 1e9)
        } else {
            format!("{:7.1} GFLOP/s", flops / secs / 1e9)
        };
        let vs = match naive_secs {
            Some(n) => format!("{:9.2} ms  x{:6.1}", n * 1e3, n / secs),
            None => "-".into(),
        };
        println!(
            "| {:<38} | {:>2} | {:>9} | {:>12.0} | {:>16} | {:>22} |",
            case.name,
            t,
            format!("{:.2} MB", bytes as f64 / 1e6),
            secs * 1e9,
            rate,
            vs,
        );
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let o = Opts {
        // `--threads 1,2,8`: thread counts to run (default 1 and 2).
        threads: value("--threads")
            .map(|v| {
                v.split(',')
                    .map(|t| t.parse().expect("--threads N,M"))
                    .collect()
            })
            .unwrap_or(vec![1, 2]),
        naive: !args.iter().any(|a| a == "--no-naive"),
        quick: args.iter().any(|a| a == "--quick"),
        // `--hot`: no rotation over copies (weights may stay in cache).
        hot: args.iter().any(|a| a == "--hot"),
        // `--cold-mib N`: copies of at least N MiB (default 256; more than a large server's L3).
        cold_mib: value("--cold-mib").map_or(256, |v| v.parse().expect("--cold-mib N")),
        // `--only TEXT`: only the cases whose name contains TEXT.
        only: value("--only"),
        // `--kernels fast|exact` (default exact).
        kernels: value("--kernels")
            .map(|k| k.parse().expect("--kernels fast|exact"))
            .unwrap_or_default(),
    };
    let threads = o.threads.clone();
    println!(
        "SIMD level: {}, {} kernels",
        kernels::simd_level(),
        o.kernels.name()
    );
    for &t in threads.iter().filter(|_| o.only.is_none()) {
        println!(
            "plain read of 512 MiB, {t} thread(s): {:.1} GB/s",
            read_bandwidth(t)
        );
    }
    println!();
    println!(
        "| {:<38} | {:>2} | {:>9} | {:>12} | {:>16} | {:>22} |",
        "case", "th", "weights", "ns/call", "rate", "naive: time, speedup"
    );
    println!(
        "|{:-<40}|{:-<4}|{:-<11}|{:-<14}|{:-<18}|{:-<24}|",
        "", "", "", "", "", ""
    );
    let mut rng = Rng(42);
    let bf16 = WeightFormat::Dense(Dtype::Bf16);
    let decode = [
        ("q4 g64 2048x2048", Q4, 2048, 2048, 1),
        ("q4 g64 768x2048 (expert gate/up)", Q4, 768, 2048, 1),
        ("q4 g64 2048x768 (expert down)", Q4, 2048, 768, 1),
        ("q4 g64 16 x 768x2048 (batch)", Q4, 768, 2048, 16),
        ("q4 g64 151936x2048 (lm_head)", Q4, 151936, 2048, 1),
        ("q8 g32 2048x2048", Q8G32, 2048, 2048, 1),
        ("q8 g16 2048x2048", Q8G16, 2048, 2048, 1),
        ("q8 g32 16 x 768x2048 (batch)", Q8G32, 768, 2048, 16),
        ("q8 g16 16 x 768x2048 (batch)", Q8G16, 768, 2048, 16),
        ("q5 g32 2048x2048", Q5G32, 2048, 2048, 1),
        ("q5 g32 16 x 768x2048 (batch)", Q5G32, 768, 2048, 16),
        ("q3 g16 2048x2048", Q3G16, 2048, 2048, 1),
        ("q3 g16 16 x 768x2048 (batch)", Q3G16, 768, 2048, 16),
        ("q2 g16 16 x 768x2048 (batch)", Q2G16, 768, 2048, 16),
        ("q6 g64 16 x 768x2048 (batch)", Q6G64, 768, 2048, 16),
        ("bf16 2048x2048", bf16, 2048, 2048, 1),
        (
            "mxfp4 2880x2880 (gpt-oss expert)",
            WeightFormat::Mxfp4,
            2880,
            2880,
            1,
        ),
        (
            "mxfp4 4 x 2880x2880 (batch)",
            WeightFormat::Mxfp4,
            2880,
            2880,
            4,
        ),
        ("q4 g64 4 x 2880x2880 (batch)", Q4, 2880, 2880, 4),
    ];
    for (name, format, rows, cols, batch) in decode {
        let case = Case {
            name,
            format,
            rows,
            cols,
            batch,
            tokens: 1,
        };
        run_case(&case, &o, &mut rng);
    }
    let prefill = [
        ("prefill q4 g64 2048x2048, 64 tok", Q4, 2048, 2048, 1, 64),
        ("prefill q4 g64 2048x2048, 512 tok", Q4, 2048, 2048, 1, 512),
        ("prefill q4 g64 768x2048, 64 tok", Q4, 768, 2048, 1, 64),
        ("small q4 g64 16 x 768x2048, 2 tok", Q4, 768, 2048, 16, 2),
        ("small q4 g64 16 x 768x2048, 3 tok", Q4, 768, 2048, 16, 3),
        ("small q4 g64 16 x 768x2048, 4 tok", Q4, 768, 2048, 16, 4),
        ("small q4 g64 16 x 768x2048, 5 tok", Q4, 768, 2048, 16, 5),
        ("small q4 g64 16 x 768x2048, 8 tok", Q4, 768, 2048, 16, 8),
        ("small q4 g64 16 x 768x2048, 12 tok", Q4, 768, 2048, 16, 12),
        ("small q4 g64 16 x 768x2048, 16 tok", Q4, 768, 2048, 16, 16),
        ("small q4 g64 16 x 768x2048, 32 tok", Q4, 768, 2048, 16, 32),
        ("small q8 g32 16 x 768x2048, 4 tok", Q8G32, 768, 2048, 16, 4),
        ("small q8 g16 16 x 768x2048, 4 tok", Q8G16, 768, 2048, 16, 4),
        ("small q5 g32 16 x 768x2048, 4 tok", Q5G32, 768, 2048, 16, 4),
        ("small q3 g16 16 x 768x2048, 4 tok", Q3G16, 768, 2048, 16, 4),
        ("prefill q8 g32 2048x2048, 64 tok", Q8G32, 2048, 2048, 1, 64),
        ("prefill q8 g16 2048x2048, 64 tok", Q8G16, 2048, 2048, 1, 64),
        ("prefill q5 g32 2048x2048, 64 tok", Q5G32, 2048, 2048, 1, 64),
        ("prefill q3 g16 2048x2048, 64 tok", Q3G16, 2048, 2048, 1, 64),
        ("prefill bf16 2048x2048, 64 tok", bf16, 2048, 2048, 1, 64),
        (
            "prefill mxfp4 2880x2880, 64 tok",
            WeightFormat::Mxfp4,
            2880,
            2880,
            1,
            64,
        ),
        ("prefill q4 g64 2880x2880, 64 tok", Q4, 2880, 2880, 1, 64),
    ];
    for (name, format, rows, cols, batch, tokens) in prefill {
        let case = Case {
            name,
            format,
            rows,
            cols,
            batch,
            tokens,
        };
        run_case(&case, &o, &mut rng);
    }
}
