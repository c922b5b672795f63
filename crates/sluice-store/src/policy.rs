//! Eviction policies for the expert cache.
//!
//! MoE routing is skewed and sticky: some experts of a layer are picked far more often than
//! others, for long stretches. Plain LRU forgets that as soon as a burst of rare experts passes
//! through; the frequency-aware policy keeps an exponentially decayed use count per (layer,
//! expert) — also for experts not in the cache — and evicts the cached expert with the lowest
//! count, breaking ties by recency.

/// Which policy picks the victim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Lowest exponentially decayed use count (half-life in accesses), then least recent.
    Frequency,
}

impl std::str::FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(Policy::Lru),
            "lfu" | "frequency" => Ok(Policy::Frequency),
            _ => Err(format!("unknown cache policy `{s}`; use lru or frequency")),
        }
    }
}

/// Use counts of every (layer, expert), decayed over time.
pub(crate) struct Frequencies {
    /// Decayed counts, expressed at `scale_at` (to decay lazily).
    counts: Vec<f64>,
    experts_per_layer: Vec<usize>,
    layer_base: Vec<usize>,
    /// Accesses so far: the clock.
    pub(crate) now: u64,
    /// Multiplier applied per access (0.5 per `half_life` accesses).
    decay: f64,
    /// The unit of stored counts is `growth^now` (counts are stored undecayed, scaled up over time
    /// instead, and renormalised when the scale gets large).
    scale: f64,
}

impl Frequencies {
    /// `half_life`: accesses after which a count has halved.
    pub(crate) fn new(experts_per_layer: &[usize], half_life: f64) -> Self {
        let mut layer_base = Vec::with_capacity(experts_per_layer.len());
        let mut n = 0;
        for &e in experts_per_layer {
            layer_base.push(n);
            n += e;
        }
        Frequencies {
            counts: vec![0.0; n],
            experts_per_layer: experts_per_layer.to_vec(),
            layer_base,
            now: 0,
            decay: 0.5f64.powf(1.0 / half_life.max(1.0)),
            scale: 1.0,
        }
    }

    fn index(&self, layer_slot: usize, expert: usize) -> usize {
        debug_assert!(expert < self.experts_per_layer[layer_slot]);
        self.layer_base[layer_slot] + expert
    }

    /// Records one use.
    pub(crate) fn touch(&mut self, layer_slot: usize, expert: usize) {
        self.now += 1;
        // Instead of decaying every count, grow the weight of new uses.
        self.scale /= self.decay;
        if self.scale > 1e100 {
            for c in &mut self.counts {
                *c /= self.scale;
            }
            self.scale = 1.0;
        }
        let i = self.index(layer_slot, expert);
        self.counts[i] += self.scale;
    }

    /// The decayed count now (in units of one fresh use).
    pub(crate) fn count(&self, layer_slot: usize, expert: usize) -> f64 {
        self.counts[self.index(layer_slot, expert)] / self.scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_decay_with_the_half_life() {
        let mut f = Frequencies::new(&[4, 4], 10.0);
        f.touch(0, 1);
        assert!((f.count(0, 1) - 1.0).abs() < 1e-9);
        for _ in 0..10 {
            f.touch(1, 0);
        }
        assert!((f.count(0, 1) - 0.5).abs() < 1e-9, "{}", f.count(0, 1));
        assert!(f.count(1, 0) > 5.0);
        assert_eq!(f.count(1, 3), 0.0);
    }

    #[test]
    fn renormalisation_keeps_counts() {
        let mut f = Frequencies::new(&[2], 1.0);
        for _ in 0..1000 {
            f.touch(0, 0);
        }
        // Geometric series with ratio 1/2: converges to 2.
        assert!((f.count(0, 0) - 2.0).abs() < 1e-6, "{}", f.count(0, 0));
        assert!(f.count(0, 1) == 0.0);
    }

    #[test]
    fn parses_names() {
        assert_eq!("lru".parse::<Policy>(), Ok(Policy::Lru));
        assert_eq!("frequency".parse::<Policy>(), Ok(Policy::Frequency));
        assert!("mru".parse::<Policy>().is_err());
    }
}
