//! The GPU's fast kernels (products with 4- and 8-bit weights against activations quantized to 8
//! bits: `CudaBackend::with_fast_kernels`, many tokens per 32 columns on integer tensor cores;
//! `with_fast_decode`, one token of 4-bit weights per 16 columns with dp4a) against the exact
//! kernels on CUDA device 0, in prefill (all tokens in one call) and in decode (a token per call):
//!
//! - Every quantized reference fixture and the demo model: mean KL divergence of the fast
//!   distribution from the exact one, argmax agreement, and max|diff| against the reference.
//! - The demo model (trained): held-out perplexity within 0.5% of the exact path's.
//!
//! The exact path is the one held to the reference implementations (`reference_logits.rs`).
//! It needs an NVIDIA GPU: without one these tests are reported as ignored, not passed. On a GPU
//! machine: `cargo test -p sluice-cuda --test fast_prefill -- --ignored`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_cuda::CudaBackend;
use sluice_engine::{npy, Engine, LoadOptions, LogitsMode};

fn load(dir: &Path, fast: bool) -> Engine<CudaBackend> {
    let backend = sluice_cuda::open(0)
        .unwrap_or_else(|e| panic!("CUDA device 0: {e}"))
        .with_fast_kernels(fast)
        .with_fast_decode(fast);
    Engine::load(dir, Arc::new(backend), &LoadOptions::default())
        .unwrap_or_else(|e| panic!("loading {}: {e}", dir.display()))
}

#[path = "../../sluice-engine/tests/common/compare.rs"]
mod compare;
use compare::{assert_fast_within_bounds, kl_and_agreement, max_diff_over_max_ref, mean_nll};
// Its suite macro is not used here.
#[allow(unused_macros)]
#[path = "../../sluice-engine/tests/common/reference.rs"]
mod reference;
use reference::{reference_tokens, repo};

/// The fixtures with 4- or 8-bit weights (the others have nothing for the fast path to do).
const FIXTURES: [&str; 5] = [
    "qwen3_moe-q4",
    "qwen3_moe-q8",
    "qwen3_moe-q4g128",
    "qwen3_5_moe-q4",
    "qwen3_5_moe-q8",
];

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn prefill_logits_stay_close_to_the_exact_kernels_on_every_fixture() {
    logits_stay_close_on_every_fixture(LogitsMode::Prefill);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn decode_logits_stay_close_to_the_exact_kernels_on_every_fixture() {
    logits_stay_close_on_every_fixture(LogitsMode::Decode);
}

fn logits_stay_close_on_every_fixture(mode: LogitsMode) {
    let root = repo();
    let mut cases: Vec<(String, PathBuf, PathBuf)> = FIXTURES
        .iter()
        // One token's fast kernels take 4-bit weights only: 8-bit ones decode exactly.
        .filter(|f| mode == LogitsMode::Prefill || !f.ends_with("-q8"))
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
    eprintln!("{mode:?}:");
    eprintln!("| model | mean KL(exact || fast) | argmax agreement | fast max|diff| / max|ref| |");
    eprintln!("|---|---|---|---|");
    for (name, model, refs) in cases {
        let tokens = reference_tokens(&refs);
        assert!(
            tokens.len() > 8,
            "{name}: too few tokens for the prefill kernels"
        );
        let exact_engine = load(&model, false);
        let vocab = exact_engine.model.info().vocab_size;
        let exact = exact_engine.logits(&tokens, mode).unwrap();
        drop(exact_engine);
        let fast = load(&model, true).logits(&tokens, mode).unwrap();
        let file = match mode {
            LogitsMode::Prefill => "logits_prefill.npy",
            LogitsMode::Decode => "logits_decode.npy",
        };
        let (want, _) = npy::read_f32(&refs.join(file)).unwrap();
        let diff = max_diff_over_max_ref(&fast, &want);
        let (kl, agree) = kl_and_agreement(&exact, &fast, vocab);
        eprintln!(
            "| {name} | {kl:.2e} | {:.1}% | {:.2e} |",
            agree * 100.0,
            diff
        );
        assert_ne!(exact, fast, "{name}: the fast kernels did not run");
        assert_fast_within_bounds(name == "demo", &name, kl, agree);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn demo_model_prefill_perplexity_within_half_a_percent_of_the_exact_kernels() {
    perplexity_within_half_a_percent(LogitsMode::Prefill);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn demo_model_decode_perplexity_within_half_a_percent_of_the_exact_kernels() {
    perplexity_within_half_a_percent(LogitsMode::Decode);
}

fn perplexity_within_half_a_percent(mode: LogitsMode) {
    let dir = repo().join("models/demo");
    let exact = load(&dir, false);
    let fast = load(&dir, true);
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
        "held-out perplexity over {count} tokens ({mode:?} on the GPU): exact {ppl_exact:.4}, \
         fast {ppl_fast:.4} ({:+.3}%)",
        change * 100.0
    );
    assert!(
        change.abs() < 0.005,
        "fast {mode:?} perplexity {ppl_fast:.4} vs exact {ppl_exact:.4}: {:+.3}%",
        change * 100.0
    );
}
