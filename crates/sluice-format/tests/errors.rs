//! Every defect of a model directory gives a one-line error naming the file (and tensor).

mod common;

use common::*;
use serde_json::json;
use sluice_format::{read_safetensors, ModelDir, StDtype};

fn config() -> serde_json::Value {
    json!({"model_type": "qwen3_moe"})
}

fn open_err(d: &Dir) -> String {
    msg(ModelDir::open(d.path()).unwrap_err())
}

/// A directory whose only weight file is `bytes`.
fn dir_with_raw(bytes: &[u8]) -> Dir {
    let d = Dir::new(config());
    d.bytes("model.safetensors", bytes);
    d
}

#[test]
fn missing_dir() {
    let d = Dir::empty();
    let p = d.file("nope");
    let m = msg(ModelDir::open(&p).unwrap_err());
    has(&m, &["does not exist", "nope"]);
}

#[test]
fn file_instead_of_dir() {
    let d = Dir::new(config());
    let m = msg(ModelDir::open(d.file("config.json")).unwrap_err());
    has(&m, &["config.json", "is not a directory"]);
}

#[test]
fn missing_config() {
    let d = Dir::empty();
    d.text("tokenizer.json", "{}");
    has(
        &open_err(&d),
        &["no config.json in", "Hugging Face model directory"],
    );
}

#[test]
fn invalid_config_json_names_file_and_line() {
    let d = Dir::empty();
    d.text("tokenizer.json", "{}");
    d.text(
        "config.json",
        "{\n  \"model_type\": \"x\",\n  \"hidden_size\": ,\n}\n",
    );
    has(&open_err(&d), &["config.json is not valid JSON", "line 3"]);
    d.text("config.json", "[1, 2]");
    has(&open_err(&d), &["config.json", "expected a JSON object"]);
}

#[test]
fn missing_tokenizer_json() {
    let d = Dir::empty();
    d.json("config.json", &config());
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[1], 1)]);
    has(
        &open_err(&d),
        &["no tokenizer.json in", "copy tokenizer.json"],
    );
}

#[test]
fn missing_weights() {
    let d = Dir::new(config());
    let m = open_err(&d);
    has(
        &m,
        &[
            "no weights in",
            "expected model.safetensors or model.safetensors.index.json",
        ],
    );
    assert!(m.contains(&d.path().display().to_string()));
}

#[test]
fn truncated_safetensors() {
    let d = Dir::new(config());
    d.st(
        "model.safetensors",
        &[
            dense("a", StDtype::F32, &[10], 1),
            dense("big", StDtype::F32, &[1000], 2),
        ],
    );
    let full = std::fs::read(d.file("model.safetensors")).unwrap();
    d.bytes("model.safetensors", &full[..full.len() - 3000]);
    let m = open_err(&d);
    has(
        &m,
        &[
            "model.safetensors is truncated",
            "tensor `big` needs bytes up to 4040 of the data section but the file has only 1040",
            "re-download",
        ],
    );
}

#[test]
fn every_truncation_and_corruption_is_an_error_not_a_panic() {
    let d = Dir::new(config());
    d.st(
        "model.safetensors",
        &[
            dense("a.weight", StDtype::BF16, &[2, 4], 1),
            dense("b", StDtype::F32, &[3], 2),
        ],
    );
    let full = std::fs::read(d.file("model.safetensors")).unwrap();
    let path = d.file("cut.safetensors");
    for len in 0..full.len() {
        std::fs::write(&path, &full[..len]).unwrap();
        let e = read_safetensors(&path).unwrap_err();
        let m = msg(e);
        assert!(m.contains("cut.safetensors"), "{m}");
    }
    for i in 0..full.len() {
        for b in [0u8, b'"', b'9', 0xff] {
            let mut c = full.clone();
            c[i] = b;
            std::fs::write(&path, &c).unwrap();
            if let Err(e) = read_safetensors(&path) {
                let _ = msg(e);
            }
        }
    }
}

