//! Text ↔ token ids through a model's `tokenizer.json` (or Kimi K2's `tiktoken.model`), and
//! streaming detokenization.
//!
//! [`Tokenizer`] wraps the Hugging Face `tokenizers` crate, or for a directory that ships
//! `tiktoken.model` instead of `tokenizer.json` (Kimi K2) a tiktoken BPE ([`tiktoken`]), so the
//! rest of the engine sees one small API with errors that name the file. [`StreamDecoder`]
//! turns generated ids into text deltas as they arrive. Decoding each token on its own is wrong
//! twice over: byte-level BPE tokens can end in the middle of a UTF-8 character (so the text
//! would show U+FFFD), and some decoders change a token's text depending on what precedes it
//! (SentencePiece's leading-space strip). It therefore uses the technique of text-generation-inference's `decode_token`: decode
//! a short window that starts a few tokens back (`prefix_offset`), subtract the text of the part
//! already emitted (up to `read_offset`), and hold back while the result ends in an incomplete
//! character. Each step costs O(window), and the deltas concatenated equal `decode(all ids)`.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

pub mod tiktoken;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {}: {message}", path.display())]
    Load { path: PathBuf, message: String },
    #[error("tokenizer failed to encode text: {0}")]
    Encode(String),
    #[error("tokenizer failed to decode ids: {0}")]
    Decode(String),
}

/// A loaded `tokenizer.json` or `tiktoken.model`.
pub struct Tokenizer {
    inner: Inner,
    /// The special tokens that decoding with `skip_special` drops: all but the markers the
    /// output parser reads ([`crate::output::MARKERS`]), which some tokenizers mark special.
    dropped_special: HashSet<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish_non_exhaustive()
    }
}

enum Inner {
    Hf(Box<tokenizers::Tokenizer>),
    Tiktoken(Box<tiktoken::Tiktoken>),
}

fn one_line(s: impl std::fmt::Display) -> String {
    s.to_string().lines().collect::<Vec<_>>().join(" ")
}

/// The message of a caught panic.
fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    let text = match (panic.downcast_ref::<&str>(), panic.downcast_ref::<String>()) {
        (Some(s), _) => s.to_string(),
        (_, Some(s)) => s.clone(),
        _ => "a panic in the tokenizers library".to_string(),
    };
    one_line(text)
}

