//! The output parser: reasoning, content and tool calls out of streamed text, stop strings, and
//! the same result whatever the chunking.

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
        id: None,
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
fn the_stop_string_reached_is_named() {
    let o = OutputOptions {
        stop: vec!["bc".into(), "abcd".into(), "zz".into()],
        ..OutputOptions::default()
    };
    let named = |chunks: &[&str]| {
        let mut p = OutputParser::new(o.clone());
        for c in chunks {
            p.push(c);
        }
        p.finish();
        p.stop_sequence().map(str::to_string)
    };
    assert_eq!(named(&["xabc", "d"]).as_deref(), Some("abcd"));
    assert_eq!(named(&["xabc", "e"]).as_deref(), Some("bc"));
    assert_eq!(named(&["x", "yz", "z"]).as_deref(), Some("zz"));
    assert_eq!(named(&["no stop here"]), None);
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
    let parse =
        |body: &str| parse_complete(opts(), &format!("<tool_call>{body}</tool_call>")).tool_calls;
    let one = |name: &str, args: &str| {
        vec![ParsedToolCall {
            name: name.into(),
            arguments: args.into(),
            id: None,
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
                arguments: r#"{"z":"hello world","a":42,"m":false,"q":"\"quoted\"","multi":"\nline one\nline two\n","open":"no close","last":null}"#.into(),
                id: None,
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
        "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
        "<arg_key>",
        "</arg_value>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 4}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 5}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 6}<|tool_call_end|><|tool_calls_section_end|>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁",
        "function",
        "```json\n",
        "```",
        "<|tool_calls_section_begin|>",
        "<|tool_call_section_begin|>",
        "<|tool_call_begin|>",
        "functions.f:0",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "<|tool_call",
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
    let mut kimi_calls = 0;
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
            harmony: false,
        };
        let whole = stream(o.clone(), &[&text]);
        let complete = parse_complete(o.clone(), &text);
        tool_calls += complete.tool_calls.len();
        kimi_calls += complete
            .tool_calls
            .iter()
            .filter(|c| c.id.is_some())
            .count();
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
    assert!(kimi_calls > 10, "{kimi_calls}");
    assert!(stops > 50, "{stops}");
}

#[test]
fn glm_tool_call_with_typed_args() {
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "zip": {"type": "string"},
        "units": {"type": "object"}
    }}}}]);
    let o = OutputOptions {
        tools: Some(tools),
        ..opts()
    };
    // As GLM-4.5's chat template writes a call: strings as they are, the rest as JSON.
    let text = "Checking.<tool_call>get_weather\n\
            <arg_key>city</arg_key>\n<arg_value>Paris, France</arg_value>\n\
            <arg_key>days</arg_key>\n<arg_value>3</arg_value>\n\
            <arg_key>zip</arg_key>\n<arg_value>75001</arg_value>\n\
            <arg_key>units</arg_key>\n<arg_value>{\"t\": \"C\"}</arg_value>\n\
            <arg_key>extra</arg_key>\n<arg_value>[1, true]</arg_value>\n\
            </tool_call>";
    for chunks in [vec![text], text.split_inclusive('>').collect::<Vec<_>>()] {
        let (ev, _) = stream(o.clone(), &chunks);
        assert_eq!(
            ev,
            [
                content("Checking."),
                call(
                    "get_weather",
                    r#"{"city":"Paris, France","days":3,"zip":"75001","units":{"t":"C"},"extra":[1,true]}"#
                )
            ]
        );
    }
    // No arguments, with and without a newline after the name: a call when the name is an offered
    // tool's, else text.
    let o = OutputOptions {
        tools: Some(json!([{"type": "function", "function": {"name": "get_time"}}])),
        ..opts()
    };
    for text in [
        "<tool_call>get_time\n</tool_call>",
        "<tool_call>get_time</tool_call>",
    ] {
        let out = parse_complete(o.clone(), text);
        let want = ParsedToolCall {
            name: "get_time".into(),
            arguments: "{}".into(),
            id: None,
        };
        assert_eq!(out.tool_calls, [want]);
        assert_eq!(parse_complete(opts(), text).content, text);
    }
}

