//! The GGUF architectures beyond Qwen's: llama.cpp's `llama` (Mixtral: a Llama with routed
//! experts), `gpt-oss`, `glm4moe` (GLM-4.5/4.6/4.7) and `deepseek2` (DeepSeek-V3/R1, Kimi K2):
//! the Hugging Face config each file's metadata describes, where its tensors go, and the one
//! layout change llama.cpp's converter makes to them that the model cannot read as is.
//!
//! What the converter (`convert_hf_to_gguf.py`, `conversion/{llama,gpt_oss,glm,deepseek}.py`)
//! changes, and how it is read back:
//! - `llama`: the rows of `attn_q` and `attn_k` are permuted within each head from Hugging
//!   Face's rotate-half order to llama.cpp's adjacent pairs; [`undo_llama_permute`] puts them
//!   back (whole rows, so quantised blocks move as they are).
//! - `gpt-oss`: the released interleaved `gate_up_proj` is split into `ffn_gate_exps` and
//!   `ffn_up_exps` (and their biases); the router is `ffn_gate_inp`, the sinks `attn_sinks`.
//!   Nothing to undo: the split stacks are what mlx's layout holds.
//! - `deepseek2`: `kv_b_proj` is split into `attn_k_b` (each head's key half, transposed to
//!   `[kv_lora_rank, qk_nope_head_dim]`) and `attn_v_b` (`[v_head_dim, kv_lora_rank]`), which
//!   are exactly mlx-lm's `embed_q` and `unembed_out`, read as such. Files from before that split
//!   hold `attn_kv_b` (`kv_b_proj`). The key and value lengths are written for MLA's absorbed
//!   form (`key_length` = `kv_lora_rank + qk_rope_head_dim`); the per-head ones are
//!   `key_length_mla` / `value_length_mla`.
//! - `glm4moe`: nothing (its q/k rows are already in rotate-half order, which llama.cpp's NEOX
//!   rope reads).
//!
//! Multi-token-prediction blocks (`nextn_predict_layers`, after the decoder's) are not run.

use serde_json::{json, Map, Value};

use crate::error::FormatError;
use crate::gguf::GgufFile;
use crate::gguf_model::{base_config, head_dim, rope_scaling, Meta, Piece};

/// The Hugging Face `mixtral` config of a llama.cpp `llama` file with routed experts.
pub(crate) fn mixtral_config(m: &Meta) -> Result<Value, FormatError> {
    let experts = m.uint_opt("expert_count")?.unwrap_or(0);
    if experts == 0 {
        return Err(m.err(
            "a dense Llama (no `llama.expert_count`): sluice runs mixture-of-experts models only"
                .into(),
        ));
    }
    if m.file.tensor("blk.0.ffn_gate.0.weight").is_some() {
        return Err(m.err(
            "experts stored one tensor per expert (`blk.N.ffn_gate.E.weight`, llama.cpp's layout \
             before 2024): convert the model again with a current convert_hf_to_gguf.py, which \
             stacks them (`ffn_gate_exps`)"
                .into(),
        ));
    }
    if m.file.tensor("rope_freqs.weight").is_some() {
        return Err(m.err(
            "per-frequency rope factors (`rope_freqs.weight`, Llama 3.1's rope scaling) are not \
             supported"
                .into(),
        ));
    }
    let layers = m.uint("block_count")?;
    let (mut c, heads) = base_config(m, "mixtral", "MixtralForCausalLM", layers)?;
    let head_dim = head_dim(m, &c, heads)?;
    c.insert("head_dim".into(), json!(head_dim));
    c.insert(
        "intermediate_size".into(),
        json!(match m.uint_opt("expert_feed_forward_length")? {
            Some(n) => n,
            None => m.uint("feed_forward_length")?,
        }),
    );
    c.insert("num_local_experts".into(), json!(experts));
    c.insert(
        "num_experts_per_tok".into(),
        json!(m.uint("expert_used_count")?),
    );
    c.insert("rms_norm_eps".into(), json!(rms_eps(m, 1e-5)?));
    if let Some(scaling) = rope_scaling(m)? {
        c.insert("rope_scaling".into(), scaling);
    }
    Ok(Value::Object(c))
}

