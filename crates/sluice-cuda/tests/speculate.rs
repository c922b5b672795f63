//! Speculative decoding on CUDA device 0 gives the tokens of plain decoding on the same device:
//! prompt lookup, a draft model (its state on the device too) and the replayed answer (every
//! draft kept, at most `decode_rows` tokens per pass), on an attention-only model, a hybrid one
//! whose recurrent state is taken back after a miss, and the trained demo model.
//!
//! It needs an NVIDIA GPU: without one these tests are reported as ignored, not passed. On a GPU
//! machine: `cargo test -p sluice-cuda --test speculate -- --ignored`.

use std::sync::Arc;

use sluice_backend::Backend;
use sluice_engine::speculate::{Speculation, SpeculationStats};
use sluice_engine::{Engine, LoadOptions};

#[path = "../../sluice-engine/tests/common/speculate.rs"]
mod common;

use common::{fixture, generate, greedy, repetitive_prompt};

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn speculation_on_the_gpu_gives_the_tokens_of_plain_decoding() {
    let gpu = Arc::new(sluice_cuda::open(0).unwrap_or_else(|e| panic!("CUDA device 0: {e}")));
    let mut total = SpeculationStats::default();
    for (main, draft) in [
        ("qwen3_moe-q4", "qwen3-q4"),
        ("qwen3_5_moe-q4", "qwen3_5-q4"),
        ("../../models/demo", "../../models/demo"),
    ] {
        let mut engine = Engine::load(&fixture(main), gpu.clone(), &LoadOptions::default())
            .unwrap_or_else(|e| panic!("loading {main}: {e}"));
        engine
            .load_draft(&fixture(draft), &LoadOptions::default())
            .unwrap();
        let prompt = repetitive_prompt(&mut engine);
        let (plain, _) = generate(&mut engine, Speculation::Off, &prompt, &greedy(), 40);
        let decode_rows = engine.model.backend().decode_rows();
        for k in [1, 4, 12] {
            let replay = Speculation::Replay {
                answer: plain.clone().into(),
                after: prompt.len(),
                draft_tokens: k,
            };
            for spec in [
                Speculation::Lookup { draft_tokens: k },
                Speculation::Draft { draft_tokens: k },
                replay,
            ] {
                let (got, stats) = generate(&mut engine, spec.clone(), &prompt, &greedy(), 40);
                assert_eq!(
                    got, plain,
                    "{main}, {spec}: tokens differ from plain decoding"
                );
                assert!(
                    stats.produced <= stats.passes * decode_rows.min(k + 1),
                    "{main}, {spec}: {stats:?}"
                );
                if let Speculation::Replay { .. } = spec {
                    assert_eq!(stats.accepted, stats.drafted, "{main}, {spec}: {stats:?}");
                }
                eprintln!("{main}, {spec}: {stats:?}");
                total.add(&stats);
            }
        }
    }
    assert!(
        total.accepted > 0 && total.accepted < total.drafted,
        "{total:?}"
    );
}
