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
//!
//! Prompts are different: a call of many tokens routes most of a layer's experts, and the
//! grouped kernels would read each one in place once per tile of its pairs, in small reads
//! across the link. Such a call instead copies the routed experts that no slot holds into a few
//! staging slots kept for it, in bulk at the link's speed, and runs on those copies
//! ([`InPlace::stage`]), in runs of ascending expert ids when they do not all fit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use cudarc::driver::CudaEvent;
use sluice_backend::{BackendError, ExpertCacheStats, HostExpert};

use crate::device::{grid, Arg, DevBuf, Device, Lane};
use crate::host_compute::HostTally;
use crate::mat::ExpertMats;
use crate::vram_experts::{slot_layout, upload_expert};

/// The tier's knobs: defaults measured on an H100 (Qwen3-30B-A3B shape, 8 GiB budget, see
/// `Knobs::parse`);
/// `SLUICE_CUDA_PLACE=EVERY,MB,HALF_LIFE` overrides them for experiments.
#[derive(Debug, Clone, Copy)]
struct Knobs {
    /// Forward passes between two reads of the counts.
    every: u64,
    /// Bytes evicted (and so, a rebalance later, copied in) per rebalance once every slot is
    /// taken; while slots are free, [`FILL_BYTES`] are copied in.
    swap_bytes: u64,
    /// Rebalances over which a score halves.
    half_life: f64,
}

impl Knobs {
    fn get() -> Knobs {
        Knobs::parse(std::env::var("SLUICE_CUDA_PLACE").ok().as_deref())
    }

    fn parse(v: Option<&str>) -> Knobs {
        // Measured (q30 shape, 8 GiB, tg64 after a tg256, one run each): every pass with 256 MB
        // and a half-life of 4 passes 123.96 tok/s, 512 MB / 8 passes 122.57, 128 MB / 16
        // passes 119.98, every 2 passes 112.80; before, every 8 passes with 64 MB copied on the
        // compute stream: 107.79.
        let default = Knobs {
            every: 1,
            swap_bytes: 256 << 20,
            half_life: 8.0,
        };
        let Some(v) = v else {
            return default;
        };
        let parts: Vec<f64> = v.split(',').filter_map(|p| p.trim().parse().ok()).collect();
        match parts.as_slice() {
            [every, mb, half_life] if *every >= 1.0 && *mb >= 0.0 && *half_life > 0.0 => Knobs {
                every: *every as u64,
                swap_bytes: (*mb * (1u64 << 20) as f64) as u64,
                half_life: *half_life,
            },
            _ => default,
        }
    }
}

/// Bytes copied into free slots per rebalance (filling the cache).
const FILL_BYTES: u64 = 1 << 30;
/// An expert displaces a slot's occupant only when its score beats the occupant's by this
/// factor (and by one routing): no swaps back and forth between experts used about as often.
const SWAP_MARGIN: f64 = 1.25;

/// An expert of a registered layer: (registry index of the layer, expert id).
pub(crate) type Key = (usize, u32);

/// What a VRAM slot is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotState {
    Free,
    /// Its expert's table entry points back at host memory; launches issued before that may
    /// still read the slot.
    Draining,
    /// An expert is being copied in; its table entry still points at host memory.
    Loading(Key),
    /// Its expert's table entry points here.
    Held(Key),
}

/// A rebalance's changes ([`Placement::plan`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    /// Free slots to copy these experts into.
    pub fills: Vec<(usize, Key)>,
    /// Held experts to read from host memory again, their slots draining.
    pub evictions: Vec<(usize, Key)>,
}

/// Which expert each VRAM slot holds, and every expert's decayed use count.
pub(crate) struct Placement {
    slots: Vec<SlotState>,
    slot_of: HashMap<Key, usize>,
    score: HashMap<Key, f64>,
}

impl Placement {
    pub fn new(slots: usize) -> Placement {
        Placement {
            slots: vec![SlotState::Free; slots],
            slot_of: HashMap::new(),
            score: HashMap::new(),
        }
    }

