//! Speculative decoding keeps the output of plain decoding: greedy gives the same tokens on
//! every architecture (attention caches rewound, recurrent states restored and their updates
//! redone for the kept rows after a miss, sliding windows), and sampling with a seed gives the
//! same tokens too.

use std::ops::ControlFlow;
use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::speculate::{Speculation, SpeculationStats};
use sluice_engine::{Engine, GenerateRequest, LoadOptions};

#[path = "common/speculate.rs"]
mod common;

use common::{fixture, generate, greedy, repetitive_prompt};

fn load(name: &str) -> Engine<CpuBackend> {
    Engine::load(
        &fixture(name),
        Arc::new(CpuBackend::new()),
        &LoadOptions::default(),
    )
    .unwrap()
}

#[test]
fn greedy_speculation_gives_the_tokens_of_plain_decoding() {
    let greedy = greedy();
    let mut total = SpeculationStats::default();
    for fixture in [
        "qwen3_moe-q4",
        "qwen3_5_moe-q4",
        "qwen3_next-bf16",
        "gpt_oss-q4",
        "mixtral-q4",
        "deepseek_v3-q4",
        "glm4_moe-q4",
        "../../models/demo",
    ] {
        let mut engine = load(fixture);
        let prompt = repetitive_prompt(&mut engine);
        let (plain, none) = generate(&mut engine, Speculation::Off, &prompt, &greedy, 40);
        assert_eq!(
            none,
            SpeculationStats::default(),
            "{fixture}: off drafts nothing"
        );
        for k in [1, 4, 7] {
            let lookup = Speculation::Lookup { draft_tokens: k };
            let (got, spec) = generate(&mut engine, lookup.clone(), &prompt, &greedy, 40);
            assert_eq!(
                got, plain,
                "{fixture}, {lookup}: tokens differ from plain decoding"
            );
            assert!(
                spec.passes > 0 && spec.drafted > 0,
                "{fixture}: nothing drafted"
            );
            assert!(spec.accepted <= spec.drafted && spec.produced <= got.len());
            eprintln!(
                "{fixture}, k {k}: {} passes, {} drafted, {} kept, {} produced",
                spec.passes, spec.drafted, spec.accepted, spec.produced
            );
            total.add(&spec);
        }
    }
    // Both kept and missed drafts were exercised (the rewinds and restores ran).
    assert!(total.accepted > 0, "no draft was kept: {total:?}");
    assert!(
        total.accepted < total.drafted,
        "no draft was missed: {total:?}"
    );
}

#[test]
fn sampled_speculation_gives_the_tokens_of_plain_sampling_with_a_seed() {
    // Each produced token is drawn from its row as decoding draws it, one draw per token in
    // order: with a seed, the very same tokens (which also keeps the distribution).
    let mut total = SpeculationStats::default();
    for fixture in [
        "qwen3_5_moe-q4",
        "gpt_oss-q4",
        "glm4_moe-q4",
        "../../models/demo",
    ] {
        let mut engine = load(fixture);
        let prompt = match fixture.ends_with("demo") {
            // The trained model continues a list it has seen: drafts kept.
            true => {
                let list = "apple, banana, cherry, date, elderberry, fig, grape.";
                let text = format!("A list: {list} Again: {list} Again: {list} Again: apple,");
                engine.tokenizer.encode(&text, true).unwrap()
            }
            false => repetitive_prompt(&mut engine),
        };
        for seed in 0..4 {
            let params = SamplingParams {
                temperature: 0.8,
                top_k: [0, 5][seed as usize % 2],
                top_p: [1.0, 0.9][seed as usize / 2],
                repetition_penalty: 1.1,
                seed: Some(seed),
                ..SamplingParams::default()
            };
            let (plain, _) = generate(&mut engine, Speculation::Off, &prompt, &params, 30);
            let lookup = Speculation::Lookup { draft_tokens: 4 };
            let (got, spec) = generate(&mut engine, lookup, &prompt, &params, 30);
            assert_eq!(got, plain, "{fixture}, seed {seed}: tokens differ");
            total.add(&spec);
        }
    }
    eprintln!("sampled: {total:?}");
    assert!(
        total.accepted > 0 && total.accepted < total.drafted,
        "{total:?}"
    );
}

