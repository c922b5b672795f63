//! `sluice pack --mtp-from`: an official checkpoint's multi-token-prediction layer added to a
//! packed mlx-layout 4-bit model. The mlx model is made here from `qwen3_5_moe-mtp`'s own main
//! weights (mlx-lm's conversion: `language_model.` names, `1 + w` norms, `[C, K, 1]` conv,
//! `switch_mlp` stacks, 4-bit g64 with the routers at 8 bits), so the grafted layer's logits can
//! be compared with the official bf16 layer's on the same rows.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use sluice_backend::Backend;
use sluice_cpu::CpuBackend;
use sluice_engine::speculate::Speculation;
use sluice_engine::{Engine, LoadOptions};
use sluice_format::safetensors_writer::write_safetensors;
use sluice_format::{StDtype, Tensors};
use sluice_store::{affine_quantize, pack_with_mtp, PackError, PackOptions};

#[path = "../../sluice-engine/tests/common/speculate.rs"]
mod speculate;

use speculate::{generate, greedy, repetitive_prompt};

use speculate::fixture;

fn bf16(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|&x| {
            let b = x.to_bits();
            let r = ((b >> 16) & 1) + 0x7fff;
            (((b + r) >> 16) as u16).to_le_bytes()
        })
        .collect()
}

type Out = Vec<(String, StDtype, Vec<usize>, Vec<u8>)>;

/// Adds `[lead.., rows, cols]` matrix `module`, 4-bit g64 (8-bit for the routers) as mlx-lm does
/// when the width allows, else bf16.
fn matrix(
    out: &mut Out,
    module: &str,
    w: &[f32],
    lead: &[usize],
    rows: usize,
    cols: usize,
    bits: u32,
) {
    let bits = if module.ends_with("mlp.gate") || module.ends_with("shared_expert_gate") {
        8
    } else {
        bits
    };
    let shape = |last| [lead, &[rows, last][..]].concat();
    if cols.is_multiple_of(64) {
        let q = affine_quantize(w, cols, bits, 64);
        out.push((
            format!("{module}.weight"),
            StDtype::U32,
            shape(cols * bits as usize / 32),
            q.weight,
        ));
        out.push((
            format!("{module}.scales"),
            StDtype::BF16,
            shape(cols / 64),
            bf16(&q.scales),
        ));
        out.push((
            format!("{module}.biases"),
            StDtype::BF16,
            shape(cols / 64),
            bf16(&q.biases),
        ));
    } else {
        out.push((
            format!("{module}.weight"),
            StDtype::BF16,
            shape(cols),
            bf16(w),
        ));
    }
}

/// `qwen3_5_moe-mtp`'s main model (no `mtp.*`) in mlx-community's layout at `bits` (routers 8),
/// written to `dir`.
fn make_mlx_src(dir: &Path, bits: u32) {
    let src = fixture("qwen3_5_moe-mtp");
    let t = Tensors::open_files(&src, vec![src.join("model.safetensors")]).unwrap();
    let mut out: Out = Vec::new();
    let mut experts: BTreeMap<String, BTreeMap<(String, usize), Vec<f32>>> = BTreeMap::new();
    let mut names: Vec<&str> = t.names().collect();
    names.sort();
    for name in names {
        let info = t.get(name).unwrap();
        let (v, shape) = t.to_f32(name).unwrap();
        let new = match name.strip_prefix("model.") {
            Some(rest) => format!("language_model.model.{rest}"),
            None => format!("language_model.{name}"),
        };
        if let Some((mlp, rest)) = new.split_once(".experts.") {
            let (e, proj) = rest.split_once('.').unwrap();
            let proj = proj.trim_end_matches(".weight").to_string();
            experts
                .entry(mlp.to_string())
                .or_default()
                .insert((proj, e.parse().unwrap()), v);
            continue;
        }
        let zero_centred = [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "model.norm.weight",
            "q_norm.weight",
            "k_norm.weight",
        ];
        if shape.len() == 1 && zero_centred.iter().any(|s| new.ends_with(s)) {
            let w: Vec<f32> = v.iter().map(|x| x + 1.0).collect();
            out.push((new, StDtype::BF16, shape, bf16(&w)));
        } else if new.ends_with("conv1d.weight") {
            out.push((
                new,
                info.dtype,
                vec![shape[0], shape[2], 1],
                info.bytes.as_slice().to_vec(),
            ));
        } else if shape.len() == 2 && !new.contains("embed_tokens") && !new.contains("lm_head") {
            // Embeddings and the output head stay bf16, so that the MTP comparison below sees
            // the grafted layer's quantisation only.
            let module = new.trim_end_matches(".weight").to_string();
            matrix(&mut out, &module, &v, &[], shape[0], shape[1], bits);
        } else {
            out.push((new, info.dtype, shape, info.bytes.as_slice().to_vec()));
        }
    }
    for (mlp, parts) in experts {
        let n = parts.keys().map(|(_, e)| e + 1).max().unwrap();
        for proj in ["gate_proj", "up_proj", "down_proj"] {
            let rows_cols = t
                .get(&format!(
                    "{}.experts.0.{proj}.weight",
                    mlp.replace("language_model.model.", "model.")
                ))
                .unwrap()
                .shape
                .clone();
            let stacked: Vec<f32> = (0..n)
                .flat_map(|e| parts[&(proj.to_string(), e)].clone())
                .collect();
            let module = format!("{mlp}.switch_mlp.{proj}");
            matrix(
                &mut out,
                &module,
                &stacked,
                &[n],
                rows_cols[0],
                rows_cols[1],
                bits,
            );
        }
    }
    std::fs::create_dir_all(dir).unwrap();
    let refs: Vec<_> = out
        .iter()
        .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), &b[..]))
        .collect();
    let md = BTreeMap::from([("format".to_string(), "mlx".to_string())]);
    write_safetensors(&dir.join("model.safetensors"), &refs, Some(&md)).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    let mut q = serde_json::json!({"group_size": 64, "bits": bits, "mode": "affine"});
    for i in 0..4 {
        for m in ["mlp.gate", "mlp.shared_expert_gate"] {
            q[format!("language_model.model.layers.{i}.{m}")] =
                serde_json::json!({"group_size": 64, "bits": 8});
        }
    }
    cfg["quantization"] = q.clone();
    cfg["quantization_config"] = q;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(&cfg).unwrap(),
    )
    .unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
}

