//! The tokenizer of a GGUF file as a Hugging Face `tokenizer.json`, so that sluice, which
//! tokenizes with the `tokenizers` crate, encodes a GGUF model's text exactly as the model's
//! original tokenizer.json did.
//!
//! llama.cpp's converter (`convert_hf_to_gguf.py`: `get_vocab_base`, `_set_vocab_gpt2` and
//! gguf-py's `SpecialVocab`) keeps the vocabulary (`tokenizer.ggml.tokens`, index = id), each
//! token's type, the BPE merges, the special token ids and flags, and the chat template. What it
//! drops is the tokenizer's pipeline: it records only a *name* for the pre-tokenizer
//! (`tokenizer.ggml.pre`, found by hashing the encoding of a probe text), and nothing about the
//! normalizer. [`tokenizer_json`] puts the pipeline back from a table keyed by that name:
//!
//! | `tokenizer.ggml.pre` | models | normalizer | pre-tokenizer regexes | ignore_merges |
//! | --- | --- | --- | --- | --- |
//! | `qwen2`, `deepseek-r1-qwen` | Qwen2/2.5, Qwen3, Qwen3-MoE, Qwen3-Next, R1-Distill-Qwen | NFC | [`QWEN2`] | no |
//! | `qwen35` | Qwen3.5 | NFC | [`QWEN35`] | no |
//! | `deepseek-v3` | DeepSeek-V3/R1/V3.1/V3.2 | none | [`DEEPSEEK_V3`] (three splits) | no |
//! | `deepseek-llm` | DeepSeek-LLM, DeepSeek-V2(-Lite) | none | [`DEEPSEEK_LLM`] (six splits) | no |
//! | `gpt-4o` | gpt-oss | none | [`GPT_4O`] | no |
//! | `glm4`, `glm5` | GLM-4, GLM-4.5/4.6/4.7, GLM-5 | none | [`LLAMA3`] | yes |
//! | `llama-bpe`, `llama3`, `llama-v3` | Llama 3 | none | [`LLAMA3`] | yes |
//! | `default` or absent | (llama.cpp's fallback) | none | [`LLAMA_CPP_DEFAULT`] (four splits) | no |
//!
//! Each regex is the one of the original tokenizer.json where llama.cpp's `src/llama-vocab.cpp`
//! quotes it ("original regex from tokenizer.json", for qwen2, qwen35, llama3 and gpt-4o), since
//! llama.cpp's own copies are rewritten for its regex engine (`(?i:'s|…)` spelled
//! `(?:'[sS]|…)`, which differs where the case fold matters: `'ſt` is `'ſ` + `t` in the
//! original, one piece in llama.cpp's); where llama.cpp uses the
//! original splits as they are (deepseek-v3, deepseek-llm) its strings are copied byte for
//! byte; GLM's is llama.cpp's CHATGLM4 expression with the contractions in the original `(?i:…)`
//! form (the same expression as Llama 3's). `ignore_merges` follows llama.cpp's per-name flag.
//! Every split is `Isolated`, followed by a `ByteLevel` step that only maps bytes
//! (`use_regex: false`), which is the shape of these models' tokenizer.json files and what
//! llama.cpp does (its regexes apply in turn, each splitting the pieces of the one before).
//!
//! **Normalizer.** GGUF does not record it, so it is decided per name: Qwen's tokenizer.json
//! files normalize to NFC (Qwen2/2.5 and Qwen3, whose tokenizer Qwen3-Next shares; Qwen3.5 and
//! DeepSeek's R1-Distill-Qwen are taken to keep it), so `qwen2`, `deepseek-r1-qwen` and
//! `qwen35` get NFC; the other names get none (DeepSeek's files hold an empty `Sequence`, the
//! same thing). llama.cpp applies no normalizer at all, so on text that is not already NFC
//! sluice (like the original) and llama.cpp can differ.
//!
//! **Vocabulary.** Every token goes into the BPE model's vocab at its GGUF index, added tokens
//! included, so that the `tokenizers` crate gives each added token its GGUF id whatever the
//! order. Skipped: `UNUSED` tokens (the `[PAD{id}]` fillers the converter writes for ids the
//! original vocabulary does not have, up to config.json's `vocab_size`), empty strings, and a
//! repeat of an earlier token's text (the first keeps it). `CONTROL` tokens become added tokens
//! with `special: true`, `USER_DEFINED` ones added tokens with `special: false`; all with
//! `lstrip`/`rstrip`/`single_word`/`normalized` false, which GGUF does not record (false in
//! Qwen's, gpt-oss's and DeepSeek's files, where `normalized: true` changes nothing without a
//! normalizer; a model whose added tokens strip spaces would encode differently). The converter
//! makes CONTROL every added token transformers calls special (tokenizer_config.json's
//! `additional_special_tokens` too) and every one that looks like `<|…|>`, so decoding with
//! `skip_special_tokens` drops what transformers drops, which can be more than the
//! tokenizer.json alone marks special (the test fixture's `<think>`); ids are unaffected.
//!
//! **Post-processor.** A `TemplateProcessing` that adds BOS and/or EOS where
//! `tokenizer.ggml.add_bos_token`/`add_eos_token` say so (absent: llama.cpp's default for the
//! name, true only for Llama 3), else a `ByteLevel` one as in Qwen's files; it runs only when
//! encoding with `add_special_tokens`. The decoder is `ByteLevel`.
//!
//! `tokenizer.ggml.model` "gpt2" (byte-level BPE) is converted as above; "llama" (SentencePiece
//! BPE: Llama 1/2, Mistral, Mixtral) as the legacy tokenizer.json transformers makes of a
//! `tokenizer.model` (see `sentencepiece_json`: merges from the pieces' scores, byte fallback,
//! `▁` for spaces and a space prefix). Other models are refused with a one-line error, as are
//! pre-tokenizers not in the table (e.g. `kimi-k2`, whose llama.cpp implementation is custom
//! code, not a regex).
//!
//! ```no_run
//! # fn main() -> Result<(), sluice_format::gguf::GgufError> {
//! use sluice_format::gguf::GgufFile;
//! use sluice_format::gguf_tokenizer::{tokenizer_json, GgufTokenizerInfo};
//! let file = GgufFile::open("Qwen3-30B-A3B-Q4_K_M.gguf")?;
//! let json = tokenizer_json(&file)?; // feed to tokenizers::Tokenizer::from_bytes
//! let info = GgufTokenizerInfo::read(&file)?;
//! println!("eos {:?} = {:?}, add_bos {}", info.eos, info.eos_text, info.add_bos);
//! # let _ = json; Ok(()) }
//! ```

