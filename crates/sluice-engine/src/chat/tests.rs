//! Chat template rendering against transformers' output: whitespace control, Python-compatible
//! filters and printing, `tojson`, `strftime`, tool calls and error messages.

use super::pycompat::{civil_from_days, days_from_civil, py_float, strftime};
use super::*;
use serde_json::json;

const QWEN3: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/qwen3_chat_template.jinja"
));
const QWEN35: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/qwen3_5_chat_template.jinja"
));
const DEEPSEEK_V31: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/deepseek_v3_1_chat_template.jinja"
));
const KIMI_K2: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/kimi_k2_instruct_chat_template.jinja"
));
const KIMI_K2_THINKING: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/data/kimi_k2_thinking_chat_template.jinja"
));

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage::new(role, content)
}

fn no_extra() -> serde_json::Map<String, serde_json::Value> {
    serde_json::Map::new()
}

fn qwen3() -> ChatTemplate {
    ChatTemplate::new(QWEN3, None, Some("<|im_end|>".into())).unwrap()
}

fn weather_tool() -> serde_json::Value {
    // Keys deliberately not in alphabetical order: the rendering must keep this order.
    json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city, e.g. Zürich",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                },
                "required": ["location"]
            }
        }
    }])
}

const WEATHER_TOOL_JSON: &str = r#"{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city, e.g. Zürich", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}"#;

#[test]
fn qwen3_system_user_generation_prompt() {
    let t = qwen3();
    let out = t
        .render(
            &[msg("system", "You are helpful."), msg("user", "Hi there!")],
            None,
            true,
            &no_extra(),
        )
        .unwrap();
    assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n"
        );
    // Without a generation prompt the text ends after the last message.
    let out = t
        .render(&[msg("user", "Hi")], None, false, &no_extra())
        .unwrap();
    assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n");
}

#[test]
fn qwen3_enable_thinking_false_appends_empty_think() {
    let t = qwen3();
    let mut extra = no_extra();
    extra.insert("enable_thinking".into(), json!(false));
    let out = t
        .render(&[msg("user", "2+2?")], None, true, &extra)
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    extra.insert("enable_thinking".into(), json!(true));
    let out = t
        .render(&[msg("user", "2+2?")], None, true, &extra)
        .unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn qwen3_multi_turn_strips_earlier_reasoning() {
    let t = qwen3();
    let msgs = [
        msg("user", "What is 2+2?"),
        msg(
            "assistant",
            "<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4.",
        ),
        msg("user", "And 3+3?"),
    ];
    let out = t.render(&msgs, None, true, &no_extra()).unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n2+2 = 4.<|im_end|>\n\
             <|im_start|>user\nAnd 3+3?<|im_end|>\n\
             <|im_start|>assistant\n"
    );
    // The same with the reasoning given separately.
    let mut with_field = msgs.clone();
    with_field[1] = ChatMessage {
        reasoning_content: Some("Simple arithmetic.".into()),
        ..msg("assistant", "2+2 = 4.")
    };
    assert_eq!(t.render(&with_field, None, true, &no_extra()).unwrap(), out);
    // A final assistant turn (after the last user query) keeps its reasoning.
    let out = t.render(&msgs[..2], None, false, &no_extra()).unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n\
             <|im_start|>assistant\n<think>\nSimple arithmetic.\n</think>\n\n2+2 = 4.<|im_end|>\n"
    );
}

#[test]
fn qwen3_tools_block() {
    let t = qwen3();
    let tools = weather_tool();
    let out = t
        .render(
            &[msg("system", "Be brief."), msg("user", "Weather in Paris?")],
            Some(&tools),
            true,
            &no_extra(),
        )
        .unwrap();
    let want = format!(
            "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
             You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{WEATHER_TOOL_JSON}\n</tools>\n\n\
             For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
             <tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
        );
    assert_eq!(out, want);
}

fn tool_round_trip(arguments: serde_json::Value) -> Vec<ChatMessage> {
    vec![
        msg("user", "Weather in Paris?"),
        ChatMessage {
            role: "assistant".into(),
            content: None,
            tool_calls: Some(json!([{
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}
            }])),
            tool_call_id: None,
            name: None,
            reasoning_content: Some("I should call the tool.".into()),
        },
        ChatMessage {
            tool_call_id: Some("call_1".into()),
            ..msg("tool", "{\"temp_c\": 18}")
        },
    ]
}

