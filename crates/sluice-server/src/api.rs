//! The OpenAI request bodies sluice accepts, and their checks.
//!
//! Fields sluice does not know are ignored, as OpenAI-compatible servers do (clients send many);
//! a known field of the wrong type or out of range is a 400 naming the field.

use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{Map, Value};
use sluice_engine::chat::ChatMessage;
use sluice_engine::sampler::SamplingParams;

use crate::error::ApiError;

/// Parses a JSON body into `T`; errors name the field (`messages[1].content: invalid type...`).
pub fn parse_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let parsed: Result<T, _> = serde_path_to_error::deserialize(&mut de);
    match parsed {
        Ok(v) => {
            de.end()
                .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))?;
            Ok(v)
        }
        Err(e) => {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() {
                Err(ApiError::invalid(format!("invalid JSON body: {inner}")))
            } else if path == "." {
                Err(ApiError::invalid(format!("invalid request body: {inner}")))
            } else {
                Err(ApiError::field(&path, format!("{path}: {inner}")))
            }
        }
    }
}

/// `stop`: one string or a list.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling and length fields shared by both endpoints, parsed from the same body as the
/// endpoint's own fields (not `#[serde(flatten)]`ed into them, which would lose the field name
/// from type errors).
#[derive(Deserialize, Default)]
pub struct Sampling {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub logprobs: Option<bool>,
    /// Extension (vLLM, llama.cpp): generate past end-of-sequence tokens up to the limit.
    pub ignore_eos: Option<bool>,
    /// Token id (as a string, OpenAI's shape) -> bias in [-100, 100] added to its logit.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
}

impl Sampling {
    /// The sampler settings: request values over the model's generation_config defaults.
    pub fn params(&self, defaults: &SamplingParams) -> Result<SamplingParams, ApiError> {
        let top_k = match self.top_k {
            None => defaults.top_k,
            // vLLM and llama.cpp read -1 (or 0) as "off".
            Some(k) if k <= 0 => 0,
            Some(k) => k as usize,
        };
        let params = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            top_k,
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
            seed: self.seed.map(|s| s as u64),
            logit_bias: self.logit_bias()?,
            ..defaults.clone()
        };
        if let Err(message) = params.validate() {
            let field = message.split_whitespace().next().unwrap_or("").to_string();
            return Err(ApiError::field(&field, message));
        }
        for (name, v) in [
            ("presence_penalty", params.presence_penalty),
            ("frequency_penalty", params.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::field(
                    name,
                    format!("{name} must be in [-2, 2], got {v}"),
                ));
            }
        }
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::field(
                    "n",
                    format!("n must be 1 (one choice per request), got {n}"),
                ));
            }
        }
        if self.logprobs == Some(true) {
            return Err(ApiError::field("logprobs", "logprobs are not supported"));
        }
        Ok(params)
    }

    /// `logit_bias` as the sampler takes it: ascending token ids.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        let mut bias = map
            .iter()
            .map(|(k, &v)| match k.trim().parse::<u32>() {
                Ok(id) => Ok((id, v)),
                Err(_) => Err(ApiError::field(
                    "logit_bias",
                    format!("logit_bias keys must be token ids, got `{k}`"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        bias.sort_by_key(|&(id, _)| id);
        if bias.windows(2).any(|w| w[0].0 == w[1].0) {
            return Err(ApiError::field(
                "logit_bias",
                "logit_bias names a token twice",
            ));
        }
        Ok(bias)
    }

    /// The requested length limit, if any (`max_completion_tokens` wins, as in OpenAI's API).
    pub fn max_tokens(&self) -> Result<Option<usize>, ApiError> {
        let (name, v) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(v), _) => ("max_completion_tokens", v),
            (None, Some(v)) => ("max_tokens", v),
            (None, None) => return Ok(None),
        };
        if v == 0 {
            return Err(ApiError::field(name, format!("{name} must be at least 1")));
        }
        Ok(Some(v.min(usize::MAX as u64) as usize))
    }

    pub fn stop(&self) -> Result<Vec<String>, ApiError> {
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.len() > 16 {
            return Err(ApiError::field(
                "stop",
                format!("at most 16 stop sequences, got {}", stop.len()),
            ));
        }
        if stop.iter().any(|s| s.is_empty()) {
            return Err(ApiError::field("stop", "stop sequences must not be empty"));
        }
        Ok(stop)
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// `POST /v1/chat/completions`.
#[derive(Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<InMessage>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    /// Extra variables for the chat template, e.g. `{"enable_thinking": false}`.
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub response_format: Option<ResponseFormat>,
    /// `"low" | "medium" | "high"`: the template variable `reasoning_effort` (gpt-oss's template
    /// writes it into its system message), unless `chat_template_kwargs` sets it.
    pub reasoning_effort: Option<String>,
}

#[derive(Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
}

#[derive(Deserialize)]
pub struct InMessage {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<InToolCall>>,
    pub tool_call_id: Option<String>,
    /// Earlier reasoning sent back (templates such as Qwen3.5's render it for recent turns).
    pub reasoning_content: Option<String>,
}

/// Message content: a string, or a list of parts of which sluice takes the text ones.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize)]
pub struct InToolCall {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: InFunctionCall,
}

#[derive(Deserialize)]
pub struct InFunctionCall {
    pub name: String,
    /// A JSON string as OpenAI sends it (an object is accepted too).
    pub arguments: Value,
}

#[derive(Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Deserialize)]
pub struct FunctionDef {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Value>,
}

/// `"none" | "auto" | "required"` or `{"type": "function", "function": {"name": ..}}`.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Named { function: NamedFunction },
}