use std::collections::HashMap;

use serde_json::{json, Map, Value};

use crate::gguf::{GgufError, GgufFile, GgufValue};

/// llama.cpp's `llama_token_type` values (`tokenizer.ggml.token_type`).
pub const TOKEN_NORMAL: i64 = 1;
pub const TOKEN_UNKNOWN: i64 = 2;
pub const TOKEN_CONTROL: i64 = 3;
pub const TOKEN_USER_DEFINED: i64 = 4;
pub const TOKEN_UNUSED: i64 = 5;
pub const TOKEN_BYTE: i64 = 6;

/// Qwen2 to Qwen3(-Next): the original tokenizer.json's regex, as quoted in llama-vocab.cpp
/// (`LLAMA_VOCAB_PRE_TYPE_QWEN2`).
pub const QWEN2: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// Qwen3.5: as [`QWEN2`] with combining marks (`\p{M}`) kept in words (llama-vocab.cpp,
/// `LLAMA_VOCAB_PRE_TYPE_QWEN35`, original regex).
pub const QWEN35: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// Llama 3 (llama-vocab.cpp, `LLAMA_VOCAB_PRE_TYPE_LLAMA3`, original regex); also GLM-4/4.5/5
/// (`LLAMA_VOCAB_PRE_TYPE_CHATGLM4`, whose llama.cpp form is the same expression).
pub const LLAMA3: &str = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// o200k / gpt-oss (llama-vocab.cpp, `LLAMA_VOCAB_PRE_TYPE_GPT4O`, original regex).
pub const GPT_4O: &str = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/// DeepSeek-V3: three splits, as in llama-vocab.cpp (`LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM`).
pub const DEEPSEEK_V3: [&str; 3] = [
    "\\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

/// DeepSeek-LLM and DeepSeek-V2: six splits, as in llama-vocab.cpp
/// (`LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM`).
pub const DEEPSEEK_LLM: [&str; 6] = [
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
];

/// llama.cpp's fallback for a missing or `default` pre-tokenizer name (llama-vocab.cpp, the
/// `default:` case): what llama.cpp does with such a file, not any original tokenizer.json.
pub const LLAMA_CPP_DEFAULT: [&str; 4] = [
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    "\\p{N}+",
    "[0-9][0-9][0-9]",
];

/// How one family of `tokenizer.ggml.pre` names tokenizes.
struct PreTokenizer {
    names: &'static [&'static str],
    nfc: bool,
    splits: &'static [&'static str],
    ignore_merges: bool,
    /// llama.cpp's `add_bos` when the file has no `tokenizer.ggml.add_bos_token`.
    default_add_bos: bool,
}

