//! Renders chat templates in a child process under a memory limit.
//!
//! A chat template is a program from a model's files. minijinja's fuel bounds how many
//! instructions a render runs, but nothing in minijinja bounds the memory it takes: forty rounds
//! of `{% set ns.s = ns.s ~ ns.s %}` ask for a terabyte, and `([0] * 10**9) | list` for sixteen
//! gigabytes in one instruction. Jinja2's documentation gives the remedy for untrusted
//! templates: a separate process under resource limits. After [`isolate_templates`] (the
//! `sluice` binary calls it at start), each [`ChatTemplate`] renders in a child process of the
//! same executable, started with `SLUICE_TEMPLATE_WORKER=1` and served by
//! [`serve_template_worker_if_asked`], with [`TEMPLATE_MEMORY`] of address space. A render that
//! goes past it ends only the child: that render fails with an error saying so, and the next
//! one starts a fresh child. Without isolation (tests, library use) templates render in the
//! calling process, bounded by fuel alone.
//!
//! The child reads one JSON line per message on stdin and answers one per message on stdout:
//! first the template ([`Init`]), answered with the probe's result, then one line per render.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Mutex, OnceLock, PoisonError};

use serde::{Deserialize, Serialize};

use super::{ChatError, ChatMessage, ChatTemplate};

/// Address space a template's renderer process may take. A real template renders a prompt of
/// a million tokens in a few tens of MiB; the rest of the gigabyte is margin.
pub const TEMPLATE_MEMORY: u64 = 1 << 30;

/// Set in a renderer process's environment; [`serve_template_worker_if_asked`] looks for it.
const WORKER_ENV: &str = "SLUICE_TEMPLATE_WORKER";

static WORKER_EXE: OnceLock<PathBuf> = OnceLock::new();

/// Templates compiled after this call render in child processes of `exe`, which must call
/// [`serve_template_worker_if_asked`] first thing in `main`. Linux only, where `RLIMIT_AS` is
/// enforced and this is tested (elsewhere templates stay in-process); the first call wins.
pub fn isolate_templates(exe: PathBuf) {
    if cfg!(target_os = "linux") {
        let _ = WORKER_EXE.set(exe);
    }
}

pub(super) fn worker_exe() -> Option<&'static Path> {
    WORKER_EXE.get().map(PathBuf::as_path)
}

/// In a process started as a template renderer, serves renders until stdin closes and exits;
/// otherwise returns at once. Call it first thing in `main`, before any thread starts.
pub fn serve_template_worker_if_asked() {
    if std::env::var_os(WORKER_ENV).is_none() {
        return;
    }
    let code = match serve_renders() {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("sluice template renderer: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// What a renderer process renders: the template as the model ships it.
#[derive(Clone, Serialize, Deserialize)]
pub(super) struct Init {
    pub source: String,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The probe's verdict once known: a process started again skips the probe, so a template
    /// that fails only on the probe cannot fail every render.
    pub string_arguments: Option<bool>,
}

#[derive(Serialize)]
pub(super) struct RenderRef<'a> {
    pub messages: &'a [ChatMessage],
    pub tools: Option<&'a serde_json::Value>,
    pub add_generation_prompt: bool,
    pub extra: &'a serde_json::Map<String, serde_json::Value>,
    pub object_arguments: bool,
}

#[derive(Deserialize)]
struct Render {
    messages: Vec<ChatMessage>,
    tools: Option<serde_json::Value>,
    add_generation_prompt: bool,
    extra: serde_json::Map<String, serde_json::Value>,
    object_arguments: bool,
}

#[derive(Serialize, Deserialize)]
enum Reply {
    /// The template compiled; the probe's verdict (see [`ChatTemplate::new`]).
    Ready {
        string_arguments: bool,
    },
    Rendered(String),
    Failed(ChatError),
}

/// The renderer process's loop.
fn serve_renders() -> std::io::Result<()> {
    sluice_sys::limit_own_memory(TEMPLATE_MEMORY)?;
    let mut lines = std::io::stdin().lock().lines();
    let mut out = std::io::stdout().lock();
    let mut reply = |r: &Reply| -> std::io::Result<()> {
        serde_json::to_writer(&mut out, r)?;
        out.write_all(b"\n")?;
        out.flush()
    };
    let Some(init) = lines.next() else {
        return Ok(());
    };
    let init: Init = serde_json::from_str(&init?)?;
    let mut template = match ChatTemplate::compile(&init.source, init.bos_token, init.eos_token) {
        Ok(t) => t,
        Err(e) => return reply(&Reply::Failed(e)),
    };
    template.string_arguments = init
        .string_arguments
        .unwrap_or_else(|| template.needs_string_arguments());
    reply(&Reply::Ready {
        string_arguments: template.string_arguments,
    })?;
    for line in lines {
        let r: Render = serde_json::from_str(&line?)?;
        let rendered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            template.render_with(
                &r.messages,
                r.tools.as_ref(),
                r.add_generation_prompt,
                &r.extra,
                r.object_arguments,
            )
        }))
        .unwrap_or_else(|_| {
            Err(ChatError::Render {
                line: None,
                detail: "the template engine panicked on this template".into(),
            })
        });
        reply(&match rendered {
            Ok(text) => Reply::Rendered(text),
            Err(e) => Reply::Failed(e),
        })?;
    }
    Ok(())
}

