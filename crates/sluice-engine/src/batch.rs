//! Generations that advance together: a [`Sequence`] is one request's generation as a state
//! machine, and [`Engine::step`] moves a batch of them one step. The decoding sequences run one
//! token each in a single forward pass (every weight and routed expert read once for all of
//! them); one sequence still reading its prompt runs a chunk of it beside them. A sequence can
//! join or leave between any two steps: that is continuous batching, and
//! [`Engine::generate_cached`] is a batch of one.
//!
//! Decode rows and prompt chunks run as separate passes so that a decoding row always takes the
//! decode kernels, as it does alone: its logits then differ from its logits alone only by the
//! order of summation inside the products.

use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use sluice_backend::{Backend, BackendError};
use sluice_models::{Segment, State};

use crate::prompt_cache::PromptCache;
use crate::sampler::{Sampler, TopRequest};
use crate::speculate::{Speculation, SpeculationStats};
use crate::tokenizer::StreamDecoder;
use crate::{
    Engine, EngineError, FinishReason, GenerateRequest, GenerationStats, Halt, TokenEvent,
};

/// A prompt chunk that runs beside decoding sequences is at most this long, so that a long
/// prompt delays the others' next token by one such chunk, not by a whole prompt.
pub const PREFILL_CHUNK_SHARED: usize = 128;

/// The most tokens a sequence decodes one at a time after checking passes that kept nothing.
pub const MAX_DRAFT_BACKOFF: usize = 16;

/// Where a sequence's output goes.
pub trait Sink {
    /// A token or the final held-back text (see [`TokenEvent`]); breaking stops the generation.
    fn event(&mut self, event: TokenEvent<'_>) -> ControlFlow<Halt>;
    /// Checked before every step: true stops the generation ([`FinishReason::Cancelled`]).
    fn cancelled(&self) -> bool {
        false
    }
}

/// A callback as a [`Sink`], with an optional cancel flag.
pub struct FnSink<'a, F> {
    pub on_event: F,
    pub cancel: Option<&'a AtomicBool>,
}

impl<F: FnMut(TokenEvent<'_>) -> ControlFlow<Halt>> Sink for FnSink<'_, F> {
    fn event(&mut self, event: TokenEvent<'_>) -> ControlFlow<Halt> {
        (self.on_event)(event)
    }

    fn cancelled(&self) -> bool {
        self.cancel.is_some_and(|c| c.load(Ordering::Relaxed))
    }
}

enum Phase {
    /// Reading the prompt: `done` of its tokens are in the state.
    Prompt,
    /// The token to run next.
    Decode(u32),
    Finished(FinishReason),
}

/// One request's generation, advanced by [`Engine::step`] and ended by [`Sequence::finish`].
pub struct Sequence<'a, B: Backend, S> {
    sink: S,
    sampler: Sampler,
    state: State<B>,
    prompt: Vec<u32>,
    /// Prompt tokens in `state`.
    done: usize,
    /// A prompt position to save a snapshot of the state at, still ahead.
    checkpoint: Option<usize>,
    /// Whether the prompt cache keeps copies of this state (recurrent models): at the checkpoint
    /// and at the end of the prompt.
    snapshots: bool,
    /// The tokens `state` has consumed, for the prompt cache and the samplers' penalties.
    consumed: Vec<u32>,
    /// Logits of the end of the prompt saved by the prompt cache.
    saved_logits: Option<Vec<f32>>,
    stream: StreamDecoder<'a>,
    max_tokens: usize,
    ignore_eos: bool,
    /// How this sequence drafts tokens when it decodes alone.
    pub(crate) speculation: Speculation,
    /// Tokens to decode one at a time before drafting again, and how many checking passes in a
    /// row kept no draft: each such pass doubles the wait (up to [`MAX_DRAFT_BACKOFF`]), so text
    /// that does not repeat costs few wasted passes.
    draft_backoff: usize,
    draft_misses: u32,
    /// The draft model's state for this sequence ([`Speculation::Draft`]), made on first use.
    drafting: Option<crate::draft::Drafting<B>>,
    /// The MTP layer's state for this sequence ([`Speculation::Mtp`]), made on first use.
    mtp: Option<crate::mtp::MtpDrafting<B>>,
    phase: Phase,
    error: Option<EngineError>,
    stats: GenerationStats,
    start: Instant,
    decode_start: Option<Instant>,
}

