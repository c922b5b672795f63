//! A `tokenizer.json`: loaded, then a mixed text encoded, decoded whole and decoded as a stream.
#![no_main]
use libfuzzer_sys::fuzz_target;
use sluice_engine::tokenizer::{StreamDecoder, Tokenizer};

const TEXT: &str = "Hello 世界 🙂 fn main() {}\n\t<|im_start|>user  x</think>";

fuzz_target!(|data: &[u8]| {
    sluice_fuzz::allow_caught_panics();
    let Ok(tok) = Tokenizer::from_bytes(data, std::path::Path::new("tokenizer.json")) else {
        return;
    };
    let Ok(ids) = tok.encode(TEXT, true) else {
        return;
    };
    let _ = tok.decode(&ids, false);
    let mut stream = StreamDecoder::new(&tok, true);
    for &id in ids.iter().chain([0, u32::MAX].iter()) {
        let _ = stream.push(id);
    }
    let _ = stream.finish();
    let _ = tok.vocab_size();
});
