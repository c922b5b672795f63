//! Everything between a model and a user: tokenizer, chat templates, sampling and the generation
//! loop. [`Engine`] loads a model directory once and then serves any number of requests.

#![forbid(unsafe_code)]

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use sluice_backend::{Backend, BackendError, ExpertSource};
use sluice_format::{FormatError, ModelDir};
use sluice_models::{CausalLm, ModelError, State};

pub mod batch;
pub mod chat;
pub mod draft;
mod mtp;
pub mod npy;
pub mod output;
pub mod prompt_cache;
pub mod sampler;
pub mod speculate;
pub mod streaming;
pub mod tokenizer;
pub mod turn;

use chat::{ChatError, ChatMessage, ChatTemplate};
use prompt_cache::PromptCache;
use sampler::SamplingParams;
use tokenizer::{Tokenizer, TokenizerError};

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Chat(#[from] ChatError),
    #[error("{0}")]
    Input(String),
    #[error(transparent)]
    Store(#[from] sluice_store::StoreError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// Choices made when a model is loaded.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Overrides the config's number of routed experts per token.
    pub experts_per_token: Option<usize>,
    /// How attention caches store keys and values.
    pub kv_format: sluice_backend::KvFormat,
    /// Tokens per prefill pass ([`PREFILL_CHUNK`] when `None`): larger passes read each
    /// streamed expert once for more tokens, at the cost of working memory.
    pub prefill_chunk: Option<usize>,
    /// The context one request's state is sized for: an expert cache derived from the memory
    /// budget or the free memory leaves room for it (`None`: no room kept beyond the reserve).
    pub context: Option<usize>,
    /// Expert cache and I/O settings for streamed experts (packed model directories, or
    /// unpacked ones with `streaming.stream_unpacked`).
    pub streaming: streaming::StreamingOptions,
}

/// How `logits` feeds tokens through the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsMode {
    /// One token per forward call, through the caches.
    Decode,
    /// All tokens in one forward call.
    Prefill,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was produced.
    Stop,
    /// The output reached one of the caller's stop sequences (the callback broke with
    /// [`Halt::StopSequence`]).
    StopSequence,
    /// `max_tokens` were produced.
    Length,
    /// The caller asked to stop: the cancel flag was set, or the callback broke with
    /// [`Halt::Cancel`].
    Cancelled,
}

/// What [`Engine::generate`] hands its callback, in order: one `Token` per generated token, then
/// at most one `Flush`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenEvent<'a> {
    /// A generated token (never an end-of-sequence token) and the text it completed, possibly
    /// empty: a token may end inside a character, whose text then comes with a later token.
    Token { id: u32, text: &'a str },
    /// After the last token, the text still held back (never empty; an incomplete character at
    /// the very end, decoded as U+FFFD). Not a token. The generation is over: breaking here
    /// changes nothing.
    Flush { text: &'a str },
}

/// Why a callback stops a generation ([`ControlFlow::Break`]); it becomes the
/// [`FinishReason`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Halt {
    /// The output reached a stop sequence: [`FinishReason::StopSequence`].
    StopSequence,
    /// The output is no longer wanted (a closed pipe, a client gone):
    /// [`FinishReason::Cancelled`].
    Cancel,
}

impl From<Halt> for FinishReason {
    fn from(halt: Halt) -> Self {
        match halt {
            Halt::StopSequence => FinishReason::StopSequence,
            Halt::Cancel => FinishReason::Cancelled,
        }
    }
}

/// A rendered chat prompt (see [`Engine::chat_prompt`]).
#[derive(Debug, Clone)]
pub struct ChatPrompt {
    pub text: String,
    pub tokens: Vec<u32>,
    /// Tokens of the conversation before the generation prompt, when they are a prefix of
    /// `tokens`.
    pub checkpoint: Option<usize>,
}

/// One generation: the prompt tokens and how to continue them.
#[derive(Debug, Clone, Copy)]
pub struct GenerateRequest<'a> {
    pub prompt: &'a [u32],
    pub params: &'a SamplingParams,
    /// At most this many tokens (also capped by the model's context).
    pub max_tokens: usize,
    /// Checked between prompt chunks and before every token: set it to stop the generation
    /// (a disconnected client); the result then has [`FinishReason::Cancelled`].
    pub cancel: Option<&'a AtomicBool>,
    /// Keep going past end-of-sequence tokens until `max_tokens` (benchmarks, tests).
    pub ignore_eos: bool,
    /// A prompt position worth saving the state at for later requests (with a prompt cache, for
    /// models whose state cannot be rewound): typically where the conversation's messages end and
    /// the generation prompt begins, since the next turn re-renders the answer differently (e.g.
    /// without its reasoning) but keeps everything before it.
    pub checkpoint: Option<usize>,
}

