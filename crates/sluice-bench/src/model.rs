//! Model benchmarks in the spirit of llama-bench: prompt processing (`ppN`) and generation
//! (`tgN`) tok/s over repetitions, time to first token, peak RSS, bytes moved per token and the
//! fraction of the relevant machine limit that represents.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use sluice_backend::Backend;
use sluice_engine::sampler::{Sampler, SamplingParams};
use sluice_engine::speculate::{Speculation, SpeculationStats};
use sluice_engine::{Engine, GenerateRequest, TokenEvent};
use sluice_models::Segment;

/// One benchmark test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Test {
    /// Process a prompt of N random tokens in one prefill.
    Prompt(usize),
    /// Generate N tokens one at a time from an empty context. Each step's greedy choice is taken
    /// as generation takes it (`argmax_rows`, on the device), but the next input is a random
    /// token, as in llama-bench: greedy decoding of a random-weight checkpoint soon repeats one token, routes
    /// every step to the same experts and so flatters an expert cache.
    Generate(usize),
    /// `Batch(n, b)`: `b` requests generate `n` tokens each together, one token of each per
    /// forward pass ([`sluice_models::CausalLm::forward_batch`]), random inputs as `Generate`.
    Batch(usize, usize),
    /// `Echo(n)`: generate N tokens greedily, through the engine's generation (speculative
    /// decoding included, as [`Engine::speculation`] says), after a prompt whose answer repeats
    /// it: S ([`ECHO_SEED`] random tokens), G (the model's own greedy continuation of S, N
    /// tokens, made untimed), then S again. Prompt lookup then finds G, which a trained model
    /// goes on to repeat; a random-weight one may not (its acceptance says how far it does).
    /// [`Speculation::Replay`] drafts the answer itself, recorded by an untimed run first.
    /// Timed from the first generated token on (the prompt's pass excluded).
    Echo(usize),
}

/// Random tokens that begin and end an [`Test::Echo`] prompt.
pub const ECHO_SEED: usize = 64;

impl Test {
    pub fn name(&self) -> String {
        match self {
            Test::Prompt(n) => format!("pp{n}"),
            Test::Generate(n) => format!("tg{n}"),
            Test::Batch(n, b) => format!("tg{n}x{b}"),
            Test::Echo(n) => format!("tg{n} echo"),
        }
    }

    /// Tokens a run produces (or reads, for a prompt).
    fn tokens(&self) -> usize {
        match *self {
            Test::Prompt(n) | Test::Generate(n) | Test::Echo(n) => n,
            Test::Batch(n, b) => n * b,
        }
    }
}

/// Which limit a run is compared against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Limit {
    /// The weights fit in memory: DRAM read bandwidth bounds decode.
    Memory,
    /// They do not: what is not resident comes from disk.
    Disk,
}

/// The measured limits of this machine, in GB/s.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct LimitRates {
    pub memory_read_gbps: Option<f64>,
    /// O_DIRECT throughput of block-sized random reads with many in flight: the pattern expert
    /// streaming issues.
    pub disk_gbps: Option<f64>,
    /// Page-locked host memory to a GPU: the link streamed experts cross there.
    pub upload_gbps: Option<f64>,
}

/// The result of one test at one setting.
#[derive(Debug, Clone, Serialize)]
pub struct RunResult {
    pub model: PathBuf,
    /// What the caller varied besides the other fields, e.g. the CPU kernels ("" if nothing):
    /// shown after the model's name.
    pub variant: String,
    pub test: String,
    pub threads: usize,
    pub experts_per_token: usize,
    /// Mean over the repetitions.
    pub tok_s: f64,
    /// Sample standard deviation over the repetitions (0 for one).
    pub tok_s_sd: f64,
    pub samples: Vec<f64>,
    /// Time to first token: the prefill of the prompt (pp tests only).
    pub ttft_s: Option<f64>,
    /// Weight bytes each token reads: all dense weights plus K experts per MoE layer for
    /// generation; for prompts, the dense and the expected distinct experts, divided by N.
    pub bytes_per_token: f64,
    pub limit: Limit,
    pub limit_gbps: Option<f64>,
    /// tok_s x bytes_per_token / limit.
    pub fraction_of_limit: Option<f64>,
    /// Peak resident set during this run (mapped file pages included), when the OS says.
    pub peak_rss_bytes: Option<u64>,
    /// Expert streaming figures (packed models).
    pub streaming: Option<StreamingRun>,
    /// The backend's own expert cache (a GPU's VRAM tier), when it keeps one.
    pub vram: Option<VramRun>,
    /// What speculative decoding did over the timed repetitions (echo tests with it on).
    pub speculation: Option<SpeculationRun>,
}