impl<'a, B: Backend, S: Sink> Sequence<'a, B, S> {
    pub fn is_finished(&self) -> bool {
        matches!(self.phase, Phase::Finished(_))
    }

    /// Whether the prompt is still being read (the sequence has produced no token yet).
    pub fn in_prompt(&self) -> bool {
        matches!(self.phase, Phase::Prompt)
    }

    pub fn sink(&self) -> &S {
        &self.sink
    }

    /// Counts so far (final once finished).
    pub fn stats(&self) -> &GenerationStats {
        &self.stats
    }

    fn end(&mut self, reason: FinishReason) {
        self.phase = Phase::Finished(reason);
    }

    fn fail(&mut self, e: EngineError) {
        self.error = Some(e);
        self.end(FinishReason::Cancelled);
    }

    /// The prompt tokens the next prefill pass runs, at most `budget`: up to the checkpoint, then
    /// up to the end.
    fn next_chunk(&self, budget: usize) -> std::ops::Range<usize> {
        let end = self.checkpoint.unwrap_or(self.prompt.len());
        self.done..end.min(self.done + budget)
    }

    /// Hands a chosen token on; decides whether the generation goes on.
    fn take(&mut self, token: u32, eos_ids: &[u32]) {
        if !self.ignore_eos && eos_ids.contains(&token) {
            return self.end(FinishReason::Stop);
        }
        self.stats.generated_tokens += 1;
        let text = match self.stream.push(token) {
            Ok(t) => t.unwrap_or_default(),
            Err(e) => return self.fail(e.into()),
        };
        if let ControlFlow::Break(halt) = self.sink.event(TokenEvent::Token {
            id: token,
            text: &text,
        }) {
            return self.end(halt.into());
        }
        if self.stats.generated_tokens == self.max_tokens {
            return self.end(FinishReason::Length);
        }
        self.phase = Phase::Decode(token);
    }

    /// Ends the generation: hands over the text still held back, saves the state in `cache`
    /// (unless the prompt was never read whole) and returns the counts, or the error that
    /// stopped it, with the sink.
    pub fn finish(
        mut self,
        cache: Option<&mut PromptCache<B>>,
    ) -> (Result<GenerationStats, EngineError>, S) {
        if let Some(e) = self.error.take() {
            return (Err(e), self.sink);
        }
        let finish = match self.phase {
            Phase::Finished(r) => r,
            _ => FinishReason::Cancelled,
        };
        self.stats.finish = finish;
        let Some(decode_start) = self.decode_start else {
            // Stopped while reading the prompt: nothing was generated or is worth keeping.
            return (Ok(self.stats), self.sink);
        };
        match self.stream.finish() {
            Ok(Some(rest)) => {
                let _ = self.sink.event(TokenEvent::Flush { text: &rest });
            }
            Ok(None) => {}
            Err(e) => return (Err(e.into()), self.sink),
        }
        self.stats.decode_secs = decode_start.elapsed().as_secs_f64();
        if let Some(cache) = cache {
            cache.insert(self.consumed, self.state, None);
        }
        (Ok(self.stats), self.sink)
    }
}

/// Why a request whose state (KV cache and recurrent state) at `tokens` tokens takes `need`
/// bytes cannot run with `free` bytes of the backend's memory, if it cannot: said before any
/// work, instead of an allocation failure partway through a long prompt.
pub fn state_shortfall(need: u64, tokens: usize, free: u64) -> Option<String> {
    let gb = |b: u64| b as f64 / 1e9;
    (need > free).then(|| {
        format!(
            "this prompt's model state (its KV cache at {tokens} tokens) needs {:.2} GB and \
             {:.2} GB of memory is free: shorten the prompt, or free memory (a smaller \
             --expert-cache)",
            gb(need),
            gb(free)
        )
    })
}