/// Counts and timings of one generation.
#[derive(Debug, Clone)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens whose state came from the prompt cache instead of being recomputed.
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// Time to process the prompt and produce the first token's logits.
    pub prompt_secs: f64,
    /// Time spent producing the remaining tokens.
    pub decode_secs: f64,
    pub finish: FinishReason,
    /// What speculative decoding did (all zero when off).
    pub speculation: speculate::SpeculationStats,
}

impl GenerationStats {
    /// Prompt tokens actually computed per second.
    pub fn prompt_tok_per_sec(&self) -> f64 {
        (self.prompt_tokens - self.cached_tokens) as f64 / self.prompt_secs.max(1e-9)
    }

    /// Decode speed over the tokens after the first.
    pub fn decode_tok_per_sec(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }
}

/// Prompts are run through the model in chunks of this many tokens, bounding activation memory.
pub const PREFILL_CHUNK: usize = 512;

/// A loaded model with its tokenizer and chat template.
pub struct Engine<B: Backend> {
    pub dir: ModelDir,
    pub model: Box<dyn CausalLm<B>>,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    /// Token ids that end a generation.
    pub eos_ids: Vec<u32>,
    /// Sampling defaults from generation_config.json.
    pub defaults: SamplingParams,
    /// The expert store, when experts stream from disk (a packed directory, or an unpacked one
    /// with `stream_unpacked`).
    pub store: Option<sluice_store::ExpertStore>,
    /// How the expert cache was sized (streamed experts).
    pub cache_plan: Option<streaming::CachePlan>,
    /// Tokens per prefill pass of a prompt running alone.
    pub prefill_chunk: usize,
    /// How the backend's own expert cache (a GPU's) was sized, when it keeps one.
    pub device_cache_plan: Option<sluice_backend::ExpertCachePlan>,
    /// How a sequence decoding alone drafts tokens to check several per pass (off by default;
    /// sequences decoding together take one token each).
    pub speculation: speculate::Speculation,
    /// The model [`speculate::Speculation::Draft`] drafts with ([`Engine::load_draft`]).
    pub draft: Option<draft::DraftModel<B>>,
    backend: Arc<B>,
}

