//! A GGUF file opened as a model, as `sluice generate --model FILE.gguf` does: header, metadata,
//! tensor table, the model config and tokenizer built from the metadata, quantised blocks
//! converted, the model loaded.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_engine::{Engine, LoadOptions};

fuzz_target!(|data: &[u8]| {
    sluice_fuzz::allow_caught_panics();
    let dir = sluice_fuzz::scratch();
    let path = sluice_fuzz::write(dir, "model.gguf", data);
    if let Ok(file) = sluice_format::gguf::GgufFile::open(&path) {
        let _ = sluice_format::gguf_tokenizer::tokenizer_json(&file);
    }
    let _ = Engine::load(&path, sluice_fuzz::cpu(), &LoadOptions::default());
});