/// Speculative decoding over the timed repetitions of an echo test.
#[derive(Debug, Clone, Serialize)]
pub struct SpeculationRun {
    /// `off`, or the drafter and its tokens per pass.
    pub method: String,
    pub drafted: usize,
    pub accepted: usize,
    /// The share of drafted tokens the model kept.
    pub acceptance: f64,
    /// Generated tokens per forward pass, plain decode steps included (1 without speculation).
    pub tokens_per_pass: f64,
}

/// What the backend's expert cache did during the timed repetitions of one run.
#[derive(Debug, Clone, Serialize)]
pub struct VramRun {
    pub cache_bytes: u64,
    pub slots: usize,
    pub uploaded_bytes_per_token: f64,
    /// Bytes of experts the kernels read in host memory per token (experts kept there).
    pub read_in_place_bytes_per_token: f64,
    /// Bytes of experts kept in host memory the CPU computed beside the device, per token.
    pub host_computed_bytes_per_token: f64,
    /// Share of the run's wall time the device spent copying experts in.
    pub copy_share: f64,
    pub hit_rate: f64,
    /// Copy throughput while copying.
    pub upload_gbps: f64,
    #[serde(skip)]
    pub stats: sluice_backend::ExpertCacheStats,
}

/// What the expert store did during the timed repetitions of one run.
#[derive(Debug, Clone, Serialize)]
pub struct StreamingRun {
    pub cache_bytes: u64,
    pub cache_slots: usize,
    pub io: String,
    /// Bytes read from disk per token.
    pub read_bytes_per_token: f64,
    /// Read throughput while reads were in flight.
    pub read_gbps: f64,
    /// Bytes read per second of wall time.
    pub read_gbps_wall: f64,
    pub hit_rate: f64,
    pub prefetch_accuracy: f64,
    /// Share of the run's time spent waiting for reads.
    pub io_wait_share: f64,
    /// Share of the run's time spent comparing blocks with their checksums.
    pub verify_share: f64,
    pub stats: sluice_store::StoreStats,
}

/// Settings for the runs of one model.
#[derive(Debug, Clone)]
pub struct RunSettings {
    pub tests: Vec<Test>,
    pub repetitions: usize,
    pub threads: Vec<usize>,
    /// `None` runs the model's own K.
    pub experts_per_token: Vec<Option<usize>>,
    /// One untimed run of each test first (page cache, allocator, branch predictors).
    pub warmup: bool,
    pub seed: u64,
    /// Generation tests start after an untimed prefill of this many random tokens (llama-bench's
    /// `-d`): decoding at a long context.
    pub depth: usize,
    /// Generation tests choose each token as generation does with these settings (on a device,
    /// the few logits a top-k sampler needs come back, not the row); `None`: greedily, on the
    /// device (`argmax_rows`). The next input is a random token either way.
    pub sampling: Option<SamplingParams>,
}

/// Chooses a token from each row of `logits`: greedily on the device when `samplers` is empty,
/// else with row `i`'s sampler and its own history, as the engine's decode step chooses
/// ([`sluice_engine::batch::choose_tokens`]).
fn choose_tokens<B: Backend>(
    backend: &B,
    logits: &B::Act,
    samplers: &mut [(Sampler, Vec<u32>)],
) -> Result<Vec<u32>> {
    if samplers.is_empty() {
        return Ok(backend.argmax_rows(logits)?);
    }
    let mut rows: Vec<(&mut Sampler, &[u32])> = samplers
        .iter_mut()
        .map(|(s, history)| (s, history.as_slice()))
        .collect();
    let chosen = sluice_engine::batch::choose_tokens(backend, logits, &mut rows)?
        .into_iter()
        .collect::<Result<Vec<u32>, _>>()?;
    for ((_, history), &token) in samplers.iter_mut().zip(&chosen) {
        history.push(token);
    }
    Ok(chosen)
}