impl Tokenizer {
    /// Loads a Hugging Face `tokenizer.json`. When `path` is a model directory's
    /// `tokenizer.json` that does not exist but `tiktoken.model` does beside it (Kimi K2), loads
    /// that instead ([`Tokenizer::from_tiktoken_dir`]).
    pub fn from_file(path: &Path) -> Result<Self, TokenizerError> {
        if let (false, Some("tokenizer.json"), Some(dir)) = (
            path.exists(),
            path.file_name().and_then(|n| n.to_str()),
            path.parent(),
        ) {
            if dir.join(tiktoken::MODEL_FILE).is_file() {
                return Self::from_tiktoken_dir(dir);
            }
        }
        let load_err = |message: String| TokenizerError::Load {
            path: path.to_path_buf(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| load_err(one_line(e)))?;
        Self::from_bytes(&bytes, path)
    }

    /// Loads a `tokenizer.json` held in memory (a GGUF's, built from its metadata); `path`
    /// names where it came from in errors.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<Self, TokenizerError> {
        let load_err = |message: String| TokenizerError::Load {
            path: path.to_path_buf(),
            message,
        };
        // `tokenizers` panics on some malformed files (a decoder with fields of the wrong type,
        // found by fuzzing): that is a bad file too, not a crash.
        let parsed = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(bytes))
            .map_err(|panic| load_err(format!("malformed tokenizer: {}", panic_text(&*panic))))?;
        let inner = parsed.map_err(|e| load_err(one_line(e)))?;
        Ok(Self::from_inner(inner))
    }

    /// Loads Kimi K2's tokenizer from a model directory: `tiktoken.model` and the special
    /// tokens of `tokenizer_config.json`'s `added_tokens_decoder`, encoding and decoding as
    /// its `tokenization_kimi.py` does (see [`tiktoken`]). Errors name the file at fault.
    pub fn from_tiktoken_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tk = tiktoken::Tiktoken::from_dir(dir)
            .map_err(|(path, message)| TokenizerError::Load { path, message })?;
        let dropped_special = tk
            .added()
            .iter()
            .filter(|t| t.special && !crate::output::MARKERS.contains(&t.content.as_str()))
            .map(|t| t.id)
            .collect();
        Ok(Tokenizer {
            inner: Inner::Tiktoken(Box::new(tk)),
            dropped_special,
        })
    }

    /// Wraps an already built `tokenizers` tokenizer.
    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        let dropped_special = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !crate::output::MARKERS.contains(&t.content.as_str()))
            .map(|(id, _)| id)
            .collect();
        Tokenizer {
            inner: Inner::Hf(Box::new(inner)),
            dropped_special,
        }
    }

    /// The `tokenizers` tokenizer, if this is one (`None` for a tiktoken model).
    pub fn inner(&self) -> Option<&tokenizers::Tokenizer> {
        match &self.inner {
            Inner::Hf(t) => Some(t),
            Inner::Tiktoken(_) => None,
        }
    }

    /// Token ids of `text`. `add_special_tokens` runs the tokenizer's post-processor (e.g. a BOS
    /// token; a tiktoken model has none, as Kimi's `TikTokenTokenizer` adds nothing); special
    /// tokens written in the text (`<|im_start|>`) are recognised either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.inner {
            Inner::Hf(t) => {
                let enc = t
                    .encode(text, add_special_tokens)
                    .map_err(|e| TokenizerError::Encode(one_line(e)))?;
                Ok(enc.get_ids().to_vec())
            }
            Inner::Tiktoken(t) => Ok(t.encode(text)),
        }
    }

    /// Text of `ids`; ids outside the vocabulary are skipped. `skip_special` drops special
    /// tokens such as `<|im_end|>`, but not the reasoning and tool-call markers that
    /// [`crate::output`] reads, special or not.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let kept: Vec<u32>;
        let ids = match skip_special && ids.iter().any(|i| self.dropped_special.contains(i)) {
            true => {
                kept = ids
                    .iter()
                    .copied()
                    .filter(|i| !self.dropped_special.contains(i))
                    .collect();
                &kept
            }
            false => ids,
        };
        match &self.inner {
            Inner::Hf(t) => t
                .decode(ids, false)
                .map_err(|e| TokenizerError::Decode(one_line(e))),
            Inner::Tiktoken(t) => Ok(t.decode(ids)),
        }
    }

    /// The id of a token written exactly as in the vocabulary (added tokens included; a
    /// tiktoken model's tokens as byte-level strings, as its `tokenization_kimi.py` has them).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Inner::Hf(t) => t.token_to_id(token),
            Inner::Tiktoken(t) => t.token_id(token),
        }
    }

    /// The vocabulary entry of `id`, if any.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.inner {
            Inner::Hf(t) => t.id_to_token(id),
            Inner::Tiktoken(t) => t.id_to_token(id),
        }
    }

    /// Number of tokens, added tokens included (a tiktoken model: one past its highest id).
    pub fn vocab_size(&self) -> usize {
        match &self.inner {
            Inner::Hf(t) => t.get_vocab_size(true),
            Inner::Tiktoken(t) => t.n_vocab(),
        }
    }
}

