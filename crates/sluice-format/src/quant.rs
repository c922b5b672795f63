//! MLX quantisation settings (`quantization` in an mlx-community config.json).

use std::collections::HashMap;
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::FormatError;

/// The `quantization` object of an MLX checkpoint's config.json, e.g.
/// `{"group_size": 64, "bits": 4, "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantConfig {
    pub bits: u32,
    pub group_size: usize,
    /// `affine` unless the config says otherwise (mlx also knows `mxfp4`, ...).
    pub mode: String,
    /// Per-module entries by module path: `Some((bits, group_size))`, or `None` for `false`
    /// (the module is not quantised).
    pub overrides: HashMap<String, Option<(u32, usize)>>,
    /// The mode of each per-module entry: its `mode`, or `affine` when it names none (mlx's
    /// `to_quantized` default: gpt-oss's `mxfp4` conversions keep the router at 8-bit affine
    /// this way).
    pub override_modes: HashMap<String, String>,
}

impl QuantConfig {
    /// `(bits, group_size)` of the module at `module_path` (e.g. `model.layers.0.mlp.gate`):
    /// its override if there is one (`None` if it is marked not quantised), else the global one.
    pub fn for_module(&self, module_path: &str) -> Option<(u32, usize)> {
        match self.overrides.get(module_path) {
            Some(o) => *o,
            None => Some((self.bits, self.group_size)),
        }
    }

    /// The quantisation mode of the module at `module_path` (`affine`, `mxfp4`, ...).
    pub fn mode_for(&self, module_path: &str) -> &str {
        self.override_modes
            .get(module_path)
            .unwrap_or(&self.mode)
            .as_str()
    }

    /// Reads the quantisation settings from a config object: `quantization`, or else
    /// `quantization_config` when it has the mlx shape (`bits` and `group_size`, no
    /// `quant_method`, which marks other schemes such as GPTQ, AWQ or FP8).
    pub fn from_config(path: &Path, config: &Value) -> Result<Option<QuantConfig>, FormatError> {
        if let Some(Value::Object(q)) = config.get("quantization") {
            return Self::from_object(path, "quantization", q).map(Some);
        }
        if let Some(Value::Object(q)) = config.get("quantization_config") {
            if q.contains_key("bits")
                && q.contains_key("group_size")
                && !q.contains_key("quant_method")
            {
                return Self::from_object(path, "quantization_config", q).map(Some);
            }
        }
        Ok(None)
    }

    fn from_object(
        path: &Path,
        key: &str,
        q: &Map<String, Value>,
    ) -> Result<QuantConfig, FormatError> {
        let err = |msg: String| FormatError::Config {
            path: path.to_path_buf(),
            msg,
        };
        let get_bits = |v: Option<&Value>, what: &str| -> Result<u32, FormatError> {
            match v.and_then(Value::as_u64) {
                Some(b @ 1..=8) => Ok(b as u32),
                _ => Err(err(format!(
                    "`{what}.bits` must be an integer from 1 to 8, found {}",
                    show(v)
                ))),
            }
        };
        let get_group = |v: Option<&Value>, what: &str| -> Result<usize, FormatError> {
            match v.and_then(Value::as_u64) {
                Some(g) if g > 0 => Ok(g as usize),
                _ => Err(err(format!(
                    "`{what}.group_size` must be a positive integer, found {}",
                    show(v)
                ))),
            }
        };
        let bits = get_bits(q.get("bits"), key)?;
        let group_size = get_group(q.get("group_size"), key)?;
        let mode = match q.get("mode") {
            None | Some(Value::Null) => "affine".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(v) => return Err(err(format!("`{key}.mode` must be a string, found {v}"))),
        };
        let mut overrides = HashMap::new();
        let mut override_modes = HashMap::new();
        for (k, v) in q {
            match v {
                Value::Bool(false) => {
                    overrides.insert(k.clone(), None);
                }
                Value::Object(o) => {
                    let what = format!("{key}.{k}");
                    let b = match o.get("bits") {
                        None => bits,
                        v => get_bits(v, &what)?,
                    };
                    let g = match o.get("group_size") {
                        None => group_size,
                        v => get_group(v, &what)?,
                    };
                    overrides.insert(k.clone(), Some((b, g)));
                    let m = match o.get("mode") {
                        None | Some(Value::Null) => "affine".to_string(),
                        Some(Value::String(s)) => s.clone(),
                        Some(v) => {
                            return Err(err(format!("`{what}.mode` must be a string, found {v}")))
                        }
                    };
                    override_modes.insert(k.clone(), m);
                }
                // `true` means "quantised with the global settings"; scalars are settings.
                _ => {}
            }
        }
        Ok(QuantConfig {
            bits,
            group_size,
            mode,
            overrides,
            override_modes,
        })
    }
}

fn show(v: Option<&Value>) -> String {
    match v {
        None => "nothing".to_string(),
        Some(v) => v.to_string(),
    }
}
