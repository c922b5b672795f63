//! Generates the bytes of one chunk of a tensor, deterministically from the tensor's seed and the
//! chunk's offset (so the output does not depend on the thread count).

use sluice_format::StDtype;

use crate::plan::{mix, Fill, GroupScales, TensorPlan};

/// A small, fast generator (wyrand); ~1 ns per 8 random bytes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xe703_7ed1_a0b4_28db) as u128);
        ((t >> 64) as u64) ^ (t as u64)
    }

    /// Uniform on [0, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Uniform on [0, 1) from a hash of `key` and `index` (stateless: scales and biases agree).
fn hashed_unit(key: u64, index: u64) -> f32 {
    (mix(key ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 40) as f32 / (1u64 << 24) as f32
}

/// The scale of group `index` (the same for the scales and the biases tensors).
fn group_scale(g: &GroupScales, index: u64) -> f32 {
    let mut s = g.base * (0.8 + 0.4 * hashed_unit(g.key, index));
    if g.row_spread != 0.0 {
        // A standard normal per output row (Box-Muller on two hashes of the row).
        let row = index / g.row_groups.max(1) as u64;
        let u1 = hashed_unit(g.key ^ 0x5eed, row).max(1e-7);
        let u2 = hashed_unit(g.key ^ 0xfeed, row);
        let z = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
        s *= (g.row_spread * z).exp();
    }
    s
}

/// Round-to-nearest-even f32 -> bf16 bits.
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let round = 0x7fff + ((b >> 16) & 1);
    (b.wrapping_add(round) >> 16) as u16
}

