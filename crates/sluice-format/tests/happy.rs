//! Well-formed checkpoints: every reader returns what was written.

mod common;

use std::collections::BTreeMap;

use common::*;
use serde_json::json;
use sluice_format::{read_safetensors, Dtype, ModelDir, QuantConfig, StDtype, WeightFormat};

fn base_config() -> serde_json::Value {
    json!({"model_type": "qwen3_moe", "hidden_size": 8})
}

#[test]
fn dense_matrices_in_bf16_f16_f32() {
    let d = Dir::new(base_config());
    let tensors = vec![
        dense("a.weight", StDtype::BF16, &[3, 8], 1),
        dense("b.weight", StDtype::F16, &[4, 8], 2),
        dense("c.weight", StDtype::F32, &[5, 8], 3),
    ];
    d.st("model.safetensors", &tensors);
    let m = ModelDir::open(d.path()).unwrap();
    assert_eq!(m.model_type().unwrap(), "qwen3_moe");
    assert!(m.quantization.is_none());
    assert_eq!(m.tensors.len(), 3);
    for ((name, dt, shape, bytes), fmt) in tensors.iter().zip([Dtype::Bf16, Dtype::F16, Dtype::F32])
    {
        let prefix = name.strip_suffix(".weight").unwrap();
        let mat = m.tensors.matrix(prefix, None, Some((shape[0], 8))).unwrap();
        assert_eq!(mat.format, WeightFormat::Dense(fmt));
        assert_eq!((mat.rows, mat.cols), (shape[0], shape[1]));
        assert_eq!(mat.data.as_slice(), bytes.as_slice());
        assert!(mat.scales.is_empty() && mat.biases.is_empty());
        let info = m.tensors.get(name).unwrap();
        assert_eq!(info.dtype, *dt);
        assert_eq!(info.file, d.file("model.safetensors"));
    }
    // A quantisation config does not matter for dense weights.
    let q = QuantConfig {
        bits: 4,
        group_size: 64,
        mode: "affine".into(),
        overrides: Default::default(),
        override_modes: Default::default(),
    };
    assert!(m.tensors.matrix("a", Some(&q), None).is_ok());
    let names: Vec<&str> = m.tensors.names().collect();
    assert_eq!(names, ["a.weight", "b.weight", "c.weight"]);
    assert!(m.tensors.contains("b.weight") && !m.tensors.contains("b"));
    assert_eq!(m.tokenizer_path(), d.file("tokenizer.json"));
}

#[test]
fn affine_4_and_8_bit_with_overrides() {
    let mut config = base_config();
    config["quantization"] = json!({
        "group_size": 64, "bits": 4,
        "model.layers.0.mlp.gate": {"group_size": 32, "bits": 8},
        "model.layers.0.mlp.shared_expert_gate": false,
        "model.layers.0.mlp.up": true,
    });
    let d = Dir::new(config);
    let mut ts = affine(
        "model.layers.0.self_attn.q_proj",
        &[],
        8,
        128,
        4,
        64,
        StDtype::BF16,
    );
    ts.extend(affine(
        "model.layers.0.mlp.gate",
        &[],
        4,
        128,
        8,
        32,
        StDtype::F16,
    ));
    ts.push(dense(
        "model.layers.0.mlp.shared_expert_gate.weight",
        StDtype::BF16,
        &[1, 128],
        9,
    ));
    d.st("model.safetensors", &ts);
    let m = ModelDir::open(d.path()).unwrap();
    let q = m.quantization.clone().unwrap();
    assert_eq!((q.bits, q.group_size, q.mode.as_str()), (4, 64, "affine"));
    assert_eq!(q.for_module("model.layers.0.mlp.gate"), Some((8, 32)));
    assert_eq!(q.for_module("model.layers.0.mlp.shared_expert_gate"), None);
    assert_eq!(q.for_module("model.layers.0.mlp.up"), Some((4, 64)));
    assert_eq!(q.for_module("anything.else"), Some((4, 64)));
    assert_eq!(q.overrides.len(), 2);

    let qp = m
        .tensors
        .matrix("model.layers.0.self_attn.q_proj", Some(&q), Some((8, 128)))
        .unwrap();
    assert_eq!(
        qp.format,
        WeightFormat::Affine {
            bits: 4,
            group_size: 64,
            scale_dtype: Dtype::Bf16
        }
    );
    assert_eq!((qp.rows, qp.cols), (8, 128));
    assert_eq!(qp.data.as_slice(), ts[0].3.as_slice());
    assert_eq!(qp.scales.as_slice(), ts[1].3.as_slice());
    assert_eq!(qp.biases.as_slice(), ts[2].3.as_slice());

    let gate = m
        .tensors
        .matrix("model.layers.0.mlp.gate", Some(&q), Some((4, 128)))
        .unwrap();
    assert_eq!(
        gate.format,
        WeightFormat::Affine {
            bits: 8,
            group_size: 32,
            scale_dtype: Dtype::F16
        }
    );
    assert_eq!((gate.rows, gate.cols), (4, 128));

    let seg = m
        .tensors
        .matrix(
            "model.layers.0.mlp.shared_expert_gate",
            Some(&q),
            Some((1, 128)),
        )
        .unwrap();
    assert_eq!(seg.format, WeightFormat::Dense(Dtype::Bf16));
}

