//! Experts tiered over VRAM, host RAM and disk on CUDA device 0 give the same logits as the same
//! model with every expert resident on the GPU: bit-identical (the same kernels add each row's
//! experts in ascending id however they are split over calls, and read the same bytes in VRAM or
//! in host memory), whatever the VRAM cache's size, with the host cache page-locked: streamed
//! (a host cache smaller than the experts) or read in place (a host cache that holds them all).
//!
//! It needs an NVIDIA GPU: without one these tests are reported as ignored, not passed. On a GPU
//! machine: `cargo test -p sluice-cuda --test tiers -- --ignored`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sluice_backend::Backend;
use sluice_cuda::CudaBackend;
use sluice_engine::streaming::StreamingOptions;
use sluice_engine::{Engine, LoadOptions, LogitsMode};
use sluice_store::{pack, PackOptions};

fn fixture(name: &str) -> PathBuf {
    let repo = std::env::var_os("SLUICE_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."));
    repo.join("tests/fixtures").join(name)
}

fn gpu() -> Arc<CudaBackend> {
    Arc::new(sluice_cuda::open(0).unwrap_or_else(|e| panic!("CUDA device 0: {e}")))
}

fn load(dir: &Path, streaming: StreamingOptions) -> Engine<CudaBackend> {
    let opts = LoadOptions {
        streaming,
        ..LoadOptions::default()
    };
    Engine::load(dir, gpu(), &opts).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

fn assert_bit_identical(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        panic!(
            "{what}: logits differ first at {i}: {} vs {}",
            got[i], want[i]
        );
    }
}

const TOKENS: [u32; 12] = [3, 141, 59, 26, 5, 358, 97, 93, 238, 46, 26, 43];

