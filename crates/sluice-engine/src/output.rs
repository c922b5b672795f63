//! Turns the text a chat model generates, arriving piece by piece, into the parts of an OpenAI
//! chat completion: reasoning (`<think>...</think>`, Qwen3 / Qwen3.5 / DeepSeek-R1 style),
//! content, and tool calls. It also applies OpenAI `stop` strings. The tool-call formats read:
//!
//! - `<tool_call>...</tool_call>` with a JSON body as Qwen2.5 / Qwen3 / Hermes write it, an XML
//!   body as Qwen3-Coder / Qwen3.5 write it, or the name and `<arg_key>`/`<arg_value>` pairs
//!   GLM-4.5 writes;
//! - a DeepSeek section, `<｜tool▁calls▁begin｜>` ... `<｜tool▁calls▁end｜>` (the bars are U+FF5C,
//!   the "▁" U+2581), holding calls `<｜tool▁call▁begin｜>HEAD<｜tool▁sep｜>TAIL<｜tool▁call▁end｜>`:
//!   DeepSeek-V3 / R1 write `function<｜tool▁sep｜>NAME` then the arguments in a ```` ```json ````
//!   fence, DeepSeek-V3.1 `NAME<｜tool▁sep｜>{ARGS}`;
//! - a Kimi K2 section, `<|tool_calls_section_begin|>` ... `<|tool_calls_section_end|>` (or the
//!   singular `tool_call_section` spelling), holding calls
//!   `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{ARGS}<|tool_call_end|>`,
//!   whose `functions.NAME:IDX` is kept as the call's id. A Kimi section also ends unclosed
//!   reasoning, as K2-Thinking may open one without writing `</think>` first.
//!
//! A section is tool calls only if every call in it reads; otherwise its text is content,
//! verbatim. Its end marker may be missing at the end of the output (as vLLM and llama.cpp
//! accept).
//!
//! OpenAI's gpt-oss models write the harmony format instead ([`OutputOptions::harmony`], chosen
//! by the chat template): after the prompt's `<|start|>assistant` come messages
//! `HEADER<|message|>BODY` ended by `<|end|>` (the next one opens with `<|start|>assistant`),
//! `<|call|>` or `<|return|>` (both also end generation, so they are usually not in the text).
//! The header names the channel (`<|channel|>analysis`, `commentary` or `final`) and maybe a
//! recipient (`to=functions.NAME`, before or after the channel) and a content type (`json`,
//! `<|constrain|>json`):
//!
//! - `<|channel|>analysis<|message|>...<|end|>`: reasoning;
//! - `<|channel|>final<|message|>...`, and commentary without a recipient (a preamble meant for
//!   the user): content;
//! - `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{ARGS}<|call|>` (or
//!   `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>...`): a tool
//!   call, whose arguments must be a JSON object; otherwise the message is content, verbatim;
//! - a message to a built-in tool (`to=python`, `to=browser.search`) counts by its channel
//!   (analysis: reasoning), as vLLM does.
//!
//! Messages of one kind are joined with a newline (as vLLM joins analysis messages). Text that
//! is not harmony at all (no header) is content, verbatim.
//!
//! Streaming and non-streaming give the same result: [`OutputParser::push`] only returns what can
//! no longer change, holding back text that might still become a marker or a stop string, and
//! [`parse_complete`] is the same parser fed the whole text at once.
//!
//! ```
//! use sluice_engine::output::{OutputEvent, OutputOptions, OutputParser};
//!
//! let mut parser = OutputParser::new(OutputOptions {
//!     starts_in_reasoning: true, // the prompt ended with "<think>\n"
//!     parse_reasoning: true,
//!     ..OutputOptions::default()
//! });
//! let mut events = Vec::new();
//! for piece in ["Easy.\n", "</think>", "\n\n", "4"] {
//!     events.extend(parser.push(piece)); // send these as SSE deltas
//!     if parser.stopped() {
//!         break;
//!     }
//! }
//! events.extend(parser.finish());
//! assert_eq!(
//!     events,
//!     [OutputEvent::Reasoning("Easy.".into()), OutputEvent::Content("4".into())]
//! );
//! ```

use serde_json::{Map, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const TOOL_OPEN: &str = "<tool_call>";
const TOOL_CLOSE: &str = "</tool_call>";
// DeepSeek-V3 / R1 / V3.1 special tokens: fullwidth bars (U+FF5C) and "▁" (U+2581).
const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";
// Kimi K2. vLLM and llama.cpp also accept the singular `tool_call_section` spelling of the
// section markers, which the models are reported to write at times.
const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
const KIMI_SECTION_BEGIN_SINGULAR: &str = "<|tool_call_section_begin|>";
const KIMI_SECTION_ENDS: &[&str] = &["<|tool_calls_section_end|>", "<|tool_call_section_end|>"];
const KIMI_CALL_BEGIN: &str = "<|tool_call_begin|>";
const KIMI_ARGS_BEGIN: &str = "<|tool_call_argument_begin|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
// OpenAI harmony (gpt-oss), as openai/harmony's docs/format.md and its encoding define them.
const H_START: &str = "<|start|>";
const H_END: &str = "<|end|>";
const H_MESSAGE: &str = "<|message|>";
const H_CHANNEL: &str = "<|channel|>";
const H_CONSTRAIN: &str = "<|constrain|>";
const H_RETURN: &str = "<|return|>";
const H_CALL: &str = "<|call|>";
/// The markers that end a message body (harmony's stop tokens).
const H_BODY_ENDS: [&str; 3] = [H_END, H_CALL, H_RETURN];
/// How the header of the output's first message can go on from the prompt's `<|start|>assistant`.
const H_FIRST_HEADERS: [&str; 4] = [H_CHANNEL, " to=", H_CONSTRAIN, H_MESSAGE];
/// What ends or breaks a header: a header is one line, with no message end in it.
const H_HEADER_STOPS: [&str; 6] = [H_MESSAGE, "\n", H_END, H_CALL, H_RETURN, H_START];
/// The longest header read (gpt-oss writes a few dozen bytes); longer, it is not a header.
const H_MAX_HEADER: usize = 256;

/// How a block of tool calls is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    /// `<tool_call>` around one call (JSON, XML or GLM body).
    Tagged,
    /// A DeepSeek section of calls.
    DeepSeek,
    /// A Kimi K2 section of calls.
    Kimi,
}

