//! Experts read in place: a model whose experts all fit the expert store's page-locked host
//! cache keeps them there, and the kernels read each expert where it is: from a VRAM slot when
//! the VRAM tier holds it, else from host memory over the link (mapped into the device's address
//! space). A layer's experts are reached through its device table of `ExpertMats`, one entry
//! per expert, so the routing stays on the device: no read back, no host decision, no copy per
//! layer, and a forward pass replays as one graph like a resident model's.
//!
//! Which experts get the slots: the kernels count each routed expert on the device; every
//! [`REBALANCE_EVERY`] forward passes the host reads the counts, folds them into decayed scores
//! ([`Placement`]) and moves the hottest experts into slots (a bounded number per rebalance),
//! re-pointing their table entries. Copies and table writes run on the backend's one stream, so
//! a slot is overwritten only after every launch that may still read it, and a table entry
//! changes between launches, never under one.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use cudarc::driver::CudaEvent;
use sluice_backend::{BackendError, ExpertCacheStats, HostExpert};

use crate::device::{grid, Arg, DevBuf, Device};
use crate::mat::ExpertMats;
use crate::vram_experts::{block_span, slot_layout, upload_block, upload_into};

/// Forward passes between two reads of the counts.
pub(crate) const REBALANCE_EVERY: u64 = 8;
/// Each rebalance multiplies the scores by this (a half-life of 8 rebalances, 64 passes).
const DECAY: f64 = 0.917;
/// An expert takes an occupied slot only when its score beats the occupant's by this factor
/// (and by one routing): no swaps back and forth between experts used about as often.
const SWAP_MARGIN: f64 = 1.25;
/// Bytes copied into slots per rebalance while slots are free (filling the cache) ...
const FILL_BYTES: u64 = 1 << 30;
/// ... and when every slot is taken (replacing experts): ~1.2 ms of a PCIe 5 link per
/// `REBALANCE_EVERY` passes.
const SWAP_BYTES: u64 = 64 << 20;

/// An expert of a registered layer: (registry index of the layer, expert id).
pub(crate) type Key = (usize, u32);

/// One change of the VRAM tier: `admitted` goes into `slot`, replacing `evicted`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Move {
    pub slot: usize,
    pub evicted: Option<Key>,
    pub admitted: Key,
}

/// Which expert each VRAM slot holds, and every expert's decayed use count.
pub(crate) struct Placement {
    slots: Vec<Option<Key>>,
    slot_of: HashMap<Key, usize>,
    score: HashMap<Key, f64>,
}

impl Placement {
    pub fn new(slots: usize) -> Placement {
        Placement {
            slots: vec![None; slots],
            slot_of: HashMap::new(),
            score: HashMap::new(),
        }
    }

    pub fn slot_of(&self, key: Key) -> Option<usize> {
        self.slot_of.get(&key).copied()
    }

    /// Ages every score by `factor` (forgetting those that fall to nothing).
    pub fn decay(&mut self, factor: f64) {
        self.score.retain(|_, s| {
            *s *= factor;
            *s >= 1e-3
        });
    }

    /// Counts `uses` of `key` since the last rebalance.
    pub fn observe(&mut self, key: Key, uses: u32) {
        *self.score.entry(key).or_default() += uses as f64;
    }

    fn score(&self, key: Key) -> f64 {
        self.score.get(&key).copied().unwrap_or(0.0)
    }

