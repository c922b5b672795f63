//! What a backend offers the tiers of a streamed model's experts beyond the expert store: its
//! own cache of experts between calls (a GPU's VRAM), and page-locked host memory, so that the
//! store's cache (host RAM) copies to the device at the link's full speed.

/// How a backend's own expert cache was sized ([`crate::Backend::plan_expert_cache`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertCachePlan {
    /// Experts it holds at once.
    pub slots: usize,
    /// Bytes per slot (one expert's three projections).
    pub slot_bytes: u64,
    /// Where the size comes from, for the user.
    pub reason: String,
}

impl ExpertCachePlan {
    pub fn bytes(&self) -> u64 {
        self.slots as u64 * self.slot_bytes
    }
}

/// Counters of a backend's expert cache since it was made.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertCacheStats {
    /// Experts asked for ([`crate::Backend::staged_expert`]) and found.
    pub hits: u64,
    /// Experts uploaded into a slot ([`crate::Backend::stage_expert`]).
    pub misses: u64,
    /// Experts uploaded for one call only: every slot was in use by the same call, or each
    /// unused slot held an expert used more often than this one. Experts kept in host memory:
    /// the routed pairs of a prompt's experts staged in VRAM for its call.
    pub bypassed: u64,
    /// Slots whose expert was replaced.
    pub evictions: u64,
    pub bytes_uploaded: u64,
    /// Of those, copied from page-locked host memory (at the link's full speed).
    pub bytes_pinned: u64,
    /// Seconds the device spent on those copies.
    pub upload_secs: f64,
    /// Experts the kernels read in place from host memory, not held (experts kept in host
    /// memory: [`crate::Backend::experts_in_host`]); one per routed (token, expert) pair.
    pub read_in_place: u64,
    /// The bytes of those reads (over the host link).
    pub bytes_read_in_place: u64,
    /// Experts kept in host memory copied into a slot between calls (counted in
    /// `bytes_uploaded`; not requests, so not in the hit rate).
    pub placed: u64,
    /// Experts kept in host memory computed there by the CPU instead of read over the link,
    /// one per routed (token, expert) pair.
    pub host_computed: u64,
    /// The bytes the CPU read for them (each expert once per call).
    pub bytes_host_computed: u64,
    /// Seconds the CPU spent on them (beside the device).
    pub host_secs: f64,
    /// The share of the misses the CPU takes now (`None`: the CPU computes none).
    pub host_share: Option<f64>,
}

impl ExpertCacheStats {
    /// The counters accumulated since `earlier`.
    pub fn since(&self, earlier: &ExpertCacheStats) -> ExpertCacheStats {
        ExpertCacheStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            bypassed: self.bypassed - earlier.bypassed,
            evictions: self.evictions - earlier.evictions,
            bytes_uploaded: self.bytes_uploaded - earlier.bytes_uploaded,
            bytes_pinned: self.bytes_pinned - earlier.bytes_pinned,
            upload_secs: self.upload_secs - earlier.upload_secs,
            read_in_place: self.read_in_place - earlier.read_in_place,
            bytes_read_in_place: self.bytes_read_in_place - earlier.bytes_read_in_place,
            placed: self.placed - earlier.placed,
            host_computed: self.host_computed - earlier.host_computed,
            bytes_host_computed: self.bytes_host_computed - earlier.bytes_host_computed,
            host_secs: self.host_secs - earlier.host_secs,
            host_share: self.host_share,
        }
    }

    /// Share of experts asked for that were already held.
    pub fn hit_rate(&self) -> f64 {
        let asked =
            self.hits + self.misses + self.bypassed + self.read_in_place + self.host_computed;
        if asked == 0 {
            return 0.0;
        }
        self.hits as f64 / asked as f64
    }

    /// The CPU's throughput over the experts it computed, GB/s.
    pub fn host_gbps(&self) -> f64 {
        if self.host_secs <= 0.0 {
            return 0.0;
        }
        self.bytes_host_computed as f64 / self.host_secs / 1e9
    }

    /// Copy throughput while copying, GB/s.
    pub fn upload_gbps(&self) -> f64 {
        if self.upload_secs <= 0.0 {
            return 0.0;
        }
        self.bytes_uploaded as f64 / self.upload_secs / 1e9
    }
}

/// Page-locks host memory for fast, asynchronous copies to a device. The memory is given as an
/// address and length (the caller owns it and keeps it alive while the returned region lives).
pub trait HostPinner: Send + Sync {
    /// Locks `len` bytes at `addr`; they are unlocked when the returned region drops.
    fn pin(&self, addr: usize, len: usize) -> Result<Box<dyn PinnedRegion>, crate::BackendError>;
}

/// Page-locked host memory; dropping it unlocks the memory.
pub trait PinnedRegion: Send + Sync {}
