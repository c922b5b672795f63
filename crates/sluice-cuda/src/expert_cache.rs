//! The VRAM tier of streamed experts: a fixed number of slots, each one expert's three
//! projections, in one device allocation. [`SlotTable`] is its bookkeeping (which expert each
//! slot holds, which slots a call is using, which to evict), kept apart from device memory so
//! that it is tested without a GPU.
//!
//! Eviction is frequency-aware, as in the expert store: every use of an expert (held or not)
//! adds to an exponentially decayed count, the victim is the unused slot with the lowest count
//! (then the least recent), and an expert whose count is below the victim's is uploaded for its
//! call only instead of evicting a more useful one.

use std::collections::HashMap;
use std::sync::Arc;

use sluice_backend::ExpertKey;

/// What [`SlotTable::claim`] decided for an expert that is not held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Upload it into `slot`, which held `evicted` (if anything).
    Slot {
        slot: usize,
        evicted: Option<ExpertKey>,
    },
    /// Upload it for this call only: every slot is in use, or each unused one holds an expert
    /// used more often.
    Bypass,
}

/// A hold on a slot: the slot is not reassigned while any clone lives.
pub(crate) type SlotHold = Arc<()>;

pub(crate) struct SlotTable {
    keys: Vec<Option<ExpertKey>>,
    holds: Vec<SlotHold>,
    last_use: Vec<u64>,
    index: HashMap<ExpertKey, usize>,
    /// Use counts, stored in units that grow by `1 / decay` per use (so that old uses count for
    /// less without touching every count).
    counts: HashMap<ExpertKey, f64>,
    scale: f64,
    decay: f64,
    clock: u64,
}

impl SlotTable {
    pub(crate) fn new(slots: usize) -> SlotTable {
        // Counts halve over about the cache's worth of uses (as in the expert store).
        let half_life = (slots as f64).max(64.0);
        SlotTable {
            keys: vec![None; slots],
            holds: (0..slots).map(|_| Arc::new(())).collect(),
            last_use: vec![0; slots],
            index: HashMap::new(),
            counts: HashMap::new(),
            scale: 1.0,
            decay: 0.5f64.powf(1.0 / half_life),
            clock: 0,
        }
    }

    /// Counts one use of `key`.
    pub(crate) fn touch(&mut self, key: ExpertKey) {
        self.clock += 1;
        self.scale /= self.decay;
        if self.scale > 1e100 {
            for c in self.counts.values_mut() {
                *c /= self.scale;
            }
            self.scale = 1.0;
        }
        *self.counts.entry(key).or_insert(0.0) += self.scale;
    }

    fn count(&self, key: ExpertKey) -> f64 {
        self.counts.get(&key).copied().unwrap_or(0.0) / self.scale
    }

    /// The slot holding `key`, held for the caller (call [`SlotTable::touch`] for the use).
    pub(crate) fn lookup(&mut self, key: ExpertKey) -> Option<(usize, SlotHold)> {
        let slot = *self.index.get(&key)?;
        self.last_use[slot] = self.clock;
        Some((slot, self.holds[slot].clone()))
    }

    /// Whether a slot holds `key` (nothing counted).
    pub(crate) fn holds(&self, key: ExpertKey) -> bool {
        self.index.contains_key(&key)
    }

    fn in_use(&self, slot: usize) -> bool {
        Arc::strong_count(&self.holds[slot]) > 1
    }

    /// Where to upload `key`, which no slot holds: an empty slot, else the unused slot with the
    /// lowest count (then least recent) if that count is not above `key`'s. The slot is assigned
    /// to `key` at once (its old expert forgotten).
    pub(crate) fn claim(&mut self, key: ExpertKey) -> Claim {
        debug_assert!(!self.index.contains_key(&key), "claim of a held expert");
        let mut best: Option<(usize, f64, u64)> = None;
        for slot in 0..self.keys.len() {
            if self.in_use(slot) {
                continue;
            }
            let Some(held) = self.keys[slot] else {
                best = Some((slot, f64::NEG_INFINITY, 0));
                break;
            };
            let c = (self.count(held), self.last_use[slot]);
            if best.is_none_or(|(_, bc, bl)| c.0 < bc || (c.0 == bc && c.1 < bl)) {
                best = Some((slot, c.0, c.1));
            }
        }
        let Some((slot, victim_count, _)) = best else {
            return Claim::Bypass;
        };
        if victim_count > self.count(key) {
            return Claim::Bypass;
        }
        let evicted = self.keys[slot].take();
        if let Some(old) = evicted {
            self.index.remove(&old);
        }
        self.keys[slot] = Some(key);
        self.index.insert(key, slot);
        self.last_use[slot] = self.clock;
        Claim::Slot { slot, evicted }
    }