/// Re-plans the engine's VRAM cache to hold about `slots` experts.
fn shrink_vram_cache(e: &Engine<CudaBackend>, slots: u64) -> usize {
    let b = e.model.backend();
    let plan = e
        .device_cache_plan
        .as_ref()
        .expect("a CUDA engine plans a VRAM cache");
    let mem = b.memory();
    let used = mem.total - mem.free;
    let budget =
        used + sluice_cuda::VRAM_RESERVE_BYTES + slots * plan.slot_bytes + plan.slot_bytes / 2;
    let manifest = e.store.as_ref().unwrap().manifest();
    let experts = manifest.layers.iter().map(|l| l.experts).sum();
    let plan = b
        .plan_expert_cache(Some(budget), manifest.max_stride(), experts)
        .unwrap()
        .unwrap();
    plan.slots
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn tiered_logits_are_bit_identical_to_resident() {
    for name in [
        "qwen3_moe-q4",
        "qwen3_moe-hf",
        "qwen3_5_moe-q4",
        "qwen3_next-bf16",
        "mixtral-hf",
        "glm4_moe-hf",
        "deepseek_v3-hf",
        "gpt_oss-hf",
    ] {
        let resident = load(&fixture(name), StreamingOptions::default());
        assert!(resident.store.is_none());
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        pack(
            &fixture(name),
            &dir,
            &PackOptions { force: false },
            &|_, _| {},
        )
        .unwrap_or_else(|e| panic!("packing {name}: {e}"));
        for mode in [LogitsMode::Decode, LogitsMode::Prefill] {
            let want = resident.logits(&TOKENS, mode).unwrap();
            // Host cache: every expert (then the kernels read the experts in place there, the
            // most used copied into VRAM slots every few passes), or K slots (streamed: prefill
            // then fetches a layer in several runs). VRAM cache: every expert (the default
            // here), or a few slots (evictions, and for streamed experts uploads for one call
            // when the slots are all in use).
            for (host_cache, vram_slots) in [
                (u64::MAX, None),
                (1, None),
                (u64::MAX, Some(3)),
                (1, Some(2)),
            ] {
                let in_place = host_cache == u64::MAX;
                let what =
                    format!("{name} {mode:?} host cache {host_cache} VRAM slots {vram_slots:?}");
                let e = load(
                    &dir,
                    StreamingOptions {
                        expert_cache: Some(host_cache),
                        ..StreamingOptions::default()
                    },
                );
                let store = e.store.as_ref().expect("packed dirs stream");
                assert_eq!(
                    store.pinned(),
                    Some(Ok(())),
                    "{what}: host cache page-locked"
                );
                if let Some(n) = vram_slots {
                    let got = shrink_vram_cache(&e, n);
                    assert!((1..=n as usize).contains(&got), "{what}: {got} slots");
                }
                // Streamed: the second pass finds what the first left in VRAM. In place: enough
                // passes for the slots to be filled (and, when few, reassigned) on the way.
                let passes = if in_place { 20 } else { 2 };
                for pass in 0..passes {
                    let got = e.logits(&TOKENS, mode).unwrap();
                    assert_bit_identical(&got, &want, &format!("{what} pass {pass}"));
                }
                let s = e.model.backend().expert_cache_stats().unwrap();
                assert!(s.bytes_uploaded > 0, "{what}: {s:?}");
                assert_eq!(
                    s.bytes_pinned, s.bytes_uploaded,
                    "{what}: every copy from locked memory"
                );
                if in_place {
                    // Counted on the device: what was read from host memory, what from slots.
                    assert!(s.placed > 0, "{what}: {s:?}");
                    assert_eq!(s.misses, 0, "{what}: nothing streamed: {s:?}");
                    if mode == LogitsMode::Prefill && vram_slots.is_none() {
                        // The prompt's experts in no slot are staged in VRAM (a few staging
                        // slots: several runs per layer), not read in place.
                        assert!(s.bypassed > 0 && s.read_in_place == 0, "{what}: {s:?}");
                    } else {
                        // Decoding, or too few slots to keep any for staging: read in place.
                        assert!(s.read_in_place > 0 && s.bypassed == 0, "{what}: {s:?}");
                    }
                    if vram_slots.is_none() {
                        assert!(s.hits > 0, "{what}: {s:?}");
                    }
                } else if vram_slots.is_none() {
                    assert!(s.hits > 0 && s.bypassed == 0, "{what}: {s:?}");
                } else {
                    assert!(s.evictions > 0 || s.bypassed > 0, "{what}: {s:?}");
                }
                eprintln!("{what}: {s:?}");
            }
        }
    }
}

/// Decoding with experts read in place and few VRAM slots, the CPU computing some of the
/// misses beside the GPU (a fixed share, all of them, and the balanced share) gives the resident
/// logits within the reference suite's tolerance (the CPU's sum is added to the GPU's, so not in
/// the same order: not bit-identical), argmax equal at every position.
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn experts_computed_by_the_cpu_beside_the_gpu_match_resident() {
    use sluice_cuda::HostCompute;
    for name in ["qwen3_moe-q4", "qwen3_5_moe-q4", "qwen3_next-bf16"] {
        let resident = load(&fixture(name), StreamingOptions::default());
        let want = resident.logits(&TOKENS, LogitsMode::Decode).unwrap();
        let vocab = want.len() / TOKENS.len();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("m");
        pack(
            &fixture(name),
            &dir,
            &PackOptions { force: false },
            &|_, _| {},
        )
        .unwrap_or_else(|e| panic!("packing {name}: {e}"));
        for mode in [
            HostCompute::Share(0.5),
            HostCompute::Share(1.0),
            HostCompute::Auto,
        ] {
            let what = format!("{name} {mode:?}");
            let backend = sluice_cuda::open(0)
                .unwrap_or_else(|e| panic!("CUDA device 0: {e}"))
                .with_host_compute(mode, sluice_cpu::Kernels::Exact);
            let opts = LoadOptions {
                streaming: StreamingOptions {
                    expert_cache: Some(u64::MAX),
                    ..StreamingOptions::default()
                },
                ..LoadOptions::default()
            };
            let e = Engine::load(&dir, Arc::new(backend), &opts)
                .unwrap_or_else(|err| panic!("{what}: {err}"));
            shrink_vram_cache(&e, 3);
            for pass in 0..4 {
                let got = e.logits(&TOKENS, LogitsMode::Decode).unwrap();
                let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let max_diff = got
                    .iter()
                    .zip(&want)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(
                    max_diff <= 1e-3 * max_ref,
                    "{what} pass {pass}: max|diff| {max_diff} against max|ref| {max_ref}"
                );
                for (row, (g, w)) in got.chunks(vocab).zip(want.chunks(vocab)).enumerate() {
                    let argmax =
                        |v: &[f32]| (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b });
                    assert_eq!(argmax(g), argmax(w), "{what} pass {pass}: argmax at {row}");
                }
            }
            let s = e.model.backend().expert_cache_stats().unwrap();
            assert!(
                s.host_computed > 0 && s.bytes_host_computed > 0,
                "{what}: {s:?}"
            );
            assert!(s.host_secs > 0.0, "{what}: {s:?}");
            let share = s.host_share.expect("the share in the stats");
            if let HostCompute::Share(want) = mode {
                assert_eq!(share, want, "{what}: a fixed share stays");
            }
            eprintln!("{what}: {s:?}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn a_vram_budget_below_the_resident_weights_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    pack(
        &fixture("qwen3_moe-q4"),
        &dir,
        &PackOptions { force: false },
        &|_, _| {},
    )
    .unwrap();
    let opts = LoadOptions {
        streaming: StreamingOptions {
            vram_budget: Some(1 << 20),
            ..StreamingOptions::default()
        },
        ..LoadOptions::default()
    };
    let err = match Engine::load(&dir, gpu(), &opts) {
        Ok(_) => panic!("a 1 MiB VRAM budget was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("--vram-budget") && err.contains("at least"),
        "{err}"
    );
    assert!(!err.contains('\n'), "one line: {err}");
}
