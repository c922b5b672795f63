//! Reads a Hugging Face / mlx-community model directory: `config.json` (and the `text_config`
//! of vision-language checkpoints), MLX quantisation settings, the safetensors weights (one
//! file, index-listed shards, or loose `*.safetensors` files), `tokenizer_config.json`,
//! `chat_template.jinja` and `generation_config.json`.
//!
//! This crate owns everything about the files of a checkpoint and nothing about what a model
//! does with them: it parses and validates the safetensors format itself, memory-maps the
//! weights and hands them out as zero-copy [`HostMatrix`]/[`HostBytes`] views (dense F32/F16/BF16
//! or MLX affine-quantised), and turns every defect of the directory (missing or truncated
//! files, malformed JSON, tensors of the wrong dtype or shape, quantisation settings that do not
//! fit the tensors) into a one-line [`FormatError`] naming the file and tensor. It never panics
//! on bad input. It also knows where a checkpoint keeps its routed experts, in each of the
//! layouts sluice reads ([`experts`]: the one scanner that packing, unpacked streaming and model
//! loading share), and writes safetensors files ([`safetensors_writer`]), for tools and tests.
//! [`gguf`] reads the metadata and tensor table of a llama.cpp GGUF file, and [`ModelDir::open`]
//! opens one as a model (`gguf_model`: config from the metadata, tensors under Hugging Face names
//! with quantised blocks converted exactly by [`ggml_quants`], tokenizer by [`gguf_tokenizer`]).
//!
//! ```no_run
//! # fn main() -> Result<(), sluice_format::FormatError> {
//! let dir = sluice_format::ModelDir::open("models/Qwen3-30B-A3B-4bit")?;
//! let q = dir.tensors.matrix(
//!     "model.layers.0.self_attn.q_proj",
//!     dir.quantization.as_ref(),
//!     None,
//! )?;
//! # let _ = q; Ok(()) }
//! ```

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::Value;

mod error;
pub mod experts;
pub mod fs_util;
pub mod ggml_quants;
pub mod gguf;
mod gguf_families;
mod gguf_model;
pub mod gguf_tokenizer;
mod quant;
pub mod safetensors;
pub mod safetensors_writer;
mod settings;
mod tensors;

pub use error::FormatError;
pub use fs_util::safetensors_bytes;
pub use gguf_model::{GgufExperts, StreamedExperts, GGUF_ARCHITECTURES};
pub use quant::QuantConfig;
pub use safetensors::{convert_to_f32, read_safetensors, StDtype, TensorInfo};
pub use safetensors_writer::{safetensors_header_for, write_safetensors};
pub use settings::{GenerationConfig, TokenizerConfig};
pub use sluice_backend::{Dtype, HostBytes, HostMatrix, WeightFormat};
pub use tensors::{Tensors, INDEX_FILE, SINGLE_FILE};

/// Keys of config.json's top level that are also visible through `text_config`.
const TOP_LEVEL_KEYS: [&str; 3] = ["quantization", "quantization_config", "tie_word_embeddings"];

/// An opened model directory.
#[derive(Debug, Clone)]
pub struct ModelDir {
    pub path: PathBuf,
    /// config.json as read.
    pub config: Value,
    /// config.json's `text_config` object if it has one (vision-language checkpoints), else the
    /// whole config. Other top-level keys are not merged in, except `quantization`,
    /// `quantization_config` and `tie_word_embeddings`, which are copied from the top level
    /// when `text_config` lacks them.
    pub text_config: Value,
    /// MLX quantisation settings from `quantization` (or an mlx-shaped `quantization_config`).
    pub quantization: Option<QuantConfig>,
    pub tensors: Tensors,
    pub tokenizer_config: TokenizerConfig,
    /// generation_config.json (token ids fall back to config.json's).
    pub generation: GenerationConfig,
    /// The tokenizer.json text when it is not a file of the directory (a GGUF's, built from its
    /// metadata); `None`: read [`ModelDir::tokenizer_path`].
    pub tokenizer_json: Option<String>,
    /// How the weights were stored when that is not what [`ModelDir::quantization`] says (a
    /// GGUF's ggml types, e.g. `GGUF Q4_K x 290, Q6_K x 50, F32 x 241`), for banners.
    pub stored_as: Option<String>,
    /// A GGUF's routed experts when they were left in the file ([`GgufExperts::Stream`]): then
    /// [`ModelDir::tensors`] lacks them, and the model runs them only from an expert store
    /// that reads and converts them. Empty otherwise.
    pub streamed_experts: Vec<StreamedExperts>,
}

impl ModelDir {
    /// Opens and validates `path`: config.json and tokenizer.json must exist, and the weights
    /// are memory-mapped and their headers checked (no weight bytes are read). A GGUF file
    /// (recognised by its magic) opens as a model too: see `gguf_model`.
    pub fn open(path: impl AsRef<Path>) -> Result<ModelDir, FormatError> {
        Self::open_with(path, GgufExperts::Convert)
    }