    /// A hold on `slot` (just claimed).
    pub(crate) fn hold(&self, slot: usize) -> SlotHold {
        self.holds[slot].clone()
    }

    /// Forgets what `slot` holds (its upload failed).
    pub(crate) fn clear(&mut self, slot: usize) {
        if let Some(old) = self.keys[slot].take() {
            self.index.remove(&old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(layer: usize, expert: u32) -> ExpertKey {
        ExpertKey { layer, expert }
    }

    /// A use as the backend makes it: touched, then found or claimed.
    fn use_expert(t: &mut SlotTable, k: ExpertKey) -> (Option<SlotHold>, Claim) {
        t.touch(k);
        if let Some((slot, hold)) = t.lookup(k) {
            return (
                Some(hold),
                Claim::Slot {
                    slot,
                    evicted: Some(k),
                },
            );
        }
        match t.claim(k) {
            c @ Claim::Slot { slot, .. } => (Some(t.hold(slot)), c),
            Claim::Bypass => (None, Claim::Bypass),
        }
    }

    #[test]
    fn fills_empty_slots_then_finds_them() {
        let mut t = SlotTable::new(3);
        for e in 0..3 {
            let (_, c) = use_expert(&mut t, key(0, e));
            assert_eq!(
                c,
                Claim::Slot {
                    slot: e as usize,
                    evicted: None
                }
            );
        }
        for e in 0..3 {
            assert_eq!(t.lookup(key(0, e)).map(|h| h.0), Some(e as usize));
        }
        assert!(t.lookup(key(1, 0)).is_none());
    }

    #[test]
    fn evicts_the_least_used_and_keeps_the_popular() {
        let mut t = SlotTable::new(2);
        // Expert 0 is used often, expert 1 once.
        for _ in 0..5 {
            use_expert(&mut t, key(0, 0));
        }
        use_expert(&mut t, key(0, 1));
        // A newcomer used twice replaces expert 1, never expert 0.
        t.touch(key(0, 2));
        let (_, c) = use_expert(&mut t, key(0, 2));
        assert_eq!(
            c,
            Claim::Slot {
                slot: 1,
                evicted: Some(key(0, 1))
            }
        );
        assert!(t.lookup(key(0, 0)).is_some());
        assert!(t.lookup(key(0, 1)).is_none());
    }

    #[test]
    fn a_rare_expert_does_not_evict_a_popular_one() {
        let mut t = SlotTable::new(1);
        for _ in 0..4 {
            use_expert(&mut t, key(3, 7));
        }
        let (hold, c) = use_expert(&mut t, key(3, 8));
        assert_eq!(c, Claim::Bypass);
        assert!(hold.is_none());
        assert!(t.lookup(key(3, 7)).is_some());
        // Once it is used more than the holder (whose count decays), it gets the slot.
        let mut got = None;
        for _ in 0..10 {
            if let (_, Claim::Slot { evicted, .. }) = use_expert(&mut t, key(3, 8)) {
                got = evicted;
                break;
            }
        }
        assert_eq!(got, Some(key(3, 7)));
    }

    #[test]
    fn slots_in_use_are_never_reassigned() {
        let mut t = SlotTable::new(2);
        let (a, _) = use_expert(&mut t, key(0, 0));
        let (b, _) = use_expert(&mut t, key(0, 1));
        // Both held by the call: a third expert must bypass, even though it is used more.
        for _ in 0..5 {
            t.touch(key(0, 2));
        }
        assert_eq!(t.claim(key(0, 2)), Claim::Bypass);
        drop(a);
        assert_eq!(
            t.claim(key(0, 2)),
            Claim::Slot {
                slot: 0,
                evicted: Some(key(0, 0))
            }
        );
        drop(b);
        assert_eq!(t.claim(key(0, 3)), Claim::Bypass, "expert 3 was never used");
    }

    #[test]
    fn equal_counts_evict_the_least_recent() {
        let mut t = SlotTable::new(2);
        t.claim(key(0, 0));
        t.claim(key(0, 1));
        t.touch(key(9, 9)); // the clock moves; neither expert's count does
        t.lookup(key(0, 0));
        assert_eq!(
            t.claim(key(0, 2)),
            Claim::Slot {
                slot: 1,
                evicted: Some(key(0, 1))
            }
        );
        // An expert never used does not evict one that was.
        let mut u = SlotTable::new(1);
        use_expert(&mut u, key(0, 0));
        assert_eq!(u.claim(key(0, 3)), Claim::Bypass);
    }

    #[test]
    fn a_cleared_slot_is_empty_again() {
        let mut t = SlotTable::new(1);
        use_expert(&mut t, key(0, 0));
        t.clear(0);
        assert!(t.lookup(key(0, 0)).is_none());
        assert_eq!(
            t.claim(key(0, 1)),
            Claim::Slot {
                slot: 0,
                evicted: None
            }
        );
    }
}