/// Runs every test at every setting on `engine`, calling `report` after each. Thread counts run
/// in their own rayon pools.
pub fn run_model<B: Backend + 'static>(
    engine: &mut Engine<B>,
    settings: &RunSettings,
    limits: &LimitRates,
    report: &mut dyn FnMut(&RunResult),
) -> Result<Vec<RunResult>> {
    if settings.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    let dir = engine.dir.path.clone();
    let file_bytes = sluice_format::safetensors_bytes(&dir);
    // MemAvailable counts the reclaimable page cache, so a model already cached still "fits".
    let limit = match sluice_sys::mem_available_bytes() {
        _ if engine.store.is_some() => Limit::Disk,
        Some(avail) if file_bytes > avail => Limit::Disk,
        _ => Limit::Memory,
    };
    let limit_gbps = match limit {
        Limit::Memory => limits.memory_read_gbps,
        Limit::Disk => limits.disk_gbps,
    };
    let default_k = engine.model.info().experts_per_token;
    let mut out = Vec::new();
    for &k in &settings.experts_per_token {
        let k = k.unwrap_or(default_k);
        engine
            .model
            .set_experts_per_token(k)
            .with_context(|| format!("--experts-per-token {k}"))?;
        for &threads in &settings.threads {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .context("building the thread pool")?;
            for &test in &settings.tests {
                let engine = &*engine;
                let run_args = (settings.depth, settings.sampling.as_ref());
                let result = pool.install(|| -> Result<RunResult> {
                    if matches!(test, Test::Echo(_)) && settings.depth > 0 {
                        bail!("echo tests (--speculate) start from an empty context: drop --depth");
                    }
                    if settings.warmup {
                        run_once(engine, test, settings.seed, run_args, &mut || {})?;
                    }
                    sluice_sys::reset_peak_rss();
                    let store_now = || engine.store.as_ref().map(|s| s.stats());
                    let vram_now = || engine.model.backend().expert_cache_stats();
                    // The counters at the start and end of each run's timed part.
                    let (mut store_marks, mut vram_marks) = (Vec::new(), Vec::new());
                    let mut samples = Vec::new();
                    let mut ttft = Vec::new();
                    let mut speculated = SpeculationStats::default();
                    let mut passes = 0;
                    for r in 0..settings.repetitions {
                        let mut start = None;
                        let (secs, spec) = run_once(
                            engine,
                            test,
                            settings.seed + 1 + r as u64,
                            run_args,
                            &mut || start = Some((store_now(), vram_now())),
                        )?;
                        if let Some((s, p)) = spec {
                            speculated.add(&s);
                            passes += p;
                        }
                        let (store_start, vram_start) = start.unwrap_or((None, None));
                        store_marks.push((store_start, store_now()));
                        vram_marks.push((vram_start, vram_now()));
                        samples.push(test.tokens() as f64 / secs);
                        ttft.push(secs);
                    }
                    let (mean, sd) = mean_sd(&samples);
                    let total_secs: f64 = ttft.iter().sum();
                    let tokens = (test.tokens() * settings.repetitions) as f64;
                    let timed_store = timed(&store_marks, |a, b| a.since(b));
                    let streaming =
                        engine
                            .store
                            .as_ref()
                            .zip(timed_store)
                            .map(|(store, d)| StreamingRun {
                                cache_bytes: store.cache_bytes(),
                                cache_slots: store.slots(),
                                io: store.io_description(),
                                read_bytes_per_token: d.bytes_read as f64 / tokens,
                                read_gbps: d.read_gbps(),
                                read_gbps_wall: d.bytes_read as f64 / total_secs / 1e9,
                                hit_rate: d.hit_rate(),
                                prefetch_accuracy: d.prefetch_accuracy(),
                                io_wait_share: d.io_wait_secs / total_secs,
                                verify_share: d.verify_secs / total_secs,
                                stats: d,
                            });
                    let vram = engine
                        .device_cache_plan
                        .as_ref()
                        .zip(timed(&vram_marks, |a, b| a.since(b)))
                        .map(|(plan, d)| VramRun {
                            cache_bytes: plan.bytes(),
                            slots: plan.slots,
                            uploaded_bytes_per_token: d.bytes_uploaded as f64 / tokens,
                            read_in_place_bytes_per_token: d.bytes_read_in_place as f64 / tokens,
                            host_computed_bytes_per_token: d.bytes_host_computed as f64 / tokens,
                            copy_share: d.upload_secs / total_secs,
                            hit_rate: d.hit_rate(),
                            upload_gbps: d.upload_gbps(),
                            stats: d,
                        });
                    // Tokens per forward pass, timed part: the checking passes and plain steps.
                    let per_pass = (test.tokens() * settings.repetitions)
                        .saturating_sub(settings.repetitions)
                        as f64
                        / passes.max(1) as f64;
                    let speculation = matches!(test, Test::Echo(_)).then(|| SpeculationRun {
                        method: engine.speculation.to_string(),
                        drafted: speculated.drafted,
                        accepted: speculated.accepted,
                        acceptance: speculated.acceptance(),
                        tokens_per_pass: per_pass,
                    });
                    let bytes_per_token = match &speculation {
                        Some(s) => {
                            let generated = (test.tokens() * settings.repetitions)
                                .saturating_sub(settings.repetitions)
                                .max(1);
                            bytes_per_token_at(engine, s.tokens_per_pass)
                                + draft_bytes_per_token(engine) * s.drafted as f64
                                    / generated as f64
                        }
                        None => bytes_per_token(engine, test),
                    };
                    Ok(RunResult {
                        model: dir.clone(),
                        variant: String::new(),
                        test: match test {
                            Test::Prompt(_) => test.name(),
                            _ if settings.depth > 0 => {
                                format!("{} @ d{}", test.name(), settings.depth)
                            }
                            _ => test.name(),
                        },
                        threads,
                        experts_per_token: k,
                        tok_s: mean,
                        tok_s_sd: sd,
                        samples,
                        ttft_s: matches!(test, Test::Prompt(_)).then(|| mean_sd(&ttft).0),
                        bytes_per_token,
                        limit,
                        limit_gbps,
                        // Streamed: the disk bytes actually read per second of the run.
                        fraction_of_limit: limit_gbps.map(|g| match &streaming {
                            Some(st) => st.read_gbps_wall / g,
                            None => mean * bytes_per_token / 1e9 / g,
                        }),
                        peak_rss_bytes: sluice_sys::peak_rss_bytes(),
                        streaming,
                        vram,
                        speculation,
                    })
                })?;
                report(&result);
                out.push(result);
            }
        }
    }
    engine.model.set_experts_per_token(default_k)?;
    Ok(out)
}

