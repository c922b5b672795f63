//! How an attention cache stores its keys and values: f32, f16 or bf16 per value, or 8- and
//! 4-bit groups with f16 scales (llama.cpp's `--cache-type-k/v q8_0`, and an affine 4-bit form
//! like its `q4_1` and mlx-lm's quantized cache). The rounding here is the definition every
//! backend follows: a backend's cache holds what [`round_trip`] gives.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

/// The storage of one attention cache's keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum KvFormat {
    /// Exact: the values as computed.
    #[default]
    F32,
    /// IEEE half precision per value (2 bytes).
    F16,
    /// bfloat16 per value (2 bytes): f32's range, 8 bits of mantissa.
    Bf16,
    /// Per group of up to 32 values of a head: one f16 scale and the values as `round(x / d)`
    /// in `-127..=127`, `d = max|x| / 127` (llama.cpp's q8_0; 1.0625 bytes per value).
    Q8,
    /// Per group of up to 32 values of a head: an f16 scale and f16 minimum and the values as
    /// `round((x - min) / d)` in `0..=15`, `d = (max - min) / 15` (0.625 bytes per value).
    Q4,
}

impl KvFormat {
    pub const ALL: [KvFormat; 5] = [
        KvFormat::F32,
        KvFormat::F16,
        KvFormat::Bf16,
        KvFormat::Q8,
        KvFormat::Q4,
    ];

    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::F16 => "f16",
            KvFormat::Bf16 => "bf16",
            KvFormat::Q8 => "q8",
            KvFormat::Q4 => "q4",
        }
    }

    /// Values per scale of the quantized formats for heads of `head_dim` values: 32, or the
    /// largest power of two below it that divides the head (groups never straddle heads).
    pub fn group(head_dim: usize) -> usize {
        if head_dim == 0 {
            return 1;
        }
        32.min(1 << head_dim.trailing_zeros())
    }

    /// Bytes that `values` values of heads of `head_dim` take in this format.
    pub fn bytes(self, values: usize, head_dim: usize) -> usize {
        let groups = values.div_ceil(Self::group(head_dim));
        match self {
            KvFormat::F32 => values * 4,
            KvFormat::F16 | KvFormat::Bf16 => values * 2,
            KvFormat::Q8 => values + groups * 2,
            KvFormat::Q4 => values.div_ceil(2) + groups * 4,
        }
    }

    /// Whether values come back changed.
    pub fn is_lossy(self) -> bool {
        self != KvFormat::F32
    }
}

impl fmt::Display for KvFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f32" => KvFormat::F32,
            "f16" => KvFormat::F16,
            "bf16" => KvFormat::Bf16,
            "q8" | "q8_0" | "8" => KvFormat::Q8,
            "q4" | "q4_1" | "4" => KvFormat::Q4,
            _ => {
                return Err(format!(
                    "unknown KV cache format `{s}` (choose f32, f16, bf16, q8 or q4)"
                ))
            }
        })
    }
}

/// One group of [`KvFormat::Q8`]: the values in `q`, the f16 scale returned.
pub fn quantize_q8(x: &[f32], q: &mut [i8]) -> f16 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
    }
    f16::from_f32(d)
}

/// One group of [`KvFormat::Q4`]: value `i` in the low (even `i`) or high (odd) half of
/// `q[i / 2]`; the f16 scale and minimum returned.
pub fn quantize_q4(x: &[f32], q: &mut [u8]) -> (f16, f16) {
    let (lo, hi) = x
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(l, h), &v| {
            (l.min(v), h.max(v))
        });
    let min = f16::from_f32(lo);
    // The codes count up from the minimum as stored, so that 0 dequantises to it exactly.
    let base = min.to_f32();
    let d = (hi - base).max(0.0) / 15.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    q.iter_mut().for_each(|b| *b = 0);
    for (i, v) in x.iter().enumerate() {
        let c = ((v - base) * inv).round().clamp(0.0, 15.0) as u8;
        q[i / 2] |= c << (4 * (i % 2));
    }
    (f16::from_f32(d), min)
}

/// `x` (whole heads of `head_dim` values) replaced by what a cache in `format` gives back.
pub fn round_trip(format: KvFormat, x: &mut [f32], head_dim: usize) {
    let group = KvFormat::group(head_dim);
    match format {
        KvFormat::F32 => {}
        KvFormat::F16 => x.iter_mut().for_each(|v| *v = f16::from_f32(*v).to_f32()),
        KvFormat::Bf16 => x.iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32()),
        KvFormat::Q8 => {
            let mut q = vec![0i8; group];
            for g in x.chunks_mut(group) {
                let d = quantize_q8(g, &mut q).to_f32();
                for (v, q) in g.iter_mut().zip(&q) {
                    *v = *q as f32 * d;
                }
            }
        }
        KvFormat::Q4 => {
            let mut q = vec![0u8; group.div_ceil(2)];
            for g in x.chunks_mut(group) {
                let (d, min) = quantize_q4(g, &mut q);
                let (d, min) = (d.to_f32(), min.to_f32());
                for (i, v) in g.iter_mut().enumerate() {
                    *v = ((q[i / 2] >> (4 * (i % 2))) & 15) as f32 * d + min;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for f in KvFormat::ALL {
            assert_eq!(f.name().parse::<KvFormat>().unwrap(), f);
        }
        let err = "q3".parse::<KvFormat>().unwrap_err();
        assert!(err.contains("f32, f16, bf16, q8 or q4"), "{err}");
    }

    #[test]
    fn groups_and_bytes() {
        assert_eq!(KvFormat::group(128), 32);
        assert_eq!(KvFormat::group(48), 16);
        assert_eq!(KvFormat::group(576), 32);
        assert_eq!(KvFormat::Q8.bytes(128, 128), 128 + 8);
        assert_eq!(KvFormat::Q4.bytes(128, 128), 64 + 16);
        assert_eq!(KvFormat::F16.bytes(128, 128), 256);
    }

    #[test]
    fn round_trips_stay_within_half_a_step() {
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        for (format, rel) in [
            (KvFormat::F16, 1e-3),
            (KvFormat::Bf16, 8e-3),
            (KvFormat::Q8, 1.0 / 127.0),
            (KvFormat::Q4, 1.0 / 15.0),
        ] {
            let mut y = x.clone();
            round_trip(format, &mut y, 64);
            for (g, h) in x.chunks(32).zip(y.chunks(32)) {
                let range = g.iter().fold(0f32, |m, v| m.max(v.abs())) * 2.0;
                for (a, b) in g.iter().zip(h) {
                    assert!(
                        (a - b).abs() <= range * rel * 0.51 + 1e-3 * a.abs(),
                        "{format}: {a} came back as {b}"
                    );
                }
            }
            assert_ne!(x, y, "{format} is lossy on these values");
        }
        // Constant groups and zeros come back exactly.
        for format in [KvFormat::Q8, KvFormat::Q4] {
            let mut y = vec![0.0; 64];
            round_trip(format, &mut y, 64);
            assert!(y.iter().all(|v| *v == 0.0), "{format}");
        }
    }
}
