//! A GGUF file opened as a model ([`ModelDir`]) for llama.cpp's `qwen3moe`, `qwen3` (dense), `qwen35moe`,
//! `qwen3next`, `llama` (Mixtral), `gpt-oss`, `glm4moe` and `deepseek2` architectures (the last
//! four in [`crate::gguf_families`]): the Hugging Face config its metadata describes, its tensors under
//! Hugging Face names (llama.cpp's changes to them undone where the model needs it, see
//! [`Transform`]), its tokenizer as a `tokenizer.json`, chat template, stop tokens and sampling
//! defaults. Everything downstream (model code, expert scanner, packing) then
//! reads it like a checkpoint directory.
//!
//! Weights: F32/F16/BF16 tensors are zero-copy views of the map; quantised ggml blocks are
//! converted at open into MLX-affine matrices holding the same values bit for bit
//! ([`crate::ggml_quants`]), in parallel over tensors. That costs memory and, for the K-quants
//! (f32 group scales), about a third more bytes per weight than the file. The routed experts
//! can instead stay in the file ([`GgufExperts`]): an expert store then reads each expert's
//! blocks as stored and converts them into its cache slot, so a GGUF larger than memory runs.
//! Types with no affine form (IQ1-IQ3, TQ, ...) are a one-line error.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde_json::{json, Map, Value};
use sluice_backend::{Dtype, HostBytes, WeightFormat};

use crate::error::FormatError;
use crate::ggml_quants;
use crate::gguf::{GgmlType, GgufFile, GgufTensorInfo, GgufValue};
use crate::gguf_families;
use crate::gguf_tokenizer;
use crate::safetensors::{StDtype, TensorInfo};
use crate::{GenerationConfig, ModelDir, QuantConfig, Tensors, TokenizerConfig};

/// Whether `path` names a GGUF file (by its magic, so any file name works).
pub(crate) fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

/// The architectures whose GGUF files sluice runs, by `general.architecture`.
pub const GGUF_ARCHITECTURES: [&str; 8] = [
    "qwen3moe",
    "qwen3",
    "qwen35moe",
    "qwen3next",
    "llama",
    "gpt-oss",
    "glm4moe",
    "deepseek2",
];

pub(crate) fn open(path: &Path, experts: GgufExperts) -> Result<ModelDir, FormatError> {
    let file = GgufFile::open(path).map_err(|e| FormatError::Config {
        path: e.path,
        msg: e.message,
    })?;
    let err = |msg: String| FormatError::Config {
        path: path.to_path_buf(),
        msg,
    };
    let arch = file
        .architecture()
        .ok_or_else(|| err("no `general.architecture` key: not a model GGUF".into()))?
        .to_string();
    let meta = Meta {
        file: &file,
        arch: &arch,
    };
    let config = match arch.as_str() {
        "qwen3moe" => qwen3moe_config(&meta)?,
        "qwen3" => qwen3_config(&meta)?,
        "qwen35moe" => qwen35moe_config(&meta)?,
        "qwen3next" => qwen3next_config(&meta)?,
        "llama" => gguf_families::mixtral_config(&meta)?,
        "gpt-oss" => gguf_families::gpt_oss_config(&meta)?,
        "glm4moe" => gguf_families::glm4moe_config(&meta)?,
        "deepseek2" => gguf_families::deepseek2_config(&meta)?,
        other => {
            return Err(err(format!(
                "architecture `{other}` is not supported in GGUF files yet (sluice runs {}); \
                 use the model's Hugging Face or MLX checkpoint instead",
                GGUF_ARCHITECTURES.join(", ")
            )))
        }
    };
    let (map, quantization, streamed_experts) = tensors(&file, path, &arch, experts)?;
    let tokenizer_json =
        gguf_tokenizer::tokenizer_json(&file).map_err(|e| FormatError::Config {
            path: e.path,
            msg: e.message,
        })?;
    let (tokenizer_config, generation) = settings(&file)?;
    Ok(ModelDir {
        path: path.to_path_buf(),
        config: config.clone(),
        text_config: config,
        quantization,
        tensors: Tensors::from_map(
            path,
            file.paths().into_iter().map(Path::to_path_buf).collect(),
            map,
        ),
        tokenizer_config,
        generation,
        tokenizer_json: Some(tokenizer_json),
        stored_as: Some(type_counts(&file)),
        streamed_experts,
    })
}

/// How [`ModelDir::open_with`](crate::ModelDir::open_with) treats the routed experts of a GGUF.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GgufExperts {
    /// Converted in memory with every other tensor, to be run resident.
    Convert,
    /// Left in the file as they are stored ([`ModelDir::streamed_experts`]), for an expert store
    /// to read and convert one expert at a time: a GGUF larger than memory runs, and each
    /// expert costs the file's bytes to read.
    Stream,
    /// `Convert` when every converted weight fits in the available memory, else `Stream`.
    #[default]
    Auto,
}

/// One projection of the routed experts of one layer of a GGUF, left in the file
/// ([`GgufExperts::Stream`]): where each expert's blocks are and what they convert to.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamedExperts {
    /// The decoder layer.
    pub layer: usize,
    /// The MoE block's module prefix, e.g. `model.layers.3.mlp`.
    pub prefix: String,
    /// 0, 1, 2: gate, up, down (the order of [`crate::experts::PROJECTIONS`]).
    pub projection: usize,
    pub ggml_type: GgmlType,
    pub rows: usize,
    pub cols: usize,
    /// Index into [`Tensors::files`].
    pub file: usize,
    /// Absolute offset of each expert's blocks in `file` (`bytes_per_expert` each).
    pub offsets: Vec<u64>,
    pub bytes_per_expert: u64,
}

impl StreamedExperts {
    /// The format of an expert's matrix once read: dense types as they are, quantised blocks
    /// as their exact affine form with F32 scales ([`ggml_quants::to_affine_f32`]).
    pub fn format(&self) -> WeightFormat {
        match self.ggml_type.name() {
            "F32" => WeightFormat::Dense(Dtype::F32),
            "F16" => WeightFormat::Dense(Dtype::F16),
            "BF16" => WeightFormat::Dense(Dtype::Bf16),
            _ => ggml_quants::affine_format_f32(self.ggml_type)
                .expect("only types with an affine form are streamed"),
        }
    }

    /// Whether an expert's bytes need converting (not a dense type).
    pub fn converts(&self) -> bool {
        !matches!(self.format(), WeightFormat::Dense(_))
    }

    /// One expert's blocks (`bytes_per_expert` bytes, as read from the file) converted to
    /// [`StreamedExperts::format`].
    pub fn convert(&self, bytes: &[u8]) -> Result<ggml_quants::AffineParts, String> {
        ggml_quants::to_affine_f32(self.ggml_type, bytes, self.rows, self.cols)
    }
}

/// `GGUF Q4_K x 290, Q6_K x 50, F32 x 241`: the file's tensor types, most common first.
fn type_counts(file: &GgufFile) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for t in file.tensors() {
        match counts.iter_mut().find(|c| c.0 == t.ggml_type.name()) {
            Some(c) => c.1 += 1,
            None => counts.push((t.ggml_type.name(), 1)),
        }
    }
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    let list: Vec<String> = counts.iter().map(|(n, c)| format!("{n} x {c}")).collect();
    format!("GGUF {}", list.join(", "))
}

/// Reads `{arch}.*` keys with messages that name the key.
pub(crate) struct Meta<'a> {
    pub(crate) file: &'a GgufFile,
    pub(crate) arch: &'a str,
}