/// The Hugging Face `gpt_oss` config of a llama.cpp `gpt-oss` file. Layers alternate a sliding
/// window and full attention, the first sliding (llama.cpp's pattern and the released
/// config's); YaRN as released, whose `truncate: false` GGUF does not record.
pub(crate) fn gpt_oss_config(m: &Meta) -> Result<Value, FormatError> {
    let layers = m.uint("block_count")?;
    let (mut c, heads) = base_config(m, "gpt_oss", "GptOssForCausalLM", layers)?;
    c.insert("head_dim".into(), json!(head_dim(m, &c, heads)?));
    c.insert(
        "intermediate_size".into(),
        json!(match m.uint_opt("expert_feed_forward_length")? {
            Some(n) => n,
            None => m.uint("feed_forward_length")?,
        }),
    );
    c.insert("num_local_experts".into(), json!(m.uint("expert_count")?));
    c.insert(
        "num_experts_per_tok".into(),
        json!(m.uint("expert_used_count")?),
    );
    c.insert("rms_norm_eps".into(), json!(rms_eps(m, 1e-5)?));
    c.insert(
        "sliding_window".into(),
        json!(m.uint("attention.sliding_window")?),
    );
    let types: Vec<&str> = (0..layers)
        .map(|i| match i % 2 {
            0 => "sliding_attention",
            _ => "full_attention",
        })
        .collect();
    c.insert("layer_types".into(), json!(types));
    if let Some(mut scaling) = rope_scaling(m)? {
        if let Value::Object(s) = &mut scaling {
            s.insert("truncate".into(), json!(false));
        }
        c.insert("rope_scaling".into(), scaling);
    }
    Ok(Value::Object(c))
}

/// The Hugging Face `glm4_moe` config of a llama.cpp `glm4moe` file (GLM-4.5 and later):
/// sigmoid routing with a selection bias, shared experts, `leading_dense_block_count` dense
/// layers first, partial rotary, q/k norms and q/k/v biases where the file has their tensors.
pub(crate) fn glm4moe_config(m: &Meta) -> Result<Value, FormatError> {
    let layers = trunk(m)?;
    let (mut c, heads) = base_config(m, "glm4_moe", "Glm4MoeForCausalLM", layers)?;
    let head_dim = head_dim(m, &c, heads)?;
    c.insert("head_dim".into(), json!(head_dim));
    let rotary = m.uint_opt("rope.dimension_count")?.unwrap_or(head_dim / 2);
    c.insert(
        "partial_rotary_factor".into(),
        json!(rotary as f64 / head_dim as f64),
    );
    c.insert(
        "use_qk_norm".into(),
        json!(m.file.tensor("blk.0.attn_q_norm.weight").is_some()),
    );
    c.insert(
        "attention_bias".into(),
        json!(m.file.tensor("blk.0.attn_q.bias").is_some()),
    );
    c.insert("rms_norm_eps".into(), json!(rms_eps(m, 1e-5)?));
    sigmoid_moe(m, &mut c, "glm4moe")?;
    if let Some(scaling) = rope_scaling(m)? {
        c.insert("rope_scaling".into(), scaling);
    }
    Ok(Value::Object(c))
}