#[test]
fn quantization_config_with_mlx_shape_is_used_and_other_schemes_are_not() {
    let mut config = base_config();
    config["quantization_config"] = json!({"group_size": 32, "bits": 8});
    let d = Dir::new(config);
    d.st(
        "model.safetensors",
        &affine("x", &[], 2, 64, 8, 32, StDtype::F32),
    );
    let m = ModelDir::open(d.path()).unwrap();
    let q = m.quantization.as_ref().unwrap();
    assert_eq!((q.bits, q.group_size), (8, 32));
    let x = m.tensors.matrix("x", Some(q), Some((2, 64))).unwrap();
    assert_eq!(
        x.format,
        WeightFormat::Affine {
            bits: 8,
            group_size: 32,
            scale_dtype: Dtype::F32
        }
    );

    let mut config = base_config();
    config["quantization_config"] = json!({"quant_method": "gptq", "bits": 4, "group_size": 128});
    d.json("config.json", &config);
    assert!(ModelDir::open(d.path()).unwrap().quantization.is_none());

    // `quantization` wins over `quantization_config`, and `mode` is read.
    let mut config = base_config();
    config["quantization"] = json!({"group_size": 64, "bits": 4, "mode": "mxfp4"});
    config["quantization_config"] = json!({"group_size": 32, "bits": 8});
    d.json("config.json", &config);
    let q = ModelDir::open(d.path()).unwrap().quantization.unwrap();
    assert_eq!((q.bits, q.group_size, q.mode.as_str()), (4, 64, "mxfp4"));
}