/// Every marker this parser reads. A tokenizer may mark some of them special (Kimi's tool-call
/// markers, GGUF conversions of DeepSeek's); the decoder keeps them even where it drops special
/// tokens, or the parser would never see them ([`crate::tokenizer::Tokenizer`]).
pub const MARKERS: &[&str] = &[
    THINK_OPEN,
    THINK_CLOSE,
    TOOL_OPEN,
    TOOL_CLOSE,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_SEP,
    KIMI_SECTION_BEGIN,
    KIMI_SECTION_BEGIN_SINGULAR,
    KIMI_SECTION_ENDS[0],
    KIMI_SECTION_ENDS[1],
    KIMI_CALL_BEGIN,
    KIMI_ARGS_BEGIN,
    KIMI_CALL_END,
    H_START,
    H_END,
    H_MESSAGE,
    H_CHANNEL,
    H_CONSTRAIN,
    H_RETURN,
    H_CALL,
];

/// A marker that opens a block of tool calls, the markers that may close it, and its format.
#[derive(Debug, PartialEq, Eq)]
struct Block {
    open: &'static str,
    closes: &'static [&'static str],
    format: Format,
}

static BLOCKS: [Block; 4] = [
    Block {
        open: TOOL_OPEN,
        closes: &[TOOL_CLOSE],
        format: Format::Tagged,
    },
    Block {
        open: DS_CALLS_BEGIN,
        closes: &[DS_CALLS_END],
        format: Format::DeepSeek,
    },
    Block {
        open: KIMI_SECTION_BEGIN,
        closes: KIMI_SECTION_ENDS,
        format: Format::Kimi,
    },
    Block {
        open: KIMI_SECTION_BEGIN_SINGULAR,
        closes: KIMI_SECTION_ENDS,
        format: Format::Kimi,
    },
];

/// Markers that end reasoning when tool calls are parsed: `</think>`, and Kimi's section openers
/// (vLLM's and llama.cpp's Kimi K2 parsers let a section end unclosed reasoning).
const REASONING_ENDS_WITH_TOOLS: [&str; 3] =
    [THINK_CLOSE, KIMI_SECTION_BEGIN, KIMI_SECTION_BEGIN_SINGULAR];

/// How to read a model's output. The default reads it as plain text: no reasoning, no tool calls,
/// no stop strings.
#[derive(Debug, Clone, Default)]
pub struct OutputOptions {
    /// The prompt ended inside an open `<think>` (e.g. Qwen3.5's generation prompt ends with
    /// `"<think>\n"`): text is reasoning until `</think>`.
    pub starts_in_reasoning: bool,
    /// Split `<think>...</think>` into reasoning at all (false: everything is content).
    pub parse_reasoning: bool,
    /// Parse tool calls, in any of the formats the module lists (false when the request offered
    /// no tools: text stays content).
    pub parse_tool_calls: bool,
    /// OpenAI `stop` strings (up to 4, non-empty): generation stops at the first occurrence; the
    /// stop string and what follows are not returned. Empty strings are ignored.
    pub stop: Vec<String>,
    /// The request's `tools` array (OpenAI shape), used to type XML-format parameters; may be
    /// None.
    pub tools: Option<Value>,
    /// Read OpenAI's harmony format (gpt-oss; the module lists it) instead of `<think>` and the
    /// tool-call blocks: the prompt ended with harmony's `<|start|>assistant`
    /// ([`crate::chat::ChatTemplate::is_harmony`]). `starts_in_reasoning` does not apply; with
    /// `parse_reasoning` false the analysis text is content, and with `parse_tool_calls` false a
    /// call is content verbatim, as the other formats' blocks are.
    pub harmony: bool,
}

/// Whether the rendered prompt leaves a `<think>` block open (Qwen3.5 opens it in the
/// generation prompt): the answer then starts with reasoning
/// ([`OutputOptions::starts_in_reasoning`]).
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    match (prompt.rfind("<think>"), prompt.rfind("</think>")) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

/// One piece of parsed output. Adjacent events of the same kind may or may not be merged: callers
/// concatenate them. Texts are never empty.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputEvent {
    Reasoning(String),
    Content(String),
    ToolCall(ParsedToolCall),
}

/// A complete tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedToolCall {
    pub name: String,
    /// JSON object text, compact (`serde_json::to_string` of the arguments object), keys in the
    /// order the model wrote them.
    pub arguments: String,
    /// The id the model wrote for the call, where its format has one (Kimi K2's
    /// `functions.NAME:IDX`). Kimi's chat template prints a call's id back into the next prompt,
    /// so a server should answer with this id rather than one of its own.
    pub id: Option<String>,
}