/// The Hugging Face `deepseek_v3` config of a llama.cpp `deepseek2` file with the sigmoid
/// router (DeepSeek-V3, R1, V3.1, Kimi K2). Multi-head Latent Attention's sizes come from
/// `kv_lora_rank`, `q_lora_rank`, `rope.dimension_count` and `key_length_mla` /
/// `value_length_mla` (or, in files from before MLA was absorbed, `key_length` /
/// `value_length`); the rotary is interleaved (llama.cpp's normal rope, as DeepSeek's own
/// code) and YaRN's `mscale_all_dim` is `rope.scaling.yarn_log_multiplier / 0.1` (the
/// converter writes `0.1 x mscale_all_dim`), with `mscale` taken equal to it as in every
/// released DeepSeek-V3 config.
pub(crate) fn deepseek2_config(m: &Meta) -> Result<Value, FormatError> {
    let layers = trunk(m)?;
    let (mut c, heads) = base_config(m, "deepseek_v3", "DeepseekV3ForCausalLM", layers)?;
    // MLA is written as multi-query attention; the Hugging Face config counts its heads.
    c.insert("num_key_value_heads".into(), json!(heads));
    let lora = m.uint("attention.kv_lora_rank")?;
    let rope = m.uint("rope.dimension_count")?;
    let (key, value) = match m.uint_opt("attention.key_length_mla")? {
        Some(k) => (k, m.uint("attention.value_length_mla")?),
        None => (
            m.uint("attention.key_length")?,
            m.uint("attention.value_length")?,
        ),
    };
    if key <= rope {
        return Err(m.err(format!(
            "query/key heads of {key} values hold no part without position beside the {rope} \
             rotated ones (`deepseek2.attention.key_length_mla`, `rope.dimension_count`)"
        )));
    }
    c.insert("kv_lora_rank".into(), json!(lora));
    c.insert(
        "q_lora_rank".into(),
        json!(m.uint_opt("attention.q_lora_rank")?),
    );
    c.insert("qk_rope_head_dim".into(), json!(rope));
    c.insert("qk_nope_head_dim".into(), json!(key - rope));
    c.insert("v_head_dim".into(), json!(value));
    c.insert("rope_interleave".into(), json!(true));
    c.insert("rms_norm_eps".into(), json!(rms_eps(m, 1e-6)?));
    sigmoid_moe(m, &mut c, "deepseek2")?;
    if let Some(mut scaling) = rope_scaling(m)? {
        if let (Value::Object(s), Some(mul)) = (
            &mut scaling,
            m.float_opt("rope.scaling.yarn_log_multiplier")?,
        ) {
            // Rounded: the key holds 0.1 x mscale_all_dim in f32.
            let mscale = (mul / 0.1 * 1e6).round() / 1e6;
            s.insert("mscale".into(), json!(mscale));
            s.insert("mscale_all_dim".into(), json!(mscale));
        }
        c.insert("rope_scaling".into(), scaling);
    }
    Ok(Value::Object(c))
}

/// The decoder layers: `block_count` less the multi-token-prediction blocks after them.
fn trunk(m: &Meta) -> Result<usize, FormatError> {
    let blocks = m.uint("block_count")?;
    let nextn = m.uint_opt("nextn_predict_layers")?.unwrap_or(0);
    blocks.checked_sub(nextn).ok_or_else(|| {
        m.err(format!(
            "`{}.nextn_predict_layers` ({nextn}) exceeds `block_count` ({blocks})",
            m.arch
        ))
    })
}

fn rms_eps(m: &Meta, default: f64) -> Result<f64, FormatError> {
    Ok(m.float_opt("attention.layer_norm_rms_epsilon")?
        .unwrap_or(default))
}