/// The parent's handle on a template's renderer process, started again when one ends.
pub(super) struct Isolated {
    exe: &'static Path,
    /// The [`Init`] line, sent to each new process.
    init: String,
    worker: Mutex<Option<Worker>>,
}

/// A renderer process told its template, or how it ended before it answered.
enum Spawned {
    Ready(Worker, bool),
    Ended(ChatError),
}

struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Isolated {
    /// Starts the renderer for `init`'s template; returns it with the probe's verdict (false
    /// when the probe itself ended the process: then the first render starts another).
    pub(super) fn start(exe: &'static Path, init: &Init) -> Result<(Isolated, bool), ChatError> {
        let line = |init: &Init| serde_json::to_string(init).map_err(|e| protocol_error(&e));
        let mut isolated = Isolated {
            exe,
            init: line(init)?,
            worker: Mutex::new(None),
        };
        let (worker, string_arguments) = match isolated.spawn()? {
            Spawned::Ready(w, verdict) => (Some(w), verdict),
            Spawned::Ended(_) => (None, false),
        };
        isolated.init = line(&Init {
            string_arguments: Some(string_arguments),
            ..init.clone()
        })?;
        *isolated
            .worker
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner) = worker;
        Ok((isolated, string_arguments))
    }

    /// A new renderer process, told the template.
    fn spawn(&self) -> Result<Spawned, ChatError> {
        let mut command = Command::new(self.exe);
        command
            .env(WORKER_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            // Its only words are a failed allocation's message; the error says it better.
            .stderr(Stdio::null());
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            // A terminal's Ctrl-C is for sluice (it stops an answer), not for the renderer; and
            // `ps` names it for what it is.
            command.process_group(0).arg0("sluice-template-renderer");
        }
        let cannot_start = |e: std::io::Error| ChatError::Render {
            line: None,
            detail: format!(
                "could not start the template renderer process `{}`: {e}",
                self.exe.display()
            ),
        };
        let mut child = command.spawn().map_err(cannot_start)?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(cannot_start(std::io::Error::other("no pipes")));
        };
        let mut worker = Worker {
            child,
            stdin,
            stdout: BufReader::new(stdout),
        };
        match worker.exchange(&self.init) {
            Ok(Reply::Ready { string_arguments }) => Ok(Spawned::Ready(worker, string_arguments)),
            Ok(Reply::Failed(e)) => Err(e),
            Ok(Reply::Rendered(_)) => Err(protocol_error(&"a render before any was asked")),
            Err(_) => Ok(Spawned::Ended(ended(Some(worker)))),
        }
    }

    /// Renders in the process, starting one if none runs; a process that ends mid-render is
    /// that render's error.
    pub(super) fn render(&self, request: &RenderRef<'_>) -> Result<String, ChatError> {
        let line = serde_json::to_string(request).map_err(|e| protocol_error(&e))?;
        let mut slot = self.worker.lock().unwrap_or_else(PoisonError::into_inner);
        // One that ended while idle (a signal, the OOM killer) is replaced before it is asked.
        if let Some(w) = slot.as_mut() {
            if !matches!(w.child.try_wait(), Ok(None)) {
                *slot = None;
            }
        }
        let worker = match slot.as_mut() {
            Some(w) => w,
            None => match self.spawn()? {
                Spawned::Ready(w, _) => slot.insert(w),
                Spawned::Ended(e) => return Err(e),
            },
        };
        match worker.exchange(&line) {
            Ok(Reply::Rendered(text)) => Ok(text),
            Ok(Reply::Failed(e)) => Err(e),
            Ok(Reply::Ready { .. }) => {
                *slot = None;
                Err(protocol_error(&"a second greeting"))
            }
            Err(_) => Err(ended(slot.take())),
        }
    }
}

impl Worker {
    /// Sends one line and reads the answer; any failure means the process is gone.
    fn exchange(&mut self, line: &str) -> std::io::Result<Reply> {
        self.stdin.write_all(line.as_bytes())?;
        self.stdin.write_all(b"\n")?;
        self.stdin.flush()?;
        let mut answer = String::new();
        if self.stdout.read_line(&mut answer)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(serde_json::from_str(&answer)?)
    }
}

/// The error for a render whose process ended, saying how it ended.
fn ended(worker: Option<Worker>) -> ChatError {
    let status = worker.and_then(|mut w| w.child.wait().ok());
    #[cfg(unix)]
    let aborted = status
        .and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s))
        .is_some_and(|signal| signal == SIGABRT);
    #[cfg(not(unix))]
    let aborted = false;
    let detail = if aborted {
        format!(
            "rendering took more than the {} a template may use (a template that builds huge \
             strings or lists is broken or hostile), so sluice stopped it",
            sluice_sys::format_bytes_binary(TEMPLATE_MEMORY)
        )
    } else {
        let how = status.map_or_else(|| "unknown status".to_string(), |s| s.to_string());
        format!("the template renderer process ended mid-render ({how}); sluice stopped it")
    };
    ChatError::Render { line: None, detail }
}

/// The signal a failed allocation ends a Rust process with (6 on every Unix).
#[cfg(unix)]
const SIGABRT: i32 = 6;

fn protocol_error(e: &dyn std::fmt::Display) -> ChatError {
    ChatError::Render {
        line: None,
        detail: format!("the template renderer process answered out of turn: {e}"),
    }
}