/// Where the text being read sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Not yet known whether the output opens with `<think>` (after optional whitespace).
    Start,
    /// Inside reasoning. `fresh` until its first char is seen, so that one leading "\n" can be
    /// dropped.
    Reasoning {
        fresh: bool,
    },
    /// Dropping whitespace, after `</think>` or a tool call; content follows.
    SkipWhitespace,
    Content,
    /// After a block's opening marker: the body is collected until one of its closing markers.
    Block(&'static Block),
}

/// Splits stop-free text into reasoning, content and tool calls.
struct Splitter {
    mode: Mode,
    /// Text received but not yet decided.
    buf: String,
    parse_tool_calls: bool,
    tools: Option<Value>,
}

impl Splitter {
    fn feed(&mut self, text: &str, out: &mut Vec<OutputEvent>) {
        self.buf.push_str(text);
        while self.step(out) {}
    }

    /// Decides what it can of `buf`; true if the mode changed (so there may be more to decide).
    fn step(&mut self, out: &mut Vec<OutputEvent>) -> bool {
        match self.mode {
            Mode::Start => {
                let t = self.buf.trim_start();
                if t.starts_with(THINK_OPEN) {
                    let end = self.buf.len() - t.len() + THINK_OPEN.len();
                    self.buf.drain(..end);
                    self.mode = Mode::Reasoning { fresh: true };
                    true
                } else if THINK_OPEN.starts_with(t) {
                    false
                } else {
                    self.mode = Mode::Content;
                    true
                }
            }
            Mode::Reasoning { fresh } => {
                if fresh {
                    if self.buf.is_empty() {
                        return false;
                    }
                    if self.buf.starts_with('\n') {
                        self.buf.remove(0);
                    }
                    self.mode = Mode::Reasoning { fresh: false };
                }
                let ends: &[&str] = if self.parse_tool_calls {
                    &REASONING_ENDS_WITH_TOOLS
                } else {
                    &[THINK_CLOSE]
                };
                if let Some((i, end)) = find_first(&self.buf, ends) {
                    emit_reasoning(out, self.buf[..i].trim_end_matches('\n'));
                    if end == THINK_CLOSE {
                        self.buf.drain(..i + end.len());
                        self.mode = Mode::SkipWhitespace;
                    } else {
                        // A tool section: content mode opens it.
                        self.buf.drain(..i);
                        self.mode = Mode::Content;
                    }
                    return true;
                }
                // Trailing "\n"s are dropped if `</think>` comes next, so they wait too.
                let cut = self.buf.len() - longest_partial(&self.buf, ends);
                let cut = self.buf[..cut].trim_end_matches('\n').len();
                emit_reasoning(out, &self.buf[..cut]);
                self.buf.drain(..cut);
                false
            }
            Mode::SkipWhitespace => {
                let n = self.buf.len() - self.buf.trim_start().len();
                self.buf.drain(..n);
                if self.buf.is_empty() {
                    return false;
                }
                self.mode = Mode::Content;
                true
            }
            Mode::Content => {
                if !self.parse_tool_calls {
                    emit_content(out, &self.buf);
                    self.buf.clear();
                    return false;
                }
                let opened = BLOCKS
                    .iter()
                    .filter_map(|b| Some((self.buf.find(b.open)?, b)))
                    .min_by_key(|&(i, _)| i);
                if let Some((i, block)) = opened {
                    emit_content(out, &self.buf[..i]);
                    self.buf.drain(..i + block.open.len());
                    self.mode = Mode::Block(block);
                    return true;
                }
                let partial = BLOCKS.iter().map(|b| partial_suffix(&self.buf, b.open));
                let cut = self.buf.len() - partial.max().unwrap_or(0);
                emit_content(out, &self.buf[..cut]);
                self.buf.drain(..cut);
                false
            }
            Mode::Block(block) => {
                let Some((i, close)) = find_first(&self.buf, block.closes) else {
                    return false;
                };
                let body = &self.buf[..i];
                match parse_block(block.format, body, self.tools.as_ref()) {
                    Some(calls) => {
                        out.extend(calls.into_iter().map(OutputEvent::ToolCall));
                        self.mode = Mode::SkipWhitespace;
                    }
                    None => {
                        // Malformed: the client still sees exactly what the model wrote.
                        emit_content(out, &format!("{}{body}{close}", block.open));
                        self.mode = Mode::Content;
                    }
                }
                self.buf.drain(..i + close.len());
                true
            }
        }
    }

    /// End of text: whatever was held back is released as what it is so far.
    fn flush(&mut self, out: &mut Vec<OutputEvent>) {
        let rest = std::mem::take(&mut self.buf);
        match self.mode {
            // An unclosed `<think>` is all reasoning, its trailing newlines included.
            Mode::Reasoning { .. } => emit_reasoning(out, &rest),
            Mode::SkipWhitespace => {}
            Mode::Start | Mode::Content => emit_content(out, &rest),
            // A section's end marker may be missing (vLLM and llama.cpp accept that too); an
            // unclosed `<tool_call>` is text, as a partial call would be.
            Mode::Block(block) => match block.format {
                Format::DeepSeek | Format::Kimi => {
                    match parse_block(block.format, &rest, self.tools.as_ref()) {
                        Some(calls) => out.extend(calls.into_iter().map(OutputEvent::ToolCall)),
                        None => emit_content(out, &format!("{}{rest}", block.open)),
                    }
                }
                Format::Tagged => emit_content(out, &format!("{}{rest}", block.open)),
            },
        }
        self.mode = Mode::Content;
    }
}

