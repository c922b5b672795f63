//! The store's counters.

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
