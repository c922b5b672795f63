//! `sluice info`: the plan before running: what is resident, what streams, how much each token
//! reads, the cache that fits, and the speed to expect from the measured bandwidths.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use sluice_bench::limits::{self, DiskOptions};
use sluice_engine::streaming::{plan_cache_for, safetensors_bytes, StateReserve, StreamingOptions};
use sluice_engine::{Engine, LoadOptions};
use sluice_sys::{format_bytes, ByteSize};

#[derive(Args)]
#[command(
    after_help = "Example:\n  sluice info -m ./Qwen3.5-35B-A3B-4bit-packed --memory-budget 10GiB\n\n\
The estimate assumes uniformly random routing (the hit rate equals the share of experts the cache \
holds); real routing is skewed, so real hit rates are higher. It prints two bounds: reads and \
compute one after the other, and reads fully hidden behind compute."
)]
pub struct InfoArgs {
    /// Model directory (packed or not), or a .gguf file (described: its architecture, metadata,
    /// tensor types and what running it takes).
    #[arg(long, short = 'm', value_name = "DIR|FILE.gguf")]
    model: PathBuf,
    /// Total memory for the model (resident weights + expert cache + working memory).
    #[arg(long, value_name = "SIZE")]
    memory_budget: Option<ByteSize>,
    /// Expert cache size (overrides --memory-budget).
    #[arg(long, value_name = "SIZE")]
    expert_cache: Option<ByteSize>,
    /// GPU memory for the model: prints the VRAM tier a GPU run would plan (resident weights,
    /// a reserve, and a VRAM expert cache in the rest).
    #[arg(long, value_name = "SIZE")]
    vram_budget: Option<ByteSize>,
    /// Page-locked host-to-GPU copy bandwidth in GB/s for that estimate (PCIe 4.0 x16 ~25,
    /// 5.0 x16 ~50; `sluice bench --device cuda --memory` measures it).
    #[arg(long, value_name = "GB/S", default_value_t = 25.0)]
    pcie_gbps: f64,
    /// DRAM read bandwidth in GB/s (default: measured now, ~1 s).
    #[arg(long, value_name = "GB/S")]
    memory_gbps: Option<f64>,
    /// Disk read bandwidth in GB/s (default: measured now on the model's largest file, ~3 s).
    #[arg(long, value_name = "GB/S")]
    disk_gbps: Option<f64>,
    /// A request's context in tokens: prints its state (KV cache and recurrent state) at that
    /// length, and whether the weights, the expert cache and that state fit --memory-budget
    /// (default: the state at 4096 tokens and at the model's full context).
    #[arg(long, value_name = "TOKENS")]
    context: Option<usize>,
    /// The KV cache format the state is sized in (f32, f16, bf16, q8, q4).
    #[arg(long, default_value = "f32", value_name = "FORMAT")]
    kv_cache: sluice_backend::KvFormat,
    /// Tokens per prefill pass, as a run's --ubatch: the working memory that pass needs is
    /// counted beside the state.
    #[arg(long, short = 'u', default_value_t = sluice_engine::PREFILL_CHUNK, value_name = "TOKENS")]
    ubatch: usize,
}