/// Splits stop-free text in one of the two ways output is written.
enum Reader {
    /// `<think>` reasoning and tool-call blocks.
    Tagged(Splitter),
    Harmony(Harmony),
}

impl Reader {
    fn feed(&mut self, text: &str, out: &mut Vec<OutputEvent>) {
        match self {
            Reader::Tagged(s) => s.feed(text, out),
            Reader::Harmony(h) => h.feed(text, out),
        }
    }

    fn flush(&mut self, out: &mut Vec<OutputEvent>) {
        match self {
            Reader::Tagged(s) => s.flush(out),
            Reader::Harmony(h) => h.flush(out),
        }
    }
}

/// Where harmony text being read sits.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HarmonyMode {
    /// Where a message may begin: `<|start|>`; at the start of the output (`first`) also the
    /// rest of a header whose `<|start|>assistant` the prompt wrote.
    Expect { first: bool },
    /// In a header, up to `<|message|>`; `role`: it begins with the author's role (it followed
    /// `<|start|>` in the text).
    Header { role: bool },
    /// In the body of a message read as text. `sep`: a newline goes before its first text (an
    /// earlier message of the same kind had text).
    Text { reasoning: bool, sep: bool },
    /// In the arguments of a call to `functions.NAME`, collected until the message ends.
    Call { name: String },
}

/// Splits stop-free harmony text into reasoning, content and tool calls.
struct Harmony {
    mode: HarmonyMode,
    /// Text received but not yet decided.
    buf: String,
    /// The current message's text already read past (its `<|start|>`, its header): returned
    /// verbatim if the message turns out not to read.
    head: String,
    parse_reasoning: bool,
    parse_tool_calls: bool,
    /// Some reasoning / content was returned (a later message's text is joined with "\n").
    had_reasoning: bool,
    had_content: bool,
}

impl Harmony {
    fn new(parse_reasoning: bool, parse_tool_calls: bool) -> Self {
        Harmony {
            mode: HarmonyMode::Expect { first: true },
            buf: String::new(),
            head: String::new(),
            parse_reasoning,
            parse_tool_calls,
            had_reasoning: false,
            had_content: false,
        }
    }

    fn feed(&mut self, text: &str, out: &mut Vec<OutputEvent>) {
        self.buf.push_str(text);
        while self.step(out) {}
    }

    /// Returns a message body's text, with the newline that joins it to the last message of its
    /// kind before its first text.
    fn emit_text(&mut self, out: &mut Vec<OutputEvent>, text: &str) {
        let HarmonyMode::Text { reasoning, sep } = &mut self.mode else {
            return;
        };
        if text.is_empty() {
            return;
        }
        let (emit, had): (fn(&mut Vec<OutputEvent>, &str), _) = if *reasoning {
            (emit_reasoning, &mut self.had_reasoning)
        } else {
            (emit_content, &mut self.had_content)
        };
        if std::mem::take(sep) {
            emit(out, "\n");
        }
        emit(out, text);
        *had = true;
    }

    /// Content returned verbatim (not a message body: no joining newline).
    fn emit_verbatim(&mut self, out: &mut Vec<OutputEvent>, text: &str) {
        if !text.is_empty() {
            emit_content(out, text);
            self.had_content = true;
        }
    }

    /// The body of a message that is not read as harmony: its text is content, verbatim.
    fn verbatim_body(&mut self) {
        let head = std::mem::take(&mut self.head);
        self.buf.insert_str(0, &head);
        self.mode = HarmonyMode::Text {
            reasoning: false,
            sep: false,
        };
    }

    /// Decides what it can of `buf`; true if the mode changed (so there may be more to decide).
    fn step(&mut self, out: &mut Vec<OutputEvent>) -> bool {
        match self.mode.clone() {
            HarmonyMode::Expect { first } => {
                if self.buf.starts_with(H_START) {
                    self.head = self.buf.drain(..H_START.len()).collect();
                    self.mode = HarmonyMode::Header { role: true };
                    return true;
                }
                if first && H_FIRST_HEADERS.iter().any(|o| self.buf.starts_with(o)) {
                    self.mode = HarmonyMode::Header { role: false };
                    return true;
                }
                let maybe = |o: &&str| o.starts_with(self.buf.as_str());
                if maybe(&H_START) || (first && H_FIRST_HEADERS.iter().any(maybe)) {
                    return false; // empty, or a marker's beginning
                }
                // Not harmony: the text is content as it is.
                self.verbatim_body();
                true
            }
            HarmonyMode::Header { role } => {
                let end = match find_first(&self.buf, &H_HEADER_STOPS) {
                    Some((i, H_MESSAGE)) if i <= H_MAX_HEADER => i,
                    Some(_) => {
                        self.verbatim_body();
                        return true;
                    }
                    None if self.buf.len() >= H_MAX_HEADER + H_MESSAGE.len() => {
                        self.verbatim_body();
                        return true;
                    }
                    None => return false,
                };
                let (channel, recipient) = parse_harmony_header(&self.buf[..end], role);
                self.head.extend(self.buf.drain(..end + H_MESSAGE.len()));
                let function = recipient
                    .as_deref()
                    .and_then(|r| r.strip_prefix("functions."));
                match function {
                    Some(name) if self.parse_tool_calls => {
                        self.mode = HarmonyMode::Call {
                            name: name.to_string(),
                        };
                    }
                    // A call read as text: verbatim, header and all.
                    Some(_) => self.verbatim_body(),
                    None => {
                        // Built-in tools' messages (`to=python`, `to=browser.*`) count by their
                        // channel, as in vLLM's harmony parsing: on analysis they are reasoning.
                        let reasoning =
                            self.parse_reasoning && channel.as_deref() == Some("analysis");
                        let had = if reasoning {
                            self.had_reasoning
                        } else {
                            self.had_content
                        };
                        self.head.clear();
                        self.mode = HarmonyMode::Text {
                            reasoning,
                            sep: had,
                        };
                    }
                }
                true
            }
            HarmonyMode::Text { .. } => {
                if let Some((i, end)) = find_first(&self.buf, &H_BODY_ENDS) {
                    let text = self.buf[..i].to_string();
                    self.buf.drain(..i + end.len());
                    self.emit_text(out, &text);
                    self.mode = HarmonyMode::Expect { first: false };
                    return true;
                }
                let cut = self.buf.len() - longest_partial(&self.buf, &H_BODY_ENDS);
                let text: String = self.buf.drain(..cut).collect();
                self.emit_text(out, &text);
                false
            }
            HarmonyMode::Call { name } => {
                let Some((i, end)) = find_first(&self.buf, &H_BODY_ENDS) else {
                    return false;
                };
                let args = self.buf[..i].to_string();
                self.buf.drain(..i + end.len());
                self.end_call(out, &name, &args);
                self.mode = HarmonyMode::Expect { first: false };
                true
            }
        }
    }