/// Random token ids below `range` (xorshift64 from `seed`): benchmark prompts and
/// `perplexity --random`, the same ids for the same seed.
pub fn random_tokens(range: u64, seed: u64) -> impl FnMut() -> u32 {
    let (mut rng, range) = (seed | 1, range.max(1));
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % range) as u32
    }
}

/// The counters of the timed parts of runs, from each one's counters at its start and end (in
/// order; `None` where there are none): the whole span less the untimed stretches between them
/// (the prefills to `--depth`), by subtraction alone.
fn timed<T>(marks: &[(Option<T>, Option<T>)], since: impl Fn(&T, &T) -> T) -> Option<T> {
    let (first, last) = (marks.first()?.0.as_ref()?, marks.last()?.1.as_ref()?);
    let mut total = since(last, first);
    for pair in marks.windows(2) {
        let (end, next) = (pair[0].1.as_ref()?, pair[1].0.as_ref()?);
        total = since(&total, &since(next, end));
    }
    Some(total)
}

/// Seconds for one run of `test` from a fresh state (generation after `depth` tokens);
/// `timed_start` is called as the timed part begins. An echo test also gives what speculation
/// did and the forward passes its timed part took.
fn run_once<B: Backend + 'static>(
    engine: &Engine<B>,
    test: Test,
    seed: u64,
    (depth, sampling): (usize, Option<&SamplingParams>),
    timed_start: &mut dyn FnMut(),
) -> Result<(f64, Option<(SpeculationStats, usize)>)> {
    // A sampler per request, seeded from the run's seed.
    let samplers = |n: usize| -> Vec<(Sampler, Vec<u32>)> {
        let Some(p) = sampling else {
            return Vec::new();
        };
        (0..n as u64)
            .map(|i| {
                let params = SamplingParams {
                    seed: Some(seed.wrapping_mul(31).wrapping_add(i)),
                    ..p.clone()
                };
                (Sampler::new(params), Vec::new())
            })
            .collect()
    };
    let info = engine.model.info();
    // Ordinary tokens only: below the first special token of Qwen vocabularies when known.
    let range = engine.tokenizer.vocab_size().min(info.vocab_size) as u64;
    let mut next_token = random_tokens(range, seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut state = engine.new_state()?;
    match test {
        Test::Prompt(n) => {
            let tokens: Vec<u32> = (0..n).map(|_| next_token()).collect();
            timed_start();
            let start = Instant::now();
            let logits = engine.prefill(&mut state, &tokens)?;
            std::hint::black_box(sluice_backend::reference::argmax(&logits));
            Ok((start.elapsed().as_secs_f64(), None))
        }
        Test::Generate(n) => {
            if depth > 0 {
                let tokens: Vec<u32> = (0..depth).map(|_| next_token()).collect();
                let start = Instant::now();
                engine.prefill(&mut state, &tokens)?;
                let secs = start.elapsed().as_secs_f64();
                eprintln!(
                    "  (prefill to depth {depth}: {secs:.1} s, {:.1} tok/s, untimed)",
                    depth as f64 / secs
                );
            }
            let mut token = next_token();
            let backend = engine.model.backend();
            let mut samplers = samplers(1);
            timed_start();
            let start = Instant::now();
            for _ in 0..n {
                let logits = engine.model.forward(&mut state, &[token], false)?;
                std::hint::black_box(choose_tokens(backend, &logits, &mut samplers)?);
                token = next_token();
            }
            Ok((start.elapsed().as_secs_f64(), None))
        }
        Test::Batch(n, b) => {
            let mut states = (0..b)
                .map(|_| engine.new_state())
                .collect::<Result<Vec<_>, _>>()?;
            let mut tokens: Vec<[u32; 1]> = (0..b).map(|_| [next_token()]).collect();
            let backend = engine.model.backend();
            let mut samplers = samplers(b);
            timed_start();
            let start = Instant::now();
            for _ in 0..n {
                let mut segments: Vec<Segment<'_, B>> = states
                    .iter_mut()
                    .zip(&tokens)
                    .map(|(state, t)| Segment { state, tokens: t })
                    .collect();
                let logits = engine.model.forward_batch(&mut segments)?;
                std::hint::black_box(choose_tokens(backend, &logits, &mut samplers)?);
                tokens.iter_mut().for_each(|t| t[0] = next_token());
            }
            Ok((start.elapsed().as_secs_f64(), None))
        }
        Test::Echo(n) => echo_once(engine, n, &mut next_token, timed_start)
            .map(|(secs, spec, passes)| (secs, Some((spec, passes)))),
    }
}

/// One [`Test::Echo`] run: seconds for its `n` tokens (the time of the n - 1 after the first,
/// scaled), what speculation did and the forward passes after the first token.
fn echo_once<B: Backend + 'static>(
    engine: &Engine<B>,
    n: usize,
    next_token: &mut dyn FnMut() -> u32,
    timed_start: &mut dyn FnMut(),
) -> Result<(f64, SpeculationStats, usize)> {
    fn request<'a>(prompt: &'a [u32], params: &'a SamplingParams, n: usize) -> GenerateRequest<'a> {
        GenerateRequest {
            prompt,
            params,
            max_tokens: n,
            cancel: None,
            ignore_eos: true,
            checkpoint: None,
        }
    }
    let params = SamplingParams::default();
    // Greedy tokens after `prompt`, without speculation.
    let answer = |prompt: &[u32]| -> Result<Vec<u32>> {
        let mut tokens = Vec::with_capacity(n);
        engine.generate_speculating(Speculation::Off, &request(prompt, &params, n), |event| {
            if let TokenEvent::Token { id, .. } = event {
                tokens.push(id);
            }
            ControlFlow::Continue(())
        })?;
        Ok(tokens)
    };
    let seed: Vec<u32> = (0..ECHO_SEED).map(|_| next_token()).collect();
    let prompt: Vec<u32> = [&seed[..], &answer(&seed)?, &seed].concat();
    let speculation = match &engine.speculation {
        // Replay drafts this prompt's own answer, recorded first (untimed).
        Speculation::Replay { draft_tokens, .. } => Speculation::Replay {
            answer: answer(&prompt)?.into(),
            after: prompt.len(),
            draft_tokens: *draft_tokens,
        },
        s => s.clone(),
    };
    let mut first = true;
    let stats =
        engine.generate_speculating(speculation, &request(&prompt, &params, n), |event| {
            if first && matches!(event, TokenEvent::Token { .. }) {
                first = false;
                timed_start();
            }
            ControlFlow::Continue(())
        })?;
    let after_first = stats.generated_tokens.saturating_sub(1);
    if after_first == 0 {
        bail!("the echo run generated {} tokens", stats.generated_tokens);
    }
    let spec = stats.speculation;
    // Plain decode steps make one token each; checking passes `produced` between them.
    let passes = spec.passes + after_first.saturating_sub(spec.produced);
    let secs = stats.decode_secs * n as f64 / after_first as f64;
    Ok((secs, spec, passes))
}