    /// Whether `key`'s table entry points at a slot.
    pub fn held(&self, key: Key) -> bool {
        self.slot_of
            .get(&key)
            .is_some_and(|&s| self.slots[s] == SlotState::Held(key))
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

    /// Free slots to the hottest experts in no slot (at most `max_fills`); then, for the next
    /// hottest, the coldest held experts out, when the newcomer's score beats theirs by
    /// [`SWAP_MARGIN`] (at most `max_evictions`: their slots are filled once drained). The
    /// states change here; the caller copies, and reports back with [`Placement::loaded`] and
    /// [`Placement::drained`].
    pub fn plan(&mut self, max_fills: usize, max_evictions: usize) -> Plan {
        let mut wanted: Vec<(Key, f64)> = self
            .score
            .iter()
            .filter(|(k, &s)| s > 0.0 && !self.slot_of.contains_key(k))
            .map(|(&k, &s)| (k, s))
            .collect();
        // Hottest first; ties to the lower key, so that a plan does not depend on hash order.
        // Only the first `max_fills + max_evictions` can be used: sort just those (this runs
        // every pass over thousands of experts, with the GPU waiting).
        let hotter = |a: &(Key, f64), b: &(Key, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let take = (max_fills + max_evictions).min(wanted.len());
        if take > 0 && take < wanted.len() {
            wanted.select_nth_unstable_by(take - 1, hotter);
            wanted.truncate(take);
        }
        wanted.sort_by(hotter);
        let mut wanted = wanted.into_iter().peekable();
        let mut plan = Plan::default();
        let free: Vec<usize> = (0..self.slots.len())
            .filter(|&s| self.slots[s] == SlotState::Free)
            .take(max_fills)
            .collect();
        for slot in free {
            let Some((key, _)) = wanted.next() else {
                break;
            };
            self.slots[slot] = SlotState::Loading(key);
            self.slot_of.insert(key, slot);
            plan.fills.push((slot, key));
        }
        let mut victims: Vec<(usize, Key, f64)> = (0..self.slots.len())
            .filter_map(|s| match self.slots[s] {
                SlotState::Held(k) => Some((s, k, self.score(k))),
                _ => None,
            })
            .collect();
        let colder =
            |a: &(usize, Key, f64), b: &(usize, Key, f64)| a.2.total_cmp(&b.2).then(a.1.cmp(&b.1));
        if max_evictions > 0 && max_evictions < victims.len() {
            victims.select_nth_unstable_by(max_evictions - 1, colder);
            victims.truncate(max_evictions);
        }
        victims.sort_by(colder);
        for (slot, victim, cold) in victims.into_iter().take(max_evictions) {
            match wanted.next() {
                Some((_, hot)) if hot > cold * SWAP_MARGIN + 1.0 => {
                    self.slots[slot] = SlotState::Draining;
                    self.slot_of.remove(&victim);
                    plan.evictions.push((slot, victim));
                }
                _ => break,
            }
        }
        plan
    }

    /// `slot`'s copy has landed and its expert's entry points at it.
    pub fn loaded(&mut self, slot: usize) {
        if let SlotState::Loading(k) = self.slots[slot] {
            self.slots[slot] = SlotState::Held(k);
        }
    }

    /// No launch reads `slot` any more.
    pub fn drained(&mut self, slot: usize) {
        if self.slots[slot] == SlotState::Draining {
            self.slots[slot] = SlotState::Free;
        }
    }

    /// Empties `slot` at once (its copy failed before anything used it).
    pub fn clear(&mut self, slot: usize) {
        if let SlotState::Loading(k) | SlotState::Held(k) = self.slots[slot] {
            self.slot_of.remove(&k);
        }
        self.slots[slot] = SlotState::Free;
    }

    /// Forgets every expert of registry layer `layer` (its model dropped): their slots drain.
    pub fn forget_layer(&mut self, layer: usize) {
        for s in 0..self.slots.len() {
            if let SlotState::Loading(k) | SlotState::Held(k) = self.slots[s] {
                if k.0 == layer {
                    self.slot_of.remove(&k);
                    self.slots[s] = SlotState::Draining;
                }
            }
        }
        self.score.retain(|k, _| k.0 != layer);
    }

    fn draining(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.slots.len()).filter(|&s| self.slots[s] == SlotState::Draining)
    }
}

/// One layer's experts in host memory, as the device reads them.
pub(crate) struct InPlaceLayer {
    /// To wait, when this goes, for launches and copies that may still read its host memory.
    d: Arc<Device>,
    /// Index in [`InPlace::layers`].
    id: usize,
    /// The store's experts, held (and page-locked) while this lives.
    host: Vec<HostExpert>,
    /// Each expert's table entry pointing into host memory.
    in_host: Vec<ExpertMats>,
    /// The entries the kernels read: `in_host`, or a slot's.
    pub table: DevBuf,
}

impl Drop for InPlaceLayer {
    fn drop(&mut self) {
        // The store may free or reuse the memory once `host` goes.
        let _ = self.d.sync_all();
    }
}

impl InPlaceLayer {
    /// Its index among the registered layers.
    pub fn id(&self) -> usize {
        self.id
    }