    /// The moves toward holding the highest scores: free slots to the hottest experts not held
    /// (at most `max_fills`), then occupied slots from the coldest occupants to hotter experts
    /// by [`SWAP_MARGIN`] (at most `max_swaps`). The moves are applied here; the caller copies.
    pub fn plan(&mut self, max_fills: usize, max_swaps: usize) -> Vec<Move> {
        let mut wanted: Vec<(Key, f64)> = self
            .score
            .iter()
            .filter(|(k, &s)| s > 0.0 && !self.slot_of.contains_key(k))
            .map(|(&k, &s)| (k, s))
            .collect();
        // Hottest first; ties to the lower key, so that a plan does not depend on hash order.
        wanted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut wanted = wanted.into_iter().peekable();
        let mut moves = Vec::new();
        let free: Vec<usize> = (0..self.slots.len())
            .filter(|&s| self.slots[s].is_none())
            .collect();
        for slot in free.into_iter().take(max_fills) {
            let Some((admitted, _)) = wanted.next() else {
                break;
            };
            moves.push(Move {
                slot,
                evicted: None,
                admitted,
            });
        }
        let mut victims: Vec<(usize, Key, f64)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(s, k)| k.map(|k| (s, k, self.score(k))))
            .collect();
        victims.sort_by(|a, b| a.2.total_cmp(&b.2).then(a.1.cmp(&b.1)));
        for (slot, victim, cold) in victims.into_iter().take(max_swaps) {
            match wanted.peek() {
                Some(&(admitted, hot)) if hot > cold * SWAP_MARGIN + 1.0 => {
                    wanted.next();
                    moves.push(Move {
                        slot,
                        evicted: Some(victim),
                        admitted,
                    });
                }
                _ => break,
            }
        }
        for m in &moves {
            if let Some(e) = m.evicted {
                self.slot_of.remove(&e);
            }
            self.slots[m.slot] = Some(m.admitted);
            self.slot_of.insert(m.admitted, m.slot);
        }
        moves
    }

    /// Empties `slot` (its copy failed, or its layer is gone).
    pub fn clear(&mut self, slot: usize) {
        if let Some(k) = self.slots[slot].take() {
            self.slot_of.remove(&k);
        }
    }

    /// Forgets every expert of registry layer `layer` (a model dropped).
    pub fn forget_layer(&mut self, layer: usize) {
        for s in 0..self.slots.len() {
            if self.slots[s].is_some_and(|k| k.0 == layer) {
                self.clear(s);
            }
        }
        self.score.retain(|k, _| k.0 != layer);
    }
}

/// One layer's experts in host memory, as the device reads them.
pub(crate) struct InPlaceLayer {
    /// Index in [`InPlace::layers`].
    id: usize,
    /// The store's experts, held (and page-locked) while this lives.
    host: Vec<HostExpert>,
    /// Each expert's table entry pointing into host memory.
    in_host: Vec<ExpertMats>,
    /// The entries the kernels read: `in_host`, or a slot's.
    pub table: DevBuf,
}

impl InPlaceLayer {
    fn expert_bytes(&self, e: usize) -> u64 {
        let h = &self.host[e];
        [&h.gate, &h.up, &h.down]
            .iter()
            .map(|m| (m.data.len() + m.scales.len() + m.biases.len()) as u64)
            .sum()
    }
}

/// Every registered layer, the slots, and the counters.
#[derive(Default)]
pub(crate) struct InPlace {
    layers: Vec<Weak<InPlaceLayer>>,
    tier: Option<Tier>,
    stats: ExpertCacheStats,
}

/// The VRAM slots over the registered layers (from [`InPlace::plan`] on).
struct Tier {
    slots: Option<DevBuf>,
    slot_bytes: usize,
    placement: Placement,
    /// One counter per expert of every layer registered at planning, layer `i` from
    /// `offsets[i]`.
    counts: DevBuf,
    counters: usize,
    offsets: Vec<usize>,
    /// Forward passes since planning (counted at the first live layer).
    passes: u64,
    /// Copy timings and table words not yet known finished (until the next rebalance's sync).
    timing: Vec<(CudaEvent, CudaEvent)>,
    words: Vec<Vec<u8>>,
}