    /// A call message's end: a tool call if its arguments are a JSON object, else its text,
    /// verbatim.
    fn end_call(&mut self, out: &mut Vec<OutputEvent>, name: &str, args: &str) {
        let head = std::mem::take(&mut self.head);
        match named_call(name, args.trim(), None) {
            Some(call) => out.push(OutputEvent::ToolCall(call)),
            None => {
                self.emit_verbatim(out, &head);
                self.emit_verbatim(out, args);
            }
        }
    }

    /// End of text. `<|call|>` and `<|return|>` end generation, so the last message's end is
    /// usually not in the text: its body is taken as it is (a call whose arguments are complete
    /// is a call). A header cut off is content, verbatim.
    fn flush(&mut self, out: &mut Vec<OutputEvent>) {
        let rest = std::mem::take(&mut self.buf);
        match self.mode.clone() {
            HarmonyMode::Expect { .. } => self.emit_verbatim(out, &rest),
            HarmonyMode::Header { .. } => {
                let head = std::mem::take(&mut self.head);
                self.emit_verbatim(out, &head);
                self.emit_verbatim(out, &rest);
            }
            HarmonyMode::Text { .. } => self.emit_text(out, &rest),
            HarmonyMode::Call { name } => self.end_call(out, &name, &rest),
        }
        self.mode = HarmonyMode::Expect { first: false };
    }
}

/// The channel and the recipient a harmony header names, read as openai/harmony's
/// `parse_header_from_string` reads them: `<|channel|>` is followed by the channel's name; the
/// rest, split at whitespace (and before `<|constrain|>`), is the role when `role` (the header
/// followed `<|start|>`), then `to=RECIPIENT` and a content type in either order.
fn parse_harmony_header(header: &str, role: bool) -> (Option<String>, Option<String>) {
    let mut rest = header.to_string();
    let mut channel = None;
    if let Some(i) = rest.find(H_CHANNEL) {
        let after = &rest[i + H_CHANNEL.len()..];
        let len = after
            .find(|c: char| c.is_whitespace() || c == '<')
            .unwrap_or(after.len());
        channel = Some(after[..len].to_string());
        rest = format!("{} {}", &rest[..i], &after[len..]);
    }
    let rest = rest.replace(H_CONSTRAIN, &format!(" {H_CONSTRAIN}"));
    let mut parts = rest.split_whitespace();
    if role {
        parts.next();
    }
    let recipient = parts
        .find_map(|p| p.strip_prefix("to="))
        .map(str::to_string);
    (channel, recipient)
}

fn emit_reasoning(out: &mut Vec<OutputEvent>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(OutputEvent::Reasoning(last)) = out.last_mut() {
        last.push_str(text);
    } else {
        out.push(OutputEvent::Reasoning(text.to_string()));
    }
}

fn emit_content(out: &mut Vec<OutputEvent>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(OutputEvent::Content(last)) = out.last_mut() {
        last.push_str(text);
    } else {
        out.push(OutputEvent::Content(text.to_string()));
    }
}