#[test]
fn qwen3_tool_call_round_trip() {
    let t = qwen3();
    let tools = weather_tool();
    let msgs = tool_round_trip(json!({"location": "Paris", "unit": "celsius"}));
    let out = t.render(&msgs, Some(&tools), true, &no_extra()).unwrap();
    let want_tail = "<|im_start|>user\nWeather in Paris?<|im_end|>\n\
             <|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n\
             <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n";
    assert!(out.starts_with("<|im_start|>system\n# Tools\n\n"), "{out}");
    assert!(out.ends_with(want_tail), "{out}");
    // Arguments as an OpenAI-style JSON string (compact, keys unordered) render the same.
    let msgs_str = tool_round_trip(json!("{\"location\":\"Paris\",\"unit\":\"celsius\"}"));
    assert_eq!(
        t.render(&msgs_str, Some(&tools), true, &no_extra())
            .unwrap(),
        out
    );
    // A string that is not a JSON object passes through verbatim (the template's string
    // branch).
    let msgs_raw = tool_round_trip(json!("not json"));
    let out_raw = t
        .render(&msgs_raw, Some(&tools), true, &no_extra())
        .unwrap();
    assert!(out_raw.contains("\"arguments\": not json}"), "{out_raw}");
}

#[test]
fn qwen35_renders() {
    let t = ChatTemplate::new(QWEN35, None, Some("<|im_end|>".into())).unwrap();
    let out = t
        .render(
            &[msg("system", "  Be brief. "), msg("user", "Hi")],
            None,
            true,
            &no_extra(),
        )
        .unwrap();
    assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
        );
    let mut extra = no_extra();
    extra.insert("enable_thinking".into(), json!(false));
    let out = t.render(&[msg("user", "Hi")], None, true, &extra).unwrap();
    assert_eq!(
        out,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );

    // Tool call with string arguments: Qwen3.5 iterates `arguments|items`, so they must
    // arrive as an object. Non-string values print as JSON, booleans as Python's True.
    let tools = weather_tool();
    let mut msgs = tool_round_trip(json!(
            "{\"location\": \"Paris\", \"days\": 2, \"opts\": {\"unit\": \"celsius\"}, \"alerts\": true}"
        ));
    msgs.push(msg("assistant", "It is 18 °C."));
    let out = t.render(&msgs, Some(&tools), false, &no_extra()).unwrap();
    let want = format!(
            "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n{WEATHER_TOOL_JSON}\n</tools>\
             \n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n\
             <function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n\
             <parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n\
             </parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n\
             - Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n\
             - Required parameters MUST be specified\n\
             - You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n\
             - If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n\
             </IMPORTANT><|im_end|>\n\
             <|im_start|>user\nWeather in Paris?<|im_end|>\n\
             <|im_start|>assistant\n<think>\nI should call the tool.\n</think>\n\n\
             <tool_call>\n<function=get_weather>\n<parameter=location>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n\
             <parameter=opts>\n{{\"unit\": \"celsius\"}}\n</parameter>\n<parameter=alerts>\nTrue\n</parameter>\n</function>\n</tool_call><|im_end|>\n\
             <|im_start|>user\n<tool_response>\n{{\"temp_c\": 18}}\n</tool_response><|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\nIt is 18 °C.<|im_end|>\n"
        );
    assert_eq!(out, want);

    // The template's raise_exception surfaces as ChatError::Raised.
    let err = t
        .render(&[msg("system", "x")], None, true, &no_extra())
        .unwrap_err();
    assert_eq!(
        err,
        ChatError::Raised("No user query found in messages.".into())
    );
    assert_eq!(
        err.to_string(),
        "chat template rejected the conversation: No user query found in messages."
    );
}

#[test]
fn fallback_chatml() {
    let t = ChatTemplate::new(FALLBACK_CHATML, None, None).unwrap();
    let msgs = [
        msg("system", "S"),
        msg("user", "U"),
        ChatMessage {
            content: None,
            ..msg("assistant", "")
        },
    ];
    let out = t.render(&msgs, None, true, &no_extra()).unwrap();
    assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
        );
}

