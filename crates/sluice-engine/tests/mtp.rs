//! The multi-token-prediction layer on the CPU backend (the checks are `common/mtp.rs`, which
//! the CUDA backend's tests run too).

use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::speculate::Speculation;
use sluice_engine::{Engine, GenerateRequest, LoadOptions};

#[path = "common/speculate.rs"]
mod speculate;

#[path = "common/mtp.rs"]
mod mtp;

#[test]
fn the_mtp_layer_matches_transformers() {
    mtp::mtp_matches_the_reference(Arc::new(CpuBackend::new()));
}

#[test]
fn mtp_drafts_give_the_tokens_of_plain_decoding() {
    mtp::mtp_speculation_is_exact(Arc::new(CpuBackend::new()), 0.3);
}

/// A checkpoint without `mtp.*` (an mlx-community conversion) refuses `--speculate mtp` with
/// what to do instead.
#[test]
fn mtp_without_an_mtp_layer_is_refused() {
    let dir = speculate::fixture("qwen3_5_moe-q4");
    let mut engine =
        Engine::load(&dir, Arc::new(CpuBackend::new()), &LoadOptions::default()).unwrap();
    assert!(engine.model.mtp().unwrap().is_none());
    engine.speculation = Speculation::Mtp { draft_tokens: 4 };
    let params = speculate::greedy();
    let request = GenerateRequest {
        prompt: &[1, 2, 3],
        params: &params,
        max_tokens: 4,
        cancel: None,
        ignore_eos: true,
        checkpoint: None,
    };
    let err = engine
        .generate_cached(None, &request, |_| std::ops::ControlFlow::Continue(()))
        .expect_err("refused")
        .to_string();
    assert!(
        err.contains("--speculate mtp") && err.contains("no multi-token-prediction layer"),
        "{err}"
    );
}

/// A second turn resumed from the prompt cache (the model's hidden states of the cached prefix
/// were never kept: the MTP layer gets zeros for them) still drafts and gives plain decoding's
/// tokens.
#[test]
fn mtp_drafts_after_a_prompt_cache_resume() {
    use sluice_engine::prompt_cache::PromptCache;
    let dir = speculate::fixture("qwen3_5_moe-mtp");
    let mut engine =
        Engine::load(&dir, Arc::new(CpuBackend::new()), &LoadOptions::default()).unwrap();
    let params = speculate::greedy();
    let run = |engine: &Engine<CpuBackend>,
               cache: Option<&mut PromptCache<CpuBackend>>,
               prompt: &[u32]| {
        let request = GenerateRequest {
            prompt,
            params: &params,
            max_tokens: 12,
            cancel: None,
            ignore_eos: true,
            checkpoint: None,
        };
        let mut tokens = Vec::new();
        let stats = engine
            .generate_cached(cache, &request, |event| {
                if let sluice_engine::TokenEvent::Token { id, .. } = event {
                    tokens.push(id);
                }
                std::ops::ControlFlow::Continue(())
            })
            .unwrap();
        (tokens, stats)
    };
    let turn1: Vec<u32> = (1..30).map(|i| (i * 7) % 300 + 3).collect();
    let mut turn2 = turn1.clone();
    engine.speculation = Speculation::Off;
    turn2.extend(run(&engine, None, &turn1).0);
    turn2.extend([11, 12, 13]);
    let plain = run(&engine, None, &turn2).0;

    engine.speculation = Speculation::Mtp { draft_tokens: 3 };
    let mut cache = PromptCache::new(4);
    run(&engine, Some(&mut cache), &turn1);
    let (resumed, stats) = run(&engine, Some(&mut cache), &turn2);
    assert!(stats.cached_tokens > 0, "{stats:?}");
    assert!(stats.speculation.drafted > 0, "{stats:?}");
    assert_eq!(resumed, plain);
}
