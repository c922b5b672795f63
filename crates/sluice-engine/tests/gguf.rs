//! A llama.cpp GGUF file as a model: it loads like a checkpoint directory (its logits against the
//! reference are in `reference_logits`), `sluice pack` turns it into a streaming directory that
//! gives the same logits bit for bit, its experts also stream from the file itself with the same
//! logits, and the settings its metadata carries (stop tokens, chat template, sampling) reach
//! the engine.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_backend::ExpertSource;
use sluice_cpu::CpuBackend;
use sluice_engine::streaming::StreamingOptions;
use sluice_engine::{Engine, LoadOptions, LogitsMode};
use sluice_store::{pack, PackOptions};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .join("model.gguf")
}

fn load(path: &Path, streaming: StreamingOptions) -> Result<Engine<CpuBackend>, String> {
    let opts = LoadOptions {
        streaming,
        ..LoadOptions::default()
    };
    Engine::load(path, Arc::new(CpuBackend::new()), &opts).map_err(|e| e.to_string())
}

/// Every GGUF fixture: each weight type and family sluice reads from a GGUF.
const GGUF_FIXTURES: [&str; 12] = [
    "qwen3_moe-gguf-q4_k_m",
    "qwen3_moe-gguf-q3_k_m",
    "qwen3_moe-gguf-q2_k",
    "qwen3_moe-gguf-legacy",
    "qwen3_moe-gguf-codebooks",
    "qwen3_moe-gguf-iq4",
    "qwen3_5_moe-gguf-q4_k_m",
    "qwen3_next-gguf-q4_k_m",
    "mixtral-gguf-q4_k_m",
    "gpt_oss-gguf-mxfp4",
    "glm4_moe-gguf-q4_k_m",
    "deepseek_v3-gguf-q4_k_m",
];

const TOKENS: [u32; 12] = [3, 141, 59, 26, 5, 358, 97, 93, 238, 46, 26, 43];