const PRE_TOKENIZERS: &[PreTokenizer] = &[
    PreTokenizer {
        names: &["qwen2", "deepseek-r1-qwen"],
        nfc: true,
        splits: &[QWEN2],
        ignore_merges: false,
        default_add_bos: false,
    },
    PreTokenizer {
        names: &["qwen35"],
        nfc: true,
        splits: &[QWEN35],
        ignore_merges: false,
        default_add_bos: false,
    },
    PreTokenizer {
        names: &["deepseek-v3"],
        nfc: false,
        splits: &DEEPSEEK_V3,
        ignore_merges: false,
        default_add_bos: false,
    },
    PreTokenizer {
        names: &["deepseek-llm"],
        nfc: false,
        splits: &DEEPSEEK_LLM,
        ignore_merges: false,
        default_add_bos: false,
    },
    PreTokenizer {
        names: &["gpt-4o"],
        nfc: false,
        splits: &[GPT_4O],
        ignore_merges: false,
        default_add_bos: false,
    },
    PreTokenizer {
        names: &["glm4", "glm5"],
        nfc: false,
        splits: &[LLAMA3],
        ignore_merges: true,
        default_add_bos: false,
    },
    PreTokenizer {
        names: &["llama-bpe", "llama3", "llama-v3"],
        nfc: false,
        splits: &[LLAMA3],
        ignore_merges: true,
        default_add_bos: true,
    },
    PreTokenizer {
        names: &["default"],
        nfc: false,
        splits: &LLAMA_CPP_DEFAULT,
        ignore_merges: false,
        default_add_bos: false,
    },
];

/// The `tokenizer.ggml.pre` names [`tokenizer_json`] converts.
pub fn supported_pre_tokenizers() -> Vec<&'static str> {
    PRE_TOKENIZERS
        .iter()
        .flat_map(|p| p.names.iter().copied())
        .collect()
}

/// The special tokens, flags and chat template of a GGUF's tokenizer (any model type).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GgufTokenizerInfo {
    /// `tokenizer.ggml.model` ("gpt2", "llama", ...).
    pub model: String,
    /// `tokenizer.ggml.pre`, when present.
    pub pre: Option<String>,
    /// Length of `tokenizer.ggml.tokens` (the `[PAD…]` fillers included).
    pub n_tokens: usize,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn (`tokenizer.ggml.eot_token_id`), e.g. GLM's `<|user|>`.
    pub eot: Option<u32>,
    /// End of message (`tokenizer.ggml.eom_token_id`).
    pub eom: Option<u32>,
    pub pad: Option<u32>,
    pub bos_text: Option<String>,
    pub eos_text: Option<String>,
    pub eot_text: Option<String>,
    /// `tokenizer.ggml.add_bos_token`; absent: llama.cpp's default (true only for Llama 3's
    /// pre-tokenizer names).
    pub add_bos: bool,
    /// `tokenizer.ggml.add_eos_token`; absent: false.
    pub add_eos: bool,
    /// `tokenizer.chat_template`, when present.
    pub chat_template: Option<String>,
}

impl GgufTokenizerInfo {
    /// Reads the tokenizer's settings. A special token id outside the vocabulary is ignored
    /// (`None`), as llama.cpp ignores it.
    pub fn read(file: &GgufFile) -> Result<Self, GgufError> {
        let model = string_key(file, "tokenizer.ggml.model")?.ok_or_else(|| {
            err(
                file,
                "no tokenizer.ggml.model: this GGUF has no tokenizer (use the original model's \
                 tokenizer.json)",
            )
        })?;
        let pre = string_key(file, "tokenizer.ggml.pre")?;
        let tokens = tokens(file)?;
        let id = |suffix: &str| -> Result<Option<u32>, GgufError> {
            let key = format!("tokenizer.ggml.{suffix}_token_id");
            match file.metadata(&key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(id) if id < tokens.len() as u64 => Ok(Some(id as u32)),
                    Some(_) => Ok(None),
                    None => Err(err(
                        file,
                        &format!("{key} is {v}, not a token id (re-convert the GGUF)"),
                    )),
                },
            }
        };
        let text = |id: Option<u32>| id.map(|i| tokens[i as usize].to_string());
        let (bos, eos, eot) = (id("bos")?, id("eos")?, id("eot")?);
        // llama.cpp adds BOS by default for SentencePiece vocabularies and Llama 3's.
        let default_add_bos = model == "llama"
            || pre
                .and_then(pre_tokenizer)
                .is_some_and(|p| p.default_add_bos);
        Ok(GgufTokenizerInfo {
            pre: pre.map(str::to_string),
            n_tokens: tokens.len(),
            bos,
            eos,
            eot,
            eom: id("eom")?,
            pad: id("padding")?,
            bos_text: text(bos),
            eos_text: text(eos),
            eot_text: text(eot),
            add_bos: bool_key(file, "tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos),
            add_eos: bool_key(file, "tokenizer.ggml.add_eos_token")?.unwrap_or(false),
            chat_template: string_key(file, "tokenizer.chat_template")?.map(str::to_string),
            model: model.to_string(),
        })
    }
}