/// The earliest occurrence in `text` of any of `markers`: its position and the marker.
fn find_first(text: &str, markers: &[&'static str]) -> Option<(usize, &'static str)> {
    markers
        .iter()
        .filter_map(|&m| Some((text.find(m)?, m)))
        .min_by_key(|&(i, _)| i)
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `markers`.
fn longest_partial(text: &str, markers: &[&str]) -> usize {
    markers
        .iter()
        .map(|m| partial_suffix(text, m))
        .max()
        .unwrap_or(0)
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker` (0 if none).
fn partial_suffix(text: &str, marker: &str) -> usize {
    let max = (marker.len() - 1).min(text.len());
    (1..=max)
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k)
                && text.as_bytes().ends_with(&marker.as_bytes()[..k])
        })
        .unwrap_or(0)
}

/// Reads streamed model output into [`OutputEvent`]s. Stop strings are applied to the raw text
/// first, then reasoning and tool-call blocks are split out of what precedes the stop.
pub struct OutputParser {
    stops: Vec<String>,
    /// Raw text that might still be the start of a stop string.
    pending: String,
    splitter: Reader,
    stopped: bool,
    /// The stop string found, once [`stopped`](Self::stopped).
    matched: Option<String>,
    /// Stopped or finished: nothing more is read.
    done: bool,
}

impl OutputParser {
    pub fn new(opts: OutputOptions) -> Self {
        let mode = if !opts.parse_reasoning {
            Mode::Content
        } else if opts.starts_in_reasoning {
            Mode::Reasoning { fresh: true }
        } else {
            Mode::Start
        };
        let splitter = if opts.harmony {
            Reader::Harmony(Harmony::new(opts.parse_reasoning, opts.parse_tool_calls))
        } else {
            Reader::Tagged(Splitter {
                mode,
                buf: String::new(),
                parse_tool_calls: opts.parse_tool_calls,
                tools: opts.tools,
            })
        };
        OutputParser {
            stops: opts.stop.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            splitter,
            stopped: false,
            matched: None,
            done: false,
        }
    }

    /// Feeds newly generated text; returns the events that are now certain. Text that might be
    /// the start of a marker (`<think>`, `</think>`, a tool-call opener) or of a stop string is
    /// held back until it is decided, as are trailing newlines of reasoning (dropped before
    /// `</think>`) and a whole tool-call block until it closes. When a stop string is found
    /// everything before it is returned, as [`finish`](Self::finish) would.
    pub fn push(&mut self, text: &str) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if self.stops.is_empty() {
            self.splitter.feed(text, &mut out);
            return out;
        }
        self.pending.push_str(text);
        self.scan_stops(false, &mut out);
        out
    }

    /// True once a stop string was seen: the caller must stop generating (everything before the
    /// stop string has been returned by push).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string the text reached (the first listed of those found at the earliest
    /// place), once [`stopped`](Self::stopped).
    pub fn stop_sequence(&self) -> Option<&str> {
        self.matched.as_deref()
    }

    /// End of generation: flushes held-back text. A malformed tool call, or an unclosed
    /// `<tool_call>`, is returned as Content text (its raw text, verbatim), never dropped; an
    /// unclosed DeepSeek or Kimi section is still read as calls if every call in it is complete.
    /// Later calls return nothing.
    pub fn finish(&mut self) -> Vec<OutputEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        self.scan_stops(true, &mut out);
        if !self.done {
            let rest = std::mem::take(&mut self.pending);
            self.splitter.feed(&rest, &mut out);
            self.splitter.flush(&mut out);
            self.done = true;
        }
        out
    }

    /// Passes on the part of `pending` that no stop string can start in, or stops at the earliest
    /// stop string. At `end` no more text comes, so partial stop strings are not waited for.
    fn scan_stops(&mut self, end: bool, out: &mut Vec<OutputEvent>) {
        let p = &self.pending;
        let found = self.stops.iter().filter_map(|s| p.find(s.as_str())).min();
        // The earliest place a stop string might still begin once more text comes.
        let maybe = if end {
            None
        } else {
            let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
            (p.len().saturating_sub(longest.saturating_sub(1))..p.len()).find(|&q| {
                p.is_char_boundary(q)
                    && self.stops.iter().any(|s| {
                        s.len() > p.len() - q && s.as_bytes().starts_with(&p.as_bytes()[q..])
                    })
            })
        };
        match (found, maybe) {
            // A stop string that might begin before the one found has to be decided first, or the
            // result would depend on how the text was split.
            (Some(at), m) if m.is_none_or(|m| m >= at) => {
                self.matched = self
                    .stops
                    .iter()
                    .find(|s| self.pending.find(s.as_str()) == Some(at))
                    .cloned();
                let before = self.pending[..at].to_string();
                self.pending.clear();
                self.splitter.feed(&before, out);
                self.splitter.flush(out);
                self.stopped = true;
                self.done = true;
            }
            (found, maybe) => {
                let cut = maybe
                    .unwrap_or(self.pending.len())
                    .min(found.unwrap_or(self.pending.len()));
                let ready: String = self.pending.drain(..cut).collect();
                self.splitter.feed(&ready, out);
            }
        }
    }
}

/// The whole output of a non-streaming request, split up.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedOutput {
    /// The concatenated reasoning; None if there was none.
    pub reasoning: Option<String>,
    /// The concatenated content; empty if there was none (callers send `null` for an empty
    /// content when there are tool calls).
    pub content: String,
    pub tool_calls: Vec<ParsedToolCall>,
    /// A stop string ended the output.
    pub stopped: bool,
}

/// Convenience for non-streaming: the concatenated reasoning, content and tool calls of a whole
/// text, exactly as streaming it through [`OutputParser`] gives.
pub fn parse_complete(opts: OutputOptions, text: &str) -> ParsedOutput {
    let mut parser = OutputParser::new(opts);
    let mut events = parser.push(text);
    events.extend(parser.finish());
    ParsedOutput::from_events(events, parser.stopped())
}

impl ParsedOutput {
    /// The events of one output joined up: reasoning and content concatenated, tool calls in
    /// order; `stopped` is [`OutputParser::stopped`].
    pub fn from_events(events: impl IntoIterator<Item = OutputEvent>, stopped: bool) -> Self {
        let mut reasoning = String::new();
        let mut content = String::new();
        let mut tool_calls = Vec::new();
        for e in events {
            match e {
                OutputEvent::Reasoning(r) => reasoning.push_str(&r),
                OutputEvent::Content(c) => content.push_str(&c),
                OutputEvent::ToolCall(t) => tool_calls.push(t),
            }
        }
        ParsedOutput {
            reasoning: (!reasoning.is_empty()).then_some(reasoning),
            content,
            tool_calls,
            stopped,
        }
    }
}

/// Reads the body of a block of tool calls; None if any of it does not read as a call.
fn parse_block(format: Format, body: &str, tools: Option<&Value>) -> Option<Vec<ParsedToolCall>> {
    match format {
        Format::Tagged => parse_tool_call(body, tools).map(|c| vec![c]),
        Format::DeepSeek => parse_section(body, DS_CALL_BEGIN, DS_CALL_END, parse_deepseek_call),
        Format::Kimi => parse_section(body, KIMI_CALL_BEGIN, KIMI_CALL_END, parse_kimi_call),
    }
}

/// The calls of a section: one or more `begin CALL end`, whitespace around them allowed and
/// nothing else.
fn parse_section(
    body: &str,
    begin: &str,
    end: &str,
    parse_call: fn(&str) -> Option<ParsedToolCall>,
) -> Option<Vec<ParsedToolCall>> {
    let mut calls = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let r = rest.strip_prefix(begin)?;
        let e = r.find(end)?;
        calls.push(parse_call(&r[..e])?);
        rest = r[e + end.len()..].trim_start();
    }
    (!calls.is_empty()).then_some(calls)
}

/// One DeepSeek call, between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`. V3.1:
/// `NAME<｜tool▁sep｜>{ARGS}`. V3 / R1: `function<｜tool▁sep｜>NAME`, a newline, then the arguments
/// in a json code fence; the type must be "function", as llama.cpp has it (vLLM takes any).
fn parse_deepseek_call(call: &str) -> Option<ParsedToolCall> {
    let (head, tail) = call.split_once(DS_SEP)?;
    let tail = tail.trim();
    if tail.starts_with('{') {
        return named_call(head.trim(), tail, None);
    }
    if head.trim() != "function" {
        return None;
    }
    let (name, fenced) = tail.split_once('\n')?;
    let args = fenced.trim().strip_prefix("```json")?.strip_suffix("```")?;
    named_call(name.trim(), args.trim(), None)
}

/// One Kimi call, between `<|tool_call_begin|>` and `<|tool_call_end|>`:
/// `functions.NAME:IDX<|tool_call_argument_begin|>{ARGS}`, or a bare `NAME:IDX` (vLLM accepts
/// both). The whole `functions.NAME:IDX` is the call's id.
fn parse_kimi_call(call: &str) -> Option<ParsedToolCall> {
    let (id, args) = call.split_once(KIMI_ARGS_BEGIN)?;
    let id = id.trim();
    let (func, index) = id.rsplit_once(':')?;
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let name = func.strip_prefix("functions.").unwrap_or(func);
    named_call(name, args.trim(), Some(id.to_string()))
}

/// A call from a name and the JSON text of its arguments object; None if the name is not a
/// plausible function name or the arguments are not a JSON object.
fn named_call(name: &str, args: &str, id: Option<String>) -> Option<ParsedToolCall> {
    if !valid_name(name) {
        return None;
    }
    let Value::Object(args) = serde_json::from_str::<Value>(args).ok()? else {
        return None;
    };
    Some(ParsedToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
        id,
    })
}

/// A function name: not empty, and no whitespace or markup characters.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.contains(|c: char| c.is_whitespace() || "<>{}".contains(c))
}

/// Reads the body between `<tool_call>` and `</tool_call>`; None if it is neither a JSON call, an
/// XML `<function=...>` call nor a GLM call.
fn parse_tool_call(body: &str, tools: Option<&Value>) -> Option<ParsedToolCall> {
    let body = body.trim();
    if body.starts_with('{') {
        parse_json_call(body)
    } else if body.starts_with("<function=") {
        parse_xml_call(body, tools)
    } else {
        parse_glm_call(body, tools)
    }
}

/// GLM-4.5's `f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n...`: the name on the first
/// line, then key/value pairs whose values are typed as XML parameters are (GLM's template writes
/// strings as they are and everything else as JSON).
fn parse_glm_call(body: &str, tools: Option<&Value>) -> Option<ParsedToolCall> {
    let end = body.find("<arg_key>").unwrap_or(body.len());
    let name = body[..end].trim();
    if !valid_name(name) {
        return None;
    }
    /// The text between `open` and `close` at the start of `s` (after whitespace), and the rest.
    fn tag<'s>(s: &'s str, open: &str, close: &str) -> Option<(&'s str, &'s str)> {
        let r = s.trim_start().strip_prefix(open)?;
        let c = r.find(close)?;
        Some((&r[..c], &r[c + close.len()..]))
    }
    let mut args = Map::new();
    let mut s = &body[end..];
    while !s.trim().is_empty() {
        let (key, r) = tag(s, "<arg_key>", "</arg_key>")?;
        let (raw, r) = tag(r, "<arg_value>", "</arg_value>")?;
        let key = key.trim();
        if key.is_empty() {
            return None;
        }
        let value = type_value(raw, param_types(tools, name, key).as_deref());
        args.insert(key.to_string(), value);
        s = r;
    }
    // A bare word is a call only if it names an offered tool.
    if args.is_empty() && find_tool(tools, name).is_none() {
        return None;
    }
    Some(ParsedToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
        id: None,
    })
}

