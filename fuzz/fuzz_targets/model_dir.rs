//! A model directory's JSON files: `config.json`, `tokenizer_config.json` and
//! `generation_config.json` (the input, split at zero bytes; a missing part keeps the fixture's
//! own), loaded as `sluice generate` loads a model, beside the weights and tokenizer of a small
//! Qwen3.5-MoE fixture.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_engine::{Engine, LoadOptions};

const FILES: [&str; 3] = [
    "config.json",
    "tokenizer_config.json",
    "generation_config.json",
];
const FIXED: [&str; 3] = [
    "model.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
];

fuzz_target!(|data: &[u8]| {
    sluice_fuzz::allow_caught_panics();
    let fixture = sluice_fuzz::fixture("qwen3_5_moe-q4");
    let dir = sluice_fuzz::fresh_dir("model");
    let parts = sluice_fuzz::parts(data, FILES.len());
    for (i, name) in FILES.iter().enumerate() {
        match parts.get(i) {
            Some(bytes) => {
                sluice_fuzz::write(&dir, name, bytes);
            }
            None => sluice_fuzz::link(&dir, name, &fixture.join(name)),
        }
    }
    for name in FIXED {
        sluice_fuzz::link(&dir, name, &fixture.join(name));
    }
    let _ = Engine::load(&dir, sluice_fuzz::cpu(), &LoadOptions::default());
});
