//! The bundled demo model (models/demo) is really trained: on held-out English text (books never
//! seen in training, models/demo/eval/heldout_text.jsonl) its perplexity is far below the
//! vocabulary size.

use std::path::Path;
use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::{Engine, LoadOptions, LogitsMode};

/// Mean negative log-likelihood of `tokens[1..]` given the prefix, from full-sequence logits.
fn mean_nll(logits: &[f32], tokens: &[u32], vocab: usize) -> f64 {
    let mut total = 0.0;
    for (t, row) in logits.chunks(vocab).enumerate().take(tokens.len() - 1) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let log_sum = row
            .iter()
            .map(|&v| ((v - max) as f64).exp())
            .sum::<f64>()
            .ln()
            + max as f64;
        total += log_sum - row[tokens[t + 1] as usize] as f64;
    }
    total / (tokens.len() - 1) as f64
}

#[test]
fn held_out_perplexity_is_far_below_the_vocabulary_size() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo");
    let engine = Engine::load(&dir, Arc::new(CpuBackend::new()), &LoadOptions::default()).unwrap();
    let vocab = engine.model.info().vocab_size;
    let heldout = std::fs::read_to_string(dir.join("eval/heldout_text.jsonl")).unwrap();
    let (mut nll, mut count) = (0.0, 0);
    for line in heldout.lines().filter(|l| !l.trim().is_empty()).take(8) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let text = v["text"].as_str().unwrap();
        let mut tokens = engine.tokenizer.encode(text, false).unwrap();
        tokens.truncate(256);
        let logits = engine.logits(&tokens, LogitsMode::Prefill).unwrap();
        nll += mean_nll(&logits, &tokens, vocab) * (tokens.len() - 1) as f64;
        count += tokens.len() - 1;
    }
    let perplexity = (nll / count as f64).exp();
    eprintln!("held-out perplexity {perplexity:.1} over {count} tokens (vocabulary {vocab})");
    // Uniform guessing is `vocab` (8192); a unigram model of English text is several hundred.
    assert!(perplexity < 100.0, "perplexity {perplexity:.1}");
}
