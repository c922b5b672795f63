//! Choosing the expert cache of a streamed model (packed, or unpacked when asked for): its size
//! from the user's flags or the machine's free memory, and the I/O settings.

use std::path::Path;

use sluice_store::{
    ExpertStore, IoKind, Manifest, Policy, ReaderOptions, StoreError, StoreOptions, UnpackedLayout,
};

/// Memory kept free for everything but weights and the expert cache (KV caches, activations,
/// the OS) when the cache size is derived.
pub const RESERVE_BYTES: u64 = 1 << 30;

/// Streaming settings (packed model directories always stream; unpacked ones when
/// `stream_unpacked` is set).
#[derive(Debug, Clone)]
pub struct StreamingOptions {
    /// Expert cache size in bytes.
    pub expert_cache: Option<u64>,
    /// Total memory for resident weights + expert cache + working memory; the cache gets the rest.
    pub memory_budget: Option<u64>,
    pub policy: Policy,
    pub io: IoKind,
    /// Reads in flight.
    pub queue_depth: usize,
    /// O_DIRECT reads (bypass the page cache).
    pub direct: bool,
    /// When a block read is checked against its checksum (packed directories only).
    pub verify: sluice_store::Verify,
    /// Stream the routed experts of an unpacked checkpoint too (buffered reads of each expert's
    /// slices) instead of keeping them all memory-mapped. Set when the user asks for a cache
    /// (`--expert-cache` or `--memory-budget`).
    pub stream_unpacked: bool,
    /// The most device memory a GPU backend may use in all, its expert cache getting what the
    /// rest leaves (`None`: the free memory less a margin). Ignored by the CPU.
    pub vram_budget: Option<u64>,
    /// Page-locks the expert cache for the backend's copies (set by [`crate::Engine::load`]).
    pub pinner: Option<sluice_store::Pinner>,
    /// Faults injected into the expert reads (tests of disk failures); None in normal use.
    pub faults: Option<std::sync::Arc<dyn sluice_store::ReadFaults>>,
    /// Memory a cache derived from the budget or the free memory leaves for one request.
    pub state_reserve: Option<StateReserve>,
}

/// What one request needs beside the weights and the expert cache, where they share memory (the
/// CPU): its state at the context asked for, and the working memory of a prefill pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StateReserve {
    /// The KV caches and recurrent states at `tokens` positions.
    pub state: u64,
    pub tokens: usize,
    /// A forward pass over `pass_tokens` tokens at once.
    pub pass: u64,
    pub pass_tokens: usize,
}

impl StateReserve {
    pub fn bytes(&self) -> u64 {
        self.state + self.pass
    }
}

impl Default for StreamingOptions {
    fn default() -> Self {
        StreamingOptions {
            expert_cache: None,
            memory_budget: None,
            policy: Policy::Frequency,
            io: IoKind::Auto,
            queue_depth: 16,
            direct: true,
            verify: sluice_store::Verify::Once,
            stream_unpacked: false,
            vram_budget: None,
            pinner: None,
            faults: None,
            state_reserve: None,
        }
    }
}

/// The expert cache a run will use, and why.
#[derive(Debug, Clone)]
pub struct CachePlan {
    pub cache_bytes: u64,
    /// Bytes of the resident weights (the packed directory's safetensors).
    pub resident_bytes: u64,
    pub expert_bytes: u64,
    pub reason: String,
}

pub use sluice_format::safetensors_bytes;

/// Sizes the cache: `--expert-cache` if given, else `--memory-budget` minus the resident
/// weights, a reserve and a request's state ([`StreamingOptions::state_reserve`]), else the
/// available memory minus the same; never more than all experts.
pub fn plan_cache(dir: &Path, manifest: &Manifest, opts: &StreamingOptions) -> CachePlan {
    plan_cache_for(safetensors_bytes(dir), manifest.total_block_bytes(), opts)
}

