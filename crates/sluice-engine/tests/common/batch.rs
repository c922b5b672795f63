//! The batching suite, shared by every backend's tests (the CPU's in sluice-engine, the GPU's in
//! sluice-cuda include this file): requests of different lengths that join and leave a batch
//! mid-way get what they get alone.
//!
//! - Model level ([`check_forward_batch`]): each request's logits at every step of a batched run
//!   (decode rows in one pass, prompts beside them, as [`Engine::step`] runs them) against the
//!   same request run alone: max|diff| <= 1e-5 x max|logit| (the order of summation may differ,
//!   nothing else).
//! - Engine level ([`check_continuous_batching`]): greedy generations stepped together, joining
//!   at different steps and stopping after different lengths, produce exactly their tokens alone.

#![allow(dead_code)]

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use sluice_backend::Backend;
use sluice_engine::batch::FnSink;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::{Engine, FinishReason, GenerateRequest, LoadOptions, TokenEvent};
use sluice_models::{Segment, State};

pub const BATCH_TOLERANCE: f32 = 1e-5;

/// One request of a scripted run: it joins at step `join` with `prompt`, then feeds `decode`
/// one token per step.
struct Script {
    join: usize,
    prompt: Vec<u32>,
    decode: Vec<u32>,
}

/// Three requests cut from `tokens` (at least 16 long): they join at steps 0, 1 and 3 and
/// leave after 6, 3 and 4 decoded tokens, so the batch grows and shrinks while prompts arrive.
fn scripts(tokens: &[u32]) -> Vec<Script> {
    let t = |a: usize, b: usize| tokens[a % tokens.len()..b.min(tokens.len())].to_vec();
    vec![
        Script {
            join: 0,
            prompt: t(0, 7),
            decode: t(7, 13),
        },
        Script {
            join: 1,
            prompt: t(2, 13),
            decode: t(13, 16),
        },
        Script {
            join: 3,
            prompt: t(5, 8),
            decode: t(8, 12),
        },
    ]
}

fn host<B: Backend>(b: &B, a: &B::Act) -> Vec<f32> {
    b.to_host(a).unwrap()
}

/// Runs each script alone, then all together through `forward_batch`, and compares every
/// step's last-token logits.
/// `tokens_dir` holds the reference.json whose tokens the requests are cut from.
pub fn check_forward_batch<B: Backend + 'static>(
    backend: Arc<B>,
    name: &str,
    dir: &Path,
    tokens_dir: &Path,
) {
    let engine = Engine::load(dir, backend, &LoadOptions::default()).unwrap();
    let model = engine.model.as_ref();
    let b = model.backend();
    let tokens = super::reference::reference_tokens(tokens_dir);
    assert!(tokens.len() >= 16, "{name}: fixture too short");
    let scripts = scripts(&tokens);

    // Alone: the prompt in one call, then a token per call.
    let alone: Vec<Vec<Vec<f32>>> = scripts
        .iter()
        .map(|s| {
            let mut state = model.new_state().unwrap();
            let mut steps = vec![host(
                b,
                &model.forward(&mut state, &s.prompt, false).unwrap(),
            )];
            for &t in &s.decode {
                steps.push(host(b, &model.forward(&mut state, &[t], false).unwrap()));
            }
            steps
        })
        .collect();

    // Together, as `Engine::step` runs them: at step n every script that has joined and not
    // finished runs its next part; the decoding ones in one pass, each prompt in its own.
    let mut states: Vec<State<B>> = scripts.iter().map(|_| model.new_state().unwrap()).collect();
    let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); scripts.len()];
    let mut max_batch = 0;
    let last = scripts
        .iter()
        .map(|s| s.join + s.decode.len())
        .max()
        .unwrap();
    for step in 0..=last {
        let parts: Vec<(usize, &[u32])> = scripts
            .iter()
            .enumerate()
            .filter(|(_, s)| step >= s.join && step - s.join <= s.decode.len())
            .map(|(i, s)| match step - s.join {
                0 => (i, &s.prompt[..]),
                n => (i, std::slice::from_ref(&s.decode[n - 1])),
            })
            .collect();
        let decoding: Vec<(usize, &[u32])> =
            parts.iter().copied().filter(|p| p.1.len() == 1).collect();
        let passes = std::iter::once(decoding.clone())
            .chain(parts.iter().filter(|p| p.1.len() > 1).map(|&p| vec![p]))
            .filter(|pass| !pass.is_empty());
        max_batch = max_batch.max(decoding.len());
        for pass in passes {
            let mut picked: Vec<(usize, &mut State<B>)> = states
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| pass.iter().any(|p| p.0 == *i))
                .collect();
            let mut segments: Vec<Segment<'_, B>> = picked
                .iter_mut()
                .map(|(i, state)| Segment {
                    state,
                    tokens: pass.iter().find(|p| p.0 == *i).unwrap().1,
                })
                .collect();
            let out = host(b, &model.forward_batch(&mut segments).unwrap());
            let vocab = out.len() / pass.len();
            for (row, (i, _)) in pass.iter().enumerate() {
                got[*i].push(out[row * vocab..(row + 1) * vocab].to_vec());
            }
        }
    }
    assert_eq!(
        max_batch, 3,
        "{name}: the script should decode three at once"
    );

    for (i, (want, got)) in alone.iter().zip(&got).enumerate() {
        assert_eq!(want.len(), got.len(), "{name}: request {i} steps");
        for (step, (w, g)) in want.iter().zip(got).enumerate() {
            let max_ref = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            let diff = w.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                diff <= BATCH_TOLERANCE * max_ref,
                "{name}: request {i} step {step}: max|diff| {diff:e} > {BATCH_TOLERANCE} x {max_ref}"
            );
        }
    }
}