/// The routed and shared experts of a `noaux_tc` sigmoid router (DeepSeek-V3's, GLM-4.5's):
/// counts, widths, groups, scaling and renormalisation as llama.cpp records them
/// (`expert_weights_norm` absent means false, as llama.cpp reads it).
fn sigmoid_moe(m: &Meta, c: &mut Map<String, Value>, arch: &str) -> Result<(), FormatError> {
    match m.uint_opt("expert_gating_func")? {
        // 2: sigmoid; absent in glm4moe files, whose router llama.cpp always takes as sigmoid.
        Some(2) => {}
        None if arch == "glm4moe" => {}
        other => {
            let what = match other {
                None | Some(1) => "softmax (DeepSeek-V2's router)".to_string(),
                Some(n) => format!("type {n}"),
            };
            return Err(m.err(format!(
                "expert gating function {what} (`{arch}.expert_gating_func`) is not supported: \
                 sluice runs the sigmoid router with a selection bias (DeepSeek-V3, GLM-4.5)"
            )));
        }
    }
    if m.file.tensor(&first_moe_bias(m)?).is_none() {
        return Err(m.err(
            "the sigmoid router has no selection bias (`blk.N.exp_probs_b.bias`): incomplete \
             file?"
                .into(),
        ));
    }
    c.insert(
        "intermediate_size".into(),
        json!(m.uint_opt("feed_forward_length")?.unwrap_or(0)),
    );
    c.insert(
        "moe_intermediate_size".into(),
        json!(m.uint("expert_feed_forward_length")?),
    );
    c.insert("n_routed_experts".into(), json!(m.uint("expert_count")?));
    c.insert(
        "num_experts_per_tok".into(),
        json!(m.uint("expert_used_count")?),
    );
    c.insert(
        "n_shared_experts".into(),
        json!(m.uint_opt("expert_shared_count")?.unwrap_or(0)),
    );
    c.insert(
        "first_k_dense_replace".into(),
        json!(m.uint_opt("leading_dense_block_count")?.unwrap_or(0)),
    );
    c.insert(
        "n_group".into(),
        json!(m.uint_opt("expert_group_count")?.unwrap_or(1)),
    );
    c.insert(
        "topk_group".into(),
        json!(m.uint_opt("expert_group_used_count")?.unwrap_or(1)),
    );
    c.insert(
        "routed_scaling_factor".into(),
        json!(m.float_opt("expert_weights_scale")?.unwrap_or(1.0)),
    );
    let norm = matches!(
        m.value("expert_weights_norm"),
        Some(crate::gguf::GgufValue::Bool(true))
    );
    c.insert("norm_topk_prob".into(), json!(norm));
    c.insert("scoring_func".into(), json!("sigmoid"));
    c.insert("topk_method".into(), json!("noaux_tc"));
    Ok(())
}

/// The selection bias of the first sparse layer (`exp_probs_b.bias`).
fn first_moe_bias(m: &Meta) -> Result<String, FormatError> {
    let dense = m.uint_opt("leading_dense_block_count")?.unwrap_or(0);
    Ok(format!("blk.{dense}.exp_probs_b.bias"))
}

