//! `sluice serve`: the OpenAI-compatible HTTP server and its web page (crate `sluice-server`).

use std::net::{IpAddr, SocketAddr};

use anyhow::{bail, Result};
use clap::Args;
use sluice_backend::Backend;
use sluice_engine::Engine;
use sluice_server::ServerConfig;
use sluice_sys::ByteSize;

use crate::ModelArgs;

#[derive(Args)]
#[command(after_help = "Examples:\n  \
    sluice serve --model ./Qwen3-30B-A3B-4bit\n  \
    sluice serve --model ./packed --port 9000 --api-key secret\n\n\
    Open http://127.0.0.1:8080/ in a browser to chat and watch the experts stream, or point\n\
    any OpenAI client at http://127.0.0.1:8080/v1, e.g.\n  \
    curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\\n    \
    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hello\"}], \"stream\": true}'\n\n\
    Anthropic's Messages API is at /v1/messages; Claude Code runs against it with\n  \
    ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_AUTH_TOKEN=KEY claude")]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    speculate: crate::SpeculateArgs,
    /// Address to listen on. The default accepts connections from this machine only; use
    /// 0.0.0.0 to accept others (set --api-key then).
    #[arg(long, default_value = "127.0.0.1")]
    host: IpAddr,
    /// Port to listen on (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`, Anthropic's header, on
    /// /v1/messages) on /v1 requests (default: the SLUICE_API_KEY environment variable, else no
    /// key).
    #[arg(long, env = "SLUICE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Model id reported by /v1/models (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Largest accepted request body.
    #[arg(long, default_value = "16MiB", value_name = "SIZE")]
    max_body: ByteSize,
    /// Saved conversation states for prompt reuse (each holds a KV cache and, for hybrid models,
    /// recurrent states: tens of MB for a 35B model at short contexts; a request saves up to
    /// three; 0 turns prompt caching off).
    #[arg(long, default_value_t = 8, value_name = "N")]
    prompt_cache: usize,
    /// Requests generated together at most (continuous batching: each step decodes a token for
    /// every running request in one pass, reading each weight and expert once for all; more
    /// requests wait in a queue). Default: what the memory left after loading holds at 4096
    /// tokens of state per request, at most 8 (said at start); on the CPU the streamed experts'
    /// cache counts as taken, since it fills as requests run.
    #[arg(long, value_name = "N")]
    parallel: Option<usize>,
    /// After SIGTERM or Ctrl-C, seconds that running requests get to finish (no new
    /// connections are accepted meanwhile) before the server exits anyway.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    shutdown_timeout: f64,
    /// The most tokens one request may generate: a request asking for more gets a 400 error,
    /// one that does not say stops there (default: up to the model's context).
    #[arg(long, value_name = "N")]
    max_tokens_limit: Option<usize>,
    /// Let web pages from this origin call the server from a browser (CORS), e.g.
    /// http://localhost:3000; repeat for several, `*` for any. Default: none (other origins'
    /// pages cannot call it).
    #[arg(long, value_name = "ORIGIN")]
    cors_origin: Vec<String>,
}

/// Positions of state per request that the default `--parallel` leaves room for.
const PARALLEL_CONTEXT: usize = 4096;
/// The default `--parallel` at most: beyond it a step's rows leave the decode kernels on the
/// GPU (more than 8) and the CPU (16 or more), and per-request speed falls.
const PARALLEL_MAX: usize = 8;

/// The expert cache of the bundled demo model when no size is given: about a third of its
/// 14.7 MB of experts, so that they really stream and the web page's expert view shows reads,
/// hits and evictions (fully resident, there would be nothing to watch).
const DEMO_EXPERT_CACHE: u64 = 4 << 20;

