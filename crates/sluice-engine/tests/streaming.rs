//! Experts streamed from a packed directory give bit-identical logits to the same model with
//! all experts resident, whatever the cache size and policy; damaged packed files fail the
//! request with a clear error instead of crashing or answering wrongly.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_cpu::CpuBackend;
use sluice_engine::streaming::StreamingOptions;
use sluice_engine::{Engine, LoadOptions, LogitsMode};
use sluice_store::{pack, IoKind, PackOptions, Policy};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn packed(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    pack(
        &fixture(name),
        &tmp.path().join("m"),
        &PackOptions { force: false },
        &|_, _| {},
    )
    .unwrap_or_else(|e| panic!("packing {name}: {e}"));
    tmp
}

fn load(dir: &Path, streaming: StreamingOptions) -> Engine<CpuBackend> {
    let opts = LoadOptions {
        streaming,
        ..LoadOptions::default()
    };
    Engine::load(dir, Arc::new(CpuBackend::new()), &opts)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn stream_opts(cache: u64, policy: Policy, io: IoKind) -> StreamingOptions {
    StreamingOptions {
        expert_cache: Some(cache),
        policy,
        io,
        ..StreamingOptions::default()
    }
}

fn assert_bit_identical(got: &[f32], want: &[f32], what: &str) {
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "{what}: logits differ");
}

const TOKENS: [u32; 12] = [3, 141, 59, 26, 5, 358, 97, 93, 238, 46, 26, 43];

#[test]
fn streamed_logits_are_bit_identical_to_resident() {
    for name in [
        "qwen3_moe-q4",
        "qwen3_moe-hf",
        "qwen3_5_moe-q4",
        "qwen3_5_moe-bf16",
        "qwen3_next-bf16",
        "mixtral-q4",
        "mixtral-hf",
        "glm4_moe-q4",
        "glm4_moe-hf",
        "deepseek_v3-q4",
        "deepseek_v3-hf",
        "gpt_oss-q4",
        "gpt_oss-mxfp4",
        "gpt_oss-hf",
        "gpt_oss-transformers",
        "gpt_oss-transformers-dense",
    ] {
        let resident = load(&fixture(name), StreamingOptions::default());
        assert!(resident.store.is_none());
        let tmp = packed(name);
        let dir = tmp.path().join("m");
        for mode in [LogitsMode::Decode, LogitsMode::Prefill] {
            let want = resident.logits(&TOKENS, mode).unwrap();
            // 1 byte: the minimum of K slots, far less than one layer's experts (prefill then
            // fetches in several runs); u64::MAX: every expert fits.
            for (cache, policy, io) in [
                (1, Policy::Frequency, IoKind::Auto),
                (1, Policy::Lru, IoKind::Threads),
                (u64::MAX, Policy::Frequency, IoKind::Threads),
            ] {
                let streamed = load(&dir, stream_opts(cache, policy, io));
                let store = streamed.store.as_ref().expect("packed dirs stream");
                let got = streamed.logits(&TOKENS, mode).unwrap();
                assert_bit_identical(
                    &got,
                    &want,
                    &format!("{name} {mode:?} cache {cache} {policy:?}"),
                );
                let s = store.stats();
                assert!(s.requests > 0 && s.blocks_read > 0, "{name}: {s:?}");
                if cache == 1 {
                    let k = resident.model.info().experts_per_token;
                    assert_eq!(store.slots(), k, "{name}: minimum cache is K slots");
                }
            }
        }
    }
}

#[test]
fn a_corrupt_block_fails_the_request_not_the_process() {
    let tmp = packed("qwen3_moe-q4");
    let dir = tmp.path().join("m");
    // Flip one byte in every block, so whichever expert is routed first is damaged.
    let blocks = dir.join("experts.bin");
    let mut bytes = std::fs::read(&blocks).unwrap();
    let manifest = sluice_store::Manifest::open(&dir).unwrap().unwrap();
    for l in &manifest.layers {
        for e in 0..l.experts {
            bytes[(l.block_offset(e) + 17) as usize] ^= 0x40;
        }
    }
    std::fs::write(&blocks, &bytes).unwrap();
    let engine = load(&dir, stream_opts(1 << 20, Policy::Frequency, IoKind::Auto));
    let err = engine
        .logits(&TOKENS, LogitsMode::Decode)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("checksum mismatch")
            && err.contains("experts.bin")
            && err.contains("sluice pack"),
        "{err}"
    );
    // The engine keeps answering (with the same clear error), it is not poisoned.
    assert!(engine.logits(&TOKENS[..2], LogitsMode::Prefill).is_err());
    // With verification off the damage goes unnoticed: checksums are what catch it.
    let unverified = load(
        &dir,
        StreamingOptions {
            verify: sluice_store::Verify::Off,
            ..stream_opts(1 << 20, Policy::Frequency, IoKind::Auto)
        },
    );
    assert!(unverified.logits(&TOKENS, LogitsMode::Decode).is_ok());
}