#[derive(Deserialize)]
pub struct NamedFunction {
    pub name: String,
}

impl ChatRequest {
    /// The conversation for the chat template.
    pub fn messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::field("messages", "messages must not be empty"));
        }
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let role = match m.role.as_str() {
                // OpenAI's newer name for the system role.
                "developer" => "system",
                r @ ("system" | "user" | "assistant" | "tool") => r,
                other => {
                    return Err(ApiError::field(
                        &format!("messages[{i}].role"),
                        format!(
                            "messages[{i}].role: unknown role `{other}` (expected system, developer, user, assistant or tool)"
                        ),
                    ))
                }
            };
            let content = match &m.content {
                None => None,
                Some(Content::Text(t)) => Some(t.clone()),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => text.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::field(
                                    &format!("messages[{i}].content[{j}]"),
                                    format!(
                                        "messages[{i}].content[{j}]: content parts of type `{kind}` are not supported (text only)"
                                    ),
                                ))
                            }
                        }
                    }
                    Some(text)
                }
            };
            if content.is_none() && !(role == "assistant" && m.tool_calls.is_some()) {
                return Err(ApiError::field(
                    &format!("messages[{i}].content"),
                    format!("messages[{i}].content is required for a {role} message"),
                ));
            }
            let tool_calls = m.tool_calls.as_ref().map(|calls| {
                Value::Array(
                    calls
                        .iter()
                        .map(|c| {
                            serde_json::json!({
                                "id": c.id,
                                "type": c.kind.as_deref().unwrap_or("function"),
                                "function": {"name": c.function.name, "arguments": c.function.arguments},
                            })
                        })
                        .collect(),
                )
            });
            out.push(ChatMessage {
                role: role.to_string(),
                content,
                tool_calls,
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
                reasoning_content: m.reasoning_content.clone(),
            });
        }
        Ok(out)
    }

    /// The extra variables for the chat template: `chat_template_kwargs`, and
    /// `reasoning_effort` as the variable of that name.
    pub fn template_kwargs(&self) -> Result<Map<String, Value>, ApiError> {
        let mut kwargs = self.chat_template_kwargs.clone().unwrap_or_default();
        if let Some(effort) = &self.reasoning_effort {
            if !matches!(effort.as_str(), "low" | "medium" | "high") {
                return Err(ApiError::field(
                    "reasoning_effort",
                    format!(
                        "reasoning_effort must be \"low\", \"medium\" or \"high\", got {effort:?}"
                    ),
                ));
            }
            kwargs
                .entry("reasoning_effort")
                .or_insert_with(|| Value::String(effort.clone()));
        }
        Ok(kwargs)
    }

    /// The tools to offer the model (`None`: no tools, no tool-call parsing).
    pub fn tools(&self) -> Result<Option<Value>, ApiError> {
        let Some(tools) = &self.tools else {
            return Ok(None);
        };
        for (i, t) in tools.iter().enumerate() {
            if t.kind != "function" {
                return Err(ApiError::field(
                    &format!("tools[{i}].type"),
                    format!("tools[{i}].type must be \"function\", got {:?}", t.kind),
                ));
            }
        }
        let chosen: Vec<&Tool> = match &self.tool_choice {
            None => tools.iter().collect(),
            Some(ToolChoice::Mode(m)) => match m.as_str() {
                "none" => return Ok(None),
                // No constrained decoding: `required` offers the tools like `auto`.
                "auto" | "required" => tools.iter().collect(),
                other => {
                    return Err(ApiError::field(
                        "tool_choice",
                        format!("tool_choice must be none, auto, required or a named function, got {other:?}"),
                    ))
                }
            },
            Some(ToolChoice::Named { function }) => {
                let named: Vec<&Tool> = tools
                    .iter()
                    .filter(|t| t.function.name == function.name)
                    .collect();
                if named.is_empty() {
                    return Err(ApiError::field(
                        "tool_choice",
                        format!("tool_choice names `{}`, which is not in tools", function.name),
                    ));
                }
                named
            }
        };
        if chosen.is_empty() {
            return Ok(None);
        }
        Ok(Some(Value::Array(
            chosen
                .into_iter()
                .map(|t| {
                    let mut f = Map::new();
                    f.insert("name".into(), Value::String(t.function.name.clone()));
                    if let Some(d) = &t.function.description {
                        f.insert("description".into(), Value::String(d.clone()));
                    }
                    if let Some(p) = &t.function.parameters {
                        f.insert("parameters".into(), p.clone());
                    }
                    serde_json::json!({"type": "function", "function": f})
                })
                .collect(),
        )))
    }

    pub fn check_unsupported(&self) -> Result<(), ApiError> {
        if let Some(f) = &self.response_format {
            if f.kind != "text" {
                return Err(ApiError::field(
                    "response_format",
                    format!(
                        "response_format {:?} is not supported (only \"text\")",
                        f.kind
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// `POST /v1/completions`.
#[derive(Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
}

/// A prompt: text, a list of one text, or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(body: &str) -> ChatRequest {
        serde_json::from_str(body).unwrap()
    }

    #[test]
    fn reasoning_effort_is_a_template_kwarg() {
        let messages = r#""messages": [{"role": "user", "content": "Hi"}]"#;
        let r = request(&format!(r#"{{{messages}, "reasoning_effort": "high"}}"#));
        assert_eq!(
            Value::Object(r.template_kwargs().unwrap()),
            serde_json::json!({"reasoning_effort": "high"})
        );
        // chat_template_kwargs say it first.
        let r = request(&format!(
            r#"{{{messages}, "reasoning_effort": "high", "chat_template_kwargs": {{"reasoning_effort": "low", "x": 1}}}}"#
        ));
        assert_eq!(
            Value::Object(r.template_kwargs().unwrap()),
            serde_json::json!({"reasoning_effort": "low", "x": 1})
        );
        let r = request(&format!(r#"{{{messages}}}"#));
        assert!(r.template_kwargs().unwrap().is_empty());
        let r = request(&format!(r#"{{{messages}, "reasoning_effort": "extreme"}}"#));
        let e = r.template_kwargs().unwrap_err();
        assert_eq!(e.param.as_deref(), Some("reasoning_effort"));
        assert!(e.message.contains("\"extreme\""), "{}", e.message);
    }
}