#[test]
fn stacked_experts_slice_to_each_expert() {
    let mut config = base_config();
    config["quantization"] = json!({"group_size": 32, "bits": 4});
    let d = Dir::new(config);
    let mut ts = vec![dense(
        "model.layers.0.mlp.experts.down_proj.weight",
        StDtype::BF16,
        &[3, 4, 8],
        5,
    )];
    ts.extend(affine(
        "model.layers.0.mlp.switch_mlp.gate_proj",
        &[3],
        4,
        64,
        4,
        32,
        StDtype::BF16,
    ));
    // transformers' fused experts: a parameter without a `.weight` suffix.
    ts.push(dense(
        "model.layers.0.mlp.experts.gate_up_proj",
        StDtype::F32,
        &[2, 6, 8],
        7,
    ));
    d.st("model.safetensors", &ts);
    let m = ModelDir::open(d.path()).unwrap();
    let q = m.quantization.as_ref();

    let down = m
        .tensors
        .matrix_stack("model.layers.0.mlp.experts.down_proj", q, Some((3, 4, 8)))
        .unwrap();
    assert_eq!(down.len(), 3);
    let per = 4 * 8 * 2;
    for (e, mat) in down.iter().enumerate() {
        assert_eq!((mat.rows, mat.cols), (4, 8));
        assert_eq!(mat.format, WeightFormat::Dense(Dtype::Bf16));
        assert_eq!(mat.data.as_slice(), &ts[0].3[e * per..(e + 1) * per]);
    }

    let gate = m
        .tensors
        .matrix_stack(
            "model.layers.0.mlp.switch_mlp.gate_proj",
            q,
            Some((3, 4, 64)),
        )
        .unwrap();
    assert_eq!(gate.len(), 3);
    let (wb, sb) = (4 * 64 * 4 / 8, 4 * 2 * 2);
    for (e, mat) in gate.iter().enumerate() {
        assert_eq!((mat.rows, mat.cols), (4, 64));
        assert_eq!(
            mat.format,
            WeightFormat::Affine {
                bits: 4,
                group_size: 32,
                scale_dtype: Dtype::Bf16
            }
        );
        assert_eq!(mat.data.as_slice(), &ts[1].3[e * wb..(e + 1) * wb]);
        assert_eq!(mat.scales.as_slice(), &ts[2].3[e * sb..(e + 1) * sb]);
        assert_eq!(mat.biases.as_slice(), &ts[3].3[e * sb..(e + 1) * sb]);
    }

    let fused = m
        .tensors
        .matrix_stack(
            "model.layers.0.mlp.experts.gate_up_proj",
            None,
            Some((2, 6, 8)),
        )
        .unwrap();
    assert_eq!(fused[1].data.as_slice(), &ts[4].3[6 * 8 * 4..]);
    // The stack's rows can be split further (gate and up halves).
    assert_eq!(
        fused[1].rows(3..6).data.as_slice(),
        &ts[4].3[6 * 8 * 4 + 3 * 8 * 4..]
    );
}

#[test]
fn sharded_index_reads_every_shard() {
    let d = Dir::new(base_config());
    d.st(
        "model-00001-of-00002.safetensors",
        &[
            dense("a.weight", StDtype::BF16, &[2, 4], 1),
            dense("extra", StDtype::F32, &[3], 4),
        ],
    );
    d.st(
        "model-00002-of-00002.safetensors",
        &[dense("b.weight", StDtype::F16, &[4, 4], 2)],
    );
    d.json(
        "model.safetensors.index.json",
        &json!({"metadata": {"total_size": 48}, "weight_map": {
            "a.weight": "model-00001-of-00002.safetensors",
            "b.weight": "model-00002-of-00002.safetensors",
        }}),
    );
    // A stray file next to an index is not read.
    d.st(
        "consolidated.safetensors",
        &[dense("a.weight", StDtype::BF16, &[2, 4], 1)],
    );
    let m = ModelDir::open(d.path()).unwrap();
    assert_eq!(
        m.tensors.len(),
        3,
        "tensors missing from the index are still included"
    );
    assert_eq!(m.tensors.files().len(), 2);
    assert_eq!(
        m.tensors.get("b.weight").unwrap().file,
        d.file("model-00002-of-00002.safetensors")
    );
    assert_eq!(m.tensors.matrix("b", None, Some((4, 4))).unwrap().rows, 4);
    assert_eq!(m.tensors.vector_f32("extra", Some(3)).unwrap().len(), 3);
}

#[test]
fn loose_safetensors_without_index_are_all_read() {
    let d = Dir::new(base_config());
    d.st(
        "model-00001-of-00002.safetensors",
        &[dense("a.weight", StDtype::BF16, &[2, 4], 1)],
    );
    d.st(
        "model-00002-of-00002.safetensors",
        &[dense("b.weight", StDtype::BF16, &[2, 4], 1)],
    );
    d.text(
        "._model-00001-of-00002.safetensors",
        "not a safetensors file",
    );
    let m = ModelDir::open(d.path()).unwrap();
    let names: Vec<&str> = m.tensors.names().collect();
    assert_eq!(names, ["a.weight", "b.weight"]);
}

