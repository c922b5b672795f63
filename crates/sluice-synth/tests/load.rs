//! Synthetic checkpoints load in sluice's model loader and run: finite logits, and prefill and
//! decode agreeing (the same model read two ways).

use std::sync::Arc;

use sluice_backend::Backend;
use sluice_cpu::CpuBackend;
use sluice_format::ModelDir;
use sluice_synth::{synthesize, Preset, SynthOptions};

type Model = Box<dyn sluice_models::CausalLm<CpuBackend>>;

/// Writes `preset` (seed 3) into a temporary directory, applies `edit` to its config.json and
/// loads it on the CPU.
fn load(preset: &str, edit: impl FnOnce(&mut serde_json::Value)) -> (tempfile::TempDir, Model) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let opts = SynthOptions {
        seed: 3,
        ..SynthOptions::new(Preset::find(preset).unwrap(), out.clone())
    };
    synthesize(&opts, &|_, _| {}).unwrap();
    let path = out.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(&path, config.to_string()).unwrap();
    let dir = ModelDir::open(&out).unwrap();
    let model = sluice_models::load(&dir, Arc::new(CpuBackend::new()))
        .unwrap_or_else(|e| panic!("{preset}: {e}"));
    (tmp, model)
}

/// Logits of every position of `tokens`, run as one prompt.
fn prefill(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let mut state = model.new_state().unwrap();
    let out = model.forward(&mut state, tokens, true).unwrap();
    model.backend().to_host(&out).unwrap()
}

#[test]
fn tiny_gpt_oss_runs_past_its_window_with_finite_logits() {
    let (_tmp, model) = load("tiny-gpt-oss", |_| {});
    let info = model.info();
    assert_eq!(info.model_type, "gpt_oss");
    assert_eq!((info.experts, info.experts_per_token), (8, 2));
    let vocab = info.vocab_size;
    // 20 positions: well past the window of 8 on the sliding layers.
    let tokens: Vec<u32> = (0..20).map(|i| (i * 97 + 5) % 1000).collect();
    let b = model.backend();
    let prefill = prefill(&model, &tokens);
    assert_eq!(prefill.len(), tokens.len() * vocab);
    assert!(prefill.iter().all(|x| x.is_finite()), "non-finite logits");
    let rms = (prefill.iter().map(|x| x * x).sum::<f32>() / prefill.len() as f32).sqrt();
    assert!(rms > 1e-3, "logits are all ~0 (rms {rms})");

    let mut state = model.new_state().unwrap();
    let mut worst = 0f32;
    let max_ref = prefill.iter().fold(0f32, |m, x| m.max(x.abs()));
    for (i, &t) in tokens.iter().enumerate() {
        let step = b
            .to_host(&model.forward(&mut state, &[t], false).unwrap())
            .unwrap();
        assert!(step.iter().all(|x| x.is_finite()), "step {i}");
        let row = &prefill[i * vocab..(i + 1) * vocab];
        for (a, r) in step.iter().zip(row) {
            worst = worst.max((a - r).abs());
        }
    }
    assert!(
        worst <= 1e-2 * max_ref,
        "decode vs prefill: {worst} of {max_ref}"
    );
}

#[test]
fn tiny_gpt_oss_window_changes_only_positions_past_it() {
    let tokens: Vec<u32> = (0..16).map(|i| (i * 31 + 7) % 1000).collect();
    let (_a, windowed) = load("tiny-gpt-oss", |_| {});
    let (_b, full) = load("tiny-gpt-oss", |c| c["sliding_window"] = 4096.into());
    let (w, f) = (prefill(&windowed, &tokens), prefill(&full, &tokens));
    let vocab = windowed.info().vocab_size;
    let diff = |p: usize| {
        let (w, f) = (
            &w[p * vocab..(p + 1) * vocab],
            &f[p * vocab..(p + 1) * vocab],
        );
        w.iter().zip(f).fold(0f32, |m, (a, b)| m.max((a - b).abs()))
    };
    // Positions 0..8 see at most 8 keys, inside the window of 8: the same either way.
    for p in 0..8 {
        assert!(diff(p) < 1e-5, "position {p}: {}", diff(p));
    }
    // Past it the sliding layers drop the oldest keys.
    assert!(diff(15) > 1e-3, "the window had no effect: {}", diff(15));
}

#[test]
fn every_tiny_preset_loads_and_gives_finite_logits() {
    let tokens: Vec<u32> = (0..12).map(|i| (i * 53 + 11) % 1000).collect();
    for p in sluice_synth::PRESETS
        .iter()
        .filter(|p| p.name.starts_with("tiny-"))
    {
        let (_tmp, model) = load(p.name, |_| {});
        let logits = prefill(&model, &tokens);
        assert_eq!(logits.len(), tokens.len() * p.vocab_size, "{}", p.name);
        assert!(logits.iter().all(|x| x.is_finite()), "{}", p.name);
    }
}