/// `sluice pack GGUF -o OUT`, then OUT loaded with a cache of one expert per layer's worth, so
/// that every token reads experts from the file.
fn pack_and_stream(gguf: &Path, out: &Path) -> Engine<CpuBackend> {
    pack(gguf, out, &PackOptions { force: false }, &|_, _| {})
        .unwrap_or_else(|e| panic!("packing {}: {e}", gguf.display()));
    load(
        out,
        StreamingOptions {
            expert_cache: Some(1 << 20),
            ..StreamingOptions::default()
        },
    )
    .unwrap()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn packed_gguf_streams_the_same_logits() {
    for name in GGUF_FIXTURES {
        let gguf = fixture(name);
        let resident = load(&gguf, StreamingOptions::default()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("packed");
        let streamed = pack_and_stream(&gguf, &out);
        for file in [
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "experts.bin",
        ] {
            assert!(out.join(file).is_file(), "{name}: pack wrote no {file}");
        }
        assert!(streamed.store.is_some(), "{name}: the packed copy streams");
        for mode in [LogitsMode::Prefill, LogitsMode::Decode] {
            let want = resident.logits(&TOKENS, mode).unwrap();
            let got = streamed.logits(&TOKENS, mode).unwrap();
            assert!(
                same_bits(&got, &want),
                "{name} {mode:?}: packed logits differ from the GGUF's"
            );
        }
        // The packed directory carries what the GGUF's metadata said.
        assert_eq!(streamed.eos_ids, resident.eos_ids, "{name}");
        assert_eq!(streamed.defaults, resident.defaults, "{name}");
        let t = "one two three <|im_start|>user\n";
        assert_eq!(
            streamed.tokenizer.encode(t, false).unwrap(),
            resident.tokenizer.encode(t, false).unwrap(),
            "{name}"
        );
    }
}

/// Options that stream a model's experts through a cache of about one expert per layer's
/// worth, so that every token reads experts from the file.
fn tiny_cache() -> StreamingOptions {
    StreamingOptions {
        expert_cache: Some(1 << 20),
        stream_unpacked: true,
        direct: true,
        ..StreamingOptions::default()
    }
}

#[test]
fn a_gguf_streams_its_experts_from_the_file_with_the_same_logits() {
    for name in GGUF_FIXTURES {
        let gguf = fixture(name);
        let resident = load(&gguf, StreamingOptions::default()).unwrap();
        assert!(resident.store.is_none(), "{name}: resident by default");
        let streamed = load(&gguf, tiny_cache()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            !streamed.dir.streamed_experts.is_empty(),
            "{name}: experts left in the file"
        );
        let store = streamed.store.as_ref().expect("streams");
        assert!(!store.can_hold_all(), "{name}: the cache must miss");
        let raw: u64 = streamed
            .dir
            .streamed_experts
            .iter()
            .map(|s| s.bytes_per_expert * s.offsets.len() as u64)
            .sum();
        for mode in [LogitsMode::Prefill, LogitsMode::Decode] {
            let want = resident.logits(&TOKENS, mode).unwrap();
            let got = streamed.logits(&TOKENS, mode).unwrap();
            assert!(
                same_bits(&got, &want),
                "{name} {mode:?}: streamed logits differ from the resident ones"
            );
        }
        // Experts are read as the file stores them: each block read costs its layer's bytes
        // per expert in the file, fewer than the converted form's.
        let s = store.stats();
        assert!(s.misses > 0 && s.blocks_read > 0, "{name}: {s:?}");
        let mut per_layer = std::collections::BTreeMap::<usize, u64>::new();
        for x in &streamed.dir.streamed_experts {
            *per_layer.entry(x.layer).or_default() += x.bytes_per_expert;
        }
        let (lo, hi) = (
            per_layer.values().min().unwrap(),
            per_layer.values().max().unwrap(),
        );
        // Aligned (O_DIRECT) reads take up to a 4 KiB page more at each end of a projection.
        let slop = 3 * 2 * 4096;
        assert!(
            (lo * s.blocks_read..=(hi + slop) * s.blocks_read).contains(&s.bytes_read),
            "{name}: {} bytes for {} blocks of {lo}..{hi}",
            s.bytes_read,
            s.blocks_read
        );
        // Whole pages of the file, read around each expert's blocks, O_DIRECT where the
        // filesystem allows it.
        assert!(
            store
                .io_description()
                .contains("ggml blocks converted as read"),
            "{name}: {}",
            store.io_description()
        );
        assert!(
            raw < store.manifest().total_block_bytes(),
            "{name}: {raw} bytes as stored, {} converted",
            store.manifest().total_block_bytes()
        );
    }
}

#[test]
fn a_fused_gguf_streams_too() {
    let name = "qwen3_moe-gguf-q4_k_m";
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("fused.gguf");
    assert!(fuse_gate_up(&fixture(name), &path) > 0);
    let resident = load(&fixture(name), StreamingOptions::default()).unwrap();
    let streamed = load(&path, tiny_cache()).unwrap();
    assert!(!streamed.dir.streamed_experts.is_empty());
    for mode in [LogitsMode::Prefill, LogitsMode::Decode] {
        let want = resident.logits(&TOKENS, mode).unwrap();
        let got = streamed.logits(&TOKENS, mode).unwrap();
        assert!(same_bits(&got, &want), "{mode:?}: fused and streamed");
    }
}

#[test]
fn a_damaged_expert_block_fails_the_request_naming_the_file() {
    // An expert whose Q4_K scale is NaN (f16 0x7e00): the conversion refuses it as it is read,
    // with the file and expert named, and the next request still works.
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.gguf");
    std::fs::copy(fixture("qwen3_moe-gguf-q4_k_m"), &path).unwrap();
    let probe = load(&path, tiny_cache()).unwrap();
    let stack = probe
        .dir
        .streamed_experts
        .iter()
        .find(|s| s.ggml_type.name() == "Q4_K" && s.layer == 0)
        .expect("a Q4_K expert stack in layer 0")
        .clone();
    drop(probe);
    let mut bytes = std::fs::read(&path).unwrap();
    for e in 0..stack.offsets.len() {
        // Byte 0..2 of a Q4_K block is its f16 `d`.
        let at = stack.offsets[e] as usize;
        bytes[at..at + 2].copy_from_slice(&[0x00, 0x7e]);
    }
    std::fs::write(&path, &bytes).unwrap();
    let e = load(&path, tiny_cache()).unwrap();
    let err = e
        .logits(&TOKENS, LogitsMode::Decode)
        .expect_err("a NaN scale must fail");
    let msg = err.to_string();
    assert!(
        msg.contains("model.gguf") && msg.contains("NaN") && msg.contains("expert"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "one line: {msg}");
}

#[test]
fn gguf_metadata_reaches_the_engine() {
    let e = load(
        &fixture("qwen3_moe-gguf-q4_k_m"),
        StreamingOptions::default(),
    )
    .unwrap();
    // tokenizer.ggml.eos_token_id (495) and the `<|endoftext|>`/`<|im_end|>` texts llama.cpp
    // also stops on, as far as the vocabulary has them.
    assert!(e.eos_ids.contains(&495), "{:?}", e.eos_ids);
    for text in ["<|im_end|>", "<|endoftext|>"] {
        if let Some(id) = e.tokenizer.token_id(text) {
            assert!(e.eos_ids.contains(&id), "{text} ({id}) in {:?}", e.eos_ids);
        }
    }
    // general.sampling.* as written by the converter from generation_config.json.
    assert_eq!(e.defaults.top_k, 20);
    assert!((e.defaults.top_p - 0.8).abs() < 1e-6);
    assert!((e.defaults.temperature - 0.7).abs() < 1e-6);
    // tokenizer.chat_template renders.
    let prompt = e
        .render_chat(
            &[sluice_engine::chat::ChatMessage::new("user", "hi")],
            None,
            &serde_json::Map::new(),
        )
        .unwrap();
    assert!(
        prompt.contains("<|im_start|>user\nhi<|im_end|>"),
        "{prompt}"
    );
    assert_eq!(e.model.info().layers, 2);
}

/// `gguf` written again as a split set of three files in `dir` (`split_gguf_bytes`, which writes
/// the bytes `llama-gguf-split --split-max-tensors` does: compared on four fixtures when it was
/// written); their paths in order.
fn split_in_three(gguf: &Path, dir: &Path) -> Vec<PathBuf> {
    use sluice_format::gguf::{split_gguf_bytes, GgufFile};
    let file = GgufFile::open(gguf).unwrap();
    let tensors: Vec<_> = file
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.as_str(),
                &t.dims[..],
                t.ggml_type,
                file.tensor_bytes(t),
            )
        })
        .collect();
    let parts = split_gguf_bytes(file.metadata_entries(), &tensors, tensors.len().div_ceil(3));
    assert_eq!(parts.len(), 3);
    parts
        .iter()
        .enumerate()
        .map(|(i, bytes)| {
            let path = dir.join(format!("model-{:05}-of-00003.gguf", i + 1));
            std::fs::write(&path, bytes).unwrap();
            path
        })
        .collect()
}