pub fn run(a: InfoArgs) -> Result<()> {
    if a.model.is_file() {
        return describe_gguf(&a.model);
    }
    let streaming = StreamingOptions {
        expert_cache: a.expert_cache.map(ByteSize::bytes),
        memory_budget: a.memory_budget.map(ByteSize::bytes),
        ..StreamingOptions::default()
    };
    // A tiny cache: loading only to read the shapes.
    let probe = LoadOptions {
        streaming: StreamingOptions {
            expert_cache: Some(0),
            ..streaming.clone()
        },
        kv_format: a.kv_cache,
        ..LoadOptions::default()
    };
    let engine = Engine::load(&a.model, crate::device::shape_probe(), &probe)
        .with_context(|| format!("loading {}", a.model.display()))?;
    let info = engine.model.info().clone();
    let packed = engine.store.is_some();
    let files = safetensors_bytes(&a.model);
    let experts_total = match &engine.store {
        Some(s) => s.manifest().total_block_bytes(),
        None => info.expert_bytes as u64,
    };
    let resident = if packed {
        files
    } else {
        files.saturating_sub(experts_total)
    };
    let moe_layers = engine
        .store
        .as_ref()
        .map_or(0, |s| s.manifest().layers.len());
    let per_expert = experts_total as f64 / info.experts.max(1) as f64; // all layers
    let k = info.experts_per_token;
    let experts_per_token = per_expert * k as f64;
    let dense_per_token = info.dense_bytes as f64;

    println!("{} ({})", a.model.display(), info.model_type);
    if info.experts == 0 {
        // A dense model (a draft model, say): no experts to stream or cache.
        println!(
            "  {} layers, dense (no routed experts); {}",
            info.layers, info.weight_format
        );
        println!(
            "  weights: {} (read every token: {}; embeddings: the rest)",
            format_bytes(resident),
            format_bytes(info.dense_bytes as u64)
        );
    } else {
        println!(
            "  {} layers, {} experts per MoE layer, {k} per token; {}",
            info.layers, info.experts, info.weight_format
        );
        println!(
            "  resident: {} (dense weights read every token: {}; embeddings: the rest)",
            format_bytes(resident),
            format_bytes(info.dense_bytes as u64)
        );
    }
    if let Some(mtp) = engine.model.mtp()? {
        println!(
            "  multi-token prediction: one layer, {} read per drafted token (--speculate mtp)",
            format_bytes(mtp.weight_bytes() as u64)
        );
    }
    if info.experts > 0 {
        println!(
            "  routed experts: {} in all, {} per expert across the layers{}",
            format_bytes(experts_total),
            format_bytes(per_expert as u64),
            if packed {
                format!(", {moe_layers} streamed layers (packed)")
            } else {
                " (not packed: memory-mapped; run `sluice pack` to stream them)".into()
            }
        );
        println!(
            "  bytes per token at K={k}: dense {} + experts {k} x {} = {}",
            format_bytes(dense_per_token as u64),
            format_bytes(per_expert as u64),
            format_bytes((dense_per_token + experts_per_token) as u64)
        );
    }

    // Packed or not, the cache that fits (for an unpacked model: what packing it would give),
    // leaving room for a request's state at --context as a run would.
    let pass_tokens = |n: usize| a.ubatch.min(n).max(1);
    // A CPU run's threads hold their attention scores beside the pass's activations.
    let scratch = sluice_cpu::prompt_scratch_bytes(a.context.unwrap_or(a.ubatch));
    let streaming = StreamingOptions {
        state_reserve: a.context.map(|n| StateReserve {
            state: (info.state_bytes_fixed + info.state_bytes_per_token * n) as u64,
            tokens: n,
            pass: (info.pass_bytes_per_token * pass_tokens(n)) as u64 + scratch,
            pass_tokens: pass_tokens(n),
        }),
        ..streaming
    };
    let plan = plan_cache_for(resident, experts_total, &streaming);
    let share = plan.cache_bytes as f64 / experts_total.max(1) as f64;
    if info.experts > 0 {
        println!(
            "  expert cache: {} = {:.0}% of the experts ({})",
            format_bytes(plan.cache_bytes),
            share * 100.0,
            plan.reason
        );
    }
    let state = (
        info.state_bytes_per_token,
        info.state_bytes_fixed,
        info.max_context,
        info.kv_format,
    );
    request_state(
        state,
        (info.pass_bytes_per_token, a.ubatch, scratch),
        a.context,
        resident,
        plan.cache_bytes,
        a.memory_budget,
    )?;

    let mem = match a.memory_gbps {
        Some(g) => g,
        None => limits::memory_read(0, 512 << 20).gbps,
    };
    let hit = share.min(1.0);
    let disk_bytes = (1.0 - hit) * experts_per_token;
    let mem_bytes = dense_per_token + hit * experts_per_token;
    let t_mem = mem_bytes / (mem * 1e9);
    let from_memory = format!(
        "{} from memory at {mem:.1} GB/s = {:.1} ms",
        format_bytes(mem_bytes as u64),
        t_mem * 1e3
    );
    // The disk is measured only when some expert bytes must come from it, and only on a file
    // large enough to measure (a tiny model's largest file is not).
    let disk = match a.disk_gbps {
        _ if disk_bytes <= 0.0 => None,
        Some(g) => Some(g),
        None => {
            let blocks = a.model.join("experts.bin");
            let file = if blocks.is_file() {
                blocks
            } else {
                limits::default_disk_file(&a.model)?
            };
            // A file that cannot be read is left to `limits::disk`, whose error names it.
            let size = std::fs::metadata(&file).map_or(u64::MAX, |m| m.len());
            if size < limits::MIN_DISK_FILE {
                println!(
                    "  per token: {from_memory}; {} from disk, not estimated: {} is {}, too small to \
                     measure the disk on (pass --disk-gbps)",
                    format_bytes(disk_bytes as u64),
                    file.display(),
                    sluice_sys::format_bytes_binary(size)
                );
                None
            } else {
                let d = limits::disk(&DiskOptions {
                    seconds: 1.0,
                    ..DiskOptions::new(file)
                })?;
                Some(d.sequential.gbps.max(d.random_qdn.gbps))
            }
        }
    };
    match disk {
        Some(disk) => {
            let t_disk = disk_bytes / (disk * 1e9);
            println!(
                "  per token: {from_memory}; {} from disk at {disk:.2} GB/s = {:.1} ms (hit rate {:.0}% if routing were uniform)",
                format_bytes(disk_bytes as u64),
                t_disk * 1e3,
                hit * 100.0
            );
            println!(
                "  estimate: {:.2} tok/s with reads after compute, {:.2} tok/s with reads hidden behind compute",
                1.0 / (t_mem + t_disk),
                1.0 / t_mem.max(t_disk)
            );
        }
        None if disk_bytes <= 0.0 => {
            println!(
                "  per token: {from_memory}; nothing from disk (the cache holds every expert)"
            );
            println!("  estimate: {:.2} tok/s", 1.0 / t_mem);
        }
        None => {}
    }
    if let Some(budget) = a.vram_budget {
        vram_plan(
            budget.bytes(),
            resident,
            experts_total,
            // One layer's expert (every layer of these families has routed experts).
            per_expert / (if packed { moe_layers } else { info.layers }).max(1) as f64,
            experts_per_token,
            a.pcie_gbps,
        );
    }
    Ok(())
}