/// Weight bytes read per generated token when each forward pass makes `tokens_per_pass` of
/// them (speculative decoding): a pass reads the dense weights and its tokens' distinct experts.
fn bytes_per_token_at<B: Backend>(engine: &Engine<B>, tokens_per_pass: f64) -> f64 {
    let info = engine.model.info();
    let per_expert = info.expert_bytes as f64 / info.experts.max(1) as f64;
    let row = (info.hidden_size * 2) as f64;
    let t = tokens_per_pass.max(1.0);
    let k = info.experts_per_token as f64 / info.experts.max(1) as f64;
    let experts_read = info.experts as f64 * (1.0 - (1.0 - k).powf(t));
    (info.dense_bytes as f64 + per_expert * experts_read) / t + row
}

/// Weight bytes the drafter reads per token it drafts (0 without a draft model or MTP layer
/// drafting).
fn draft_bytes_per_token<B: Backend>(engine: &Engine<B>) -> f64 {
    match (&engine.speculation, &engine.draft) {
        (Speculation::Draft { .. }, Some(draft)) => decode_bytes(draft.model.info()),
        (Speculation::Mtp { .. }, _) => {
            let mtp = engine.model.mtp().ok().flatten();
            mtp.map_or(0.0, |m| (m.weight_bytes() + m.hidden_size() * 2) as f64)
        }
        _ => 0.0,
    }
}

