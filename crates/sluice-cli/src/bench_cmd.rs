//! `sluice bench`: speed next to the machine's limits, in one run.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::json;
use sluice_backend::Backend;
use sluice_backend::KvFormat;
use sluice_bench::limits::{self, DiskOptions};
use sluice_bench::model::{markdown_table, run_model, LimitRates, RunSettings, Test};
use sluice_engine::sampler::SamplingParams;
use sluice_engine::speculate::Speculation;
use sluice_engine::{Engine, LoadOptions};
use sluice_sys::{format_bytes, format_bytes_binary, ByteSize};

#[derive(Args)]
#[command(after_help = "Examples:\n  \
    sluice bench -m ./Qwen3-30B-A3B-4bit --memory            pp512 + tg128, 3 repetitions, vs DRAM\n  \
    sluice bench -m ./m -p 0 -n 32,128 -t 1,2 -k 4,8           sweep threads and experts per token\n  \
    sluice bench --disk --file ./m/model-00001-of-00004.safetensors   only the disk limit\n  \
    sluice bench -m ./m --memory --disk --json > run.json\n\n\
Each row reports tok/s as mean ± sample sd over the repetitions (after one untimed warm-up), the \
weight bytes each token reads, and tok/s x bytes/token as a fraction of the limit that bounds it: \
DRAM read bandwidth (--memory) when the weights fit in available memory, else the disk (--disk).")]
pub struct BenchArgs {
    /// Model directories to benchmark (repeat or comma-separate) [default: $SLUICE_MODEL, else
    /// the bundled demo model, unless only --memory/--disk are asked for].
    #[arg(long, short = 'm', value_name = "DIR", value_delimiter = ',')]
    model: Vec<PathBuf>,
    /// Prompt lengths to process (comma-separated; 0 skips).
    #[arg(long, short = 'p', value_delimiter = ',', default_value = "512")]
    prompt: Vec<usize>,
    /// Numbers of tokens to generate (comma-separated; 0 skips).
    #[arg(long, short = 'n', value_delimiter = ',', default_value = "128")]
    generate: Vec<usize>,
    /// Requests that generate together (comma-separated): `-n 64 -b 1,8` runs tg64 alone and
    /// `tg64x8`, eight requests decoding one token each per forward pass (as `serve` batches
    /// them); tok/s counts every request's tokens.
    #[arg(long, short = 'b', value_delimiter = ',', default_value = "1")]
    batch: Vec<usize>,
    /// Repetitions of each test.
    #[arg(long, short = 'r', default_value_t = 3)]
    repetitions: usize,
    /// Thread counts to run (comma-separated; default: all cores).
    #[arg(long, short = 't', value_delimiter = ',')]
    threads: Vec<usize>,
    /// Routed experts per token to run (comma-separated; default: the model's).
    #[arg(long, short = 'k', value_delimiter = ',')]
    experts_per_token: Vec<usize>,
    /// Skip the untimed warm-up run of each test.
    #[arg(long)]
    no_warmup: bool,
    /// Measure the memory bandwidth the model runs against first: DRAM read (all threads) on the
    /// CPU, a device-to-device copy on a GPU.
    #[arg(long)]
    memory: bool,
    /// Where the models run: `auto` (the first GPU when one is usable, else the CPU), `cpu`,
    /// `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto", value_name = "DEVICE")]
    device: crate::device::Device,
    /// Kernels to run (comma-separated, each a run of every test on the CPU): `fast` (integer
    /// 4-bit products; the default) and/or `exact` (f32). `--kernels fast,exact` compares them
    /// in one run. A GPU takes the first: `fast` runs prompts' 4- and 8-bit products on 8-bit
    /// activations (integer tensor cores; with `SLUICE_CUDA_FAST_DECODE=1` one token's 4-bit
    /// products too, with dp4a), `exact` in f32.
    #[arg(long, value_delimiter = ',', value_name = "fast|exact")]
    kernels: Vec<sluice_cpu::Kernels>,
    /// Measure disk throughput first (O_DIRECT; sequential, and random blocks at queue depth 1
    /// and N) on --file, else on the first model's experts.bin (packed), largest safetensors
    /// file, or GGUF file.
    #[arg(long)]
    disk: bool,
    /// File for --disk.
    #[arg(long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// Random-read size for --disk (default: 2MiB, about one expert block).
    #[arg(long, value_name = "BYTES", default_value = "2MiB")]
    block: ByteSize,
    /// Reads in flight for the parallel --disk pattern.
    #[arg(long, default_value_t = 8, value_name = "N")]
    disk_queue_depth: usize,
    /// Seconds per --disk pattern.
    #[arg(long, default_value_t = 2.0)]
    disk_seconds: f64,
    /// Expert cache sizes to run with (comma-separated, e.g. 2GiB,4GiB). Unpacked models stream
    /// through a cache of that size too; `off` runs them memory-mapped (packed ones then get the
    /// default cache), so `off,4GiB` compares the two in one run.
    #[arg(long, value_delimiter = ',', value_name = "SIZE")]
    expert_cache: Vec<CacheArg>,
    /// Generation tests start after an untimed prefill of this many random tokens (decoding
    /// at a long context; the prefill's speed is printed).
    #[arg(long, short = 'd', default_value_t = 0, value_name = "TOKENS")]
    depth: usize,
    /// Tokens per prefill pass (see `sluice generate --help`).
    #[arg(long, short = 'u', default_value_t = sluice_engine::PREFILL_CHUNK, value_name = "TOKENS")]
    ubatch: usize,
    /// KV cache formats to run (comma-separated: f32, f16, bf16, q8, q4), each a run of every
    /// test; a derived expert cache leaves room for one request's state at the longest test.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "f32",
        value_name = "FORMAT"
    )]
    kv_cache: Vec<KvFormat>,
    #[command(flatten)]
    stream: crate::stream_args::StreamArgs,
    /// Speculative decoding settings to run (comma-separated: `off`, `lookup`, `replay`), each
    /// a run of every test. With it, `-n N` runs "tgN echo": N tokens generated greedily
    /// through the engine after a prompt whose answer repeats it (64 random tokens S, the
    /// model's own continuation of S, then S again), timed after the first token; rows give the
    /// share of drafted tokens kept and the tokens per forward pass. `replay` drafts the answer
    /// itself (recorded by an untimed run): every draft is kept, the most any drafter can give,
    /// and what a random-weight model (which repeats nothing) can still measure.
    /// `draft` drafts with --draft-model, `mtp` with the model's multi-token-prediction layer.
    /// `--speculate off,lookup,replay` compares.
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "off|mtp|lookup|draft|replay"
    )]
    speculate: Vec<String>,
    /// The draft model of `--speculate draft` (same tokenizer, loaded on the same device).
    #[arg(long, value_name = "DIR|FILE.gguf")]
    draft_model: Option<PathBuf>,
    /// Tokens drafted per pass (comma-separated: each a run; default 4).
    #[arg(long, value_delimiter = ',', value_name = "K")]
    draft_tokens: Vec<usize>,
    /// Generation tests choose each token as `generate` does with the model's sampling defaults
    /// (generation_config.json; Qwen's top-k 20 and top-p 0.8-0.95), a sampler per request
    /// seeded from --seed, instead of greedily (llama-bench's way, and the default here); rows
    /// say "sampled". The next input is still a random token.
    #[arg(long)]
    sample: bool,
    /// With --sample (implied): the temperature instead of the model's.
    #[arg(long, value_name = "T")]
    temperature: Option<f32>,
    /// With --sample (implied): keep the K most likely tokens (0 = off) instead of the model's.
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// With --sample (implied): the nucleus mass (1 = off) instead of the model's.
    #[arg(long, value_name = "P")]
    top_p: Option<f32>,
    /// Print JSON instead of markdown.
    #[arg(long)]
    json: bool,
    /// Random seed for the prompt tokens.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// One `--expert-cache` value: a size, or `off` (the model as it loads without the flag).