#[test]
fn absurd_header_length() {
    let mut bytes = u64::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    let d = dir_with_raw(&bytes);
    has(
        &open_err(&d),
        &[
            "model.safetensors",
            "header length 18446744073709551615 is larger than the rest of the file (2 bytes)",
        ],
    );
    let d = dir_with_raw(&[1, 2, 3]);
    has(&open_err(&d), &["model.safetensors", "too short"]);
}

#[test]
fn header_not_json() {
    let d = dir_with_raw(&raw_st("{\"a\": nope}", &[]));
    has(
        &open_err(&d),
        &["model.safetensors", "header is not a valid JSON object"],
    );
    let d = dir_with_raw(&raw_st(r#"{"a": {"dtype": "F32", "shape": [1]}}"#, &[0; 4]));
    has(
        &open_err(&d),
        &[
            "tensor `a`",
            "model.safetensors",
            "malformed header entry",
            "data_offsets",
        ],
    );
}

#[test]
fn unknown_dtype() {
    let d = dir_with_raw(&raw_st(
        r#"{"__metadata__": {"format": "pt"}, "w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}"#,
        &[0],
    ));
    has(
        &open_err(&d),
        &[
            "tensor `w`",
            "model.safetensors",
            "unsupported dtype `F4`",
            "BF16",
        ],
    );
}

#[test]
fn shape_bytes_mismatch() {
    let d = dir_with_raw(&raw_st(
        r#"{"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}"#,
        &[0; 24],
    ));
    has(
        &open_err(&d),
        &[
            "tensor `w`",
            "model.safetensors",
            "shape [2, 3] of F32 needs 24 bytes but data_offsets [0, 20] span 20",
        ],
    );
    let d = dir_with_raw(&raw_st(
        r#"{"w": {"dtype": "U8", "shape": [0], "data_offsets": [4, 0]}}"#,
        &[0; 4],
    ));
    has(&open_err(&d), &["tensor `w`", "reversed"]);
    let d = dir_with_raw(&raw_st(
        r#"{"w": {"dtype": "F64", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 8]}}"#,
        &[0; 8],
    ));
    has(&open_err(&d), &["tensor `w`", "too large"]);
}

#[test]
fn missing_tensor_suggests_similar_names() {
    let d = Dir::new(config());
    d.st(
        "model.safetensors",
        &[
            dense(
                "model.layers.0.self_attn.q_proj.weight",
                StDtype::BF16,
                &[2, 2],
                1,
            ),
            dense(
                "model.layers.0.self_attn.k_proj.weight",
                StDtype::BF16,
                &[2, 2],
                1,
            ),
            dense("lm_head.weight", StDtype::BF16, &[2, 2], 1),
        ],
    );
    let m = ModelDir::open(d.path()).unwrap();
    let e = msg(m
        .tensors
        .get("model.layers.0.self_attn.o_proj.weight")
        .unwrap_err());
    has(
        &e,
        &[
            "tensor `model.layers.0.self_attn.o_proj.weight` not found in",
            "(3 tensors; similar: ",
            "model.layers.0.self_attn.q_proj.weight",
        ],
    );
    assert!(!e.contains("lm_head"), "{e}");
    let e = msg(m
        .tensors
        .matrix("model.layers.1.mlp.down_proj", None, None)
        .unwrap_err());
    has(
        &e,
        &["tensor `model.layers.1.mlp.down_proj.weight` not found"],
    );
    let e = msg(m.tensors.vector_f32("zzz", None).unwrap_err());
    has(&e, &["tensor `zzz` not found", "(3 tensors)"]);
}

#[test]
fn wrong_shape_vs_expect() {
    let mut c = config();
    c["quantization"] = json!({"bits": 4, "group_size": 32});
    let d = Dir::new(c);
    let mut ts = vec![
        dense("a.weight", StDtype::BF16, &[4, 8], 1),
        dense("v", StDtype::F32, &[8], 1),
        dense("m", StDtype::F32, &[2, 4], 1),
        dense("e.weight", StDtype::BF16, &[2, 4, 8], 1),
    ];
    ts.extend(affine("q", &[], 4, 64, 4, 32, StDtype::BF16));
    d.st("model.safetensors", &ts);
    let m = ModelDir::open(d.path()).unwrap();
    let q = m.quantization.as_ref();
    let e = msg(m.tensors.matrix("a", None, Some((8, 4))).unwrap_err());
    has(
        &e,
        &[
            "tensor `a.weight` in",
            "model.safetensors",
            "holds a [4, 8] matrix (BF16 [4, 8]), expected [8, 4]",
        ],
    );
    let e = msg(m.tensors.matrix("e", None, None).unwrap_err());
    has(
        &e,
        &[
            "tensor `e.weight`",
            "has shape [2, 4, 8] (BF16), expected a 2-D [out, in] matrix",
        ],
    );
    let e = msg(m.tensors.matrix_stack("a", None, None).unwrap_err());
    has(
        &e,
        &[
            "tensor `a.weight`",
            "expected a 3-D [experts, out, in] stack",
        ],
    );
    let e = msg(m
        .tensors
        .matrix_stack("e", None, Some((3, 4, 8)))
        .unwrap_err());
    has(
        &e,
        &[
            "tensor `e.weight`",
            "holds 2 experts of [4, 8]",
            "expected 3 experts of [4, 8]",
        ],
    );
    let e = msg(m.tensors.matrix("q", q, Some((4, 32))).unwrap_err());
    has(
        &e,
        &[
            "tensor `q.weight`",
            "holds rows of 64 columns at 4 bits",
            "expected 32 columns",
            "the shapes fit 8 bits, group size 16",
        ],
    );
    let e = msg(m.tensors.matrix("q", q, Some((5, 64))).unwrap_err());
    has(
        &e,
        &[
            "tensor `q.weight`",
            "holds a [4, 64] matrix",
            "at 4 bits, group 32",
            "expected [5, 64]",
        ],
    );
    let e = msg(m.tensors.vector_f32("v", Some(9)).unwrap_err());
    has(&e, &["tensor `v`", "has length 8, expected 9"]);
    let e = msg(m.tensors.vector_f32("m", None).unwrap_err());
    has(
        &e,
        &["tensor `m`", "has shape [2, 4], expected a 1-D vector"],
    );
}

#[test]
fn wrong_dtype() {
    let d = Dir::new(config());
    d.st(
        "model.safetensors",
        &[
            dense("i.weight", StDtype::I32, &[2, 2], 1),
            dense("u.weight", StDtype::U32, &[2, 2], 1),
            dense("ints", StDtype::I64, &[2], 1),
            dense("fp8.weight", StDtype::F8_E4M3, &[2, 2], 1),
        ],
    );
    let m = ModelDir::open(d.path()).unwrap();
    let e = msg(m.tensors.matrix("i", None, None).unwrap_err());
    has(
        &e,
        &[
            "tensor `i.weight` in",
            "model.safetensors",
            "dtype I32, expected F32, F16 or BF16",
        ],
    );
    let e = msg(m.tensors.matrix("u", None, None).unwrap_err());
    has(
        &e,
        &["tensor `u.weight`", "dtype U32", "there is no `u.scales`"],
    );
    // DeepSeek-V3's official FP8 weights: the error says what to do.
    let e = msg(m.tensors.matrix("fp8", None, None).unwrap_err());
    has(
        &e,
        &["tensor `fp8.weight`", "dtype F8_E4M3", "convert to bf16"],
    );
    let e = msg(m.tensors.vector_f32("ints", None).unwrap_err());
    has(&e, &["tensor `ints`", "dtype I64, expected a float dtype"]);
    let e = msg(m.tensors.to_f32("ints").unwrap_err());
    has(&e, &["tensor `ints`", "expected a float dtype"]);
}

#[test]
fn bad_affine_tensors() {
    let mut c = config();
    c["quantization"] = json!({"bits": 4, "group_size": 32});
    let d = Dir::new(c);
    let mut ts = affine("a", &[], 4, 64, 4, 32, StDtype::BF16);
    ts.push(dense("nob.weight", StDtype::U32, &[4, 8], 1));
    ts.push(dense("nob.scales", StDtype::BF16, &[4, 2], 1));
    ts.push(dense("f.weight", StDtype::BF16, &[4, 8], 1));
    ts.push(dense("f.scales", StDtype::BF16, &[4, 2], 1));
    ts.push(dense("f.biases", StDtype::BF16, &[4, 2], 1));
    ts.push(dense("s.weight", StDtype::U32, &[4, 8], 1));
    ts.push(dense("s.scales", StDtype::I8, &[4, 2], 1));
    ts.push(dense("s.biases", StDtype::I8, &[4, 2], 1));
    ts.push(dense("r.weight", StDtype::U32, &[4, 8], 1));
    ts.push(dense("r.scales", StDtype::BF16, &[3, 2], 1));
    ts.push(dense("r.biases", StDtype::BF16, &[3, 2], 1));
    ts.push(dense("mix.weight", StDtype::U32, &[4, 8], 1));
    ts.push(dense("mix.scales", StDtype::BF16, &[4, 2], 1));
    ts.push(dense("mix.biases", StDtype::F16, &[4, 2], 1));
    d.st("model.safetensors", &ts);
    let m = ModelDir::open(d.path()).unwrap();
    let q = m.quantization.as_ref();
    let e = msg(m.tensors.matrix("nob", q, None).unwrap_err());
    has(&e, &["tensor `nob.scales`", "`nob.biases` does not"]);
    let e = msg(m.tensors.matrix("f", q, None).unwrap_err());
    has(&e, &["tensor `f.weight`", "dtype BF16, expected U32"]);
    let e = msg(m.tensors.matrix("s", q, None).unwrap_err());
    has(&e, &["tensor `s.scales`", "dtype I8"]);
    let e = msg(m.tensors.matrix("r", q, None).unwrap_err());
    has(
        &e,
        &[
            "tensor `r.scales`",
            "does not fit the packed weight `r.weight` [4, 8]",
        ],
    );
    let e = msg(m.tensors.matrix("mix", q, None).unwrap_err());
    has(&e, &["tensor `mix.biases`", "BF16 [4, 2]"]);
    let e = msg(m.tensors.matrix_stack("a", q, None).unwrap_err());
    has(
        &e,
        &[
            "tensor `a.weight`",
            "expected a 3-D [experts, out, in] stack (packed)",
        ],
    );
}

#[test]
fn quantized_tensor_without_quantization_config() {
    let d = Dir::new(config());
    d.st(
        "model.safetensors",
        &affine(
            "model.layers.0.mlp.up_proj",
            &[],
            4,
            64,
            4,
            32,
            StDtype::BF16,
        ),
    );
    let m = ModelDir::open(d.path()).unwrap();
    let e = msg(m
        .tensors
        .matrix("model.layers.0.mlp.up_proj", m.quantization.as_ref(), None)
        .unwrap_err());
    has(
        &e,
        &[
            "tensor `model.layers.0.mlp.up_proj.weight` in",
            "model.safetensors",
            "is MLX-quantised",
            "config.json has no `quantization` settings",
        ],
    );
}

#[test]
fn quantization_disagreeing_with_shapes() {
    let mut c = config();
    c["quantization"] = json!({"bits": 4, "group_size": 64, "off": false, "odd": {"bits": 3}});
    let d = Dir::new(c);
    // 8 bits, group 64: does not fit 4 bits, group 64 at all.
    let mut ts = affine("x", &[], 2, 128, 8, 64, StDtype::F16);
    // 8 bits, group 32: fits 4 bits, group 64 too (twice the columns); only `expect` tells.
    ts.extend(affine("y", &[], 2, 64, 8, 32, StDtype::F16));
    ts.extend(affine("off", &[], 2, 64, 4, 64, StDtype::F16));
    ts.extend(affine("odd", &[], 2, 64, 4, 64, StDtype::F16));
    d.st("model.safetensors", &ts);
    let m = ModelDir::open(d.path()).unwrap();
    let q = m.quantization.as_ref();
    let e = msg(m.tensors.matrix("x", q, None).unwrap_err());
    has(
        &e,
        &[
            "tensor `x.weight`",
            "config.json says `x` has 4 bits, group size 64",
            "32 u32 words per row and 2 groups per row",
            "8 bits with group size 64",
            "fix `quantization` in config.json",
        ],
    );
    let e = msg(m.tensors.matrix("x", q, Some((2, 128))).unwrap_err());
    has(&e, &["(the shapes fit 8 bits with group size 64)"]);
    let y = m.tensors.matrix("y", q, None).unwrap();
    assert_eq!(y.cols, 128, "ambiguous without an expected shape");
    let e = msg(m.tensors.matrix("y", q, Some((2, 64))).unwrap_err());
    has(
        &e,
        &[
            "tensor `y.weight`",
            "holds rows of 128 columns at 4 bits",
            "expected 64 columns: the shapes fit 8 bits, group size 32",
        ],
    );
    let e = msg(m.tensors.matrix("off", q, None).unwrap_err());
    has(
        &e,
        &[
            "tensor `off.weight`",
            "marks `off` as not quantised",
            "`off.scales` exists",
        ],
    );
    let e = msg(m.tensors.matrix("odd", q, None).unwrap_err());
    has(&e, &["tensor `odd.weight`", "3 bits"]);

    // A mode sluice does not read.
    let mut c = config();
    c["quantization"] = json!({"bits": 4, "group_size": 16, "mode": "nvfp4"});
    d.json("config.json", &c);
    let m = ModelDir::open(d.path()).unwrap();
    let e = msg(m
        .tensors
        .matrix("x", m.quantization.as_ref(), None)
        .unwrap_err());
    has(&e, &["tensor `x.weight`", "mode `nvfp4`", "not supported"]);

    // mxfp4 settings over affine tensors: the scales are not mxfp4 exponents.
    c["quantization"] = json!({"bits": 4, "group_size": 32, "mode": "mxfp4"});
    d.json("config.json", &c);
    let m = ModelDir::open(d.path()).unwrap();
    let e = msg(m
        .tensors
        .matrix("x", m.quantization.as_ref(), None)
        .unwrap_err());
    has(
        &e,
        &[
            "tensor `x.scales`",
            "expected U8 mxfp4 exponents",
            "mode mxfp4",
        ],
    );
}

#[test]
fn bad_quantization_settings() {
    let d = Dir::new(config());
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[1], 1)]);
    for (q, want) in [
        (
            json!({"bits": 4}),
            "`quantization.group_size` must be a positive integer, found nothing",
        ),
        (
            json!({"bits": "4", "group_size": 64}),
            "`quantization.bits` must be an integer from 1 to 8, found \"4\"",
        ),
        (json!({"bits": 16, "group_size": 64}), "found 16"),
        (
            json!({"bits": 4, "group_size": 0}),
            "group_size` must be a positive integer, found 0",
        ),
        (
            json!({"bits": 4, "group_size": 64, "mode": 3}),
            "`quantization.mode` must be a string",
        ),
        (
            json!({"bits": 4, "group_size": 64, "m.gate": {"bits": 9}}),
            "`quantization.m.gate.bits`",
        ),
    ] {
        let mut c = config();
        c["quantization"] = q;
        d.json("config.json", &c);
        has(&open_err(&d), &["config.json: ", want]);
    }
}