#[derive(serde::Deserialize, Debug)]
struct TextCfg {
    hidden_size: usize,
    num_experts: usize,
    tie_word_embeddings: bool,
}

#[test]
fn text_config_nesting() {
    let d = Dir::new(json!({
        "model_type": "qwen3_vl_moe",
        "vision_config": {"hidden_size": 3},
        "text_config": {"model_type": "qwen3_vl_moe_text", "hidden_size": 8, "num_experts": 4},
        "tie_word_embeddings": true,
        "quantization": {"bits": 4, "group_size": 64},
        "vocab_size": 99,
        "eos_token_id": [5, 6],
    }));
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[2], 1)]);
    let m = ModelDir::open(d.path()).unwrap();
    assert_eq!(m.model_type().unwrap(), "qwen3_vl_moe_text");
    assert_eq!(m.text_config["hidden_size"], 8);
    assert!(
        m.text_config.get("vocab_size").is_none(),
        "other top-level keys are not merged"
    );
    assert!(m.text_config.get("vision_config").is_none());
    assert_eq!(m.text_config["tie_word_embeddings"], true);
    assert_eq!(m.quantization.as_ref().unwrap().bits, 4);
    let c: TextCfg = m.parse_config().unwrap();
    assert_eq!(
        (c.hidden_size, c.num_experts, c.tie_word_embeddings),
        (8, 4, true)
    );
    assert_eq!(m.config["vocab_size"], 99);
    // Without text_config, the top level is the text config.
    let d2 = Dir::new(
        json!({"model_type": "qwen3_moe", "hidden_size": 2, "num_experts": 1, "tie_word_embeddings": false}),
    );
    d2.st("model.safetensors", &[dense("x", StDtype::F32, &[2], 1)]);
    let m2 = ModelDir::open(d2.path()).unwrap();
    let c: TextCfg = m2.parse_config().unwrap();
    assert_eq!(c.hidden_size, 2);
    assert_eq!(m2.text_config, m2.config);
}

#[test]
fn model_type_falls_back_to_top_level() {
    let d = Dir::new(json!({"model_type": "top", "text_config": {"hidden_size": 1}}));
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[2], 1)]);
    assert_eq!(
        ModelDir::open(d.path()).unwrap().model_type().unwrap(),
        "top"
    );
}

#[test]
fn tokenizer_config_variants() {
    let d = Dir::new(base_config());
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[2], 1)]);
    // Missing: defaults.
    let m = ModelDir::open(d.path()).unwrap();
    assert_eq!(m.tokenizer_config, Default::default());

    // Plain strings.
    d.json(
        "tokenizer_config.json",
        &json!({"eos_token": "<|im_end|>", "bos_token": null, "pad_token": "<|endoftext|>",
                "add_bos_token": false, "chat_template": "{{ messages }}"}),
    );
    let tc = ModelDir::open(d.path()).unwrap().tokenizer_config;
    assert_eq!(tc.eos_token.as_deref(), Some("<|im_end|>"));
    assert_eq!(tc.bos_token, None);
    assert_eq!(tc.pad_token.as_deref(), Some("<|endoftext|>"));
    assert!(!tc.add_bos_token);
    assert_eq!(tc.chat_template.as_deref(), Some("{{ messages }}"));

    // AddedToken objects and a list of named templates.
    d.json(
        "tokenizer_config.json",
        &json!({
            "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": false},
            "bos_token": {"content": "<s>"},
            "add_bos_token": true,
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "DEFAULT"},
            ],
        }),
    );
    let tc = ModelDir::open(d.path()).unwrap().tokenizer_config;
    assert_eq!(tc.eos_token.as_deref(), Some("</s>"));
    assert_eq!(tc.bos_token.as_deref(), Some("<s>"));
    assert!(tc.add_bos_token);
    assert_eq!(tc.chat_template.as_deref(), Some("DEFAULT"));

    // chat_template.jinja wins.
    d.text("chat_template.jinja", "JINJA {{ x }}\n");
    let tc = ModelDir::open(d.path()).unwrap().tokenizer_config;
    assert_eq!(tc.chat_template.as_deref(), Some("JINJA {{ x }}\n"));
    assert_eq!(tc.eos_token.as_deref(), Some("</s>"));

    // chat_template.json is the last resort.
    std::fs::remove_file(d.file("chat_template.jinja")).unwrap();
    d.json("tokenizer_config.json", &json!({"eos_token": "e"}));
    d.json("chat_template.json", &json!({"chat_template": "FROM JSON"}));
    let tc = ModelDir::open(d.path()).unwrap().tokenizer_config;
    assert_eq!(tc.chat_template.as_deref(), Some("FROM JSON"));
}

