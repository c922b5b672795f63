//! `sluice`: run Mixture-of-Experts language models larger than memory.
//!
//! The binary only parses arguments and prints; the work is done by `sluice-engine`.

#![forbid(unsafe_code)]

// Declared first: its macros are used by the command modules.
#[macro_use]
mod device;
mod bench_cmd;
mod chat_cmd;
mod info_cmd;
mod pack_cmd;
mod perplexity_cmd;
mod serve_cmd;
mod stream_args;
mod synth_cmd;

use std::io::Write;

/// Large buffers in mappings of their own, with huge pages: a prompt's passes fault their
/// activations in 512 times fewer steps (see `sluice_sys::LargePages`).
#[global_allocator]
static ALLOCATOR: sluice_sys::LargePages = sluice_sys::LargePages;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use sluice_backend::Backend;
use sluice_cpu::Kernels;
use sluice_engine::chat::ChatMessage;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::speculate::Speculation;
use sluice_engine::{Engine, Halt, LoadOptions, LogitsMode, TokenEvent};
use sluice_sys::{format_bytes, ByteSize};

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Run Mixture-of-Experts language models, streaming experts from disk",
    long_about = "Run Mixture-of-Experts language models (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, \
                  GLM-4.5 MoE, Mixtral) from a Hugging Face or mlx-community model directory: \
                  config.json, tokenizer.json and safetensors, in bf16/f16/f32 or MLX 4/8-bit \
                  quantisation, or from a llama.cpp GGUF file (the Qwen families).",
    after_help = "Examples:\n  \
        sluice generate --model ./Qwen3-30B-A3B-4bit --prompt \"Why is the sky blue?\" --chat -n 200\n  \
        sluice logits --model ./tiny --tokens 1,2,3 --mode prefill --out logits.npy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming tokens to stdout.
    Generate(GenerateArgs),
    /// Chat with a model in the terminal (history, streaming; /reset, /system, /quit; Ctrl-C
    /// stops an answer).
    Chat(chat_cmd::ChatArgs),
    /// Serve the OpenAI API (chat completions with tool calls, completions, SSE streaming) on
    /// loopback.
    Serve(serve_cmd::ServeArgs),
    /// Measure prompt and generation speed, next to the machine's memory and disk limits.
    Bench(bench_cmd::BenchArgs),
    /// Show the plan before running: resident and streamed bytes, bytes per token, the expert
    /// cache that fits, and the speed to expect from measured bandwidths.
    Info(info_cmd::InfoArgs),
    /// Write a random checkpoint with a real model's exact shapes (for benchmarks).
    Synth(synth_cmd::SynthArgs),
    /// Rewrite a checkpoint into the streaming layout: resident tensors + one aligned block per
    /// expert.
    Pack(pack_cmd::PackArgs),
    /// Write the logits at every position of a token list to a .npy file (to compare with
    /// another implementation).
    Logits(LogitsArgs),
    /// Score a text: perplexity window by window, and with --compare how far other KV cache
    /// formats move the predictions (mean KL divergence, argmax agreement).
    Perplexity(perplexity_cmd::PerplexityArgs),
}

