//! A tiktoken `tiktoken.model` (Kimi K2's tokenizer) with the input as its `tokenizer_config.json`
//! when the input holds a zero byte (`MODEL \0 CONFIG`), else the fixture's: loaded, then a mixed
//! text encoded and decoded.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_engine::tokenizer::Tokenizer;

const TEXT: &str = "Hello 世界 🙂 fn main() {}\n\t<|im_start|>user  x";

fuzz_target!(|data: &[u8]| {
    let fixture = sluice_fuzz::repo().join("crates/sluice-engine/tests/data/tiktoken");
    let dir = sluice_fuzz::fresh_dir("tiktoken");
    let parts = sluice_fuzz::parts(data, 2);
    sluice_fuzz::write(&dir, "tiktoken.model", parts[0]);
    match parts.get(1) {
        Some(config) => {
            sluice_fuzz::write(&dir, "tokenizer_config.json", config);
        }
        None => sluice_fuzz::link(
            &dir,
            "tokenizer_config.json",
            &fixture.join("tokenizer_config.json"),
        ),
    }
    let Ok(tok) = Tokenizer::from_tiktoken_dir(&dir) else {
        return;
    };
    if let Ok(ids) = tok.encode(TEXT, true) {
        let _ = tok.decode(&ids, false);
    }
});