impl<B: Backend + 'static> Engine<B> {
    /// Whether the state of a `prompt_len`-token prompt (its KV cache and recurrent state, which
    /// its prefill takes before the first answer token) fits the backend's free memory; `Err`
    /// says what it needs. The answer's growth is not reserved: a request without a length
    /// limit would otherwise reserve the whole context.
    pub fn prompt_state_fits(&self, prompt_len: usize) -> Result<(), String> {
        let info = self.model.info();
        let tokens = prompt_len + 1;
        let need = info.state_bytes_fixed as u64 + (info.state_bytes_per_token * tokens) as u64;
        match state_shortfall(need, tokens, self.model.backend().memory().free) {
            Some(msg) => Err(msg),
            None => Ok(()),
        }
    }

    /// A generation of `request` that [`Engine::step`] advances, resuming from the longest usable
    /// state saved in `cache`. Fails at once on bad parameters, an empty prompt, one that
    /// leaves no room in the model's context, or one whose state (the KV cache of the whole
    /// prompt) would not fit the backend's free memory.
    pub fn sequence<S: Sink>(
        &self,
        cache: Option<&mut PromptCache<B>>,
        request: &GenerateRequest<'_>,
        sink: S,
    ) -> Result<Sequence<'_, B, S>, EngineError> {
        self.sequence_speculating(cache, request, sink, self.speculation.clone())
    }

    /// [`Engine::sequence`], drafting as `speculation` says.
    pub(crate) fn sequence_speculating<S: Sink>(
        &self,
        cache: Option<&mut PromptCache<B>>,
        request: &GenerateRequest<'_>,
        sink: S,
        speculation: Speculation,
    ) -> Result<Sequence<'_, B, S>, EngineError> {
        let GenerateRequest {
            prompt,
            params,
            max_tokens,
            ignore_eos,
            checkpoint,
            cancel: _,
        } = *request;
        params.validate().map_err(EngineError::Input)?;
        if matches!(speculation, Speculation::Draft { .. }) && self.draft.is_none() {
            return Err(EngineError::Input(
                "--speculate draft needs a draft model (--draft-model DIR)".into(),
            ));
        }
        if matches!(speculation, Speculation::Mtp { .. }) && self.model.mtp()?.is_none() {
            return Err(EngineError::Input(format!(
                "--speculate mtp: this {} checkpoint has no multi-token-prediction layer \
                 (`mtp.*` tensors: the official Qwen3.5 and Qwen3-Next checkpoints have one, \
                 and `sluice pack` keeps it; mlx-community conversions drop it); use \
                 --speculate lookup or --draft-model DIR",
                self.model.info().model_type
            )));
        }
        if prompt.is_empty() {
            return Err(EngineError::Input("the prompt is empty".into()));
        }
        let ctx = self.model.info().max_context;
        if prompt.len() >= ctx {
            return Err(EngineError::Input(format!(
                "the prompt has {} tokens but the model's context is {ctx}",
                prompt.len()
            )));
        }
        self.prompt_state_fits(prompt.len())
            .map_err(EngineError::Input)?;
        let start = Instant::now();
        let snapshots_wanted = cache.is_some();
        let resumed = cache.and_then(|c| c.take(self.model.backend(), prompt));
        let (mut state, cached_tokens, saved_logits) = match resumed {
            Some(r) => (r.state, r.cached_tokens, r.logits),
            None => (self.new_state()?, 0, None),
        };
        // The MTP layer drafts from the model's hidden states.
        if matches!(speculation, Speculation::Mtp { .. }) {
            state.keep_hidden();
        }
        // A recurrent state cannot be rewound, so the prompt cache keeps copies of it at the
        // points a later prompt is likely to share: the checkpoint and the end of this prompt.
        let snapshots = snapshots_wanted && !state.can_rewind();
        Ok(Sequence {
            sink,
            sampler: Sampler::new(params.clone()),
            state,
            prompt: prompt.to_vec(),
            done: cached_tokens,
            checkpoint: checkpoint.filter(|&c| snapshots && c > cached_tokens && c < prompt.len()),
            snapshots,
            consumed: prompt.to_vec(),
            saved_logits,
            stream: StreamDecoder::new(&self.tokenizer, true),
            max_tokens: max_tokens.min(ctx - prompt.len()),
            ignore_eos,
            speculation,
            draft_backoff: 0,
            draft_misses: 0,
            drafting: None,
            mtp: None,
            phase: Phase::Prompt,
            error: None,
            stats: GenerationStats {
                prompt_tokens: prompt.len(),
                cached_tokens,
                generated_tokens: 0,
                prompt_secs: 0.0,
                decode_secs: 0.0,
                finish: FinishReason::Cancelled,
                speculation: Default::default(),
            },
            start,
            decode_start: None,
        })
    }

    /// Advances every unfinished sequence of `batch` by one step: each decoding sequence by one
    /// token (all in one forward pass), and the first sequence still reading its prompt by one
    /// chunk ([`Engine::prefill_chunk`] tokens alone, [`PREFILL_CHUNK_SHARED`] beside decoding ones).
    /// A sequence whose sink reports it cancelled ends first. A failed pass ends the sequences
    /// that were in it with the error ([`Sequence::finish`] returns it).
    pub fn step<S: Sink>(
        &self,
        batch: &mut [&mut Sequence<'_, B, S>],
        cache: Option<&mut PromptCache<B>>,
    ) {
        for s in batch.iter_mut() {
            if !s.is_finished() && s.sink.cancelled() {
                s.end(FinishReason::Cancelled);
            }
        }
        // A prompt whose logits the cache saved needs no pass: its first token comes from them.
        for s in batch.iter_mut() {
            if s.in_prompt() && s.done == s.prompt.len() {
                if let Some(logits) = s.saved_logits.take() {
                    self.prompt_read(s, logits);
                }
            }
        }
        let decoding: Vec<usize> = (0..batch.len())
            .filter(|&i| matches!(batch[i].phase, Phase::Decode(_)))
            .collect();
        if let [only] = decoding[..] {
            let s = &mut *batch[only];
            let drafts = match s.draft_backoff {
                0 => self.drafts(s),
                _ => {
                    s.draft_backoff -= 1;
                    Vec::new()
                }
            };
            if !drafts.is_empty() {
                self.speculative_pass(s, &drafts);
            } else {
                self.decode_pass(batch, &decoding);
            }
        } else if !decoding.is_empty() {
            self.decode_pass(batch, &decoding);
        }
        if let Some(i) = batch.iter().position(|s| s.in_prompt()) {
            let budget = match decoding.is_empty() {
                true => self.prefill_chunk,
                false => PREFILL_CHUNK_SHARED,
            };
            self.prompt_pass(batch[i], budget, cache);
        }
    }

    fn decode_pass<S: Sink>(&self, batch: &mut [&mut Sequence<'_, B, S>], rows: &[usize]) {
        let backend = self.model.backend();
        let tokens: Vec<[u32; 1]> = rows
            .iter()
            .map(|&i| match batch[i].phase {
                Phase::Decode(t) => [t],
                _ => unreachable!("only decoding sequences are passed"),
            })
            .collect();
        let result = {
            let mut picked: Vec<&mut &mut Sequence<'_, B, S>> = batch
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| rows.contains(i))
                .map(|(_, s)| s)
                .collect();
            let mut segments: Vec<Segment<'_, B>> = picked
                .iter_mut()
                .zip(&tokens)
                .map(|(s, t)| Segment {
                    state: &mut s.state,
                    tokens: t,
                })
                .collect();
            self.model.forward_batch(&mut segments)
        };
        let out = match result {
            Ok(out) => out,
            Err(e) => return fail_all(batch, rows, e.into()),
        };
        for (&i, t) in rows.iter().zip(&tokens) {
            batch[i].consumed.push(t[0]);
        }
        let chosen = {
            let mut picked: Vec<(&mut Sampler, &[u32])> = batch
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| rows.contains(i))
                .map(|(_, s)| {
                    let s = &mut **s;
                    (&mut s.sampler, s.consumed.as_slice())
                })
                .collect();
            choose_tokens(backend, &out, &mut picked)
        };
        let chosen = match chosen {
            Ok(chosen) => chosen,
            Err(e) => return fail_all(batch, rows, e.into()),
        };
        for (&i, token) in rows.iter().zip(chosen) {
            let s = &mut *batch[i];
            match token {
                Ok(t) => s.take(t, &self.eos_ids),
                Err(e) => s.fail(e.into()),
            }
        }
    }

    /// The tokens `s`'s drafter proposes after its next token, as many as its length limit
    /// and the model's context leave room for.
    fn drafts<S: Sink>(&self, s: &mut Sequence<'_, B, S>) -> Vec<u32> {
        let Phase::Decode(next) = s.phase else {
            return Vec::new();
        };
        // The pass runs the next token and the drafts: no more than the backend computes as it
        // computes one decoded token (see `Backend::decode_rows`).
        let room = (s.max_tokens - s.stats.generated_tokens)
            .min(
                self.model
                    .info()
                    .max_context
                    .saturating_sub(s.state.position + 1),
            )
            .min(self.model.backend().decode_rows().saturating_sub(1));
        if room == 0 || s.speculation == Speculation::Off {
            return Vec::new();
        }
        let mut history = Vec::with_capacity(s.consumed.len() + 1);
        history.extend_from_slice(&s.consumed);
        history.push(next);
        match (&s.speculation, &self.draft) {
            (Speculation::Draft { draft_tokens }, Some(draft)) => {
                let drafted = draft.draft(
                    &mut s.drafting,
                    &history,
                    room.min(*draft_tokens),
                    self.model.info().vocab_size,
                    &self.eos_ids,
                );
                // A failing draft model (out of memory, say) costs the request its drafts, not
                // its answer: it goes on decoding one token per pass.
                drafted.unwrap_or_else(|e| {
                    eprintln!(
                        "sluice: the draft model failed ({e}): this request goes on without it"
                    );
                    s.speculation = Speculation::Off;
                    s.drafting = None;
                    Vec::new()
                })
            }
            (Speculation::Mtp { draft_tokens }, _) => {
                let drafted = crate::mtp::draft(
                    self.model.as_ref(),
                    &mut s.mtp,
                    &mut s.state,
                    &history,
                    room.min(*draft_tokens),
                    &self.eos_ids,
                    self.prefill_chunk,
                );
                drafted.unwrap_or_else(|e| {
                    eprintln!(
                        "sluice: the MTP layer failed ({e}): this request goes on without it"
                    );
                    s.speculation = Speculation::Off;
                    s.mtp = None;
                    s.state.hidden = None;
                    Vec::new()
                })
            }
            _ => s.speculation.draft(&history, room),
        }
    }

    /// Runs `s`'s next token and `drafts` in one pass and keeps the drafts the model agrees
    /// with (see [`crate::speculate`]): row `i`'s token is sampled as a decode step would
    /// sample it, and the drafts are kept while they equal those tokens. The state is then
    /// taken back to the tokens produced (all but the last, which runs next).
    fn speculative_pass<S: Sink>(&self, s: &mut Sequence<'_, B, S>, drafts: &[u32]) {
        let Phase::Decode(next) = s.phase else {
            return;
        };
        let backend = self.model.backend();
        let start = s.state.position;
        // A recurrent state cannot drop positions: keep a copy to go back to, and the inputs of
        // its updates in this pass, to redo them for the rows kept.
        let checkpoint = (!s.state.can_rewind()).then(|| {
            s.state.begin_log();
            s.state.checkpoint()
        });
        let mut fed = Vec::with_capacity(drafts.len() + 1);
        fed.push(next);
        fed.extend_from_slice(drafts);
        let out = match self.model.forward(&mut s.state, &fed, true) {
            Ok(out) => out,
            Err(e) => return s.fail(e.into()),
        };
        let argmax = match s.sampler.is_argmax() {
            true => match backend.argmax_rows(&out) {
                Ok(ids) => Some(ids),
                Err(e) => return s.fail(e.into()),
            },
            false => None,
        };
        let vocab = backend.shape(&out).1;
        let mut round = SpeculationStats {
            passes: 1,
            drafted: drafts.len(),
            ..Default::default()
        };
        for (row, &token) in fed.iter().enumerate() {
            // Row `row` saw the tokens up to `token`: the sampler's history does too.
            s.consumed.push(token);
            let picked = match &argmax {
                Some(ids) => Ok(ids[row]),
                None => self.sample_row(s, &out, row, vocab),
            };
            let picked = match picked {
                Ok(t) => t,
                Err(e) => return s.fail(e),
            };
            round.produced += 1;
            let kept = drafts.get(row) == Some(&picked);
            round.accepted += kept as usize;
            s.take(picked, &self.eos_ids);
            if !kept || s.is_finished() {
                break;
            }
        }
        s.stats.speculation.add(&round);
        if round.accepted == 0 {
            s.draft_misses = (s.draft_misses + 1).min(8);
            s.draft_backoff = (1usize << s.draft_misses).min(MAX_DRAFT_BACKOFF);
        } else {
            s.draft_misses = 0;
        }
        // The state holds `fed`; keep the tokens run before each produced token.
        let keep = start + round.produced;
        if s.state.position > keep {
            let kept = &fed[..round.produced];
            let back = match checkpoint {
                None => s.state.rewind(backend, keep),
                Some(checkpoint) => match self.model.take_back(&mut s.state, checkpoint, kept) {
                    Ok(back) => back,
                    Err(e) => return s.fail(e.into()),
                },
            };
            if !back {
                s.fail(EngineError::Input(
                    "speculative decoding could not take the state back".into(),
                ));
            }
        }
        s.state.log = None;
    }

    /// A token for row `row` of `out`: from the few values a top-k sampler needs when it can
    /// say which (so a device sends those back, not the vocabulary), else from the whole row.
    fn sample_row<S: Sink>(
        &self,
        s: &mut Sequence<'_, B, S>,
        out: &B::Act,
        row: usize,
        vocab: usize,
    ) -> Result<u32, EngineError> {
        if let Some(req) = s.sampler.top_request(vocab, &s.consumed) {
            let part = self
                .model
                .backend()
                .top_logits(out, row, req.n, &req.cols)?;
            if let Some(t) = s.sampler.sample_top(&req, &part, &s.consumed) {
                return Ok(t);
            }
        }
        self.sample_whole_row(s, out, row)
    }

    /// A token for row `row` of `out` from the whole row, read to the host.
    fn sample_whole_row<S: Sink>(
        &self,
        s: &mut Sequence<'_, B, S>,
        out: &B::Act,
        row: usize,
    ) -> Result<u32, EngineError> {
        let backend = self.model.backend();
        let mut logits = backend.to_host(&backend.slice_rows(out, row, 1))?;
        Ok(s.sampler.sample(&mut logits, &s.consumed))
    }

    fn prompt_pass<S: Sink>(
        &self,
        s: &mut Sequence<'_, B, S>,
        budget: usize,
        cache: Option<&mut PromptCache<B>>,
    ) {
        let chunk = s.next_chunk(budget);
        let result = {
            let mut segments = [Segment {
                state: &mut s.state,
                tokens: &s.prompt[chunk.clone()],
            }];
            self.model
                .forward_batch(&mut segments)
                .map_err(EngineError::from)
                .and_then(|out| match chunk.end == s.prompt.len() {
                    true => Ok(Some(self.model.backend().to_host(&out)?)),
                    false => Ok(None),
                })
        };
        let logits = match result {
            Ok(l) => l,
            Err(e) => return s.fail(e),
        };
        s.done = chunk.end;
        if s.checkpoint == Some(s.done) {
            s.checkpoint = None;
            if let Some(cache) = cache {
                cache.insert(s.prompt[..s.done].to_vec(), s.state.clone(), None);
            }
            return;
        }
        if let Some(logits) = logits {
            if let (Some(cache), true) = (cache, s.snapshots) {
                cache.insert(s.consumed.clone(), s.state.clone(), Some(logits.clone()));
            }
            self.prompt_read(s, logits);
        }
    }

    /// The prompt is in the state and `logits` are its last token's: the first token.
    fn prompt_read<S: Sink>(&self, s: &mut Sequence<'_, B, S>, mut logits: Vec<f32>) {
        s.stats.prompt_secs = s.start.elapsed().as_secs_f64();
        s.decode_start = Some(Instant::now());
        if s.max_tokens == 0 {
            return s.end(FinishReason::Length);
        }
        let token = s.sampler.sample(&mut logits, &s.consumed);
        s.take(token, &self.eos_ids);
    }
}

