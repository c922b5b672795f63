//! The tokenizer.json that sluice-format rebuilds from a GGUF's tokenizer metadata must encode
//! and decode exactly as the model's original tokenizer.json. Each case writes a GGUF the way
//! llama.cpp's `convert_hf_to_gguf.py` does (`get_vocab_base`, `_set_vocab_gpt2` and gguf-py's
//! `SpecialVocab`, emulated by [`convert`]) from an original tokenizer, rebuilds the tokenizer
//! from the GGUF, and compares both on fixed mixed texts and on a few thousand generated ones.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{json, Value};
use sluice_format::gguf::{GgufFile, GgufValue};
use sluice_format::gguf_tokenizer::{
    supported_pre_tokenizers, tokenizer_json, GgufTokenizerInfo, DEEPSEEK_V3, GPT_4O, LLAMA3, QWEN2,
};
use tokenizers::models::bpe::BpeTrainerBuilder;
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const NORMAL: i32 = 1;
const UNUSED: i32 = 5;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_moe-bf16")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

// ---- A GGUF writer (metadata only) -------------------------------------------------------

/// Writes a version-3 GGUF with `kv` and no tensors into `dir` and opens it.
fn write_gguf(dir: &Path, kv: &[(String, GgufValue)]) -> GgufFile {
    let arch = ("general.architecture".to_string(), str_value("qwen3moe"));
    let all: Vec<(String, GgufValue)> = std::iter::once(arch).chain(kv.iter().cloned()).collect();
    let b = sluice_format::gguf::metadata_only_gguf(&all);
    // A new name each time: an open GgufFile maps its file, which must not be rewritten.
    static N: AtomicUsize = AtomicUsize::new(0);
    let path = dir.join(format!("model-{}.gguf", N.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&path, b).unwrap();
    GgufFile::open(&path).unwrap()
}

fn str_value(s: &str) -> GgufValue {
    GgufValue::String(s.to_string())
}

// ---- convert_hf_to_gguf.py, the tokenizer part -------------------------------------------

/// `ModelBase.does_token_look_special`.
fn looks_special(t: &str) -> bool {
    ["<pad>", "<mask>", "<2mass>", "[@BOS@]"].contains(&t)
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// Whether transformers' `added_tokens_decoder` calls an added token special: when
/// tokenizer.json does, and also when tokenizer_config.json names it among
/// `additional_special_tokens` or as one of the `*_token`s (transformers marks those special on
/// load, so a GGUF has them as CONTROL even where tokenizer.json says `"special": false`).
fn special_for_transformers(added: &Value, tokenizer_config: &Value) -> bool {
    let content = &added["content"];
    let named = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"]
        .iter()
        .any(|typ| {
            let entry = &tokenizer_config[format!("{typ}_token")];
            entry == content || entry["content"] == *content
        });
    added["special"] == json!(true)
        || named
        || tokenizer_config["additional_special_tokens"]
            .as_array()
            .is_some_and(|a| a.contains(content))
}

/// `original` as transformers sees it: its added tokens' `special` flags as
/// [`special_for_transformers`] says. Decoding with `skip_special_tokens` follows this view.
fn transformers_view(original: &Value, tokenizer_config: &Value) -> Tokenizer {
    let mut view = original.clone();
    for t in view["added_tokens"].as_array_mut().unwrap() {
        let special = special_for_transformers(t, tokenizer_config);
        t["special"] = json!(special);
    }
    Tokenizer::from_bytes(view.to_string()).unwrap()
}

/// The GGUF tokenizer metadata llama.cpp's converter writes for a byte-level BPE model
/// (`_set_vocab_gpt2`) with pre-tokenizer name `pre`, from the model directory's
/// tokenizer.json (`original`), tokenizer_config.json and config.json.
fn convert(
    original: &Value,
    tokenizer_config: &Value,
    config: &Value,
    pre: &str,
) -> Vec<(String, GgufValue)> {
    let hf = Tokenizer::from_bytes(original.to_string()).unwrap();
    // get_vocab_base: tokenizer.vocab (added tokens included), reversed; ids the vocabulary
    // lacks up to config.json's vocab_size become UNUSED "[PAD{id}]".
    let mut reverse: BTreeMap<u32, String> = BTreeMap::new();
    for (text, id) in original["model"]["vocab"].as_object().unwrap() {
        reverse.insert(id.as_u64().unwrap() as u32, text.clone());
    }
    let added = original["added_tokens"].as_array().unwrap();
    for t in added {
        reverse.insert(
            t["id"].as_u64().unwrap() as u32,
            t["content"].as_str().unwrap().to_string(),
        );
    }
    let vocab_size = config["vocab_size"]
        .as_u64()
        .map_or(reverse.len() as u32, |n| n as u32);
    assert!(*reverse.keys().last().unwrap() < vocab_size);
    let mut tokens = Vec::new();
    let mut types = Vec::new();
    for id in 0..vocab_size {
        let Some(text) = reverse.get(&id) else {
            tokens.push(format!("[PAD{id}]"));
            types.push(UNUSED);
            continue;
        };
        let mut text = text.clone();
        let ty = match added.iter().find(|t| t["id"] == json!(id)) {
            None => NORMAL,
            Some(t) => {
                let special = special_for_transformers(t, tokenizer_config);
                if t["normalized"] == json!(false) {
                    // tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
                    let ids = hf.encode(text.as_str(), false).unwrap();
                    text = hf.decode(ids.get_ids(), false).unwrap();
                }
                if special || looks_special(&text) {
                    CONTROL
                } else {
                    text = text.replace('\u{2581}', " ");
                    USER_DEFINED
                }
            }
        };
        tokens.push(text);
        types.push(ty);
    }
    // SpecialVocab(load_merges=True): merges as "a b", a space inside a part written as 'Ġ'.
    let merges: Vec<GgufValue> = original["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => str_value(s),
            Value::Array(pair) => {
                let part = |v: &Value| v.as_str().unwrap().replace(' ', "\u{120}");
                str_value(&format!("{} {}", part(&pair[0]), part(&pair[1])))
            }
            _ => panic!("merge {m}"),
        })
        .collect();
    // SpecialVocab._try_load_from_tokenizer_json, then _try_load_from_config_json.
    let mut add_special: BTreeMap<&str, bool> = BTreeMap::new();
    let post = &original["post_processor"];
    let processors = post["processors"]
        .as_array()
        .cloned()
        .unwrap_or_else(|| vec![post.clone()]);
    for p in &processors {
        match p["type"].as_str() {
            Some("ByteLevel") => {
                add_special.entry("bos").or_insert(false);
                add_special.entry("eos").or_insert(false);
            }
            Some("TemplateProcessing") => {
                let first = &p["single"][0]["SpecialToken"]["id"];
                add_special.insert(
                    "bos",
                    first.is_string() && *first == tokenizer_config["bos_token"],
                );
            }
            _ => {}
        }
    }
    let mut ids: BTreeMap<&str, u32> = BTreeMap::new();
    let types_of = ["bos", "eos", "unk", "sep", "pad", "cls", "mask"];
    for typ in types_of {
        if let Some(add) = tokenizer_config[format!("add_{typ}_token")].as_bool() {
            add_special.entry(typ).or_insert(add);
        }
        let entry = &tokenizer_config[format!("{typ}_token")];
        let content = entry.as_str().or_else(|| entry["content"].as_str());
        let id = content.and_then(|c| added.iter().find(|t| t["content"] == json!(c)));
        if let Some(id) = id.and_then(|t| t["id"].as_u64()) {
            ids.entry(typ).or_insert(id as u32);
        }
    }
    for typ in types_of {
        if let Some(id) = config[format!("{typ}_token_id")].as_u64() {
            ids.entry(typ).or_insert(id as u32);
        }
    }
    let mut kv = vec![
        ("tokenizer.ggml.model".to_string(), str_value("gpt2")),
        ("tokenizer.ggml.pre".to_string(), str_value(pre)),
        (
            "tokenizer.ggml.tokens".to_string(),
            GgufValue::Array(tokens.iter().map(|t| str_value(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".to_string(),
            GgufValue::Array(types.into_iter().map(GgufValue::I32).collect()),
        ),
        (
            "tokenizer.ggml.merges".to_string(),
            GgufValue::Array(merges),
        ),
    ];
    for (typ, id) in ids {
        let key = match typ {
            "unk" => "unknown",
            "sep" => "seperator",
            "pad" => "padding",
            t => t,
        };
        kv.push((format!("tokenizer.ggml.{key}_token_id"), GgufValue::U32(id)));
    }
    for (typ, add) in add_special {
        kv.push((
            format!("tokenizer.ggml.add_{typ}_token"),
            GgufValue::Bool(add),
        ));
    }
    if let Some(t) = tokenizer_config["chat_template"].as_str() {
        kv.push(("tokenizer.chat_template".to_string(), str_value(t)));
    }
    kv
}

// ---- Texts --------------------------------------------------------------------------------

const MIXED: &str = "<|im_start|>user\nfn main() {\n\tlet x = 12345;   // don't panic\n\
    \t\tprintln!(\"{x:>8}\");\n}\r\n\n\n    four spaces  two  \t tab\n\
    你好，世界！こんにちは 안녕하세요 🚀 (normal) 😶\u{200d}🌫️ 🦙🦙 ✅\n\
    I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some \
    tea? We'Ve a'lL 3.3 3..3 33333333 1314151天～ ------======= нещо на Български\n\
    café vs cafe\u{301} (NFC), e\u{301}\u{301} ﬁ Å K 'ſ 'Ｓ<|im_end|>\n<|im_start|>assistant\n\
    <think>\nreasoning</think>\n\n<tool_call>{\"a\": 1}</tool_call><|endoftext|>\
    <|im_end|><|im_start|><|im_st <think <|endoftext|>   ";

fn fixed_texts() -> Vec<String> {
    let mut texts: Vec<String> = vec![
        MIXED.to_string(),
        String::new(),
        " ".into(),
        "\n".into(),
        "   \n\n  \t".into(),
        "Hello world".into(),
        " hello".into(),
        "don't DON'T Don'T".into(),
        "12345 1234567890 ١٢٣ ⅷ".into(),
        "<|im_start|><|im_end|>".into(),
        "a<think>b</think>c".into(),
        // (?i:'s) also matches 'ſ (U+017F folds to s): "'ſ" + "t", where "(?:'[sS]…)" would
        // keep "'ſt" whole and "ſt" merge.
        "'ſt liſt 'ſtop".into(),
    ];
    texts.extend(MIXED.lines().map(str::to_string));
    texts
}

/// Deterministic pseudo-random texts over a pool of pieces chosen to stress the regexes,
/// NFC, byte-level BPE and the added tokens.
fn random_texts(n: usize, seed: u64) -> Vec<String> {
    const POOL: &[&str] = &[
        "a",
        "b",
        "e",
        "t",
        "the",
        " the",
        "Hello",
        "world",
        "ing",
        "er",
        "x",
        "Z",
        "Q",
        " ",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "\n\n",
        "    ",
        "'",
        "'s",
        "'t",
        "'re",
        "'ll",
        "'D",
        "'ſ",
        "'K",
        "ſt",
        "liſt",
        "'ſt",
        "0",
        "1",
        "7",
        "42",
        "12345",
        "3.14",
        ".",
        ",",
        "!",
        "?",
        "...",
        "-",
        "=",
        "(",
        ")",
        "{",
        "}",
        "[",
        "]",
        "<",
        ">",
        "/",
        "\\",
        "\"",
        "_",
        "#",
        "@",
        "$",
        "%",
        "^",
        "&",
        "*",
        "~",
        "`",
        "|",
        ":",
        ";",
        "你",
        "好",
        "世界",
        "天",
        "こんにちは",
        "カタカナ",
        "안녕",
        "\u{1100}\u{1161}",
        "é",
        "e\u{301}",
        "\u{301}",
        "\u{308}",
        "Å",
        "A\u{30a}",
        "ﬁ",
        "ß",
        "Ω",
        "Ж",
        "нещо",
        "ع",
        "١٢",
        "🚀",
        "🦙",
        "😶\u{200d}🌫️",
        "👍🏽",
        "\u{200b}",
        "\u{a0}",
        "\u{3000}",
        "\u{feff}",
        "ｆｕｌｌ",
        "１２",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<|",
        "|>",
        "<think",
        "im_start",
        "fn",
        "let",
        "println!",
        "def",
        "return",
        "::",
        "->",
        "=>",
    ];
    let mut state = seed;
    let mut next = move || {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    (0..n)
        .map(|_| {
            let len = 1 + (next() % 40) as usize;
            (0..len)
                .map(|_| POOL[(next() % POOL.len() as u64) as usize])
                .collect()
        })
        .collect()
}

/// Both tokenizers give the same ids (with and without the post-processor) and the same
/// decodes on every text. Decoding with `skip_special_tokens` is compared with `skip_view`
/// (the original as transformers sees it, whose special tokens the GGUF records).
fn assert_same(original: &Tokenizer, skip_view: &Tokenizer, rebuilt: &Tokenizer, texts: &[String]) {
    for text in texts {
        for add_special in [false, true] {
            let want = original.encode(text.as_str(), add_special).unwrap();
            let got = rebuilt.encode(text.as_str(), add_special).unwrap();
            assert_eq!(
                got.get_ids(),
                want.get_ids(),
                "ids differ on {text:?} (add_special_tokens {add_special})"
            );
            assert_eq!(
                rebuilt.decode(want.get_ids(), false).unwrap(),
                original.decode(want.get_ids(), false).unwrap(),
                "decode differs on {text:?}"
            );
            assert_eq!(
                rebuilt.decode(want.get_ids(), true).unwrap(),
                skip_view.decode(want.get_ids(), true).unwrap(),
                "decode skipping special tokens differs on {text:?}"
            );
        }
    }
}

fn rebuild(file: &GgufFile) -> Tokenizer {
    Tokenizer::from_bytes(tokenizer_json(file).unwrap()).unwrap()
}

// ---- Cases --------------------------------------------------------------------------------

#[test]
fn fixture_qwen3_tokenizer_survives_the_gguf_round_trip() {
    let dir = fixture_dir();
    let original_json = read_json(&dir.join("tokenizer.json"));
    let tokenizer_config = read_json(&dir.join("tokenizer_config.json"));
    let config = read_json(&dir.join("config.json"));
    let tmp = tempfile::tempdir().unwrap();
    let kv = convert(&original_json, &tokenizer_config, &config, "qwen2");
    let file = write_gguf(tmp.path(), &kv);

    let original = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let skip_view = transformers_view(&original_json, &tokenizer_config);
    let rebuilt = rebuild(&file);
    let mut texts = fixed_texts();
    texts.extend(random_texts(3000, 0x5eed_0001));
    assert_same(&original, &skip_view, &rebuilt, &texts);
    // The mixed text really exercises the added tokens and byte-level pieces.
    let ids = original.encode(MIXED, false).unwrap();
    for special in [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<think>",
        "</think>",
    ] {
        let id = original.token_to_id(special).unwrap();
        assert!(ids.get_ids().contains(&id), "{special}");
        assert_eq!(rebuilt.token_to_id(special), Some(id));
    }

    // What SpecialVocab wrote: eos from tokenizer_config, bos from config.json.
    let info = GgufTokenizerInfo::read(&file).unwrap();
    assert_eq!(info.pre.as_deref(), Some("qwen2"));
    assert_eq!(
        (info.eos, info.eos_text.as_deref()),
        (Some(495), Some("<|im_end|>"))
    );
    assert_eq!(
        (info.bos, info.bos_text.as_deref()),
        (Some(493), Some("<|endoftext|>"))
    );
    assert_eq!(info.pad, Some(493));
    assert!(!info.add_bos && !info.add_eos);
    assert_eq!(
        info.chat_template.as_deref(),
        tokenizer_config["chat_template"].as_str()
    );
}

/// The GGUF fixtures written by llama.cpp's own `convert_hf_to_gguf.py` from the same tokenizer
/// (`scripts/make_fixtures_gguf.py`): their tokenizer metadata is what [`convert`] writes (so
/// the emulation above is faithful), and the tokenizer rebuilt from them encodes as the
/// original.
#[test]
fn llama_cpp_converter_output_encodes_like_the_original() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&fixtures)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("qwen3_moe-gguf-"))
        })
        .map(|p| p.join("model.gguf"))
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(
        files.len() >= 4,
        "tests/fixtures/qwen3_moe-gguf-*/model.gguf: {files:?}"
    );
    let dir = fixture_dir();
    let original_json = read_json(&dir.join("tokenizer.json"));
    let tokenizer_config = read_json(&dir.join("tokenizer_config.json"));
    let config = read_json(&dir.join("config.json"));
    // The converted checkpoint's config.json was transformers' own, without bos_token_id.
    let emulated: BTreeMap<String, GgufValue> =
        convert(&original_json, &tokenizer_config, &config, "qwen2")
            .into_iter()
            .filter(|(k, _)| k != "tokenizer.ggml.bos_token_id")
            .collect();
    let original = Tokenizer::from_bytes(original_json.to_string()).unwrap();
    let skip_view = transformers_view(&original_json, &tokenizer_config);
    let mut texts = fixed_texts();
    texts.extend(random_texts(1000, 0x5eed_0004));
    for path in files {
        let file = GgufFile::open(&path).unwrap();
        let written: BTreeMap<String, GgufValue> = file
            .metadata_entries()
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned()
            .collect();
        assert_eq!(written, emulated, "{}", path.display());
        assert_same(&original, &skip_view, &rebuild(&file), &texts);
    }
}