#[test]
fn generation_config_int_or_list() {
    let d = Dir::new(base_config());
    d.st("model.safetensors", &[dense("x", StDtype::F32, &[2], 1)]);
    let g = ModelDir::open(d.path()).unwrap().generation;
    assert_eq!(g, Default::default());

    d.json(
        "generation_config.json",
        &json!({"eos_token_id": 7, "bos_token_id": 1, "temperature": 0.6, "top_p": 0.95,
                "top_k": 20, "min_p": 0, "repetition_penalty": 1.1, "do_sample": true}),
    );
    let g = ModelDir::open(d.path()).unwrap().generation;
    assert_eq!(g.eos_token_id, vec![7]);
    assert_eq!(g.bos_token_id, Some(1));
    assert_eq!(g.temperature, Some(0.6));
    assert_eq!(g.top_p, Some(0.95));
    assert_eq!(g.top_k, Some(20));
    assert_eq!(g.min_p, Some(0.0));
    assert_eq!(g.repetition_penalty, Some(1.1));

    d.json(
        "generation_config.json",
        &json!({"eos_token_id": [151645, 151643], "top_k": -1}),
    );
    let g = ModelDir::open(d.path()).unwrap().generation;
    assert_eq!(g.eos_token_id, vec![151645, 151643]);
    assert_eq!(g.top_k, None);
    assert_eq!(g.temperature, None);

    // Absent from generation_config.json: taken from config.json.
    let mut config = base_config();
    config["eos_token_id"] = json!(2);
    config["bos_token_id"] = json!(1);
    d.json("config.json", &config);
    d.json("generation_config.json", &json!({"temperature": 1.0}));
    let g = ModelDir::open(d.path()).unwrap().generation;
    assert_eq!((g.eos_token_id, g.bos_token_id), (vec![2], Some(1)));
}

#[test]
fn vectors_and_small_tensors_convert_to_f32() {
    let d = Dir::new(base_config());
    let v = [1.0f32, -2.5, 0.125, 3.0];
    let f64b: Vec<u8> = v.iter().flat_map(|x| (*x as f64).to_le_bytes()).collect();
    d.st(
        "model.safetensors",
        &[
            t("n.bf16", StDtype::BF16, &[4], bf16_bytes(&v)),
            t("n.f16", StDtype::F16, &[4], f16_bytes(&v)),
            t("n.f32", StDtype::F32, &[4], f32_bytes(&v)),
            t("n.f64", StDtype::F64, &[4], f64b),
            // 0x38 = 1.0, 0xc0 = -2.0 in E4M3; 0x3c = 1.0, 0xc0 = -2.0 in E5M2.
            t("n.e4m3", StDtype::F8_E4M3, &[3], vec![0x38, 0xc0, 0x01]),
            t("n.e5m2", StDtype::F8_E5M2, &[2], vec![0x3c, 0xc0]),
            t("conv", StDtype::BF16, &[2, 1, 2], bf16_bytes(&v)),
        ],
    );
    let m = ModelDir::open(d.path()).unwrap();
    for n in ["n.bf16", "n.f16", "n.f32", "n.f64"] {
        assert_eq!(m.tensors.vector_f32(n, Some(4)).unwrap(), v, "{n}");
    }
    assert_eq!(
        m.tensors.vector_f32("n.e4m3", None).unwrap(),
        [1.0, -2.0, 2f32.powi(-9)]
    );
    assert_eq!(m.tensors.vector_f32("n.e5m2", None).unwrap(), [1.0, -2.0]);
    let (c, shape) = m.tensors.to_f32("conv").unwrap();
    assert_eq!((c.as_slice(), shape.as_slice()), (&v[..], &[2, 1, 2][..]));
}