/// One request's state (KV cache, growing per token; DeltaNet recurrent state, fixed) at
/// `context` tokens, or at 4096 and the full context; with a memory budget, whether weights,
/// expert cache and that state fit it together.
fn request_state(
    (per_token, fixed, max_context, format): (usize, usize, usize, sluice_backend::KvFormat),
    (pass_per_token, ubatch, scratch): (usize, usize, u64),
    context: Option<usize>,
    resident: u64,
    cache: u64,
    budget: Option<ByteSize>,
) -> Result<()> {
    let at = |n: usize| (fixed + per_token * n) as u64;
    let recurrent = if fixed > 0 {
        format!(" + recurrent state {}", format_bytes(fixed as u64))
    } else {
        String::new()
    };
    let mut lengths = match context {
        Some(0) => bail!("--context must be at least 1 token"),
        Some(n) if n > max_context => {
            bail!("--context {n} is past the model's context of {max_context} tokens")
        }
        Some(n) => vec![n],
        None => vec![4096.min(max_context), max_context],
    };
    lengths.dedup();
    let sizes: Vec<String> = lengths
        .iter()
        .map(|&n| format!("{} at {n} tokens", format_bytes(at(n))))
        .collect();
    println!(
        "  state per request: KV cache {} per token ({format}){recurrent}: {}",
        format_bytes(per_token as u64),
        sizes.join(", ")
    );
    let pass = |n: usize| (pass_per_token * ubatch.min(n).max(1)) as u64 + scratch;
    println!(
        "  prefill pass of {ubatch} tokens (--ubatch): {} working memory ({} per token and {} \
         of attention scores for the CPU's threads)",
        format_bytes(pass(ubatch)),
        format_bytes(pass_per_token as u64),
        format_bytes(scratch)
    );
    if let (Some(n), Some(budget)) = (context, budget) {
        let total = resident + cache + at(n) + pass(n);
        let verdict = if total <= budget.bytes() {
            "fits"
        } else {
            "does NOT fit: lower --expert-cache or --ubatch, or shorten the context"
        };
        println!(
            "  memory at {n} tokens: resident {} + expert cache {} + state {} + prefill pass {} = \
             {} of the {} budget: {verdict}",
            format_bytes(resident),
            format_bytes(cache),
            format_bytes(at(n)),
            format_bytes(pass(n)),
            format_bytes(total),
            format_bytes(budget.bytes())
        );
    }
    Ok(())
}

/// The VRAM tier a GPU run would plan within `budget`: what stays resident, the expert cache
/// in the rest, and the copies a token needs under uniform routing.
fn vram_plan(
    budget: u64,
    resident: u64,
    experts_total: u64,
    block: f64,
    experts_per_token: f64,
    pcie_gbps: f64,
) {
    let reserve = sluice_cuda::VRAM_RESERVE_BYTES;
    let need = resident + reserve;
    if budget < need {
        println!(
            "  VRAM budget {}: too small: the resident weights ({}) and the {} reserve need at \
             least {} (the CUDA context takes a few hundred MB more)",
            format_bytes(budget),
            format_bytes(resident),
            format_bytes(reserve),
            format_bytes(need)
        );
        return;
    }
    let cache = (budget - need).min(experts_total);
    let share = cache as f64 / experts_total.max(1) as f64;
    let copied = (1.0 - share) * experts_per_token;
    println!(
        "  VRAM budget {}: resident {} + reserve {}, expert cache {} = {:.0}% of the experts \
         (~{} slots; less the CUDA context's few hundred MB); per token {} over the link at \
         {pcie_gbps:.0} GB/s = {:.1} ms if routing were uniform (read in place from host RAM \
         when --memory-budget holds every expert, else copied in as they stream)",
        format_bytes(budget),
        format_bytes(resident),
        format_bytes(reserve),
        format_bytes(cache),
        share * 100.0,
        (cache as f64 / block.max(1.0)) as u64,
        format_bytes(copied as u64),
        copied / (pcie_gbps * 1e9) * 1e3,
    );
}