#[test]
fn replaying_the_answer_keeps_every_draft() {
    let greedy = greedy();
    for fixture in ["qwen3_5_moe-q4", "gpt_oss-q4", "../../models/demo"] {
        let mut engine = load(fixture);
        let prompt: Vec<u32> = (0..20).map(|i| 3 + 11 * i).collect();
        let (plain, _) = generate(&mut engine, Speculation::Off, &prompt, &greedy, 60);
        // 24 drafts would make a pass of 25 rows, past the rows the CPU computes as it decodes
        // (its prompt kernels round differently): passes are capped there.
        let decode_rows = sluice_backend::Backend::decode_rows(engine.model.backend());
        for k in [1, 4, 24] {
            let replay = Speculation::Replay {
                answer: plain.clone().into(),
                after: prompt.len(),
                draft_tokens: k,
            };
            let (got, spec) = generate(&mut engine, replay, &prompt, &greedy, 60);
            assert_eq!(got, plain, "{fixture}, k {k}: tokens differ");
            assert!(spec.drafted > 0, "{fixture}, k {k}: nothing drafted");
            assert_eq!(spec.accepted, spec.drafted, "{fixture}, k {k}: {spec:?}");
            // Every pass makes its k drafts and its own token (the last ones fewer).
            assert!(
                spec.produced >= spec.passes * 2 - 1,
                "{fixture}, k {k}: {spec:?}"
            );
            assert!(
                spec.produced <= spec.passes * decode_rows.min(k + 1),
                "{fixture}, k {k}: {spec:?}"
            );
        }
    }
}

/// Taking a pass back with the recurrent layers' logged inputs (their updates redone for the
/// rows kept) leaves the state that running only those rows leaves: the next token's logits
/// agree, for every number of rows kept, on the architectures with DeltaNet layers. Without a
/// log the default (restore, run the kept rows again) is taken, and agrees too.
#[test]
fn a_pass_taken_back_by_its_log_leaves_the_state_of_the_rows_kept() {
    use sluice_backend::Backend;
    for fixture in ["qwen3_5_moe-q4", "qwen3_next-bf16"] {
        let engine = load(fixture);
        let (model, b) = (&engine.model, engine.model.backend());
        let mut base = model.new_state().unwrap();
        model
            .forward(&mut base, &[3, 14, 15, 92, 65], false)
            .unwrap();
        let fed = [35, 89, 79, 32, 38];
        for kept in 0..fed.len() {
            // As plain decoding would have it: only the kept rows run.
            let mut plain = base.clone();
            if kept > 0 {
                model.forward(&mut plain, &fed[..kept], false).unwrap();
            }
            let expected = b
                .to_host(&model.forward(&mut plain, &[7], false).unwrap())
                .unwrap();
            for logged in [true, false] {
                let mut state = base.clone();
                if logged {
                    state.begin_log();
                }
                let checkpoint = state.checkpoint();
                model.forward(&mut state, &fed, true).unwrap();
                assert_eq!(state.log.is_some(), logged);
                assert!(model
                    .take_back(&mut state, checkpoint, &fed[..kept])
                    .unwrap());
                assert!(state.log.is_none(), "the log ends");
                assert_eq!(state.position, base.position + kept);
                let got = b
                    .to_host(&model.forward(&mut state, &[7], false).unwrap())
                    .unwrap();
                let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
                let diff = (expected.iter().zip(&got)).fold(0f32, |m, (e, g)| m.max((e - g).abs()));
                assert!(
                    diff <= 1e-4 * scale,
                    "{fixture}, {kept} kept, logged {logged}: max |diff| {diff} of {scale}"
                );
            }
        }
    }
}