#[test]
fn missing_shard() {
    let d = Dir::new(config());
    d.st(
        "model-00001-of-00002.safetensors",
        &[dense("a", StDtype::F32, &[1], 1)],
    );
    d.json(
        "model.safetensors.index.json",
        &json!({"weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors",
        }}),
    );
    has(
        &open_err(&d),
        &[
            "model.safetensors.index.json: shard model-00002-of-00002.safetensors (holding 2 tensors, e.g. `b`) is missing from",
            "incomplete download",
        ],
    );
}

#[test]
fn index_and_shards_that_disagree() {
    let d = Dir::new(config());
    d.st("s1.safetensors", &[dense("a", StDtype::F32, &[1], 1)]);
    d.json(
        "model.safetensors.index.json",
        &json!({"weight_map": {"a": "s1.safetensors", "ghost": "s1.safetensors"}}),
    );
    has(
        &open_err(&d),
        &[
            "model.safetensors.index.json",
            "lists tensor `ghost` in s1.safetensors, but no shard holds it",
        ],
    );

    d.json("model.safetensors.index.json", &json!({"metadata": {}}));
    has(
        &open_err(&d),
        &["model.safetensors.index.json", "no `weight_map`"],
    );
    d.json(
        "model.safetensors.index.json",
        &json!({"weight_map": {"a": 3}}),
    );
    has(
        &open_err(&d),
        &[
            "model.safetensors.index.json",
            "`weight_map` entry `a` must be a file name",
        ],
    );
    d.json(
        "model.safetensors.index.json",
        &json!({"weight_map": {"a": "/etc/passwd"}}),
    );
    has(
        &open_err(&d),
        &["model.safetensors.index.json", "inside the model directory"],
    );
    d.text("model.safetensors.index.json", "{ oops");
    has(
        &open_err(&d),
        &["model.safetensors.index.json is not valid JSON", "line 1"],
    );
}

