//! Helpers of the speculation tests, for any backend (the CPU's `tests/speculate.rs`, the CUDA
//! backend's `tests/speculate.rs`).

#![allow(dead_code)]

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use sluice_backend::Backend;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::speculate::{Speculation, SpeculationStats};
use sluice_engine::{Engine, GenerateRequest, TokenEvent};

/// A fixture's directory (`../../models/demo` names the demo model), in `SLUICE_REPO` when the
/// test binary runs away from its build tree.
pub fn fixture(name: &str) -> PathBuf {
    std::env::var_os("SLUICE_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
        .join("tests/fixtures")
        .join(name)
}

pub fn greedy() -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    }
}

/// `max_tokens` tokens after `prompt` (end tokens ignored), drafting as `speculation` says.
pub fn generate<B: Backend + 'static>(
    engine: &mut Engine<B>,
    speculation: Speculation,
    prompt: &[u32],
    params: &SamplingParams,
    max_tokens: usize,
) -> (Vec<u32>, SpeculationStats) {
    engine.speculation = speculation;
    let request = GenerateRequest {
        prompt,
        params,
        max_tokens,
        cancel: None,
        ignore_eos: true,
        checkpoint: None,
    };
    let mut tokens = Vec::new();
    let stats = engine
        .generate_cached(None, &request, |event| {
            if let TokenEvent::Token { id, .. } = event {
                tokens.push(id);
            }
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(stats.generated_tokens, tokens.len());
    (tokens, stats.speculation)
}

/// A prompt that prompt lookup finds drafts in: a start, the model's own greedy continuation of
/// it, and the start again (the model tends to continue it the same way).
pub fn repetitive_prompt<B: Backend + 'static>(engine: &mut Engine<B>) -> Vec<u32> {
    let start: Vec<u32> = (0..12).map(|i| 5 + 7 * i).collect();
    let (own, _) = generate(engine, Speculation::Off, &start, &greedy(), 24);
    [&start[..], &own, &start].concat()
}