#[test]
fn truncated_or_missing_blocks_files_are_load_errors() {
    let tmp = packed("qwen3_5_moe-q4");
    let dir = tmp.path().join("m");
    let blocks = dir.join("experts.bin");
    let len = std::fs::metadata(&blocks).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&blocks)
        .unwrap();
    f.set_len(len - 4096).unwrap();
    let opts = LoadOptions::default();
    let err = Engine::load(&dir, Arc::new(CpuBackend::new()), &opts)
        .err()
        .expect("truncated file must not load")
        .to_string();
    assert!(
        err.contains("experts.bin") && err.contains("truncated"),
        "{err}"
    );
    std::fs::remove_file(&blocks).unwrap();
    let err = Engine::load(&dir, Arc::new(CpuBackend::new()), &opts)
        .err()
        .expect("missing file must not load")
        .to_string();
    assert!(err.contains("experts.bin"), "{err}");
}

/// gpt-oss's released experts interleave gate and up rows, split apart in memory at load: they
/// cannot stream unpacked, and the error says to pack first (packed, they stream: above).
#[test]
fn interleaved_released_gpt_oss_experts_must_be_packed_to_stream() {
    let opts = LoadOptions {
        streaming: StreamingOptions {
            stream_unpacked: true,
            ..stream_opts(1, Policy::Frequency, IoKind::Auto)
        },
        ..LoadOptions::default()
    };
    let err = match Engine::load(&fixture("gpt_oss-hf"), Arc::new(CpuBackend::new()), &opts) {
        Ok(_) => panic!("gpt_oss-hf streamed unpacked"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("gate and up rows split") && err.contains("sluice pack"),
        "{err}"
    );
}

#[test]
fn unpacked_streaming_is_bit_identical_to_resident() {
    for name in [
        "qwen3_moe-q4",
        "qwen3_moe-hf",
        "qwen3_5_moe-q4",
        "qwen3_5_moe-bf16",
        "qwen3_next-bf16",
        "mixtral-q4",
        "mixtral-hf",
        "glm4_moe-q4",
        "glm4_moe-hf",
        "deepseek_v3-q4",
        "deepseek_v3-hf",
        "gpt_oss-q4",
        "gpt_oss-mxfp4",
    ] {
        let dir = fixture(name);
        let resident = load(&dir, StreamingOptions::default());
        assert!(
            resident.store.is_none(),
            "{name}: unpacked stays resident by default"
        );
        let info = resident.model.info().clone();
        for mode in [LogitsMode::Decode, LogitsMode::Prefill] {
            let want = resident.logits(&TOKENS, mode).unwrap();
            for (cache, policy, io) in [
                (1, Policy::Frequency, IoKind::Auto),
                (u64::MAX, Policy::Lru, IoKind::Threads),
            ] {
                let streamed = load(
                    &dir,
                    StreamingOptions {
                        stream_unpacked: true,
                        ..stream_opts(cache, policy, io)
                    },
                );
                let store = streamed.store.as_ref().expect("stream_unpacked streams");
                assert!(store.is_unpacked(), "{name}");
                assert_eq!(
                    streamed.model.info().expert_bytes,
                    info.expert_bytes,
                    "{name}: expert bytes reported as resident"
                );
                let got = streamed.logits(&TOKENS, mode).unwrap();
                assert_bit_identical(
                    &got,
                    &want,
                    &format!("{name} {mode:?} cache {cache} {policy:?}"),
                );
                let s = store.stats();
                assert!(
                    s.requests > 0 && s.blocks_read > 0 && s.bytes_read > 0 && s.errors == 0,
                    "{name}: {s:?}"
                );
                if cache == 1 {
                    assert_eq!(
                        store.slots(),
                        info.experts_per_token,
                        "{name}: minimum cache is K slots"
                    );
                }
            }
        }
    }
}
