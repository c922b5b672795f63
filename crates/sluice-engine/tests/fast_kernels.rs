//! The CPU's fast kernels (`Kernels::Fast`: 4-bit products in integers against activations
//! quantized to 8 bits per 8 values) against its exact ones, in decode (one token per call,
//! through the caches) and prefill (all tokens in one call).
//!
//! - Every reference fixture and the demo model: mean KL divergence of the fast distribution
//!   from the exact one, argmax agreement, and max|diff| against the reference logits.
//! - The demo model (trained): held-out perplexity within 0.5% of the exact path's, in both.
//!
//! The exact path is the one held to the reference implementations (`reference_logits.rs`).
//! These tests bound how far the default for generation moves from it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_cpu::{CpuBackend, Kernels};
use sluice_engine::{npy, Engine, LoadOptions, LogitsMode};

fn load(dir: &Path, kernels: Kernels) -> Engine<CpuBackend> {
    let backend = Arc::new(CpuBackend::with_kernels(kernels));
    Engine::load(dir, backend, &LoadOptions::default())
        .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

#[path = "common/compare.rs"]
mod compare;
use compare::{assert_fast_within_bounds, kl_and_agreement, max_diff_over_max_ref, mean_nll};
// Its suite macro is not used here.
#[allow(unused_macros)]
#[path = "common/reference.rs"]
mod reference;
use reference::{reference_tokens, repo};

const FIXTURES: [&str; 25] = [
    "qwen3_moe-bf16",
    "qwen3_moe-q4",
    "qwen3_moe-q8",
    "qwen3_moe-q4g128",
    "qwen3_moe-hf",
    "qwen3_moe-transformers",
    "qwen3_5_moe-transformers",
    "qwen3_5_moe-bf16",
    "qwen3_5_moe-q4",
    "qwen3_5_moe-q8",
    "qwen3_next-bf16",
    "mixtral-q4",
    "mixtral-hf",
    "mixtral-transformers",
    "glm4_moe-q4",
    "glm4_moe-hf",
    "glm4_moe-transformers",
    "deepseek_v3-q4",
    "deepseek_v3-hf",
    "deepseek_v3-transformers",
    "gpt_oss-q4",
    "gpt_oss-mxfp4",
    "gpt_oss-hf",
    "gpt_oss-transformers",
    "gpt_oss-transformers-dense",
];

#[test]
fn decode_logits_stay_close_to_the_exact_kernels_on_every_fixture() {
    let root = repo();
    let mut cases: Vec<(String, PathBuf, PathBuf)> = FIXTURES
        .iter()
        .map(|f| {
            let d = root.join("tests/fixtures").join(f);
            (f.to_string(), d.clone(), d)
        })
        .collect();
    cases.push((
        "demo".into(),
        root.join("models/demo"),
        root.join("tests/fixtures/demo-reference"),
    ));
    eprintln!(
        "| model | mode | mean KL(exact || fast) | argmax agreement | fast max|diff| / max|ref| |"
    );
    eprintln!("|---|---|---|---|---|");
    let modes = [LogitsMode::Decode, LogitsMode::Prefill];
    for ((name, model, refs), mode) in cases
        .into_iter()
        .flat_map(|c| modes.map(|m| (c.clone(), m)))
    {
        let tokens = reference_tokens(&refs);
        let exact_engine = load(&model, Kernels::Exact);
        let vocab = exact_engine.model.info().vocab_size;
        let exact = exact_engine.logits(&tokens, mode).unwrap();
        let fast = load(&model, Kernels::Fast).logits(&tokens, mode).unwrap();
        let file = match mode {
            LogitsMode::Decode => "logits_decode.npy",
            LogitsMode::Prefill => "logits_prefill.npy",
        };
        let (want, _) = npy::read_f32(&refs.join(file)).unwrap();
        let diff = max_diff_over_max_ref(&fast, &want);
        let (kl, agree) = kl_and_agreement(&exact, &fast, vocab);
        eprintln!(
            "| {name} | {mode:?} | {kl:.2e} | {:.1}% | {:.2e} |",
            agree * 100.0,
            diff
        );
        let q4 = name.contains("q4") || name == "demo";
        if !q4 {
            // No 4-bit weights: the fast kernels are the exact ones.
            assert_eq!(exact, fast, "{name}: fast differs without 4-bit weights");
            continue;
        }
        assert_ne!(exact, fast, "{name}: the fast kernels did not run");
        assert_fast_within_bounds(name == "demo", &format!("{name} {mode:?}"), kl, agree);
    }
}

#[test]
fn demo_model_perplexity_within_half_a_percent_of_the_exact_kernels() {
    for mode in [LogitsMode::Decode, LogitsMode::Prefill] {
        demo_perplexity(mode);
    }
}

fn demo_perplexity(mode: LogitsMode) {
    let dir = repo().join("models/demo");
    let exact = load(&dir, Kernels::Exact);
    let fast = load(&dir, Kernels::Fast);
    let vocab = exact.model.info().vocab_size;
    let heldout = std::fs::read_to_string(dir.join("eval/heldout_text.jsonl")).unwrap();
    let (mut nll_exact, mut nll_fast, mut count) = (0.0, 0.0, 0);
    for line in heldout.lines().filter(|l| !l.trim().is_empty()).take(6) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let mut tokens = exact
            .tokenizer
            .encode(v["text"].as_str().unwrap(), false)
            .unwrap();
        tokens.truncate(192);
        let n = (tokens.len() - 1) as f64;
        let e = exact.logits(&tokens, mode).unwrap();
        let f = fast.logits(&tokens, mode).unwrap();
        nll_exact += mean_nll(&e, &tokens, vocab) * n;
        nll_fast += mean_nll(&f, &tokens, vocab) * n;
        count += tokens.len() - 1;
    }
    let (ppl_exact, ppl_fast) = (
        (nll_exact / count as f64).exp(),
        (nll_fast / count as f64).exp(),
    );
    let change = ppl_fast / ppl_exact - 1.0;
    eprintln!(
        "held-out perplexity over {count} tokens ({mode:?}): exact {ppl_exact:.4}, fast \
         {ppl_fast:.4} ({:+.3}%)",
        change * 100.0
    );
    assert!(
        change.abs() < 0.005,
        "{mode:?}: perplexity moved {:+.3}%",
        change * 100.0
    );
}