#[derive(Args)]
pub(crate) struct ModelArgs {
    /// Model directory (config.json, tokenizer.json, *.safetensors), or a llama.cpp GGUF file
    /// (qwen3moe, qwen35moe, qwen3next, llama with experts (Mixtral), gpt-oss, glm4moe,
    /// deepseek2; quantised blocks are converted at load, but the routed
    /// experts stay in the file and stream from it when a cache is asked for or the converted
    /// weights would not fit in memory; any part of a split set NAME-00001-of-0000N.gguf opens
    /// the whole set) [default:
    /// $SLUICE_MODEL, else the demo model bundled in the repo, models/demo].
    #[arg(long, short = 'm', value_name = "DIR|FILE.gguf")]
    pub(crate) model: Option<PathBuf>,
    /// Where the model runs: `auto` (the first GPU when one is usable, else the CPU), `cpu`,
    /// `cuda` or `cuda:N`.
    #[arg(long, default_value = "auto", value_name = "DEVICE")]
    pub(crate) device: device::Device,
    /// Kernels for quantized weights: `fast` (the default, except for `logits`) or `exact`
    /// (f32, equal to mlx-lm to ~1e-6). `fast` on the CPU: 4-bit decode products in integers
    /// against 8-bit activations (memory-bound); on a GPU: prompt products of 4- and 8-bit
    /// weights against activations quantized to 8 bits per 32 columns on integer tensor cores
    /// (llama.cpp's arithmetic), decode unchanged (`SLUICE_CUDA_FAST_DECODE=1`: its 4-bit
    /// products per 16 columns with dp4a, not yet measured on a GPU).
    #[arg(long, value_name = "fast|exact")]
    pub(crate) kernels: Option<Kernels>,
    /// CPU worker threads (default: all cores).
    #[arg(long, short = 't')]
    threads: Option<usize>,
    /// Routed experts per token, overriding the config (fewer is faster, less accurate).
    #[arg(long, value_name = "K")]
    experts_per_token: Option<usize>,
    /// How attention caches store keys and values: `f32` (exact), `f16` or `bf16` (half the
    /// memory), `q8` (8-bit codes with an f16 scale per 32 values: 0.27x of f32) or `q4` (4-bit
    /// codes with an f16 scale and minimum per 32: 0.16x). The README's table gives what each
    /// costs in accuracy.
    #[arg(long, default_value = "f32", value_name = "f32|f16|bf16|q8|q4")]
    kv_cache: sluice_backend::KvFormat,
    /// The context in tokens that one request's state is sized for: an expert cache derived
    /// from --memory-budget or the free memory leaves room for its KV cache (longer prompts
    /// still run while memory allows; one that does not fit is refused before its prefill).
    #[arg(long, short = 'c', default_value_t = 4096, value_name = "TOKENS")]
    context: usize,
    /// Tokens per prefill pass (llama.cpp's --ubatch-size): a streamed model reads each expert
    /// a pass needs once for all its tokens, so larger passes read less from disk per prompt
    /// token, at the cost of working memory (about 250 kB per token on Qwen3.5-35B-A3B; an
    /// expert cache derived from --memory-budget or the free memory leaves room for it).
    #[arg(long, short = 'u', default_value_t = sluice_engine::PREFILL_CHUNK, value_name = "TOKENS")]
    ubatch: usize,
    /// Expert cache size, e.g. 6GiB (packed models default to the available memory minus the
    /// resident weights and 1 GiB; unpacked models stream their experts only when this or
    /// --memory-budget is given, or, for a GGUF, when its converted weights would not fit).
    #[arg(long, value_name = "SIZE")]
    expert_cache: Option<ByteSize>,
    #[command(flatten)]
    stream: stream_args::StreamArgs,
}

impl ModelArgs {
    /// `--kernels`, else the fast ones.
    pub(crate) fn kernels(&self) -> Kernels {
        self.kernels.unwrap_or(Kernels::Fast)
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long, short = 'p')]
    prompt: String,
    /// Maximum number of tokens to generate.
    #[arg(long = "max-tokens", short = 'n', default_value_t = 128)]
    max_tokens: usize,
    /// Print expert-streaming statistics per token and in total (packed models).
    #[arg(long)]
    stats: bool,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message (implies --chat).
    #[arg(long)]
    system: Option<String>,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    speculate: SpeculateArgs,
}

