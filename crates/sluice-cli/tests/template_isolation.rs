//! Chat templates render in a child process of the `sluice` binary under a memory limit
//! (`sluice_engine::chat::isolate_templates`): a template that builds a string past the limit
//! fails that one render, the next render works, and real templates render exactly as they do
//! in-process.

use std::path::{Path, PathBuf};

use sluice_engine::chat::{isolate_templates, ChatError, ChatMessage, ChatTemplate};

fn isolate() {
    isolate_templates(PathBuf::from(env!("CARGO_BIN_EXE_sluice")));
}

fn kwargs(pairs: &[(&str, serde_json::Value)]) -> serde_json::Map<String, serde_json::Value> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// Doubles a string 45 times (32 TiB) when `blow_up` is set; prints the first message.
const DOUBLING: &str = "{% if blow_up %}{% set ns = namespace(s='x') %}\
    {% for i in range(45) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}\
    {% endif %}{{ messages[0].content }}";

#[test]
fn a_template_past_its_memory_limit_fails_that_render_and_the_next_one_works() {
    isolate();
    let template = ChatTemplate::new(DOUBLING, None, None).unwrap();
    let messages = [ChatMessage::new("user", "hello")];
    for _ in 0..2 {
        let blown = template
            .render(&messages, None, false, &kwargs(&[("blow_up", true.into())]))
            .unwrap_err();
        let text = blown.to_string();
        assert!(
            matches!(blown, ChatError::Render { .. })
                && text.contains("1.0 GiB a template may use"),
            "{text}"
        );
        let fine = template
            .render(
                &messages,
                None,
                false,
                &kwargs(&[("blow_up", false.into())]),
            )
            .unwrap();
        assert_eq!(fine, "hello");
    }
}

#[test]
fn a_huge_list_in_one_instruction_is_stopped_too() {
    isolate();
    let template =
        ChatTemplate::new("{{ ([0] * 1000000000) | list | length }}", None, None).unwrap();
    let err = template
        .render(&[], None, false, &serde_json::Map::new())
        .unwrap_err();
    assert!(err.to_string().contains("a template may use"), "{err}");
}

#[test]
fn errors_inside_the_renderer_come_back_as_they_are() {
    isolate();
    let raising = ChatTemplate::new("{{ raise_exception('no system role') }}", None, None).unwrap();
    let err = raising
        .render(&[], None, false, &serde_json::Map::new())
        .unwrap_err();
    assert_eq!(err, ChatError::Raised("no system role".into()));

    let endless = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        None,
        None,
    )
    .unwrap();
    let err = endless
        .render(&[], None, false, &serde_json::Map::new())
        .unwrap_err();
    assert!(err.to_string().contains("instructions"), "{err}");

    let syntax = ChatTemplate::new("{% if %}", None, None).unwrap_err();
    assert!(
        matches!(syntax, ChatError::Syntax { line: 1, .. }),
        "{syntax}"
    );
}

fn fixture_template(dir: &str) -> (String, Option<String>, Option<String>) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(dir)
        .join("tokenizer_config.json");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let token = |k: &str| {
        config[k]
            .as_str()
            .or_else(|| config[k]["content"].as_str())
            .map(str::to_string)
    };
    let source = config["chat_template"]
        .as_str()
        .unwrap_or_else(|| panic!("{} has no chat_template", path.display()))
        .to_string();
    (source, token("bos_token"), token("eos_token"))
}

#[test]
fn real_templates_render_the_same_isolated_and_in_process() {
    isolate();
    let tools = serde_json::json!([{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }]);
    let call = serde_json::json!([{
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
    }]);
    let messages = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Weather in Paris?"),
        ChatMessage {
            content: None,
            tool_calls: Some(call),
            ..ChatMessage::new("assistant", "")
        },
        ChatMessage {
            tool_call_id: Some("call_1".into()),
            ..ChatMessage::new("tool", "18 C, clear")
        },
    ];
    let mut checked = 0;
    for dir in [
        "qwen3_moe-q4g128",
        "deepseek_v3-q4",
        "glm4_moe-hf",
        "gpt_oss-transformers",
        "mixtral-hf",
    ] {
        let (source, bos, eos) = fixture_template(dir);
        let isolated = ChatTemplate::new(&source, bos.clone(), eos.clone()).unwrap();
        let local = ChatTemplate::in_process(&source, bos, eos).unwrap();
        let no_kwargs = serde_json::Map::new();
        // Mixtral's template takes no tools or tool turns: it raises, and must raise the same.
        let a = isolated.render(&messages, Some(&tools), true, &no_kwargs);
        let b = local.render(&messages, Some(&tools), true, &no_kwargs);
        assert_eq!(a, b, "{dir}");
        checked += usize::from(a.is_ok());
    }
    assert!(
        checked >= 4,
        "only {checked} templates rendered the tool conversation"
    );
}