#[test]
fn duplicate_tensor_across_files() {
    let d = Dir::new(config());
    d.st("a.safetensors", &[dense("w", StDtype::F32, &[1], 1)]);
    d.st("b.safetensors", &[dense("w", StDtype::F32, &[1], 1)]);
    has(
        &open_err(&d),
        &["tensor `w` is in both", "a.safetensors", "b.safetensors"],
    );
}

#[test]
fn bad_side_files() {
    let d = Dir::new(config());
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[1], 1)]);
    d.text("tokenizer_config.json", "{\"eos_token\": }");
    has(
        &open_err(&d),
        &["tokenizer_config.json is not valid JSON", "line 1"],
    );
    std::fs::remove_file(d.file("tokenizer_config.json")).unwrap();

    for (g, want) in [
        (
            json!({"eos_token_id": "x"}),
            "`eos_token_id` must be a token id or a list of token ids, found \"x\"",
        ),
        (json!({"eos_token_id": [1, -2]}), "found -2"),
        (
            json!({"bos_token_id": [1, 2]}),
            "`bos_token_id` must be a single token id",
        ),
        (
            json!({"temperature": "hot"}),
            "`temperature` must be a number",
        ),
        (json!({"top_k": 1.5}), "`top_k` must be an integer"),
        (json!([1]), "expected a JSON object"),
    ] {
        d.json("generation_config.json", &g);
        has(&open_err(&d), &["generation_config.json: ", want]);
    }
}

