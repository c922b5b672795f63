//! The expert store at run time: a fixed set of cache slots (allocated once), filled by
//! parallel reads, handed out as pinned leases. A slot is filled from the packed blocks file by
//! one aligned read, or (unpacked checkpoints, [`crate::unpacked`]) by one buffered read per
//! slice of the expert in the safetensors shards; it is ready when all its reads are. The
//! slots' memory and states are in [`crate::slots`], where blocks come from in
//! [`crate::source`]; this file decides which block goes in which slot, and when.
//!
//! One decode thread drives it: [`ExpertStore::fetch`] for the experts a layer was routed to
//! (hits are pinned at once, misses are read all at once, then it waits), and
//! [`ExpertStore::prefetch`] for the experts a layer will probably need (reads issued, not
//! waited for). The matrices handed out borrow their slot through a lease; the slot cannot be
//! evicted or overwritten until every lease clone is dropped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use sluice_backend::{HostBytes, HostMatrix, HostPinner};

use crate::error::StoreError;
use crate::io::{Completion, ReadRequest, ReaderOptions};
use crate::manifest::{
    checksum, LayerExperts, Manifest, ManifestError, EXPERTS_FILE, MANIFEST_FILE,
};
use crate::policy::{Frequencies, Policy};
use crate::slots::{tag, untag, Failure, Slab, Slot, Status};
use crate::source::Source;
use crate::stats::{ExpertEvent, ExpertMap, StoreStats};
use crate::unpacked::UnpackedLayout;
use crate::verify::{Checked, Verify};

/// Whether a block just read was compared with its checksum, and whether it is usable.
type CheckOutcome = (bool, Result<(), String>);

/// How the store is set up.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Bytes of expert cache (rounded down to whole slots, raised to the minimum).
    pub cache_bytes: u64,
    pub policy: Policy,
    pub io: ReaderOptions,
    /// When a block read is checked against its checksum (packed directories; unpacked
    /// checkpoints have no checksums and ignore it).
    pub verify: Verify,
    /// Smallest number of slots accepted (the experts one token needs in one layer).
    pub min_slots: usize,
    /// Page-locks the cache's memory for a device's copies (a GPU backend's pinner).
    pub pinner: Option<Pinner>,
}

/// A backend's [`HostPinner`], for [`StoreOptions`].
#[derive(Clone)]
pub struct Pinner(pub Arc<dyn HostPinner>);

impl std::fmt::Debug for Pinner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pinner")
    }
}

/// Slot assignments, use counts and counters, behind the store's one lock.
struct State {
    slots: Vec<Slot>,
    map: HashMap<(usize, u32), usize>,
    freq: Frequencies,
    clock: u64,
    /// Slots held by a prefetch, per manifest layer index, until that layer's next fetch.
    prefetched: HashMap<usize, Vec<usize>>,
    stats: StoreStats,
    /// When reads last went from none to some in flight.
    busy_since: Option<Instant>,
}

impl State {
    /// Pins `slot` for the request being served and marks it used now.
    fn pin(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        s.pins += 1;
        s.last_use = self.clock;
    }
}

struct Inner {
    dir: PathBuf,
    /// Decoder layer -> index into the manifest's layers.
    layer_index: HashMap<usize, usize>,
    source: Source,
    slab: Slab,
    /// Whether the slab was page-locked, when asked to be.
    pinned: Option<Result<(), String>>,
    verify: Verify,
    /// The blocks checked already, for [`Verify::Once`].
    checked: Option<Checked>,
    policy: Policy,
    state: Mutex<State>,
    /// What happened to each expert last, readable without the lock.
    expert_map: ExpertMap,
}

/// The streamed experts of a packed model directory (or of an unpacked checkpoint).
#[derive(Clone)]
pub struct ExpertStore {
    inner: Arc<Inner>,
}

/// One fetched expert: its three matrices, valid (pinned) as long as any clone lives.
pub struct FetchedExpert {
    pub expert: u32,
    pub gate: HostMatrix,
    pub up: HostMatrix,
    pub down: HostMatrix,
}

/// Keeps a slot pinned; the owner behind the slot's `HostBytes`.
struct Lease {
    inner: Arc<Inner>,
    slot: usize,
}