/// [`plan_cache`] from the resident and expert bytes.
pub fn plan_cache_for(resident: u64, experts: u64, opts: &StreamingOptions) -> CachePlan {
    let (want, reason) = if let Some(c) = opts.expert_cache {
        (c, "--expert-cache".to_string())
    } else if let Some(b) = opts.memory_budget {
        (
            b.saturating_sub(resident + RESERVE_BYTES / 2),
            format!(
                "--memory-budget minus {:.2} GB resident and {} MiB working memory",
                resident as f64 / 1e9,
                RESERVE_BYTES / 2 / (1 << 20)
            ),
        )
    } else {
        match sluice_sys::mem_available_bytes() {
            Some(avail) => (
                avail.saturating_sub(resident + RESERVE_BYTES),
                format!(
                    "available memory {:.2} GB minus {:.2} GB resident and a {} GiB reserve",
                    avail as f64 / 1e9,
                    resident as f64 / 1e9,
                    RESERVE_BYTES >> 30
                ),
            ),
            None => (
                4 << 30,
                "default 4 GiB (available memory unknown)".to_string(),
            ),
        }
    };
    // A derived cache leaves room for a request's state.
    let (want, reason) = match opts.state_reserve {
        Some(r) if opts.expert_cache.is_none() => (
            want.saturating_sub(r.bytes()),
            format!(
                "{reason}, less {} for a request's state at {} tokens and {} for a prefill pass \
                 of {} tokens",
                sluice_sys::format_bytes(r.state),
                r.tokens,
                sluice_sys::format_bytes(r.pass),
                r.pass_tokens
            ),
        ),
        _ => (want, reason),
    };
    CachePlan {
        cache_bytes: want.min(experts),
        resident_bytes: resident,
        expert_bytes: experts,
        reason,
    }
}

/// Opens the store of a packed directory with the planned cache.
pub fn open_store(
    dir: &Path,
    manifest: Manifest,
    opts: &StreamingOptions,
    experts_per_token: usize,
) -> Result<(ExpertStore, CachePlan), StoreError> {
    let plan = plan_cache(dir, &manifest, opts);
    let store = ExpertStore::from_manifest(
        dir,
        manifest,
        &StoreOptions {
            cache_bytes: plan.cache_bytes,
            policy: opts.policy,
            io: ReaderOptions {
                kind: opts.io,
                direct: opts.direct,
                queue_depth: opts.queue_depth.max(1),
                faults: opts.faults.clone(),
            },
            verify: opts.verify,
            min_slots: experts_per_token,
            pinner: opts.pinner.clone(),
        },
    )?;
    Ok((store, plan))
}

/// Opens a store streaming the routed experts of the unpacked checkpoint `dir`; `None` when it
/// has no routed experts.
pub fn open_unpacked_store(
    dir: &sluice_format::ModelDir,
    opts: &StreamingOptions,
    experts_per_token: usize,
) -> Result<Option<(ExpertStore, CachePlan)>, StoreError> {
    let layout = UnpackedLayout::for_model(dir)?;
    if layout.is_empty() {
        return Ok(None);
    }
    let experts = layout.expert_bytes();
    let resident = if dir.streamed_experts.is_empty() {
        safetensors_bytes(&dir.path).saturating_sub(experts)
    } else {
        // A GGUF whose experts stay in the file: everything it holds is resident.
        dir.tensors.iter().map(|t| t.bytes.len() as u64).sum()
    };
    // Sized in slots, like a packed directory's blocks (each part 64-byte aligned).
    let plan = plan_cache_for(resident, layout.manifest.total_block_bytes(), opts);
    let store = ExpertStore::from_unpacked(
        &dir.path,
        layout,
        &StoreOptions {
            cache_bytes: plan.cache_bytes,
            policy: opts.policy,
            io: ReaderOptions {
                kind: opts.io,
                // Only reads the layout aligned (a GGUF's converted experts) go O_DIRECT.
                direct: opts.direct,
                queue_depth: opts.queue_depth.max(1),
                faults: opts.faults.clone(),
            },
            verify: sluice_store::Verify::Off,
            min_slots: experts_per_token,
            pinner: opts.pinner.clone(),
        },
    )?;
    Ok(Some((store, plan)))
}
