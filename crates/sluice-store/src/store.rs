//! The expert store at run time: a fixed set of cache slots (allocated once), filled by
//! parallel reads, handed out as pinned leases. A slot is filled from the packed blocks file by
//! one aligned read, or (unpacked checkpoints, [`crate::unpacked`]) by one buffered read per
//! slice of the expert in the safetensors shards; it is ready when all its reads are.
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

use serde::Serialize;
use sluice_backend::{HostBytes, HostMatrix};

use crate::io::{Completion, ReadRequest, Reader, ReaderOptions};
use crate::manifest::{checksum, LayerExperts, Manifest};
use crate::policy::{Frequencies, Policy};
use crate::unpacked::{PartRead, UnpackedLayout};

/// How the store is set up.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Bytes of expert cache (rounded down to whole slots, raised to the minimum).
    pub cache_bytes: u64,
    pub policy: Policy,
    pub io: ReaderOptions,
    /// Check every block read against its checksum (packed directories; unpacked checkpoints
    /// have no checksums and ignore it).
    pub verify: bool,
    /// Smallest number of slots accepted (the experts one token needs in one layer).
    pub min_slots: usize,
}

/// Errors of the store, each naming the block and the file.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{0}")]
    Manifest(#[from] crate::manifest::ManifestError),
    /// The checkpoint's expert tensors could not be laid out (unpacked checkpoints).
    #[error(transparent)]
    Format(#[from] sluice_format::FormatError),
    #[error("opening {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("layer {layer} expert {expert}: {msg} ({path} at offset {offset}); {hint}")]
    Block {
        layer: usize,
        expert: u32,
        msg: String,
        path: PathBuf,
        offset: u64,
        /// What to do about it.
        hint: &'static str,
    },
    #[error("{0}")]
    Layout(String),
    #[error("layer {0} has no streamed experts in {1}")]
    NoLayer(usize, PathBuf),
    #[error("expert {expert} is out of range for layer {layer} ({experts} experts)")]
    Expert {
        layer: usize,
        expert: u32,
        experts: usize,
    },
    #[error("{0}")]
    Memory(String),
}

/// Counters since the store opened (see [`StoreStats::since`] for per-token deltas).
#[derive(Debug, Clone, Default, Serialize)]
pub struct StoreStats {
    /// Experts asked for by `fetch`.
    pub requests: u64,
    /// Of those, already in the cache and ready.
    pub hits: u64,
    /// Of those, found in flight from a prefetch (they still wait, but less).
    pub prefetch_hits: u64,
    /// Of those, read on demand.
    pub misses: u64,
    pub prefetch_issued: u64,
    /// Prefetched blocks that the next fetch of their layer used.
    pub prefetch_useful: u64,
    pub prefetch_wasted: u64,
    pub bytes_read: u64,
    pub prefetch_bytes: u64,
    pub blocks_read: u64,
    /// Seconds `fetch` spent waiting for reads.
    pub io_wait_secs: f64,
    /// Seconds with at least one read in flight.
    pub io_busy_secs: f64,
    pub evictions: u64,
    pub errors: u64,
}

impl StoreStats {
    /// The counters accumulated since `earlier`.
    pub fn since(&self, earlier: &StoreStats) -> StoreStats {
        StoreStats {
            requests: self.requests - earlier.requests,
            hits: self.hits - earlier.hits,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            misses: self.misses - earlier.misses,
            prefetch_issued: self.prefetch_issued - earlier.prefetch_issued,
            prefetch_useful: self.prefetch_useful - earlier.prefetch_useful,
            prefetch_wasted: self.prefetch_wasted - earlier.prefetch_wasted,
            bytes_read: self.bytes_read - earlier.bytes_read,
            prefetch_bytes: self.prefetch_bytes - earlier.prefetch_bytes,
            blocks_read: self.blocks_read - earlier.blocks_read,
            io_wait_secs: self.io_wait_secs - earlier.io_wait_secs,
            io_busy_secs: self.io_busy_secs - earlier.io_busy_secs,
            evictions: self.evictions - earlier.evictions,
            errors: self.errors - earlier.errors,
        }
    }

    /// Share of requested experts that needed no demand read: in the cache, or already being
    /// read by a prefetch.
    pub fn hit_rate(&self) -> f64 {
        if self.requests == 0 {
            return 0.0;
        }
        (self.hits + self.prefetch_hits) as f64 / self.requests as f64
    }

    /// Read throughput while reads were in flight, GB/s.
    pub fn read_gbps(&self) -> f64 {
        if self.io_busy_secs <= 0.0 {
            return 0.0;
        }
        self.bytes_read as f64 / self.io_busy_secs / 1e9
    }

    /// Share of prefetched blocks that were used.
    pub fn prefetch_accuracy(&self) -> f64 {
        let done = self.prefetch_useful + self.prefetch_wasted;
        if done == 0 {
            return 0.0;
        }
        self.prefetch_useful as f64 / done as f64
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Status {
    Empty,
    Loading,
    Ready,
    Failed(String),
}

struct Slot {
    /// (index into the manifest's layers, expert).
    key: Option<(usize, u32)>,
    status: Status,
    /// Leases alive plus one while a prefetch holds it for its layer.
    pins: u32,
    last_use: u64,
    /// Bumped on every (re)assignment, carried in read tags (24 bits).
    generation: u32,
    /// Reads of the current assignment not yet completed.
    parts_left: u32,
    /// The first failure among them: message, file and offset.
    failure: Option<(String, PathBuf, u64)>,
}

/// Read tags: slot, part index (unpacked reads of one slot), generation.
fn tag(slot: usize, part: usize, generation: u32) -> u64 {
    (slot as u64) << 32 | (part as u64 & 0xff) << 24 | (generation & GENERATION_MASK) as u64
}

fn untag(tag: u64) -> (usize, usize, u32) {
    (
        (tag >> 32) as usize,
        ((tag >> 24) & 0xff) as usize,
        tag as u32 & GENERATION_MASK,
    )
}

const GENERATION_MASK: u32 = 0xff_ffff;

/// Where blocks come from.
enum Source {
    /// `experts.bin`: one aligned read per block.
    Packed { reader: Reader, path: PathBuf },
    /// The checkpoint's shards, one buffered reader each; per manifest layer index, per expert,
    /// the reads that fill a slot.
    Unpacked {
        readers: Vec<Reader>,
        files: Vec<PathBuf>,
        reads: Vec<Vec<Vec<PartRead>>>,
    },
}

impl Source {
    fn readers(&self) -> &[Reader] {
        match self {
            Source::Packed { reader, .. } => std::slice::from_ref(reader),
            Source::Unpacked { readers, .. } => readers,
        }
    }

    fn in_flight(&self) -> usize {
        self.readers().iter().map(Reader::in_flight).sum()
    }
}

const PACKED_HINT: &str = "the file is damaged: re-run `sluice pack`";
const UNPACKED_HINT: &str =
    "the checkpoint file is damaged, or was truncated or replaced while sluice ran";

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

/// The slots' memory: one allocation, aligned for O_DIRECT.
struct Slab {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: the slab is plain memory; which thread may touch which slot is governed by the store's
// state (a slot is written only while Loading and unpinned, read only while pinned and Ready).
unsafe impl Send for Slab {}
// SAFETY: as above.
unsafe impl Sync for Slab {}

impl Drop for Slab {
    fn drop(&mut self) {
        // SAFETY: allocated in `Inner::new` with exactly this layout; no lease outlives the
        // store's Inner (leases hold an Arc to it).
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

struct Inner {
    dir: PathBuf,
    manifest: Manifest,
    /// Decoder layer -> index into `manifest.layers`.
    layer_index: HashMap<usize, usize>,
    source: Source,
    slab: Slab,
    slot_bytes: usize,
    verify: bool,
    policy: Policy,
    state: Mutex<State>,
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
        let start = self.slot * self.inner.slot_bytes;
        // SAFETY: the slot lies inside the slab; it is Ready and pinned by this lease, so no read
        // is in flight into it and it cannot be reassigned until the lease drops.
        unsafe {
            std::slice::from_raw_parts(
                self.inner.slab.ptr.as_ptr().add(start),
                self.inner.slot_bytes,
            )
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut st = self.inner.lock();
        let slot = &mut st.slots[self.slot];
        slot.pins = slot.pins.saturating_sub(1);
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves counters possibly stale, never memory unsafe.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn slot_ptr(&self, slot: usize) -> *mut u8 {
        // SAFETY: `slot < slots`, so the offset stays inside the allocation.
        unsafe { self.slab.ptr.as_ptr().add(slot * self.slot_bytes) }
    }
}

impl ExpertStore {
    /// Opens the packed experts of `dir` with a cache of `opts.cache_bytes`.
    pub fn open(dir: &Path, opts: &StoreOptions) -> Result<ExpertStore, StoreError> {
        let manifest = Manifest::open(dir)?.ok_or_else(|| {
            StoreError::Manifest(crate::manifest::ManifestError::Invalid {
                path: dir
                    .join(crate::manifest::MANIFEST_FILE)
                    .display()
                    .to_string(),
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
        manifest.check_file_len(dir)?;
        let blocks_path = manifest.blocks_path(dir)?;
        let reader = Reader::open(&blocks_path, &opts.io).map_err(|source| StoreError::Open {
            path: blocks_path.clone(),
            source,
        })?;
        let source = Source::Packed {
            reader,
            path: blocks_path,
        };
        Self::build(dir, manifest, source, opts.verify, opts)
    }

    /// Streams the routed experts of the unpacked checkpoint `dir` (buffered reads of each
    /// expert's slices; `opts.io.direct` and `opts.verify` do not apply). Errors when it has no
    /// routed experts.
    pub fn open_unpacked(
        dir: &sluice_format::ModelDir,
        opts: &StoreOptions,
    ) -> Result<ExpertStore, StoreError> {
        let layout = UnpackedLayout::plan(&dir.tensors, dir.quantization.as_ref())?;
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
        let io = ReaderOptions {
            direct: false,
            ..opts.io.clone()
        };
        let readers = layout
            .files
            .iter()
            .map(|path| {
                Reader::open(path, &io).map_err(|source| StoreError::Open {
                    path: path.clone(),
                    source,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let source = Source::Unpacked {
            readers,
            files: layout.files,
            reads: layout.reads,
        };
        Self::build(dir, layout.manifest, source, false, opts)
    }

    fn build(
        dir: &Path,
        manifest: Manifest,
        source: Source,
        verify: bool,
        opts: &StoreOptions,
    ) -> Result<ExpertStore, StoreError> {
        let slot_bytes = manifest.max_stride() as usize;
        let total_blocks: usize = manifest.layers.iter().map(|l| l.experts).sum();
        let slots = Self::slots_for(opts.cache_bytes, slot_bytes as u64, opts.min_slots)
            .min(total_blocks.max(1));
        let layout = std::alloc::Layout::from_size_align(
            slots.max(1) * slot_bytes.max(1),
            crate::manifest::BLOCK_ALIGN as usize,
        )
        .map_err(|e| StoreError::Memory(format!("expert cache layout: {e}")))?;
        // SAFETY: the layout has a non-zero size. The memory is left uninitialised: every slot is
        // written by a read before it is handed out.
        let ptr = unsafe { std::alloc::alloc(layout) };
        let ptr = std::ptr::NonNull::new(ptr).ok_or_else(|| {
            StoreError::Memory(format!(
                "could not allocate an expert cache of {} bytes; lower --expert-cache",
                layout.size()
            ))
        })?;
        let layer_index = manifest
            .layers
            .iter()
            .enumerate()
            .map(|(i, l)| (l.layer, i))
            .collect();
        let experts: Vec<usize> = manifest.layers.iter().map(|l| l.experts).collect();
        // Counts halve over about the cache's worth of accesses.
        let freq = Frequencies::new(&experts, (slots as f64).max(64.0));
        let state = State {
            slots: (0..slots)
                .map(|_| Slot {
                    key: None,
                    status: Status::Empty,
                    pins: 0,
                    last_use: 0,
                    generation: 0,
                    parts_left: 0,
                    failure: None,
                })
                .collect(),
            map: HashMap::new(),
            freq,
            clock: 0,
            prefetched: HashMap::new(),
            stats: StoreStats::default(),
            busy_since: None,
        };
        Ok(ExpertStore {
            inner: Arc::new(Inner {
                dir: dir.to_path_buf(),
                manifest,
                layer_index,
                source,
                slab: Slab { ptr, layout },
                slot_bytes,
                verify,
                policy: opts.policy,
                state: Mutex::new(state),
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
        &self.inner.manifest
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
        self.inner.slab.layout.size() as u64
    }

    /// A description of the I/O path, e.g. `io_uring, O_DIRECT`.
    pub fn io_description(&self) -> String {
        match &self.inner.source {
            Source::Packed { reader, .. } => format!(
                "{:?}{}",
                reader.kind(),
                if reader.direct() {
                    ", O_DIRECT"
                } else {
                    ", buffered"
                }
            ),
            Source::Unpacked { readers, .. } => format!(
                "{:?}, buffered, unpacked: {} file{}",
                readers
                    .first()
                    .map_or(crate::io::IoKind::Threads, Reader::kind),
                readers.len(),
                if readers.len() == 1 { "" } else { "s" }
            ),
        }
    }

    /// Whether the experts stream from an unpacked checkpoint rather than a packed directory.
    pub fn is_unpacked(&self) -> bool {
        matches!(self.inner.source, Source::Unpacked { .. })
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
        Ok((i, &self.inner.manifest.layers[i]))
    }

    /// Picks a slot to (re)fill: empty first, else the policy's victim among unpinned ready or
    /// failed slots. `None` when every slot is pinned or loading.
    fn victim(&self, st: &State) -> Option<usize> {
        let mut best: Option<(usize, f64, u64)> = None;
        for (i, s) in st.slots.iter().enumerate() {
            if s.pins > 0 || s.status == Status::Loading {
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

    /// Assigns `slot` to (layer index, expert) and appends its reads, as (reader index,
    /// request), to `reqs`.
    fn assign(
        &self,
        st: &mut State,
        slot: usize,
        li: usize,
        expert: u32,
        reqs: &mut Vec<(usize, ReadRequest)>,
    ) {
        let s = &mut st.slots[slot];
        if let Some(old) = s.key.take() {
            st.map.remove(&old);
            st.stats.evictions += 1;
        }
        let s = &mut st.slots[slot];
        s.key = Some((li, expert));
        s.status = Status::Loading;
        s.failure = None;
        s.generation = s.generation.wrapping_add(1) & GENERATION_MASK;
        let generation = s.generation;
        let dst = self.inner.slot_ptr(slot);
        let before = reqs.len();
        match &self.inner.source {
            Source::Packed { .. } => {
                let l = &self.inner.manifest.layers[li];
                reqs.push((
                    0,
                    ReadRequest {
                        tag: tag(slot, 0, generation),
                        offset: l.block_offset(expert as usize),
                        len: l.stride as usize,
                        dst,
                    },
                ));
            }
            Source::Unpacked { reads, .. } => {
                let parts = &reads[li][expert as usize];
                // The reads fill the parts only: zero the gaps (alignment padding, the slot's
                // tail), so that the whole slot a lease exposes is initialised.
                let mut at = 0usize;
                let gaps = parts
                    .iter()
                    .map(|r| (r.at as usize, (r.at + r.len) as usize))
                    .chain(std::iter::once((
                        self.inner.slot_bytes,
                        self.inner.slot_bytes,
                    )));
                for (start, end) in gaps {
                    if start > at {
                        // SAFETY: the slot is being (re)assigned: unpinned and not Loading, so
                        // no lease and no read touches it; `at..start` lies inside the slot
                        // (parts are ascending and within the block, which fits the slot).
                        unsafe { std::ptr::write_bytes(dst.add(at), 0, start - at) };
                    }
                    at = at.max(end);
                }
                for (i, r) in parts.iter().enumerate() {
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
        }
        let s = &mut st.slots[slot];
        s.parts_left = (reqs.len() - before) as u32;
        if s.parts_left == 0 {
            s.status = Status::Ready;
        }
        st.map.insert((li, expert), slot);
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
        for (ri, r) in readers.iter().enumerate() {
            let done = r.poll();
            if !done.is_empty() {
                got = true;
                self.complete(ri, done);
            }
        }
        if got {
            return true;
        }
        let Some((ri, r)) = readers.iter().enumerate().find(|(_, r)| r.in_flight() > 0) else {
            return false;
        };
        let done = r.wait();
        self.complete(ri, done);
        true
    }

    /// Retires completions available now, without blocking.
    fn poll_all(&self) {
        for (ri, r) in self.inner.source.readers().iter().enumerate() {
            let done = r.poll();
            if !done.is_empty() {
                self.complete(ri, done);
            }
        }
    }

    /// Counts finished reads (from reader `ri`) against their slots; a slot whose reads have
    /// all finished becomes ready (after its checksum is checked) or failed.
    fn complete(&self, ri: usize, done: Vec<Completion>) {
        // Slots whose last read finished: (slot, generation).
        let mut finished: Vec<(usize, u32)> = Vec::new();
        {
            let mut st = self.inner.lock();
            for c in done {
                let (slot, part, generation) = untag(c.tag);
                let s = &mut st.slots[slot];
                if s.generation != generation || s.status != Status::Loading || s.parts_left == 0 {
                    continue;
                }
                s.parts_left -= 1;
                if let Err(e) = c.result {
                    if s.failure.is_none() {
                        let (path, offset) = match (&self.inner.source, s.key) {
                            (Source::Packed { path, .. }, Some((li, ex))) => (
                                path.clone(),
                                self.inner.manifest.layers[li].block_offset(ex as usize),
                            ),
                            (Source::Unpacked { files, reads, .. }, Some((li, ex))) => {
                                let r = reads[li][ex as usize][part];
                                (files[r.file].clone(), r.offset)
                            }
                            (Source::Packed { path, .. }, None) => (path.clone(), 0),
                            (Source::Unpacked { files, .. }, None) => (files[ri].clone(), 0),
                        };
                        s.failure = Some((e.to_string(), path, offset));
                    }
                }
                if s.parts_left == 0 {
                    finished.push((slot, generation));
                }
            }
        }
        // Verify outside the lock: the slots are Loading, so nothing else touches them.
        let checked: Vec<(usize, u32, bool)> = finished
            .into_iter()
            .map(|(slot, generation)| {
                if !self.inner.verify {
                    return (slot, generation, true);
                }
                let st = self.inner.lock();
                let s = &st.slots[slot];
                let (key, failed) = (s.key, s.failure.is_some());
                drop(st);
                let Some((li, e)) = key else {
                    return (slot, generation, true);
                };
                if failed {
                    return (slot, generation, true);
                }
                let l = &self.inner.manifest.layers[li];
                // SAFETY: the slot is Loading and its reads have completed: nothing writes it
                // and nothing else reads it.
                let bytes = unsafe {
                    std::slice::from_raw_parts(self.inner.slot_ptr(slot), l.stride as usize)
                };
                (slot, generation, checksum(bytes) == l.checksums[e as usize])
            })
            .collect();
        let mut st = self.inner.lock();
        for (slot, generation, sum_ok) in checked {
            let s = &mut st.slots[slot];
            if s.generation != generation || s.status != Status::Loading {
                continue;
            }
            if s.failure.is_none() && !sum_ok {
                let (li, e) = s.key.expect("a loading slot has a key");
                let (path, offset) = match &self.inner.source {
                    Source::Packed { path, .. } => (
                        path.clone(),
                        self.inner.manifest.layers[li].block_offset(e as usize),
                    ),
                    Source::Unpacked { files, .. } => (files[0].clone(), 0),
                };
                s.failure = Some(("checksum mismatch".to_string(), path, offset));
            }
            s.status = match &s.failure {
                None => Status::Ready,
                Some((msg, _, _)) => Status::Failed(msg.clone()),
            };
            if matches!(s.status, Status::Failed(_)) {
                st.stats.errors += 1;
            }
        }
        if self.inner.source.in_flight() == 0 {
            if let Some(t) = st.busy_since.take() {
                st.stats.io_busy_secs += t.elapsed().as_secs_f64();
            }
        }
    }

    /// Releases the prefetch holds of layer index `li`, counting which were used by `wanted`.
    fn release_prefetched(&self, st: &mut State, li: usize, wanted: &[u32]) {
        let Some(held) = st.prefetched.remove(&li) else {
            return;
        };
        for slot in held {
            let s = &mut st.slots[slot];
            s.pins = s.pins.saturating_sub(1);
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
        for &e in experts {
            if e as usize >= l.experts {
                return Err(StoreError::Expert {
                    layer,
                    expert: e,
                    experts: l.experts,
                });
            }
        }
        let mut st = self.inner.lock();
        // Pin what is cached (or in flight) first, so that no miss below evicts a block this
        // call wants; then drop this layer's prefetch holds; then assign the misses.
        let mut found: Vec<Option<usize>> = Vec::with_capacity(experts.len());
        for &e in experts {
            st.clock += 1;
            st.freq.touch(li, e as usize);
            st.stats.requests += 1;
            let slot = st.map.get(&(li, e)).copied();
            if let Some(s) = slot {
                if st.slots[s].status == Status::Ready {
                    st.stats.hits += 1;
                } else {
                    st.stats.prefetch_hits += 1;
                }
                let clock = st.clock;
                let slot = &mut st.slots[s];
                slot.pins += 1;
                slot.last_use = clock;
            }
            found.push(slot);
        }
        self.release_prefetched(&mut st, li, experts);
        let mut slots: Vec<usize> = Vec::with_capacity(experts.len());
        let mut reqs = Vec::new();
        let mut blocks = 0;
        for (i, &e) in experts.iter().enumerate() {
            let slot = match found[i] {
                Some(s) => s,
                None => {
                    st.stats.misses += 1;
                    let Some(v) = self.victim(&st) else {
                        // Cannot happen with max_fetch respected; undo the pins taken so far.
                        for s in slots.iter().chain(found[i..].iter().flatten()) {
                            st.slots[*s].pins -= 1;
                        }
                        return Err(StoreError::Memory(format!(
                            "layer {layer}: {} experts requested but the expert cache has only {} slots",
                            experts.len(),
                            st.slots.len()
                        )));
                    };
                    self.assign(&mut st, v, li, e, &mut reqs);
                    blocks += 1;
                    let clock = st.clock;
                    let slot = &mut st.slots[v];
                    slot.pins += 1;
                    slot.last_use = clock;
                    v
                }
            };
            slots.push(slot);
        }
        self.submit(&mut st, &reqs, blocks);
        // Wait until every slot is ready (processing any completion, prefetches included).
        let wait_start = Instant::now();
        let mut waited = false;
        loop {
            let pending = slots.iter().any(|&s| st.slots[s].status == Status::Loading);
            if !pending {
                break;
            }
            drop(st);
            waited = true;
            let any = self.wait_any();
            st = self.inner.lock();
            if !any {
                // No read in flight can finish these slots (cannot happen): fail them rather
                // than wait forever.
                for &s in &slots {
                    if st.slots[s].status == Status::Loading {
                        st.slots[s].status = Status::Failed("its read was lost".into());
                        st.stats.errors += 1;
                    }
                }
            }
        }
        if waited {
            st.stats.io_wait_secs += wait_start.elapsed().as_secs_f64();
        }
        // Any failure fails the request: unpin, forget the block, report the first.
        let failed = slots
            .iter()
            .zip(experts)
            .find_map(|(&s, &e)| match &st.slots[s].status {
                Status::Failed(msg) => Some((e, msg.clone(), st.slots[s].failure.clone())),
                _ => None,
            });
        if let Some((e, msg, at)) = failed {
            for &s in &slots {
                st.slots[s].pins -= 1;
                if matches!(st.slots[s].status, Status::Failed(_)) {
                    if let Some(k) = st.slots[s].key.take() {
                        st.map.remove(&k);
                    }
                    st.slots[s].status = Status::Empty;
                }
            }
            let (path, offset, hint) = match (&self.inner.source, at) {
                (Source::Packed { .. }, Some((_, path, offset))) => (path, offset, PACKED_HINT),
                (Source::Unpacked { .. }, Some((_, path, offset))) => (path, offset, UNPACKED_HINT),
                (Source::Packed { path, .. }, None) => {
                    (path.clone(), l.block_offset(e as usize), PACKED_HINT)
                }
                (Source::Unpacked { files, .. }, None) => (files[0].clone(), 0, UNPACKED_HINT),
            };
            return Err(StoreError::Block {
                layer,
                expert: e,
                msg,
                path,
                offset,
                hint,
            });
        }
        drop(st);
        Ok(slots
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
            .collect())
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
            self.assign(&mut st, v, li, e, &mut reqs);
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
mod tests {
    use super::*;
    use crate::io::IoKind;
    use crate::manifest::{LayerExperts, Manifest, EXPERTS_FILE, MANIFEST_FILE};
    use sluice_backend::{Dtype, WeightFormat};

    /// A packed directory with one layer of `experts` tiny bf16 experts; block `e` is filled
    /// with byte `e`.
    fn tiny_store(experts: usize) -> (tempfile::TempDir, Manifest) {
        let dir = tempfile::tempdir().unwrap();
        let f = WeightFormat::Dense(Dtype::Bf16);
        let projs = vec![
            ("gate_proj".to_string(), 4, 64, f),
            ("up_proj".to_string(), 4, 64, f),
            ("down_proj".to_string(), 64, 4, f),
        ];
        let mut l = LayerExperts::plan(0, "model.layers.0.mlp".into(), experts, 0, &projs);
        let mut bytes = Vec::new();
        for e in 0..experts {
            let block = vec![e as u8; l.stride as usize];
            l.checksums.push(checksum(&block));
            bytes.extend(block);
        }
        std::fs::write(dir.path().join(EXPERTS_FILE), bytes).unwrap();
        let m = Manifest::new(vec![l]);
        std::fs::write(
            dir.path().join(MANIFEST_FILE),
            serde_json::to_string(&m).unwrap(),
        )
        .unwrap();
        (dir, m)
    }

    fn open(dir: &Path, slots: usize, policy: Policy) -> ExpertStore {
        let m = Manifest::open(dir).unwrap().unwrap();
        let opts = StoreOptions {
            cache_bytes: slots as u64 * m.max_stride(),
            policy,
            io: ReaderOptions {
                kind: IoKind::Auto,
                direct: true,
                queue_depth: 4,
            },
            verify: true,
            min_slots: 1,
        };
        ExpertStore::open(dir, &opts).unwrap()
    }

    #[test]
    fn fetched_blocks_hold_their_expert_and_stay_pinned() {
        let (dir, _) = tiny_store(8);
        let store = open(dir.path(), 2, Policy::Lru);
        let got = store.fetch(0, &[3, 5]).unwrap();
        assert_eq!(got[0].gate.data.as_slice()[0], 3);
        assert_eq!(got[1].down.data.as_slice()[7], 5);
        // Both slots are pinned by `got`: a third expert cannot be placed.
        let err = store.fetch(0, &[6]).err().expect("no free slot");
        assert!(err.to_string().contains("slots"), "{err}");
        drop(got);
        let again = store.fetch(0, &[6]).unwrap();
        assert_eq!(again[0].up.data.as_slice()[0], 6);
        let s = store.stats();
        // The refused request counts as asked for and missed, but read nothing.
        assert_eq!((s.requests, s.misses, s.blocks_read), (4, 4, 3));
        assert!(store.fetch(0, &[8]).is_err(), "expert out of range");
        assert!(store.fetch(1, &[0]).is_err(), "layer without experts");
    }

    #[test]
    fn frequency_policy_keeps_a_hot_expert_through_scans_that_flush_lru() {
        // Expert 0 is used between scans of 4 distinct cold experts; the cache has 4 slots.
        let (dir, _) = tiny_store(16);
        let mut hits = Vec::new();
        for policy in [Policy::Lru, Policy::Frequency] {
            let store = open(dir.path(), 4, policy);
            let mut cold = 1u32;
            for _ in 0..40 {
                drop(store.fetch(0, &[0]).unwrap());
                for _ in 0..4 {
                    drop(store.fetch(0, &[cold]).unwrap());
                    cold = cold % 15 + 1;
                }
            }
            hits.push(store.stats().hits);
        }
        let (lru, freq) = (hits[0], hits[1]);
        assert!(lru <= 2, "LRU hits {lru}");
        assert!(freq >= 35, "frequency hits {freq}");
    }

    #[test]
    fn prefetched_blocks_are_used_by_the_next_fetch() {
        let (dir, _) = tiny_store(8);
        let store = open(dir.path(), 4, Policy::Frequency);
        store.prefetch(0, &[1, 2]);
        let got = store.fetch(0, &[1, 2, 3]).unwrap();
        assert_eq!(got[2].gate.data.as_slice()[0], 3);
        let s = store.stats();
        assert_eq!(s.prefetch_issued, 2);
        assert_eq!(s.prefetch_useful, 2);
        assert_eq!(s.misses, 1);
        assert_eq!(s.blocks_read, 3, "no block read twice");
    }

    #[test]
    fn a_corrupt_block_is_an_error_and_is_not_cached() {
        let (dir, m) = tiny_store(4);
        let path = dir.path().join(EXPERTS_FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[m.layers[0].block_offset(2) as usize + 100] ^= 1;
        std::fs::write(&path, bytes).unwrap();
        let store = open(dir.path(), 2, Policy::Lru);
        let err = store.fetch(0, &[1, 2]).err().expect("corrupt").to_string();
        assert!(
            err.contains("expert 2") && err.contains("checksum mismatch"),
            "{err}"
        );
        // The good block still works, and the bad one fails again rather than being served.
        assert!(store.fetch(0, &[1]).is_ok());
        assert!(store.fetch(0, &[2]).is_err());
        assert_eq!(store.stats().errors, 2);
    }
}