#[test]
fn writer_pads_header_and_keeps_metadata() {
    let d = Dir::empty();
    let data = pattern(6, 1);
    let md: BTreeMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    sluice_format::write_safetensors(
        &d.file("x.safetensors"),
        &[
            ("one".to_string(), StDtype::U8, vec![3], &data[..3]),
            ("two".to_string(), StDtype::I8, vec![1, 3], &data[3..]),
        ],
        Some(&md),
    )
    .unwrap();
    let raw = std::fs::read(d.file("x.safetensors")).unwrap();
    let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    assert_eq!(&raw[8 + n..], &data[..]);
    let header: serde_json::Value = serde_json::from_slice(&raw[8..8 + n]).unwrap();
    assert_eq!(header["__metadata__"]["format"], "pt");
    let ts = read_safetensors(&d.file("x.safetensors")).unwrap();
    assert_eq!(ts.len(), 2);
    let two = ts.iter().find(|t| t.name == "two").unwrap();
    assert_eq!(
        (two.dtype, two.shape.as_slice(), two.bytes.as_slice()),
        (StDtype::I8, &[1, 3][..], &data[3..])
    );

    // A scalar (shape []) has one element.
    sluice_format::write_safetensors(
        &d.file("s.safetensors"),
        &[(
            "s".to_string(),
            StDtype::F32,
            vec![],
            &1.5f32.to_le_bytes()[..],
        )],
        None,
    )
    .unwrap();
    let ts = read_safetensors(&d.file("s.safetensors")).unwrap();
    assert_eq!(ts[0].numel(), 1);
    assert_eq!(ts[0].to_f32().unwrap(), [1.5]);

    // Wrong byte counts and repeated names are refused.
    let e = sluice_format::write_safetensors(
        &d.file("bad.safetensors"),
        &[("x".to_string(), StDtype::F32, vec![2], &[0u8; 7][..])],
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("needs 8"), "{e}");
    let e = sluice_format::write_safetensors(
        &d.file("bad.safetensors"),
        &[
            ("x".to_string(), StDtype::U8, vec![1], &[0u8][..]),
            ("x".to_string(), StDtype::U8, vec![1], &[0u8][..]),
        ],
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("repeated"), "{e}");
}

#[test]
fn location_gives_the_file_offset_of_each_tensor() {
    let d = Dir::new(base_config());
    let tensors = vec![
        dense("a.weight", StDtype::BF16, &[3, 8], 1),
        dense("b.weight", StDtype::F32, &[5, 8], 2),
    ];
    d.st("model.safetensors", &tensors);
    let m = ModelDir::open(d.path()).unwrap();
    let file = std::fs::read(d.file("model.safetensors")).unwrap();
    for (name, _, _, bytes) in &tensors {
        let (path, offset, len) = m.tensors.location(name).unwrap();
        assert_eq!(path, d.file("model.safetensors"));
        assert_eq!(len, bytes.len() as u64);
        let at = offset as usize;
        assert_eq!(&file[at..at + len as usize], bytes.as_slice(), "{name}");
    }
    assert!(m.tensors.location("c.weight").is_err());
}