impl Meta<'_> {
    pub(crate) fn err(&self, msg: String) -> FormatError {
        FormatError::Config {
            path: self.file.path().to_path_buf(),
            msg,
        }
    }

    pub(crate) fn value(&self, key: &str) -> Option<&GgufValue> {
        self.file.metadata(&format!("{}.{key}", self.arch))
    }

    pub(crate) fn uint_opt(&self, key: &str) -> Result<Option<usize>, FormatError> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|v| Some(v as usize)).ok_or_else(|| {
                self.err(format!(
                    "`{}.{key}` must be a non-negative integer, found {v}",
                    self.arch
                ))
            }),
        }
    }

    pub(crate) fn uint(&self, key: &str) -> Result<usize, FormatError> {
        self.uint_opt(key)?.ok_or_else(|| {
            self.err(format!(
                "no `{}.{key}` key (a GGUF written by llama.cpp's converter has it)",
                self.arch
            ))
        })
    }

    pub(crate) fn float_opt(&self, key: &str) -> Result<Option<f64>, FormatError> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                self.err(format!("`{}.{key}` must be a number, found {v}", self.arch))
            }),
        }
    }

    pub(crate) fn tensor_dims(&self, name: &str) -> Option<&[u64]> {
        self.file.tensor(name).map(|t| t.dims.as_slice())
    }
}