/// Speculative decoding flags (`generate`, `chat`, `serve`).
#[derive(Args, Clone)]
pub(crate) struct SpeculateArgs {
    /// Draft tokens and check them several per forward pass: `mtp` (the model's own
    /// multi-token-prediction layer, chained: official Qwen3.5 and Qwen3-Next checkpoints),
    /// `lookup` (the tokens that followed the last few tokens' latest earlier occurrence in the
    /// prompt or output: helps when the answer repeats its input, as code edits and quotes do),
    /// `draft` (a smaller model's greedy guesses: --draft-model) or `off`. The output is what
    /// decoding without it gives (greedy: the same tokens; sampled: the same distribution).
    #[arg(long, default_value = "off", value_name = "mtp|lookup|draft|off")]
    speculate: String,
    /// Tokens drafted per pass (default 4, 3 for mtp; at most 64; a pass checks at most what
    /// the backend decodes as one token: 14 drafts on the CPU, 7 on a GPU).
    #[arg(long, value_name = "K")]
    draft_tokens: Option<usize>,
    /// The draft model for `--speculate draft` (implied by this flag): a model directory or
    /// GGUF file with the same tokenizer, much smaller (e.g. Qwen3-0.6B for Qwen3-30B-A3B).
    /// It runs on the same device; its weights and state are not in --memory-budget.
    #[arg(long, value_name = "DIR|FILE.gguf")]
    draft_model: Option<PathBuf>,
}

impl SpeculateArgs {
    /// Sets `engine`'s speculation, loading the draft model if one is given.
    pub(crate) fn apply<B: Backend + 'static>(&self, engine: &mut Engine<B>) -> Result<()> {
        let method = match (self.speculate.as_str(), &self.draft_model) {
            ("off", Some(_)) => "draft",
            (m, _) => m,
        };
        engine.speculation =
            Speculation::from_args(method, self.draft_tokens).map_err(|e| anyhow::anyhow!(e))?;
        match (&engine.speculation, &self.draft_model) {
            (Speculation::Draft { .. }, Some(dir)) => {
                let opts = LoadOptions {
                    kv_format: engine.model.info().kv_format,
                    ..LoadOptions::default()
                };
                engine.load_draft(dir, &opts)?;
                eprintln!("sluice: drafting with {}", dir.display());
            }
            (Speculation::Draft { .. }, None) => {
                bail!("--speculate draft needs --draft-model DIR")
            }
            (_, Some(_)) => bail!(
                "--draft-model drafts for --speculate draft, not --speculate {}",
                self.speculate
            ),
            _ => {}
        }
        Ok(())
    }
}

/// Sampling flags shared by `generate` and `chat` (defaults: the model's generation_config.json).
#[derive(Args, Clone)]
pub(crate) struct SamplingArgs {
    /// Sampling temperature; 0 picks the most likely token (default: generation_config.json,
    /// else 0).
    #[arg(long)]
    temperature: Option<f32>,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probabilities sum to P (1 = off).
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long)]
    min_p: Option<f32>,
    /// Penalise tokens seen in the last 64 (1 = off; 1.1 is a mild setting).
    #[arg(long)]
    repetition_penalty: Option<f32>,
    /// Random seed, for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The flags over the model's defaults, checked.
    pub(crate) fn params(&self, defaults: &SamplingParams) -> Result<SamplingParams> {
        let d = defaults;
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            seed: self.seed,
            ..d.clone()
        };
        params
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid sampling settings: {e}"))?;
        Ok(params)
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum Mode {
    /// Feed the tokens one at a time through the caches.
    Decode,
    /// Run all tokens in one batch.
    Prefill,
}

#[derive(Args)]
struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',', required = true)]
    tokens: Vec<u32>,
    #[arg(long, value_enum, default_value = "prefill")]
    mode: Mode,
    /// Output file: little-endian float32, C order, shape [tokens, vocab].
    #[arg(long, short = 'o', value_name = "FILE.npy")]
    out: PathBuf,
}