#[test]
fn syntax_error_names_the_line() {
    let src = "{%- for m in messages %}\n{{ m.content }}\n{%- if %}\n{%- endfor %}";
    let err = ChatTemplate::new(src, None, None).unwrap_err();
    match &err {
        ChatError::Syntax { line, detail } => {
            assert_eq!(*line, 3, "{err}");
            assert!(detail.contains("{%- if %}"), "{err}");
        }
        other => panic!("{other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.starts_with("chat template syntax error at line 3:"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "{msg}");
}

#[test]
fn runtime_error_is_reported() {
    let t = ChatTemplate::new("line one\n{{ messages[0].content + 1 }}", None, None).unwrap();
    let err = t
        .render(&[msg("user", "x")], None, false, &no_extra())
        .unwrap_err();
    assert!(
        matches!(err, ChatError::Render { line: Some(2), .. }),
        "{err:?}"
    );
    let err = t
        .render(
            &[],
            None,
            false,
            &serde_json::Map::from_iter([("messages".into(), json!(1))]),
        )
        .unwrap_err();
    assert!(matches!(err, ChatError::Argument(_)), "{err:?}");
}

#[test]
fn hf_environment_features() {
    let render = |src: &str, extra: serde_json::Value| {
        let t = ChatTemplate::new(src, Some("<s>".into()), Some("</s>".into())).unwrap();
        let extra = extra.as_object().cloned().unwrap_or_default();
        t.render(
            &[
                msg("user", "  Hello, World  "),
                msg("assistant", "A"),
                msg("user", "B"),
            ],
            None,
            false,
            &extra,
        )
        .unwrap()
    };
    // bos/eos tokens and extra kwargs at top level.
    assert_eq!(
        render(
            "{{ bos_token }}|{{ eos_token }}|{{ foo }}",
            json!({"foo": 3})
        ),
        "<s>|</s>|3"
    );
    // trim_blocks + lstrip_blocks: block lines leave no whitespace behind.
    assert_eq!(
            render("{% for m in messages %}\n    {% if loop.last %}\n{{ m.role }}\n    {% endif %}\n{% endfor %}", json!({})),
            "user\n"
        );
    // Reverse slicing, namespace, loop controls.
    assert_eq!(
            render(
                "{% set ns = namespace(n=0) %}{% for m in messages[::-1] %}{% if loop.index > 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{{ m.content }}{% endfor %}{{ ns.n }}",
                json!({})
            ),
            "BA2"
        );
    // Python string methods.
    assert_eq!(
            render(
                "{% set c = messages[0].content %}{{ c.strip() }}|{{ c.lstrip() }}|{{ c.rstrip() }}|{{ c.strip().startswith('Hello') }}|{{ c.strip().endswith('x') }}|{{ c.split(',')[1] }}|{{ c.replace('World', 'there') }}",
                json!({})
            ),
            "Hello, World|Hello, World  |  Hello, World|True|False| World  |  Hello, there  "
        );
    // is string / is mapping, length, items, Python-style printing.
    assert_eq!(
            render(
                "{{ d is mapping }} {{ s is string }} {{ d|length }} {% for k, v in d|items %}{{ k }}={{ v }};{% endfor %} {{ none_v }} {{ f }} {{ big }} {{ d.b|string }}",
                json!({"d": {"z": 1, "b": true}, "s": "x", "none_v": null, "f": 0.5, "big": 1e20})
            ),
            "True True 2 z=1;b=True; None 0.5 1e+20 True"
        );
    // tojson: Python separators, key order, no ASCII escaping, indent, sort_keys.
    assert_eq!(
        render(
            "{{ d|tojson }}",
            json!({"d": {"z": [1, 2.0, "é<>&'"], "a": null}})
        ),
        r#"{"z": [1, 2.0, "é<>&'"], "a": null}"#
    );
    assert_eq!(
        render(
            "{{ d|tojson(indent=2) }}",
            json!({"d": {"z": [1, {}], "a": "\n"}})
        ),
        "{\n  \"z\": [\n    1,\n    {}\n  ],\n  \"a\": \"\\n\"\n}"
    );
    assert_eq!(
        render(
            "{{ d|tojson(sort_keys=true, ensure_ascii=true) }}",
            json!({"d": {"z": "é😀", "a": 1}})
        ),
        r#"{"a": 1, "z": "\u00e9\ud83d\ude00"}"#
    );
    assert_eq!(
        render(
            "{{ d|tojson(separators=[',', ':']) }}",
            json!({"d": {"a": [1, 2]}})
        ),
        r#"{"a":[1,2]}"#
    );
    // raise_exception, strftime_now.
    let t = ChatTemplate::new(
        "{{ raise_exception('bad role: ' + messages[0].role) }}",
        None,
        None,
    )
    .unwrap();
    assert_eq!(
        t.render(&[msg("tool", "")], None, false, &no_extra()),
        Err(ChatError::Raised("bad role: tool".into()))
    );
    let year = render("{{ strftime_now('%Y') }}", json!({}));
    assert!(year.len() == 4 && year.starts_with("20"), "{year}");
    // {% generation %} blocks (transformers' assistant masks) render their body.
    assert_eq!(
            render("{%- for m in messages %}\n{%- generation %}{{ m.content }}{%- endgeneration %}\n{%- endfor %}", json!({})),
            "  Hello, World  AB"
        );
}

/// Found by fuzzing: `{%}` (the opening and closing marks overlap) in a template that has
/// `{% generation %}` blocks made the rewrite slice backwards and panic.
#[test]
fn overlapping_tag_marks_are_a_syntax_error_not_a_panic() {
    for source in [
        "{% generation %}x{% endgeneration %}{%}",
        "{%}{% generation %}",
    ] {
        let r = ChatTemplate::new(source, None, None);
        assert!(
            matches!(r, Err(ChatError::Syntax { .. })),
            "{source}: {r:?}"
        );
    }
}

#[test]
fn strftime_matches_c() {
    // 2024-02-29 13:05:09 UTC, a Thursday.
    let t = 1_709_211_909;
    assert_eq!(strftime("%Y-%m-%d %H:%M:%S", t), "2024-02-29 13:05:09");
    assert_eq!(strftime("%d %b %Y", t), "29 Feb 2024");
    assert_eq!(
        strftime("%A %B %-d, %I %p %j %%", t),
        "Thursday February 29, 01 PM 060 %"
    );
    assert_eq!(strftime("%a %F %T", 0), "Thu 1970-01-01 00:00:00");
    assert_eq!(strftime("%j %D", 1_735_603_200), "366 12/31/24");
    assert_eq!(strftime("%j", 1_735_689_600), "001");
    for days in [-800_000i64, -1, 0, 59, 60, 11_016, 2_932_896] {
        let (y, m, d) = civil_from_days(days);
        assert_eq!(days_from_civil(y, m, d), days);
    }
}

#[test]
fn py_float_repr() {
    for (f, s) in [
        (1.0, "1.0"),
        (0.5, "0.5"),
        (-0.0, "-0.0"),
        (1e16, "1e+16"),
        (1.5e-7, "1.5e-07"),
        (0.0001, "0.0001"),
        (123456789.125, "123456789.125"),
        (1e15, "1000000000000000.0"),
        (0.1 + 0.2, "0.30000000000000004"),
    ] {
        assert_eq!(py_float(f), s);
    }
}

#[test]
fn shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
    assert_send_sync::<crate::tokenizer::Tokenizer>();
    assert_send_sync::<crate::sampler::Sampler>();
}

#[test]
fn message_serialization() {
    let m = ChatMessage {
        content: None,
        ..msg("assistant", "")
    };
    assert_eq!(
        serde_json::to_string(&m).unwrap(),
        r#"{"role":"assistant","content":null}"#
    );
    let back: ChatMessage = serde_json::from_str(r#"{"role":"user","content":"hi"}"#).unwrap();
    assert_eq!(back, msg("user", "hi"));
}

/// A conversation with a past tool call (or two) and the tool's replies: system, user, the
/// assistant's call turn, a tool reply per call.
fn past_calls(
    first_id: &str,
    arguments: serde_json::Value,
    second: Option<serde_json::Value>,
    content: Option<&str>,
    reasoning: Option<&str>,
) -> Vec<ChatMessage> {
    let mut calls = vec![json!({
        "id": first_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments}
    })];
    calls.extend(second.clone());
    let mut msgs = vec![
        msg("system", "You are helpful."),
        msg("user", "Weather in Paris?"),
        ChatMessage {
            content: content.map(str::to_string),
            tool_calls: Some(serde_json::Value::Array(calls)),
            reasoning_content: reasoning.map(str::to_string),
            ..msg("assistant", "")
        },
        ChatMessage {
            tool_call_id: Some(first_id.into()),
            ..msg("tool", "{\"temp_c\": 18}")
        },
    ];
    if let Some(call) = second {
        msgs.push(ChatMessage {
            tool_call_id: call["id"].as_str().map(str::to_string),
            ..msg("tool", "12:00")
        });
    }
    msgs
}

fn get_time_call(id: &str) -> serde_json::Value {
    json!({"id": id, "type": "function", "function": {"name": "get_time", "arguments": "{}"}})
}

// The expected prompts below were rendered from the same template files and conversations by
// Python's jinja2 3.1.6 through tests/data/render_reference.py.

#[test]
fn deepseek_v31_renders_past_tool_calls_with_string_arguments() {
    let t = ChatTemplate::new(
        DEEPSEEK_V31,
        Some("<｜begin▁of▁sentence｜>".into()),
        Some("<｜end▁of▁sentence｜>".into()),
    )
    .unwrap();
    // The template concatenates `'...' + tool['function']['arguments']`: the probe found that it
    // needs the arguments as JSON text.
    assert!(t.string_arguments);
    let tools = weather_tool();
    let msgs = past_calls(
        "call_1",
        json!("{\"location\":\"Paris\",\"unit\":\"celsius\"}"),
        None,
        None,
        None,
    );
    let out = t.render(&msgs, Some(&tools), true, &no_extra()).unwrap();
    assert_eq!(
        out,
        "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Weather in Paris?<｜Assistant｜></think>\
         <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\":\"Paris\",\"unit\":\"celsius\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>\
         <｜tool▁output▁begin｜>{\"temp_c\": 18}<｜tool▁output▁end｜>"
    );
    // Two calls after some text, the first with object arguments (written as compact JSON), then
    // the answer and a new question; `thinking` opens the reasoning.
    let mut msgs = past_calls(
        "call_1",
        json!({"location": "Paris", "unit": "celsius"}),
        Some(get_time_call("call_2")),
        Some("Let me check."),
        None,
    );
    msgs.push(msg("assistant", "18 °C at noon."));
    msgs.push(msg("user", "Thanks"));
    let mut extra = no_extra();
    extra.insert("thinking".into(), json!(true));
    let out = t.render(&msgs, Some(&tools), true, &extra).unwrap();
    assert_eq!(
        out,
        "<｜begin▁of▁sentence｜>You are helpful.<｜User｜>Weather in Paris?<｜Assistant｜></think>Let me check.\
         <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\":\"Paris\",\"unit\":\"celsius\"}<｜tool▁call▁end｜>\
         <｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>\
         <｜tool▁output▁begin｜>{\"temp_c\": 18}<｜tool▁output▁end｜><｜tool▁output▁begin｜>12:00<｜tool▁output▁end｜>\
         18 °C at noon.<｜end▁of▁sentence｜><｜User｜>Thanks<｜Assistant｜><think>"
    );
    // What the answer then generates parses back into the same calls.
    let answer = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\":\"Paris\",\"unit\":\"celsius\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
    let parsed = crate::output::parse_complete(
        crate::output::OutputOptions {
            parse_tool_calls: true,
            ..Default::default()
        },
        answer,
    );
    assert_eq!(
        parsed.tool_calls[0].arguments,
        "{\"location\":\"Paris\",\"unit\":\"celsius\"}"
    );
}

/// Kimi K2's tool declaration as its templates print it: `tools | tojson`, Python's spacing.
const KIMI_TOOLS: &str = r#"[{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city, e.g. Zürich", "parameters": {"type": "object", "properties": {"location": {"type": "string", "description": "City name"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}]"#;

#[test]
fn kimi_k2_renders_past_tool_calls_with_their_ids() {
    let t = ChatTemplate::new(KIMI_K2, None, Some("<|im_end|>".into())).unwrap();
    // `arguments is string` picks either form; objects stay the default.
    assert!(!t.string_arguments);
    let tools = weather_tool();
    let msgs = past_calls(
        "functions.get_weather:0",
        json!("{\"location\":\"Paris\",\"unit\":\"celsius\"}"),
        None,
        None,
        None,
    );
    let out = t.render(&msgs, Some(&tools), true, &no_extra()).unwrap();
    let want = format!(
        "<|im_system|>tool_declare<|im_middle|>\n  # Tools\n  {KIMI_TOOLS}<|im_end|>\
         <|im_system|>system<|im_middle|>You are helpful.<|im_end|>\
         <|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>\
         <|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0\
         <|tool_call_argument_begin|>{{\"location\": \"Paris\", \"unit\": \"celsius\"}}<|tool_call_end|><|tool_calls_section_end|><|im_end|>\
         <|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n    {{\"temp_c\": 18}}<|im_end|>\
         <|im_assistant|>assistant<|im_middle|>"
    );
    assert_eq!(out, want);
    let mut msgs = past_calls(
        "functions.get_weather:0",
        json!({"location": "Paris", "unit": "celsius"}),
        Some(get_time_call("functions.get_time:1")),
        Some("Let me check."),
        Some("Two tools."),
    );
    msgs.push(msg("assistant", "18 °C at noon."));
    msgs.push(msg("user", "Thanks"));
    let out = t.render(&msgs, Some(&tools), true, &no_extra()).unwrap();
    assert!(
        out.contains(
            "<|im_assistant|>assistant<|im_middle|>Let me check.<|tool_calls_section_begin|>\
             <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"location\": \"Paris\", \"unit\": \"celsius\"}<|tool_call_end|>\
             <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|><|im_end|>\
             <|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n    {\"temp_c\": 18}<|im_end|>\
             <|im_system|>tool<|im_middle|>## Return of functions.get_time:1\n    12:00<|im_end|>\
             <|im_assistant|>assistant<|im_middle|>18 °C at noon.<|im_end|>\
             <|im_user|>user<|im_middle|>Thanks<|im_end|><|im_assistant|>assistant<|im_middle|>"
        ),
        "{out}"
    );
}

#[test]
fn kimi_k2_thinking_renders_with_negative_range_and_tuple_separators() {
    // `range(messages|length-1, -1, -1)` with `break`, slices by a namespace value, macros and
    // `dict.get` with a default.
    let t = ChatTemplate::new(KIMI_K2_THINKING, None, Some("<|im_end|>".into())).unwrap();
    assert!(!t.string_arguments);
    let tools = weather_tool();
    let msgs = past_calls(
        "functions.get_weather:0",
        json!("{\"location\":\"Paris\"}"),
        None,
        None,
        Some("Need the weather."),
    );
    let tail = "<|im_system|>system<|im_middle|>You are helpful.<|im_end|>\
         <|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>\
         <|im_assistant|>assistant<|im_middle|><think>Need the weather.</think><|tool_calls_section_begin|>\
         <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"location\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>\
         <|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n{\"temp_c\": 18}<|im_end|>\
         <|im_assistant|>assistant<|im_middle|>";
    let out = t.render(&msgs, Some(&tools), true, &no_extra()).unwrap();
    assert_eq!(
        out,
        format!("<|im_system|>tool_declare<|im_middle|>{KIMI_TOOLS}<|im_end|>{tail}")
    );
    // A later revision of this template prints `tools | tojson(separators=(',', ':'))`: a
    // tuple literal as a keyword argument.
    let compact = KIMI_K2_THINKING.replace(
        "tools | tojson() }}",
        "tools | tojson(separators=(',', ':')) }}",
    );
    assert_ne!(compact, KIMI_K2_THINKING);
    let t = ChatTemplate::new(&compact, None, Some("<|im_end|>".into())).unwrap();
    let out = t.render(&msgs, Some(&tools), true, &no_extra()).unwrap();
    let tools_compact = serde_json::to_string(&tools).unwrap();
    assert_eq!(
        out,
        format!("<|im_system|>tool_declare<|im_middle|>{tools_compact}<|im_end|>{tail}")
    );
    // Reasoning of turns before the last answer is dropped: the call turn is history now.
    let mut msgs = msgs;
    msgs.push(msg("assistant", "18 °C."));
    msgs.push(msg("user", "Thanks"));
    let out = t.render(&msgs, Some(&tools), true, &no_extra()).unwrap();
    assert!(
        out.contains("<|im_middle|><think></think><|tool_calls_section_begin|>"),
        "{out}"
    );
    assert!(!out.contains("Need the weather."), "{out}");
}

#[test]
fn probe_keeps_object_arguments_for_templates_that_take_them() {
    for src in [QWEN3, QWEN35, FALLBACK_CHATML] {
        let t = ChatTemplate::new(src, None, None).unwrap();
        assert!(!t.string_arguments);
    }
    // A template that only concatenates the arguments, and one that only iterates them.
    let concat = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ 'A=' + c.function.arguments }}{% endfor %}{% endfor %}";
    let items = "{% for m in messages %}{% for c in m.tool_calls or [] %}{% for k, v in c.function.arguments|items %}{{ k }}={{ v }};{% endfor %}{% endfor %}{% endfor %}";
    let msgs = tool_round_trip(json!({"location": "Paris"}));
    let t = ChatTemplate::new(concat, None, None).unwrap();
    assert!(t.string_arguments);
    assert_eq!(
        t.render(&msgs, None, false, &no_extra()).unwrap(),
        "A={\"location\":\"Paris\"}"
    );
    let t = ChatTemplate::new(items, None, None).unwrap();
    assert!(!t.string_arguments);
    let msgs = tool_round_trip(json!("{\"location\": \"Paris\"}"));
    assert_eq!(
        t.render(&msgs, None, false, &no_extra()).unwrap(),
        "location=Paris;"
    );
}