/// A tokenizer.json equivalent of the GGUF's tokenizer, for the `tokenizers` crate (see the
/// module documentation for what is rebuilt and how).
pub fn tokenizer_json(file: &GgufFile) -> Result<String, GgufError> {
    let info = GgufTokenizerInfo::read(file)?;
    match info.model.as_str() {
        "gpt2" => {}
        "llama" => return sentencepiece_json(file, &info),
        m => {
            return Err(err(
                file,
                &format!(
                    "tokenizer.ggml.model {m:?} is not supported (only \"gpt2\", byte-level BPE, \
                     and \"llama\", SentencePiece BPE, are)"
                ),
            ))
        }
    }
    let pre_name = info.pre.as_deref().unwrap_or("default");
    let pre = pre_tokenizer(pre_name).ok_or_else(|| {
        err(
            file,
            &format!(
                "tokenizer.ggml.pre {pre_name:?} is not supported yet (supported: {}): use the \
                 original model's tokenizer.json",
                supported_pre_tokenizers().join(", ")
            ),
        )
    })?;

    let tokens = tokens(file)?;
    let types = token_types(file, tokens.len())?;
    let Vocabulary {
        ids: vocab,
        json: vocab_json,
        added,
        ..
    } = vocabulary(&tokens, &types, false);

    let merges = merges(file, &vocab)?;

    let mut pretokenizers: Vec<Value> = pre
        .splits
        .iter()
        .map(|re| {
            json!({
                "type": "Split",
                "pattern": {"Regex": re},
                "behavior": "Isolated",
                "invert": false,
            })
        })
        .collect();
    pretokenizers.push(json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": false,
        "use_regex": false,
    }));

    let post_processor = post_processor(&info).unwrap_or_else(|| {
        json!({
            "type": "ByteLevel",
            "add_prefix_space": false,
            "trim_offsets": false,
            "use_regex": false,
        })
    });
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": if pre.nfc { json!({"type": "NFC"}) } else { Value::Null },
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pretokenizers},
        "post_processor": post_processor,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": true,
            "trim_offsets": true,
            "use_regex": true,
        },
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": pre.ignore_merges,
            "vocab": vocab_json,
            "merges": merges,
        },
    });
    Ok(tokenizer.to_string())
}

fn pre_tokenizer(name: &str) -> Option<&'static PreTokenizer> {
    PRE_TOKENIZERS.iter().find(|p| p.names.contains(&name))
}

/// BOS/EOS added as the GGUF says (the template Hugging Face's fast tokenizers build from
/// `add_bos_token`/`add_eos_token`); `None` when neither is added.
fn post_processor(info: &GgufTokenizerInfo) -> Option<Value> {
    let bos = info.bos_text.as_deref().filter(|_| info.add_bos);
    let eos = info.eos_text.as_deref().filter(|_| info.add_eos);
    if bos.is_none() && eos.is_none() {
        return None;
    }
    let special = |t: &str, type_id: u32| json!({"SpecialToken": {"id": t, "type_id": type_id}});
    let sequence = |s: &str, type_id: u32| json!({"Sequence": {"id": s, "type_id": type_id}});
    let part = |s: &str, type_id: u32| {
        let mut v: Vec<Value> = bos.map(|b| special(b, type_id)).into_iter().collect();
        v.push(sequence(s, type_id));
        v.extend(eos.map(|e| special(e, type_id)));
        v
    };
    let single = part("A", 0);
    let pair: Vec<Value> = single.iter().cloned().chain(part("B", 1)).collect();
    let mut special_tokens = Map::new();
    for (text, id) in [(bos, info.bos), (eos, info.eos)] {
        if let (Some(text), Some(id)) = (text, id) {
            special_tokens.insert(
                text.to_string(),
                json!({"id": text, "ids": [id], "tokens": [text]}),
            );
        }
    }
    Some(json!({
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": special_tokens,
    }))
}

/// The tokens as a BPE model's vocabulary.
struct Vocabulary<'a> {
    /// Text -> GGUF id.
    ids: HashMap<&'a str, u32>,
    /// The same, as tokenizer.json's `model.vocab`.
    json: Map<String, Value>,
    /// tokenizer.json's `added_tokens`.
    added: Vec<Value>,
    /// The first `UNKNOWN` token's text.
    unk: Option<&'a str>,
}

/// Every token at its GGUF index (see the module documentation for what is skipped), and the
/// added tokens: `CONTROL` ones special, `USER_DEFINED` ones not, and `UNKNOWN` ones special
/// when `unknown_added` (SentencePiece's `<unk>`, which transformers adds).
fn vocabulary<'a>(tokens: &[&'a str], types: &[i64], unknown_added: bool) -> Vocabulary<'a> {
    let mut v = Vocabulary {
        ids: HashMap::with_capacity(tokens.len()),
        json: Map::new(),
        added: Vec::new(),
        unk: None,
    };
    for (id, (&text, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == TOKEN_UNUSED || text.is_empty() || v.ids.contains_key(text) {
            continue;
        }
        let id = id as u32;
        v.ids.insert(text, id);
        v.json.insert(text.to_string(), json!(id));
        if ty == TOKEN_UNKNOWN {
            v.unk.get_or_insert(text);
        }
        let special = match ty {
            TOKEN_CONTROL => true,
            TOKEN_UNKNOWN if unknown_added => true,
            TOKEN_USER_DEFINED => false,
            _ => continue,
        };
        v.added.push(json!({
            "id": id,
            "content": text,
            "single_word": false,
            "lstrip": false,
            "rstrip": false,
            "normalized": false,
            "special": special,
        }));
    }
    v
}