fn main() {
    // A chat template renders in a child process of this binary, under a memory limit.
    sluice_engine::chat::serve_template_worker_if_asked();
    sluice_engine::chat::isolate_templates(own_executable());
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Serve(_)) {
        sluice_sys::die_quietly_on_closed_pipe();
    }
    let result = match cli.command {
        Command::Generate(a) => generate(a),
        Command::Logits(a) => logits(a),
        Command::Chat(a) => chat_cmd::run(a),
        Command::Serve(a) => serve_cmd::run(a),
        Command::Synth(a) => synth_cmd::run(a),
        Command::Pack(a) => pack_cmd::run(a),
        Command::Bench(a) => bench_cmd::run(a),
        Command::Info(a) => info_cmd::run(a),
        Command::Perplexity(a) => perplexity_cmd::run(a),
    };
    if let Some(report) = sluice_cpu::profile_report() {
        eprint!("{report}");
    }
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// This executable, for starting template renderers. On Linux `/proc/self/exe`, which still
/// runs when the file was replaced or deleted (an upgrade while a server runs).
fn own_executable() -> PathBuf {
    let proc_link = Path::new("/proc/self/exe");
    if proc_link.exists() {
        return proc_link.to_path_buf();
    }
    std::env::current_exe()
        .unwrap_or_else(|_| PathBuf::from(std::env::args_os().next().unwrap_or_default()))
}

/// The bundled demo model: `models/demo` of the source tree this binary was built from.
pub(crate) fn demo_model() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo");
    dir.canonicalize().unwrap_or(dir)
}

/// `--model`, else `$SLUICE_MODEL`, else the bundled demo model (said on stderr).
pub(crate) fn model_dir(model: Option<&Path>) -> Result<PathBuf> {
    if let Some(m) = model {
        return Ok(m.to_path_buf());
    }
    if let Some(m) = std::env::var_os("SLUICE_MODEL").filter(|m| !m.is_empty()) {
        return Ok(PathBuf::from(m));
    }
    let demo = demo_model();
    if !demo.join("config.json").is_file() {
        bail!(
            "no --model given and the bundled demo model is missing ({}); pass --model DIR",
            demo.display()
        );
    }
    eprintln!(
        "sluice: no --model given: using the bundled demo model ({})",
        demo.display()
    );
    Ok(demo)
}

/// Loads the model of `args` on `backend` (see [`device::with_engine`]).
pub(crate) fn load<B: Backend + 'static>(args: &ModelArgs, backend: Arc<B>) -> Result<Engine<B>> {
    let model = model_dir(args.model.as_deref())?;
    if let Some(n) = args.threads {
        if n == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("setting up the thread pool")?;
    }
    let opts = LoadOptions {
        experts_per_token: args.experts_per_token,
        kv_format: args.kv_cache,
        context: Some(args.context),
        prefill_chunk: Some(args.ubatch),
        streaming: args
            .stream
            .options_on(args.expert_cache, backend.as_ref())?,
    };
    Ok(Engine::load(&model, backend, &opts)?)
}

/// Prints what was loaded and how experts stream, to stderr.
pub(crate) fn print_banner<B: Backend>(engine: &Engine<B>) {
    let info = engine.model.info();
    eprintln!(
        "sluice: {} ({}, {} layers, {} experts, {} per token) on {}",
        engine.dir.path.display(),
        info.weight_format,
        info.layers,
        info.experts,
        info.experts_per_token,
        engine.model.backend().describe()
    );
    if let (Some(store), Some(plan)) = (&engine.store, &engine.cache_plan) {
        eprintln!(
            "streaming experts from {} ({}): cache {} in {} slots ({}), {:.0}% of {} expert bytes; resident {}",
            store.dir().display(),
            store.io_description(),
            format_bytes(store.cache_bytes()),
            store.slots(),
            plan.reason,
            store.cache_bytes() as f64 / plan.expert_bytes.max(1) as f64 * 100.0,
            format_bytes(plan.expert_bytes),
            format_bytes(plan.resident_bytes),
        );
        match store.pinned() {
            Some(Ok(())) => eprintln!("expert cache page-locked for GPU copies"),
            Some(Err(why)) => eprintln!("sluice: warning: {why}"),
            None => {}
        }
    }
    if let (Some(plan), Some(cache)) = (&engine.device_cache_plan, &engine.cache_plan) {
        eprintln!(
            "VRAM expert cache: {} in {} slots ({}), {:.0}% of {} expert bytes",
            format_bytes(plan.bytes()),
            plan.slots,
            plan.reason,
            plan.bytes() as f64 / cache.expert_bytes.max(1) as f64 * 100.0,
            format_bytes(cache.expert_bytes),
        );
    }
}