#[derive(Clone, Copy)]
enum CacheArg {
    Off,
    Size(ByteSize),
}

impl FromStr for CacheArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "off" {
            return Ok(CacheArg::Off);
        }
        s.parse()
            .map(CacheArg::Size)
            .map_err(|e| format!("{e}; or `off`"))
    }
}

pub fn run(a: BenchArgs) -> Result<()> {
    if a.batch.contains(&0) {
        bail!("--batch takes request counts of 1 or more");
    }
    let mut kernels = a.kernels.clone();
    if kernels.is_empty() {
        kernels.push(sluice_cpu::Kernels::Fast);
    }
    match crate::device::pick(a.device, kernels[0], a.stream.cpu_experts)? {
        crate::device::Picked::Cpu(b) => {
            // One CPU backend per `--kernels` value; rows name theirs when there are several.
            let mut backends = vec![(b, String::new())];
            if kernels.len() > 1 {
                backends = kernels
                    .iter()
                    .map(|&k| {
                        let b = sluice_cpu::CpuBackend::with_kernels(k);
                        (Arc::new(b), format!("{} kernels", k.name()))
                    })
                    .collect();
            }
            run_on(&backends, a, false)
        }
        crate::device::Picked::Cuda(b) => run_on(&[(b, String::new())], a, true),
    }
}

