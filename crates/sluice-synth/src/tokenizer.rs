//! A byte-level BPE tokenizer with exactly the preset's number of tokens.
//!
//! The 256 byte symbols come first (GPT-2's byte-to-unicode mapping, as Qwen's tokenizers use),
//! then random merges of existing tokens up to `special_tokens_start`, then Qwen's special tokens.
//! Any text encodes (every byte has a token) and every id below the vocabulary size decodes, so
//! the checkpoint behaves like the real one for loading, chat templates and speed.

use std::collections::HashSet;

use serde_json::{json, Value};

use crate::plan::mix;
use crate::presets::{Family, Preset, SPECIAL_TOKENS};

const QWEN3_TEMPLATE: &str = include_str!("../templates/qwen3.jinja");
const QWEN35_TEMPLATE: &str = include_str!("../templates/qwen3_5.jinja");

/// GPT-2's reversible byte -> printable char mapping, in its canonical order.
fn byte_symbols() -> Vec<(u8, char)> {
    let mut printable: Vec<u8> = (b'!'..=b'~').collect();
    printable.extend(0xA1u8..=0xAC);
    printable.extend(0xAEu8..=0xFF);
    let mut out: Vec<(u8, char)> = printable.iter().map(|&b| (b, b as char)).collect();
    let mut n = 0u32;
    for b in 0..=255u8 {
        if !printable.contains(&b) {
            out.push((b, char::from_u32(256 + n).expect("valid code point")));
            n += 1;
        }
    }
    out
}

/// `tokenizer.json` for `preset`.
pub fn tokenizer_json(preset: &Preset, seed: u64) -> Value {
    let regular = preset.special_tokens_start;
    let mut tokens: Vec<String> = byte_symbols()
        .into_iter()
        .map(|(_, c)| c.to_string())
        .collect();
    let mut seen: HashSet<String> = tokens.iter().cloned().collect();
    let mut merges: Vec<Value> = Vec::with_capacity(regular.saturating_sub(256));
    let mut state = mix(seed ^ 0x70ce);
    let mut next = || {
        state = mix(state);
        state
    };
    while tokens.len() < regular {
        // Skewed towards short (early) tokens, so merged tokens stay word-sized.
        let pick = |r: u64, n: usize| -> usize {
            let u = (r >> 11) as f64 / (1u64 << 53) as f64;
            ((u * u * u) * n as f64) as usize
        };
        let n = tokens.len();
        let (a, b) = (pick(next(), n), pick(next(), n));
        let merged = format!("{}{}", tokens[a], tokens[b]);
        if merged.chars().count() > 16 || !seen.insert(merged.clone()) {
            continue;
        }
        merges.push(json!([tokens[a], tokens[b]]));
        tokens.push(merged);
    }
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(i, (content, special))| {
            json!({
                "id": regular + i, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            })
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
        ]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    })
}

/// `tokenizer_config.json` for `preset`, with the real model's chat template.
pub fn tokenizer_config_json(preset: &Preset) -> Value {
    let mut decoder = serde_json::Map::new();
    for (i, (content, special)) in SPECIAL_TOKENS.iter().enumerate() {
        decoder.insert(
            (preset.special_tokens_start + i).to_string(),
            json!({"content": content, "lstrip": false, "normalized": false, "rstrip": false,
                   "single_word": false, "special": special}),
        );
    }
    let template = match preset.family {
        // The synthetic vocabulary has Qwen's special tokens, so the others get Qwen3's template
        // (gpt-oss's harmony template would need o200k_harmony's, which it does not have).
        Family::Qwen3Moe
        | Family::Mixtral
        | Family::Glm4Moe
        | Family::DeepseekV3
        | Family::GptOss => QWEN3_TEMPLATE,
        Family::Qwen35Moe => QWEN35_TEMPLATE,
    };
    json!({
        "add_bos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": SPECIAL_TOKENS[1..].iter().map(|t| t.0).collect::<Vec<_>>(),
        "bos_token": null,
        "chat_template": template,
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": preset.max_position_embeddings,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": false,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": null,
    })
}

/// `generation_config.json` with Qwen's recommended sampling.
pub fn generation_config_json(preset: &Preset) -> Value {
    json!({
        "bos_token_id": preset.special_tokens_start,
        "do_sample": true,
        "eos_token_id": [preset.eos_token_id(), preset.special_tokens_start],
        "pad_token_id": preset.special_tokens_start,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_symbols_are_a_bijection() {
        let s = byte_symbols();
        assert_eq!(s.len(), 256);
        let bytes: HashSet<u8> = s.iter().map(|p| p.0).collect();
        let chars: HashSet<char> = s.iter().map(|p| p.1).collect();
        assert_eq!((bytes.len(), chars.len()), (256, 256));
        assert_eq!(s[0], (b'!', '!'));
        // Space maps to 'Ġ' as in GPT-2 / Qwen vocabularies.
        assert!(s.contains(&(b' ', 'Ġ')));
    }

    #[test]
    fn vocabulary_has_the_exact_size_and_valid_merges() {
        let p = Preset::find("tiny-qwen3-moe").unwrap();
        let t = tokenizer_json(p, 3);
        let vocab = t["model"]["vocab"].as_object().unwrap();
        assert_eq!(vocab.len(), p.special_tokens_start);
        for m in t["model"]["merges"].as_array().unwrap() {
            let (a, b) = (m[0].as_str().unwrap(), m[1].as_str().unwrap());
            assert!(vocab.contains_key(a) && vocab.contains_key(b));
            assert!(vocab.contains_key(&format!("{a}{b}")));
        }
        let added = t["added_tokens"].as_array().unwrap();
        assert_eq!(added[2]["content"], "<|im_end|>");
        assert_eq!(added[2]["id"], p.eos_token_id());
    }
}
