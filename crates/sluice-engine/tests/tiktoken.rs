//! Kimi K2's tiktoken tokenizer against tiktoken itself.
//!
//! `tests/data/tiktoken/` is a model directory's tokenizer files without `tokenizer.json`: a
//! small BPE as `tiktoken.model`, a Kimi-style `tokenizer_config.json`, and `cases.json`, the
//! ids that tiktoken set up as Kimi's `tokenization_kimi.py` sets it up gives for each text
//! (written by `scripts/make_tiktoken_fixture.py`). The tokenizer is loaded as the engine loads
//! a model directory's: `Tokenizer::from_file(dir/tokenizer.json)`.

use std::path::{Path, PathBuf};

use serde_json::Value;
use sluice_engine::chat::{ChatMessage, ChatTemplate};
use sluice_engine::tokenizer::{StreamDecoder, Tokenizer};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tiktoken")
}

fn load() -> Tokenizer {
    Tokenizer::from_file(&data_dir().join("tokenizer.json")).unwrap()
}

/// Number of BPE ranks in the fixture (its special ids follow).
fn n_ranks() -> u32 {
    let text = std::fs::read_to_string(data_dir().join("tiktoken.model")).unwrap();
    text.lines().filter(|l| !l.trim().is_empty()).count() as u32
}

struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
}

fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(data_dir().join("cases.json")).unwrap();
    let rows: Vec<Value> = serde_json::from_str(&text).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect()
    };
    rows.iter()
        .map(|r| {
            let text = match (&r["text"], &r["repeat"]) {
                (Value::String(s), _) => s.clone(),
                (_, Value::Array(parts)) => parts
                    .iter()
                    .map(|p| {
                        p[0].as_str()
                            .unwrap()
                            .repeat(p[1].as_u64().unwrap() as usize)
                    })
                    .collect(),
                _ => panic!("case without text: {r}"),
            };
            let ids = match &r["ids"] {
                Value::Array(_) => ids(&r["ids"]),
                _ => r["ids_runs"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|run| {
                        let block = ids(&run[0]);
                        let n = run[1].as_u64().unwrap() as usize;
                        std::iter::repeat_n(block, n).flatten()
                    })
                    .collect(),
            };
            Case {
                name: r["name"].as_str().unwrap().to_string(),
                text,
                ids,
            }
        })
        .collect()
}

#[test]
fn encodes_and_decodes_as_tiktoken() {
    let tok = load();
    let cases = cases();
    assert!(cases.len() > 400, "{} cases", cases.len());
    let mut failed = Vec::new();
    for c in &cases {
        let ids = tok.encode(&c.text, false).unwrap();
        if ids != c.ids {
            let at = ids.iter().zip(&c.ids).take_while(|(a, b)| a == b).count();
            failed.push(format!(
                "{}: first difference at {at}: got {:?}, tiktoken {:?}",
                c.name,
                &ids[at..(at + 8).min(ids.len())],
                &c.ids[at..(at + 8).min(c.ids.len())]
            ));
            continue;
        }
        // No BOS or other post-processing: Kimi's `encode` adds none.
        if c.text.len() < 1000 {
            assert_eq!(tok.encode(&c.text, true).unwrap(), ids, "{}", c.name);
        }
        assert_eq!(tok.decode(&ids, false).unwrap(), c.text, "{}", c.name);
    }
    assert!(
        failed.is_empty(),
        "{} of {} cases differ:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}

#[test]
fn special_tokens_of_the_config() {
    let tok = load();
    let n = n_ranks();
    // 256 special ids after the ranks: the named ones at Kimi K2's offsets, the others reserved.
    assert_eq!(tok.vocab_size(), (n + 256) as usize);
    for (off, name) in [
        (0, "[BOS]"),
        (1, "[EOS]"),
        (2, "<|im_end|>"),
        (3, "<|im_user|>"),
        (17, "<|im_middle|>"),
        (22, "<think>"),
        (255, "[PAD]"),
    ] {
        assert_eq!(tok.token_id(name), Some(n + off), "{name}");
        assert_eq!(tok.id_to_token(n + off).as_deref(), Some(name));
        assert_eq!(tok.encode(name, false).unwrap(), [n + off]);
    }
    let reserved = format!("<|reserved_token_{}|>", n + 100);
    assert_eq!(tok.token_id(&reserved), Some(n + 100));
    // Vocabulary strings are byte-level: the token " world" is written "Ġworld".
    let world = tok.encode(" world", false).unwrap();
    assert_eq!(world.len(), 1);
    assert_eq!(tok.id_to_token(world[0]).as_deref(), Some("Ġworld"));
    assert_eq!(tok.token_id("Ġworld"), Some(world[0]));
    assert_eq!(tok.token_id("no such token"), None);
    assert!(tok.inner().is_none());

    // skip_special drops the specials but not the markers the output parser reads.
    let text = "<|im_assistant|>assistant<|im_middle|><think>hm</think>ok\
                <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0\
                <|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>[EOS]";
    let ids = tok.encode(text, false).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "assistant<think>hm</think>ok<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0\
         <|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"
    );
    // Out-of-vocabulary ids are skipped.
    assert_eq!(
        tok.decode(&[u32::MAX, ids[0]], false).unwrap(),
        "<|im_assistant|>"
    );
}

/// Kimi K2's chat template prints its role markers as text; encoding makes them the special ids.
#[test]
fn kimi_chat_template_markers_become_special_ids() {
    let tok = load();
    let n = n_ranks();
    let source = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/kimi_k2_instruct_chat_template.jinja"),
    )
    .unwrap();
    let template = ChatTemplate::new(&source, Some("[BOS]".into()), Some("[EOS]".into())).unwrap();
    let messages = [
        ChatMessage::new("system", "You are Kimi."),
        ChatMessage::new("user", "你好, what's 12345?"),
    ];
    let text = template
        .render(&messages, None, true, &serde_json::Map::new())
        .unwrap();
    assert!(
        text.starts_with("<|im_system|>system<|im_middle|>"),
        "{text}"
    );
    let ids = tok.encode(&text, false).unwrap();
    let im_system = n + 10;
    let im_middle = n + 17;
    let im_user = n + 3;
    let im_assistant = n + 4;
    let im_end = n + 2;
    assert_eq!(ids[0], im_system);
    for id in [im_middle, im_user, im_assistant, im_end] {
        assert!(ids.contains(&id), "{id} missing from {ids:?}");
    }
    // No marker was spelled out in BPE tokens: decoding the non-special ids leaves no `<|`.
    let plain: Vec<u32> = ids.iter().copied().filter(|&i| i < n).collect();
    assert!(!tok.decode(&plain, false).unwrap().contains("<|"));
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
}

