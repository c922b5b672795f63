//! Loading checks that belong to the models crate: the config against the checkpoint's experts,
//! and the config-only plan.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_format::ModelDir;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// A copy of fixture `name` with `edit` applied to its config.json.
fn edited(name: &str, edit: impl Fn(&mut serde_json::Value)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    tmp
}

#[test]
fn experts_that_disagree_with_the_config_are_a_clear_error() {
    // The router is read first, so a wrong expert count shows there; a wrong expert width in the
    // experts.
    for (key, value, says) in [
        ("num_experts", 16, "mlp.gate"),
        ("moe_intermediate_size", 32, "the config needs"),
    ] {
        let tmp = edited("qwen3_moe-q4", |c| c[key] = value.into());
        let dir = ModelDir::open(tmp.path()).unwrap();
        let err = match sluice_models::load(&dir, Arc::new(CpuBackend::new())) {
            Ok(_) => panic!("{key} = {value} loaded"),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains("model.layers.0.mlp") && err.contains(says),
            "{key}: {err}"
        );
    }
}

#[test]
fn the_config_plan_reads_the_architecture_config() {
    let dir = ModelDir::open(fixture("qwen3_5_moe-q4")).unwrap();
    let plan = sluice_models::config_plan(&dir).unwrap();
    assert!(plan.model_type.starts_with("qwen3_5_moe"), "{plan:?}");
    assert!(plan.experts > 0 && plan.experts_per_token >= 1);
    assert!(plan.experts_per_token <= plan.experts);
    let tmp = edited("qwen3_moe-q4", |c| c["num_experts_per_tok"] = 99.into());
    let err =
        sluice_models::config_plan(&ModelDir::open(tmp.path()).unwrap()).expect_err("k > experts");
    assert!(err.to_string().contains("num_experts_per_tok"), "{err}");
}

#[test]
fn mixtral_configs_load_or_say_what_is_unsupported() {
    let load = |tmp: &tempfile::TempDir| {
        let dir = ModelDir::open(tmp.path()).unwrap();
        sluice_models::load(&dir, Arc::new(CpuBackend::new())).map(|m| m.info().clone())
    };
    // A sliding window shorter than the context caps the context there (full attention within
    // the window is the same numbers); a longer one changes nothing.
    let tmp = edited("mixtral-hf", |c| c["sliding_window"] = 64.into());
    assert_eq!(load(&tmp).unwrap().max_context, 64);
    let tmp = edited("mixtral-hf", |c| {
        c["sliding_window"] = serde_json::Value::Null
    });
    let info = load(&tmp).unwrap();
    assert_eq!((info.max_context, info.experts), (512, 8));
    assert_eq!(info.model_type, "mixtral");
    for (key, value, says) in [
        ("hidden_act", serde_json::json!("gelu"), "hidden_act `gelu`"),
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 4.0}),
            "rope scaling `yarn`",
        ),
        (
            "num_key_value_heads",
            serde_json::json!(3),
            "num_key_value_heads (3)",
        ),
        (
            "num_experts_per_tok",
            serde_json::json!(9),
            "num_local_experts (8)",
        ),
    ] {
        let tmp = edited("mixtral-hf", |c| c[key] = value.clone());
        let err = load(&tmp).expect_err(key).to_string();
        assert!(
            err.contains("config.json") && err.contains(says),
            "{key}: {err}"
        );
    }
    // The router's expert count is checked against the config.
    let tmp = edited("mixtral-q4", |c| c["num_local_experts"] = 16.into());
    let err = load(&tmp).expect_err("16 experts").to_string();
    assert!(err.contains("block_sparse_moe.gate"), "{err}");
}

#[test]
fn glm4_moe_configs_say_what_is_unsupported() {
    let load = |tmp: &tempfile::TempDir| {
        let dir = ModelDir::open(tmp.path()).unwrap();
        sluice_models::load(&dir, Arc::new(CpuBackend::new())).map(|m| m.info().clone())
    };
    for (key, value, says) in [
        (
            "scoring_func",
            serde_json::json!("softmax"),
            "scoring_func `softmax`",
        ),
        ("n_group", serde_json::json!(3), "n_group (3)"),
        ("topk_group", serde_json::json!(5), "topk_group (5)"),
        (
            "partial_rotary_factor",
            serde_json::json!(0.01),
            "partial_rotary_factor",
        ),
        (
            "rope_scaling",
            serde_json::json!({"rope_type": "yarn", "factor": 4.0}),
            "rope scaling `yarn`",
        ),
    ] {
        let tmp = edited("glm4_moe-hf", |c| c[key] = value.clone());
        let err = load(&tmp).expect_err(key).to_string();
        assert!(
            err.contains("config.json") && err.contains(says),
            "{key}: {err}"
        );
    }
    // Without q/k norms configured, the checkpoint's norm weights are not read (and not needed).
    let tmp = edited("glm4_moe-q4", |c| c["use_qk_norm"] = true.into());
    let err = load(&tmp).expect_err("no q_norm").to_string();
    assert!(err.contains("q_norm"), "{err}");
    let info = load(&edited("glm4_moe-hf", |_| {})).unwrap();
    assert_eq!(
        (info.model_type.as_str(), info.layers, info.experts),
        ("glm4_moe", 3, 8)
    );
}

#[test]
fn deepseek_v3_configs_say_what_is_unsupported() {
    let load = |tmp: &tempfile::TempDir| {
        let dir = ModelDir::open(tmp.path()).unwrap();
        sluice_models::load(&dir, Arc::new(CpuBackend::new())).map(|m| m.info().clone())
    };
    let yarn = |mscale: f64, all: f64| {
        serde_json::json!({"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                           "mscale": mscale, "mscale_all_dim": all})
    };
    for (key, value, says) in [
        (
            "topk_method",
            serde_json::json!("greedy"),
            "topk_method `greedy`",
        ),
        ("n_group", serde_json::json!(3), "n_group (3)"),
        (
            "qk_rope_head_dim",
            serde_json::json!(31),
            "qk_rope_head_dim 31",
        ),
        ("attention_bias", serde_json::json!(true), "attention_bias"),
        (
            "rope_scaling",
            yarn(1.0, 0.0),
            "mscale 1 and mscale_all_dim 0",
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "dynamic", "factor": 2.0}),
            "rope scaling `dynamic`",
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 4.0}),
            "original_max_position_embeddings",
        ),
    ] {
        let tmp = edited("deepseek_v3-hf", |c| c[key] = value.clone());
        let err = load(&tmp).expect_err(key).to_string();
        assert!(
            err.contains("config.json") && err.contains(says),
            "{key}: {err}"
        );
    }
    // The query projection the config names is the one read: q_proj without q_lora_rank.
    let tmp = edited("deepseek_v3-hf", |c| {
        c["q_lora_rank"] = serde_json::Value::Null
    });
    let err = load(&tmp).expect_err("no q_proj").to_string();
    assert!(err.contains("q_proj"), "{err}");
    let info = load(&edited("deepseek_v3-q4", |_| {})).unwrap();
    assert_eq!(
        (info.model_type.as_str(), info.layers, info.experts),
        ("kimi_k2", 3, 8)
    );
    // The cache holds one latent head of 32 + 128 values for keys and for values, per layer.
    assert_eq!(info.state_bytes_per_token, 3 * 2 * 160 * 4);
}
