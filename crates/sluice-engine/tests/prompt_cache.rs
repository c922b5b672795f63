//! Resuming from the prompt cache gives the same tokens as computing the whole prompt again,
//! for attention-only models (rewound to any common prefix) and hybrid ones with recurrent
//! layers (resumed only from whole saved prefixes).

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::prompt_cache::PromptCache;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::{
    Engine, FinishReason, GenerateRequest, GenerationStats, LoadOptions, TokenEvent,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load(name: &str) -> Engine<CpuBackend> {
    Engine::load(
        &fixture(name),
        Arc::new(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Greedy generation of up to `n` tokens, through `cache` when given.
fn run(
    engine: &Engine<CpuBackend>,
    cache: Option<&mut PromptCache<CpuBackend>>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, GenerationStats) {
    let params = SamplingParams::default();
    let request = GenerateRequest {
        prompt,
        params: &params,
        max_tokens: n,
        cancel: None,
        ignore_eos: true,
        checkpoint: Some(25),
    };
    let mut tokens = Vec::new();
    let stats = engine
        .generate_cached(cache, &request, |event| {
            if let TokenEvent::Token { id, .. } = event {
                tokens.push(id);
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    (tokens, stats)
}

fn check(name: &str, rewindable: bool) {
    let engine = load(name);
    let mut cache = PromptCache::new(8);
    let turn1: Vec<u32> = (1..40).map(|i| (i * 7) % 300 + 3).collect();
    let (answer1, stats1) = run(&engine, Some(&mut cache), &turn1, 6);
    assert_eq!(stats1.cached_tokens, 0);
    assert_eq!(answer1.len(), 6);

    // Turn 2 extends turn 1 and its answer: all of what the model consumed is reused (the last
    // answer token was sampled but never fed back).
    let mut turn2 = turn1.clone();
    turn2.extend(&answer1);
    turn2.extend([11, 12, 13]);
    let (answer2, stats2) = run(&engine, Some(&mut cache), &turn2, 6);
    assert_eq!(
        stats2.cached_tokens,
        turn1.len() + answer1.len() - 1,
        "{name}"
    );
    assert_eq!(
        answer2,
        run(&engine, None, &turn2, 6).0,
        "{name}: resumed != fresh"
    );

    // The same prompt again: at most its last token is recomputed (hybrid models kept the
    // logits of the prompt itself).
    let (again, stats) = run(&engine, Some(&mut cache), &turn2, 6);
    assert_eq!(again, answer2, "{name}");
    assert!(stats.cached_tokens >= turn2.len() - 1, "{name}: {stats:?}");

    // A prompt that leaves turn 1 halfway: attention caches rewind to the common prefix;
    // recurrent states cannot, so nothing is reused...
    let mut branch = turn1[..20].to_vec();
    branch.extend([50, 51, 52]);
    let (answer3, stats3) = run(&engine, Some(&mut cache), &branch, 6);
    let expected = if rewindable { 20 } else { 0 };
    assert_eq!(stats3.cached_tokens, expected, "{name}");
    assert_eq!(answer3, run(&engine, None, &branch, 6).0, "{name}: branch");

    // ...except from the checkpoint (position 25) that turn 1 saved on its way.
    let mut branch = turn1[..30].to_vec();
    branch.extend([60, 61]);
    let (answer4, stats4) = run(&engine, Some(&mut cache), &branch, 6);
    let expected = if rewindable { 30 } else { 25 };
    assert_eq!(stats4.cached_tokens, expected, "{name}");
    assert_eq!(
        answer4,
        run(&engine, None, &branch, 6).0,
        "{name}: checkpoint"
    );
}

#[test]
fn attention_only_models_resume_from_any_common_prefix() {
    check("qwen3_moe-q4", true);
    check("qwen3_moe-bf16", true);
}

#[test]
fn hybrid_models_resume_from_whole_saved_prefixes() {
    check("qwen3_5_moe-q4", false);
    check("qwen3_next-bf16", false);
}

#[test]
fn a_cancelled_request_stops_before_computing() {
    let engine = load("qwen3_moe-q4");
    let cancel = AtomicBool::new(true);
    let params = SamplingParams::default();
    let request = GenerateRequest {
        prompt: &[1, 2, 3],
        params: &params,
        max_tokens: 5,
        cancel: Some(&cancel),
        ignore_eos: false,
        checkpoint: None,
    };
    let stats = engine
        .generate_cached(None, &request, |_| ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(stats.finish, FinishReason::Cancelled);
    assert_eq!(stats.generated_tokens, 0);
}

#[test]
fn a_disabled_cache_keeps_nothing() {
    let engine = load("qwen3_moe-q4");
    let mut cache = PromptCache::new(0);
    run(&engine, Some(&mut cache), &[1, 2, 3, 4], 3);
    assert!(cache.is_empty());
    let (_, stats) = run(&engine, Some(&mut cache), &[1, 2, 3, 4, 5], 3);
    assert_eq!(stats.cached_tokens, 0);
}