/// The benchmarks on each of `backends` (with the label of its rows); `gpu` picks the memory
/// limit (`--memory`): a device copy.
fn run_on<B: Backend + 'static>(
    backends: &[(Arc<B>, String)],
    mut a: BenchArgs,
    gpu: bool,
) -> Result<()> {
    let backend = &backends[0].0;
    if a.model.is_empty() && !a.memory && !a.disk {
        a.model.push(crate::model_dir(None)?);
    }
    if a.threads.contains(&0) {
        bail!("--threads must be at least 1");
    }
    let threads = if a.threads.is_empty() {
        vec![std::thread::available_parallelism().map_or(1, |n| n.get())]
    } else {
        a.threads.clone()
    };
    let max_threads = *threads.iter().max().expect("one thread count");
    let mut rates = LimitRates::default();
    let mut limits_json = serde_json::Map::new();
    if a.memory && gpu {
        eprintln!(
            "measuring {}'s memory bandwidth (device-to-device copy)...",
            backend.describe()
        );
        let gbps = limits::backend_copy_gbps(backend.as_ref(), 2 << 30)?;
        rates.memory_read_gbps = Some(gbps);
        limits_json.insert("device_copy_gbps".into(), json!(gbps));
        // The link streamed experts cross (page-locked host memory to the device).
        let up = limits::backend_upload_gbps(backend.as_ref(), 1 << 30)?;
        rates.upload_gbps = Some(up);
        limits_json.insert("host_to_device_gbps".into(), json!(up));
    } else if a.memory {
        eprintln!("measuring DRAM read bandwidth ({max_threads} threads)...");
        let m = limits::memory_read(max_threads, limits::DEFAULT_MEMORY_BYTES);
        rates.memory_read_gbps = Some(m.gbps);
        limits_json.insert("memory".into(), json!(m));
    }
    if a.disk {
        let file = match &a.file {
            Some(f) => f.clone(),
            None => match a.model.first() {
                // A packed model streams from its blocks file: measure that one.
                Some(m) if m.join("experts.bin").is_file() => m.join("experts.bin"),
                Some(m) => limits::default_disk_file(m)?,
                None => bail!("--disk needs --file FILE or --model DIR to read from"),
            },
        };
        let opts = DiskOptions {
            block: a.block.bytes() as usize,
            queue_depth: a.disk_queue_depth,
            seconds: a.disk_seconds,
            ..DiskOptions::new(file.clone())
        };
        eprintln!("measuring disk throughput on {}...", file.display());
        let d = limits::disk(&opts)?;
        // The pattern expert streaming issues: block-sized random reads, many in flight.
        // (Sequential reads of this virtual disk can be inflated by the host's cache.)
        rates.disk_gbps = Some(d.random_qdn.gbps);
        limits_json.insert("disk".into(), json!(d));
    }
    // Each speculation setting with each drafted length; none: generation tests as llama-bench's.
    let mut speculations = Vec::new();
    for method in &a.speculate {
        let ks: Vec<Option<usize>> = match (method.as_str(), a.draft_tokens.is_empty()) {
            ("off", _) | (_, true) => vec![None],
            _ => a.draft_tokens.iter().map(|&k| Some(k)).collect(),
        };
        for k in ks {
            let speculation = match method.as_str() {
                "replay" => Speculation::replay(k),
                _ => Speculation::from_args(method, k),
            };
            speculations.push(speculation.map_err(|e| anyhow::anyhow!(e))?);
        }
    }
    if !a.draft_tokens.is_empty() && speculations.is_empty() {
        bail!("--draft-tokens needs --speculate mtp, lookup, draft or replay");
    }
    let drafting = speculations
        .iter()
        .any(|s| matches!(s, Speculation::Draft { .. }));
    match (drafting, &a.draft_model) {
        (true, None) => bail!("--speculate draft needs --draft-model DIR"),
        (false, Some(_)) => bail!("--draft-model is used by --speculate draft"),
        _ => {}
    }
    let echo = !speculations.is_empty();
    if echo && a.batch.iter().any(|&b| b > 1) {
        bail!("--speculate runs one request (echo tests): drop --batch");
    }
    if echo && a.depth > 0 {
        bail!("--speculate's echo tests start from an empty context: drop --depth");
    }
    let settings = RunSettings {
        tests: a
            .prompt
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| Test::Prompt(n))
            .chain(a.generate.iter().filter(|&&n| n > 0).flat_map(|&n| {
                a.batch.iter().map(move |&b| match b {
                    _ if echo => Test::Echo(n),
                    1 => Test::Generate(n),
                    b => Test::Batch(n, b),
                })
            }))
            .collect(),
        repetitions: a.repetitions,
        threads,
        experts_per_token: if a.experts_per_token.is_empty() {
            vec![None]
        } else {
            a.experts_per_token.iter().map(|&k| Some(k)).collect()
        },
        warmup: !a.no_warmup,
        seed: a.seed,
        depth: a.depth,
        sampling: None,
    };
    let sample = a.sample || a.temperature.is_some() || a.top_k.is_some() || a.top_p.is_some();
    if sample && echo {
        bail!("--sample and --speculate: echo tests generate greedily; run them apart");
    }
    let mut results = Vec::new();
    let most_generated = a.generate.iter().max().copied().unwrap_or(0);
    let mut longest = a.prompt.iter().max().copied().unwrap_or(0).max(a.depth) + most_generated;
    if echo {
        // S, its continuation, S, then the answer.
        longest = longest.max(2 * sluice_bench::model::ECHO_SEED + 2 * most_generated);
    }
    // One run of the tests per speculation setting (`None`: without --speculate).
    let speculation_runs: Vec<Option<Speculation>> = if echo {
        speculations.iter().cloned().map(Some).collect()
    } else {
        vec![None]
    };
    let caches: Vec<Option<ByteSize>> = if a.expert_cache.is_empty() {
        vec![None]
    } else {
        a.expert_cache
            .iter()
            .map(|c| match c {
                CacheArg::Off => None,
                CacheArg::Size(s) => Some(*s),
            })
            .collect()
    };
    for dir in &a.model {
        for (((backend, variant), cache), kv) in backends
            .iter()
            .flat_map(|b| caches.iter().map(move |c| (b, c)))
            .flat_map(|bc| a.kv_cache.iter().map(move |kv| (bc, *kv)))
        {
            let opts = LoadOptions {
                streaming: a.stream.options_on(*cache, backend.as_ref())?,
                kv_format: kv,
                context: Some(longest),
                prefill_chunk: Some(a.ubatch),
                ..LoadOptions::default()
            };
            let variant = match (variant.as_str(), kv) {
                (v, KvFormat::F32) if a.kv_cache.len() == 1 => v.to_string(),
                ("", kv) => format!("kv {kv}"),
                (v, kv) => format!("{v}, kv {kv}"),
            };
            let mut engine = Engine::load(dir, backend.clone(), &opts)
                .with_context(|| format!("loading {}", dir.display()))?;
            let mut settings = settings.clone();
            if sample {
                let d = &engine.defaults;
                let params = SamplingParams {
                    temperature: a.temperature.unwrap_or(d.temperature),
                    top_k: a.top_k.unwrap_or(d.top_k),
                    top_p: a.top_p.unwrap_or(d.top_p),
                    ..d.clone()
                };
                params
                    .validate()
                    .map_err(|e| anyhow::anyhow!("invalid sampling settings: {e}"))?;
                eprintln!(
                    "  sampling: temperature {}, top-k {}, top-p {}",
                    params.temperature, params.top_k, params.top_p
                );
                settings.sampling = Some(params);
            }
            let variant = match (sample, variant.as_str()) {
                (false, v) => v.to_string(),
                (true, "") => "sampled".to_string(),
                (true, v) => format!("{v}, sampled"),
            };
            if let Some(draft) = &a.draft_model {
                let opts = LoadOptions {
                    kv_format: kv,
                    ..LoadOptions::default()
                };
                engine.load_draft(draft, &opts)?;
            }
            let info = engine.model.info();
            eprintln!(
                "{}: {} layers, {} experts ({} per token), {}; dense {} + experts {}{}",
                dir.display(),
                info.layers,
                info.experts,
                info.experts_per_token,
                info.weight_format,
                format_bytes(info.dense_bytes as u64),
                format_bytes(info.expert_bytes as u64),
                engine.store.as_ref().map_or(String::new(), |s| format!(
                    "; streaming, cache {} ({} slots, {})",
                    format_bytes(s.cache_bytes()),
                    s.slots(),
                    s.io_description()
                )),
            );
            for speculation in &speculation_runs {
                let variant = match speculation {
                    Some(s) if variant.is_empty() => format!("speculate {s}"),
                    Some(s) => format!("{variant}, speculate {s}"),
                    None => variant.clone(),
                };
                if let Some(s) = speculation {
                    engine.speculation = s.clone();
                }
                let first = results.len();
                results.extend(run_model(&mut engine, &settings, &rates, &mut |r| {
                    eprintln!(
                        "  {}{} K={} threads={}: {:.2} ± {:.2} tok/s{}",
                        r.test,
                        if variant.is_empty() {
                            String::new()
                        } else {
                            format!(" ({variant})")
                        },
                        r.experts_per_token,
                        r.threads,
                        r.tok_s,
                        r.tok_s_sd,
                        r.streaming.as_ref().map_or(String::new(), |st| format!(
                            ", hit {:.0}%, read {:.2} GB/s ({:.2} in flight)",
                            st.hit_rate * 100.0,
                            st.read_gbps_wall,
                            st.read_gbps
                        ))
                    );
                    if let Some(v) = &r.vram {
                        eprintln!(
                            "    VRAM cache {} in {} slots: hit {:.1}%{}, uploaded {} per token at {:.2} GB/s while copying{}, {:.0}% of the run copying",
                            format_bytes(v.cache_bytes),
                            v.slots,
                            v.stats.hit_rate() * 100.0,
                            if v.stats.read_in_place > 0 || v.stats.host_computed > 0 {
                                format!(
                                    ", read in place from host memory {} per token, computed by the CPU {} per token at {:.1} GB/s ({} pairs{})",
                                    format_bytes(v.read_in_place_bytes_per_token as u64),
                                    format_bytes(v.host_computed_bytes_per_token as u64),
                                    v.stats.host_gbps(),
                                    v.stats.host_computed,
                                    v.stats.host_share.map_or(String::new(), |s| format!(
                                        ", last share {:.0}% of the misses",
                                        s * 100.0
                                    )),
                                )
                            } else {
                                String::new()
                            },
                            format_bytes(v.uploaded_bytes_per_token as u64),
                            v.stats.upload_gbps(),
                            rates.upload_gbps.map_or(String::new(), |l| format!(
                                " ({:.0}% of the {l:.1} GB/s link)",
                                v.stats.upload_gbps() / l * 100.0
                            )),
                            v.copy_share * 100.0,
                        );
                    }
                })?);
                for r in &mut results[first..] {
                    r.variant = variant.clone();
                }
            }
        }
    }
    if a.json {
        let out = json!({
            "limits": {
                "memory_read_gbps": rates.memory_read_gbps,
                "disk_gbps": rates.disk_gbps,
                "detail": limits_json,
            },
            "runs": results,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    match rates.memory_read_gbps {
        Some(g) if gpu => println!(
            "{}: device-to-device copy {g:.0} GB/s, page-locked host to device {:.1} GB/s\n",
            backend.describe(),
            rates.upload_gbps.unwrap_or(0.0)
        ),
        Some(g) => println!("DRAM read, {max_threads} threads: {g:.1} GB/s\n"),
        None => {}
    }
    if let Some(d) = limits_json.get("disk") {
        println!(
            "| disk pattern ({}) | request | queue depth | GB/s | mean latency |",
            if d["direct"].as_bool() == Some(true) {
                "O_DIRECT"
            } else {
                "buffered"
            }
        );
        println!("|---|---|---|---|---|");
        for p in ["sequential", "random_qd1", "random_qdn"] {
            let p = &d[p];
            println!(
                "| {} | {} | {} | {:.2} | {:.2} ms |",
                p["name"].as_str().unwrap_or("?"),
                format_bytes_binary(p["request_bytes"].as_u64().unwrap_or(0)),
                p["queue_depth"],
                p["gbps"].as_f64().unwrap_or(0.0),
                p["mean_latency_ms"].as_f64().unwrap_or(0.0)
            );
        }
        for n in d["notes"].as_array().into_iter().flatten() {
            println!("note: {}", n.as_str().unwrap_or(""));
        }
        println!();
    }
    if !results.is_empty() {
        print!("{}", markdown_table(&results));
    }
    Ok(())
}