/// A token for each row of `logits`, row `i` chosen by `rows[i]`'s sampler given its history
/// (the tokens the row saw, its last included): greedy rows answered on the backend all at once,
/// the sampled rows' best logits asked for together (`Backend::top_logits_rows`: a device may
/// answer with one transfer), and a whole row read only for a sampler that cannot say which
/// values it needs (a failed read fails that row alone). The engine's decode step and
/// `sluice bench --sample` choose with it.
pub fn choose_tokens<B: Backend>(
    backend: &B,
    logits: &B::Act,
    rows: &mut [(&mut Sampler, &[u32])],
) -> Result<Vec<Result<u32, BackendError>>, BackendError> {
    let argmax = match rows.iter().any(|(s, _)| s.is_argmax()) {
        true => Some(backend.argmax_rows(logits)?),
        false => None,
    };
    let vocab = backend.shape(logits).1;
    let requests: Vec<Option<TopRequest>> = rows
        .iter_mut()
        .map(|(s, history)| match s.is_argmax() {
            true => None,
            false => s.top_request(vocab, history),
        })
        .collect();
    let asked: Vec<(usize, usize, &[u32])> = requests
        .iter()
        .enumerate()
        .filter_map(|(row, r)| r.as_ref().map(|r| (row, r.n, r.cols.as_slice())))
        .collect();
    let mut tops = match asked.is_empty() {
        true => Vec::new(),
        false => backend.top_logits_rows(logits, &asked)?,
    }
    .into_iter();
    let whole_row = |s: &mut Sampler, history: &[u32], row: usize| {
        let mut values = backend.to_host(&backend.slice_rows(logits, row, 1))?;
        Ok(s.sample(&mut values, history))
    };
    Ok(rows
        .iter_mut()
        .zip(&requests)
        .enumerate()
        .map(|(row, ((s, history), request))| match (&argmax, request) {
            (Some(ids), _) if s.is_argmax() => Ok(ids[row]),
            (_, Some(req)) => {
                let top = tops.next().expect("an answer per request");
                match s.sample_top(req, &top, history) {
                    Some(t) => Ok(t),
                    None => whole_row(s, history, row),
                }
            }
            (_, None) => whole_row(s, history, row),
        })
        .collect())
}