// gpt-oss (OpenAI harmony). The template is llama.cpp's `models/templates/openai-gpt-oss-120b.jinja`,
// its copy of huggingface.co/openai/gpt-oss-120b's `chat_template.jinja` (gpt-oss-20b ships the
// same); see tests/server/gpt_oss_chat_template.md. The expected texts are those of
// openai/harmony's docs/format.md, except where the template itself writes otherwise (said at
// each place); Python's jinja2 set up as transformers does renders the same texts
// (crates/sluice-engine/tests/data/render_reference.py).

const GPT_OSS: &str = include_str!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/server/gpt_oss_chat_template.jinja"
));

fn gpt_oss() -> ChatTemplate {
    ChatTemplate::new(
        GPT_OSS,
        Some("<|startoftext|>".into()),
        Some("<|return|>".into()),
    )
    .unwrap()
}

/// `text` with the date that `strftime_now` wrote after "Current date: " replaced by DATE.
fn undated(text: &str) -> String {
    let at = text.find("Current date: ").expect("a date") + "Current date: ".len();
    let date = &text[at..at + 10];
    assert!(
        date.bytes().enumerate().all(|(i, b)| if i == 4 || i == 7 {
            b == b'-'
        } else {
            b.is_ascii_digit()
        }),
        "{date}"
    );
    format!("{}DATE{}", &text[..at], &text[at + 10..])
}

