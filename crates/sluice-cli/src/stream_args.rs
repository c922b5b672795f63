//! Flags that set up expert streaming for packed model directories (`sluice pack`).

use anyhow::{anyhow, Result};
use clap::{Args, ValueEnum};
use sluice_engine::streaming::StreamingOptions;
use sluice_store::{IoKind, Policy, Verify};
use sluice_sys::ByteSize;

#[derive(Clone, Copy, ValueEnum)]
pub enum PolicyArg {
    /// Evict the expert with the lowest recent use count (decayed), then the least recent.
    Frequency,
    /// Evict the least recently used expert.
    Lru,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum IoArg {
    /// io_uring where the kernel allows it, else a pread thread pool.
    Auto,
    Uring,
    Threads,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum VerifyArg {
    /// The first time each block is read, and again after experts.bin changes (its size or
    /// times): catches a damaged or rewritten file at a fraction of the cost.
    Once,
    /// Every read (a pass over every byte read, on the thread about to use it).
    Always,
    /// Never.
    Off,
}

#[derive(Args, Clone)]
pub struct StreamArgs {
    /// Total memory for the model: resident weights + expert cache + working memory (e.g.
    /// 10GiB); the expert cache gets what is left. Unpacked models then stream their experts
    /// too (a safetensors checkpoint with buffered reads, where `sluice pack` makes streaming
    /// faster; a GGUF's experts as the file stores them, converted as they are read).
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<ByteSize>,
    /// GPU memory for the model (e.g. 8GiB): resident weights, KV caches and activations, and a
    /// VRAM cache of the most used experts in the rest. When the host cache (--memory-budget)
    /// holds every expert, the GPU reads the others there in place over PCIe while decoding,
    /// and copies a prompt's in bulk into a few staging slots (an eighth of the cache at most);
    /// else they are copied in from the host cache or read from disk as they stream. Default:
    /// the free GPU memory less 1 GiB. Unpacked models then stream their experts too. Ignored
    /// on the CPU.
    #[arg(long, value_name = "SIZE")]
    pub vram_budget: Option<ByteSize>,
    /// GPU decoding with experts read in place from host memory (above): the share of each
    /// layer's experts held in no VRAM slot that the CPU computes from its own copy while the
    /// GPU reads the others over PCIe. `auto` balances the two from measurement (the CPU takes
    /// more when the link is the slower side); `off` reads them all over the link; a number
    /// from 0 to 1 fixes the share. Ignored on the CPU.
    #[arg(long, default_value = "auto", value_name = "auto|off|SHARE")]
    pub cpu_experts: sluice_cuda::HostCompute,
    /// Expert cache eviction policy.
    #[arg(long, value_enum, default_value = "frequency")]
    pub cache_policy: PolicyArg,
    /// How expert blocks are read.
    #[arg(long, value_enum, default_value = "auto")]
    pub io: IoArg,
    /// Expert reads in flight.
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub queue_depth: usize,
    /// Read through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// When an expert block read from a packed model is checked against its checksum.
    #[arg(long, value_enum, default_value = "once", value_name = "WHEN")]
    pub verify: VerifyArg,
    /// Never check the blocks' checksums (`--verify off`).
    #[arg(long, conflicts_with = "verify")]
    pub no_verify: bool,
}

impl StreamArgs {
    /// [`StreamArgs::options`] for a run on `backend`: a VRAM budget applies to a GPU (and then
    /// streams an unpacked model's experts too, into the VRAM cache); the CPU ignores it, saying
    /// so.
    pub fn options_on<B: sluice_backend::Backend>(
        &self,
        expert_cache: Option<ByteSize>,
        backend: &B,
    ) -> Result<StreamingOptions> {
        let mut opts = self.options(expert_cache)?;
        if opts.vram_budget.is_some() {
            if backend.has_device_memory() {
                opts.stream_unpacked = true;
            } else {
                eprintln!("sluice: --vram-budget is ignored on the CPU");
                opts.vram_budget = None;
            }
        }
        Ok(opts)
    }

    /// The engine's options, with `expert_cache` if given.
    pub fn options(&self, expert_cache: Option<ByteSize>) -> Result<StreamingOptions> {
        if self.queue_depth == 0 {
            return Err(anyhow!("--queue-depth must be at least 1"));
        }
        Ok(StreamingOptions {
            expert_cache: expert_cache.map(ByteSize::bytes),
            memory_budget: self.memory_budget.map(ByteSize::bytes),
            policy: match self.cache_policy {
                PolicyArg::Frequency => Policy::Frequency,
                PolicyArg::Lru => Policy::Lru,
            },
            io: match self.io {
                IoArg::Auto => IoKind::Auto,
                IoArg::Uring => IoKind::Uring,
                IoArg::Threads => IoKind::Threads,
            },
            queue_depth: self.queue_depth,
            direct: !self.buffered,
            verify: match (self.no_verify, self.verify) {
                (true, _) | (_, VerifyArg::Off) => Verify::Off,
                (_, VerifyArg::Once) => Verify::Once,
                (_, VerifyArg::Always) => Verify::Always,
            },
            // Asking for a cache streams unpacked checkpoints too (packed ones always stream).
            stream_unpacked: expert_cache.is_some() || self.memory_budget.is_some(),
            vram_budget: self.vram_budget.map(ByteSize::bytes),
            pinner: None,
            faults: None,
            state_reserve: None,
        })
    }
}