/// Ends the sequences at `rows` of `batch` with `e` (a pass they shared failed).
fn fail_all<B: Backend, S: Sink>(
    batch: &mut [&mut Sequence<'_, B, S>],
    rows: &[usize],
    e: EngineError,
) {
    if let [only] = rows {
        return batch[*only].fail(e);
    }
    let msg = e.to_string();
    for &i in rows {
        batch[i].fail(EngineError::Input(msg.clone()));
    }
}

/// Runs `sequence` to its end alone.
pub(crate) fn run_alone<B: Backend + 'static, S: Sink>(
    engine: &Engine<B>,
    mut sequence: Sequence<'_, B, S>,
    mut cache: Option<&mut PromptCache<B>>,
) -> (Result<GenerationStats, EngineError>, S) {
    while !sequence.is_finished() {
        engine.step(&mut [&mut sequence], cache.as_deref_mut());
    }
    sequence.finish(cache)
}

#[cfg(test)]
mod tests {
    use super::state_shortfall;

    #[test]
    fn a_state_past_free_memory_is_refused_naming_both_sizes() {
        assert_eq!(state_shortfall(1_000, 10, 1_000), None);
        let msg = state_shortfall(12_500_000_000, 262_144, 4_000_000_000).unwrap();
        assert!(
            msg.contains("262144 tokens") && msg.contains("12.50 GB") && msg.contains("4.00 GB"),
            "{msg}"
        );
    }
}
