//! Turns the text a chat model generates, arriving piece by piece, into the parts of an OpenAI
//! chat completion: reasoning (`<think>...</think>`, Qwen3 / Qwen3.5 / DeepSeek-R1 style),
//! content, and tool calls (`<tool_call>...</tool_call>` with a JSON body as Qwen2.5 / Qwen3 /
//! Hermes write it, or an XML body as Qwen3-Coder / Qwen3.5 write it). It also applies OpenAI
//! `stop` strings.
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

/// How to read a model's output. The default reads it as plain text: no reasoning, no tool calls,
/// no stop strings.
#[derive(Debug, Clone, Default)]
pub struct OutputOptions {
    /// The prompt ended inside an open `<think>` (e.g. Qwen3.5's generation prompt ends with
    /// "<think>\n"): text is reasoning until `</think>`.
    pub starts_in_reasoning: bool,
    /// Split `<think>...</think>` into reasoning at all (false: everything is content).
    pub parse_reasoning: bool,
    /// Parse `<tool_call>...</tool_call>` blocks (false when the request offered no tools: text
    /// stays content).
    pub parse_tool_calls: bool,
    /// OpenAI `stop` strings (up to 4, non-empty): generation stops at the first occurrence; the
    /// stop string and what follows are not returned. Empty strings are ignored.
    pub stop: Vec<String>,
    /// The request's `tools` array (OpenAI shape), used to type XML-format parameters; may be
    /// None.
    pub tools: Option<Value>,
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
    /// After `<tool_call>`: the body is collected until `</tool_call>`.
    ToolBody,
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
                if let Some(i) = self.buf.find(THINK_CLOSE) {
                    emit_reasoning(out, self.buf[..i].trim_end_matches('\n'));
                    self.buf.drain(..i + THINK_CLOSE.len());
                    self.mode = Mode::SkipWhitespace;
                    return true;
                }
                // Trailing "\n"s are dropped if `</think>` comes next, so they wait too.
                let cut = self.buf.len() - partial_suffix(&self.buf, THINK_CLOSE);
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
                if let Some(i) = self.buf.find(TOOL_OPEN) {
                    emit_content(out, &self.buf[..i]);
                    self.buf.drain(..i + TOOL_OPEN.len());
                    self.mode = Mode::ToolBody;
                    return true;
                }
                let cut = self.buf.len() - partial_suffix(&self.buf, TOOL_OPEN);
                emit_content(out, &self.buf[..cut]);
                self.buf.drain(..cut);
                false
            }
            Mode::ToolBody => {
                let Some(i) = self.buf.find(TOOL_CLOSE) else {
                    return false;
                };
                let body = &self.buf[..i];
                match parse_tool_call(body, self.tools.as_ref()) {
                    Some(call) => {
                        out.push(OutputEvent::ToolCall(call));
                        self.mode = Mode::SkipWhitespace;
                    }
                    None => {
                        // Malformed: the client still sees exactly what the model wrote.
                        emit_content(out, &format!("{TOOL_OPEN}{body}{TOOL_CLOSE}"));
                        self.mode = Mode::Content;
                    }
                }
                self.buf.drain(..i + TOOL_CLOSE.len());
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
            Mode::ToolBody => emit_content(out, &format!("{TOOL_OPEN}{rest}")),
        }
        self.mode = Mode::Content;
    }
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
/// first, then `<think>` and `<tool_call>` blocks are split out of what precedes the stop.
pub struct OutputParser {
    stops: Vec<String>,
    /// Raw text that might still be the start of a stop string.
    pending: String,
    splitter: Splitter,
    stopped: bool,
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
        OutputParser {
            stops: opts.stop.into_iter().filter(|s| !s.is_empty()).collect(),
            pending: String::new(),
            splitter: Splitter {
                mode,
                buf: String::new(),
                parse_tool_calls: opts.parse_tool_calls,
                tools: opts.tools,
            },
            stopped: false,
            done: false,
        }
    }

    /// Feeds newly generated text; returns the events that are now certain. Text that might be
    /// the start of a marker (`<think>`, `</think>`, `<tool_call>`) or of a stop string is held
    /// back until it is decided, as are trailing newlines of reasoning (dropped before
    /// `</think>`). When a stop string is found everything before it is returned, as
    /// [`finish`](Self::finish) would.
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

    /// End of generation: flushes held-back text. An unclosed or malformed tool call is returned
    /// as Content text (its raw text, verbatim), never dropped. Later calls return nothing.
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
        stopped: parser.stopped(),
    }
}