/// One line of VRAM-tier counters (`d`: a delta), for `--stats`.
pub(crate) fn vram_line(d: &sluice_backend::ExpertCacheStats) -> String {
    if d.read_in_place > 0 || d.placed > 0 || d.host_computed > 0 {
        // Experts kept in host memory: the kernels read them there or in a slot, or the CPU
        // computes them.
        return format!(
            "VRAM hit {:.1}% ({} from slots, {} read in place from host memory: {}, {} computed by the CPU: {} at {:.1} GB/s{}), {} copied into slots and {} staged for prompts ({}, {} evicted) at {:.2} GB/s while copying",
            d.hit_rate() * 100.0,
            d.hits,
            d.read_in_place,
            format_bytes(d.bytes_read_in_place),
            d.host_computed,
            format_bytes(d.bytes_host_computed),
            d.host_gbps(),
            d.host_share.map_or(String::new(), |s| format!(
                ", now {:.0}% of the misses",
                s * 100.0
            )),
            d.placed,
            d.bypassed,
            format_bytes(d.bytes_uploaded),
            d.evictions,
            d.upload_gbps(),
        );
    }
    format!(
        "VRAM hit {:.1}% ({} held, {} uploaded into slots, {} for one call), uploaded {} ({:.0}% from page-locked memory) at {:.2} GB/s while copying, {:.0} ms copying",
        d.hit_rate() * 100.0,
        d.hits,
        d.misses,
        d.bypassed,
        format_bytes(d.bytes_uploaded),
        d.bytes_pinned as f64 / d.bytes_uploaded.max(1) as f64 * 100.0,
        d.upload_gbps(),
        d.upload_secs * 1e3,
    )
}

fn generate(a: GenerateArgs) -> Result<()> {
    with_engine!(&a.model, |engine| generate_on(engine, &a))
}