/// The keys every architecture shares: a Hugging Face config of `model_type` with `layers`
/// decoder layers (vocabulary, width, attention heads, norm epsilon, rotary base, context,
/// whether the embeddings are the output head), and its number of attention heads.
pub(crate) fn base_config(
    m: &Meta,
    model_type: &str,
    architecture: &str,
    layers: usize,
) -> Result<(Map<String, Value>, usize), FormatError> {
    let arch = m.arch;
    let hidden = m.uint("embedding_length")?;
    let heads = m.uint("attention.head_count")?;
    if heads == 0 {
        return Err(m.err(format!("`{arch}.attention.head_count` is 0")));
    }
    let vocab = match m.tensor_dims("token_embd.weight") {
        Some([_, rows]) => *rows as usize,
        _ => {
            return Err(m.err(
                "no 2-D `token_embd.weight` tensor (the token embeddings): incomplete file?".into(),
            ))
        }
    };
    let mut c = Map::new();
    c.insert("model_type".into(), json!(model_type));
    c.insert("architectures".into(), json!([architecture]));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert(
        "num_key_value_heads".into(),
        json!(m.uint_opt("attention.head_count_kv")?.unwrap_or(heads)),
    );
    c.insert(
        "rms_norm_eps".into(),
        json!(m
            .float_opt("attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-6)),
    );
    // llama.cpp's default base when the key is absent.
    c.insert(
        "rope_theta".into(),
        json!(m.float_opt("rope.freq_base")?.unwrap_or(10000.0)),
    );
    if let Some(ctx) = m.uint_opt("context_length")? {
        c.insert("max_position_embeddings".into(), json!(ctx));
    }
    c.insert(
        "tie_word_embeddings".into(),
        json!(m.file.tensor("output.weight").is_none()),
    );
    Ok((c, heads))
}

/// The attention head size: `attention.key_length`, else hidden / heads; checked against
/// `attention.value_length` (these architectures have equal key and value heads).
pub(crate) fn head_dim(
    m: &Meta,
    c: &Map<String, Value>,
    heads: usize,
) -> Result<usize, FormatError> {
    let hidden = c["hidden_size"].as_u64().unwrap_or(0) as usize;
    let key = m
        .uint_opt("attention.key_length")?
        .unwrap_or(hidden / heads);
    match m.uint_opt("attention.value_length")? {
        Some(v) if v != key => Err(m.err(format!(
            "value heads of {v} and key heads of {key}: {} has equal ones",
            m.arch
        ))),
        _ => Ok(key),
    }
}

/// The keys the Qwen MoE architectures share: [`base_config`], the head size, the routed
/// experts. llama.cpp always renormalises the top-k routing weights of these architectures
/// (`norm_topk_prob`).
fn moe_decoder_config(
    m: &Meta,
    model_type: &str,
    architecture: &str,
    layers: usize,
) -> Result<(Map<String, Value>, usize), FormatError> {
    let (mut c, heads) = base_config(m, model_type, architecture, layers)?;
    let head_dim = head_dim(m, &c, heads)?;
    c.insert("head_dim".into(), json!(head_dim));
    c.insert("num_experts".into(), json!(m.uint("expert_count")?));
    c.insert(
        "num_experts_per_tok".into(),
        json!(m.uint("expert_used_count")?),
    );
    c.insert(
        "moe_intermediate_size".into(),
        json!(m.uint("expert_feed_forward_length")?),
    );
    c.insert("norm_topk_prob".into(), json!(true));
    Ok((c, head_dim))
}

/// The Hugging Face `qwen3_moe` config a llama.cpp `qwen3moe` GGUF describes.
fn qwen3moe_config(m: &Meta) -> Result<Value, FormatError> {
    let layers = m.uint("block_count")?;
    let (mut c, _) = moe_decoder_config(m, "qwen3_moe", "Qwen3MoeForCausalLM", layers)?;
    c.insert(
        "intermediate_size".into(),
        json!(m.uint_opt("feed_forward_length")?.unwrap_or(0)),
    );
    if let Some(scaling) = rope_scaling(m)? {
        c.insert("rope_scaling".into(), scaling);
    }
    c.insert("decoder_sparse_step".into(), json!(1));
    Ok(Value::Object(c))
}

/// The Hugging Face `qwen3` config a llama.cpp `qwen3` GGUF describes: the dense Qwen3 models
/// (Qwen3-0.6B ... 32B), llama.cpp's usual draft models of the MoE ones.
fn qwen3_config(m: &Meta) -> Result<Value, FormatError> {
    let layers = m.uint("block_count")?;
    let (mut c, heads) = base_config(m, "qwen3", "Qwen3ForCausalLM", layers)?;
    let head_dim = head_dim(m, &c, heads)?;
    c.insert("head_dim".into(), json!(head_dim));
    c.insert(
        "intermediate_size".into(),
        json!(m.uint("feed_forward_length")?),
    );
    if let Some(scaling) = rope_scaling(m)? {
        c.insert("rope_scaling".into(), scaling);
    }
    Ok(Value::Object(c))
}

/// The Hugging Face `qwen3_5_moe` text config a llama.cpp `qwen35moe` GGUF describes (Qwen3.5
/// MoE: Gated DeltaNet layers and gated full attention). Layers are typed by their tensors (a
/// linear-attention layer has `ssm_a`); the multi-token-prediction layers past
/// `nextn_predict_layers` are left out. llama.cpp stores the DeltaNet's value heads tiled
/// (`linear_value_heads_tiled`).
fn qwen35moe_config(m: &Meta) -> Result<Value, FormatError> {
    deltanet_moe_config(m, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", true)
}

/// The Hugging Face `qwen3_next` config a llama.cpp `qwen3next` GGUF describes (Qwen3-Next, the
/// same network as Qwen3.5 MoE; llama.cpp keeps its DeltaNet value heads grouped as Hugging Face
/// does).
fn qwen3next_config(m: &Meta) -> Result<Value, FormatError> {
    deltanet_moe_config(m, "qwen3_next", "Qwen3NextForCausalLM", false)
}

/// The config of a Gated-DeltaNet MoE file (`qwen35moe`, `qwen3next`); `tiled`: whether the
/// value heads are stored tiled over the key heads (`linear_value_heads_tiled`).
fn deltanet_moe_config(
    m: &Meta,
    model_type: &str,
    architecture: &str,
    tiled: bool,
) -> Result<Value, FormatError> {
    let arch = m.arch;
    let blocks = m.uint("block_count")?;
    let nextn = m.uint_opt("nextn_predict_layers")?.unwrap_or(0);
    let layers = blocks.checked_sub(nextn).ok_or_else(|| {
        m.err(format!(
            "`{arch}.nextn_predict_layers` ({nextn}) exceeds `block_count` ({blocks})"
        ))
    })?;
    let (mut c, head_dim) = moe_decoder_config(m, model_type, architecture, layers)?;
    let (key_heads, value_heads) = (m.uint("ssm.group_count")?, m.uint("ssm.time_step_rank")?);
    let inner = m.uint("ssm.inner_size")?;
    if key_heads == 0 || value_heads == 0 || !value_heads.is_multiple_of(key_heads) {
        return Err(m.err(format!(
            "{value_heads} DeltaNet value heads (`ssm.time_step_rank`) over {key_heads} key heads \
             (`ssm.group_count`): need a whole number of value heads per key head"
        )));
    }
    if !inner.is_multiple_of(value_heads) {
        return Err(m.err(format!(
            "`{arch}.ssm.inner_size` {inner} is not a multiple of {value_heads} value heads"
        )));
    }
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| {
            if m.file.tensor(&format!("blk.{i}.ssm_a")).is_some() {
                "linear_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    let rotary = m.uint_opt("rope.dimension_count")?.unwrap_or(head_dim / 4);
    c.insert(
        "partial_rotary_factor".into(),
        json!(rotary as f64 / head_dim as f64),
    );
    c.insert("linear_num_key_heads".into(), json!(key_heads));
    c.insert("linear_num_value_heads".into(), json!(value_heads));
    c.insert(
        "linear_key_head_dim".into(),
        json!(m.uint("ssm.state_size")?),
    );
    c.insert("linear_value_head_dim".into(), json!(inner / value_heads));
    c.insert(
        "linear_conv_kernel_dim".into(),
        json!(m.uint("ssm.conv_kernel")?),
    );
    c.insert("linear_value_heads_tiled".into(), json!(tiled));
    c.insert("layer_types".into(), json!(layer_types));
    c.insert(
        "shared_expert_intermediate_size".into(),
        json!(m.uint("expert_shared_feed_forward_length")?),
    );
    c.insert("attn_output_gate".into(), json!(true));
    Ok(Value::Object(c))
}

/// `rope.scaling.*` as a Hugging Face `rope_scaling` object (`None` when absent or `none`).
pub(crate) fn rope_scaling(m: &Meta) -> Result<Option<Value>, FormatError> {
    let kind = match m.value("rope.scaling.type") {
        None => return Ok(None),
        Some(v) => v.as_str().unwrap_or("").to_string(),
    };
    match kind.as_str() {
        "" | "none" => Ok(None),
        "linear" | "yarn" => {
            let factor = m.float_opt("rope.scaling.factor")?.unwrap_or(1.0);
            let mut s = Map::new();
            s.insert("rope_type".into(), json!(kind));
            s.insert("type".into(), json!(kind));
            s.insert("factor".into(), json!(factor));
            if let Some(orig) = m.uint_opt("rope.scaling.original_context_length")? {
                s.insert("original_max_position_embeddings".into(), json!(orig));
            }
            for (key, hf) in [
                ("rope.scaling.yarn_beta_fast", "beta_fast"),
                ("rope.scaling.yarn_beta_slow", "beta_slow"),
            ] {
                if let Some(v) = m.float_opt(key)? {
                    s.insert(hf.into(), json!(v));
                }
            }
            Ok(Some(Value::Object(s)))
        }
        other => Err(m.err(format!(
            "rope scaling `{other}` (`{}.rope.scaling.type`) is not supported",
            m.arch
        ))),
    }
}

/// What a GGUF tensor needs beyond renaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transform {
    None,
    /// llama.cpp stores a DeltaNet's `A = -exp(A_log)`; the model reads `A_log = ln(-A)`.
    NegExpInverse,
    /// A 1-D `[n]` tensor the model reads as the matrix `[1, n]` (the shared expert's gate).
    Row,
}

/// Where a GGUF tensor goes: the Hugging Face module (its tensor is `{module}.weight`, or
/// `module` itself for the DeltaNet's bare parameters), stacked experts as mlx's `switch_mlp`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    module: String,
    /// Whether the Hugging Face name ends in `.weight` (a quantised tensor can only be such).
    weight: bool,
    transform: Transform,
}

/// The [`Target`] of llama.cpp tensor `name` in a file of architecture `arch`; `Ok(None)` for a
/// tensor sluice does not use (multi-token prediction, rope frequencies), `Err` for a layout it
/// cannot run.
fn hf_target(
    name: &str,
    arch: &str,
    file: &GgufFile,
    layers: usize,
) -> Result<Option<Target>, String> {
    let target = |module: String, weight: bool, transform: Transform| {
        Ok(Some(Target {
            module,
            weight,
            transform,
        }))
    };
    match name {
        "token_embd.weight" => return target("model.embed_tokens".into(), true, Transform::None),
        "output_norm.weight" => return target("model.norm".into(), true, Transform::None),
        "output.weight" => return target("lm_head".into(), true, Transform::None),
        _ => {}
    }
    let Some((layer, rest)) = name
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(l, r)| Some((l.parse::<usize>().ok()?, r)))
    else {
        return Ok(None);
    };
    if layer >= layers {
        // A multi-token-prediction block (`nextn_predict_layers`), which sluice does not run.
        return Ok(None);
    }
    let module = |m: &str| format!("model.layers.{layer}.{m}");
    if let Some((m, weight)) = gguf_families::layer_target(arch, rest) {
        return target(module(m), weight, Transform::None);
    }
    let common = match rest {
        "attn_norm.weight" => Some("input_layernorm"),
        "attn_q.weight" => Some("self_attn.q_proj"),
        "attn_k.weight" => Some("self_attn.k_proj"),
        "attn_v.weight" => Some("self_attn.v_proj"),
        "attn_output.weight" => Some("self_attn.o_proj"),
        "attn_q_norm.weight" => Some("self_attn.q_norm"),
        "attn_k_norm.weight" => Some("self_attn.k_norm"),
        "ffn_gate_inp.weight" => Some("mlp.gate"),
        "ffn_gate_exps.weight" => Some("mlp.switch_mlp.gate_proj"),
        "ffn_up_exps.weight" => Some("mlp.switch_mlp.up_proj"),
        "ffn_down_exps.weight" => Some("mlp.switch_mlp.down_proj"),
        // A dense FFN layer (none in these MoE checkpoints, kept for `mlp_only_layers`).
        "ffn_gate.weight" => Some("mlp.gate_proj"),
        "ffn_up.weight" => Some("mlp.up_proj"),
        "ffn_down.weight" => Some("mlp.down_proj"),
        _ => None,
    };
    if let Some(m) = common {
        return target(module(m), true, Transform::None);
    }
    match (arch, rest) {
        ("qwen3moe" | "qwen3", "ffn_norm.weight") => {
            target(module("post_attention_layernorm"), true, Transform::None)
        }
        ("qwen35moe" | "qwen3next", _) => {
            let linear = file.tensor(&format!("blk.{layer}.ssm_a")).is_some();
            let (m, weight, transform) = match rest {
                // Qwen3-Next's fused projections, rows interleaved per key head as Hugging Face
                // has them: b and a always; q/k/v/z in files before llama.cpp split them.
                "ssm_ba.weight" if arch == "qwen3next" => {
                    ("linear_attn.in_proj_ba", true, Transform::None)
                }
                "ssm_in.weight" if arch == "qwen3next" => {
                    ("linear_attn.in_proj_qkvz", true, Transform::None)
                }
                "post_attention_norm.weight" => ("post_attention_layernorm", true, Transform::None),
                "attn_qkv.weight" if !linear => {
                    return Err(format!(
                        "`{name}`: fused q/k/v in a full-attention layer (convert_hf_to_gguf.py \
                         --fuse-qkv) is not supported yet: convert the model without that option"
                    ))
                }
                "attn_qkv.weight" => ("linear_attn.in_proj_qkv", true, Transform::None),
                "attn_gate.weight" => ("linear_attn.in_proj_z", true, Transform::None),
                "ssm_beta.weight" => ("linear_attn.in_proj_b", true, Transform::None),
                "ssm_alpha.weight" => ("linear_attn.in_proj_a", true, Transform::None),
                "ssm_conv1d.weight" => ("linear_attn.conv1d", true, Transform::None),
                "ssm_dt.bias" => ("linear_attn.dt_bias", false, Transform::None),
                "ssm_a" => ("linear_attn.A_log", false, Transform::NegExpInverse),
                "ssm_norm.weight" => ("linear_attn.norm", true, Transform::None),
                "ssm_out.weight" => ("linear_attn.out_proj", true, Transform::None),
                "ffn_gate_inp_shexp.weight" => ("mlp.shared_expert_gate", true, Transform::Row),
                "ffn_gate_shexp.weight" => ("mlp.shared_expert.gate_proj", true, Transform::None),
                "ffn_up_shexp.weight" => ("mlp.shared_expert.up_proj", true, Transform::None),
                "ffn_down_shexp.weight" => ("mlp.shared_expert.down_proj", true, Transform::None),
                _ => return Ok(None),
            };
            target(module(m), weight, transform)
        }
        _ => Ok(None),
    }
}

/// The decoder layers a model runs: `block_count` less the multi-token-prediction blocks that
/// llama.cpp appends after them (`nextn_predict_layers`). The config has checked both keys.
fn trunk_layers(file: &GgufFile, arch: &str) -> usize {
    let key = |k: &str| {
        file.metadata(&format!("{arch}.{k}"))
            .and_then(GgufValue::as_u64)
            .unwrap_or(0) as usize
    };
    key("block_count").saturating_sub(key("nextn_predict_layers"))
}

/// `ln(-a)` of each f32 of llama.cpp's `ssm_a` (rounded once from f64), or why not.
fn a_log_of(bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(bytes.len());
    for c in bytes.chunks_exact(4) {
        let a = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        if a.is_nan() || a >= 0.0 {
            return Err(format!(
                "holds {a}: llama.cpp stores -exp(A_log), which is negative"
            ));
        }
        out.extend_from_slice(&((-(a as f64)).ln() as f32).to_le_bytes());
    }
    Ok(out)
}

type TensorsOfFile = (
    BTreeMap<String, TensorInfo>,
    Option<QuantConfig>,
    Vec<StreamedExperts>,
);

/// Every tensor under its Hugging Face name: dense ones as views of the map, quantised ones
/// converted to affine (`.weight` codes, `.scales`, `.biases`), with the per-module quantisation
/// settings the converted shapes need; the routed experts instead left in the file when
/// `experts` says so.
fn tensors(
    file: &GgufFile,
    path: &Path,
    arch: &str,
    experts: GgufExperts,
) -> Result<TensorsOfFile, FormatError> {
    let err = |t: &GgufTensorInfo, msg: String| FormatError::Tensor {
        name: t.name.clone(),
        file: path.to_path_buf(),
        msg,
    };
    let mut map = BTreeMap::new();
    let paths = file.paths();
    // `offset` is the data's place in file `part` of the set, or `IN_MEMORY` for converted
    // bytes.
    let mut add = |name: String, dtype, shape, bytes, offset, part: usize| {
        let info = TensorInfo {
            name: name.clone(),
            dtype,
            shape,
            file: paths[part].to_path_buf(),
            bytes,
            offset,
        };
        map.insert(name, info);
    };
    // ggml lists the contiguous dimension first.
    let shape_of =
        |t: &GgufTensorInfo| -> Vec<usize> { t.dims.iter().rev().map(|&d| d as usize).collect() };
    let available = sluice_sys::mem_available_bytes();
    // Decided from the tensor table, before the fused stacks would be copied: when the experts
    // stream, nothing of them is read now.
    let stream = match experts {
        GgufExperts::Convert => false,
        GgufExperts::Stream => true,
        GgufExperts::Auto => memory_shortfall(conversion_bytes(file), available).is_some(),
    };
    let mut pieces = pieces(file, !stream).map_err(|(t, msg)| err(t, msg))?;
    if arch == "llama" {
        gguf_families::undo_llama_permute(file, &mut pieces).map_err(|(name, msg)| {
            FormatError::Tensor {
                name,
                file: path.to_path_buf(),
                msg,
            }
        })?;
    }
    let mut quantised: Vec<(&Piece, String)> = Vec::new();
    // The routed experts' stacks: (piece, module, prefix, projection), decided on below.
    let mut expert_pieces: Vec<(&Piece, String, String, usize)> = Vec::new();
    let layers = trunk_layers(file, arch);
    for piece in &pieces {
        let t = &piece.info;
        let Some(target) = hf_target(&t.name, arch, file, layers).map_err(|msg| err(t, msg))?
        else {
            continue;
        };
        let module = target.module;
        if let Some((prefix, projection)) = expert_projection(&module) {
            if target.weight && target.transform == Transform::None {
                if !(dense_type(t.ggml_type) || ggml_quants::has_affine_form(t.ggml_type)) {
                    return Err(err(t, unsupported_type(t.ggml_type)));
                }
                expert_pieces.push((piece, module.clone(), prefix, projection));
                continue;
            }
        }
        let dtype = match t.ggml_type.name() {
            "F32" => Some(StDtype::F32),
            "F16" => Some(StDtype::F16),
            "BF16" => Some(StDtype::BF16),
            _ => None,
        };
        let name = if target.weight {
            format!("{module}.weight")
        } else {
            module.clone()
        };
        match (dtype, target.transform) {
            (Some(StDtype::F32), Transform::NegExpInverse) => {
                let bytes = a_log_of(piece.bytes(file)).map_err(|msg| err(t, msg))?;
                add(
                    name,
                    StDtype::F32,
                    shape_of(t),
                    HostBytes::from_vec(bytes),
                    TensorInfo::IN_MEMORY,
                    0,
                )
            }
            (_, Transform::NegExpInverse) => {
                return Err(err(t, format!("is {}, expected F32", t.ggml_type.name())))
            }
            (Some(dtype), transform) => {
                let mut shape = shape_of(t);
                if transform == Transform::Row && shape.len() == 1 {
                    shape.insert(0, 1);
                }
                let (bytes, offset, part) = piece.host_bytes(file);
                add(name, dtype, shape, bytes, offset, part)
            }
            (None, _) if !target.weight || target.transform != Transform::None => {
                return Err(err(
                    t,
                    format!(
                        "is quantised ({}), which llama.cpp never does to this tensor",
                        t.ggml_type.name()
                    ),
                ))
            }
            (None, _) => {
                if !ggml_quants::has_affine_form(t.ggml_type) {
                    return Err(err(t, unsupported_type(t.ggml_type)));
                }
                quantised.push((piece, module));
            }
        }
    }
    let mut streamed = Vec::new();
    for (piece, module, prefix, projection) in expert_pieces {
        let t = &piece.info;
        if stream {
            streamed.push(streamed_experts(piece, prefix, projection).map_err(|m| err(t, m))?);
        } else if dense_type(t.ggml_type) {
            let dtype = match t.ggml_type.name() {
                "F32" => StDtype::F32,
                "F16" => StDtype::F16,
                _ => StDtype::BF16,
            };
            let (bytes, offset, part) = piece.host_bytes(file);
            add(
                format!("{module}.weight"),
                dtype,
                shape_of(t),
                bytes,
                offset,
                part,
            );
        } else {
            quantised.push((piece, module));
        }
    }
    let need: u64 = quantised
        .iter()
        .map(|(p, _)| converted_bytes(&p.info))
        .sum();
    if let Some(msg) = memory_shortfall(need, available) {
        return Err(FormatError::Config {
            path: path.to_path_buf(),
            msg,
        });
    }
    let converted =
        convert_all(file, &quantised).map_err(|(i, msg)| err(&quantised[i].0.info, msg))?;
    let mut overrides = HashMap::new();
    let mut first = None;
    for ((piece, module), parts) in quantised.iter().zip(converted) {
        let t = &piece.info;
        let WeightFormat::Affine {
            bits,
            group_size,
            scale_dtype,
        } = parts.format
        else {
            return Err(err(t, "converted to a dense format".into()));
        };
        first.get_or_insert((bits, group_size));
        overrides.insert(module.clone(), Some((bits, group_size)));
        let dims = shape_of(t);
        let (lead, cols) = dims.split_at(dims.len() - 1);
        let cols = cols[0];
        let st_scale = match scale_dtype {
            Dtype::F32 => StDtype::F32,
            Dtype::F16 => StDtype::F16,
            Dtype::Bf16 => StDtype::BF16,
        };
        let with_last = |last: usize| {
            let mut s = lead.to_vec();
            s.push(last);
            s
        };
        let parts_list = [
            (
                "weight",
                StDtype::U32,
                with_last(cols * bits as usize / 32),
                parts.data,
            ),
            (
                "scales",
                st_scale,
                with_last(cols / group_size),
                parts.scales,
            ),
            (
                "biases",
                st_scale,
                with_last(cols / group_size),
                parts.biases,
            ),
        ];
        for (suffix, dtype, shape, bytes) in parts_list {
            add(
                format!("{module}.{suffix}"),
                dtype,
                shape,
                HostBytes::from_vec(bytes),
                TensorInfo::IN_MEMORY,
                0,
            );
        }
    }
    let quant = first.map(|(bits, group_size)| QuantConfig {
        bits,
        group_size,
        mode: "affine".to_string(),
        overrides,
        override_modes: Default::default(),
    });
    Ok((map, quant, streamed))
}

/// A tensor as the model reads it: one of the file's, or one half of a fused one.
pub(crate) struct Piece {
    pub(crate) info: GgufTensorInfo,
    /// The piece's bytes when they are not one range of the file (copied out of a fused tensor,
    /// or rows put back in order).
    pub(crate) owned: Option<Vec<u8>>,
    /// For a half of a fused gate/up stack: which half (0 gate, 1 up), and where in the file
    /// each expert's rows of it are.
    fused: Option<Vec<u64>>,
}

impl Piece {
    pub(crate) fn bytes<'a>(&'a self, file: &'a GgufFile) -> &'a [u8] {
        match &self.owned {
            Some(b) => b,
            None => file.tensor_bytes(&self.info),
        }
    }

    /// The bytes as the tensor map holds them, with their offset and file: a view of the map
    /// where the piece is a range of the file.
    fn host_bytes(&self, file: &GgufFile) -> (HostBytes, u64, usize) {
        match &self.owned {
            Some(b) => (HostBytes::from_vec(b.clone()), TensorInfo::IN_MEMORY, 0),
            None => (
                file.tensor_host_bytes(&self.info),
                self.info.offset,
                self.info.part,
            ),
        }
    }
}

/// The file's tensors as the model reads them: each as it is, except the experts' gate and up
/// projections fused into one tensor (`blk.N.ffn_gate_up_exps`, written by
/// `convert_hf_to_gguf.py --fuse-gate-up-exps`: per expert, the gate's rows then the up's,
/// `[cols, 2 x rows, experts]`), which become the `ffn_gate_exps` and `ffn_up_exps` they were
/// made from (the same rows, copied unless `copy` is false: streamed experts are read where
/// they are).
fn pieces(file: &GgufFile, copy: bool) -> Result<Vec<Piece>, (&GgufTensorInfo, String)> {
    let mut out = Vec::with_capacity(file.tensors().len() + 1);
    for t in file.tensors() {
        let Some(layer) = t
            .name
            .strip_prefix("blk.")
            .and_then(|r| r.strip_suffix(".ffn_gate_up_exps.weight"))
        else {
            out.push(Piece {
                info: t.clone(),
                owned: None,
                fused: None,
            });
            continue;
        };
        let [cols, rows2, experts] = t.dims[..] else {
            let msg = format!(
                "has dimensions {:?}, expected [cols, 2 x rows, experts]",
                t.dims
            );
            return Err((t, msg));
        };
        if rows2 % 2 != 0 {
            return Err((
                t,
                format!("has {rows2} rows per expert: not gate and up halves"),
            ));
        }
        let names = [
            format!("blk.{layer}.ffn_gate_exps.weight"),
            format!("blk.{layer}.ffn_up_exps.weight"),
        ];
        if let Some(both) = names.iter().find(|n| file.tensor(n).is_some()) {
            return Err((
                t,
                format!("the file also has {both}: fused and separate experts at once"),
            ));
        }
        let rows = rows2 / 2;
        let row_bytes = (cols / t.ggml_type.block_elements() * t.ggml_type.block_bytes()) as usize;
        let half = rows as usize * row_bytes;
        let bytes = file.tensor_bytes(t);
        for (k, name) in names.into_iter().enumerate() {
            let starts: Vec<usize> = (0..experts as usize).map(|e| (2 * e + k) * half).collect();
            // Streamed experts are read from the file where they are: no copy.
            let owned = copy.then(|| {
                let mut owned = Vec::with_capacity(half * experts as usize);
                for &start in &starts {
                    owned.extend_from_slice(&bytes[start..start + half]);
                }
                owned
            });
            out.push(Piece {
                info: GgufTensorInfo {
                    name,
                    dims: vec![cols, rows, experts],
                    bytes: (half * experts as usize) as u64,
                    ..t.clone()
                },
                owned,
                fused: Some(starts.iter().map(|&s| t.offset + s as u64).collect()),
            });
        }
    }
    Ok(out)
}

/// Why converting `need` bytes of weights cannot work with `available` bytes of memory, if it
/// cannot: a clear error instead of the kernel's out-of-memory kill halfway through.
fn memory_shortfall(need: u64, available: Option<u64>) -> Option<String> {
    let available = available?;
    let gb = |b: u64| b as f64 / 1e9;
    (need > available).then(|| {
        format!(
            "converting its quantised blocks takes ~{:.1} GB of memory and {:.1} GB is available \
             (sluice holds a GGUF's weights converted in memory, all but the routed experts when \
             they stream from the file), so it needs a machine where they fit",
            gb(need),
            gb(available)
        )
    })
}

/// Bytes of `t` converted to its affine form (0 for a dense tensor, a view of the file).
fn converted_bytes(t: &GgufTensorInfo) -> u64 {
    match ggml_quants::affine_bits_per_weight(t.ggml_type) {
        Some(bits) => (t.elements() as f64 * bits / 8.0) as u64,
        None => 0,
    }
}

/// Bytes of every quantised tensor of `file` converted (those the model does not use too: an
/// upper bound).
fn conversion_bytes(file: &GgufFile) -> u64 {
    file.tensors().iter().map(converted_bytes).sum()
}

/// Whether `ty` is a float type, read as it is.
fn dense_type(ty: GgmlType) -> bool {
    matches!(ty.name(), "F32" | "F16" | "BF16")
}

fn unsupported_type(ty: GgmlType) -> String {
    format!(
        "ggml type {} is not supported yet (sluice runs F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, \
         Q8_0, Q2_K..Q6_K, IQ4_NL, IQ4_XS and MXFP4; re-quantize the model with llama-quantize \
         to one of them)",
        ty.name()
    )
}

/// The MoE block prefix and projection index of a routed-expert stack's module
/// (`model.layers.3.mlp.switch_mlp.up_proj` is `("model.layers.3.mlp", 1)`).
fn expert_projection(module: &str) -> Option<(String, usize)> {
    let (prefix, projection) = module.split_once(".switch_mlp.")?;
    let p = crate::experts::PROJECTIONS
        .iter()
        .position(|&n| n == projection)?;
    Some((prefix.to_string(), p))
}

/// Where each expert of a `[cols, rows, experts]` stack lies in the file.
fn streamed_experts(
    piece: &Piece,
    prefix: String,
    projection: usize,
) -> Result<StreamedExperts, String> {
    let t = &piece.info;
    let [cols, rows, experts] = t.dims[..] else {
        return Err(format!(
            "has dimensions {:?}, expected [cols, rows, experts]",
            t.dims
        ));
    };
    let layer = prefix
        .strip_prefix("model.layers.")
        .and_then(|r| r.split('.').next())
        .and_then(|l| l.parse().ok())
        .ok_or_else(|| format!("`{prefix}` is not a decoder layer"))?;
    let bytes_per_expert = t.bytes / experts.max(1);
    let offsets = match &piece.fused {
        Some(starts) => starts.clone(),
        None => (0..experts)
            .map(|e| t.offset + e * bytes_per_expert)
            .collect(),
    };
    Ok(StreamedExperts {
        layer,
        prefix,
        projection,
        ggml_type: t.ggml_type,
        rows: rows as usize,
        cols: cols as usize,
        file: t.part,
        offsets,
        bytes_per_expert,
    })
}

/// Converts the quantised tensors, several at a time (a tensor per task, largest first).
fn convert_all(
    file: &GgufFile,
    tensors: &[(&Piece, String)],
) -> Result<Vec<ggml_quants::AffineParts>, (usize, String)> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(tensors[i].0.info.bytes));
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<Result<ggml_quants::AffineParts, String>>>> =
        Mutex::new((0..tensors.len()).map(|_| None).collect());
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(tensors.len().max(1));
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&i) = order.get(k) else { break };
                    let piece = tensors[i].0;
                    let t = &piece.info;
                    let cols = t.dims[0] as usize;
                    let rows = (t.elements() / t.dims[0].max(1)) as usize;
                    let r = ggml_quants::to_affine(t.ggml_type, piece.bytes(file), rows, cols);
                    results.lock().unwrap_or_else(|e| e.into_inner())[i] = Some(r);
                })
            })
            .collect();
        // Joined here, not left to the scope's end, which waits for the closures but not for
        // the threads to exit: LeakSanitizer (the gguf fuzz target) reported the memory of
        // threads still exiting as leaked. A panicked conversion leaves its tensor unconverted.
        for worker in workers {
            let _ = worker.join();
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .into_iter()
        .enumerate()
        .map(|(i, r)| match r {
            Some(Ok(p)) => Ok(p),
            Some(Err(e)) => Err((i, e)),
            None => Err((i, "not converted".to_string())),
        })
        .collect()
}