/// The pipeline of an original tokenizer.json, as the models of a `tokenizer.ggml.pre` name
/// have it.
struct Style {
    pre: &'static str,
    normalizer: fn() -> Value,
    splits: &'static [&'static str],
    ignore_merges: bool,
    /// A `TemplateProcessing` that adds `<|endoftext|>` as BOS (Llama 3 and DeepSeek-V3 add
    /// theirs), else Qwen's `ByteLevel` post-processor.
    add_bos: bool,
}

const STYLES: [Style; 4] = [
    Style {
        pre: "qwen2",
        normalizer: || json!({"type": "NFC"}),
        splits: &[QWEN2],
        ignore_merges: false,
        add_bos: false,
    },
    Style {
        pre: "llama-bpe",
        normalizer: || Value::Null,
        splits: &[LLAMA3],
        ignore_merges: true,
        add_bos: true,
    },
    Style {
        pre: "deepseek-v3",
        normalizer: || json!({"type": "Sequence", "normalizers": []}),
        splits: &DEEPSEEK_V3,
        ignore_merges: false,
        add_bos: true,
    },
    Style {
        pre: "gpt-4o",
        normalizer: || Value::Null,
        splits: &[GPT_4O],
        ignore_merges: false,
        add_bos: false,
    },
];

/// A byte-level BPE tokenizer.json in `style`, trained here on a small mixed corpus (about 1500
/// tokens: all 256 byte symbols and the merges training found), with Qwen's added tokens.
fn trained(style: &Style) -> Value {
    let mut pretokenizers: Vec<Value> = style
        .splits
        .iter()
        .map(|re| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false}))
        .collect();
    pretokenizers.push(
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}),
    );
    let byte_level_post = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false});
    let shell = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": (style.normalizer)(),
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pretokenizers},
        "post_processor": byte_level_post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": {}, "merges": []},
    });
    let mut tok = Tokenizer::from_bytes(shell.to_string()).unwrap();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(1500)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut corpus: Vec<String> = fixed_texts();
    corpus.extend(random_texts(2000, 0xc0ff_ee00));
    corpus.extend(
        include_str!("gguf_tokenizer.rs")
            .lines()
            .map(str::to_string),
    );
    tok.train(&mut trainer, corpus.iter()).unwrap();
    tok.add_special_tokens(&[
        AddedToken::from("<|endoftext|>", true).normalized(false),
        AddedToken::from("<|im_start|>", true).normalized(false),
        AddedToken::from("<|im_end|>", true).normalized(false),
    ]);
    tok.add_tokens(&[
        AddedToken::from("<think>", false).normalized(false),
        AddedToken::from("</think>", false).normalized(false),
        AddedToken::from("<tool_call>", false).normalized(false),
        AddedToken::from("</tool_call>", false).normalized(false),
    ]);
    let mut json: Value = serde_json::from_str(&tok.to_string(false).unwrap()).unwrap();
    json["model"]["ignore_merges"] = json!(style.ignore_merges);
    if style.add_bos {
        let bos = tok.token_to_id("<|endoftext|>").unwrap();
        let special =
            |type_id: u32| json!({"SpecialToken": {"id": "<|endoftext|>", "type_id": type_id}});
        let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
        json["post_processor"] = json!({
            "type": "TemplateProcessing",
            "single": [special(0), seq("A", 0)],
            "pair": [special(0), seq("A", 0), special(1), seq("B", 1)],
            "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [bos], "tokens": ["<|endoftext|>"]}},
        });
    }
    json
}