fn packed_with_mtp(tmp: &Path, bits: u32) -> PathBuf {
    let src = tmp.join(format!("mlx-q{bits}"));
    make_mlx_src(&src, bits);
    let out = tmp.join(format!("packed-q{bits}"));
    let summary = pack_with_mtp(
        &src,
        &out,
        &PackOptions::default(),
        Some(&fixture("qwen3_5_moe-mtp")),
        &|_, _| {},
    )
    .unwrap();
    assert!(summary.mtp_tensors > 0);
    out
}

#[test]
fn grafted_mtp_loads_and_drafts_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = packed_with_mtp(tmp.path(), 4);

    // The layout: mlx stacks, quantised, and the routers' 8-bit entries in config.json.
    let t = Tensors::open_dir(&out).unwrap();
    let w = t
        .get("mtp.layers.0.mlp.switch_mlp.gate_proj.weight")
        .unwrap();
    assert_eq!((w.dtype, w.shape.clone()), (StDtype::U32, vec![8, 64, 16]));
    assert_eq!(
        t.get("mtp.layers.0.mlp.gate.weight").unwrap().shape,
        vec![8, 32]
    );
    assert!(!t.contains("mtp.layers.0.mlp.experts.0.gate_proj.weight"));
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    for key in ["quantization", "quantization_config"] {
        assert_eq!(
            cfg[key]["mtp.layers.0.mlp.gate"],
            serde_json::json!({"group_size": 64, "bits": 8}),
            "{key}"
        );
    }

    // Speculation with the grafted layer gives plain decoding's tokens.
    let backend = Arc::new(CpuBackend::new());
    let mut engine = Engine::load(&out, backend.clone(), &LoadOptions::default()).unwrap();
    assert!(engine.model.mtp().unwrap().is_some());
    let prompt = repetitive_prompt(&mut engine);
    let (plain, _) = generate(&mut engine, Speculation::Off, &prompt, &greedy(), 24);
    for k in [1, 3] {
        let spec = Speculation::Mtp { draft_tokens: k };
        let (drafted, stats) = generate(&mut engine, spec, &prompt, &greedy(), 24);
        assert_eq!(drafted, plain, "k = {k}");
        assert!(stats.drafted > 0, "k = {k}: {stats:?}");
        eprintln!("k = {k}: {stats:?}");
    }

    // The CLI's info line.
    let info = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["info", "--model"])
        .arg(&out)
        .output()
        .unwrap();
    // (Its exit status is not checked: on a model this small its read measurement refuses.)
    let text =
        String::from_utf8_lossy(&info.stdout).to_string() + &String::from_utf8_lossy(&info.stderr);
    assert!(text.contains("multi-token prediction"), "{text}");
}