#[test]
fn streaming_decode_matches_decode() {
    let tok = load();
    for c in cases().iter().filter(|c| c.text.len() < 200) {
        let full = tok.decode(&c.ids, true).unwrap();
        let mut s = StreamDecoder::new(&tok, true);
        let mut out = String::new();
        for &id in &c.ids {
            out.extend(s.push(id).unwrap());
        }
        out.extend(s.finish().unwrap());
        assert_eq!(out, full, "{}", c.name);
    }
}

/// A directory with `model` as tiktoken.model and, if given, `config` as tokenizer_config.json.
fn dir_with(model: &str, config: Option<&str>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tiktoken.model"), model).unwrap();
    if let Some(c) = config {
        std::fs::write(dir.path().join("tokenizer_config.json"), c).unwrap();
    }
    dir
}

/// tiktoken.model lines for all 256 bytes (rank = byte), then `extra`.
fn all_bytes(extra: &str) -> String {
    const B64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for b in 0..=255u8 {
        let (c0, c1) = (B64[(b >> 2) as usize], B64[((b & 3) << 4) as usize]);
        s.push_str(&format!("{}{}== {b}\n", c0 as char, c1 as char));
    }
    s + extra
}

fn load_err(dir: &tempfile::TempDir) -> String {
    let err = Tokenizer::from_file(&dir.path().join("tokenizer.json"))
        .expect_err("malformed input must be an error");
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "{msg}");
    msg
}

#[test]
fn malformed_files_are_errors_that_name_them() {
    // A well-formed directory loads (and a minimal config without added tokens is fine).
    let ok = dir_with(&all_bytes("aGk= 256\n\n"), Some("{}"));
    let tok = Tokenizer::from_file(&ok.path().join("tokenizer.json")).unwrap();
    assert_eq!(tok.encode("hi", false).unwrap(), [256]);
    assert_eq!(tok.vocab_size(), 257 + 256);

    let model = |d: &tempfile::TempDir| d.path().join("tiktoken.model").display().to_string();
    let config =
        |d: &tempfile::TempDir| d.path().join("tokenizer_config.json").display().to_string();
    for (extra, want) in [
        ("aGk 256\n", "line 257: token \"aGk\" is not base64"),
        ("a*k= 256\n", "line 257: token \"a*k=\" is not base64"),
        ("aGk= two\n", "line 257: rank \"two\" is not a number"),
        ("aGk= -1\n", "line 257: rank \"-1\" is not a number"),
        (
            "aGk= 99999999999\n",
            "line 257: rank \"99999999999\" is not a number",
        ),
        (
            "aGk= 7\n",
            "line 257: rank 7 is given twice (first on line 8)",
        ),
        (
            "IQ== 300\n",
            "line 257: token IQ== is given twice (first with rank 33)",
        ),
        ("aGk=\n", "line 257: expected `<base64 token> <rank>`"),
        ("aGk= 256 x\n", "line 257: expected `<base64 token> <rank>`"),
    ] {
        let d = dir_with(&all_bytes(extra), None);
        let msg = load_err(&d);
        assert!(
            msg.starts_with(&format!("cannot load tokenizer {}: ", model(&d))),
            "{msg}"
        );
        assert!(msg.contains(want), "{msg} lacks {want}");
    }
    // A byte without a token, and an empty file.
    let d = dir_with(&all_bytes("").replacen("AA== 0\n", "", 1), None);
    assert!(load_err(&d).contains("no token for the byte 0x00"));
    let d = dir_with("", None);
    assert!(load_err(&d).ends_with("tiktoken.model: no tokens"));

    // tokenizer_config.json at fault: named, not tiktoken.model.
    for (cfg, want) in [
        ("{not json", "not JSON"),
        (r#"{"added_tokens_decoder": []}"#, "is not an object"),
        (
            r#"{"added_tokens_decoder": {"x": {"content": "a"}}}"#,
            "key \"x\" is not a token id",
        ),
        (
            r#"{"added_tokens_decoder": {"300": {"special": true}}}"#,
            "entry 300 has no `content` string",
        ),
        (
            r#"{"added_tokens_decoder": {"65": {"content": "<x>"}}}"#,
            "added token \"<x>\" has id 65, which tiktoken.model gives to the BPE token \"A\"",
        ),
    ] {
        let d = dir_with(&all_bytes(""), Some(cfg));
        let msg = load_err(&d);
        assert!(
            msg.starts_with(&format!("cannot load tokenizer {}: ", config(&d))),
            "{msg}"
        );
        assert!(msg.contains(want), "{msg} lacks {want}");
    }

    // Neither file: the error is about tokenizer.json, as before.
    let empty = tempfile::tempdir().unwrap();
    let msg = Tokenizer::from_file(&empty.path().join("tokenizer.json"))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("tokenizer.json"), "{msg}");
}
