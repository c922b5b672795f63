//! Rotary position embeddings: which part of each head turns, and at what frequencies.

/// Rotary embedding of attention heads (rotate-half form): the first `rotary_dim` values of each
/// head of `head_dim` turn, pair `(i, i + rotary_dim / 2)` at the angle `position *
/// inv_freq[i]` ([`Rope::inv_freq`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rope {
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub theta: f32,
    /// YaRN's frequency interpolation (`rope_scaling.type: yarn`); `None`: plain `theta`.
    pub yarn: Option<Yarn>,
}

/// YaRN (Peng et al. 2023) as transformers and mlx-lm compute its frequencies: dimensions that
/// turn more than `beta_fast` times within `original_max_position` keep their frequency, those
/// that turn fewer than `beta_slow` times are divided by `factor`, and a linear ramp blends the
/// ones between. The attention temperature YaRN adds (its `mscale`) is not here: models fold it
/// into their attention scale or their rotated values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub original_max_position: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// Round the ramp's ends to whole dimensions (transformers' `truncate`, default true;
    /// mlx-lm always does).
    pub truncate: bool,
}

impl Rope {
    /// Plain rotary embedding at base `theta`.
    pub fn new(head_dim: usize, rotary_dim: usize, theta: f32) -> Self {
        Rope {
            head_dim,
            rotary_dim,
            theta,
            yarn: None,
        }
    }

    /// The `rotary_dim / 2` angular frequencies, in f32 as mlx and transformers compute them:
    /// `theta^(-2i/d)`, then YaRN's blend where set.
    pub fn inv_freq(&self) -> Vec<f32> {
        let d = self.rotary_dim;
        let plain = (0..d / 2).map(|i| 1.0 / self.theta.powf((2 * i) as f32 / d as f32));
        let Some(y) = self.yarn else {
            return plain.collect();
        };
        // The dimension that turns `turns` times over the original context.
        let dim_of = |turns: f32| {
            let orig = y.original_max_position as f64;
            d as f64 * (orig / (turns as f64 * 2.0 * std::f64::consts::PI)).ln()
                / (2.0 * (self.theta as f64).ln())
        };
        let (mut low, mut high) = (dim_of(y.beta_fast), dim_of(y.beta_slow));
        if y.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0) as f32, high.min(d as f64 - 1.0) as f32);
        if low == high {
            high += 0.001; // as both references do, against a division by zero
        }
        plain
            .enumerate()
            .map(|(i, extrapolated)| {
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let interpolated = extrapolated / y.factor;
                interpolated * ramp + extrapolated * (1.0 - ramp)
            })
            .collect()
    }

    /// A key that tells apart every distinct set of frequencies (for caches of them).
    pub fn freq_key(&self) -> (usize, u32, Option<[u32; 5]>) {
        let yarn = self.yarn.map(|y| {
            [
                y.factor.to_bits(),
                y.original_max_position as u32,
                y.beta_fast.to_bits(),
                y.beta_slow.to_bits(),
                y.truncate as u32,
            ]
        });
        (self.rotary_dim, self.theta.to_bits(), yarn)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSeek-V3's published rope_scaling (factor 40, 4096 positions, beta 32/1) on its 64
    /// rotated dims: the first dims keep theta's frequency, the last are divided by 40, and the
    /// values in between move monotonically from one to the other.
    #[test]
    fn yarn_blends_from_extrapolation_to_interpolation() {
        let plain = Rope::new(64, 64, 10_000.0);
        let yarn = Rope {
            yarn: Some(Yarn {
                factor: 40.0,
                original_max_position: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
            }),
            ..plain
        };
        let (p, y) = (plain.inv_freq(), yarn.inv_freq());
        assert_eq!(p.len(), 32);
        // low = floor(64 ln(4096 / (64 pi)) / (2 ln 1e4)) = 10, high = ceil(...beta 1...) = 23.
        assert_eq!(&y[..11], &p[..11]);
        for i in 23..32 {
            assert_eq!(y[i], p[i] / 40.0, "dim {i}");
        }
        for i in 11..23 {
            let r = (i as f32 - 10.0) / 13.0;
            let want = p[i] / 40.0 * r + p[i] * (1.0 - r);
            assert!(
                (y[i] - want).abs() <= 1e-7 * p[i],
                "dim {i}: {} vs {want}",
                y[i]
            );
            assert!(y[i] < p[i] && y[i] > p[i] / 40.0);
        }
        assert_ne!(plain.freq_key(), yarn.freq_key());
    }
}