pub fn run(mut a: ServeArgs) -> Result<()> {
    let max_body = a.max_body.bytes();
    if max_body == 0 {
        bail!("--max-body must be more than 0 bytes");
    }
    if a.api_key.as_deref() == Some("") {
        bail!("--api-key must not be empty");
    }
    shutdown_timeout(&a)?;
    if a.max_tokens_limit == Some(0) {
        bail!("--max-tokens-limit must be at least 1");
    }
    if a.cors_origin.iter().any(|o| o.trim().is_empty()) {
        bail!("--cors-origin must name an origin (e.g. http://localhost:3000) or be `*`");
    }
    let model = &mut a.model;
    let demo = model.model.is_none()
        && std::env::var_os("SLUICE_MODEL").is_none_or(|m| m.is_empty())
        && model.expert_cache.is_none()
        && model.stream.memory_budget.is_none()
        && model.stream.vram_budget.is_none();
    if demo {
        model.expert_cache = Some(ByteSize(DEMO_EXPERT_CACHE));
        eprintln!(
            "sluice: the demo model streams its experts through a {} cache (as with --expert-cache 4MiB), for the web page's expert view; --expert-cache or --memory-budget sets another",
            sluice_sys::format_bytes_binary(DEMO_EXPERT_CACHE)
        );
    }
    with_engine!(&a.model, |engine| serve_on(engine, &a, max_body))
}

/// `--shutdown-timeout` as a duration, or the error that says what it must be.
fn shutdown_timeout(a: &ServeArgs) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(a.shutdown_timeout).map_err(|_| {
        anyhow::anyhow!(
            "--shutdown-timeout must be a number of seconds, 0 or more (got {})",
            a.shutdown_timeout
        )
    })
}

fn serve_on<B: Backend + 'static>(
    mut engine: Engine<B>,
    a: &ServeArgs,
    max_body: u64,
) -> Result<()> {
    // A request decoding alone checks drafted tokens; several together take one token each.
    a.speculate.apply(&mut engine)?;
    crate::print_banner(&engine);
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        let path = engine
            .dir
            .path
            .canonicalize()
            .unwrap_or(engine.dir.path.clone());
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into())
    });
    let mut config = ServerConfig::new(SocketAddr::new(a.host, a.port), name);
    config.api_key = a.api_key.clone();
    config.max_body_bytes = max_body.min(usize::MAX as u64) as usize;
    config.prompt_cache = a.prompt_cache;
    config.shutdown_timeout = shutdown_timeout(a)?;
    config.max_tokens_limit = a.max_tokens_limit;
    config.cors_origins = a.cors_origin.clone();
    config.parallel = match a.parallel {
        Some(0) => bail!("--parallel must be at least 1"),
        Some(n) => n,
        None => {
            let info = engine.model.info();
            let per_request =
                info.state_bytes_fixed + info.state_bytes_per_token * PARALLEL_CONTEXT;
            let backend = engine.model.backend();
            // On the CPU the states share host memory with the expert cache, which fills as
            // requests run: what it will take is not free now, though nothing has touched it.
            let cache = match &engine.store {
                Some(store) if !backend.has_device_memory() => store.cache_bytes(),
                _ => 0,
            };
            let free = backend.memory().free.saturating_sub(cache) as usize;
            let n = (free / per_request.max(1)).clamp(1, PARALLEL_MAX);
            eprintln!(
                "sluice: --parallel {n} (default: up to {PARALLEL_MAX} requests at once; {} of state per request at {PARALLEL_CONTEXT} tokens, {} free{})",
                sluice_sys::format_bytes(per_request as u64),
                sluice_sys::format_bytes(free as u64),
                if cache > 0 { " beside the expert cache" } else { "" },
            );
            n
        }
    };
    let loopback = a.host.is_loopback();
    let key = a.api_key.is_some();
    let model = config.model_name.clone();
    sluice_server::run(engine, config, |addr| {
        eprintln!("sluice: serving `{model}` at http://{addr}/v1 (OpenAI API)");
        eprintln!(
            "sluice: web page: http://{addr}/ (chat, and the experts streaming; {} kB, in the binary)",
            sluice_server::web::page_bytes().div_ceil(1000)
        );
        eprintln!(
            "sluice: Anthropic Messages API on http://{addr}/v1/messages (Claude Code: ANTHROPIC_BASE_URL=http://{addr})"
        );
        if loopback {
            eprintln!("sluice: listening on {addr}: loopback only, other machines cannot connect (--host 0.0.0.0 to allow)");
        } else {
            eprintln!(
                "sluice: listening on {addr}: reachable from other machines{}",
                if key {
                    ""
                } else {
                    " WITHOUT an API key (set --api-key)"
                }
            );
        }
    })
}