/// What a GGUF file holds: architecture, the shape metadata, tensor types and sizes.
fn describe_gguf(path: &std::path::Path) -> Result<()> {
    use sluice_format::gguf::GgufFile;
    let file = GgufFile::open(path)?;
    let arch = file.architecture().unwrap_or("(no general.architecture)");
    println!("{} (GGUF v{}, {arch})", path.display(), file.version);
    let keys = [
        "general.name",
        "block_count",
        "embedding_length",
        "expert_count",
        "expert_used_count",
        "context_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "rope.dimension_count",
        "expert_feed_forward_length",
        "expert_shared_feed_forward_length",
        // The Gated DeltaNet layers of qwen35moe and qwen3next.
        "full_attention_interval",
        "ssm.group_count",
        "ssm.time_step_rank",
        "ssm.state_size",
        "ssm.inner_size",
        "ssm.conv_kernel",
    ];
    for key in keys {
        let full = if key.starts_with("general.") {
            key.to_string()
        } else {
            format!("{arch}.{key}")
        };
        if let Some(v) = file.metadata(&full) {
            println!("  {full}: {v}");
        }
    }
    if let Some(tokens) = file
        .metadata("tokenizer.ggml.tokens")
        .and_then(|v| v.as_array())
    {
        println!("  tokenizer: {} tokens", tokens.len());
    }
    let mut by_type: Vec<(&str, usize, u64)> = Vec::new();
    for t in file.tensors() {
        let name = t.ggml_type.name();
        match by_type.iter_mut().find(|e| e.0 == name) {
            Some(e) => {
                e.1 += 1;
                e.2 += t.bytes;
            }
            None => by_type.push((name, 1, t.bytes)),
        }
    }
    by_type.sort_by_key(|e| std::cmp::Reverse(e.2));
    let total: u64 = file.tensors().iter().map(|t| t.bytes).sum();
    let parts = file.paths().len();
    let files = if parts > 1 {
        format!(
            "{parts} files of a split set, {} in all",
            format_bytes(file.file_bytes())
        )
    } else {
        format!("a {} file", format_bytes(file.file_bytes()))
    };
    println!(
        "  {} tensors, {} of weights in {files}",
        file.tensors().len(),
        format_bytes(total),
    );
    for (name, n, bytes) in by_type {
        let plural = if n == 1 { "" } else { "s" };
        println!("    {name}: {n} tensor{plural}, {}", format_bytes(bytes));
    }
    let experts: u64 = file
        .tensors()
        .iter()
        .filter(|t| t.name.contains("_exps."))
        .map(|t| t.bytes)
        .sum();
    if experts > 0 {
        println!(
            "  routed experts (stacked *_exps tensors): {}",
            format_bytes(experts)
        );
    }
    // Whether sluice runs it, and what the converted weights cost (read from the table only:
    // converting is what loading does).
    use sluice_format::ggml_quants::affine_bits_per_weight;
    if !sluice_format::GGUF_ARCHITECTURES.contains(&arch) {
        println!(
            "  sluice does not run `{arch}` GGUFs yet (it runs {}): use the model's safetensors \
             checkpoint",
            sluice_format::GGUF_ARCHITECTURES.join(", ")
        );
        return Ok(());
    }
    let (mut converted, mut converted_resident) = (0f64, 0f64);
    let mut missing = Vec::new();
    for t in file.tensors() {
        let elements = t.elements() as f64;
        let bytes = match t.ggml_type.name() {
            "F32" | "F16" | "BF16" => t.bytes as f64,
            name => match affine_bits_per_weight(t.ggml_type) {
                Some(bits) => elements * bits / 8.0,
                None => {
                    if !missing.contains(&name) {
                        missing.push(name);
                    }
                    0.0
                }
            },
        };
        converted += bytes;
        if !t.name.contains("_exps.") {
            converted_resident += bytes;
        }
    }
    if missing.is_empty() {
        println!(
            "  sluice runs it: quantised blocks become the same values as MLX-affine matrices at \
             load, ~{} in memory ({:.0}% of the file's weights); with its routed experts \
             streamed from the file (--memory-budget or --expert-cache, or by itself when that \
             does not fit) ~{} resident, and each expert read at the file's size",
            format_bytes(converted as u64),
            converted / total.max(1) as f64 * 100.0,
            format_bytes(converted_resident as u64),
        );
    } else {
        println!(
            "  sluice cannot run it yet: no support for {} (re-quantize with llama-quantize to \
             Q4_K_M, Q8_0, IQ4_XS or another K-, legacy or 4-bit codebook type)",
            missing.join(", ")
        );
    }
    Ok(())
}
