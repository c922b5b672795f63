//! The store's counters, and the per-expert map of what happened lately ([`ExpertMap`]).

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

/// What happened to each routed expert lately, one byte per (layer, expert), for live views of
/// the cache (`sluice serve`'s `/stats/stream`). The store sets the bits under its lock as it
/// works; readers need no lock. [`IN_CACHE`](ExpertMap::IN_CACHE) is the expert's state now
/// (it holds a slot, ready or still loading); the other bits are events, kept until a reader
/// clears them ([`ExpertMap::snapshot`]), so a reader that samples every so often sees every
/// kind of event of the interval. One relaxed atomic OR per expert fetched: nothing next to the
/// fetch's lock.
pub struct ExpertMap {
    /// Decoder layer of each manifest layer, and where its experts start in `cells`.
    layers: Vec<(usize, usize, usize)>,
    cells: Box<[std::sync::atomic::AtomicU8]>,
}

impl ExpertMap {
    /// Holds a cache slot now (loading or ready).
    pub const IN_CACHE: u8 = 1;
    /// Asked for and found in the cache (or already being read by a prefetch).
    pub const HIT: u8 = 2;
    /// Read ahead by a prefetch.
    pub const READ_AHEAD: u8 = 4;
    /// Read on demand: asked for and not in the cache.
    pub const DEMAND_READ: u8 = 8;
    /// Lost its slot to another expert.
    pub const EVICTED: u8 = 16;
    /// The event bits (all but [`ExpertMap::IN_CACHE`]).
    pub const EVENTS: u8 = Self::HIT | Self::READ_AHEAD | Self::DEMAND_READ | Self::EVICTED;

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

    /// Sets `bits` for expert `e` of manifest layer `li` (out of range: ignored).
    pub(crate) fn mark(&self, li: usize, e: u32, bits: u8) {
        if let Some(c) = self.cell(li, e) {
            c.fetch_or(bits, Relaxed);
        }
    }

    /// Expert `e` of manifest layer `li` left the cache; `evicted` when another expert took its
    /// slot (a failed read also drops it).
    pub(crate) fn leave(&self, li: usize, e: u32, evicted: bool) {
        if let Some(c) = self.cell(li, e) {
            c.fetch_and(!Self::IN_CACHE, Relaxed);
            if evicted {
                c.fetch_or(Self::EVICTED, Relaxed);
            }
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

    /// Every expert's bits, layer by layer. With `clear`, the event bits are reset as they are
    /// read, so that the next snapshot shows the events since this one (one reader should
    /// clear; others read without).
    pub fn snapshot(&self, clear: bool) -> Vec<Vec<u8>> {
        self.layers
            .iter()
            .map(|&(_, start, n)| {
                self.cells[start..start + n]
                    .iter()
                    .map(|c| {
                        if clear {
                            c.fetch_and(!Self::EVENTS, Relaxed)
                        } else {
                            c.load(Relaxed)
                        }
                    })
                    .collect()
            })
            .collect()
    }
}