#[test]
fn a_split_set_runs_and_packs_like_its_single_file() {
    for name in ["qwen3_moe-gguf-q4_k_m", "qwen3_next-gguf-q4_k_m"] {
        let whole = load(&fixture(name), StreamingOptions::default()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let parts = split_in_three(&fixture(name), tmp.path());
        // Any part opens the set.
        let split =
            load(&parts[1], StreamingOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        for mode in [LogitsMode::Prefill, LogitsMode::Decode] {
            let want = whole.logits(&TOKENS, mode).unwrap();
            let got = split.logits(&TOKENS, mode).unwrap();
            assert!(
                same_bits(&got, &want),
                "{name} {mode:?}: the split set's logits differ"
            );
        }
        let streamed = pack_and_stream(&parts[0], &tmp.path().join("packed"));
        let want = whole.logits(&TOKENS, LogitsMode::Decode).unwrap();
        let got = streamed.logits(&TOKENS, LogitsMode::Decode).unwrap();
        assert!(
            same_bits(&got, &want),
            "{name}: the packed split set's logits differ"
        );
        // A missing part is a one-line error that names it.
        std::fs::remove_file(&parts[2]).unwrap();
        let e = load(&parts[0], StreamingOptions::default()).err().unwrap();
        assert!(
            e.contains("model-00003-of-00003.gguf") && e.contains("missing"),
            "{e}"
        );
        assert!(!e.contains('\n'), "{e}");
    }
}

/// `gguf` with each layer's `ffn_gate_exps` and `ffn_up_exps` fused into `ffn_gate_up_exps` as
/// `convert_hf_to_gguf.py --fuse-gate-up-exps` does (`torch.cat([gate, up], dim=1)` on
/// `[experts, rows, cols]`: per expert, the gate's rows then the up's), written to `out`.
fn fuse_gate_up(gguf: &Path, out: &Path) -> usize {
    use sluice_format::gguf::{gguf_bytes, GgufFile};
    let file = GgufFile::open(gguf).unwrap();
    let mut fused: Vec<(String, Vec<u64>, sluice_format::gguf::GgmlType, Vec<u8>)> = Vec::new();
    let mut count = 0;
    for t in file.tensors() {
        if t.name.ends_with(".ffn_up_exps.weight") {
            continue;
        }
        let Some(layer) = t.name.strip_suffix(".ffn_gate_exps.weight") else {
            fused.push((
                t.name.clone(),
                t.dims.clone(),
                t.ggml_type,
                file.tensor_bytes(t).to_vec(),
            ));
            continue;
        };
        let up = file.tensor(&format!("{layer}.ffn_up_exps.weight")).unwrap();
        assert_eq!((up.ggml_type, &up.dims), (t.ggml_type, &t.dims), "{layer}");
        let (gate, up) = (file.tensor_bytes(t), file.tensor_bytes(up));
        let per_expert = gate.len() / t.dims[2] as usize;
        let mut bytes = Vec::with_capacity(2 * gate.len());
        for e in 0..t.dims[2] as usize {
            bytes.extend_from_slice(&gate[e * per_expert..(e + 1) * per_expert]);
            bytes.extend_from_slice(&up[e * per_expert..(e + 1) * per_expert]);
        }
        let dims = vec![t.dims[0], 2 * t.dims[1], t.dims[2]];
        fused.push((
            format!("{layer}.ffn_gate_up_exps.weight"),
            dims,
            t.ggml_type,
            bytes,
        ));
        count += 1;
    }
    let tensors: Vec<_> = fused
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), &d[..], *t, &b[..]))
        .collect();
    std::fs::write(out, gguf_bytes(file.metadata_entries(), &tensors)).unwrap();
    count
}

#[test]
fn fused_gate_and_up_experts_run_like_separate_ones() {
    for name in ["qwen3_moe-gguf-q4_k_m", "qwen3_5_moe-gguf-q4_k_m"] {
        let whole = load(&fixture(name), StreamingOptions::default()).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("fused.gguf");
        assert!(
            fuse_gate_up(&fixture(name), &path) > 0,
            "{name}: nothing fused"
        );
        let fused =
            load(&path, StreamingOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        for mode in [LogitsMode::Prefill, LogitsMode::Decode] {
            let want = whole.logits(&TOKENS, mode).unwrap();
            let got = fused.logits(&TOKENS, mode).unwrap();
            assert!(
                same_bits(&got, &want),
                "{name} {mode:?}: fused experts' logits differ"
            );
        }
    }
}