/// Reads the body between `<tool_call>` and `</tool_call>`; None if it is neither a JSON call nor
/// an XML `<function=...>` call.
fn parse_tool_call(body: &str, tools: Option<&Value>) -> Option<ParsedToolCall> {
    let body = body.trim();
    if body.starts_with('{') {
        parse_json_call(body)
    } else if body.starts_with("<function=") {
        parse_xml_call(body, tools)
    } else {
        None
    }
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
    })
}

/// The JSON-schema `type` of parameter `param` of function `func` in an OpenAI `tools` array, as
/// a list (`"type"` may be a string or an array of strings); None if the schema does not say.
fn param_types(tools: Option<&Value>, func: &str, param: &str) -> Option<Vec<String>> {
    let tool = tools?.as_array()?.iter().find_map(|t| {
        let f = t.get("function").unwrap_or(t);
        (f.get("name")?.as_str()? == func).then_some(f)
    })?;
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
mod tests {
    use super::*;

    #[test]
    fn thinking_detection_follows_the_last_marker() {
        assert!(prompt_opens_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!prompt_opens_thinking(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!prompt_opens_thinking("<|im_start|>assistant\n"));
        assert!(prompt_opens_thinking(
            "<think>\nold\n</think>\n\nanswer<|im_end|>\n<|im_start|>assistant\n<think>\n"
        ));
    }

    use serde_json::json;

    fn opts() -> OutputOptions {
        OutputOptions {
            parse_reasoning: true,
            parse_tool_calls: true,
            ..OutputOptions::default()
        }
    }

    fn call(name: &str, arguments: &str) -> OutputEvent {
        OutputEvent::ToolCall(ParsedToolCall {
            name: name.into(),
            arguments: arguments.into(),
        })
    }

    fn content(s: &str) -> OutputEvent {
        OutputEvent::Content(s.into())
    }

    fn reasoning(s: &str) -> OutputEvent {
        OutputEvent::Reasoning(s.into())
    }

    /// Merges adjacent events of the same text kind, as a client concatenating deltas would.
    fn merged(events: Vec<OutputEvent>) -> Vec<OutputEvent> {
        let mut out: Vec<OutputEvent> = Vec::new();
        for e in events {
            match (out.last_mut(), e) {
                (Some(OutputEvent::Content(a)), OutputEvent::Content(b)) => a.push_str(&b),
                (Some(OutputEvent::Reasoning(a)), OutputEvent::Reasoning(b)) => a.push_str(&b),
                (_, e) => out.push(e),
            }
        }
        out
    }

    /// Pushes each chunk, then finishes; all events (merged), and whether it stopped.
    fn stream(opts: OutputOptions, chunks: &[&str]) -> (Vec<OutputEvent>, bool) {
        let mut p = OutputParser::new(opts);
        let mut events = Vec::new();
        for c in chunks {
            let got = p.push(c);
            assert!(got.iter().all(|e| match e {
                OutputEvent::Content(s) | OutputEvent::Reasoning(s) => !s.is_empty(),
                OutputEvent::ToolCall(_) => true,
            }));
            events.extend(got);
        }
        events.extend(p.finish());
        (merged(events), p.stopped())
    }

    #[test]
    fn plain_text_by_default() {
        let text = "<think>x</think> <tool_call>{}</tool_call>";
        let (ev, stopped) = stream(OutputOptions::default(), &[text]);
        assert_eq!(ev, [content(text)]);
        assert!(!stopped);
    }

    #[test]
    fn stop_string_spanning_chunks() {
        let o = OutputOptions {
            stop: vec!["STOP".into()],
            ..opts()
        };
        let mut p = OutputParser::new(o);
        assert_eq!(p.push("Hello S"), [content("Hello ")]);
        assert_eq!(p.push("T"), []);
        assert_eq!(p.push("O"), []);
        assert!(!p.stopped());
        assert_eq!(p.push("P and more"), []);
        assert!(p.stopped());
        assert_eq!(p.push("even more"), []);
        assert_eq!(p.finish(), []);
        assert_eq!(p.finish(), []);
    }

    #[test]
    fn held_back_stop_prefix_released_when_not_a_stop() {
        let o = OutputOptions {
            stop: vec!["STOP".into()],
            ..opts()
        };
        let mut p = OutputParser::new(o.clone());
        assert_eq!(p.push("ST"), []);
        assert_eq!(p.push("AY"), [content("STAY")]);
        assert_eq!(p.push("ST"), []);
        assert_eq!(p.finish(), [content("ST")]);
        assert!(!p.stopped());
        assert_eq!(stream(o, &["ST", "AY ST"]).0, [content("STAY ST")]);
    }

    #[test]
    fn stop_returns_everything_before_it_from_push() {
        let o = OutputOptions {
            stop: vec!["END".into()],
            ..opts()
        };
        let mut p = OutputParser::new(o);
        // The partial "<tool" would be held back, but a stop ends the output.
        assert_eq!(p.push("a <toolEND"), [content("a <tool")]);
        assert!(p.stopped());
    }

    #[test]
    fn earliest_stop_wins_whatever_the_chunking() {
        let o = OutputOptions {
            stop: vec!["bc".into(), "abcd".into()],
            ..OutputOptions::default()
        };
        // "abcd" starts before "bc", so the output is "x" however the text arrives.
        assert_eq!(
            stream(o.clone(), &["xabc", "d"]),
            (vec![content("x")], true)
        );
        assert_eq!(stream(o.clone(), &["xabcd"]), (vec![content("x")], true));
        // "abcd" never completes: "bc" is the earliest stop.
        assert_eq!(
            stream(o.clone(), &["xabc", "e"]),
            (vec![content("xa")], true)
        );
        assert_eq!(stream(o, &["xabc"]), (vec![content("xa")], true));
    }

    #[test]
    fn stop_strings_respect_char_boundaries() {
        let o = OutputOptions {
            stop: vec!["é!".into()],
            ..OutputOptions::default()
        };
        let mut p = OutputParser::new(o.clone());
        assert_eq!(p.push("café"), [content("caf")]);
        assert_eq!(p.push("?"), [content("é?")]);
        assert_eq!(stream(o, &["caf", "é", "!x"]), (vec![content("caf")], true));
    }

    #[test]
    fn stop_inside_a_tool_call_leaves_it_as_content() {
        let o = OutputOptions {
            stop: vec!["Paris".into()],
            ..opts()
        };
        let text = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}}\n</tool_call>";
        let out = parse_complete(o, text);
        assert_eq!(
            out.content,
            "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \""
        );
        assert!(out.tool_calls.is_empty());
        assert!(out.stopped);
    }

    #[test]
    fn stop_applies_before_reasoning() {
        let o = OutputOptions {
            starts_in_reasoning: true,
            stop: vec!["</think>".into()],
            ..opts()
        };
        let out = parse_complete(o, "thinking\n</think>\n\nanswer");
        assert_eq!(out.reasoning.as_deref(), Some("thinking\n"));
        assert_eq!(out.content, "");
        assert!(out.stopped);
    }

    #[test]
    fn json_tool_call() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>";
        let (ev, _) = stream(opts(), &[text]);
        assert_eq!(
            ev,
            [call("get_weather", r#"{"location":"Paris","unit":"c"}"#)]
        );
        let out = parse_complete(opts(), &format!("Let me check.\n\n{text}\n"));
        assert_eq!(out.content, "Let me check.\n\n");
        assert_eq!(out.tool_calls.len(), 1);
        assert_eq!(out.reasoning, None);
    }

    #[test]
    fn json_tool_call_argument_forms() {
        let parse = |body: &str| {
            parse_complete(opts(), &format!("<tool_call>{body}</tool_call>")).tool_calls
        };
        let one = |name: &str, args: &str| {
            vec![ParsedToolCall {
                name: name.into(),
                arguments: args.into(),
            }]
        };
        assert_eq!(
            parse(r#"{"name": "f", "arguments": "{\"b\": 1, \"a\": [true]}"}"#),
            one("f", r#"{"b":1,"a":[true]}"#)
        );
        assert_eq!(
            parse(r#"{"name": "f", "parameters": {"x": null}}"#),
            one("f", r#"{"x":null}"#)
        );
        assert_eq!(parse(r#" {"name": "f"} "#), one("f", "{}"));
        assert_eq!(parse(r#"{"name": "f", "arguments": null}"#), one("f", "{}"));
    }

    #[test]
    fn malformed_json_tool_call_is_content_verbatim() {
        for body in [
            "\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n",
            "\n{\"arguments\": {}}\n",
            "\n{\"name\": 3}\n",
            "\n[1, 2]\n",
            "\n{\"name\": \"f\", \"arguments\": \"not json\"}\n",
            "\n{\"name\": \"f\", \"arguments\": [1]}\n",
            "\nhello\n",
            "",
        ] {
            let text = format!("A <tool_call>{body}</tool_call> B");
            let (ev, _) = stream(opts(), &[&text]);
            assert_eq!(ev, [content(&text)], "{body:?}");
        }
    }

    #[test]
    fn xml_tool_call_with_typed_params() {
        let tools = json!([
            {"type": "function", "function": {"name": "other", "parameters": {"properties": {
                "days": {"type": "string"}}}}},
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string"},
                    "days": {"type": "integer"},
                    "zip": {"type": "string"},
                    "metric": {"type": "boolean"},
                    "opts": {"type": "object"},
                    "ratio": {"type": "number"},
                    "bad": {"type": "integer"},
                    "maybe": {"type": ["integer", "null"]},
                    "either": {"type": ["string", "integer"]}
                }}}}
        ]);
        let o = OutputOptions {
            tools: Some(tools),
            ..opts()
        };
        let text = "<tool_call>\n<function=get_weather>\n\
            <parameter=location>\nParis\n</parameter>\n\
            <parameter=days>\n3\n</parameter>\n\
            <parameter=zip>\n75001\n</parameter>\n\
            <parameter=metric>\nTrue\n</parameter>\n\
            <parameter=opts>\n{\"a\": [1, 2]}\n</parameter>\n\
            <parameter=ratio>\n0.5\n</parameter>\n\
            <parameter=bad>\nmany\n</parameter>\n\
            <parameter=maybe>\nNone\n</parameter>\n\
            <parameter=either>\nabc\n</parameter>\n\
            <parameter=extra>\n[1]\n</parameter>\n\
            </function>\n</tool_call>";
        let (ev, _) = stream(o, &[text]);
        assert_eq!(
            ev,
            [call(
                "get_weather",
                r#"{"location":"Paris","days":3,"zip":"75001","metric":true,"opts":{"a":[1,2]},"ratio":0.5,"bad":"many","maybe":null,"either":"abc","extra":[1]}"#
            )]
        );
    }

    #[test]
    fn xml_params_without_schema_keep_order_and_guess_types() {
        let text = "<tool_call>\n<function=f>\n\
            <parameter=z>\nhello world\n</parameter>\n\
            <parameter=a>\n42\n</parameter>\n\
            <parameter=m>\nfalse\n</parameter>\n\
            <parameter=q>\n\"quoted\"\n</parameter>\n\
            <parameter=multi>\n\nline one\nline two\n\n</parameter>\n\
            <parameter=open>\nno close\n<parameter=last>\nnull\n\
            </function>\n</tool_call>";
        let out = parse_complete(opts(), text);
        assert_eq!(out.content, "");
        assert_eq!(
            out.tool_calls,
            [ParsedToolCall {
                name: "f".into(),
                arguments: r#"{"z":"hello world","a":42,"m":false,"q":"\"quoted\"","multi":"\nline one\nline two\n","open":"no close","last":null}"#.into()
            }]
        );
        // No parameters, and no `</function>`.
        let out = parse_complete(opts(), "<tool_call><function=now></tool_call>");
        assert_eq!(out.tool_calls[0].arguments, "{}");
    }

    #[test]
    fn malformed_xml_tool_call_is_content_verbatim() {
        for body in [
            "\n<function=>\n</function>\n",
            "\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\ntrailing\n",
            "\n<function=f>\njunk\n</function>\n",
            "\n<function=f\n",
        ] {
            let text = format!("<tool_call>{body}</tool_call>");
            assert_eq!(parse_complete(opts(), &text).content, text, "{body:?}");
        }
    }

    #[test]
    fn two_tool_calls_drop_whitespace_between() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n\n\
                    <tool_call>\n<function=b>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n";
        let (ev, _) = stream(opts(), &[text]);
        assert_eq!(ev, [call("a", "{}"), call("b", r#"{"x":1}"#)]);
    }

    #[test]
    fn text_after_a_tool_call_is_content() {
        let text = "<tool_call>{\"name\": \"a\"}</tool_call>\n\nDone.";
        let (ev, _) = stream(opts(), &[text]);
        assert_eq!(ev, [call("a", "{}"), content("Done.")]);
    }

    #[test]
    fn unclosed_tool_call_at_finish_is_content() {
        let mut p = OutputParser::new(opts());
        assert_eq!(p.push("Hi <tool_call>\n{\"name\": \"a\""), [content("Hi ")]);
        assert_eq!(p.push(", \"arguments\": {}}"), []);
        assert_eq!(
            p.finish(),
            [content("<tool_call>\n{\"name\": \"a\", \"arguments\": {}}")]
        );
    }

    #[test]
    fn tool_call_event_only_when_closed() {
        let mut p = OutputParser::new(opts());
        assert_eq!(p.push("<tool_call>{\"name\": \"a\"}</tool_"), []);
        assert_eq!(p.push("call>"), [call("a", "{}")]);
        assert_eq!(p.finish(), []);
    }

    #[test]
    fn reasoning_with_starts_in_reasoning() {
        let o = OutputOptions {
            starts_in_reasoning: true,
            ..opts()
        };
        let mut p = OutputParser::new(o.clone());
        assert_eq!(p.push("\nLet me"), [reasoning("Let me")]);
        // Trailing newlines wait: they are dropped if `</think>` follows.
        assert_eq!(p.push(" think.\n"), [reasoning(" think.")]);
        assert_eq!(p.push("\n</th"), []);
        assert_eq!(p.push("ink>\n\n"), []);
        assert_eq!(p.push("Answer"), [content("Answer")]);
        assert_eq!(p.finish(), []);
        // Newlines inside reasoning are kept once text follows them.
        let out = parse_complete(o, "a\n\nb\n</think>\n\nc");
        assert_eq!(out.reasoning.as_deref(), Some("a\n\nb"));
        assert_eq!(out.content, "c");
    }

    #[test]
    fn think_at_start() {
        let text = "\n <think>\nreasoning\n</think>\n\nThe answer.";
        for chunks in [vec![text], text.split_inclusive(['>', '\n']).collect()] {
            let (ev, _) = stream(opts(), &chunks);
            assert_eq!(ev, [reasoning("reasoning"), content("The answer.")]);
        }
        let out = parse_complete(opts(), "<think>\n\n</think>\n\nHi");
        assert_eq!((out.reasoning, out.content.as_str()), (None, "Hi"));
    }

    #[test]
    fn think_not_at_start_is_content() {
        let text = "Hello <think>x</think> world";
        assert_eq!(stream(opts(), &[text]).0, [content(text)]);
        let text = "Hi</think>";
        assert_eq!(stream(opts(), &[text]).0, [content(text)]);
        let mut p = OutputParser::new(opts());
        assert_eq!(p.push("  <thi"), []);
        assert_eq!(p.push("s"), [content("  <this")]);
    }

    #[test]
    fn no_closing_think_is_all_reasoning() {
        let out = parse_complete(opts(), "<think>\nstill thinking\n\n</thi");
        assert_eq!(out.reasoning.as_deref(), Some("still thinking\n\n</thi"));
        assert_eq!(out.content, "");
        let o = OutputOptions {
            starts_in_reasoning: true,
            ..opts()
        };
        let out = parse_complete(o, "all reasoning <think> here");
        assert_eq!(out.reasoning.as_deref(), Some("all reasoning <think> here"));
    }

    #[test]
    fn tool_call_inside_reasoning_stays_reasoning() {
        let text = "<think>\nMaybe <tool_call>{\"name\": \"a\"}</tool_call>\n</think>\n\nOK";
        let (ev, _) = stream(opts(), &[text]);
        assert_eq!(
            ev,
            [
                reasoning("Maybe <tool_call>{\"name\": \"a\"}</tool_call>"),
                content("OK")
            ]
        );
    }

    #[test]
    fn parse_tool_calls_false_keeps_the_block_as_content() {
        let o = OutputOptions {
            parse_tool_calls: false,
            ..opts()
        };
        let text = "<tool_call>\n{\"name\": \"a\"}\n</tool_call>";
        let mut p = OutputParser::new(o);
        assert_eq!(p.push(text), [content(text)]);
        assert_eq!(p.finish(), []);
    }

    #[test]
    fn parse_reasoning_false_is_all_content() {
        let o = OutputOptions {
            parse_reasoning: false,
            starts_in_reasoning: true,
            ..opts()
        };
        let text = "<think>\nx\n</think>\n\ny";
        assert_eq!(stream(o, &[text]).0, [content(text)]);
    }

    #[test]
    fn partial_marker_held_back_then_released() {
        let mut p = OutputParser::new(opts());
        assert_eq!(p.push("<to"), []);
        assert_eq!(p.push("day"), [content("<today")]);
        assert_eq!(p.push(" <tool"), [content(" ")]);
        assert_eq!(p.finish(), [content("<tool")]);
    }

    #[test]
    fn content_keeps_leading_whitespace_without_reasoning() {
        assert_eq!(stream(opts(), &["  \n", "hi"]).0, [content("  \nhi")]);
        assert_eq!(stream(opts(), &[" \n "]).0, [content(" \n ")]);
    }

    /// splitmix64: a small deterministic PRNG for the property test.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// Splits `text` at random char boundaries.
    fn random_chunks<'a>(rng: &mut Rng, text: &'a str) -> Vec<&'a str> {
        let mut cuts: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .filter(|&i| i > 0 && rng.below(3) == 0)
            .collect();
        cuts.push(text.len());
        let mut chunks = Vec::new();
        let mut start = 0;
        for c in cuts {
            chunks.push(&text[start..c]);
            start = c;
        }
        chunks
    }

    #[test]
    fn streaming_matches_parse_complete_for_any_chunking() {
        const PIECES: &[&str] = &[
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<",
            "</",
            "<tool",
            "</think",
            "{",
            "}",
            "\"name\"",
            ": ",
            "\"f\"",
            ", ",
            "\"arguments\"",
            "{\"name\": \"f\", \"arguments\": {\"a\": 1}}",
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>",
            "<tool_call>\n<function=f>\n<parameter=a>\n2\n</parameter>\n</function>\n</tool_call>",
            "<function=f>",
            "<parameter=a>",
            "</parameter>",
            "</function>",
            "1",
            "\n",
            "\n\n",
            " ",
            "é",
            "世",
            "x",
            "STOP",
            "ST",
            "OP",
            "é!",
            "ab",
            "c",
        ];
        let stop_sets: &[&[&str]] = &[&[], &["STOP"], &["é!", "</tool"], &["abc", "b", "\n\n\n"]];
        let tools = json!([{"type": "function", "function": {"name": "f",
            "parameters": {"properties": {"a": {"type": "integer"}}}}}]);
        let mut rng = Rng(0x5eed);
        let mut tool_calls = 0;
        let mut stops = 0;
        for case in 0..3000 {
            let len = rng.below(14);
            let text: String = (0..len).map(|_| PIECES[rng.below(PIECES.len())]).collect();
            let o = OutputOptions {
                starts_in_reasoning: rng.below(3) == 0,
                parse_reasoning: rng.below(5) != 0,
                parse_tool_calls: rng.below(5) != 0,
                stop: stop_sets[case % stop_sets.len()]
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
                tools: (rng.below(2) == 0).then(|| tools.clone()),
            };
            let whole = stream(o.clone(), &[&text]);
            let complete = parse_complete(o.clone(), &text);
            tool_calls += complete.tool_calls.len();
            stops += complete.stopped as usize;
            // parse_complete is the concatenation of the one-chunk stream.
            let mut from_events = (String::new(), String::new(), Vec::new());
            for e in &whole.0 {
                match e {
                    OutputEvent::Reasoning(r) => from_events.0.push_str(r),
                    OutputEvent::Content(c) => from_events.1.push_str(c),
                    OutputEvent::ToolCall(t) => from_events.2.push(t.clone()),
                }
            }
            assert_eq!(complete.reasoning.unwrap_or_default(), from_events.0);
            assert_eq!(complete.content, from_events.1);
            assert_eq!(complete.tool_calls, from_events.2);
            assert_eq!(complete.stopped, whole.1);
            let chars: Vec<&str> = text
                .char_indices()
                .map(|(i, c)| &text[i..i + c.len_utf8()])
                .collect();
            assert_eq!(stream(o.clone(), &chars), whole, "{text:?} by chars");
            for _ in 0..4 {
                let chunks = random_chunks(&mut rng, &text);
                assert_eq!(stream(o.clone(), &chunks), whole, "{chunks:?}");
            }
        }
        // The generator reaches the interesting paths.
        assert!(tool_calls > 50, "{tool_calls}");
        assert!(stops > 50, "{stops}");
    }
}