/// Incremental detokenizer for streaming: push ids, get text deltas that never split a UTF-8
/// character (byte-level BPE tokens can end mid-character: held back until complete) and that,
/// concatenated, equal `decode(all ids)`.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    /// Ids from `prefix_offset` on; earlier ones are no longer needed.
    ids: Vec<u32>,
    /// Start of the emitted context window inside `ids` (always 0 after compaction).
    prefix_offset: usize,
    /// End of what has been emitted.
    read_offset: usize,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one generated id; returns the newly complete text, if any.
    pub fn push(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        let prefix = self.decode(self.prefix_offset, self.read_offset)?;
        let text = self.decode(self.prefix_offset, self.ids.len())?;
        let delta = match text.get(prefix.len()..) {
            Some(d) if !d.is_empty() && !text.ends_with('\u{FFFD}') => d.to_string(),
            _ => return Ok(None),
        };
        // The emitted tokens become the next window's context.
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        Ok(Some(delta))
    }

    /// Flushes what is held back (an incomplete character at the very end decodes as U+FFFD,
    /// as in `decode`), and resets the decoder.
    pub fn finish(&mut self) -> Result<Option<String>, TokenizerError> {
        let prefix = self.decode(self.prefix_offset, self.read_offset)?;
        let text = self.decode(self.prefix_offset, self.ids.len())?;
        self.ids.clear();
        self.prefix_offset = 0;
        self.read_offset = 0;
        Ok(text
            .get(prefix.len()..)
            .filter(|d| !d.is_empty())
            .map(str::to_string))
    }

    fn decode(&self, from: usize, to: usize) -> Result<String, TokenizerError> {
        if from >= to {
            return Ok(String::new());
        }
        self.tok.decode(&self.ids[from..to], self.skip_special)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Found by fuzzing: `tokenizers` panics (inside its decoder's deserializer) on a
    /// `"decoder"` object whose first key is not a string; that must be a load error.
    #[test]
    fn a_malformed_decoder_is_a_load_error_not_a_panic() {
        let fixture = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/qwen3_5_moe-q4"
        );
        let text = std::fs::read_to_string(Path::new(fixture).join("tokenizer.json")).unwrap();
        let broken = text.replacen("\"decoder\": {", "\"decoder\": {\n  {", 1);
        assert_ne!(broken, text);
        let Err(e) = Tokenizer::from_bytes(broken.as_bytes(), Path::new("x/tokenizer.json")) else {
            panic!("a malformed file must not load");
        };
        let msg = e.to_string();
        assert!(msg.contains("x/tokenizer.json"), "{msg}");
    }

    /// GPT-2's byte → printable char map used by byte-level BPE.
    fn byte_char(b: u8) -> char {
        let printable =
            |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        if printable(b) {
            return b as char;
        }
        let n = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + n).unwrap()
    }

    fn bl(s: &str) -> Vec<String> {
        s.bytes().map(|b| byte_char(b).to_string()).collect()
    }

    /// A byte-level BPE tokenizer.json (Qwen/GPT-2 style): every byte is a token, plus merges
    /// that build some whole words and some tokens that end or start mid-character.
    fn byte_level_json() -> serde_json::Value {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            let n = vocab.len();
            vocab.insert(byte_char(b).to_string(), json!(n));
        }
        let mut merges: Vec<String> = Vec::new();
        let mut merge =
            |a: &str, b: &str, vocab: &mut serde_json::Map<String, serde_json::Value>| {
                let ab = format!("{a}{b}");
                if !vocab.contains_key(&ab) {
                    let n = vocab.len();
                    vocab.insert(ab, json!(n));
                    merges.push(format!("{a} {b}"));
                }
            };
        // Left-to-right merges of whole strings: " hello", " world", "Hello".
        for w in [" hello", " world", "Hello", "é", " café"] {
            let chars = bl(w);
            let mut acc = chars[0].clone();
            for c in &chars[1..] {
                merge(&acc, c, &mut vocab);
                acc = format!("{acc}{c}");
            }
        }
        // Pairs of bytes that straddle character boundaries: "世界" = E4 B8 96 | E7 95 8C
        // becomes [E4 B8] [96 E7] [95 8C]; 😀 = F0 9F 98 80 becomes [F0 9F] [98] [80].
        for (a, b) in [(0xE4u8, 0xB8u8), (0x96, 0xE7), (0x95, 0x8C), (0xF0, 0x9F)] {
            merge(
                &byte_char(a).to_string(),
                &byte_char(b).to_string(),
                &mut vocab,
            );
        }
        let n = vocab.len();
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": n, "content": "<|im_end|>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true},
                {"id": n + 1, "content": "<think>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": false}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                "vocab": vocab, "merges": merges
            }
        })
    }

    /// A SentencePiece-style tokenizer.json (Llama/Mistral): Metaspace, byte fallback, and a
    /// decoder that strips the leading space, so a token's text depends on its position.
    fn sentencepiece_json() -> serde_json::Value {
        let mut vocab = vec![
            json!(["<unk>", 0.0]),
            json!(["<s>", 0.0]),
            json!(["</s>", 0.0]),
        ];
        for b in 0..=255u8 {
            vocab.push(json!([format!("<0x{b:02X}>"), 0.0]));
        }
        for (i, p) in [
            "▁", "▁hello", "▁world", "▁ca", "f", "é", "▁Hello", ",", "!", "a", "o",
        ]
        .iter()
        .enumerate()
        {
            vocab.push(json!([p, -(i as f64)]));
        }
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
            },
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}
            ]},
            "model": {"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": true}
        })
    }

    /// Writes `v` to `name` in a directory of its own (tests run in parallel threads of one
    /// process; a shared name let one test read another's half-written file), removed when the
    /// returned guard drops.
    fn write_tmp(name: &str, v: &serde_json::Value) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, serde_json::to_vec(v).unwrap()).unwrap();
        (dir, path)
    }

    /// The tokenizer of `v` (read whole at load, so its file may go at once).
    fn from_json(name: &str, v: &serde_json::Value) -> Tokenizer {
        let (_dir, path) = write_tmp(name, v);
        Tokenizer::from_file(&path).unwrap()
    }

    fn byte_level() -> Tokenizer {
        from_json("byte_level.json", &byte_level_json())
    }

    fn sentencepiece() -> Tokenizer {
        from_json("sentencepiece.json", &sentencepiece_json())
    }

    const TEXTS: [&str; 6] = [
        "Hello world, hello café!",
        "世界 and 世界世界",
        "emoji 😀😀 then 👍🏽 and 🇫🇷 flag",
        "accents: éàüñ ÅØ, mixed 日本語テキスト and Ελληνικά",
        " leading space and trailing  ",
        "a\nb\tc\u{0}d\u{FFFD}e",
    ];

    /// Streams `ids` and checks every delta and their concatenation against `decode`.
    fn check_stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) {
        let full = tok.decode(ids, skip_special).unwrap();
        let mut stream = StreamDecoder::new(tok, skip_special);
        let mut out = String::new();
        for &id in ids {
            if let Some(d) = stream.push(id).unwrap() {
                assert!(
                    full.contains('\u{FFFD}') || !d.contains('\u{FFFD}'),
                    "delta {d:?} has U+FFFD, full text {full:?}"
                );
                out.push_str(&d);
            }
            // The decoder's window stays short.
            assert!(stream.ids.len() <= 8, "window grew to {}", stream.ids.len());
        }
        if let Some(d) = stream.finish().unwrap() {
            out.push_str(&d);
        }
        assert_eq!(out, full, "ids {ids:?}");
    }

    #[test]
    fn byte_level_round_trip_and_stream() {
        let tok = byte_level();
        for text in TEXTS {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
            check_stream(&tok, &ids, false);
            check_stream(&tok, &ids, true);
        }
        // The merges make tokens that split characters, which the stream must hold back.
        let ids = tok.encode("世界", false).unwrap();
        assert_eq!(ids.len(), 3, "{ids:?}");
        assert!(tok.decode(&ids[..1], false).unwrap().contains('\u{FFFD}'));
        let mut s = StreamDecoder::new(&tok, false);
        assert_eq!(s.push(ids[0]).unwrap(), None);
        assert_eq!(
            s.push(ids[1]).unwrap(),
            None,
            "世 is complete but 界 has started"
        );
        assert_eq!(s.push(ids[2]).unwrap().as_deref(), Some("世界"));
        assert_eq!(s.finish().unwrap(), None);
    }

    /// Tool-call markers that a tokenizer marks special (Kimi K2's; GGUF conversions of
    /// DeepSeek's; all of gpt-oss's harmony markers) survive `skip_special`, which still drops
    /// the other special tokens.
    #[test]
    fn special_markers_survive_skip_special() {
        let mut json = byte_level_json();
        let added = json["added_tokens"].as_array_mut().unwrap();
        let n = added.last().unwrap()["id"].as_u64().unwrap() + 1;
        for (i, content) in ["<|tool_calls_section_begin|>", "<｜tool▁sep｜>", "<|eot|>"]
            .into_iter()
            .chain(HARMONY)
            .enumerate()
        {
            added.push(
                json!({"id": n + i as u64, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
            );
        }
        let tok = from_json("markers.json", &json);
        let text = "Hi<|tool_calls_section_begin|>f<｜tool▁sep｜>{}<|eot|><|im_end|>";
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            "Hi<|tool_calls_section_begin|>f<｜tool▁sep｜>{}"
        );
        check_stream(&tok, &ids, true);
        // gpt-oss's answer, all its markers special tokens (as in its tokenizer.json).
        let text = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|><|return|><|eot|>";
        let ids = tok.encode(text, false).unwrap();
        assert!(HARMONY
            .iter()
            .all(|m| ids.contains(&tok.token_id(m).unwrap())));
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            text.strip_suffix("<|eot|>").unwrap()
        );
        check_stream(&tok, &ids, true);
    }

    const HARMONY: [&str; 7] = [
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|return|>",
        "<|call|>",
    ];

    #[test]
    fn special_tokens() {
        let tok = byte_level();
        let end = tok.token_id("<|im_end|>").unwrap();
        let think = tok.token_id("<think>").unwrap();
        assert_eq!(tok.vocab_size(), end as usize + 2);
        assert_eq!(tok.token_id("no such token"), None);
        let ids = tok.encode("<think>Hello 世界<|im_end|>", false).unwrap();
        assert_eq!(ids[0], think);
        assert_eq!(*ids.last().unwrap(), end);
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            "<think>Hello 世界<|im_end|>"
        );
        assert_eq!(tok.decode(&ids, true).unwrap(), "<think>Hello 世界");
        check_stream(&tok, &ids, true);
        check_stream(&tok, &ids, false);
        // Out-of-vocabulary ids are skipped, not a panic.
        assert_eq!(
            tok.decode(&[u32::MAX, ids[1]], false).unwrap(),
            tok.decode(&ids[1..2], false).unwrap()
        );
        let mut s = StreamDecoder::new(&tok, false);
        assert_eq!(s.push(u32::MAX).unwrap(), None);
        assert_eq!(s.finish().unwrap(), None);
    }

    #[test]
    fn truncated_character_is_flushed_by_finish() {
        let tok = byte_level();
        let ids = tok.encode("ok 😀", false).unwrap();
        let cut = &ids[..ids.len() - 1];
        let full = tok.decode(cut, false).unwrap();
        assert!(full.ends_with('\u{FFFD}'));
        let mut s = StreamDecoder::new(&tok, false);
        let mut out = String::new();
        for &id in cut {
            out.extend(s.push(id).unwrap());
        }
        assert_eq!(out, "ok ");
        out.extend(s.finish().unwrap());
        assert_eq!(out, full);
    }

    #[test]
    fn sentencepiece_stream_keeps_spaces() {
        let tok = sentencepiece();
        for text in ["Hello world, hello café!", "hello 世界 😀 world", "a  o"] {
            let ids = tok.encode(text, true).unwrap();
            assert_eq!(ids[0], 1, "BOS from the post-processor");
            assert_eq!(tok.decode(&ids, true).unwrap(), text);
            check_stream(&tok, &ids, true);
            let ids = tok.encode(text, false).unwrap();
            assert_ne!(ids[0], 1);
            check_stream(&tok, &ids, false);
        }
    }

    #[test]
    fn load_errors_name_the_file() {
        let missing = Path::new("/nonexistent/dir/tokenizer.json");
        let err = Tokenizer::from_file(missing).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("cannot load tokenizer /nonexistent/dir/tokenizer.json: "),
            "{msg}"
        );
        let (_dir, bad) = write_tmp(
            "bad.json",
            &json!({"version": "1.0", "model": {"type": "BPE", "vocab": 3}}),
        );
        let msg = Tokenizer::from_file(&bad).unwrap_err().to_string();
        assert!(msg.contains("bad.json") && !msg.contains('\n'), "{msg}");
    }
}