    /// The experts as the store holds them in host memory.
    pub fn host(&self) -> &[HostExpert] {
        &self.host
    }

    pub fn expert_bytes(&self, e: usize) -> u64 {
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
    /// Routings of experts staged or computed on the host since the last read of the counts
    /// (counted on the device like every routing, but not read in place).
    staged_uses: HashMap<Key, u64>,
    /// Events around each run's staging copies, until timed.
    staged_copies: Vec<(CudaEvent, CudaEvent)>,
    /// Experts the host computed beside the device (`host_compute`), not yet counted.
    host_tally: Option<Arc<Mutex<HostTally>>>,
}

/// The VRAM slots over the registered layers (from [`InPlace::plan`] on).
struct Tier {
    slots: Option<DevBuf>,
    slot_bytes: usize,
    /// Slots of `slot_bytes` for the experts of one call of many tokens ([`InPlace::stage`]).
    staging: Option<DevBuf>,
    staging_slots: usize,
    placement: Placement,
    knobs: Knobs,
    /// One counter per expert of every layer registered at planning, layer `i` from
    /// `offsets[i]`.
    counts: DevBuf,
    counters: usize,
    offsets: Vec<usize>,
    /// Forward passes since planning (counted at the first live layer).
    passes: u64,
    /// Copies into slots in flight on the copy lane: (slot, the expert's entry there, the
    /// batch's index in `batches`).
    loading: Vec<(usize, ExpertMats, usize)>,
    /// Each batch of copies on the copy lane: events before and after it.
    batches: Vec<(CudaEvent, CudaEvent)>,
    /// Table words written, kept until the stream has passed them.
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
        d: &Arc<Device>,
        host: Vec<HostExpert>,
        in_host: Vec<ExpertMats>,
        table: DevBuf,
    ) -> Arc<InPlaceLayer> {
        let layer = Arc::new(InPlaceLayer {
            d: d.clone(),
            id: self.layers.len(),
            host,
            in_host,
            table,
        });
        self.layers.push(Arc::downgrade(&layer));
        layer
    }

    /// How many of `slots` slots to keep for staging prompts' experts: a layer's worth, at most
    /// an eighth of them (the rest cache experts for decoding); none with
    /// `SLUICE_CUDA_STAGE=0`.
    pub fn staging_slots(&self, slots: usize) -> usize {
        if std::env::var("SLUICE_CUDA_STAGE").is_ok_and(|v| v == "0") {
            return 0;
        }
        let per_layer = self
            .layers
            .iter()
            .filter_map(Weak::upgrade)
            .map(|l| l.in_host.len())
            .max()
            .unwrap_or(0);
        per_layer.min(slots / 8)
    }

