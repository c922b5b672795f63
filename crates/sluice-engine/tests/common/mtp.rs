//! The multi-token-prediction checks, for any backend (the CPU's `tests/mtp.rs`, the CUDA
//! backend's `tests/mtp.rs`): the MTP layer against transformers on `qwen3_5_moe-mtp` (made by
//! `scripts/make_fixtures_mtp.py`), and `--speculate mtp` giving plain decoding's tokens.

#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use sluice_backend::Backend;
use sluice_engine::npy;
use sluice_engine::speculate::{Speculation, SpeculationStats};
use sluice_engine::{Engine, LoadOptions};

use super::speculate::{fixture, generate, greedy, repetitive_prompt};

/// Reference tolerance, relative to the largest reference value (as the reference suite).
const RELATIVE: f32 = 1e-3;

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: sizes");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    eprintln!("{what}: max |diff| {diff:.3e} of max |ref| {scale:.3}");
    assert!(
        diff <= RELATIVE * scale,
        "{what}: max |diff| {diff} vs max |ref| {scale}"
    );
}

fn argmax(row: &[f32]) -> u32 {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as u32
}

fn read(dir: &Path, name: &str) -> Vec<f32> {
    npy::read_f32(&dir.join(name))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()))
        .0
}

/// The model's kept hidden states, the MTP layer's logits over a sequence in one pass and one
/// row at a time, and a chained row, against transformers.
pub fn mtp_matches_the_reference<B: Backend + 'static>(backend: Arc<B>) {
    let dir = fixture("qwen3_5_moe-mtp");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("mtp.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = meta["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let chained_token = meta["chained_token"].as_u64().unwrap() as u32;
    let engine = Engine::load(&dir, backend, &LoadOptions::default()).unwrap();
    let (model, b) = (&engine.model, engine.model.backend());
    let mtp = model.mtp().unwrap().expect("the fixture has an MTP layer");
    let n = tokens.len();

    let mut state = model.new_state().unwrap();
    state.keep_hidden();
    model.forward(&mut state, &tokens, false).unwrap();
    let log = state.hidden.as_ref().unwrap();
    assert_eq!(log.covered(b), 0..n);
    let hidden = log.rows(b, 0..n).unwrap();
    close(
        "the model's final hidden states",
        &b.to_host(&hidden).unwrap(),
        &read(&dir, "main_hidden.npy"),
    );

    // Rows (hidden at p, token at p + 1), p = 0..n - 1, in one pass.
    let rows = b.slice_rows(&hidden, 0, n - 1);
    let mut one_pass = mtp.new_state().unwrap();
    let (logits, out) = mtp
        .forward(&mut one_pass, &rows, &tokens[1..], true)
        .unwrap();
    let want = read(&dir, "mtp_logits.npy");
    close("MTP logits, one pass", &b.to_host(&logits).unwrap(), &want);
    close(
        "MTP hidden states, one pass",
        &b.to_host(&out).unwrap(),
        &read(&dir, "mtp_hidden.npy"),
    );

    // The same rows one at a time through the cache.
    let mut stepped = mtp.new_state().unwrap();
    let mut got = Vec::new();
    for p in 0..n - 1 {
        let (l, _) = mtp
            .forward(
                &mut stepped,
                &b.slice_rows(&hidden, p, 1),
                &tokens[p + 1..p + 2],
                false,
            )
            .unwrap();
        got.extend(b.to_host(&l).unwrap());
    }
    close("MTP logits, a row at a time", &got, &want);

    // Chained: the last row's own hidden state and its greedy token, one position on.
    let vocab = want.len() / (n - 1);
    assert_eq!(argmax(&want[want.len() - vocab..]), chained_token);
    let last = b.slice_rows(&out, n - 2, 1);
    let (chained, _) = mtp
        .forward(&mut one_pass, &last, &[chained_token], false)
        .unwrap();
    close(
        "MTP logits, chained",
        &b.to_host(&chained).unwrap(),
        &read(&dir, "mtp_chained_logits.npy"),
    );

    // Bad input is an error, not a panic.
    let mut fresh = mtp.new_state().unwrap();
    assert!(mtp.forward(&mut fresh, &rows, &tokens[..2], true).is_err());
    assert!(mtp
        .forward(&mut fresh, &b.slice_rows(&hidden, 0, 1), &[u32::MAX], true)
        .is_err());
}

/// `--speculate mtp` gives the tokens of plain decoding, greedy and sampled, at several k, on
/// the fixture and on the demo model (whose trained MTP layer keeps at least `min_kept` of its
/// drafts on a repetitive prompt). Returns the demo's statistics at k = 4.
pub fn mtp_speculation_is_exact<B: Backend + 'static>(
    backend: Arc<B>,
    min_kept: f64,
) -> SpeculationStats {
    let mut demo_stats = SpeculationStats::default();
    for name in ["qwen3_5_moe-mtp", "../../models/demo"] {
        let mut engine = Engine::load(&fixture(name), backend.clone(), &LoadOptions::default())
            .unwrap_or_else(|e| panic!("loading {name}: {e}"));
        let prompt = repetitive_prompt(&mut engine);
        let seeded = sluice_engine::sampler::SamplingParams {
            temperature: 0.8,
            seed: Some(7),
            ..greedy()
        };
        for params in [greedy(), seeded] {
            let (plain, _) = generate(&mut engine, Speculation::Off, &prompt, &params, 40);
            for k in [1, 3, 8] {
                let spec = Speculation::Mtp { draft_tokens: k };
                let (got, stats) = generate(&mut engine, spec.clone(), &prompt, &params, 40);
                assert_eq!(got, plain, "{name}, {spec}, {params:?}: tokens differ");
                assert!(stats.drafted > 0, "{name}, {spec}: no drafts");
                eprintln!("{name}, {spec}, t={}: {stats:?}", params.temperature);
                if name.ends_with("demo") && k == 3 && params.temperature == 0.0 {
                    demo_stats = stats;
                }
            }
        }
    }
    // A pass that keeps some drafts is followed by drafting again at once (the rows of the
    // refused drafts are skipped, not waited out): most tokens come from checking passes.
    assert!(
        demo_stats.produced * 4 >= 39 * 3,
        "the demo's MTP layer drafted for too few of its tokens: {demo_stats:?}"
    );
    let kept = demo_stats.accepted as f64 / demo_stats.drafted.max(1) as f64;
    assert!(
        kept >= min_kept,
        "the demo's MTP layer kept {kept:.2} of its drafts: {demo_stats:?}"
    );
    demo_stats
}