impl<B: Backend + 'static> Engine<B> {
    pub fn load(path: &Path, backend: Arc<B>, opts: &LoadOptions) -> Result<Self, EngineError> {
        // A GGUF's experts stay in the file when they stream: asked for, or when converting
        // them all would not fit in memory.
        let gguf_experts = if opts.streaming.stream_unpacked {
            sluice_format::GgufExperts::Stream
        } else {
            sluice_format::GgufExperts::Auto
        };
        let dir = ModelDir::open_with(path, gguf_experts)?;
        let must_stream = !dir.streamed_experts.is_empty();
        if must_stream && !opts.streaming.stream_unpacked {
            eprintln!(
                "sluice: {}'s weights do not fit in memory once converted: its routed experts \
                 stream from the file (as with --memory-budget)",
                path.display()
            );
        }
        let config = sluice_models::config_plan(&dir)?;
        // The cache holds at least the experts one token needs in one layer.
        let k = config
            .experts_per_token
            .max(opts.experts_per_token.unwrap_or(0))
            .max(1);
        let streaming = streaming::StreamingOptions {
            // The store's cache page-locked where the backend copies from it (a GPU).
            pinner: backend.host_pinner().map(sluice_store::Pinner),
            // On the CPU a request's state shares host memory with the expert cache.
            state_reserve: match opts.context {
                Some(n) if !backend.has_device_memory() => {
                    let pass_tokens = opts.prefill_chunk.unwrap_or(PREFILL_CHUNK).min(n).max(1);
                    Some(streaming::StateReserve {
                        state: config.state.bytes(opts.kv_format, n),
                        tokens: n,
                        pass: config.state.pass_bytes(pass_tokens) + backend.pass_scratch_bytes(n),
                        pass_tokens,
                    })
                }
                _ => None,
            },
            ..opts.streaming.clone()
        };
        let (store, cache_plan) = match sluice_store::Manifest::open(&dir.path)
            .map_err(sluice_store::StoreError::from)?
        {
            Some(manifest) => {
                let (store, plan) = streaming::open_store(&dir.path, manifest, &streaming, k)?;
                (Some(store), Some(plan))
            }
            None if opts.streaming.stream_unpacked || must_stream => {
                match streaming::open_unpacked_store(&dir, &streaming, k)? {
                    Some((store, plan)) => (Some(store), Some(plan)),
                    None => (None, None),
                }
            }
            None => (None, None),
        };
        let source = store.clone().map(|s| Arc::new(s) as Arc<dyn ExpertSource>);
        let mut model = sluice_models::load_with_experts(&dir, backend.clone(), source)?;
        // The backend's own expert cache (VRAM) gets what the resident weights leave.
        let device_cache_plan = match &store {
            Some(store) => {
                let manifest = store.manifest();
                let experts = manifest.layers.iter().map(|l| l.experts).sum();
                backend.plan_expert_cache(
                    opts.streaming.vram_budget,
                    manifest.max_stride(),
                    experts,
                )?
            }
            None => None,
        };
        if let Some(k) = opts.experts_per_token {
            model.set_experts_per_token(k)?;
        }
        model.set_kv_format(opts.kv_format)?;
        let tokenizer = match &dir.tokenizer_json {
            Some(json) => Tokenizer::from_bytes(json.as_bytes(), &dir.path)?,
            None => Tokenizer::from_file(&dir.tokenizer_path())?,
        };
        let tc = &dir.tokenizer_config;
        let chat_template = ChatTemplate::new(
            tc.chat_template.as_deref().unwrap_or(chat::FALLBACK_CHATML),
            tc.bos_token.clone(),
            tc.eos_token.clone(),
        )?;
        let mut eos_ids = dir.generation.eos_token_id.clone();
        if let Some(id) = tc.eos_token.as_deref().and_then(|t| tokenizer.token_id(t)) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let g = &dir.generation;
        let base = SamplingParams::default();
        let defaults = SamplingParams {
            temperature: g.temperature.unwrap_or(base.temperature),
            top_k: g.top_k.unwrap_or(base.top_k),
            top_p: g.top_p.unwrap_or(base.top_p),
            min_p: g.min_p.unwrap_or(base.min_p),
            repetition_penalty: g.repetition_penalty.unwrap_or(base.repetition_penalty),
            ..base
        };
        let vocab = model.info().vocab_size;
        if tokenizer.vocab_size() > vocab {
            return Err(EngineError::Input(format!(
                "{}: the tokenizer has {} tokens but the model's vocab_size is {vocab}",
                dir.tokenizer_path().display(),
                tokenizer.vocab_size()
            )));
        }
        Ok(Engine {
            dir,
            model,
            tokenizer,
            chat_template,
            eos_ids,
            defaults,
            store,
            cache_plan,
            device_cache_plan,
            prefill_chunk: opts.prefill_chunk.unwrap_or(PREFILL_CHUNK).max(1),
            speculation: speculate::Speculation::Off,
            draft: None,
            backend,
        })
    }

    /// Loads the model at `path` on this engine's backend as its draft model
    /// ([`speculate::Speculation::Draft`]); it must share the tokenizer. Its weights and its
    /// state per request come on top of the memory this engine planned for.
    pub fn load_draft(&mut self, path: &Path, opts: &LoadOptions) -> Result<(), EngineError> {
        let draft = draft::DraftModel::load(path, self.backend.clone(), opts, self)?;
        self.draft = Some(draft);
        Ok(())
    }

    pub fn new_state(&self) -> Result<State<B>, EngineError> {
        Ok(self.model.new_state()?)
    }

    /// Renders a conversation with the model's chat template, ready to continue as the assistant.
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, EngineError> {
        Ok(self.chat_template.render(messages, tools, true, extra)?)
    }

    /// Renders and tokenizes a conversation for generation, with the prompt-cache checkpoint
    /// where its messages end and the generation prompt begins (see
    /// [`GenerateRequest::checkpoint`]).
    pub fn chat_prompt(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<ChatPrompt, EngineError> {
        let text = self.chat_template.render(messages, tools, true, extra)?;
        // A rendered template already holds its special tokens (transformers encodes it likewise).
        let tokens = self.tokenizer.encode(&text, false)?;
        let checkpoint = self
            .chat_template
            .render(messages, tools, false, extra)
            .ok()
            .filter(|head| text.starts_with(head.as_str()) && head.len() < text.len())
            .and_then(|head| self.tokenizer.encode(&head, false).ok())
            .filter(|head| tokens.starts_with(head))
            .map(|head| head.len());
        Ok(ChatPrompt {
            text,
            tokens,
            checkpoint,
        })
    }

    /// Runs `tokens` through the model (in chunks) and returns the last token's logits.
    pub fn prefill(&self, state: &mut State<B>, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.prefill_cancellable(state, tokens, None)?
            .ok_or_else(|| EngineError::Input("the prompt is empty".into()))
    }

    /// [`Engine::prefill`] that checks `cancel` between chunks; `Ok(None)` when cancelled or
    /// `tokens` is empty.
    fn prefill_cancellable(
        &self,
        state: &mut State<B>,
        tokens: &[u32],
        cancel: Option<&AtomicBool>,
    ) -> Result<Option<Vec<f32>>, EngineError> {
        let mut last = None;
        for chunk in tokens.chunks(self.prefill_chunk) {
            if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                return Ok(None);
            }
            last = Some(self.model.forward(state, chunk, false)?);
        }
        last.map(|l| self.model.backend().to_host(&l))
            .transpose()
            .map_err(EngineError::from)
    }

    /// Generates up to `max_tokens` after `prompt`, calling `on_event` with each token as it is
    /// produced and then with the text held back at the end (see [`TokenEvent`]). Stops at an
    /// end-of-sequence token (not passed on), at `max_tokens`, or when `on_event` breaks with a
    /// [`Halt`], which sets the [`FinishReason`].
    pub fn generate(
        &self,
        prompt: &[u32],
        params: &SamplingParams,
        max_tokens: usize,
        on_event: impl FnMut(TokenEvent<'_>) -> ControlFlow<Halt>,
    ) -> Result<GenerationStats, EngineError> {
        let request = GenerateRequest {
            prompt,
            params,
            max_tokens,
            cancel: None,
            ignore_eos: false,
            checkpoint: None,
        };
        self.generate_cached(None, &request, on_event)
    }

    /// [`Engine::generate`] that resumes from the longest usable state saved in `cache` (see
    /// [`PromptCache`]) and saves this request's states there afterwards: a [`batch::Sequence`]
    /// stepped alone.
    pub fn generate_cached(
        &self,
        cache: Option<&mut PromptCache<B>>,
        request: &GenerateRequest<'_>,
        on_event: impl FnMut(TokenEvent<'_>) -> ControlFlow<Halt>,
    ) -> Result<GenerationStats, EngineError> {
        self.generate_alone(cache, None, request, on_event)
    }

    /// [`Engine::generate_cached`] without a prompt cache, drafting as `speculation` says
    /// instead of [`Engine::speculation`]: benchmarks comparing drafters on one engine.
    pub fn generate_speculating(
        &self,
        speculation: speculate::Speculation,
        request: &GenerateRequest<'_>,
        on_event: impl FnMut(TokenEvent<'_>) -> ControlFlow<Halt>,
    ) -> Result<GenerationStats, EngineError> {
        self.generate_alone(None, Some(speculation), request, on_event)
    }

    /// One request stepped alone, with `cache` and `speculation` (`None`: the engine's).
    fn generate_alone(
        &self,
        mut cache: Option<&mut PromptCache<B>>,
        speculation: Option<speculate::Speculation>,
        request: &GenerateRequest<'_>,
        on_event: impl FnMut(TokenEvent<'_>) -> ControlFlow<Halt>,
    ) -> Result<GenerationStats, EngineError> {
        let sink = batch::FnSink {
            on_event,
            cancel: request.cancel,
        };
        let speculation = speculation.unwrap_or_else(|| self.speculation.clone());
        let sequence =
            self.sequence_speculating(cache.as_deref_mut(), request, sink, speculation)?;
        batch::run_alone(self, sequence, cache).0
    }

    /// Logits `[tokens.len(), vocab]` (row-major) at every position of `tokens`.
    pub fn logits(&self, tokens: &[u32], mode: LogitsMode) -> Result<Vec<f32>, EngineError> {
        let mut state = self.new_state()?;
        let b = self.model.backend();
        match mode {
            LogitsMode::Prefill => {
                let mut all = Vec::new();
                for chunk in tokens.chunks(self.prefill_chunk) {
                    all.extend(b.to_host(&self.model.forward(&mut state, chunk, true)?)?);
                }
                Ok(all)
            }
            LogitsMode::Decode => {
                let mut all = Vec::new();
                for &t in tokens {
                    all.extend(b.to_host(&self.model.forward(&mut state, &[t], true)?)?);
                }
                Ok(all)
            }
        }
    }
}