#[test]
fn malformed_glm_tool_call_is_content_verbatim() {
    for body in [
        "",
        "two words\n<arg_key>a</arg_key><arg_value>1</arg_value>",
        "f\n<arg_key>a</arg_key>\n",
        "f\n<arg_key>a</arg_key><arg_value>1",
        "f\n<arg_key></arg_key><arg_value>1</arg_value>",
        "f\n<arg_key>a</arg_key><arg_value>1</arg_value>trailing",
    ] {
        let text = format!("<tool_call>{body}</tool_call>");
        assert_eq!(parse_complete(opts(), &text).content, text, "{body:?}");
    }
}

// DeepSeek and Kimi K2 sections. The texts are written as vLLM's deepseekv3 / deepseekv31 /
// kimi_k2 tool parsers document them and as the models' chat templates render past calls.

const DS_V3: &str = "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"location\": \"Paris\", \"unit\": \"c\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

const DS_V31: &str = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Paris\", \"unit\": \"c\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"été\", \"n\": [1, 2]}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

const KIMI: &str = "I'll look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Beijing\"}<|tool_call_end|><|tool_call_begin|>search:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";

fn call_with_id(name: &str, arguments: &str, id: &str) -> OutputEvent {
    OutputEvent::ToolCall(ParsedToolCall {
        name: name.into(),
        arguments: arguments.into(),
        id: Some(id.into()),
    })
}