    /// [`ModelDir::open`], with a GGUF's routed experts converted or left in the file as
    /// `experts` says (a directory's tensors are always left in their files).
    pub fn open_with(
        path: impl AsRef<Path>,
        experts: GgufExperts,
    ) -> Result<ModelDir, FormatError> {
        let path = path.as_ref().to_path_buf();
        match std::fs::metadata(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(FormatError::NoDir(path))
            }
            Err(source) => return Err(FormatError::Io { path, source }),
            Ok(m) if m.is_file() && gguf_model::is_gguf(&path) => {
                return gguf_model::open(&path, experts)
            }
            Ok(m) if !m.is_dir() => return Err(FormatError::NotADir(path)),
            Ok(_) => {}
        }
        let config_path = path.join("config.json");
        if !config_path.is_file() {
            return Err(FormatError::MissingFile {
                dir: path,
                name: "config.json".to_string(),
                hint: "is this a Hugging Face model directory? (it must hold config.json, tokenizer.json and *.safetensors weights)".to_string(),
            });
        }
        let config = read_json(&config_path)?;
        let Value::Object(top) = &config else {
            return Err(FormatError::Config {
                path: config_path,
                msg: "expected a JSON object".to_string(),
            });
        };
        let text_config = match top.get("text_config") {
            Some(Value::Object(tc)) => {
                let mut tc = tc.clone();
                for k in TOP_LEVEL_KEYS {
                    if let (false, Some(v)) = (tc.contains_key(k), top.get(k)) {
                        tc.insert(k.to_string(), v.clone());
                    }
                }
                Value::Object(tc)
            }
            _ => config.clone(),
        };
        let quantization = QuantConfig::from_config(&config_path, &text_config)?;
        // Kimi K2 ships a tiktoken file instead (read by sluice-engine's tokenizer).
        if !path.join("tokenizer.json").is_file() && !path.join("tiktoken.model").is_file() {
            return Err(FormatError::MissingFile {
                dir: path,
                name: "tokenizer.json".to_string(),
                hint: "sluice needs the fast-tokenizer file; copy tokenizer.json (or, for Kimi K2, tiktoken.model) from the original model's repository".to_string(),
            });
        }
        let tokenizer_config = TokenizerConfig::read(&path)?;
        let generation = GenerationConfig::read(&path, &text_config)?;
        let tensors = Tensors::open_dir(&path)?;
        Ok(ModelDir {
            path,
            config,
            text_config,
            quantization,
            tensors,
            tokenizer_config,
            generation,
            tokenizer_json: None,
            stored_as: None,
            streamed_experts: Vec::new(),
        })
    }

    /// Whether this model was opened from a GGUF file rather than a directory.
    pub fn is_gguf(&self) -> bool {
        self.tokenizer_json.is_some()
    }

    /// For a GGUF, the files a directory of its converted weights needs beside them (config.json
    /// with the quantisation settings, the tokenizer files, generation_config.json): what `sluice
    /// pack` writes. Empty for a directory (its own files are copied).
    pub fn generated_files(&self) -> Vec<(&'static str, String)> {
        if self.is_gguf() {
            gguf_model::directory_files(self)
        } else {
            Vec::new()
        }
    }

    /// `text_config.model_type`, else the top-level `model_type`.
    pub fn model_type(&self) -> Result<&str, FormatError> {
        self.text_config
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| self.config.get("model_type").and_then(Value::as_str))
            .ok_or_else(|| FormatError::Config {
                path: self.config_path(),
                msg:
                    "no `model_type` string (add the architecture's model_type, e.g. \"qwen3_moe\")"
                        .to_string(),
            })
    }

    pub fn config_path(&self) -> PathBuf {
        self.path.join("config.json")
    }

    /// `path/tokenizer.json` (its existence is checked by [`ModelDir::open`]); a GGUF's own path
    /// (its tokenizer is [`ModelDir::tokenizer_json`]).
    pub fn tokenizer_path(&self) -> PathBuf {
        if self.is_gguf() {
            self.path.clone()
        } else {
            self.path.join("tokenizer.json")
        }
    }

    /// A typed view of [`ModelDir::text_config`], e.g. `dir.parse_config::<Qwen3MoeConfig>()`.
    /// Errors name config.json, the type, serde's complaint and, where it can be found, the key.
    pub fn parse_config<T: DeserializeOwned>(&self) -> Result<T, FormatError> {
        let text = serde_json::to_string_pretty(&self.text_config).unwrap_or_default();
        serde_json::from_str::<T>(&text).map_err(|e| {
            let full = e.to_string();
            let suffix = format!(" at line {} column {}", e.line(), e.column());
            let msg = full.strip_suffix(&suffix).unwrap_or(&full);
            let key = if e.line() > 0 {
                text.lines().nth(e.line() - 1).and_then(key_of_line)
            } else {
                None
            };
            let at = key.map(|k| format!(" (at `{k}`)")).unwrap_or_default();
            let part = if self.config.get("text_config").is_some_and(Value::is_object) {
                "`text_config`"
            } else {
                "the config"
            };
            let ty = std::any::type_name::<T>();
            let ty = ty.split('<').next().unwrap_or(ty);
            let ty = ty.rsplit("::").next().unwrap_or(ty);
            FormatError::Config {
                path: self.config_path(),
                msg: format!("{part} does not fit {ty}: {msg}{at}"),
            }
        })
    }
}

/// The key of a pretty-printed JSON line such as `  "num_experts": "x",`.
fn key_of_line(line: &str) -> Option<String> {
    let rest = line.trim_start().strip_prefix('"')?;
    let mut key = String::new();
    let mut chars = rest.chars();
    loop {
        match chars.next()? {
            '\\' => key.push(chars.next()?),
            '"' => break,
            c => key.push(c),
        }
    }
    chars.as_str().trim_start().starts_with(':').then_some(key)
}

/// Reads and parses a JSON file (errors name the file, and the line for bad JSON).
pub(crate) fn read_json(path: &Path) -> Result<Value, FormatError> {
    let text = std::fs::read_to_string(path).map_err(|source| FormatError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| FormatError::Json {
        path: path.to_path_buf(),
        source,
    })
}

/// [`read_json`], or `None` when the file does not exist.
pub(crate) fn read_json_opt(path: &Path) -> Result<Option<Value>, FormatError> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}