const HARMONY_SYSTEM: &str = "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: DATE\n\nReasoning: high\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.\nCalls to these tools must go to the commentary channel: 'functions'.<|end|>";

/// docs/format.md's function-calling example's tools.
fn harmony_doc_tools() -> serde_json::Value {
    json!([
        {"type": "function", "function": {"name": "get_location",
            "description": "Gets the location of the user."}},
        {"type": "function", "function": {"name": "get_current_weather",
            "description": "Gets the current weather in the provided location.",
            "parameters": {"type": "object", "properties": {
                "location": {"type": "string",
                    "description": "The city and state, e.g. San Francisco, CA"},
                "format": {"type": "string", "enum": ["celsius", "fahrenheit"],
                    "default": "celsius"}},
                "required": ["location"]}}}
    ])
}

fn high_effort() -> serde_json::Map<String, serde_json::Value> {
    let mut extra = no_extra();
    extra.insert("reasoning_effort".into(), json!("high"));
    extra
}

#[test]
fn gpt_oss_template_is_harmony() {
    let t = gpt_oss();
    assert!(t.is_harmony());
    assert!(!qwen3().is_harmony());
    // It takes tool-call arguments as objects, as transformers gives them.
    assert!(!t.string_arguments);
}

#[test]
fn gpt_oss_renders_the_docs_function_calling_prompt() {
    let out = gpt_oss()
        .render(
            &[
                msg("system", "Use a friendly tone."),
                msg("user", "What is the weather like in SF?"),
            ],
            Some(&harmony_doc_tools()),
            true,
            &high_effort(),
        )
        .unwrap();
    // docs/format.md, "Defining available tools", but for the template's own comma after a
    // default (`// default: celsius,`).
    let want = format!(
        "{HARMONY_SYSTEM}<|start|>developer<|message|># Instructions\n\nUse a friendly tone.\n\n# Tools\n\n## functions\n\nnamespace functions {{\n\n// Gets the location of the user.\ntype get_location = () => any;\n\n// Gets the current weather in the provided location.\ntype get_current_weather = (_: {{\n// The city and state, e.g. San Francisco, CA\nlocation: string,\nformat?: \"celsius\" | \"fahrenheit\", // default: celsius,\n}}) => any;\n\n}} // namespace functions<|end|><|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant"
    );
    assert_eq!(undated(&out), want);
    // Without kwargs the effort is medium, and without tools no developer message is needed.
    let out = gpt_oss()
        .render(&[msg("user", "What is 2 + 2?")], None, true, &no_extra())
        .unwrap();
    assert_eq!(
        undated(&out),
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: DATE\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|><|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant"
    );
}