/// `{"name": "f", "arguments": {...}}`; `arguments` may be a JSON string holding an object, or be
/// called `parameters`, or be missing.
fn parse_json_call(body: &str) -> Option<ParsedToolCall> {
    let Value::Object(obj) = serde_json::from_str::<Value>(body).ok()? else {
        return None;
    };
    let name = obj.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s).ok()? {
            Value::Object(m) => m,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ParsedToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
        id: None,
    })
}

/// `<function=f>\n<parameter=p>\nvalue\n</parameter>\n...</function>`. As vLLM's qwen3_coder
/// parser, a missing `</parameter>` ends the value at the next `<parameter=`, and a missing
/// `</function>` at the end of the body.
fn parse_xml_call(body: &str, tools: Option<&Value>) -> Option<ParsedToolCall> {
    let rest = body.strip_prefix("<function=")?;
    let gt = rest.find('>')?;
    let name = rest[..gt].trim();
    if name.is_empty() {
        return None;
    }
    let rest = &rest[gt + 1..];
    let inner = match rest.find("</function>") {
        Some(i) if rest[i + "</function>".len()..].trim().is_empty() => &rest[..i],
        Some(_) => return None,
        None => rest,
    };
    // serde_json's `preserve_order` (enabled for this crate) keeps the model's parameter order.
    let mut args = Map::new();
    let mut s = inner.trim_start();
    while !s.is_empty() {
        let r = s.strip_prefix("<parameter=")?;
        let gt = r.find('>')?;
        let pname = r[..gt].trim();
        if pname.is_empty() {
            return None;
        }
        let r = &r[gt + 1..];
        let close = r.find("</parameter>");
        let next = r.find("<parameter=");
        let (raw, after) = match close {
            Some(c) if next.is_none_or(|n| c < n) => (&r[..c], &r[c + "</parameter>".len()..]),
            _ => r.split_at(next.unwrap_or(r.len())),
        };
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = type_value(raw, param_types(tools, name, pname).as_deref());
        args.insert(pname.to_string(), value);
        s = after.trim_start();
    }
    Some(ParsedToolCall {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
        id: None,
    })
}

