//! `sluice chat`: a terminal conversation with a model.
//!
//! The conversation is re-rendered with the model's chat template every turn (as a server
//! client would send it), and the prompt cache resumes from the state saved at the end of the
//! previous answer, so each turn only computes the new tokens.

use std::io::{IsTerminal, Write};
use std::ops::ControlFlow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use rustyline::error::ReadlineError;
use sluice_backend::Backend;
use sluice_engine::chat::ChatMessage;
use sluice_engine::output::{prompt_opens_thinking, OutputEvent, OutputOptions};
use sluice_engine::prompt_cache::PromptCache;
use sluice_engine::{Engine, FinishReason, GenerateRequest};

use crate::{ModelArgs, SamplingArgs};

#[derive(Args)]
#[command(after_help = "In the chat:\n  \
    /system TEXT   set the system message (and start over)\n  \
    /reset         forget the conversation (keeps the system message)\n  \
    /quit          leave (or Ctrl-D)\n  \
    Ctrl-C         stop the current answer")]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// System message.
    #[arg(long)]
    system: Option<String>,
    /// Maximum tokens per answer.
    #[arg(long = "max-tokens", short = 'n', default_value_t = 1024)]
    max_tokens: usize,
    /// Ask the model not to think first (sets the template's `enable_thinking` to false).
    #[arg(long)]
    no_think: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    speculate: crate::SpeculateArgs,
}

const HELP: &str = "commands: /system TEXT, /reset, /quit (Ctrl-D); Ctrl-C stops an answer";

pub fn run(a: ChatArgs) -> Result<()> {
    with_engine!(&a.model, |engine| chat_on(engine, &a))
}

fn chat_on<B: Backend + 'static>(mut engine: Engine<B>, a: &ChatArgs) -> Result<()> {
    let params = a.sampling.params(&engine.defaults)?;
    a.speculate.apply(&mut engine)?;
    crate::print_banner(&engine);
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let flag = interrupted.clone();
        ctrlc::set_handler(move || flag.store(true, Ordering::Relaxed))
            .context("installing the Ctrl-C handler")?;
    }
    let tty = std::io::stdout().is_terminal();
    let mut editor = rustyline::DefaultEditor::new().context("opening the terminal")?;
    eprintln!("{HELP}");
    let mut system = a.system.clone();
    let mut history: Vec<ChatMessage> = Vec::new();
    // One conversation saves up to three states per turn (see GenerateRequest::checkpoint).
    let mut cache = PromptCache::new(4);
    let mut extra = serde_json::Map::new();
    if a.no_think {
        extra.insert("enable_thinking".into(), false.into());
    }
    loop {
        let line = match editor.readline(">>> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => {
                eprintln!("(/quit or Ctrl-D to leave)");
                continue;
            }
            Err(ReadlineError::Eof) => break,
            Err(e) => return Err(e).context("reading input"),
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let _ = editor.add_history_entry(line);
        match command(line) {
            Some(("/quit" | "/exit", _)) => break,
            Some(("/reset", _)) => {
                history.clear();
                eprintln!("(conversation cleared)");
                continue;
            }
            Some(("/system", text)) => {
                system = (!text.is_empty()).then(|| text.to_string());
                history.clear();
                eprintln!("(system message set; conversation cleared)");
                continue;
            }
            Some(("/help", _)) => {
                eprintln!("{HELP}");
                continue;
            }
            Some((other, _)) => {
                eprintln!("unknown command {other}; {HELP}");
                continue;
            }
            None => {}
        }
        history.push(ChatMessage::new("user", line));
        let mut messages: Vec<ChatMessage> = system
            .iter()
            .map(|s| ChatMessage::new("system", s))
            .collect();
        messages.extend(history.iter().cloned());
        interrupted.store(false, Ordering::Relaxed);
        match answer(
            &engine,
            &messages,
            &extra,
            &params,
            a,
            &mut cache,
            &interrupted,
            tty,
        ) {
            Ok(reply) => history.push(reply),
            Err(e) => {
                // The turn failed (e.g. the conversation outgrew the context): drop it, keep going.
                history.pop();
                eprintln!("error: {e:#}");
            }
        }
    }
    Ok(())
}