/// The docs' tool round trip as an OpenAI client sends it back: the call with its reasoning,
/// then the tool's result.
fn harmony_round_trip(reasoning: Option<&str>, content: Option<&str>) -> Vec<ChatMessage> {
    let call = json!([{"id": "call_1", "type": "function", "function": {
        "name": "get_current_weather", "arguments": "{\"location\":\"San Francisco\"}"}}]);
    vec![
        msg("system", "Use a friendly tone."),
        msg("user", "What is the weather like in SF?"),
        ChatMessage {
            content: content.map(str::to_string),
            tool_calls: Some(call),
            reasoning_content: reasoning.map(str::to_string),
            ..msg("assistant", "")
        },
        ChatMessage {
            tool_call_id: Some("call_1".into()),
            ..msg("tool", "{\"sunny\": true, \"temperature\": 20}")
        },
    ]
}

#[test]
fn gpt_oss_renders_a_tool_round_trip_with_its_reasoning() {
    let t = gpt_oss();
    let out = t
        .render(
            &harmony_round_trip(Some("Need to use function get_current_weather."), None),
            Some(&harmony_doc_tools()),
            true,
            &high_effort(),
        )
        .unwrap();
    // docs/format.md, "Handling tool calls": the call's chain of thought stays in the prompt.
    // The template writes the recipient in the role (which the docs allow too), the arguments
    // with `tojson`, and the tool's output as a JSON string.
    let tail = "<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|><|start|>assistant to=functions.get_current_weather<|channel|>commentary json<|message|>{\"location\": \"San Francisco\"}<|call|><|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>\"{\\\"sunny\\\": true, \\\"temperature\\\": 20}\"<|end|><|start|>assistant";
    assert!(undated(&out).starts_with(HARMONY_SYSTEM), "{out}");
    assert!(out.ends_with(tail), "{out}");
    // `content: null` (what OpenAI clients send with tool calls), or content and reasoning both
    // (the template refuses a turn with both): the reasoning is what is written.
    let again = t
        .render(
            &harmony_round_trip(
                Some("Need to use function get_current_weather."),
                Some("Let me check."),
            ),
            Some(&harmony_doc_tools()),
            true,
            &high_effort(),
        )
        .unwrap();
    assert_eq!(again, out);
    // No reasoning: the call alone.
    let out = t
        .render(
            &harmony_round_trip(None, None),
            Some(&harmony_doc_tools()),
            true,
            &high_effort(),
        )
        .unwrap();
    assert!(
        out.contains("<|start|>user<|message|>What is the weather like in SF?<|end|><|start|>assistant to=functions.get_current_weather<|channel|>commentary json<|message|>"),
        "{out}"
    );
    // A tool result with no call before it: the template's own error.
    let err = t
        .render(
            &[msg("user", "Hi"), msg("tool", "x")],
            None,
            true,
            &no_extra(),
        )
        .unwrap_err();
    assert!(
        matches!(&err, ChatError::Raised(m) if m.contains("no previous assistant message with a tool call")),
        "{err:?}"
    );
}