#[test]
fn trained_byte_level_tokenizers_survive_the_gguf_round_trip() {
    for style in &STYLES {
        let original_json = trained(style);
        let n_vocab = original_json["model"]["vocab"].as_object().unwrap().len();
        let n_merges = original_json["model"]["merges"].as_array().unwrap().len();
        assert!(
            n_vocab > 1000 && n_merges > 700,
            "{n_vocab} tokens, {n_merges} merges"
        );
        let original = Tokenizer::from_bytes(original_json.to_string()).unwrap();
        let eot = original.token_to_id("<|endoftext|>").unwrap();
        let tokenizer_config = json!({
            "add_bos_token": style.add_bos,
            "bos_token": if style.add_bos { json!("<|endoftext|>") } else { Value::Null },
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": "{{ x }}",
        });
        // Room past the last id, as real configs leave: the converter fills it with UNUSED.
        let config = json!({"bos_token_id": eot, "vocab_size": n_vocab + 7 + 13});
        let tmp = tempfile::tempdir().unwrap();
        let file = write_gguf(
            tmp.path(),
            &convert(&original_json, &tokenizer_config, &config, style.pre),
        );
        let info = GgufTokenizerInfo::read(&file).unwrap();
        assert_eq!(info.add_bos, style.add_bos, "{}", style.pre);
        assert_eq!(
            (info.bos, info.eos_text.as_deref()),
            (Some(eot), Some("<|im_end|>"))
        );
        assert_eq!(info.n_tokens, n_vocab + 7 + 13);
        let rebuilt = rebuild(&file);
        let mut texts = fixed_texts();
        texts.extend(random_texts(2000, 0x5eed_0002));
        assert_same(&original, &original, &rebuilt, &texts);
        // Long merges really happen (the test is not all single bytes).
        let ids = original.encode("fn main() { let x = 1; }", false).unwrap();
        assert!(ids.get_ids().len() < 15, "{:?}", ids.get_tokens());
        assert_eq!(rebuilt.get_vocab_size(true), n_vocab + 7);
        if style.add_bos {
            assert_eq!(rebuilt.encode("hi", true).unwrap().get_ids()[0], eot);
        }
    }
}