/// The grafted layer's logits against the official bf16 layer's on the fixture's rows (the same
/// main weights; embeddings and head bf16 in both): at 8 bits within quantisation noise (a
/// conversion error, a norm left unshifted say, is far larger), at 4 bits within 4-bit noise
/// (these random weights give ~0.28 x max|logit| at 4 bits, 0.013 at 8).
#[test]
fn grafted_layer_tracks_the_official_one() {
    let tmp = tempfile::tempdir().unwrap();
    let backend = Arc::new(CpuBackend::new());
    let official = Engine::load(
        &fixture("qwen3_5_moe-mtp"),
        backend.clone(),
        &LoadOptions::default(),
    )
    .unwrap();
    for (bits, tolerance) in [(8, 0.03), (4, 0.4)] {
        let out = packed_with_mtp(tmp.path(), bits);
        let engine = Engine::load(&out, backend.clone(), &LoadOptions::default()).unwrap();
        // The grafted 4-bit layer against the official bf16 one on the fixture's rows (the same
        // main weights; embeddings and head bf16 in both).
        let meta: serde_json::Value = serde_json::from_slice(
            &std::fs::read(fixture("qwen3_5_moe-mtp").join("mtp.json")).unwrap(),
        )
        .unwrap();
        let tokens: Vec<u32> = meta["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let (hidden, shape) =
            sluice_engine::npy::read_f32(&fixture("qwen3_5_moe-mtp").join("main_hidden.npy"))
                .unwrap();
        let (n, h) = (shape[0], shape[1]);
        let rows = backend.act_from_host(&hidden[..(n - 1) * h], n - 1, h);
        let logits = |e: &Engine<CpuBackend>| {
            let mtp = e.model.mtp().unwrap().unwrap();
            let mut state = mtp.new_state().unwrap();
            let (l, _) = mtp.forward(&mut state, &rows, &tokens[1..n], true).unwrap();
            backend.to_host(&l).unwrap()
        };
        let (want, got) = (logits(&official), logits(&engine));
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let diff = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("grafted {bits}-bit MTP logits: max |diff| {diff:.3e} of max |ref| {scale:.3}");
        assert!(
            diff < tolerance * scale,
            "{bits} bits: max |diff| {diff} vs max |ref| {scale}"
        );
    }
}

/// The refusals: one line naming the file at fault and what to do, and no output written.
#[test]
fn mtp_from_refusals() {
    let tmp = tempfile::tempdir().unwrap();
    let mlx = tmp.path().join("mlx-q4");
    make_mlx_src(&mlx, 4);
    let try_pack = |src: &Path, official: &Path| -> String {
        let out = tmp.path().join("out");
        let err = pack_with_mtp(
            src,
            &out,
            &PackOptions::default(),
            Some(official),
            &|_, _| {},
        )
        .expect_err("refused");
        assert!(matches!(err, PackError::Mtp { .. }), "{err:?}");
        assert!(!out.exists() && !tmp.path().join("out.partial").exists());
        let msg = err.to_string();
        assert!(!msg.contains('\n'), "{msg}");
        msg
    };
    // No `mtp.fc.weight` in the official directory (an official checkpoint without the layer).
    let no_mtp = fixture("qwen3_5_moe-transformers");
    let msg = try_pack(&mlx, &no_mtp);
    assert!(
        msg.contains("qwen3_5_moe-transformers") && msg.contains("mtp.fc.weight"),
        "{msg}"
    );
    // A source that has the layer already.
    let msg = try_pack(&fixture("qwen3_5_moe-mtp"), &fixture("qwen3_5_moe-mtp"));
    assert!(
        msg.contains("already has a multi-token-prediction layer")
            && msg.contains("without --mtp-from"),
        "{msg}"
    );
    // Hidden sizes that differ.
    let other = tmp.path().join("official-256");
    std::fs::create_dir(&other).unwrap();
    let official = fixture("qwen3_5_moe-mtp");
    for f in [
        "model.safetensors",
        "mtp.safetensors",
        "model.safetensors.index.json",
    ] {
        std::fs::copy(official.join(f), other.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(official.join("config.json")).unwrap()).unwrap();
    cfg["hidden_size"] = 256.into();
    std::fs::write(other.join("config.json"), cfg.to_string()).unwrap();
    let msg = try_pack(&mlx, &other);
    assert!(
        msg.contains("config.json") && msg.contains("hidden_size 256") && msg.contains("128"),
        "{msg}"
    );
    // A GGUF source.
    let msg = try_pack(
        &fixture("qwen3_5_moe-gguf-q4_k_m/model.gguf"),
        &fixture("qwen3_5_moe-mtp"),
    );
    assert!(msg.contains("model.gguf") && msg.contains("GGUF"), "{msg}");

    // And through the CLI: a one-line error, exit status non-zero.
    let run = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("pack")
        .arg(&mlx)
        .arg("-o")
        .arg(tmp.path().join("cli-out"))
        .arg("--mtp-from")
        .arg(&no_mtp)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(err.contains("mtp.fc.weight"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