/// `/name rest` → `(name, rest)`; `None` for ordinary text.
fn command(line: &str) -> Option<(&str, &str)> {
    if !line.starts_with('/') {
        return None;
    }
    Some(match line.split_once(char::is_whitespace) {
        Some((name, rest)) => (name, rest.trim()),
        None => (line, ""),
    })
}

/// Generates and prints one answer; returns it as the assistant message for the history.
#[allow(clippy::too_many_arguments)]
fn answer<B: Backend + 'static>(
    engine: &Engine<B>,
    messages: &[ChatMessage],
    extra: &serde_json::Map<String, serde_json::Value>,
    params: &sluice_engine::sampler::SamplingParams,
    a: &ChatArgs,
    cache: &mut PromptCache<B>,
    interrupted: &AtomicBool,
    tty: bool,
) -> Result<ChatMessage> {
    let prompt = engine.chat_prompt(messages, None, extra)?;
    let output = OutputOptions {
        starts_in_reasoning: prompt_opens_thinking(&prompt.text),
        parse_reasoning: true,
        parse_tool_calls: false,
        stop: Vec::new(),
        tools: None,
        harmony: engine.chat_template.is_harmony(),
    };
    let (dim, reset) = if tty {
        ("\x1b[2m", "\x1b[0m")
    } else {
        ("", "")
    };
    let mut out = std::io::stdout().lock();
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut in_reasoning = false;
    let mut show = |events: Vec<OutputEvent>, out: &mut std::io::StdoutLock<'_>| {
        for e in events {
            match e {
                OutputEvent::Reasoning(t) => {
                    if !in_reasoning {
                        let _ = write!(out, "{dim}");
                        in_reasoning = true;
                    }
                    let _ = write!(out, "{t}");
                    reasoning.push_str(&t);
                }
                OutputEvent::Content(t) => {
                    if in_reasoning {
                        let _ = write!(out, "{reset}\n\n");
                        in_reasoning = false;
                    }
                    let _ = write!(out, "{t}");
                    content.push_str(&t);
                }
                OutputEvent::ToolCall(_) => {}
            }
        }
        let _ = out.flush();
    };
    let request = GenerateRequest {
        prompt: &prompt.tokens,
        params,
        max_tokens: a.max_tokens,
        cancel: Some(interrupted),
        ignore_eos: false,
        checkpoint: prompt.checkpoint,
    };
    // Ctrl-C stops an answer through `interrupted`, never from here.
    let stats = engine.chat_turn(Some(cache), &request, output, |event| {
        show(event.into_output(), &mut out);
        ControlFlow::Continue(())
    })?;
    if in_reasoning {
        let _ = write!(out, "{reset}");
    }
    let _ = writeln!(out);
    drop(out);
    let why = match stats.finish {
        FinishReason::Stop | FinishReason::StopSequence => "",
        FinishReason::Length => ", stopped at --max-tokens",
        FinishReason::Cancelled => ", interrupted",
    };
    let spec = &stats.speculation;
    let drafts = match spec.drafted {
        0 => String::new(),
        _ => format!(
            "; {:.0}% of drafts kept, {:.2} tokens per pass",
            spec.acceptance() * 100.0,
            spec.tokens_per_pass()
        ),
    };
    eprintln!(
        "{dim}[{} tokens, {:.1} tok/s; prompt {} tokens, {} reused{drafts}{why}]{reset}",
        stats.generated_tokens,
        stats.decode_tok_per_sec(),
        stats.prompt_tokens,
        stats.cached_tokens,
    );
    let mut reply = ChatMessage::new("assistant", content);
    reply.reasoning_content = (!reasoning.is_empty()).then_some(reasoning);
    Ok(reply)
}
