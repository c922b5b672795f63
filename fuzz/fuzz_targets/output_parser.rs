//! The model-output parser (reasoning, tool calls in every format, harmony, stop strings): any
//! text, fed whole and fed in random pieces, must give the same reasoning, content, tool calls
//! and stop (streaming and non-streaming replies agree).
//!
//! Input: a flags byte, a seed byte for the piece sizes, then the text.
#![no_main]
use libfuzzer_sys::fuzz_target;
use serde_json::json;
use sluice_engine::output::{
    parse_complete, OutputEvent, OutputOptions, OutputParser, ParsedOutput,
};

fuzz_target!(|data: &[u8]| {
    let [flags, seed, text @ ..] = data else {
        return;
    };
    let text = String::from_utf8_lossy(text);
    let opts = OutputOptions {
        starts_in_reasoning: flags & 1 != 0,
        parse_reasoning: flags & 2 != 0,
        parse_tool_calls: flags & 4 != 0,
        harmony: flags & 8 != 0,
        stop: if flags & 16 != 0 {
            vec!["\n\n".into(), "</".into()]
        } else {
            Vec::new()
        },
        tools: (flags & 32 != 0).then(|| {
            json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                "properties": {"n": {"type": "integer"}, "s": {"type": "string"},
                "b": {"type": "boolean"}, "a": {"type": "array"}}}}}])
        }),
    };
    let whole = parse_complete(opts.clone(), &text);

    // The same text in pieces of 1 to 8 characters, sizes from a small generator.
    let mut parser = OutputParser::new(opts);
    let mut events = Vec::new();
    let mut state = u32::from(*seed) | 1;
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        let n = 1 + (state % 8) as usize;
        let piece: String = chars[i..(i + n).min(chars.len())].iter().collect();
        events.extend(parser.push(&piece));
        i += n;
    }
    events.extend(parser.finish());
    for e in &events {
        match e {
            OutputEvent::Reasoning(text) | OutputEvent::Content(text) => {
                assert!(!text.is_empty(), "an empty event: {e:?}")
            }
            OutputEvent::ToolCall(t) => {
                serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&t.arguments)
                    .unwrap_or_else(|e| {
                        panic!("arguments not a JSON object ({e}): {}", t.arguments)
                    });
            }
        }
    }
    let streamed = ParsedOutput::from_events(events, parser.stopped());
    assert_eq!(
        whole, streamed,
        "whole and streamed parses differ for {text:?}"
    );
});