/// Greedy generations stepped together through [`Engine::step`], joining at different steps
/// and stopping after different lengths, against each alone.
pub fn check_continuous_batching<B: Backend + 'static>(
    backend: Arc<B>,
    name: &str,
    dir: &Path,
    tokens_dir: &Path,
) {
    let engine = Engine::load(dir, backend, &LoadOptions::default()).unwrap();
    let tokens = super::reference::reference_tokens(tokens_dir);
    let greedy = SamplingParams::default();
    // Sampled rows are asked for their best logits together (`top_logits_rows`); each keeps its
    // own generator, so a seeded request draws alike in a batch and alone.
    let sampled = |seed| SamplingParams {
        temperature: 0.8,
        top_k: 20,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let (sampled_a, sampled_b) = (sampled(7), sampled(8));
    // (joins at step, prompt, tokens to generate, sampling)
    let plan: Vec<(usize, Vec<u32>, usize, &SamplingParams)> = vec![
        (0, tokens[..9].to_vec(), 12, &greedy),
        (2, tokens[3..].to_vec(), 4, &sampled_a),
        (2, tokens[1..5].to_vec(), 9, &greedy),
        (5, tokens[..9].to_vec(), 7, &sampled_b),
        (5, tokens[2..7].to_vec(), 6, &sampled_a),
    ];
    fn request<'a>(prompt: &'a [u32], params: &'a SamplingParams, n: usize) -> GenerateRequest<'a> {
        GenerateRequest {
            prompt,
            params,
            max_tokens: n,
            cancel: None,
            ignore_eos: true,
            checkpoint: None,
        }
    }
    let alone: Vec<Vec<u32>> = plan
        .iter()
        .map(|(_, prompt, n, params)| {
            let mut ids = Vec::new();
            let stats = engine
                .generate_cached(None, &request(prompt, params, *n), |e| {
                    if let TokenEvent::Token { id, .. } = e {
                        ids.push(id);
                    }
                    ControlFlow::Continue(())
                })
                .unwrap();
            assert_eq!(stats.finish, FinishReason::Length);
            ids
        })
        .collect();

    let outputs: Vec<std::cell::RefCell<Vec<u32>>> =
        plan.iter().map(|_| Default::default()).collect();
    let sink = |i: usize| {
        let out = &outputs[i];
        FnSink {
            on_event: move |e: TokenEvent<'_>| {
                if let TokenEvent::Token { id, .. } = e {
                    out.borrow_mut().push(id);
                }
                ControlFlow::Continue(())
            },
            cancel: None,
        }
    };
    let mut running = Vec::new();
    let mut finished = 0;
    let mut most = 0;
    for step in 0.. {
        for (i, (join, prompt, n, params)) in plan.iter().enumerate() {
            if *join == step {
                running.push(
                    engine
                        .sequence(None, &request(prompt, params, *n), sink(i))
                        .unwrap(),
                );
            }
        }
        if running.is_empty() && step > plan.iter().map(|p| p.0).max().unwrap() {
            break;
        }
        most = most.max(running.len());
        engine.step(&mut running.iter_mut().collect::<Vec<_>>(), None);
        for s in std::mem::take(&mut running) {
            if s.is_finished() {
                let (stats, _) = s.finish(None);
                assert_eq!(stats.unwrap().finish, FinishReason::Length, "{name}");
                finished += 1;
            } else {
                running.push(s);
            }
        }
    }
    assert_eq!(finished, plan.len());
    assert!(most >= 3, "{name}: at most {most} ran at once");
    for (i, want) in alone.iter().enumerate() {
        assert_eq!(
            *outputs[i].borrow(),
            *want,
            "{name}: request {i} in a batch differs from alone"
        );
    }
}

/// One test per fixture for both checks, plus the demo model, for the backend `$make` builds.
#[macro_export]
macro_rules! batch_suite {
    ($make:expr; $(#[$attr:meta])*) => {
        batch_suite!(@one $make; $(#[$attr])*; qwen3_moe_q4_batch, "qwen3_moe-q4");
        batch_suite!(@one $make; $(#[$attr])*; qwen3_moe_bf16_batch, "qwen3_moe-bf16");
        batch_suite!(@one $make; $(#[$attr])*; qwen3_5_moe_q4_batch, "qwen3_5_moe-q4");
        batch_suite!(@one $make; $(#[$attr])*; qwen3_next_bf16_batch, "qwen3_next-bf16");
        batch_suite!(@one $make; $(#[$attr])*; mixtral_q4_batch, "mixtral-q4");
        batch_suite!(@one $make; $(#[$attr])*; glm4_moe_hf_batch, "glm4_moe-hf");
        batch_suite!(@one $make; $(#[$attr])*; deepseek_v3_q4_batch, "deepseek_v3-q4");

        #[test]
        $(#[$attr])*
        fn demo_model_batch() {
            let model = reference::repo().join("models/demo");
            // The demo model's reference fixture holds its tokens.
            let tokens = reference::fixture("demo-reference");
            batch::check_forward_batch($make, "demo", &model, &tokens);
            batch::check_continuous_batching($make, "demo", &model, &tokens);
        }
    };
    (@one $make:expr; $(#[$attr:meta])*; $test:ident, $fixture:expr) => {
        #[test]
        $(#[$attr])*
        fn $test() {
            let dir = reference::fixture($fixture);
            batch::check_forward_batch($make, $fixture, &dir, &dir);
            batch::check_continuous_batching($make, $fixture, &dir, &dir);
        }
    };
}