#[test]
fn gpt_oss_drops_reasoning_of_answered_turns() {
    // docs/format.md, "Handling reasoning output in subsequent sampling": a turn that ended in a
    // final message is sent back without its chain of thought.
    let messages = [
        msg("user", "What is 2 + 2?"),
        ChatMessage {
            reasoning_content: Some("Simple arithmetic.".into()),
            ..msg("assistant", "2 + 2 = 4.")
        },
        msg("user", "What about 9 / 2?"),
    ];
    let out = gpt_oss()
        .render(&messages, None, true, &high_effort())
        .unwrap();
    assert!(
        out.ends_with("<|end|><|start|>user<|message|>What is 2 + 2?<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|end|><|start|>user<|message|>What about 9 / 2?<|end|><|start|>assistant"),
        "{out}"
    );
    // A call's reasoning goes too once a later turn answered (the template's rule).
    let mut messages = harmony_round_trip(Some("Need the weather."), None);
    messages.push(msg("assistant", "It is sunny, 20 °C."));
    messages.push(msg("user", "Thanks!"));
    let out = gpt_oss()
        .render(&messages, Some(&harmony_doc_tools()), true, &no_extra())
        .unwrap();
    assert!(!out.contains("Need the weather."), "{out}");
    assert!(
        out.ends_with("<|call|><|start|>functions.get_current_weather to=assistant<|channel|>commentary<|message|>\"{\\\"sunny\\\": true, \\\"temperature\\\": 20}\"<|end|><|start|>assistant<|channel|>final<|message|>It is sunny, 20 °C.<|end|><|start|>user<|message|>Thanks!<|end|><|start|>assistant"),
        "{out}"
    );
}