#[derive(serde::Deserialize, Debug)]
#[allow(dead_code)]
struct Cfg {
    hidden_size: usize,
    num_experts: usize,
}

#[test]
fn parse_config_errors_name_file_type_and_key() {
    let d = Dir::new(json!({"model_type": "m", "hidden_size": 8, "num_experts": "many"}));
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[1], 1)]);
    let m = ModelDir::open(d.path()).unwrap();
    let e = msg(m.parse_config::<Cfg>().unwrap_err());
    has(
        &e,
        &[
            "config.json: the config does not fit Cfg",
            "invalid type: string \"many\"",
            "(at `num_experts`)",
        ],
    );
    assert!(!e.contains("line"), "{e}");

    let d = Dir::new(json!({"model_type": "m", "text_config": {"hidden_size": 8}}));
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[1], 1)]);
    let m = ModelDir::open(d.path()).unwrap();
    let e = msg(m.parse_config::<Cfg>().unwrap_err());
    has(
        &e,
        &[
            "config.json: `text_config` does not fit Cfg",
            "missing field `num_experts`",
        ],
    );

    let d = Dir::new(json!({"text_config": {}}));
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[1], 1)]);
    let m = ModelDir::open(d.path()).unwrap();
    has(
        &msg(m.model_type().unwrap_err()),
        &["config.json", "no `model_type`"],
    );
}
