//! sluice's logits against the reference implementations' fp32 logits on the tiny checkpoints in
//! `tests/fixtures/`, on the CPU backend (the suite itself is `common/reference.rs`, which the
//! CUDA backend's tests run too).

use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::{npy, Engine, LoadOptions, LogitsMode};

#[path = "common/reference.rs"]
#[macro_use]
mod reference;

use reference::{fixture, reference_tokens, RELATIVE_TOLERANCE};

reference_suite!(Arc::new(CpuBackend::new()));

/// A tied model uses its embeddings as the output head even when a (different) `lm_head` tensor
/// is stored, as mlx-lm (whose sanitize drops it) and transformers (which ties it) do.
#[test]
fn tied_model_ignores_a_stray_lm_head() {
    use sluice_format::{write_safetensors, StDtype};
    let src = fixture("qwen3_moe-q8");
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["tie_word_embeddings"], true, "fixture must be tied");
    let (vocab, hidden) = (
        config["vocab_size"].as_u64().unwrap() as usize,
        config["hidden_size"].as_u64().unwrap() as usize,
    );
    // A dense f32 head of ones: far from the embeddings, so using it would change every logit.
    let head: Vec<u8> = (0..vocab * hidden)
        .flat_map(|_| 1f32.to_le_bytes())
        .collect();
    let shard = "extra.safetensors";
    write_safetensors(
        &tmp.path().join(shard),
        &[(
            "lm_head.weight".into(),
            StDtype::F32,
            vec![vocab, hidden],
            &head,
        )],
        None,
    )
    .unwrap();
    let index_path = tmp.path().join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    index["weight_map"]["lm_head.weight"] = shard.into();
    std::fs::write(&index_path, index.to_string()).unwrap();

    let engine = Engine::load(
        tmp.path(),
        Arc::new(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .unwrap();
    let tokens = reference_tokens(&src);
    let (want, _) = npy::read_f32(&src.join("logits_prefill.npy")).unwrap();
    let got = engine.logits(&tokens, LogitsMode::Prefill).unwrap();
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(
        max_diff <= RELATIVE_TOLERANCE * max_ref,
        "stray lm_head was used: max|diff| {max_diff} vs max|ref| {max_ref}"
    );
}