/// A SentencePiece BPE vocabulary (`tokenizer.ggml.model` "llama": Llama 1/2, Mistral,
/// Mixtral) as the tokenizer.json transformers' `LlamaConverter` makes of the original
/// `tokenizer.model` (the legacy form Mixtral's published tokenizer.json has): a BPE model over
/// the vocabulary whose merges are every split of a piece into two pieces, ranked by the
/// piece's score (`tokenizer.ggml.scores`; ties as transformers' `generate_merges` orders
/// them), byte fallback to the `<0xXX>` tokens, unknown text fused into `<unk>`; the normalizer
/// writes spaces as `▁` and, unless `tokenizer.ggml.add_space_prefix` is false, puts one before
/// the text and after each special token (as llama.cpp's SentencePiece tokenizer does). That
/// ranks merges as llama.cpp does, highest score first.
fn sentencepiece_json(file: &GgufFile, info: &GgufTokenizerInfo) -> Result<String, GgufError> {
    const SCORES: &str = "tokenizer.ggml.scores";
    let tokens = tokens(file)?;
    let types = token_types(file, tokens.len())?;
    let scores: Vec<f64> = match array_key(file, SCORES)? {
        Some(items) if items.len() == tokens.len() => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_f64().ok_or_else(|| {
                    err(
                        file,
                        &format!("{SCORES}[{i}] is {v}, not a number (re-convert the GGUF)"),
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        Some(items) => {
            return Err(err(
                file,
                &format!(
                    "{SCORES} has {} entries for {} tokens (re-convert the GGUF)",
                    items.len(),
                    tokens.len()
                ),
            ))
        }
        None => {
            return Err(err(
                file,
                &format!("no {SCORES}: a SentencePiece vocabulary ranks its merges by them"),
            ))
        }
    };
    let prefix = bool_key(file, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
    let Vocabulary {
        ids: vocab,
        json: vocab_json,
        added,
        unk,
    } = vocabulary(&tokens, &types, true);
    // transformers' generate_merges: each piece's splits into two pieces, ordered by the ids of
    // their parts, then all of them by (score, left length, right length) descending, stably.
    let mut merges: Vec<(f64, usize, usize, u32, u32, &str, &str)> = Vec::new();
    for (id, &text) in tokens.iter().enumerate() {
        if vocab.get(text) != Some(&(id as u32)) {
            continue;
        }
        let mut local = Vec::new();
        for (cut, _) in text.char_indices().skip(1) {
            let (l, r) = text.split_at(cut);
            if let (Some(&il), Some(&ir)) = (vocab.get(l), vocab.get(r)) {
                local.push((
                    scores[id],
                    l.chars().count(),
                    r.chars().count(),
                    il,
                    ir,
                    l,
                    r,
                ));
            }
        }
        local.sort_by_key(|m| (m.3, m.4));
        merges.extend(local);
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    let merges: Vec<Value> = merges.iter().map(|m| json!([m.5, m.6])).collect();
    let byte_fallback = types.contains(&TOKEN_BYTE);

    let mut normalizers = Vec::new();
    if prefix {
        normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
    }
    normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}));
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": null,
        "post_processor": post_processor(info),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": unk,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": byte_fallback,
            "ignore_merges": false,
            "vocab": vocab_json,
            "merges": merges,
        },
    });
    Ok(tokenizer.to_string())
}

fn err(file: &GgufFile, message: &str) -> GgufError {
    GgufError {
        path: file.path().to_path_buf(),
        message: message.to_string(),
    }
}

fn string_key<'a>(file: &'a GgufFile, key: &str) -> Result<Option<&'a str>, GgufError> {
    match file.metadata(key) {
        None => Ok(None),
        Some(v) => v.as_str().map(Some).ok_or_else(|| {
            err(
                file,
                &format!("{key} is {v}, not a string (re-convert the GGUF)"),
            )
        }),
    }
}

fn bool_key(file: &GgufFile, key: &str) -> Result<Option<bool>, GgufError> {
    match file.metadata(key) {
        None => Ok(None),
        Some(GgufValue::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(err(
            file,
            &format!("{key} is {v}, not a boolean (re-convert the GGUF)"),
        )),
    }
}

/// An array-valued key; `None` when absent.
fn array_key<'a>(file: &'a GgufFile, key: &str) -> Result<Option<&'a [GgufValue]>, GgufError> {
    match file.metadata(key) {
        None => Ok(None),
        Some(v) => v.as_array().map(Some).ok_or_else(|| {
            err(
                file,
                &format!("{key} is {v}, not an array (re-convert the GGUF)"),
            )
        }),
    }
}

/// `tokenizer.ggml.tokens`, index = id.
fn tokens(file: &GgufFile) -> Result<Vec<&str>, GgufError> {
    const KEY: &str = "tokenizer.ggml.tokens";
    let items = array_key(file, KEY)?.ok_or_else(|| {
        err(
            file,
            &format!(
                "no {KEY}: this GGUF has no tokenizer vocabulary (use the original model's \
                 tokenizer.json)"
            ),
        )
    })?;
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_str().ok_or_else(|| {
                err(
                    file,
                    &format!("{KEY}[{i}] is {v}, not a string (re-convert the GGUF)"),
                )
            })
        })
        .collect()
}