/// Every supported pre-tokenizer compiles in the `tokenizers` crate's regex engine and loses
/// nothing: decoding gives back the text (NFC-normalized where the family normalizes).
#[test]
fn every_supported_pre_tokenizer_round_trips_text() {
    let original_json = trained(&STYLES[0]);
    let tokenizer_config = json!({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"});
    let tmp = tempfile::tempdir().unwrap();
    let texts: Vec<String> = fixed_texts()
        .into_iter()
        .chain(random_texts(300, 0x5eed_0003))
        .collect();
    let nfc = Tokenizer::from_bytes(original_json.to_string()).unwrap();
    for pre in supported_pre_tokenizers() {
        let kv = convert(&original_json, &tokenizer_config, &json!({}), pre);
        let tok = rebuild(&write_gguf(tmp.path(), &kv));
        let normalizes = pre.starts_with("qwen") || pre == "deepseek-r1-qwen";
        for text in &texts {
            let ids = tok.encode(text.as_str(), false).unwrap();
            let back = tok.decode(ids.get_ids(), false).unwrap();
            let want = if normalizes {
                // NFC by the qwen2-style original: the same normalizer.
                let n = nfc.encode(text.as_str(), false).unwrap();
                nfc.decode(n.get_ids(), false).unwrap()
            } else {
                text.clone()
            };
            assert_eq!(back, want, "{pre}: {text:?}");
        }
    }
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model` "llama", as Mixtral's GGUFs carry):
/// `tests/fixtures/spm-tokenizer` holds a SentencePiece BPE model trained with Llama's
/// settings, the tokenizer.json transformers makes of it, and the vocabulary-only GGUF
/// llama.cpp's converter writes from it (scripts/make_spm_tokenizer_fixture.py). The tokenizer
/// rebuilt from the GGUF gives the ids SentencePiece itself gives on mixed texts (BOS added as
/// llama.cpp adds it) and those of the original tokenizer.json on those and a few thousand
/// generated texts, and decodes alike.
#[test]
fn sentencepiece_vocabulary_encodes_like_sentencepiece_and_its_tokenizer_json() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/spm-tokenizer");
    let file = GgufFile::open(dir.join("vocab.gguf")).unwrap();
    let info = GgufTokenizerInfo::read(&file).unwrap();
    assert_eq!(info.model, "llama");
    assert!(
        info.add_bos,
        "llama.cpp adds BOS to a SentencePiece vocabulary"
    );
    let rebuilt = rebuild(&file);
    let original = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let expected = read_json(&dir.join("expected.json"));
    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let got = rebuilt.encode(text, true).unwrap().get_ids().to_vec();
        assert_eq!(
            got,
            ids(&case["tokenizer_json"]),
            "{text:?}: tokenizer.json's ids"
        );
        // SentencePiece reads "<s>" in a text as text; tokenizer.json and llama.cpp (parsing
        // special tokens) as the token.
        if !text.contains("<s>") {
            assert_eq!(
                got,
                ids(&case["sentencepiece"]),
                "{text:?}: SentencePiece's ids"
            );
        }
    }
    let mut texts = fixed_texts();
    texts.extend(
        cases
            .iter()
            .map(|c| c["text"].as_str().unwrap().to_string()),
    );
    texts.extend(random_texts(3000, 0x5eed_0005));
    assert_same(&original, &original, &rebuilt, &texts);

    // Without the space prefix (`tokenizer.ggml.add_space_prefix` false): no ▁ before the text.
    let mut kv: Vec<(String, GgufValue)> = file
        .metadata_entries()
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .cloned()
        .collect();
    kv.push((
        "tokenizer.ggml.add_space_prefix".into(),
        GgufValue::Bool(false),
    ));
    let tmp = tempfile::tempdir().unwrap();
    let plain = rebuild(&write_gguf(tmp.path(), &kv));
    let with = rebuilt.encode("Hello world", false).unwrap();
    let without = plain.encode("Hello world", false).unwrap();
    assert!(
        with.get_tokens()[0].starts_with('\u{2581}'),
        "{:?}",
        with.get_tokens()
    );
    assert!(
        !without.get_tokens()[0].starts_with('\u{2581}'),
        "{:?}",
        without.get_tokens()
    );
    assert_eq!(
        plain.decode(without.get_ids(), false).unwrap(),
        "Hello world"
    );
}