fn generate_on<B: Backend + 'static>(mut engine: Engine<B>, a: &GenerateArgs) -> Result<()> {
    let params = a.sampling.params(&engine.defaults)?;
    a.speculate.apply(&mut engine)?;
    let chat = a.chat || a.system.is_some();
    let text = if chat {
        let mut messages = Vec::new();
        if let Some(s) = &a.system {
            messages.push(ChatMessage::new("system", s));
        }
        messages.push(ChatMessage::new("user", &a.prompt));
        engine.render_chat(&messages, None, &Default::default())?
    } else {
        a.prompt.clone()
    };
    // A rendered template already holds its special tokens (transformers encodes it likewise).
    let prompt = engine.tokenizer.encode(&text, !chat)?;
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenisation");
    }
    print_banner(&engine);
    let start_stats = engine.store.as_ref().map(|s| s.stats());
    let mut last_stats = start_stats.clone();
    let backend = engine.model.backend();
    let vram_start = backend.expert_cache_stats();
    let mut vram_last = vram_start.clone();
    let mut last_time = std::time::Instant::now();
    let mut index = 0usize;
    let mut out = std::io::stdout().lock();
    // `Flush` (text held back at the end, not a token) is printed, and gets a `--stats` line,
    // like a token: unchanged from when it came as a fake token id.
    let stats = engine.generate(&prompt, &params, a.max_tokens, |event| {
        let (TokenEvent::Token { text: piece, .. } | TokenEvent::Flush { text: piece }) = event;
        if a.stats {
            if let (Some(store), Some(last)) = (&engine.store, &mut last_stats) {
                let now = store.stats();
                let d = now.since(last);
                let secs = last_time.elapsed().as_secs_f64();
                eprintln!(
                    "[stats] {} {index}: {:.0} ms, read {} ({:.2} GB/s while reading), hit {:.0}% of {}, io wait {:.0} ms, prefetch {}/{} useful",
                    if index == 0 { "prompt+token" } else { "token" },
                    secs * 1e3,
                    format_bytes(d.bytes_read),
                    d.read_gbps(),
                    d.hit_rate() * 100.0,
                    d.requests,
                    d.io_wait_secs * 1e3,
                    d.prefetch_useful,
                    d.prefetch_useful + d.prefetch_wasted,
                );
                *last = now;
                if let Some(last) = &mut vram_last {
                    if let Some(now) = backend.expert_cache_stats() {
                        eprintln!("[stats]   {}", vram_line(&now.since(last)));
                        *last = now;
                    }
                }
                last_time = std::time::Instant::now();
                index += 1;
            }
        }
        // A closed stdout (e.g. `| head`) ends the generation quietly.
        if out
            .write_all(piece.as_bytes())
            .and_then(|_| out.flush())
            .is_err()
        {
            return ControlFlow::Break(Halt::Cancel);
        }
        ControlFlow::Continue(())
    })?;
    let _ = writeln!(out);
    eprintln!(
        "prompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.2} tok/s | finish: {:?}",
        stats.prompt_tokens,
        stats.prompt_tok_per_sec(),
        stats.generated_tokens,
        stats.decode_tok_per_sec(),
        stats.finish
    );
    let spec = &stats.speculation;
    if engine.speculation != Speculation::Off {
        eprintln!(
            "speculation ({}): {} passes checked {} drafted tokens, {} kept ({:.0}%), {:.2} tokens per pass",
            engine.speculation,
            spec.passes,
            spec.drafted,
            spec.accepted,
            spec.acceptance() * 100.0,
            spec.tokens_per_pass()
        );
    }
    if let (Some(store), Some(start)) = (&engine.store, &start_stats) {
        let d = store.stats().since(start);
        let total = stats.prompt_secs + stats.decode_secs;
        eprintln!(
            "experts: read {} in {} blocks, {:.2} GB/s while reading; hit rate {:.1}% ({} cached + {} read ahead, of {}), \
             prefetch {:.0}% useful ({} of {} blocks, {} prefetched); io wait {:.2} s = {:.0}% of {:.2} s; \
             checksums of {} blocks {:.2} s",
            format_bytes(d.bytes_read),
            d.blocks_read,
            d.read_gbps(),
            d.hit_rate() * 100.0,
            d.hits,
            d.prefetch_hits,
            d.requests,
            d.prefetch_accuracy() * 100.0,
            d.prefetch_useful,
            d.prefetch_useful + d.prefetch_wasted,
            format_bytes(d.prefetch_bytes),
            d.io_wait_secs,
            d.io_wait_secs / total.max(1e-9) * 100.0,
            total,
            d.blocks_verified,
            d.verify_secs,
        );
    }
    if let (Some(start), Some(now)) = (&vram_start, backend.expert_cache_stats()) {
        eprintln!("experts on the GPU: {}", vram_line(&now.since(start)));
    }
    Ok(())
}

fn logits(mut a: LogitsArgs) -> Result<()> {
    // Logits are for comparing with reference implementations: exact unless asked otherwise.
    a.model.kernels.get_or_insert(Kernels::Exact);
    with_engine!(&a.model, |engine| logits_on(engine, &a))
}

fn logits_on<B: Backend + 'static>(engine: Engine<B>, a: &LogitsArgs) -> Result<()> {
    let mode = match a.mode {
        Mode::Decode => LogitsMode::Decode,
        Mode::Prefill => LogitsMode::Prefill,
    };
    let vocab = engine.model.info().vocab_size;
    let data = engine.logits(&a.tokens, mode)?;
    sluice_engine::npy::write_f32(&a.out, &data, &[a.tokens.len(), vocab])
        .with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "wrote {} ([{}, {vocab}] float32)",
        a.out.display(),
        a.tokens.len()
    );
    Ok(())
}