impl AsRef<[u8]> for Lease {
    fn as_ref(&self) -> &[u8] {
        let slab = &self.inner.slab;
        // SAFETY: the slot lies inside the slab; it is Ready and pinned by this lease, so no read
        // is in flight into it and it cannot be reassigned until the lease drops.
        unsafe { std::slice::from_raw_parts(slab.slot_ptr(self.slot), slab.slot_bytes()) }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.inner.lock().slots[self.slot].unpin();
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves counters possibly stale, never memory unsafe.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ExpertStore {
    /// Opens the packed experts of `dir` with a cache of `opts.cache_bytes`.
    pub fn open(dir: &Path, opts: &StoreOptions) -> Result<ExpertStore, StoreError> {
        let manifest = Manifest::open(dir)?.ok_or_else(|| {
            StoreError::Manifest(ManifestError::Invalid {
                path: dir.join(MANIFEST_FILE).display().to_string(),
                msg: "missing (not a packed model directory: run `sluice pack`)".into(),
            })
        })?;
        Self::from_manifest(dir, manifest, opts)
    }

    pub fn from_manifest(
        dir: &Path,
        manifest: Manifest,
        opts: &StoreOptions,
    ) -> Result<ExpertStore, StoreError> {
        let source = Source::packed(dir, manifest, &opts.io)?;
        Self::build(dir, source, opts.verify, opts)
    }

    /// Streams the routed experts of the unpacked checkpoint `dir` (buffered reads of each
    /// expert's slices; `opts.io.direct` and `opts.verify` do not apply). Errors when it has no
    /// routed experts.
    pub fn open_unpacked(
        dir: &sluice_format::ModelDir,
        opts: &StoreOptions,
    ) -> Result<ExpertStore, StoreError> {
        let layout = UnpackedLayout::for_model(dir)?;
        if layout.is_empty() {
            return Err(StoreError::Layout(format!(
                "{} has no routed experts to stream",
                dir.path.display()
            )));
        }
        Self::from_unpacked(&dir.path, layout, opts)
    }

    /// Like [`ExpertStore::open_unpacked`] from a planned layout.
    pub fn from_unpacked(
        dir: &Path,
        layout: UnpackedLayout,
        opts: &StoreOptions,
    ) -> Result<ExpertStore, StoreError> {
        let source = Source::unpacked(layout, &opts.io)?;
        Self::build(dir, source, Verify::Off, opts)
    }

    fn build(
        dir: &Path,
        source: Source,
        verify: Verify,
        opts: &StoreOptions,
    ) -> Result<ExpertStore, StoreError> {
        let manifest = source.manifest();
        let slot_bytes = manifest.max_stride() as usize;
        let total_blocks: usize = manifest.layers.iter().map(|l| l.experts).sum();
        let slots = Self::slots_for(opts.cache_bytes, slot_bytes as u64, opts.min_slots)
            .min(total_blocks.max(1));
        let mut slab = Slab::new(slots, slot_bytes)?;
        // Not pinning costs speed, not correctness: the failure is kept for the banner.
        let pinned = opts.pinner.as_ref().map(|p| slab.pin(p.0.as_ref()));
        let layer_index = manifest
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| (l.layer, i))
            .collect();
        let experts: Vec<usize> = manifest.layers.iter().map(|l| l.experts).collect();
        let expert_map = ExpertMap::new(manifest.layers.iter().map(|l| (l.layer, l.experts)));
        // Counts halve over about the cache's worth of accesses.
        let freq = Frequencies::new(&experts, (slots as f64).max(64.0));
        let state = State {
            slots: (0..slots).map(|_| Slot::empty()).collect(),
            map: HashMap::new(),
            freq,
            clock: 0,
            prefetched: HashMap::new(),
            stats: StoreStats::default(),
            busy_since: None,
        };
        let checked =
            (verify == Verify::Once).then(|| Checked::new(dir.join(EXPERTS_FILE), manifest, slots));
        Ok(ExpertStore {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                layer_index,
                source,
                slab,
                pinned,
                verify,
                checked,
                policy: opts.policy,
                state: Mutex::new(state),
                expert_map,
            }),
        })
    }

    /// Slots a budget buys (at least `min_slots`).
    pub fn slots_for(cache_bytes: u64, slot_bytes: u64, min_slots: usize) -> usize {
        ((cache_bytes / slot_bytes.max(1)) as usize)
            .max(min_slots)
            .max(1)
    }

    pub fn manifest(&self) -> &Manifest {
        self.inner.source.manifest()
    }

    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Number of cache slots.
    pub fn slots(&self) -> usize {
        self.inner.lock().slots.len()
    }

    /// Bytes of cache memory.
    pub fn cache_bytes(&self) -> u64 {
        self.inner.slab.size() as u64
    }

    /// Whether the cache memory is page-locked for a device's copies: `None` when nobody asked,
    /// else whether it worked (and why not).
    pub fn pinned(&self) -> Option<Result<(), String>> {
        self.inner.pinned.clone()
    }

    /// A description of the I/O path, e.g. `io_uring, O_DIRECT`.
    pub fn io_description(&self) -> String {
        self.inner.source.describe()
    }

    /// Whether the experts stream from an unpacked checkpoint rather than a packed directory.
    pub fn is_unpacked(&self) -> bool {
        self.inner.source.is_unpacked()
    }

    /// What happened to each expert last (hit, read ahead, read on demand, evicted) and whether
    /// it is in the cache, for live views.
    pub fn expert_map(&self) -> &ExpertMap {
        &self.inner.expert_map
    }

    pub fn stats(&self) -> StoreStats {
        let st = self.inner.lock();
        let mut s = st.stats.clone();
        if let Some(t) = st.busy_since {
            s.io_busy_secs += t.elapsed().as_secs_f64();
        }
        s
    }

    fn layer(&self, layer: usize) -> Result<(usize, &LayerExperts), StoreError> {
        let i = *self
            .inner
            .layer_index
            .get(&layer)
            .ok_or_else(|| StoreError::NoLayer(layer, self.inner.dir.clone()))?;
        Ok((i, &self.manifest().layers[i]))
    }

    /// Picks a slot to (re)fill: empty first, else the policy's victim among unpinned ready or
    /// failed slots. `None` when every slot is pinned or loading.
    fn victim(&self, st: &State) -> Option<usize> {
        let mut best: Option<(usize, f64, u64)> = None;
        for (i, s) in st.slots.iter().enumerate() {
            if s.pins > 0 || s.is_loading() {
                continue;
            }
            let Some((l, e)) = s.key else {
                return Some(i);
            };
            let score = match self.inner.policy {
                Policy::Lru => 0.0,
                Policy::Frequency => st.freq.count(l, e as usize),
            };
            if best.is_none_or(|(_, bs, bu)| (score, s.last_use) < (bs, bu)) {
                best = Some((i, score, s.last_use));
            }
        }
        best.map(|b| b.0)
    }

    /// Assigns `slot` to `key` (layer index, expert) and appends its reads, as (reader index,
    /// request), to `reqs`.
    fn assign(
        &self,
        st: &mut State,
        slot: usize,
        key: (usize, u32),
        reqs: &mut Vec<(usize, ReadRequest)>,
    ) {
        let reads = self.inner.source.reads_for(key);
        let (evicted, generation) = st.slots[slot].assign(key, reads.len());
        if let Some(checked) = &self.inner.checked {
            checked.assigning(slot);
        }
        if let Some(old) = evicted {
            let experts = &self.inner.expert_map;
            st.map.remove(&old);
            st.stats.evictions += 1;
            experts.record(old.0, old.1, ExpertEvent::Evicted);
        }
        st.map.insert(key, slot);
        let dst = self.inner.slab.slot_ptr(slot);
        let slot_bytes = self.inner.slab.slot_bytes();
        // The reads fill the parts only: zero the gaps (alignment padding, the slot's tail), so
        // that the whole slot a lease exposes is initialised.
        let mut at = 0usize;
        let gaps = reads
            .iter()
            .map(|r| (r.at as usize, (r.at + r.len) as usize))
            .chain(std::iter::once((slot_bytes, slot_bytes)));
        for (start, end) in gaps {
            if start > at {
                // SAFETY: the slot is being (re)assigned: unpinned and not Loading before, so no
                // lease and no read touches it; `at..start` lies inside the slot (parts are
                // ascending and within the block, which fits the slot).
                unsafe { std::ptr::write_bytes(dst.add(at), 0, start - at) };
            }
            at = at.max(end);
        }
        for (i, r) in reads.iter().enumerate() {
            reqs.push((
                r.file,
                ReadRequest {
                    tag: tag(slot, i, generation),
                    offset: r.offset,
                    len: r.len as usize,
                    // `at + len` lies within the block, which fits in the slot.
                    dst: dst.wrapping_add(r.at as usize),
                },
            ));
        }
    }

    /// Issues the reads of `blocks` newly assigned slots.
    fn submit(&self, st: &mut State, reqs: &[(usize, ReadRequest)], blocks: usize) {
        st.stats.blocks_read += blocks as u64;
        if reqs.is_empty() {
            return;
        }
        if st.busy_since.is_none() {
            st.busy_since = Some(Instant::now());
        }
        for (_, r) in reqs {
            st.stats.bytes_read += r.len as u64;
        }
        let readers = self.inner.source.readers();
        let mut per_reader: Vec<Vec<ReadRequest>> = vec![Vec::new(); readers.len()];
        for (ri, r) in reqs {
            per_reader[*ri].push(*r);
        }
        for (reader, rs) in readers.iter().zip(&per_reader) {
            // SAFETY: each destination is a range of a slot that is Loading: no lease exists
            // for it, and no other read targets that range (the parts of a block are disjoint)
            // until its completion has been processed.
            unsafe { reader.submit(rs) };
        }
    }

    /// Processes whatever completions are available; if there are none, blocks on a reader
    /// that has reads in flight. Returns false when no reads were in flight at all.
    fn wait_any(&self) -> bool {
        let readers = self.inner.source.readers();
        let mut got = false;
        for r in readers {
            let done = r.poll();
            if !done.is_empty() {
                got = true;
                self.complete(done);
            }
        }
        if got {
            return true;
        }
        let Some(r) = readers.iter().find(|r| r.in_flight() > 0) else {
            return false;
        };
        let done = r.wait();
        self.complete(done);
        true
    }

    /// Retires completions available now, without blocking.
    fn poll_all(&self) {
        for r in self.inner.source.readers() {
            let done = r.poll();
            if !done.is_empty() {
                self.complete(done);
            }
        }
    }

    /// Counts finished reads against their slots; a slot whose reads have all finished becomes
    /// ready (after its checksum is checked) or failed.
    fn complete(&self, done: Vec<Completion>) {
        // Slots whose last read finished: (slot, generation).
        let mut finished: Vec<(usize, u32)> = Vec::new();
        {
            let mut st = self.inner.lock();
            for c in done {
                let (slot, part, generation) = untag(c.tag);
                if st.slots[slot].part_done(generation, part, c.result) {
                    finished.push((slot, generation));
                }
            }
        }
        // Verify and convert outside the lock: the slots are Loading, so nothing else touches
        // them. Blocks that convert (a GGUF's) take milliseconds each: several convert at once.
        let epoch = match (&self.inner.checked, finished.is_empty()) {
            (Some(checked), false) => checked.refresh(),
            _ => 0,
        };
        let check =
            |(slot, generation): (usize, u32)| (slot, generation, self.check_block(slot, epoch));
        let started = Instant::now();
        let checked: Vec<(usize, u32, CheckOutcome)> =
            if finished.len() > 1 && self.inner.source.converts_any() {
                std::thread::scope(|s| {
                    let mut rest = finished.into_iter();
                    let first = rest.next();
                    let others: Vec<_> = rest.map(|f| (f, s.spawn(move || check(f).2))).collect();
                    let joined = others.into_iter().map(|((slot, generation), h)| {
                        let r = h
                            .join()
                            .unwrap_or_else(|_| (false, Err("converting it panicked".into())));
                        (slot, generation, r)
                    });
                    first.into_iter().map(check).chain(joined).collect()
                })
            } else {
                finished.into_iter().map(check).collect()
            };
        let checking = started.elapsed().as_secs_f64();
        let mut st = self.inner.lock();
        if checked.iter().any(|(_, _, (verified, _))| *verified) {
            st.stats.verify_secs += checking;
        }
        for (slot, generation, (verified, checked)) in checked {
            st.stats.blocks_verified += verified as u64;
            if st.slots[slot].finish(generation, checked) == Some(true) {
                st.stats.errors += 1;
            }
        }
        if self.inner.source.in_flight() == 0 {
            if let Some(t) = st.busy_since.take() {
                st.stats.io_busy_secs += t.elapsed().as_secs_f64();
            }
        }
    }

    /// Checks the block just read into `slot` against its checksum (when verifying: every read,
    /// or in `epoch` a block not checked since the file last changed), and converts it where
    /// its source says so (a GGUF's blocks). Ok when a read already failed it. Also says
    /// whether the checksum was compared.
    fn check_block(&self, slot: usize, epoch: u32) -> CheckOutcome {
        let key = {
            let st = self.inner.lock();
            let s = &st.slots[slot];
            match s.status {
                Status::Loading { failure: None, .. } => s.key,
                _ => None,
            }
        };
        let Some((li, e)) = key else {
            return (false, Ok(()));
        };
        let l = &self.manifest().layers[li];
        let source = &self.inner.source;
        let verify = match (self.inner.verify, &self.inner.checked) {
            (Verify::Off, _) => false,
            (Verify::Once, Some(checked)) => !checked.skips(epoch, slot, (li, e)),
            _ => true,
        };
        if verify {
            // SAFETY: the slot is Loading and its reads have completed: nothing writes it and
            // nothing else reads it.
            let bytes = unsafe {
                std::slice::from_raw_parts(self.inner.slab.slot_ptr(slot), l.stride as usize)
            };
            if checksum(bytes) != l.checksums[e as usize] {
                return (true, Err("checksum mismatch".into()));
            }
            if let Some(checked) = &self.inner.checked {
                checked.passed(epoch, slot, (li, e));
            }
        }
        if source.converts(li) {
            // SAFETY: as above, and only this call (on this slot) holds the slice.
            let block = unsafe {
                std::slice::from_raw_parts_mut(self.inner.slab.slot_ptr(slot), l.stride as usize)
            };
            if let Err(e) = source.convert((li, e), block) {
                return (verify, Err(e));
            }
        }
        (verify, Ok(()))
    }

    /// Releases the prefetch holds of layer index `li`, counting which were used by `wanted`.
    fn release_prefetched(&self, st: &mut State, li: usize, wanted: &[u32]) {
        let Some(held) = st.prefetched.remove(&li) else {
            return;
        };
        for slot in held {
            let s = &mut st.slots[slot];
            s.unpin();
            let used = matches!(s.key, Some((l, e)) if l == li && wanted.contains(&e));
            if used {
                st.stats.prefetch_useful += 1;
            } else {
                st.stats.prefetch_wasted += 1;
            }
        }
    }

    /// Most experts one `fetch` can hold at once (the number of slots).
    pub fn max_fetch(&self) -> usize {
        self.slots()
    }

    /// Fetches the blocks of `experts` (ascending, distinct) of decoder layer `layer`: hits are
    /// pinned, misses read in parallel, and this waits until all are in memory. At most
    /// [`ExpertStore::max_fetch`] experts per call.
    pub fn fetch(&self, layer: usize, experts: &[u32]) -> Result<Vec<FetchedExpert>, StoreError> {
        let (li, l) = self.layer(layer)?;
        if let Some(&expert) = experts.iter().find(|&&e| e as usize >= l.experts) {
            return Err(StoreError::Expert {
                layer,
                expert,
                experts: l.experts,
            });
        }
        let mut st = self.inner.lock();
        // Pin what is cached (or in flight) first, so that no miss below evicts a block this
        // call wants; then drop this layer's prefetch holds; then assign the misses.
        let hits = self.pin_hits(&mut st, li, experts);
        self.release_prefetched(&mut st, li, experts);
        // A slot whose read is still in flight for nobody (a prefetch let go) is reusable once
        // the read lands: wait for those when the misses need the room.
        let misses = hits.iter().filter(|h| h.is_none()).count();
        loop {
            let unheld = |s: &&Slot| s.pins == 0;
            let free = st
                .slots
                .iter()
                .filter(unheld)
                .filter(|s| !s.is_loading())
                .count();
            let draining = st.slots.iter().filter(unheld).any(|s| s.is_loading());
            if free >= misses || !draining {
                break;
            }
            drop(st);
            let any = self.wait_any();
            st = self.inner.lock();
            if !any {
                break;
            }
        }
        let slots = self.assign_misses(&mut st, layer, li, experts, &hits)?;
        let mut st = self.wait_ready(st, &slots);
        self.fail_request(&mut st, layer, li, experts, &slots)?;
        drop(st);
        Ok(self.hand_out(l, slots, experts))
    }

    /// Counts the requests and pins those already cached or in flight: their slots, `None`
    /// for misses.
    fn pin_hits(&self, st: &mut State, li: usize, experts: &[u32]) -> Vec<Option<usize>> {
        experts
            .iter()
            .map(|&e| {
                st.clock += 1;
                st.freq.touch(li, e as usize);
                st.stats.requests += 1;
                let slot = st.map.get(&(li, e)).copied();
                if let Some(s) = slot {
                    self.inner.expert_map.record(li, e, ExpertEvent::Hit);
                    if st.slots[s].status == Status::Ready {
                        st.stats.hits += 1;
                    } else {
                        st.stats.prefetch_hits += 1;
                    }
                    st.pin(s);
                }
                slot
            })
            .collect()
    }

    /// Gives every miss among `experts` a slot and issues their reads. Returns the slots of all
    /// of `experts`, in order, pinned; errors (with the pins undone) when every slot is held.
    fn assign_misses(
        &self,
        st: &mut State,
        layer: usize,
        li: usize,
        experts: &[u32],
        hits: &[Option<usize>],
    ) -> Result<Vec<usize>, StoreError> {
        let mut slots: Vec<usize> = Vec::with_capacity(experts.len());
        let mut reqs = Vec::new();
        let mut blocks = 0;
        for (i, (&e, &hit)) in experts.iter().zip(hits).enumerate() {
            if let Some(s) = hit {
                slots.push(s);
                continue;
            }
            st.stats.misses += 1;
            let Some(v) = self.victim(st) else {
                // Cannot happen with max_fetch respected (and no leases kept across calls).
                // Read the misses assigned so far, which would otherwise stay Loading with no
                // read in flight, and undo the pins taken.
                self.submit(st, &reqs, blocks);
                for &s in slots.iter().chain(hits[i..].iter().flatten()) {
                    st.slots[s].unpin();
                }
                return Err(StoreError::Memory(format!(
                    "layer {layer}: {} experts requested but the expert cache has only {} slots",
                    experts.len(),
                    st.slots.len()
                )));
            };
            self.assign(st, v, (li, e), &mut reqs);
            self.inner.expert_map.record(li, e, ExpertEvent::DemandRead);
            blocks += 1;
            st.pin(v);
            slots.push(v);
        }
        self.submit(st, &reqs, blocks);
        Ok(slots)
    }

    /// Waits until none of `slots` is loading, processing any completion (prefetches
    /// included).
    fn wait_ready<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        slots: &[usize],
    ) -> MutexGuard<'a, State> {
        let wait_start = Instant::now();
        let verifying_before = st.stats.verify_secs;
        let mut waited = false;
        while slots.iter().any(|&s| st.slots[s].is_loading()) {
            drop(st);
            waited = true;
            let any = self.wait_any();
            st = self.inner.lock();
            if !any {
                // No read in flight can finish these slots (cannot happen): fail them rather
                // than wait forever.
                for &s in slots {
                    if st.slots[s].is_loading() {
                        st.slots[s].status = Status::Failed(Failure {
                            msg: "its read was lost".into(),
                            part: 0,
                        });
                        st.stats.errors += 1;
                    }
                }
            }
        }
        if waited {
            let verifying = st.stats.verify_secs - verifying_before;
            st.stats.io_wait_secs += (wait_start.elapsed().as_secs_f64() - verifying).max(0.0);
        }
        st
    }

    /// Any failure among `slots` fails the request: unpins them all, forgets the failed blocks
    /// (the next fetch reads them again) and reports the first, naming its file and offset.
    fn fail_request(
        &self,
        st: &mut State,
        layer: usize,
        li: usize,
        experts: &[u32],
        slots: &[usize],
    ) -> Result<(), StoreError> {
        let failed = slots
            .iter()
            .zip(experts)
            .find_map(|(&s, &e)| match &st.slots[s].status {
                Status::Failed(f) => Some((e, f.clone())),
                _ => None,
            });
        let Some((expert, failure)) = failed else {
            return Ok(());
        };
        for &s in slots {
            let slot = &mut st.slots[s];
            slot.unpin();
            if matches!(slot.status, Status::Failed(_)) {
                if let Some(k) = slot.key.take() {
                    st.map.remove(&k);
                    self.inner.expert_map.forget(k.0, k.1);
                }
                slot.status = Status::Empty;
            }
        }
        let source = &self.inner.source;
        let (path, offset) = source.locate((li, expert), failure.part);
        Err(StoreError::Block {
            layer,
            expert,
            msg: failure.msg,
            path,
            offset,
            hint: source.hint(),
        })
    }

    /// The matrices of the pinned, ready `slots`, each holding a lease on its slot.
    fn hand_out(&self, l: &LayerExperts, slots: Vec<usize>, experts: &[u32]) -> Vec<FetchedExpert> {
        slots
            .into_iter()
            .zip(experts)
            .map(|(slot, &expert)| {
                let lease: Arc<dyn AsRef<[u8]> + Send + Sync> = Arc::new(Lease {
                    inner: self.inner.clone(),
                    slot,
                });
                let block = HostBytes::new(lease, 0..l.stride as usize);
                let [gate, up, down] = l.matrices(&block);
                FetchedExpert {
                    expert,
                    gate,
                    up,
                    down,
                }
            })
            .collect()
    }

    /// Lets go of what a prefetch holds for decoder layer `layer` without fetching (its
    /// experts were found elsewhere, say in a GPU's memory); counted as wasted prefetches.
    pub fn release_prefetch(&self, layer: usize) {
        let Ok((li, _)) = self.layer(layer) else {
            return;
        };
        let mut st = self.inner.lock();
        self.release_prefetched(&mut st, li, &[]);
    }

    /// Starts reading the blocks of `experts` of decoder layer `layer` that are not cached,
    /// without waiting; they stay held until that layer's next `fetch`. Skips what does not fit
    /// without evicting anything pinned.
    pub fn prefetch(&self, layer: usize, experts: &[u32]) {
        let Ok((li, l)) = self.layer(layer) else {
            return;
        };
        let mut st = self.inner.lock();
        // Holds from an earlier prefetch of this layer that no fetch consumed are replaced.
        if st.prefetched.contains_key(&li) {
            self.release_prefetched(&mut st, li, &[]);
        }
        let mut reqs = Vec::new();
        let mut held = Vec::new();
        for &e in experts {
            if e as usize >= l.experts || st.map.contains_key(&(li, e)) {
                continue;
            }
            let Some(v) = self.victim(&st) else { break };
            self.assign(&mut st, v, (li, e), &mut reqs);
            self.inner.expert_map.record(li, e, ExpertEvent::ReadAhead);
            // Held, not used: its recency is left to the fetch that uses it.
            st.slots[v].pins += 1;
            held.push(v);
        }
        st.stats.prefetch_issued += held.len() as u64;
        st.stats.prefetch_bytes += reqs.iter().map(|(_, r)| r.len as u64).sum::<u64>();
        let blocks = held.len();
        if !held.is_empty() {
            st.prefetched.insert(li, held);
        }
        self.submit(&mut st, &reqs, blocks);
        drop(st);
        // Retire whatever has finished meanwhile, so slots become ready without a fetch.
        self.poll_all();
    }
}

#[cfg(test)]
mod tests;
