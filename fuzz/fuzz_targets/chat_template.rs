//! A chat template (templates are programs from a model's files): compiled, then rendered with
//! a conversation that has tools, a tool call and its result, the input after a zero byte as
//! extra kwargs when it is a JSON object. Rendering must end within the fuel budget.
#![no_main]
use libfuzzer_sys::fuzz_target;
use serde_json::json;
use sluice_engine::chat::{ChatMessage, ChatTemplate};

fuzz_target!(|data: &[u8]| {
    let parts = sluice_fuzz::parts(data, 2);
    let Ok(source) = std::str::from_utf8(parts[0]) else {
        return;
    };
    let Ok(template) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())) else {
        return;
    };
    let extra = parts
        .get(1)
        .and_then(|b| serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(b).ok())
        .unwrap_or_default();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let call = json!([{"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]);
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
            ..ChatMessage::new("tool", "{\"temp\": 21}")
        },
    ];
    let start = std::time::Instant::now();
    let _ = template.render(&messages, Some(&tools), true, &extra);
    // The fuel budget is ~0.5 s on a slow machine; a render past 20 s escaped it.
    assert!(
        start.elapsed().as_secs() < 20,
        "a render ran {:?}",
        start.elapsed()
    );
});
