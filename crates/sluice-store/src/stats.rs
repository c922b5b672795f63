//! The store's counters, and the per-expert map of what happened last ([`ExpertMap`]).

use std::sync::atomic::Ordering::Relaxed;

use serde::Serialize;

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
    /// Blocks read and checked against their checksums.
    pub blocks_verified: u64,
    /// Seconds `fetch` spent waiting for reads (not counting the checksums it compared
    /// meanwhile).
    pub io_wait_secs: f64,
    /// Seconds spent comparing blocks with their checksums.
    pub verify_secs: f64,
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
            blocks_verified: self.blocks_verified - earlier.blocks_verified,
            io_wait_secs: self.io_wait_secs - earlier.io_wait_secs,
            verify_secs: self.verify_secs - earlier.verify_secs,
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

/// What happened to each routed expert last, one byte per (layer, expert), for live views of
/// the cache (`sluice serve`'s `/stats/stream`). The store writes a byte under its lock at
/// every event; readers need no lock. A byte is [`IN_CACHE`](ExpertMap::IN_CACHE) (the expert
/// holds a slot now, ready or loading), the last [`ExpertEvent`] in bits 1-3
/// ([`ExpertMap::event`]) and [`FRESH`](ExpertMap::FRESH) when that event came after the last
/// clearing snapshot ([`ExpertMap::snapshot`]). The last event, not all of them: a reader that
/// samples while many tokens pass sees each expert's latest fate, so the shares of hits, reads
/// and evictions across the map follow the cache's rates. One relaxed store per expert fetched.
pub struct ExpertMap {
    /// Decoder layer of each manifest layer, and where its experts start in `cells`.
    layers: Vec<(usize, usize, usize)>,
    cells: Box<[std::sync::atomic::AtomicU8]>,
}

/// What last happened to an expert ([`ExpertMap`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ExpertEvent {
    /// Asked for and found in the cache (or already being read by a prefetch).
    Hit = 1,
    /// Read ahead by a prefetch.
    ReadAhead = 2,
    /// Asked for and not in the cache: read on demand.
    DemandRead = 3,
    /// Lost its slot to another expert.
    Evicted = 4,
}

impl ExpertMap {
    /// Holds a cache slot now (loading or ready).
    pub const IN_CACHE: u8 = 1;
    /// The last event came after the last clearing snapshot.
    pub const FRESH: u8 = 16;

    /// A map for layers given as (decoder layer, experts), in manifest order.
    pub fn new(layers: impl IntoIterator<Item = (usize, usize)>) -> ExpertMap {
        let mut at = 0;
        let layers: Vec<(usize, usize, usize)> = layers
            .into_iter()
            .map(|(layer, experts)| {
                at += experts;
                (layer, at - experts, experts)
            })
            .collect();
        ExpertMap {
            layers,
            cells: (0..at).map(|_| Default::default()).collect(),
        }
    }

    /// The last event recorded in a byte of [`ExpertMap::snapshot`].
    pub fn event(byte: u8) -> Option<ExpertEvent> {
        match (byte >> 1) & 7 {
            1 => Some(ExpertEvent::Hit),
            2 => Some(ExpertEvent::ReadAhead),
            3 => Some(ExpertEvent::DemandRead),
            4 => Some(ExpertEvent::Evicted),
            _ => None,
        }
    }

    /// Records `event` for expert `e` of manifest layer `li` (out of range: ignored). Callers
    /// hold the store's lock: writers never race.
    pub(crate) fn record(&self, li: usize, e: u32, event: ExpertEvent) {
        if let Some(c) = self.cell(li, e) {
            let cached = if event == ExpertEvent::Evicted {
                0
            } else {
                Self::IN_CACHE
            };
            c.store(cached | (event as u8) << 1 | Self::FRESH, Relaxed);
        }
    }

    /// Expert `e` of manifest layer `li` left the cache without being evicted (its read failed).
    pub(crate) fn forget(&self, li: usize, e: u32) {
        if let Some(c) = self.cell(li, e) {
            c.fetch_and(!Self::IN_CACHE, Relaxed);
        }
    }

    fn cell(&self, li: usize, e: u32) -> Option<&std::sync::atomic::AtomicU8> {
        let &(_, start, n) = self.layers.get(li)?;
        ((e as usize) < n).then(|| &self.cells[start + e as usize])
    }

    /// The decoder layers in map order, with their expert counts.
    pub fn layers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.layers.iter().map(|&(layer, _, n)| (layer, n))
    }

    /// Every expert's byte, layer by layer. With `clear`, [`ExpertMap::FRESH`] is reset as it
    /// is read, so that the next such snapshot marks the events since this one (one reader
    /// should clear; others read without).
    pub fn snapshot(&self, clear: bool) -> Vec<Vec<u8>> {
        self.layers
            .iter()
            .map(|&(_, start, n)| {
                self.cells[start..start + n]
                    .iter()
                    .map(|c| {
                        if clear {
                            c.fetch_and(!Self::FRESH, Relaxed)
                        } else {
                            c.load(Relaxed)
                        }
                    })
                    .collect()
            })
            .collect()
    }
}