/// A draft model (another model with the same tokenizer) drafting greedily leaves the output of
/// plain decoding as it is, greedy and sampled, whichever of the two is recurrent; the demo's
/// trained draft model has most of its drafts kept, and a model drafting for itself nearly all.
#[test]
fn a_draft_model_gives_the_tokens_of_plain_decoding() {
    let mut total = SpeculationStats::default();
    for (main, draft) in [
        // The pairs users run: a dense model of the family drafting for the MoE one.
        ("qwen3_moe-q4", "qwen3-q4"),
        ("qwen3_5_moe-q4", "qwen3_5-q4"),
        // llama.cpp's usual draft: a dense Qwen3 GGUF at Q8_0.
        ("qwen3_moe-q4", "qwen3-gguf-q8_0/model.gguf"),
        ("qwen3_moe-q8", "qwen3_5_moe-q4"),
        ("qwen3_5_moe-q4", "qwen3_moe-q8"),
        ("qwen3_next-bf16", "qwen3_5_moe-q8"),
        ("../../models/demo", "../../models/demo-draft"),
        ("../../models/demo", "../../models/demo"),
    ] {
        let mut engine = load(main);
        let opts = LoadOptions::default();
        engine.load_draft(&fixture(draft), &opts).unwrap();
        let prompt: Vec<u32> = match main.ends_with("demo") {
            true => engine.tokenizer.encode("Once upon a time", true).unwrap(),
            false => (0..16).map(|i| 2 + 13 * i).collect(),
        };
        let sampled = SamplingParams {
            temperature: 0.8,
            top_k: 20,
            seed: Some(7),
            ..SamplingParams::default()
        };
        for params in [greedy(), sampled] {
            let (plain, _) = generate(&mut engine, Speculation::Off, &prompt, &params, 40);
            for k in [1, 3, 8] {
                let spec = Speculation::Draft { draft_tokens: k };
                let (got, stats) = generate(&mut engine, spec, &prompt, &params, 40);
                assert_eq!(
                    got, plain,
                    "{main} drafted by {draft}, k {k}: tokens differ"
                );
                assert!(stats.drafted > 0, "{main}, k {k}: nothing drafted");
                // The trained pair agrees on prose most of the time, a model with itself
                // nearly always.
                let least = match (main == draft, draft.ends_with("demo-draft")) {
                    (true, _) => 0.9,
                    (_, true) => 0.6,
                    _ => 0.0,
                };
                if params.temperature == 0.0 {
                    assert!(
                        stats.acceptance() >= least,
                        "{main} drafted by {draft}: {stats:?}"
                    );
                }
                total.add(&stats);
            }
        }
    }
    eprintln!("drafted: {total:?}");
    assert!(
        total.accepted > 0 && total.accepted < total.drafted,
        "{total:?}"
    );
}

#[test]
fn drafting_without_a_draft_model_is_refused() {
    let mut engine = load("qwen3_moe-q4");
    engine.speculation = Speculation::Draft { draft_tokens: 2 };
    let request = GenerateRequest {
        prompt: &[1, 2, 3],
        params: &greedy(),
        max_tokens: 4,
        cancel: None,
        ignore_eos: true,
        checkpoint: None,
    };
    let err = engine
        .generate_cached(None, &request, |_| ControlFlow::Continue(()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("--draft-model"), "{err}");
}

/// A draft model with a shorter context than the request stops drafting there; the request goes
/// on decoding to the same tokens.
#[test]
fn drafting_stops_at_the_draft_models_context() {
    let tmp = tempfile::tempdir().unwrap();
    let src = fixture("qwen3-q4");
    for entry in std::fs::read_dir(&src).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let path = tmp.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["max_position_embeddings"] = 24.into();
    std::fs::write(&path, config.to_string()).unwrap();

    let mut engine = load("qwen3_moe-q4");
    engine
        .load_draft(tmp.path(), &LoadOptions::default())
        .unwrap();
    let prompt: Vec<u32> = (0..16).map(|i| 2 + 13 * i).collect();
    let (plain, _) = generate(&mut engine, Speculation::Off, &prompt, &greedy(), 30);
    let draft = Speculation::Draft { draft_tokens: 4 };
    let (got, short) = generate(&mut engine, draft.clone(), &prompt, &greedy(), 30);
    assert_eq!(got, plain);
    // Drafts only while the history and the drafts fit 24 positions (histories of 17 to 23
    // tokens: at most 4 + 4 + 4 + 4 + 3 + 2 + 1), fewer than the same model with its context.
    assert!(short.drafted > 0 && short.drafted <= 22, "{short:?}");
    engine.load_draft(&src, &LoadOptions::default()).unwrap();
    let (got, full) = generate(&mut engine, draft, &prompt, &greedy(), 30);
    assert_eq!(got, plain);
    assert!(short.drafted < full.drafted, "{short:?} {full:?}");
}