/// Weight bytes one decoded token reads: the dense weights, its experts, one embedding row.
fn decode_bytes(info: &sluice_models::ModelInfo) -> f64 {
    let per_expert = info.expert_bytes as f64 / info.experts.max(1) as f64;
    info.dense_bytes as f64
        + per_expert * info.experts_per_token as f64
        + (info.hidden_size * 2) as f64
}

/// Weight bytes read per token (see [`RunResult::bytes_per_token`]).
pub fn bytes_per_token<B: Backend>(engine: &Engine<B>, test: Test) -> f64 {
    let info = engine.model.info();
    let per_expert = info.expert_bytes as f64 / info.experts.max(1) as f64;
    let row = (info.hidden_size * 2) as f64; // One embedding row, roughly.
    match test {
        Test::Generate(_) | Test::Echo(_) => decode_bytes(info),
        // Like a prompt of `b` tokens: each step reads the dense weights and the distinct
        // experts of its `b` rows once.
        Test::Batch(_, b) => bytes_per_token(engine, Test::Prompt(b)),
        Test::Prompt(n) => {
            // Each expert is read once per prefill if any of the n tokens routes to it.
            let p_unused = (1.0 - info.experts_per_token as f64 / info.experts.max(1) as f64)
                .powi(n.min(i32::MAX as usize) as i32);
            let experts_read = info.experts as f64 * (1.0 - p_unused);
            (info.dense_bytes as f64 + per_expert * experts_read) / n.max(1) as f64 + row
        }
    }
}