fn bf16_value(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// Bytes `start..end` of tensor `t`.
pub fn fill(t: &TensorPlan, start: usize, end: usize) -> Vec<u8> {
    let mut out = vec![0u8; end - start];
    let mut rng = Rng(mix(t.seed ^ start as u64));
    if let Fill::Codes(symmetric) = t.fill {
        for chunk in out.chunks_mut(8) {
            let r = rng.next().to_le_bytes();
            chunk.copy_from_slice(&r[..chunk.len()]);
        }
        match symmetric {
            None => {}
            Some(4) => {
                for b in &mut out {
                    let (lo, hi) = (*b & 0x0f, *b >> 4);
                    *b = if lo == 0 { 8 } else { lo } | (if hi == 0 { 8 } else { hi }) << 4;
                }
            }
            Some(8) => {
                for b in &mut out {
                    if *b == 0 {
                        *b = 128;
                    }
                }
            }
            Some(bits) => unreachable!("{bits}-bit codes are refused before planning"),
        }
        return out;
    }
    let size = t.dtype.size();
    debug_assert!(start.is_multiple_of(size) && end.is_multiple_of(size));
    let first = (start / size) as u64;
    for (i, slot) in out.chunks_exact_mut(size).enumerate() {
        let index = first + i as u64;
        let v = match t.fill {
            Fill::Codes(_) => unreachable!("handled above"),
            Fill::Scales(g) => group_scale(&g, index),
            Fill::Biases(g, zero_point) => {
                let scale = bf16_value(group_scale(&g, index));
                -scale * zero_point
            }
            Fill::Constant(c) => c,
            Fill::Uniform { lo, hi } => lo + (hi - lo) * rng.unit(),
            Fill::Normal { mean, std } => {
                // Box-Muller on two uniforms (the first kept off zero).
                let u1 = rng.unit().max(1e-7);
                let u2 = rng.unit();
                mean + std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
            }
            Fill::LogUniform { lo, hi } => (lo + (hi - lo) * rng.unit()).ln(),
            Fill::InvSoftplusLogUniform { lo, hi } => {
                let dt = (lo.ln() + (hi.ln() - lo.ln()) * rng.unit()).exp();
                // softplus^-1(dt) = dt + ln(1 - e^-dt)
                dt + (-(-dt).exp_m1()).ln()
            }
        };
        match t.dtype {
            StDtype::BF16 => slot.copy_from_slice(&bf16_bits(v).to_le_bytes()),
            StDtype::F32 => slot.copy_from_slice(&v.to_le_bytes()),
            other => unreachable!("synthetic tensors are bf16 or f32, not {other}"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(fill: Fill, dtype: StDtype, n: usize) -> TensorPlan {
        TensorPlan {
            name: "t".into(),
            dtype,
            shape: vec![n],
            fill,
            seed: 42,
        }
    }

    fn bf16s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(2)
            .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
            .collect()
    }

    #[test]
    fn biases_centre_their_scales() {
        let g = GroupScales {
            base: 0.01,
            key: 7,
            row_groups: 4,
            row_spread: 0.0,
        };
        let s = bf16s(&fill(&plan(Fill::Scales(g), StDtype::BF16, 100), 0, 200));
        let b = fill(&plan(Fill::Biases(g, 7.5), StDtype::BF16, 100), 0, 200);
        for (s, b) in s.iter().zip(bf16s(&b)) {
            assert!((0.0079..0.0121).contains(s), "{s}");
            // bf16 keeps 8 significant bits: within 0.4% of the bias.
            assert!((b + 7.5 * s).abs() <= 0.004 * 7.5 * s, "{b} vs {s}");
        }
    }

    #[test]
    fn ggml_zero_point_biases_are_exactly_minus_8_and_128_scales() {
        use crate::plan::ZeroPoint;
        let g = GroupScales {
            base: 0.01,
            key: 3,
            row_groups: 4,
            row_spread: 0.2,
        };
        let s = bf16s(&fill(&plan(Fill::Scales(g), StDtype::BF16, 100), 0, 200));
        for (bits, zero) in [(4, -8.0f32), (8, -128.0)] {
            let z = ZeroPoint::Ggml.value(bits);
            let b = bf16s(&fill(&plan(Fill::Biases(g, z), StDtype::BF16, 100), 0, 200));
            for (s, b) in s.iter().zip(b) {
                // A power-of-two multiple of a bf16 is a bf16: Q4_0 / Q8_0 hold it exactly.
                assert_eq!(b, zero * s, "bits {bits}");
            }
        }
        assert_eq!(ZeroPoint::Centred.value(4), 7.5);
    }

    #[test]
    fn ggml_zero_point_codes_are_symmetric_about_it() {
        use crate::plan::ZeroPoint;
        for (bits, mid) in [(4u32, 8i64), (8, 128)] {
            let b = fill(
                &plan(Fill::Codes(Some(bits)), StDtype::U32, 1 << 16),
                0,
                1 << 18,
            );
            let codes: Vec<i64> = if bits == 4 {
                b.iter()
                    .flat_map(|&x| [(x & 15) as i64, (x >> 4) as i64])
                    .collect()
            } else {
                b.iter().map(|&x| x as i64).collect()
            };
            assert!(!codes.contains(&0), "{bits}-bit: code 0 written");
            let n = codes.len() as f64;
            let mean = codes.iter().map(|&c| (c - mid) as f64).sum::<f64>() / n;
            let std = (codes
                .iter()
                .map(|&c| ((c - mid) as f64).powi(2))
                .sum::<f64>()
                / n)
                .sqrt();
            assert!(
                mean.abs() < 0.05 * std,
                "{bits}-bit: mean {mean} about the zero point"
            );
            let want = ZeroPoint::Ggml.code_std(bits) as f64;
            assert!(
                (std / want - 1.0).abs() < 0.01,
                "{bits}-bit: std {std} vs {want}"
            );
        }
        let want = ZeroPoint::Centred.code_std(4) as f64;
        assert!((want - (255.0f64 / 12.0).sqrt()).abs() < 1e-6);
    }

    #[test]
    fn row_spread_scales_whole_rows_and_biases_follow() {
        let g = GroupScales {
            base: 0.01,
            key: 9,
            row_groups: 8,
            row_spread: 0.3,
        };
        let s = bf16s(&fill(&plan(Fill::Scales(g), StDtype::BF16, 800), 0, 1600));
        let b = bf16s(&fill(
            &plan(Fill::Biases(g, 127.5), StDtype::BF16, 800),
            0,
            1600,
        ));
        let row_mean = |r: usize| s[r * 8..(r + 1) * 8].iter().sum::<f32>() / 8.0;
        let means: Vec<f32> = (0..100).map(row_mean).collect();
        let (lo, hi) = means
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &m| (a.min(m), b.max(m)));
        // exp(0.3 z) over 100 rows spans well over 1.5x; without spread rows agree within ~20%.
        assert!(hi / lo > 1.5, "{lo} {hi}");
        for (s, b) in s.iter().zip(&b) {
            assert!((b + 127.5 * s).abs() <= 0.004 * 127.5 * s, "{b} vs {s}");
        }
    }

    #[test]
    fn normal_fill_has_its_mean_and_spread() {
        let n = 4096;
        let fill_normal = Fill::Normal {
            mean: 0.0,
            std: 1.0,
        };
        let v = bf16s(&fill(&plan(fill_normal, StDtype::BF16, n), 0, 2 * n));
        let mean = v.iter().sum::<f32>() / n as f32;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n as f32;
        assert!(mean.abs() < 0.06, "{mean}");
        assert!((0.9..1.1).contains(&var.sqrt()), "{var}");
        assert!(v.iter().all(|x| x.is_finite() && x.abs() < 6.0));
    }

    #[test]
    fn chunks_match_the_whole() {
        let t = plan(Fill::Uniform { lo: -1.0, hi: 1.0 }, StDtype::BF16, 1000);
        let whole = fill(&t, 0, 2000);
        assert_eq!(whole, fill(&t, 0, 2000));
        let codes = plan(Fill::Codes(None), StDtype::U32, 1000);
        assert_ne!(fill(&codes, 0, 4000), fill(&codes, 4000, 8000));
    }

    #[test]
    fn delta_net_parameters_are_in_range() {
        let a = fill(
            &plan(Fill::LogUniform { lo: 1.0, hi: 16.0 }, StDtype::F32, 64),
            0,
            256,
        );
        for c in a.chunks_exact(4) {
            let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            assert!((0.0..=16f32.ln()).contains(&v), "{v}");
        }
        let dt = fill(
            &plan(
                Fill::InvSoftplusLogUniform { lo: 1e-3, hi: 0.1 },
                StDtype::BF16,
                64,
            ),
            0,
            128,
        );
        for v in bf16s(&dt) {
            let softplus = (1.0 + v.exp()).ln();
            assert!((0.0009..0.11).contains(&softplus), "{v} -> {softplus}");
        }
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(bf16_bits(1.0), 0x3f80);
        assert_eq!(bf16_bits(-2.0), 0xc000);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
    }
}
