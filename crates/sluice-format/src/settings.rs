//! tokenizer_config.json and generation_config.json.

use std::path::Path;

use serde_json::Value;

use crate::error::FormatError;
use crate::read_json_opt;

/// What sluice needs from tokenizer_config.json (the vocabulary itself is in tokenizer.json).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerConfig {
    pub eos_token: Option<String>,
    pub bos_token: Option<String>,
    pub pad_token: Option<String>,
    /// `add_bos_token` as written; `false` when absent (tokenizer.json's post-processor may
    /// still add one).
    pub add_bos_token: bool,
    /// The Jinja chat template: `chat_template.jinja` if the directory has one, else
    /// tokenizer_config.json's `chat_template` (a string, or the `default` entry of a list of
    /// `{name, template}`), else `chat_template.json`'s.
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    /// Reads the settings from `dir`; a missing tokenizer_config.json gives the defaults.
    pub fn read(dir: &Path) -> Result<TokenizerConfig, FormatError> {
        let path = dir.join("tokenizer_config.json");
        let mut tc = TokenizerConfig::default();
        if let Some(v) = read_json_opt(&path)? {
            let Value::Object(o) = &v else {
                return Err(FormatError::Config {
                    path,
                    msg: "expected a JSON object".to_string(),
                });
            };
            tc.eos_token = o.get("eos_token").and_then(token_text);
            tc.bos_token = o.get("bos_token").and_then(token_text);
            tc.pad_token = o.get("pad_token").and_then(token_text);
            tc.add_bos_token = o
                .get("add_bos_token")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            tc.chat_template = o.get("chat_template").and_then(template_text);
        }
        let jinja = dir.join("chat_template.jinja");
        if jinja.is_file() {
            tc.chat_template =
                Some(
                    std::fs::read_to_string(&jinja).map_err(|source| FormatError::Io {
                        path: jinja,
                        source,
                    })?,
                );
        } else if tc.chat_template.is_none() {
            let path = dir.join("chat_template.json");
            if let Some(v) = read_json_opt(&path)? {
                tc.chat_template = v.get("chat_template").and_then(template_text);
            }
        }
        Ok(tc)
    }
}

/// A special token written as a string or as an AddedToken object `{"content": ...}`.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// A chat template written as a string or as a list of `{name, template}` (the `default` one,
/// else the first).
fn template_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let entry = list
                .iter()
                .find(|e| e.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| list.first())?;
            entry
                .get("template")
                .and_then(Value::as_str)
                .map(str::to_string)
        }
        _ => None,
    }
}

/// Sampling defaults and stop tokens from generation_config.json.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerationConfig {
    /// Written as an integer or a list; empty when absent. When generation_config.json does not
    /// give it, config.json's `eos_token_id` is used.
    pub eos_token_id: Vec<u32>,
    /// From generation_config.json, else config.json.
    pub bos_token_id: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// A negative value (disabled) reads as `None`.
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationConfig {
    /// Reads `dir/generation_config.json` (defaults if missing), filling the token ids from
    /// `config` (the model's config.json, text part) when the file does not give them.
    pub fn read(dir: &Path, config: &Value) -> Result<GenerationConfig, FormatError> {
        let path = dir.join("generation_config.json");
        let mut g = GenerationConfig::default();
        if let Some(v) = read_json_opt(&path)? {
            let err = |msg: String| FormatError::Config {
                path: path.clone(),
                msg,
            };
            let Value::Object(o) = &v else {
                return Err(err("expected a JSON object".to_string()));
            };
            g.eos_token_id = token_ids(o.get("eos_token_id")).map_err(|found| {
                err(format!(
                    "`eos_token_id` must be a token id or a list of token ids, found {found}"
                ))
            })?;
            g.bos_token_id = match token_ids(o.get("bos_token_id")) {
                Ok(ids) if ids.len() <= 1 => ids.first().copied(),
                Ok(_) => return Err(err("`bos_token_id` must be a single token id".to_string())),
                Err(found) => {
                    return Err(err(format!(
                        "`bos_token_id` must be a token id, found {found}"
                    )))
                }
            };
            let float = |key: &str| -> Result<Option<f32>, FormatError> {
                match o.get(key) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::Number(n)) => Ok(n.as_f64().map(|x| x as f32)),
                    Some(v) => Err(err(format!("`{key}` must be a number, found {v}"))),
                }
            };
            g.temperature = float("temperature")?;
            g.top_p = float("top_p")?;
            g.min_p = float("min_p")?;
            g.repetition_penalty = float("repetition_penalty")?;
            g.top_k = match o.get("top_k") {
                None | Some(Value::Null) => None,
                Some(Value::Number(n)) if n.as_i64().is_some() => {
                    usize::try_from(n.as_i64().unwrap_or(-1)).ok()
                }
                Some(v) => return Err(err(format!("`top_k` must be an integer, found {v}"))),
            };
        }
        if g.eos_token_id.is_empty() {
            g.eos_token_id = token_ids(config.get("eos_token_id")).unwrap_or_default();
        }
        if g.bos_token_id.is_none() {
            g.bos_token_id = token_ids(config.get("bos_token_id"))
                .ok()
                .and_then(|ids| ids.first().copied());
        }
        Ok(g)
    }
}

/// An id, a list of ids, or nothing; `Err` carries what was found instead.
fn token_ids(v: Option<&Value>) -> Result<Vec<u32>, String> {
    let id = |v: &Value| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(list)) => list
            .iter()
            .map(|e| id(e).ok_or_else(|| e.to_string()))
            .collect(),
        Some(v) => id(v).map(|x| vec![x]).ok_or_else(|| v.to_string()),
    }
}