/// The function `func` of an OpenAI `tools` array.
fn find_tool<'t>(tools: Option<&'t Value>, func: &str) -> Option<&'t Value> {
    tools?.as_array()?.iter().find_map(|t| {
        let f = t.get("function").unwrap_or(t);
        (f.get("name")?.as_str()? == func).then_some(f)
    })
}

/// The JSON-schema `type` of parameter `param` of function `func` in an OpenAI `tools` array, as
/// a list (`"type"` may be a string or an array of strings); None if the schema does not say.
fn param_types(tools: Option<&Value>, func: &str, param: &str) -> Option<Vec<String>> {
    let tool = find_tool(tools, func)?;
    let ty = tool
        .get("parameters")?
        .get("properties")?
        .get(param)?
        .get("type")?;
    let types: Vec<String> = match ty {
        Value::String(s) => vec![s.to_ascii_lowercase()],
        Value::Array(a) => a
            .iter()
            .filter_map(|t| Some(t.as_str()?.to_ascii_lowercase()))
            .collect(),
        _ => return None,
    };
    (!types.is_empty()).then_some(types)
}

/// Names vLLM's qwen3_coder parser treats as strings.
fn is_string_type(t: &str) -> bool {
    matches!(t, "string" | "str" | "text" | "varchar" | "char" | "enum")
}

fn is_known_type(t: &str) -> bool {
    is_string_type(t)
        || matches!(
            t,
            "integer" | "int" | "number" | "float" | "boolean" | "bool" | "object" | "array"
        )
        || t == "null"
}

/// Types an XML parameter value. A schema's "string" keeps the text; other schema types parse it
/// as JSON (Python's True/False/None accepted), keeping the text if it does not parse. Without a
/// (known) schema type, JSON objects, arrays, numbers, booleans and null are taken as such and
/// anything else stays text.
fn type_value(raw: &str, types: Option<&[String]>) -> Value {
    let text = || Value::String(raw.to_string());
    let types = types.filter(|ts| ts.iter().any(|t| is_known_type(t)));
    let Some(types) = types else {
        return match serde_json::from_str::<Value>(raw) {
            Ok(v) if !v.is_string() => v,
            _ => text(),
        };
    };
    let wants_string = types.iter().any(|t| is_string_type(t));
    if wants_string && types.iter().all(|t| is_string_type(t)) {
        return text();
    }
    let wants = |t: &[&str]| types.iter().any(|x| t.contains(&x.as_str()));
    let parsed = match raw.trim() {
        "True" if wants(&["boolean", "bool"]) => Some(Value::Bool(true)),
        "False" if wants(&["boolean", "bool"]) => Some(Value::Bool(false)),
        "None" if wants(&["null"]) => Some(Value::Null),
        t => serde_json::from_str::<Value>(t).ok(),
    };
    match parsed {
        // With "string" among the types, a value that parses to none of the others is text.
        Some(v) if wants_string && !matches_type(&v, types) => text(),
        Some(v) => v,
        None => text(),
    }
}

fn matches_type(v: &Value, types: &[String]) -> bool {
    types.iter().any(|t| match t.as_str() {
        "integer" | "int" => v.is_i64() || v.is_u64(),
        "number" | "float" => v.is_number(),
        "boolean" | "bool" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "null" => v.is_null(),
        _ => false,
    })
}

#[cfg(test)]
mod tests;