/// `tokenizer.ggml.token_type`, one per token; absent: all NORMAL.
fn token_types(file: &GgufFile, n: usize) -> Result<Vec<i64>, GgufError> {
    const KEY: &str = "tokenizer.ggml.token_type";
    let Some(items) = array_key(file, KEY)? else {
        return Ok(vec![TOKEN_NORMAL; n]);
    };
    if items.len() != n {
        return Err(err(
            file,
            &format!(
                "{KEY} has {} entries for {n} tokens in tokenizer.ggml.tokens (re-convert the GGUF)",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            integer(v).ok_or_else(|| {
                err(
                    file,
                    &format!("{KEY}[{i}] is {v}, not an integer (re-convert the GGUF)"),
                )
            })
        })
        .collect()
}

fn integer(v: &GgufValue) -> Option<i64> {
    match *v {
        GgufValue::I8(x) => Some(x.into()),
        GgufValue::I16(x) => Some(x.into()),
        GgufValue::I32(x) => Some(x.into()),
        GgufValue::I64(x) => Some(x),
        _ => v.as_u64().and_then(|x| i64::try_from(x).ok()),
    }
}

/// `tokenizer.ggml.merges` as `[left, right]` pairs, each split at its first space after the
/// first byte (as llama.cpp splits them), every part and result checked against the vocabulary
/// (the `tokenizers` crate refuses a merge that is not).
fn merges(file: &GgufFile, vocab: &HashMap<&str, u32>) -> Result<Vec<Value>, GgufError> {
    const KEY: &str = "tokenizer.ggml.merges";
    let items = array_key(file, KEY)?.ok_or_else(|| {
        err(
            file,
            &format!(
                "no {KEY}: a \"gpt2\" (byte-level BPE) tokenizer needs its merges (re-convert \
                 the GGUF)"
            ),
        )
    })?;
    let mut out = Vec::with_capacity(items.len());
    let mut merged = String::new();
    for (i, v) in items.iter().enumerate() {
        let merge = v.as_str().ok_or_else(|| {
            err(
                file,
                &format!("{KEY}[{i}] is {v}, not a string (re-convert the GGUF)"),
            )
        })?;
        // A space byte is never inside a multi-byte character, so `at` is a char boundary.
        let split = merge
            .bytes()
            .skip(1)
            .position(|b| b == b' ')
            .map(|at| (&merge[..at + 1], &merge[at + 2..]))
            .filter(|(_, right)| !right.is_empty());
        let Some((left, right)) = split else {
            return Err(err(
                file,
                &format!(
                    "{KEY}[{i}] is {merge:?}, not two tokens separated by a space (\"a b\"; \
                     re-convert the GGUF)"
                ),
            ));
        };
        merged.clear();
        merged.push_str(left);
        merged.push_str(right);
        for part in [left, right, merged.as_str()] {
            if !vocab.contains_key(part) {
                return Err(err(
                    file,
                    &format!(
                        "{KEY}[{i}] {merge:?} needs the token {part:?}, which is not in \
                         tokenizer.ggml.tokens (re-convert the GGUF)"
                    ),
                ));
            }
        }
        out.push(json!([left, right]));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF (version 3, no tensors) holding `kv`, opened from a temporary directory.
    fn open(kv: &[(&str, GgufValue)]) -> Result<GgufFile, GgufError> {
        let kv: Vec<(String, GgufValue)> =
            kv.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        let b = crate::gguf::metadata_only_gguf(&kv);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.gguf");
        std::fs::write(&path, b).unwrap();
        GgufFile::open(&path)
    }

    fn strings(items: &[&str]) -> GgufValue {
        GgufValue::Array(
            items
                .iter()
                .map(|s| GgufValue::String(s.to_string()))
                .collect(),
        )
    }

    fn s(v: &str) -> GgufValue {
        GgufValue::String(v.to_string())
    }

    /// A small valid byte-level vocabulary: "a", "b", "ab", a control and a user-defined
    /// token, and a `[PAD5]` filler.
    fn valid() -> Vec<(&'static str, GgufValue)> {
        vec![
            ("tokenizer.ggml.model", s("gpt2")),
            ("tokenizer.ggml.pre", s("qwen2")),
            (
                "tokenizer.ggml.tokens",
                strings(&["a", "b", "ab", "<|im_end|>", "<think>", "[PAD5]"]),
            ),
            (
                "tokenizer.ggml.token_type",
                GgufValue::Array([1, 1, 1, 3, 4, 5].map(GgufValue::I32).to_vec()),
            ),
            ("tokenizer.ggml.merges", strings(&["a b"])),
            ("tokenizer.ggml.eos_token_id", GgufValue::U32(3)),
            ("tokenizer.ggml.padding_token_id", GgufValue::U32(3)),
            ("tokenizer.ggml.bos_token_id", GgufValue::U32(99)),
            ("tokenizer.ggml.add_bos_token", GgufValue::Bool(false)),
            ("tokenizer.chat_template", s("{{ messages }}")),
        ]
    }

    fn with(
        mut kv: Vec<(&'static str, GgufValue)>,
        key: &'static str,
        v: Option<GgufValue>,
    ) -> Vec<(&'static str, GgufValue)> {
        kv.retain(|(k, _)| *k != key);
        if let Some(v) = v {
            kv.push((key, v));
        }
        kv
    }

    fn json_of(kv: &[(&str, GgufValue)]) -> Value {
        serde_json::from_str(&tokenizer_json(&open(kv).unwrap()).unwrap()).unwrap()
    }

    #[test]
    fn builds_a_qwen_style_tokenizer_json() {
        let t = json_of(&valid());
        assert_eq!(t["normalizer"], json!({"type": "NFC"}));
        let pre = &t["pre_tokenizer"]["pretokenizers"];
        assert_eq!(pre[0]["pattern"]["Regex"], json!(QWEN2));
        assert_eq!(pre[0]["behavior"], json!("Isolated"));
        assert_eq!(pre[1]["type"], json!("ByteLevel"));
        assert_eq!(pre[1]["use_regex"], json!(false));
        let model = &t["model"];
        assert_eq!(model["type"], json!("BPE"));
        assert_eq!(model["ignore_merges"], json!(false));
        // The filler is left out; the added tokens are in the vocab at their ids.
        assert_eq!(
            model["vocab"],
            json!({"a": 0, "b": 1, "ab": 2, "<|im_end|>": 3, "<think>": 4})
        );
        assert_eq!(model["merges"], json!([["a", "b"]]));
        let added = t["added_tokens"].as_array().unwrap();
        assert_eq!(added.len(), 2);
        assert_eq!(
            (&added[0]["content"], &added[0]["id"], &added[0]["special"]),
            (&json!("<|im_end|>"), &json!(3), &json!(true))
        );
        assert_eq!(
            (&added[1]["content"], &added[1]["special"]),
            (&json!("<think>"), &json!(false))
        );
        assert_eq!(t["post_processor"]["type"], json!("ByteLevel"));
        assert_eq!(t["decoder"]["type"], json!("ByteLevel"));
    }

    #[test]
    fn qwen2_regex_is_the_one_of_qwens_tokenizer_json() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/qwen3_moe-bf16/tokenizer.json"
        );
        let original: Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(
            original["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"],
            json!(QWEN2)
        );
    }

    #[test]
    fn pre_tokenizer_names_choose_normalizer_splits_and_flags() {
        let t = json_of(&with(valid(), "tokenizer.ggml.pre", Some(s("deepseek-v3"))));
        assert_eq!(t["normalizer"], Value::Null);
        let pre = t["pre_tokenizer"]["pretokenizers"].as_array().unwrap();
        assert_eq!(pre.len(), 4);
        assert_eq!(pre[0]["pattern"]["Regex"], json!("\\p{N}{1,3}"));
        let t = json_of(&with(valid(), "tokenizer.ggml.pre", Some(s("llama-bpe"))));
        assert_eq!(t["model"]["ignore_merges"], json!(true));
        let t = json_of(&with(valid(), "tokenizer.ggml.pre", Some(s("qwen35"))));
        assert_eq!(t["normalizer"], json!({"type": "NFC"}));
        // No name: llama.cpp's fallback.
        let t = json_of(&with(valid(), "tokenizer.ggml.pre", None));
        assert_eq!(
            t["pre_tokenizer"]["pretokenizers"]
                .as_array()
                .unwrap()
                .len(),
            5
        );
        assert!(supported_pre_tokenizers().contains(&"gpt-4o"));
    }

    #[test]
    fn add_bos_and_add_eos_become_a_template() {
        let kv = with(
            valid(),
            "tokenizer.ggml.bos_token_id",
            Some(GgufValue::U32(4)),
        );
        let kv = with(
            kv,
            "tokenizer.ggml.add_bos_token",
            Some(GgufValue::Bool(true)),
        );
        let kv = with(
            kv,
            "tokenizer.ggml.add_eos_token",
            Some(GgufValue::Bool(true)),
        );
        let t = json_of(&kv);
        let pp = &t["post_processor"];
        assert_eq!(pp["type"], json!("TemplateProcessing"));
        assert_eq!(
            pp["single"],
            json!([
                {"SpecialToken": {"id": "<think>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<|im_end|>", "type_id": 0}},
            ])
        );
        assert_eq!(pp["pair"].as_array().unwrap().len(), 6);
        assert_eq!(pp["special_tokens"]["<think>"]["ids"], json!([4]));
    }

    #[test]
    fn info_reads_ids_texts_flags_and_template() {
        let info = GgufTokenizerInfo::read(&open(&valid()).unwrap()).unwrap();
        assert_eq!(info.model, "gpt2");
        assert_eq!(info.pre.as_deref(), Some("qwen2"));
        assert_eq!(info.n_tokens, 6);
        assert_eq!(
            (info.eos, info.eos_text.as_deref()),
            (Some(3), Some("<|im_end|>"))
        );
        assert_eq!(info.pad, Some(3));
        // Out of range: ignored, as llama.cpp ignores it.
        assert_eq!((info.bos, info.bos_text), (None, None));
        assert!(!info.add_bos && !info.add_eos);
        assert_eq!(info.chat_template.as_deref(), Some("{{ messages }}"));
        // Llama 3 adds BOS unless the file says otherwise.
        let kv = with(valid(), "tokenizer.ggml.add_bos_token", None);
        let kv = with(kv, "tokenizer.ggml.pre", Some(s("llama-bpe")));
        assert!(
            GgufTokenizerInfo::read(&open(&kv).unwrap())
                .unwrap()
                .add_bos
        );
    }

    #[test]
    fn merges_split_at_the_first_space_after_the_first_byte() {
        let kv = with(
            valid(),
            "tokenizer.ggml.tokens",
            Some(strings(&[
                "é",
                "b",
                "éb",
                "<|im_end|>",
                "<think>",
                "[PAD5]",
            ])),
        );
        let kv = with(kv, "tokenizer.ggml.merges", Some(strings(&["é b"])));
        assert_eq!(json_of(&kv)["model"]["merges"], json!([["é", "b"]]));
    }

    #[test]
    fn every_defect_is_a_one_line_error_naming_the_file_and_key() {
        let cases: Vec<(Vec<(&str, GgufValue)>, &str)> = vec![
            (
                with(valid(), "tokenizer.ggml.tokens", None),
                "no tokenizer.ggml.tokens",
            ),
            (
                with(valid(), "tokenizer.ggml.tokens", Some(s("a"))),
                "tokenizer.ggml.tokens is \"a\", not an array",
            ),
            (
                with(
                    valid(),
                    "tokenizer.ggml.tokens",
                    Some(GgufValue::Array(vec![GgufValue::U32(1); 6])),
                ),
                "tokenizer.ggml.tokens[0] is 1, not a string",
            ),
            (
                with(valid(), "tokenizer.ggml.model", None),
                "no tokenizer.ggml.model",
            ),
            (
                with(valid(), "tokenizer.ggml.model", Some(s("bert"))),
                "tokenizer.ggml.model \"bert\" is not supported",
            ),
            (
                with(valid(), "tokenizer.ggml.model", Some(s("llama"))),
                "no tokenizer.ggml.scores: a SentencePiece vocabulary ranks its merges by them",
            ),
            (
                with(
                    with(valid(), "tokenizer.ggml.model", Some(s("llama"))),
                    "tokenizer.ggml.scores",
                    Some(GgufValue::Array(vec![GgufValue::F32(0.0); 2])),
                ),
                "tokenizer.ggml.scores has 2 entries for 6 tokens",
            ),
            (
                with(valid(), "tokenizer.ggml.pre", Some(s("kimi-k2"))),
                "tokenizer.ggml.pre \"kimi-k2\" is not supported yet (supported: qwen2,",
            ),
            (
                with(valid(), "tokenizer.ggml.merges", None),
                "no tokenizer.ggml.merges",
            ),
            (
                with(valid(), "tokenizer.ggml.merges", Some(strings(&["ab"]))),
                "tokenizer.ggml.merges[0] is \"ab\", not two tokens separated by a space",
            ),
            (
                with(valid(), "tokenizer.ggml.merges", Some(strings(&["a "]))),
                "not two tokens separated by a space",
            ),
            (
                with(
                    valid(),
                    "tokenizer.ggml.merges",
                    Some(strings(&["a b", "b a"])),
                ),
                "tokenizer.ggml.merges[1] \"b a\" needs the token \"ba\"",
            ),
            (
                with(valid(), "tokenizer.ggml.merges", Some(strings(&["a c"]))),
                "needs the token \"c\"",
            ),
            (
                with(
                    valid(),
                    "tokenizer.ggml.token_type",
                    Some(GgufValue::Array(vec![GgufValue::I32(1); 2])),
                ),
                "tokenizer.ggml.token_type has 2 entries for 6 tokens",
            ),
            (
                with(
                    valid(),
                    "tokenizer.ggml.add_bos_token",
                    Some(GgufValue::U8(1)),
                ),
                "tokenizer.ggml.add_bos_token is 1, not a boolean",
            ),
            (
                with(valid(), "tokenizer.ggml.eos_token_id", Some(s("x"))),
                "tokenizer.ggml.eos_token_id is \"x\", not a token id",
            ),
            (
                with(valid(), "tokenizer.chat_template", Some(GgufValue::U32(0))),
                "tokenizer.chat_template is 0, not a string",
            ),
        ];
        for (kv, want) in cases {
            let e = tokenizer_json(&open(&kv).unwrap()).unwrap_err().to_string();
            assert!(e.contains(want), "wanted {want:?}, got {e:?}");
            assert!(e.contains("model.gguf: "), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}