/// Mean and sample standard deviation.
pub fn mean_sd(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    if v.is_empty() {
        return (0.0, 0.0);
    }
    let mean = v.iter().sum::<f64>() / n;
    if v.len() < 2 {
        return (mean, 0.0);
    }
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// The markdown table of results.
pub fn markdown_table(results: &[RunResult]) -> String {
    let mut s = String::from(
        "| model | K | threads | test | tok/s | TTFT | bytes/token | limit | of limit | peak RSS | streaming |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let name = r
            .model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| r.model.display().to_string());
        let name = if r.variant.is_empty() {
            name
        } else {
            format!("{name} ({})", r.variant)
        };
        // An echo test names what speculation did.
        let test = match &r.speculation {
            Some(sp) if sp.drafted > 0 => format!(
                "{} ({}: {:.0}% kept, {:.2} tokens/pass)",
                r.test,
                sp.method,
                sp.acceptance * 100.0,
                sp.tokens_per_pass
            ),
            Some(sp) => format!(
                "{} ({}: {:.2} tokens/pass)",
                r.test, sp.method, sp.tokens_per_pass
            ),
            None => r.test.clone(),
        };
        let limit = match (r.limit, r.limit_gbps) {
            (l, Some(g)) => format!("{} {g:.1} GB/s", format!("{l:?}").to_lowercase()),
            (l, None) => format!("{} (not measured)", format!("{l:?}").to_lowercase()),
        };
        s.push_str(&format!(
            "| {name} | {} | {} | {test} | {:.2} ± {:.2} | {} | {} | {limit} | {} | {} | {} |\n",
            r.experts_per_token,
            r.threads,
            r.tok_s,
            r.tok_s_sd,
            r.ttft_s.map_or("-".into(), |t| if t < 1.0 {
                format!("{:.1} ms", t * 1e3)
            } else {
                format!("{t:.2} s")
            }),
            sluice_sys::format_bytes(r.bytes_per_token as u64),
            r.fraction_of_limit
                .map_or("-".into(), |f| format!("{:.0}%", f * 100.0)),
            r.peak_rss_bytes.map_or("-".into(), sluice_sys::format_bytes),
            r.streaming.as_ref().map_or("-".into(), |st| format!(
                "cache {} ({}), hit {:.0}%, read {}/token at {:.2} GB/s ({:.2} in flight), io wait {:.0}%, checksums {:.0}%, prefetch {:.0}% useful",
                sluice_sys::format_bytes(st.cache_bytes),
                st.io,
                st.hit_rate * 100.0,
                sluice_sys::format_bytes(st.read_bytes_per_token as u64),
                st.read_gbps_wall,
                st.read_gbps,
                st.io_wait_share * 100.0,
                st.verify_share * 100.0,
                st.prefetch_accuracy * 100.0
            )),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timed_counters_leave_out_what_ran_between_the_timed_parts() {
        let sub = |a: &u64, b: &u64| a - b;
        // Three runs timed 0..5, 20..23 and 40..41: the prefills between them are left out.
        let marks = [
            (Some(0), Some(5)),
            (Some(20), Some(23)),
            (Some(40), Some(41)),
        ];
        assert_eq!(timed(&marks, sub), Some(9));
        assert_eq!(timed(&marks[..1], sub), Some(5));
        assert_eq!(timed::<u64>(&[(None, None)], sub), None);
        assert_eq!(timed::<u64>(&[], sub), None);
    }

    #[test]
    fn mean_and_sample_sd() {
        let (m, sd) = mean_sd(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(m, 5.0);
        assert!((sd - 2.138).abs() < 1e-3, "{sd}");
        assert_eq!(mean_sd(&[3.0]), (3.0, 0.0));
    }

    #[test]
    fn test_names() {
        assert_eq!(Test::Prompt(512).name(), "pp512");
        assert_eq!(Test::Generate(128).name(), "tg128");
        assert_eq!(Test::Batch(64, 8).name(), "tg64x8");
        assert_eq!(Test::Batch(64, 8).tokens(), 512);
    }
}