/// Where layer tensor `rest` (the name after `blk.N.`) of an `arch` file goes, for the tensors
/// whose place differs from Qwen's: `(module under the layer, whether the Hugging Face name
/// adds `.weight`)`. `None`: the shared table decides.
pub(crate) fn layer_target(arch: &str, rest: &str) -> Option<(&'static str, bool)> {
    let moved = |m: &'static str, weight: bool| Some((m, weight));
    let bias = |rest: &str| -> Option<&'static str> {
        Some(match rest {
            "attn_q.bias" => "self_attn.q_proj.bias",
            "attn_k.bias" => "self_attn.k_proj.bias",
            "attn_v.bias" => "self_attn.v_proj.bias",
            "attn_output.bias" => "self_attn.o_proj.bias",
            _ => return None,
        })
    };
    match arch {
        "llama" => match rest {
            "ffn_norm.weight" => moved("post_attention_layernorm", true),
            r => bias(r).and_then(|b| moved(b, false)),
        },
        "gpt-oss" => match rest {
            "post_attention_norm.weight" => moved("post_attention_layernorm", true),
            "attn_sinks.weight" => moved("self_attn.sinks", false),
            "ffn_gate_inp.weight" => moved("mlp.router", true),
            "ffn_gate_inp.bias" => moved("mlp.router.bias", false),
            "ffn_gate_exps.bias" => moved("mlp.experts.gate_proj.bias", false),
            "ffn_up_exps.bias" => moved("mlp.experts.up_proj.bias", false),
            "ffn_down_exps.bias" => moved("mlp.experts.down_proj.bias", false),
            r => bias(r).and_then(|b| moved(b, false)),
        },
        "glm4moe" | "deepseek2" => match rest {
            "post_attention_norm.weight" | "ffn_norm.weight" => {
                moved("post_attention_layernorm", true)
            }
            "exp_probs_b.bias" => moved("mlp.gate.e_score_correction_bias", false),
            "ffn_gate_shexp.weight" => moved("mlp.shared_experts.gate_proj", true),
            "ffn_up_shexp.weight" => moved("mlp.shared_experts.up_proj", true),
            "ffn_down_shexp.weight" => moved("mlp.shared_experts.down_proj", true),
            "attn_q_a.weight" => moved("self_attn.q_a_proj", true),
            "attn_q_a_norm.weight" => moved("self_attn.q_a_layernorm", true),
            "attn_q_b.weight" => moved("self_attn.q_b_proj", true),
            "attn_kv_a_mqa.weight" => moved("self_attn.kv_a_proj_with_mqa", true),
            "attn_kv_a_norm.weight" => moved("self_attn.kv_a_layernorm", true),
            "attn_kv_b.weight" => moved("self_attn.kv_b_proj", true),
            "attn_k_b.weight" => moved("self_attn.embed_q", true),
            "attn_v_b.weight" => moved("self_attn.unembed_out", true),
            r => bias(r).and_then(|b| moved(b, false)),
        },
        _ => None,
    }
}

/// Undoes the row permutation llama.cpp's `llama` converter applies to `attn_q` and `attn_k`
/// (weights and biases): within each head, Hugging Face row `i * d/2 + j` (`i` in 0..2, `j` in
/// 0..d/2) was stored at row `2j + i`. Rows are moved whole, so a quantised tensor's blocks move
/// as they are. `Err((tensor, message))` for a tensor whose rows do not split into the heads.
pub(crate) fn undo_llama_permute(
    file: &GgufFile,
    pieces: &mut [Piece],
) -> Result<(), (String, String)> {
    let key = |k: &str| {
        file.metadata(&format!("llama.attention.{k}"))
            .and_then(crate::gguf::GgufValue::as_u64)
    };
    let heads = key("head_count").unwrap_or(0) as usize;
    let kv_heads = key("head_count_kv").map_or(heads, |h| h as usize);
    for piece in pieces.iter_mut() {
        let name = piece.info.name.clone();
        let Some(rest) = name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .map(|(_, r)| r)
        else {
            continue;
        };
        let n = match rest {
            "attn_q.weight" | "attn_q.bias" => heads,
            "attn_k.weight" | "attn_k.bias" => kv_heads,
            _ => continue,
        };
        let t = &piece.info;
        let ty = t.ggml_type;
        let (rows, row_bytes) = match t.dims[..] {
            [cols, rows] => (rows, cols / ty.block_elements() * ty.block_bytes()),
            [rows] if ty.block_elements() == 1 => (rows, ty.block_bytes()),
            _ => return Err((name, format!("has dimensions {:?}", t.dims))),
        };
        let (rows, row_bytes) = (rows as usize, row_bytes as usize);
        if n == 0 || !rows.is_multiple_of(2 * n) {
            return Err((
                name,
                format!("has {rows} rows, which do not split into {n} heads of pairs"),
            ));
        }
        let d = rows / n;
        let src = piece.bytes(file);
        let mut out = Vec::with_capacity(rows * row_bytes);
        for h in 0..n {
            for i in 0..2 {
                for j in 0..d / 2 {
                    let from = (h * d + 2 * j + i) * row_bytes;
                    out.extend_from_slice(&src[from..from + row_bytes]);
                }
            }
        }
        piece.owned = Some(out);
    }
    Ok(())
}