/// The bytes of table entry `e`.
fn entry_bytes(m: &ExpertMats) -> Vec<u8> {
    let mut words = Vec::with_capacity(ExpertMats::WORDS);
    m.push_words(&mut words);
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

impl InPlace {
    pub fn is_empty(&self) -> bool {
        self.layers.iter().all(|l| l.strong_count() == 0)
    }

    /// Registers a layer whose table (`table`, holding `in_host`) is already on the device.
    pub fn register(
        &mut self,
        host: Vec<HostExpert>,
        in_host: Vec<ExpertMats>,
        table: DevBuf,
    ) -> Arc<InPlaceLayer> {
        let layer = Arc::new(InPlaceLayer {
            id: self.layers.len(),
            host,
            in_host,
            table,
        });
        self.layers.push(Arc::downgrade(&layer));
        layer
    }

    /// Sets up `slots` VRAM slots of `slot_bytes` (replacing an earlier tier) and the counters.
    pub fn plan(
        &mut self,
        d: &Device,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<(), BackendError> {
        if let Some(old) = self.tier.take() {
            // Point every table back at host memory before the slots go.
            for k in old.placement.slots.iter().flatten() {
                self.point_at_host(d, *k, &mut Vec::new())?;
            }
        }
        let mut offsets = Vec::with_capacity(self.layers.len());
        let mut total = 0;
        for l in &self.layers {
            offsets.push(total);
            total += l.upgrade().map_or(0, |l| l.in_host.len());
        }
        let counts = d.alloc(total.max(1) * 4, "expert counters")?;
        d.zero(&counts);
        let slots_mem = match slots {
            0 => None,
            n => Some(d.alloc(n * slot_bytes, "the VRAM expert cache")?),
        };
        self.tier = Some(Tier {
            slots: slots_mem,
            slot_bytes,
            placement: Placement::new(slots),
            counts,
            counters: total,
            offsets,
            passes: 0,
            timing: Vec::new(),
            words: Vec::new(),
        });
        Ok(())
    }

    fn point_at_host(
        &self,
        d: &Device,
        k: Key,
        keep: &mut Vec<Vec<u8>>,
    ) -> Result<(), BackendError> {
        if let Some(l) = self.layers.get(k.0).and_then(Weak::upgrade) {
            let e = k.1 as usize;
            let bytes = entry_bytes(&l.in_host[e]);
            d.copy_to_device(l.table.ptr() + (e * bytes.len()) as u64, &bytes)?;
            keep.push(bytes);
        }
        Ok(())
    }

    /// Before a call of `layer`'s experts routed by `ids` (`n` of them): counts them on the
    /// device, and every [`REBALANCE_EVERY`] forward passes moves experts into slots.
    pub fn before_call(
        &mut self,
        d: &Device,
        layer: &InPlaceLayer,
        ids: u64,
        n: usize,
    ) -> Result<(), BackendError> {
        let first_live = self.layers.iter().position(|l| l.strong_count() > 0);
        let Some(tier) = &mut self.tier else {
            return Ok(());
        };
        let Some(&offset) = tier.offsets.get(layer.id) else {
            // Registered after planning: not counted (it stays in host memory).
            return Ok(());
        };
        if first_live == Some(layer.id) {
            tier.passes += 1;
            if tier.passes.is_multiple_of(REBALANCE_EVERY) {
                self.rebalance(d)?;
            }
        }
        let Some(tier) = &self.tier else {
            return Ok(());
        };
        d.launch(
            &d.k.count_experts,
            (grid(n, 256).min(64), 1, 1),
            (256, 1, 1),
            &[
                Arg::Ptr(ids),
                Arg::I32(n as i32),
                Arg::Ptr(tier.counts.ptr() + offset as u64 * 4),
            ],
        );
        Ok(())
    }

    /// Reads the counts, scores them, and moves the hottest experts into slots.
    fn rebalance(&mut self, d: &Device) -> Result<(), BackendError> {
        let Some(mut tier) = self.tier.take() else {
            return Ok(());
        };
        let result = self.rebalance_with(d, &mut tier);
        self.tier = Some(tier);
        result
    }

    fn rebalance_with(&mut self, d: &Device, tier: &mut Tier) -> Result<(), BackendError> {
        let counts: Vec<u32> = d.download(&tier.counts, tier.counters)?;
        // The download synchronised: earlier copies and table writes are done.
        for (a, b) in tier.timing.drain(..) {
            if let Ok(ms) = a.elapsed_ms(&b) {
                self.stats.upload_secs += ms as f64 / 1e3;
            }
        }
        tier.words.clear();
        d.zero(&tier.counts);
        tier.placement.decay(DECAY);
        let live: Vec<Option<Arc<InPlaceLayer>>> = self.layers.iter().map(Weak::upgrade).collect();
        for (id, l) in live.iter().enumerate() {
            let (Some(l), Some(&offset)) = (l, tier.offsets.get(id)) else {
                tier.placement.forget_layer(id);
                continue;
            };
            for e in 0..l.in_host.len() {
                let uses = counts.get(offset + e).copied().unwrap_or(0);
                if uses == 0 {
                    continue;
                }
                let key = (id, e as u32);
                if tier.placement.slot_of(key).is_some() {
                    self.stats.hits += uses as u64;
                } else {
                    self.stats.read_in_place += uses as u64;
                    self.stats.bytes_read_in_place += uses as u64 * l.expert_bytes(e);
                }
                tier.placement.observe(key, uses);
            }
        }
        let Some(slots) = &tier.slots else {
            return Ok(());
        };
        let per_slot = tier.slot_bytes.max(1) as u64;
        let moves = tier.placement.plan(
            (FILL_BYTES / per_slot).max(1) as usize,
            (SWAP_BYTES / per_slot).max(1) as usize,
        );
        if moves.is_empty() {
            return Ok(());
        }
        let start = d.timing_event();
        for m in moves {
            if let Some(evicted) = m.evicted {
                // The evicted expert is read from host memory from now on.
                self.point_at_host(d, evicted, &mut tier.words)?;
                self.stats.evictions += 1;
            }
            let Some(l) = live.get(m.admitted.0).cloned().flatten() else {
                tier.placement.clear(m.slot);
                continue;
            };
            let e = m.admitted.1 as usize;
            let host = &l.host[e];
            let base = slots.ptr() + (m.slot * tier.slot_bytes) as u64;
            let (offsets, bytes) = slot_layout(host);
            if bytes > tier.slot_bytes {
                tier.placement.clear(m.slot);
                continue;
            }
            let mats = match block_span(host) {
                Some(span) if span.len() <= tier.slot_bytes => upload_block(d, host, base, span),
                _ => upload_into(d, host, base, &offsets),
            };
            let mats = match mats {
                Ok(m) => m,
                Err(err) => {
                    tier.placement.clear(m.slot);
                    return Err(err);
                }
            };
            let bytes = entry_bytes(&mats);
            d.copy_to_device(l.table.ptr() + (e * bytes.len()) as u64, &bytes)?;
            tier.words.push(bytes);
            let moved = l.expert_bytes(e);
            self.stats.placed += 1;
            self.stats.bytes_uploaded += moved;
            self.stats.bytes_pinned += moved;
        }
        if let (Some(a), Some(b)) = (start, d.timing_event()) {
            tier.timing.push((a, b));
        }
        Ok(())
    }

    pub fn stats(&self) -> ExpertCacheStats {
        self.stats.clone()
    }

    pub fn has_tier(&self) -> bool {
        self.tier.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn placement(slots: usize, uses: &[(Key, u32)]) -> Placement {
        let mut p = Placement::new(slots);
        for &(k, n) in uses {
            p.observe(k, n);
        }
        p
    }

    #[test]
    fn free_slots_go_to_the_most_used_experts() {
        let mut p = placement(2, &[((0, 1), 3), ((0, 2), 9), ((1, 0), 5), ((1, 1), 0)]);
        let moves = p.plan(8, 8);
        assert_eq!(
            moves,
            vec![
                Move {
                    slot: 0,
                    evicted: None,
                    admitted: (0, 2)
                },
                Move {
                    slot: 1,
                    evicted: None,
                    admitted: (1, 0)
                },
            ]
        );
        assert_eq!(p.slot_of((0, 2)), Some(0));
        assert_eq!(p.slot_of((0, 1)), None);
        // Nothing hotter than what is held: no more moves.
        assert!(p.plan(8, 8).is_empty());
    }

    #[test]
    fn an_occupant_goes_only_for_a_clearly_hotter_expert() {
        let mut p = placement(1, &[((0, 0), 10)]);
        p.plan(1, 1);
        // About as hot: stays.
        p.observe((0, 1), 12);
        assert!(p.plan(1, 1).is_empty());
        // Far hotter: swapped in, the occupant evicted.
        p.observe((0, 1), 20);
        assert_eq!(
            p.plan(1, 1),
            vec![Move {
                slot: 0,
                evicted: Some((0, 0)),
                admitted: (0, 1)
            }]
        );
        assert_eq!(p.slot_of((0, 0)), None);
    }

    #[test]
    fn moves_per_rebalance_are_bounded() {
        let uses: Vec<(Key, u32)> = (0..10).map(|e| ((0, e), 10 + e)).collect();
        let mut p = placement(4, &uses);
        assert_eq!(p.plan(3, 0).len(), 3);
        // The fourth free slot, then no swaps allowed.
        assert_eq!(p.plan(1, 0).len(), 1);
        assert!(p.plan(0, 0).is_empty());
        // Experts 0..3 turn far hotter than the held 6..9: at most `max_swaps` per plan.
        for e in 0..3 {
            p.observe((0, e), 1000);
        }
        let swaps = p.plan(0, 2);
        assert_eq!(swaps.len(), 2);
        assert!(swaps.iter().all(|m| m.evicted.is_some() && m.admitted.1 < 3));
        // The coldest occupants went first.
        let evicted: Vec<u32> = swaps.iter().map(|m| m.evicted.unwrap().1).collect();
        assert_eq!(evicted, vec![6, 7]);
        assert_eq!(p.plan(0, 2).len(), 1, "the third hot expert");
    }

    #[test]
    fn scores_fade_and_a_dropped_layer_frees_its_slots() {
        let mut p = placement(2, &[((0, 0), 4), ((1, 0), 4)]);
        p.plan(2, 0);
        for _ in 0..200 {
            p.decay(DECAY);
        }
        assert_eq!(p.score((0, 0)), 0.0, "faded to nothing");
        p.forget_layer(1);
        assert_eq!(p.slot_of((1, 0)), None);
        assert!(p.slot_of((0, 0)).is_some());
        // The freed slot is filled again.
        p.observe((2, 5), 1);
        assert_eq!(p.plan(2, 0).len(), 1);
    }
}