/// The result of streaming `text` in two pieces at every char boundary, in three pieces at
/// every pair of them, and char by char, is the one-piece result (which is returned).
fn same_for_every_split(o: &OutputOptions, text: &str) -> Vec<OutputEvent> {
    let whole = stream(o.clone(), &[text]);
    let mut bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    bounds.push(text.len());
    for (n, &i) in bounds.iter().enumerate() {
        assert_eq!(
            stream(o.clone(), &[&text[..i], &text[i..]]),
            whole,
            "{text:?} split at {i}"
        );
        for &j in &bounds[n..] {
            let chunks = [&text[..i], &text[i..j], &text[j..]];
            assert_eq!(stream(o.clone(), &chunks), whole, "{chunks:?}");
        }
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let chars: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(stream(o.clone(), &chars), whole, "{text:?} by chars");
    let complete = parse_complete(o.clone(), text);
    let calls: Vec<OutputEvent> = complete
        .tool_calls
        .into_iter()
        .map(OutputEvent::ToolCall)
        .collect();
    let streamed_calls: Vec<OutputEvent> = whole
        .0
        .iter()
        .filter(|e| matches!(e, OutputEvent::ToolCall(_)))
        .cloned()
        .collect();
    assert_eq!(calls, streamed_calls);
    whole.0
}

#[test]
fn deepseek_v3_tool_calls() {
    assert_eq!(
        same_for_every_split(&opts(), DS_V3),
        [
            content("Let me check."),
            call("get_weather", r#"{"location":"Paris","unit":"c"}"#),
            call("get_time", "{}"),
        ]
    );
    // Arguments over several lines, whitespace around the fence.
    let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\n  \"b\": 1,\n  \"a\": {\"x\": null}\n}\n```\n<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    assert_eq!(
        stream(opts(), &[text]).0,
        [call("f", r#"{"b":1,"a":{"x":null}}"#)]
    );
}

#[test]
fn deepseek_v31_tool_calls() {
    assert_eq!(
        same_for_every_split(&opts(), DS_V31),
        [
            call("get_weather", r#"{"location":"Paris","unit":"c"}"#),
            call("search", r#"{"q":"été","n":[1,2]}"#),
        ]
    );
    // Text before and after the section is content; whitespace right after it is dropped, as
    // after a `<tool_call>`.
    let text = format!("Checking both.\n\n{DS_V31}\n\nDone.");
    let out = parse_complete(opts(), &text);
    assert_eq!(out.content, "Checking both.\n\nDone.");
    assert_eq!(out.tool_calls.len(), 2);
    assert!(out.tool_calls.iter().all(|c| c.id.is_none()));
}

#[test]
fn deepseek_reasoning_then_tool_calls() {
    // DeepSeek-V3.1's thinking prompt ends with "<think>"; R1's with "<think>\n".
    let o = OutputOptions {
        starts_in_reasoning: true,
        ..opts()
    };
    let text = format!("The user wants the weather.\n</think>{DS_V31}");
    let events = same_for_every_split(&o, &text);
    assert_eq!(events[0], reasoning("The user wants the weather."));
    assert_eq!(
        events[1..],
        [
            call("get_weather", r#"{"location":"Paris","unit":"c"}"#),
            call("search", r#"{"q":"été","n":[1,2]}"#),
        ]
    );
    // Markers written inside the reasoning stay reasoning: only `</think>` ends it.
    let text = format!("<think>\nMaybe {DS_V31}\n</think>\n\nOK");
    let out = parse_complete(opts(), &text);
    assert_eq!(
        out.reasoning.as_deref(),
        Some(&format!("Maybe {DS_V31}")[..])
    );
    assert_eq!((out.content.as_str(), out.tool_calls.len()), ("OK", 0));
}

#[test]
fn kimi_k2_tool_calls_keep_their_ids() {
    assert_eq!(
        same_for_every_split(&opts(), KIMI),
        [
            content("I'll look."),
            call_with_id(
                "get_weather",
                r#"{"city":"Beijing"}"#,
                "functions.get_weather:0"
            ),
            call_with_id("search", "{}", "search:1"),
        ]
    );
    // Whitespace around the parts of a call (vLLM's regex allows it), the singular spelling of
    // the section markers, and a name with a dot.
    let text = "<|tool_call_section_begin|>\n<|tool_call_begin|> functions.fs.read:12 <|tool_call_argument_begin|> {\"path\": \"/a\"} <|tool_call_end|>\n<|tool_call_section_end|>";
    assert_eq!(
        same_for_every_split(&opts(), text),
        [call_with_id(
            "fs.read",
            r#"{"path":"/a"}"#,
            "functions.fs.read:12"
        )]
    );
}

#[test]
fn kimi_section_ends_unclosed_reasoning() {
    // K2-Thinking may start calling tools without closing its thinking.
    let text = "<think>I should look it up.\n<|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{\"q\": \"x\"}<|tool_call_end|><|tool_calls_section_end|>";
    assert_eq!(
        same_for_every_split(&opts(), text),
        [
            reasoning("I should look it up."),
            call_with_id("search", r#"{"q":"x"}"#, "functions.search:0"),
        ]
    );
    // The usual order works too.
    let text = "<think>Look it up.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.search:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
    assert_eq!(
        stream(opts(), &[text]).0,
        [
            reasoning("Look it up."),
            call_with_id("search", "{}", "functions.search:0")
        ]
    );
    // Without tools the section stays in the reasoning.
    let o = OutputOptions {
        parse_tool_calls: false,
        ..opts()
    };
    let text = "<think>a<|tool_calls_section_begin|>b</think>c";
    assert_eq!(
        stream(o, &[text]).0,
        [reasoning("a<|tool_calls_section_begin|>b"), content("c")]
    );
}

#[test]
fn partial_section_markers_are_held_back() {
    let mut p = OutputParser::new(opts());
    assert_eq!(p.push("Hi <｜tool▁"), [content("Hi ")]);
    assert_eq!(p.push("calls"), []);
    assert_eq!(p.push("!"), [content("<｜tool▁calls!")]);
    assert_eq!(p.push(" <|tool_call"), [content(" ")]);
    assert_eq!(p.push("_sect"), []);
    assert_eq!(p.finish(), [content("<|tool_call_sect")]);
    // In reasoning, a partial Kimi section marker waits as `</think>`'s would.
    let mut p = OutputParser::new(opts());
    assert_eq!(p.push("<think>a <|tool_calls"), [reasoning("a ")]);
    assert_eq!(p.push("_x"), [reasoning("<|tool_calls_x")]);
}

#[test]
fn section_events_only_when_closed() {
    let mut p = OutputParser::new(opts());
    let (head, tail) = DS_V31.split_at(DS_V31.len() - "<｜tool▁calls▁end｜>".len());
    assert_eq!(p.push(head), []);
    let got = p.push(tail);
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(p.finish(), []);
}

#[test]
fn unclosed_section_at_finish() {
    // Complete calls without the section's end marker are calls (vLLM and llama.cpp agree).
    let text =
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>\n";
    assert_eq!(
        same_for_every_split(&opts(), text),
        [call("f", r#"{"a":1}"#)]
    );
    let text = "x<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}<|tool_call_end|>";
    assert_eq!(
        same_for_every_split(&opts(), text),
        [content("x"), call_with_id("f", "{}", "functions.f:0")]
    );
    // A call cut off is not: the whole section is returned as text.
    for text in [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{\"b\"",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}",
        "<｜tool▁calls▁begin｜>",
    ] {
        assert_eq!(same_for_every_split(&opts(), text), [content(text)]);
    }
}

#[test]
fn malformed_sections_are_content_verbatim() {
    let ds = |calls: &str| format!("<｜tool▁calls▁begin｜>{calls}<｜tool▁calls▁end｜>");
    let ds_call = |call: &str| format!("<｜tool▁call▁begin｜>{call}<｜tool▁call▁end｜>");
    let kimi =
        |calls: &str| format!("<|tool_calls_section_begin|>{calls}<|tool_calls_section_end|>");
    let kimi_call = |call: &str| format!("<|tool_call_begin|>{call}<|tool_call_end|>");
    let good_ds = ds_call("f<｜tool▁sep｜>{}");
    let good_kimi = kimi_call("functions.f:0<|tool_call_argument_begin|>{}");
    let sections = [
        ds(""),
        ds(&ds_call("f<｜tool▁sep｜>{\"a\": 1")),
        ds(&ds_call("f<｜tool▁sep｜>[1]")),
        ds(&ds_call("f{\"a\": 1}")),
        ds(&ds_call("<｜tool▁sep｜>{}")),
        ds(&ds_call("get weather<｜tool▁sep｜>{}")),
        ds(&ds_call("tool<｜tool▁sep｜>f\n```json\n{}\n```")),
        ds(&ds_call("function<｜tool▁sep｜>f\n{}")),
        ds(&ds_call("function<｜tool▁sep｜>f\n```json\n{}")),
        ds(&ds_call("function<｜tool▁sep｜>f\n```json\n\"x\"\n```")),
        ds(&format!("{good_ds}junk{good_ds}")),
        ds(&format!("{good_ds}{}", ds_call("g<｜tool▁sep｜>nope"))),
        ds(&format!(
            "{good_ds}<｜tool▁call▁begin｜>g<｜tool▁sep｜>{{}}"
        )),
        ds("f<｜tool▁sep｜>{}"),
        kimi(""),
        kimi(&kimi_call("functions.f<|tool_call_argument_begin|>{}")),
        kimi(&kimi_call("functions.f:x<|tool_call_argument_begin|>{}")),
        kimi(&kimi_call("functions.:0<|tool_call_argument_begin|>{}")),
        kimi(&kimi_call("functions.f:0 {}")),
        kimi(&kimi_call(
            "functions.f:0<|tool_call_argument_begin|>{\"a\"}",
        )),
        kimi(&kimi_call("functions.f:0<|tool_call_argument_begin|>null")),
        kimi(&format!(
            "{good_kimi}{}",
            kimi_call("g:1<|tool_call_argument_begin|>")
        )),
        kimi(&format!("{good_kimi} text")),
    ];
    for section in sections {
        let text = format!("A {section} B");
        assert_eq!(stream(opts(), &[&text]).0, [content(&text)], "{text:?}");
        assert!(parse_complete(opts(), &text).tool_calls.is_empty());
    }
    // A malformed section is text, and a good one after it is still read.
    let bad = ds(&ds_call("f<｜tool▁sep｜>{"));
    let text = format!("{bad}{}", ds(&good_ds));
    assert_eq!(
        same_for_every_split(&opts(), &text),
        [content(&bad), call("f", "{}")]
    );
}

#[test]
fn parse_tool_calls_false_keeps_sections_as_content() {
    let o = OutputOptions {
        parse_tool_calls: false,
        ..opts()
    };
    for text in [DS_V3, DS_V31, KIMI] {
        assert_eq!(stream(o.clone(), &[text]).0, [content(text)]);
    }
}

// Harmony (gpt-oss): the model's text after the prompt's `<|start|>assistant`, written as
// openai/harmony's docs/format.md shows it.

fn harmony() -> OutputOptions {
    OutputOptions {
        harmony: true,
        ..opts()
    }
}

const H_REASONED: &str = "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>";

const H_CALL: &str = "<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}<|call|>";

/// `text`, and `text` without its trailing `<|return|>` / `<|call|>` (which end generation, so
/// the engine does not pass them on), read alike for every split; the events.
fn harmony_both_ends(o: &OutputOptions, text: &str) -> Vec<OutputEvent> {
    let events = same_for_every_split(o, text);
    for end in ["<|return|>", "<|call|>"] {
        if let Some(cut) = text.strip_suffix(end) {
            assert_eq!(same_for_every_split(o, cut), events, "{cut:?}");
        }
    }
    events
}

#[test]
fn harmony_reasoning_then_final() {
    assert_eq!(
        harmony_both_ends(&harmony(), H_REASONED),
        [
            reasoning("User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer."),
            content("2 + 2 = 4."),
        ]
    );
    // The markers never reach the client; text around them is kept exactly (no trimming).
    let out = parse_complete(
        harmony(),
        "<|channel|>analysis<|message|>\n a \n<|end|><|start|>assistant<|channel|>final<|message|> b\n",
    );
    assert_eq!(out.reasoning.as_deref(), Some("\n a \n"));
    assert_eq!(out.content, " b\n");
    assert!(out.tool_calls.is_empty() && !out.stopped);
}

#[test]
fn harmony_final_without_analysis() {
    let text = "<|channel|>final<|message|>Hello! How can I help?<|return|>";
    assert_eq!(
        harmony_both_ends(&harmony(), text),
        [content("Hello! How can I help?")]
    );
    // A content type on the final channel (structured output) changes nothing.
    let text = "<|channel|>final <|constrain|>json<|message|>{\"a\": 1}";
    assert_eq!(
        same_for_every_split(&harmony(), text),
        [content("{\"a\": 1}")]
    );
}

#[test]
fn harmony_tool_call_with_the_recipient_in_the_channel() {
    assert_eq!(
        harmony_both_ends(&harmony(), H_CALL),
        [
            reasoning("Need to use function get_weather."),
            call("get_weather", r#"{"location":"San Francisco"}"#),
        ]
    );
    // With and without `<|constrain|>`, a space before it or not, or no content type at all.
    for head in [
        "<|channel|>commentary to=functions.get_weather <|constrain|>json",
        "<|channel|>commentary to=functions.get_weather<|constrain|>json",
        "<|channel|>commentary to=functions.get_weather json",
        "<|channel|>commentary to=functions.get_weather",
    ] {
        let text =
            format!("{head}<|message|>{{\"location\": \"Paris\", \"unit\": \"celsius\"}}<|call|>");
        assert_eq!(
            harmony_both_ends(&harmony(), &text),
            [call(
                "get_weather",
                r#"{"location":"Paris","unit":"celsius"}"#
            )],
            "{text:?}"
        );
    }
}

#[test]
fn harmony_tool_call_with_the_recipient_in_the_role() {
    // As gpt-oss's chat template renders past calls, after an analysis message.
    let text = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"location\": \"Paris\",\n \"unit\": \"celsius\"}<|call|>";
    assert_eq!(
        harmony_both_ends(&harmony(), text),
        [
            reasoning("Need the weather."),
            call("get_weather", r#"{"location":"Paris","unit":"celsius"}"#),
        ]
    );
    // The output's first message: the prompt wrote `<|start|>assistant`, the model the rest.
    for text in [
        " to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{\"location\": \"Paris\"}",
        " to=functions.get_weather<|channel|>commentary<|message|>{\"location\": \"Paris\"}<|call|>",
        // Some calls are written on the analysis channel; vLLM reads them as calls too.
        "<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{\"location\": \"Paris\"}",
    ] {
        assert_eq!(
            harmony_both_ends(&harmony(), text),
            [call("get_weather", r#"{"location":"Paris"}"#)],
            "{text:?}"
        );
    }
}

#[test]
fn harmony_preamble_is_content() {
    // docs/format.md's preamble: commentary without a recipient is meant for the user.
    let text = "<|channel|>analysis<|message|>{long chain of thought}<|end|><|start|>assistant<|channel|>commentary<|message|>**Action plan**:\n1. Generate an HTML file\n---\nWill start executing the plan step by step<|end|><|start|>assistant<|channel|>commentary to=functions.generate_file<|constrain|>json<|message|>{\"template\": \"basic_html\", \"path\": \"index.html\"}<|call|>";
    assert_eq!(
        harmony_both_ends(&harmony(), text),
        [
            reasoning("{long chain of thought}"),
            content("**Action plan**:\n1. Generate an HTML file\n---\nWill start executing the plan step by step"),
            call("generate_file", r#"{"template":"basic_html","path":"index.html"}"#),
        ]
    );
}

#[test]
fn harmony_messages_of_one_kind_are_joined_with_a_newline() {
    // Several calls (with ignore_eos the text goes on past `<|call|>`), reasoning between them.
    let text = "<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>commentary to=functions.f json<|message|>{\"a\": 1}<|call|><|start|>assistant<|channel|>analysis<|message|><|end|><|start|>assistant<|channel|>analysis<|message|>B<|end|><|start|>assistant to=functions.g<|channel|>commentary json<|message|>{}<|call|><|start|>assistant<|channel|>commentary<|message|>C<|end|><|start|>assistant<|channel|>final<|message|>D<|return|>";
    assert_eq!(
        same_for_every_split(&harmony(), text),
        [
            reasoning("A"),
            call("f", r#"{"a":1}"#),
            reasoning("\nB"),
            call("g", "{}"),
            content("C\nD"),
        ]
    );
}

#[test]
fn harmony_malformed_calls_are_content_verbatim() {
    for (head, args) in [
        (
            "<|channel|>commentary to=functions.f <|constrain|>json",
            "{\"a\": 1",
        ),
        ("<|channel|>commentary to=functions.f json", "[1, 2]"),
        ("<|channel|>commentary to=functions.f", "not json"),
        ("<|channel|>commentary to=functions.f", ""),
        ("<|channel|>commentary to=functions.", "{}"),
        ("<|channel|>commentary to=functions.{f}", "{}"),
    ] {
        let message = format!("{head}<|message|>{args}");
        for end in ["<|call|>", "<|end|>", ""] {
            let text = format!("{message}{end}");
            assert_eq!(
                same_for_every_split(&harmony(), &text),
                [content(&message)],
                "{text:?}"
            );
        }
        // After an analysis message the call's whole text is returned, its `<|start|>` too.
        let text =
            format!("<|channel|>analysis<|message|>x<|end|><|start|>assistant {message}<|call|>");
        assert_eq!(
            same_for_every_split(&harmony(), &text),
            [
                reasoning("x"),
                content(&format!("<|start|>assistant {message}"))
            ]
        );
    }
    // A good call after a bad one is still read.
    let text = "<|channel|>commentary to=functions.f<|message|>{<|call|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{}";
    assert_eq!(
        same_for_every_split(&harmony(), text),
        [
            content("<|channel|>commentary to=functions.f<|message|>{"),
            call("f", "{}")
        ]
    );
}

#[test]
fn harmony_builtin_tools_follow_their_channel() {
    // Built-in tools are called on the analysis channel: their messages are reasoning, as
    // vLLM's harmony parsing has them; on another channel they are content.
    let text = "<|channel|>analysis<|message|>Compute it.<|end|><|start|>assistant<|channel|>analysis to=python code<|message|>print(6 * 7)<|call|>";
    assert_eq!(
        harmony_both_ends(&harmony(), text),
        [reasoning("Compute it.\nprint(6 * 7)")]
    );
    let text = "<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|call|>";
    assert_eq!(
        harmony_both_ends(&harmony(), text),
        [reasoning("{\"query\": \"x\"}")]
    );
    let text = "<|channel|>commentary to=browser.open json<|message|>{\"id\": 3}<|call|>";
    assert_eq!(
        harmony_both_ends(&harmony(), text),
        [content("{\"id\": 3}")]
    );
}

#[test]
fn harmony_without_tool_or_reasoning_parsing() {
    // No tools offered: a call message is content verbatim, as the other formats' blocks are.
    let o = OutputOptions {
        parse_tool_calls: false,
        ..harmony()
    };
    let events = harmony_both_ends(&o, H_CALL);
    assert_eq!(
        events,
        [
            reasoning("Need to use function get_weather."),
            content("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"location\":\"San Francisco\"}"),
        ]
    );
    // Reasoning not split out: the analysis text is content.
    let o = OutputOptions {
        parse_reasoning: false,
        ..harmony()
    };
    assert_eq!(
        harmony_both_ends(&o, H_REASONED),
        [content(
            "User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.\n2 + 2 = 4."
        )]
    );
    // `starts_in_reasoning` is for `<think>` prompts: harmony ignores it.
    let o = OutputOptions {
        starts_in_reasoning: true,
        ..harmony()
    };
    assert_eq!(
        parse_complete(o, "<|channel|>final<|message|>x").content,
        "x"
    );
}

#[test]
fn harmony_text_that_is_not_harmony_is_content() {
    for text in [
        "Hello there",
        " to be or not to be",
        "<|chan",
        "<think>x</think>y",
        // A header is one short line.
        "<|channel|>final\nHi<|message|>x",
    ] {
        assert_eq!(
            same_for_every_split(&harmony(), text),
            [content(text)],
            "{text:?}"
        );
    }
    // A message that ends inside its header is its text; the end marker is not (it never is).
    assert_eq!(
        same_for_every_split(&harmony(), "<|channel|>final<|end|>x"),
        [content("<|channel|>finalx")]
    );
    let long = format!("<|channel|>final{}<|message|>x", " ".repeat(300));
    assert_eq!(parse_complete(harmony(), &long).content, long);
    assert_eq!(
        stream(harmony(), &[&long[..200], &long[200..]]).0,
        [content(&long)]
    );
    // Text after a message that does not open another, and a header cut off at the end.
    assert_eq!(
        same_for_every_split(
            &harmony(),
            "<|channel|>final<|message|>a<|end|>b<|start|>assistant<|channel|>fin"
        ),
        [content("ab<|start|>assistant<|channel|>fin")]
    );
}

#[test]
fn harmony_markers_are_held_back_while_streaming() {
    let mut p = OutputParser::new(harmony());
    assert_eq!(p.push("<|channel|>analysis"), []);
    assert_eq!(p.push("<|message|>Think"), [reasoning("Think")]);
    assert_eq!(p.push("ing<|e"), [reasoning("ing")]);
    assert_eq!(p.push("nd|><|start|>assistant<|chan"), []);
    assert_eq!(p.push("nel|>final<|message|>4"), [content("4")]);
    assert_eq!(p.push("<|ret"), []);
    assert_eq!(p.push("urn|>"), []);
    assert_eq!(p.finish(), []);
    // A call is returned whole, when its message ends or the output does.
    let mut p = OutputParser::new(harmony());
    assert_eq!(
        p.push("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\""),
        []
    );
    assert_eq!(p.push(": 1}"), []);
    assert_eq!(p.finish(), [call("f", r#"{"a":1}"#)]);
}

#[test]
fn harmony_stop_strings() {
    let o = OutputOptions {
        stop: vec!["STOP".into()],
        ..harmony()
    };
    let out = parse_complete(o.clone(), "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>final<|message|>b STOP c");
    assert_eq!(
        (out.reasoning.as_deref(), out.content.as_str(), out.stopped),
        (Some("a"), "b ", true)
    );
    // A stop string inside a call leaves it unfinished: content, verbatim.
    let out = parse_complete(
        o,
        "<|channel|>commentary to=functions.f<|message|>{\"x\": \"STOP\"}",
    );
    assert_eq!(
        out.content,
        "<|channel|>commentary to=functions.f<|message|>{\"x\": \""
    );
    assert!(out.tool_calls.is_empty() && out.stopped);
}

#[test]
fn harmony_streaming_matches_parse_complete_for_any_chunking() {
    const PIECES: &[&str] = &[
        "<|start|>",
        "assistant",
        "<|channel|>",
        "analysis",
        "commentary",
        "final",
        "<|message|>",
        "<|end|>",
        "<|call|>",
        "<|return|>",
        "<|constrain|>",
        "json",
        " to=functions.f",
        " to=python",
        " to=",
        " ",
        "<|",
        "<|chan",
        "<|end",
        "{\"a\": 1}",
        "{",
        "}",
        "x",
        "é",
        "\n",
        "STOP",
        "ST",
        "<|channel|>analysis<|message|>",
        "<|end|><|start|>assistant<|channel|>final<|message|>",
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\": 2}<|call|>",
        "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}",
    ];
    let stop_sets: &[&[&str]] = &[&[], &["STOP"], &["x\n", "<|end"]];
    let mut rng = Rng(0x4a11);
    let (mut calls, mut reasoned, mut stops) = (0, 0, 0);
    for case in 0..3000 {
        let len = rng.below(12);
        let text: String = (0..len).map(|_| PIECES[rng.below(PIECES.len())]).collect();
        let o = OutputOptions {
            parse_reasoning: rng.below(5) != 0,
            parse_tool_calls: rng.below(5) != 0,
            stop: stop_sets[case % stop_sets.len()]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ..harmony()
        };
        let whole = stream(o.clone(), &[&text]);
        let complete = parse_complete(o.clone(), &text);
        calls += complete.tool_calls.len();
        reasoned += complete.reasoning.is_some() as usize;
        stops += complete.stopped as usize;
        let (mut r, mut c, mut t) = (String::new(), String::new(), Vec::new());
        for e in &whole.0 {
            match e {
                OutputEvent::Reasoning(x) => r.push_str(x),
                OutputEvent::Content(x) => c.push_str(x),
                OutputEvent::ToolCall(x) => t.push(x.clone()),
            }
        }
        assert_eq!(complete.reasoning.unwrap_or_default(), r);
        assert_eq!((complete.content, complete.tool_calls), (c, t));
        // No marker reaches the client from a message that reads.
        let chars: Vec<&str> = text
            .char_indices()
            .map(|(i, ch)| &text[i..i + ch.len_utf8()])
            .collect();
        assert_eq!(stream(o.clone(), &chars), whole, "{text:?} by chars");
        for _ in 0..4 {
            let chunks = random_chunks(&mut rng, &text);
            assert_eq!(stream(o.clone(), &chunks), whole, "{chunks:?}");
        }
    }
    assert!(calls > 50, "{calls}");
    assert!(reasoned > 50, "{reasoned}");
    assert!(stops > 50, "{stops}");
}