/// Token texts, chat template, stop tokens and sampling defaults from `tokenizer.*` and
/// `general.sampling.*`. Stop tokens: `eos_token_id`, `eot_token_id`, `eom_token_id`, and the
/// control tokens llama.cpp also ends a generation on (`<|im_end|>`, `<|endoftext|>`, ...).
fn settings(file: &GgufFile) -> Result<(TokenizerConfig, GenerationConfig), FormatError> {
    let id = |key: &str| {
        file.metadata(&format!("tokenizer.ggml.{key}"))
            .and_then(GgufValue::as_u64)
            .map(|v| v as u32)
    };
    let tokens: Vec<&str> = file
        .metadata("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_array)
        .map(|a| a.iter().map(|v| v.as_str().unwrap_or("")).collect())
        .unwrap_or_default();
    let text = |id: Option<u32>| {
        id.and_then(|i| tokens.get(i as usize))
            .map(|s| s.to_string())
    };
    let flag = |key: &str| {
        matches!(
            file.metadata(&format!("tokenizer.ggml.{key}")),
            Some(GgufValue::Bool(true))
        )
    };
    let (bos, eos) = (id("bos_token_id"), id("eos_token_id"));
    let tc = TokenizerConfig {
        eos_token: text(eos),
        bos_token: text(bos),
        pad_token: text(id("padding_token_id")),
        add_bos_token: flag("add_bos_token"),
        chat_template: file
            .metadata("tokenizer.chat_template")
            .and_then(GgufValue::as_str)
            .map(str::to_string),
    };
    let mut stops: Vec<u32> = [eos, id("eot_token_id"), id("eom_token_id")]
        .into_iter()
        .flatten()
        .collect();
    // llama.cpp's list of end-of-generation texts (llama-vocab.cpp, `special_eog_ids`).
    const EOG_TEXTS: [&str; 8] = [
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<｜end▁of▁sentence｜>",
        "<|return|>",
    ];
    for (i, t) in tokens.iter().enumerate() {
        if EOG_TEXTS.contains(t) && !stops.contains(&(i as u32)) {
            stops.push(i as u32);
        }
    }
    let sampling = |key: &str| {
        file.metadata(&format!("general.sampling.{key}"))
            .and_then(GgufValue::as_f64)
    };
    let g = GenerationConfig {
        eos_token_id: stops,
        bos_token_id: bos,
        temperature: sampling("temp").map(|v| v as f32),
        top_p: sampling("top_p").map(|v| v as f32),
        top_k: sampling("top_k").filter(|&k| k > 0.0).map(|k| k as usize),
        min_p: sampling("min_p").map(|v| v as f32),
        repetition_penalty: sampling("penalty_repeat").map(|v| v as f32),
    };
    Ok((tc, g))
}

/// The files a directory holding this GGUF's converted weights needs beside them (what `sluice
/// pack` writes): config.json with the quantisation settings of the converted tensors,
/// tokenizer.json, tokenizer_config.json and generation_config.json.
pub(crate) fn directory_files(dir: &ModelDir) -> Vec<(&'static str, String)> {
    let mut config = dir.text_config.clone();
    if let (Some(q), Value::Object(c)) = (&dir.quantization, &mut config) {
        let mut o = Map::new();
        o.insert("bits".into(), json!(q.bits));
        o.insert("group_size".into(), json!(q.group_size));
        let mut modules: Vec<_> = q.overrides.iter().collect();
        modules.sort_by(|a, b| a.0.cmp(b.0));
        for (module, setting) in modules {
            o.insert(
                module.clone(),
                match setting {
                    Some((bits, group_size)) => json!({"bits": bits, "group_size": group_size}),
                    None => json!(false),
                },
            );
        }
        c.insert("quantization".into(), Value::Object(o));
    }
    let tc = &dir.tokenizer_config;
    let mut t = Map::new();
    for (key, value) in [
        ("bos_token", &tc.bos_token),
        ("eos_token", &tc.eos_token),
        ("pad_token", &tc.pad_token),
        ("chat_template", &tc.chat_template),
    ] {
        if let Some(v) = value {
            t.insert(key.into(), json!(v));
        }
    }
    t.insert("add_bos_token".into(), json!(tc.add_bos_token));
    let g = &dir.generation;
    let mut gen = Map::new();
    gen.insert("eos_token_id".into(), json!(g.eos_token_id));
    if let Some(b) = g.bos_token_id {
        gen.insert("bos_token_id".into(), json!(b));
    }
    for (key, v) in [
        ("temperature", g.temperature),
        ("top_p", g.top_p),
        ("min_p", g.min_p),
        ("repetition_penalty", g.repetition_penalty),
    ] {
        if let Some(v) = v {
            gen.insert(key.into(), json!(v));
        }
    }
    if let Some(k) = g.top_k {
        gen.insert("top_k".into(), json!(k));
    }
    let pretty = |v: &Value| serde_json::to_string_pretty(v).expect("JSON values serialise");
    let mut files = vec![
        ("config.json", pretty(&config)),
        ("tokenizer_config.json", pretty(&Value::Object(t))),
        ("generation_config.json", pretty(&Value::Object(gen))),
    ];
    if let Some(tok) = &dir.tokenizer_json {
        files.push(("tokenizer.json", tok.clone()));
    }
    files
}

#[cfg(test)]
mod tests {
    use crate::gguf::tests::{s, Writer};
    use crate::ModelDir;

    const U32: u32 = 4;
    const STRING: u32 = 8;

    fn u32v(v: u32) -> Vec<u8> {
        v.to_le_bytes().to_vec()
    }

    /// The metadata and the one tensor a qwen3moe config needs, without tokenizer or weights.
    fn qwen3moe() -> Writer {
        Writer::new()
            .kv("qwen3moe.embedding_length", U32, u32v(64))
            .kv("qwen3moe.block_count", U32, u32v(1))
            .kv("qwen3moe.attention.head_count", U32, u32v(2))
            .kv("qwen3moe.expert_count", U32, u32v(2))
            .kv("qwen3moe.expert_used_count", U32, u32v(1))
            .kv("qwen3moe.expert_feed_forward_length", U32, u32v(32))
            .tensor("token_embd.weight", &[64, 4], 0, vec![0; 64 * 4 * 4])
    }

    /// `w` written as `m.gguf` in a new temporary directory (kept alive by the caller).
    fn written(w: &Writer) -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        std::fs::write(&path, w.bytes()).unwrap();
        (dir, path)
    }

    fn open_error(w: &Writer) -> String {
        let (_dir, path) = written(w);
        let e = ModelDir::open(&path)
            .expect_err("must not open")
            .to_string();
        assert!(!e.contains('\n'), "one line: {e}");
        assert!(e.contains("m.gguf"), "names the file: {e}");
        e
    }

    #[test]
    fn unsupported_files_are_one_line_errors() {
        let mut w = Writer::new();
        w.kv = vec![("general.architecture".into(), STRING, s("falcon"))];
        let e = open_error(&w);
        assert!(
            e.contains("`falcon` is not supported") && e.contains("qwen3moe"),
            "{e}"
        );

        let e = open_error(&qwen3moe().kv("split.count", 2, 3u16.to_le_bytes().to_vec()));
        assert!(
            e.contains("split") && e.contains("llama-gguf-split --merge"),
            "{e}"
        );

        let mut w = qwen3moe();
        w.kv.retain(|(k, _, _)| k != "qwen3moe.expert_count");
        let e = open_error(&w);
        assert!(e.contains("`qwen3moe.expert_count`"), "{e}");

        // IQ2_XXS (id 16, 66 bytes per 256 values): no affine form.
        let e = open_error(&qwen3moe().tensor("blk.0.attn_q.weight", &[256, 2], 16, vec![0; 132]));
        assert!(
            e.contains("blk.0.attn_q.weight")
                && e.contains("IQ2_XXS")
                && e.contains("llama-quantize"),
            "{e}"
        );
    }

    /// `arch`'s keys for a one-layer model of width 64 with 2 heads, and its embeddings.
    fn base(arch: &str) -> Writer {
        let mut w = Writer::new();
        w.kv = vec![("general.architecture".into(), STRING, s(arch))];
        w.kv(&format!("{arch}.embedding_length"), U32, u32v(64))
            .kv(&format!("{arch}.block_count"), U32, u32v(1))
            .kv(&format!("{arch}.attention.head_count"), U32, u32v(2))
            .tensor("token_embd.weight", &[64, 4], 0, vec![0; 64 * 4 * 4])
    }

    #[test]
    fn families_llama_cpp_writes_otherwise_are_one_line_errors() {
        // A dense Llama, and a Mixtral in llama.cpp's pre-2024 one-tensor-per-expert layout.
        let e = open_error(&base("llama"));
        assert!(
            e.contains("dense Llama") && e.contains("mixture-of-experts"),
            "{e}"
        );
        let legacy = base("llama").kv("llama.expert_count", U32, u32v(2)).tensor(
            "blk.0.ffn_gate.0.weight",
            &[64, 2],
            0,
            vec![0; 64 * 2 * 4],
        );
        let e = open_error(&legacy);
        assert!(
            e.contains("blk.N.ffn_gate.E.weight") && e.contains("convert_hf_to_gguf"),
            "{e}"
        );

        // DeepSeek-V2's softmax router, and a sigmoid one without its selection bias.
        let mla_keys = |w: Writer, key_length: u32| {
            w.kv("deepseek2.attention.kv_lora_rank", U32, u32v(32))
                .kv("deepseek2.rope.dimension_count", U32, u32v(16))
                .kv("deepseek2.attention.key_length_mla", U32, u32v(key_length))
                .kv("deepseek2.attention.value_length_mla", U32, u32v(32))
                .kv("deepseek2.expert_count", U32, u32v(4))
                .kv("deepseek2.expert_used_count", U32, u32v(2))
                .kv("deepseek2.expert_feed_forward_length", U32, u32v(32))
        };
        let mla = |w: Writer| mla_keys(w, 48);
        let e =
            open_error(&mla(base("deepseek2")).kv("deepseek2.expert_gating_func", U32, u32v(1)));
        assert!(
            e.contains("softmax") && e.contains("expert_gating_func"),
            "{e}"
        );
        let e =
            open_error(&mla(base("deepseek2")).kv("deepseek2.expert_gating_func", U32, u32v(2)));
        assert!(e.contains("exp_probs_b"), "{e}");
        // Keys without position of no width.
        let w = mla_keys(base("deepseek2"), 16).kv("deepseek2.expert_gating_func", U32, u32v(2));
        let e = open_error(&w);
        assert!(e.contains("key_length_mla"), "{e}");
    }

    /// A qwen35moe file's metadata (one DeltaNet key head, two value heads) and embeddings.
    fn qwen35moe() -> Writer {
        let mut w = Writer::new();
        w.kv = vec![("general.architecture".into(), STRING, s("qwen35moe"))];
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        w.kv("qwen35moe.embedding_length", U32, u32v(64))
            .kv("qwen35moe.block_count", U32, u32v(2))
            .kv("qwen35moe.attention.head_count", U32, u32v(2))
            .kv("qwen35moe.ssm.group_count", U32, u32v(1))
            .kv("qwen35moe.ssm.time_step_rank", U32, u32v(2))
            .kv("qwen35moe.ssm.inner_size", U32, u32v(64))
            .kv("qwen35moe.ssm.state_size", U32, u32v(32))
            .kv("qwen35moe.ssm.conv_kernel", U32, u32v(4))
            .kv("qwen35moe.expert_count", U32, u32v(2))
            .kv("qwen35moe.expert_used_count", U32, u32v(1))
            .kv("qwen35moe.expert_feed_forward_length", U32, u32v(32))
            .kv("qwen35moe.expert_shared_feed_forward_length", U32, u32v(32))
            .tensor("token_embd.weight", &[64, 4], 0, vec![0; 64 * 4 * 4])
            .tensor("blk.0.ssm_a", &[2], 0, f32s(&[-0.5, -2.0]))
    }

    #[test]
    fn qwen35moe_layouts_it_cannot_run_are_one_line_errors() {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        // Fused gate and up experts that cannot be halves of each expert's rows.
        let e = open_error(&qwen35moe().tensor(
            "blk.0.ffn_gate_up_exps.weight",
            &[64, 63, 2],
            0,
            vec![0; 64 * 63 * 2 * 4],
        ));
        assert!(
            e.contains("ffn_gate_up_exps") && e.contains("63 rows per expert"),
            "{e}"
        );
        let e = open_error(
            &qwen35moe()
                .tensor(
                    "blk.0.ffn_gate_exps.weight",
                    &[64, 32, 2],
                    0,
                    vec![0; 64 * 32 * 2 * 4],
                )
                .tensor(
                    "blk.0.ffn_gate_up_exps.weight",
                    &[64, 64, 2],
                    0,
                    vec![0; 64 * 64 * 2 * 4],
                ),
        );
        assert!(e.contains("fused and separate"), "{e}");
        // Layer 1 has no ssm_a: a full-attention layer, where attn_qkv is a fused q/k/v.
        let e = open_error(&qwen35moe().tensor(
            "blk.1.attn_qkv.weight",
            &[64, 4],
            0,
            vec![0; 64 * 4 * 4],
        ));
        assert!(
            e.contains("blk.1.attn_qkv") && e.contains("--fuse-qkv"),
            "{e}"
        );
        let mut w = qwen35moe();
        w.tensors.retain(|t| t.0 != "blk.0.ssm_a");
        let e = open_error(&w.tensor("blk.0.ssm_a", &[2], 0, f32s(&[-0.5, 0.25])));
        assert!(e.contains("blk.0.ssm_a") && e.contains("negative"), "{e}");
        let mut w = qwen35moe();
        w.kv.retain(|(k, _, _)| k != "qwen35moe.ssm.group_count");
        let e = open_error(&w.kv("qwen35moe.ssm.group_count", U32, u32v(4)));
        assert!(e.contains("whole number of value heads"), "{e}");
    }

    /// Published Qwen3.5 GGUFs carry a multi-token-prediction block after the decoder layers
    /// (`nextn_predict_layers`): it is not a layer of the model, and its tensors are left out.
    #[test]
    fn qwen35moe_config_leaves_the_prediction_block_out() {
        let mut w = qwen35moe();
        w.kv.retain(|(k, _, _)| k != "qwen35moe.block_count");
        let w = w
            .kv("qwen35moe.block_count", U32, u32v(3))
            .kv("qwen35moe.nextn_predict_layers", U32, u32v(1))
            .kv("qwen35moe.attention.key_length", U32, u32v(64))
            .kv("qwen35moe.rope.dimension_count", U32, u32v(16))
            .tensor(
                "blk.2.ffn_gate_exps.weight",
                &[64, 32, 2],
                0,
                vec![0; 64 * 32 * 2 * 4],
            );
        let (_dir, path) = written(&w);
        let file = crate::gguf::GgufFile::open(&path).unwrap();
        let c = super::qwen35moe_config(&super::Meta {
            file: &file,
            arch: "qwen35moe",
        })
        .unwrap();
        assert_eq!(c["model_type"], "qwen3_5_moe_text");
        assert_eq!(c["num_hidden_layers"], 2);
        assert_eq!(
            c["layer_types"],
            serde_json::json!(["linear_attention", "full_attention"])
        );
        assert_eq!(c["linear_num_key_heads"], 1);
        assert_eq!(c["linear_num_value_heads"], 2);
        assert_eq!(c["linear_value_head_dim"], 32);
        assert_eq!(c["linear_value_heads_tiled"], true);
        assert_eq!(c["partial_rotary_factor"], 0.25);
        assert_eq!(super::trunk_layers(&file, "qwen35moe"), 2);
        let t = |n: &str| super::hf_target(n, "qwen35moe", &file, 2).unwrap();
        assert_eq!(t("blk.2.ffn_gate_exps.weight"), None);
        assert_eq!(
            t("blk.1.ffn_gate_exps.weight").map(|t| t.module),
            Some("model.layers.1.mlp.switch_mlp.gate_proj".to_string())
        );
        let a = t("blk.0.ssm_a").unwrap();
        assert_eq!(
            (a.module.as_str(), a.weight, a.transform),
            (
                "model.layers.0.linear_attn.A_log",
                false,
                super::Transform::NegExpInverse
            )
        );
    }

    #[test]
    fn qwen3next_keeps_the_value_heads_grouped_and_the_fused_projections() {
        // The same keys under `qwen3next`.
        let mut w = qwen35moe();
        for (k, _, v) in &mut w.kv {
            if let Some(rest) = k.strip_prefix("qwen35moe.") {
                *k = format!("qwen3next.{rest}");
            } else if k == "general.architecture" {
                *v = s("qwen3next");
            }
        }
        let (_dir, path) = written(&w);
        let file = crate::gguf::GgufFile::open(&path).unwrap();
        let c = super::qwen3next_config(&super::Meta {
            file: &file,
            arch: "qwen3next",
        })
        .unwrap();
        assert_eq!(c["model_type"], "qwen3_next");
        assert_eq!(c["linear_value_heads_tiled"], false);
        assert_eq!(c["linear_num_value_heads"], 2);
        assert_eq!(
            c["layer_types"],
            serde_json::json!(["linear_attention", "full_attention"])
        );
        let module = |n: &str, arch: &str| {
            super::hf_target(n, arch, &file, 2)
                .unwrap()
                .map(|t| t.module)
        };
        assert_eq!(
            module("blk.0.ssm_ba.weight", "qwen3next").as_deref(),
            Some("model.layers.0.linear_attn.in_proj_ba")
        );
        assert_eq!(
            module("blk.0.ssm_in.weight", "qwen3next").as_deref(),
            Some("model.layers.0.linear_attn.in_proj_qkvz")
        );
        assert_eq!(
            module("blk.0.attn_qkv.weight", "qwen3next").as_deref(),
            Some("model.layers.0.linear_attn.in_proj_qkv")
        );
        // Qwen3.5 files have no fused b/a: not mapped there.
        assert_eq!(module("blk.0.ssm_ba.weight", "qwen35moe"), None);
    }

    #[test]
    fn a_log_is_the_log_of_minus_a() {
        let bytes: Vec<u8> = [-1.0f32, -0.5]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let out = super::a_log_of(&bytes).unwrap();
        let v: Vec<f32> = out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(v, vec![0.0, (0.5f64).ln() as f32]);
    }

    #[test]
    fn conversion_larger_than_memory_is_refused_up_front() {
        assert_eq!(super::memory_shortfall(10, Some(10)), None);
        assert_eq!(super::memory_shortfall(10, None), None);
        let e = super::memory_shortfall(25_100_000_000, Some(14_200_000_000)).unwrap();
        assert!(
            e.contains("~25.1 GB") && e.contains("14.2 GB is available"),
            "{e}"
        );
    }

    #[test]
    fn config_comes_from_the_metadata() {
        let w = qwen3moe()
            .kv("qwen3moe.attention.head_count_kv", U32, u32v(1))
            .kv("qwen3moe.rope.freq_base", 6, 5e5f32.to_le_bytes().to_vec())
            .kv("tokenizer.ggml.model", STRING, s("gpt2"));
        let (_dir, path) = written(&w);
        // No tokenizer vocabulary: the error is about it, after the config was read.
        let e = ModelDir::open(&path).unwrap_err().to_string();
        assert!(e.contains("tokenizer"), "{e}");
        let file = crate::gguf::GgufFile::open(&path).unwrap();
        let c = super::qwen3moe_config(&super::Meta {
            file: &file,
            arch: "qwen3moe",
        })
        .unwrap();
        assert_eq!(c["model_type"], "qwen3_moe");
        assert_eq!(c["hidden_size"], 64);
        assert_eq!(c["vocab_size"], 4);
        assert_eq!(c["num_key_value_heads"], 1);
        assert_eq!(c["head_dim"], 32);
        assert_eq!(c["rope_theta"], 5e5);
        assert_eq!(c["norm_topk_prob"], true);
        // No output.weight: the embeddings are the output head.
        assert_eq!(c["tie_word_embeddings"], true);
    }
}