#[test]
fn gpt_oss_renders_typescript_parameter_types() {
    let tools = json!([{"type": "function", "function": {"name": "f", "description": "Does f.",
        "parameters": {"type": "object", "properties": {
            "xs": {"type": "array", "description": "No item type."},
            "ys": {"type": "array", "items": {"type": "integer"}},
            "n": {"type": ["number", "null"]},
            "flag": {"type": "boolean", "default": false},
            "o": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}},
            "required": ["xs"]}}}]);
    let out = gpt_oss()
        .render(&[msg("user", "Hi")], Some(&tools), true, &no_extra())
        .unwrap();
    // `param_spec['items']` of a schema without `items` is undefined here; in Python it is the
    // dict's `items` method, which ends in the same `any[]`. The object's inner line break and
    // indent are the template's (a `{{ }}` without `-`).
    assert!(
        out.contains("// Does f.\ntype f = (_: {\n// No item type.\nxs: any[],\nys?: number[],\nn?: number | null,\nflag?: boolean, // default: false,\no?: {\na: \n                string},\n}) => any;\n\n} // namespace functions<|end|>"),
        "{out}"
    );
}

/// Hostile templates end with a clear error, quickly: a loop of 10^10 steps runs out of fuel,
/// recursion hits minijinja's depth limit, huge ranges and repeated strings are refused. A real
/// template over a long conversation stays far inside the fuel.
#[test]
fn hostile_templates_are_stopped() {
    let cases = [
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
            "instructions",
        ),
        (
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "recursion",
        ),
        ("{% for i in range(10000000000) %}x{% endfor %}", "too many"),
        ("{{ 'x' * 100000000000 }}", "too large"),
    ];
    for (source, want) in cases {
        let t = ChatTemplate::new(source, None, None).unwrap();
        let start = std::time::Instant::now();
        let err = t
            .render(&[msg("user", "hi")], None, true, &no_extra())
            .expect_err(source)
            .to_string();
        assert!(err.contains(want), "{source}: {err}");
        assert!(
            start.elapsed().as_secs() < 20,
            "{source}: took {:?}",
            start.elapsed()
        );
    }
    let long: Vec<ChatMessage> = (0..2000)
        .map(|i| {
            msg(
                if i % 2 == 0 { "user" } else { "assistant" },
                "some words here",
            )
        })
        .collect();
    let out = qwen3().render(&long, Some(&weather_tool()), true, &no_extra());
    assert!(out.is_ok(), "{out:?}");
}
