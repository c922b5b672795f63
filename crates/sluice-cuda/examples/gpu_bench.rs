//! Quick figures for the CUDA backend on the GPU at hand: device-to-device copy bandwidth (the
//! limit), the decode matrix-vector product on 4-bit weights against it, and the demo model's
//! decode speed. `cargo run --release -p sluice-cuda --example gpu_bench`.

use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Instant;

use sluice_backend::conformance::{random_matrix, Rng};
use sluice_backend::{Backend, Dtype, WeightFormat};
use sluice_engine::sampler::SamplingParams;
use sluice_engine::{Engine, LoadOptions};

fn main() {
    let b = sluice_cuda::open(0).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(1)
    });
    println!("{}", b.describe());

    // Copy bandwidth: 1 GiB of activations, read and written.
    let (rows, cols) = (65536, 4096);
    let big = b.zeros(rows, cols);
    drop(b.slice_rows(&big, 0, rows));
    b.synchronize().unwrap();
    let reps = 10;
    let t = Instant::now();
    for _ in 0..reps {
        drop(b.slice_rows(&big, 0, rows));
    }
    b.synchronize().unwrap();
    let copy = 2.0 * (rows * cols * 4) as f64 * reps as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("device-to-device copy: {copy:.0} GB/s (read + write)");
    drop(big);

    let q4 = WeightFormat::Affine {
        bits: 4,
        group_size: 64,
        scale_dtype: Dtype::Bf16,
    };
    let mut rng = Rng::new(1);
    let shapes = [
        (16384, 2048, 1),
        (4096, 2048, 1),
        (2048, 6144, 1),
        (16384, 2048, 4),
        (16384, 2048, 64),
    ];
    let mats: Vec<_> = shapes
        .iter()
        .map(|&(out, inp, _)| random_matrix(&mut rng, q4, out, inp))
        .collect();
    {
        for (&(out, inp, tokens), m) in shapes.iter().zip(&mats) {
            let w = b.weight(m.clone()).unwrap();
            let x = b.act_from_host(&rng.vec(tokens * inp, -1.0, 1.0), tokens, inp);
            let want =
                sluice_backend::reference::matmul(&b.to_host(&x).unwrap(), tokens, &m.as_ref());
            let got = b.to_host(&b.matmul(&x, &w)).unwrap();
            sluice_backend::conformance::assert_close("matmul", &got, &want, 2e-5);
            b.synchronize().unwrap();
            let reps = 200;
            let t = Instant::now();
            for _ in 0..reps {
                drop(b.matmul(&x, &w));
            }
            b.synchronize().unwrap();
            let s = t.elapsed().as_secs_f64() / reps as f64;
            let gbps = m.nbytes() as f64 / s / 1e9;
            println!(
                "matmul q4 [{out},{inp}] x {tokens}: {:6.1} us {gbps:5.0} GB/s ({:3.0}% of copy)",
                s * 1e6,
                gbps / copy * 100.0
            );
        }
    }

    let repo = std::env::var("SLUICE_REPO").unwrap_or_else(|_| "../..".into());
    let engine = Engine::load(
        &std::path::Path::new(&repo).join("models/demo"),
        Arc::new(b),
        &LoadOptions::default(),
    )
    .unwrap();
    let prompt = engine.tokenizer.encode("Once upon a time", true).unwrap();
    let params = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    for _ in 0..2 {
        let stats = engine
            .generate(&prompt, &params, 128, |_| ControlFlow::Continue(()))
            .unwrap();
        println!(
            "demo model: prompt {} tokens, decode {} tokens at {:.1} tok/s",
            stats.prompt_tokens,
            stats.generated_tokens,
            stats.decode_tok_per_sec()
        );
    }
}