    /// Sets up `slots` VRAM slots of `slot_bytes` and `staging` staging slots (replacing an
    /// earlier tier) and the counters.
    pub fn plan(
        &mut self,
        d: &Device,
        slots: usize,
        staging: usize,
        slot_bytes: usize,
    ) -> Result<(), BackendError> {
        if let Some(old) = self.tier.take() {
            // Every table back at host memory, and no copy in flight, before the slots go.
            for (_, done) in &old.batches {
                done.synchronize()
                    .map_err(|e| BackendError::Device(format!("CUDA waiting for a copy: {e}")))?;
            }
            let held: Vec<Key> = old
                .placement
                .slots
                .iter()
                .filter_map(|s| match s {
                    SlotState::Held(k) => Some(*k),
                    _ => None,
                })
                .collect();
            let mut keep = Vec::new();
            for k in held {
                self.point_at_host(d, k, &mut keep)?;
            }
            d.sync()?;
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
        let staging_mem = match staging {
            0 => None,
            n => Some(d.alloc(n * slot_bytes, "the staging slots of prompts' experts")?),
        };
        self.tier = Some(Tier {
            slots: slots_mem,
            slot_bytes,
            staging: staging_mem,
            staging_slots: staging,
            placement: Placement::new(slots),
            knobs: Knobs::get(),
            counts,
            counters: total,
            offsets,
            passes: 0,
            loading: Vec::new(),
            batches: Vec::new(),
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
    /// device, and every few forward passes rebalances the slots.
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
            if tier.passes.is_multiple_of(tier.knobs.every) {
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

    fn rebalance(&mut self, d: &Device) -> Result<(), BackendError> {
        let Some(mut tier) = self.tier.take() else {
            return Ok(());
        };
        let result = self.rebalance_with(d, &mut tier);
        self.tier = Some(tier);
        result
    }

    /// Reads the counts and scores them; points the entries of experts whose copies have
    /// landed at their slots; frees the slots drained since the last time; then evicts the
    /// coldest held experts for hotter ones and starts copying the hottest into free slots
    /// on the copy lane, beside the compute.
    fn rebalance_with(&mut self, d: &Device, tier: &mut Tier) -> Result<(), BackendError> {
        // A synchronisation: every launch issued before has finished, so slots drained before
        // now are free and the table words written before may go.
        let counts: Vec<u32> = d.download(&tier.counts, tier.counters)?;
        self.merge_host_tally();
        tier.words.clear();
        let drained: Vec<usize> = tier.placement.draining().collect();
        for slot in drained {
            tier.placement.drained(slot);
        }
        d.zero(&tier.counts);
        let live: Vec<Option<Arc<InPlaceLayer>>> = self.layers.iter().map(Weak::upgrade).collect();
        // Landed copies: their experts are read from the slots from the next launch on.
        let landed: Vec<bool> = tier.batches.iter().map(|b| b.1.is_complete()).collect();
        let mut still = Vec::new();
        for (slot, mats, batch) in tier.loading.drain(..) {
            if !landed[batch] {
                still.push((slot, mats, batch));
                continue;
            }
            let SlotState::Loading(key) = tier.placement.slots[slot] else {
                continue;
            };
            if let Some(l) = live.get(key.0).cloned().flatten() {
                let bytes = entry_bytes(&mats);
                let e = key.1 as usize;
                d.copy_to_device(l.table.ptr() + (e * bytes.len()) as u64, &bytes)?;
                tier.words.push(bytes);
                tier.placement.loaded(slot);
            }
        }
        // Batches are renumbered: the landed ones are timed and dropped.
        let mut renumber = vec![usize::MAX; landed.len()];
        let mut kept = Vec::new();
        for (i, (a, b)) in tier.batches.drain(..).enumerate() {
            if landed[i] {
                if let Ok(ms) = a.elapsed_ms(&b) {
                    self.stats.upload_secs += ms as f64 / 1e3;
                }
            } else {
                renumber[i] = kept.len();
                kept.push((a, b));
            }
        }
        tier.batches = kept;
        tier.loading = still
            .into_iter()
            .map(|(slot, mats, batch)| (slot, mats, renumber[batch]))
            .collect();
        tier.placement
            .decay(0.5f64.powf(1.0 / tier.knobs.half_life));
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
                if tier.placement.held(key) {
                    self.stats.hits += uses as u64;
                } else {
                    let staged = self.staged_uses.get(&key).copied().unwrap_or(0);
                    let read = (uses as u64).saturating_sub(staged);
                    self.stats.read_in_place += read;
                    self.stats.bytes_read_in_place += read * l.expert_bytes(e);
                }
                tier.placement.observe(key, uses);
            }
        }
        self.staged_uses.clear();
        self.time_staged_copies();
        let Some(slots) = &tier.slots else {
            return Ok(());
        };
        let per_slot = tier.slot_bytes.max(1) as u64;
        let plan = tier.placement.plan(
            (FILL_BYTES / per_slot).max(1) as usize,
            (tier.knobs.swap_bytes / per_slot) as usize,
        );
        for &(_, evicted) in &plan.evictions {
            // Read from host memory from the next launch on; the slot drains by the next
            // rebalance's synchronisation.
            self.point_at_host(d, evicted, &mut tier.words)?;
            self.stats.evictions += 1;
        }
        if plan.fills.is_empty() {
            return Ok(());
        }
        // The copy lane waits for nothing: a free slot is read by no launch.
        let start = d.event(Lane::Copy)?;
        let batch = tier.batches.len();
        for (slot, key) in plan.fills {
            let Some(l) = live.get(key.0).cloned().flatten() else {
                tier.placement.clear(slot);
                continue;
            };
            let e = key.1 as usize;
            let host = &l.host[e];
            let base = slots.ptr() + (slot * tier.slot_bytes) as u64;
            let (offsets, bytes) = slot_layout(host);
            if bytes > tier.slot_bytes {
                tier.placement.clear(slot);
                continue;
            }
            let mats = upload_expert(d, Lane::Copy, host, base, (tier.slot_bytes, &offsets), true);
            let mats = match mats {
                Ok(m) => m,
                Err(err) => {
                    tier.placement.clear(slot);
                    return Err(err);
                }
            };
            let moved = l.expert_bytes(e);
            self.stats.placed += 1;
            self.stats.bytes_uploaded += moved;
            self.stats.bytes_pinned += moved;
            tier.loading.push((slot, mats, batch));
        }
        tier.batches.push((start, d.event(Lane::Copy)?));
        Ok(())
    }

    /// The device addresses of the VRAM slots, `[start, end)` (empty before planning).
    pub fn slots_range(&self) -> (u64, u64) {
        match self.tier.as_ref().and_then(|t| t.slots.as_ref()) {
            Some(s) => (s.ptr(), s.ptr() + s.bytes as u64),
            None => (0, 0),
        }
    }

    /// Where the host's counts of experts it computed go (`host_compute`).
    pub fn set_host_tally(&mut self, tally: Arc<Mutex<HostTally>>) {
        self.host_tally = Some(tally);
    }

    /// Moves the host's counts into the counters: its pairs were counted on the device like every
    /// routing, but not read in place.
    fn merge_host_tally(&mut self) {
        let Some(tally) = &self.host_tally else {
            return;
        };
        let t = std::mem::take(&mut *tally.lock().unwrap_or_else(|p| p.into_inner()));
        for (key, uses) in t.uses {
            *self.staged_uses.entry(key).or_default() += uses;
        }
        self.stats.host_computed += t.pairs;
        self.stats.bytes_host_computed += t.bytes;
        self.stats.host_secs += t.secs;
    }

    /// Whether calls of many tokens of `layer` take [`InPlace::stage`].
    pub fn stages(&self, layer: &InPlaceLayer) -> bool {
        self.tier
            .as_ref()
            .is_some_and(|t| t.staging.is_some() && t.offsets.get(layer.id).is_some())
    }

    /// Splits the experts `routed` (ascending, distinct) of a call of many tokens of `layer`
    /// into runs of ascending ids whose experts in no slot fit the staging slots.
    pub fn stage_runs(&self, layer: &InPlaceLayer, routed: &[u32]) -> Vec<Vec<u32>> {
        let Some(tier) = &self.tier else {
            return vec![routed.to_vec()];
        };
        let cap = tier.staging_slots.max(1);
        let mut runs: Vec<Vec<u32>> = Vec::new();
        let mut staged = cap;
        for &e in routed {
            if !tier.placement.held((layer.id, e)) {
                if staged == cap {
                    runs.push(Vec::new());
                    staged = 0;
                }
                staged += 1;
            }
            match runs.last_mut() {
                Some(run) => run.push(e),
                None => runs.push(vec![e]),
            }
        }
        runs
    }

    /// For one run of [`InPlace::stage_runs`]: copies its experts that no slot holds into the
    /// staging slots (on the compute stream: after every launch that may still read them) and
    /// returns the run's table, `words` of [`ExpertMats::WORDS`] per expert: a slot's entry as
    /// `current` (the layer's table read back) has it, else the staged copy's. `pairs`: the
    /// call's routed ids (the staged experts' uses are not reads in place).
    pub fn stage(
        &mut self,
        d: &Device,
        layer: &InPlaceLayer,
        run: &[u32],
        pairs: &[u32],
        current: &[u32],
    ) -> Result<Vec<u32>, BackendError> {
        let Some(tier) = &self.tier else {
            return Err(BackendError::Device("staging without a VRAM tier".into()));
        };
        let Some(staging) = &tier.staging else {
            return Err(BackendError::Device("staging without staging slots".into()));
        };
        let (staging, slots, slot_bytes) = (staging.ptr(), tier.staging_slots, tier.slot_bytes);
        let held: Vec<bool> = run
            .iter()
            .map(|&e| tier.placement.held((layer.id, e)))
            .collect();
        let w = ExpertMats::WORDS;
        let mut words = Vec::with_capacity(run.len() * w);
        let mut next = 0;
        let start = d.event(Lane::Compute)?;
        for (&e, held) in run.iter().zip(held) {
            let e = e as usize;
            let Some(host) = layer.host.get(e) else {
                return Err(BackendError::Device(format!(
                    "expert {e} routed of {}",
                    layer.host.len()
                )));
            };
            if held {
                words.extend_from_slice(&current[e * w..(e + 1) * w]);
                continue;
            }
            if next == slots {
                return Err(BackendError::Device(
                    "a staging run larger than its slots".into(),
                ));
            }
            let base = staging + (next * slot_bytes) as u64;
            next += 1;
            let (offsets, bytes) = slot_layout(host);
            if bytes > slot_bytes {
                return Err(BackendError::Device(format!(
                    "expert {e} takes {bytes} bytes, a slot {slot_bytes}"
                )));
            }
            let mats = upload_expert(d, Lane::Compute, host, base, (slot_bytes, &offsets), true)?;
            mats.push_words(&mut words);
            let uses = pairs.iter().filter(|&&p| p as usize == e).count() as u64;
            *self.staged_uses.entry((layer.id, e as u32)).or_default() += uses;
            let moved = layer.expert_bytes(e);
            // Per routed pair, as the reads in place and the hits here.
            self.stats.bypassed += uses;
            self.stats.bytes_uploaded += moved;
            self.stats.bytes_pinned += moved;
        }
        let end = d.event(Lane::Compute)?;
        self.staged_copies.push((start, end));
        Ok(words)
    }

    /// Adds the time of the staging copies that have completed to the copy time.
    fn time_staged_copies(&mut self) {
        self.staged_copies.retain(|(start, end)| {
            if !end.is_complete() {
                return true;
            }
            if let Ok(ms) = start.elapsed_ms(end) {
                self.stats.upload_secs += ms as f64 / 1e3;
            }
            false
        });
    }

    /// The counters (after waiting for the staging copies in flight, so that their time is in).
    pub fn stats(&mut self) -> ExpertCacheStats {
        self.merge_host_tally();
        for (_, end) in &self.staged_copies {
            let _ = end.synchronize();
        }
        self.time_staged_copies();
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

    /// Plans and completes every copy and drain at once.
    fn settle(p: &mut Placement, max_fills: usize, max_evictions: usize) -> Plan {
        let plan = p.plan(max_fills, max_evictions);
        for &(slot, _) in &plan.fills {
            p.loaded(slot);
        }
        for &(slot, _) in &plan.evictions {
            p.drained(slot);
        }
        plan
    }

    #[test]
    fn free_slots_go_to_the_most_used_experts() {
        let mut p = placement(2, &[((0, 1), 3), ((0, 2), 9), ((1, 0), 5), ((1, 1), 0)]);
        let plan = p.plan(8, 8);
        assert_eq!(plan.fills, vec![(0, (0, 2)), (1, (1, 0))]);
        assert!(plan.evictions.is_empty(), "nothing held yet");
        // Loading: planned for, but read from host memory until the copy lands.
        assert!(!p.held((0, 2)));
        assert!(p.plan(8, 8).fills.is_empty(), "not copied twice");
        p.loaded(0);
        assert!(p.held((0, 2)) && !p.held((0, 1)));
    }

    #[test]
    fn an_occupant_goes_only_for_a_clearly_hotter_expert_and_its_slot_drains_first() {
        let mut p = placement(1, &[((0, 0), 10)]);
        settle(&mut p, 1, 1);
        // About as hot: stays.
        p.observe((0, 1), 12);
        assert_eq!(p.plan(1, 1), Plan::default());
        // Far hotter: the occupant is evicted; the slot is filled only once drained.
        p.observe((0, 1), 20);
        let plan = p.plan(1, 1);
        assert_eq!(plan.evictions, vec![(0, (0, 0))]);
        assert!(plan.fills.is_empty());
        assert!(!p.held((0, 0)));
        assert!(p.plan(1, 1).fills.is_empty(), "still draining");
        p.drained(0);
        assert_eq!(p.plan(1, 1).fills, vec![(0, (0, 1))]);
    }

    #[test]
    fn moves_per_rebalance_are_bounded() {
        let uses: Vec<(Key, u32)> = (0..10).map(|e| ((0, e), 10 + e)).collect();
        let mut p = placement(4, &uses);
        assert_eq!(settle(&mut p, 3, 0).fills.len(), 3);
        // The fourth free slot, then nothing: no evictions allowed.
        assert_eq!(settle(&mut p, 1, 0).fills.len(), 1);
        assert_eq!(settle(&mut p, 0, 0), Plan::default());
        // Experts 0..3 turn far hotter than the held 6..9: at most `max_evictions` per plan,
        // the coldest occupants first.
        for e in 0..3 {
            p.observe((0, e), 1000);
        }
        let plan = settle(&mut p, 0, 2);
        let evicted: Vec<u32> = plan.evictions.iter().map(|e| e.1 .1).collect();
        assert_eq!(evicted, vec![6, 7]);
        // Their slots go to two of the hot experts, and the third evicts one more.
        let plan = settle(&mut p, 4, 2);
        assert_eq!(plan.fills.len(), 2);
        assert!(plan.fills.iter().all(|f| f.1 .1 < 3));
        assert_eq!(plan.evictions.len(), 1);
    }

    #[test]
    fn scores_fade_and_a_dropped_layer_drains_its_slots() {
        let mut p = placement(2, &[((0, 0), 4), ((1, 0), 4)]);
        settle(&mut p, 2, 0);
        for _ in 0..200 {
            p.decay(0.9);
        }
        assert_eq!(p.score((0, 0)), 0.0, "faded to nothing");
        p.forget_layer(1);
        assert!(!p.held((1, 0)));
        assert!(p.held((0, 0)));
        p.observe((2, 5), 1);
        assert!(
            p.plan(2, 0).fills.is_empty(),
            "the dropped layer's slot drains first"
        );
        let drained: Vec<usize> = p.draining().collect();
        assert_eq!(drained.len(), 1);
        p.drained(drained[0]);
        assert_eq!(p.plan(2, 0).fills, vec![(drained[0], (2, 5))]);
    }

    #[test]
    fn knobs_are_overridden_only_when_well_formed() {
        let k = Knobs::parse(Some("2,64,8"));
        assert_eq!((k.every, k.swap_bytes, k.half_life), (2, 64 << 20, 8.0));
        for bad in [None, Some(""), Some("0,64,8"), Some("1,64"), Some("1,x,8")] {
            let k = Knobs::parse(bad);
            assert_eq!((k.every, k.swap_bytes), (1, 256 << 20), "{bad:?}");
        }
    }
}
