//! The elementwise steps of a prompt-sized pass run on the team (many rows, values past one
//! task's chunk): their results do not depend on the thread count, and equal the reference.

use sluice_backend::{reference, Backend, DeltaNetDims, HostLinearState, ValueHeadOrder};
use sluice_cpu::CpuBackend;

mod common;
use common::values;

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool")
        .install(f)
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
            "{what}: value {i} is {g}, want {w}"
        );
    }
}

/// Every step once, its outputs on the host.
fn steps(rows: usize, cols: usize, norm: usize) -> Vec<(&'static str, Vec<f32>)> {
    let b = CpuBackend::new();
    let x = b.act_from_host(&values(rows * cols, 1), rows, cols);
    let y = b.act_from_host(&values(rows * cols, 2), rows, cols);
    let w = b.vector(&values(norm, 3)).expect("vector");
    let host = |a: &_| b.to_host(a).expect("to_host");
    let mut sum = x.clone();
    b.add_assign(&mut sum, &y);
    let mut gated = x.clone();
    b.sigmoid_mul(&mut gated, &y);
    let mut row_gated = x.clone();
    let g = b.act_from_host(&values(rows, 4), rows, 1);
    b.sigmoid_mul(&mut row_gated, &g);
    let (first, rest) = b.split_chunks(&x, norm, norm / 4);
    vec![
        ("add_assign", host(&sum)),
        ("sigmoid_mul", host(&gated)),
        ("sigmoid_mul by rows", host(&row_gated)),
        ("rms_norm", host(&b.rms_norm(&x, &w, 1e-6))),
        ("rms_norm_gated", host(&b.rms_norm_gated(&x, &y, &w, 1e-6))),
        ("split_chunks, first", host(&first)),
        ("split_chunks, rest", host(&rest)),
    ]
}

#[test]
fn prompt_steps_do_not_depend_on_threads_and_equal_the_reference() {
    // 37 rows of 3000: 111,000 values, past one task's chunk and not a multiple of it.
    let (rows, cols, norm) = (37, 3000, 120);
    let one = in_pool(1, || steps(rows, cols, norm));
    let four = in_pool(4, || steps(rows, cols, norm));
    assert_eq!(one, four, "one thread and four differ");

    let (x, y) = (values(rows * cols, 1), values(rows * cols, 2));
    let w = values(norm, 3);
    let want = |name: &str| -> Vec<f32> {
        match name {
            "add_assign" => x.iter().zip(&y).map(|(a, b)| a + b).collect(),
            "sigmoid_mul" => {
                let mut v = x.clone();
                reference::sigmoid_mul(&mut v, cols, &y, cols);
                v
            }
            "sigmoid_mul by rows" => {
                let mut v = x.clone();
                reference::sigmoid_mul(&mut v, cols, &values(rows, 4), 1);
                v
            }
            "rms_norm" => reference::rms_norm(&x, &w, 1e-6),
            "rms_norm_gated" => reference::rms_norm_gated(&x, &y, &w, 1e-6),
            "split_chunks, first" => reference::split_chunks(&x, norm, norm / 4).0,
            "split_chunks, rest" => reference::split_chunks(&x, norm, norm / 4).1,
            other => panic!("no reference for {other}"),
        }
    };
    for (name, got) in &four {
        assert_close(name, got, &want(name));
    }
}

#[test]
fn a_prompt_convolution_on_the_team_equals_the_reference_and_carries_the_window() {
    let dims = DeltaNetDims {
        key_heads: 2,
        value_heads: 4,
        key_dim: 64,
        value_dim: 64,
        conv_kernel: 4,
        value_order: ValueHeadOrder::Grouped,
    };
    let c = dims.conv_channels();
    let weight = values(c * dims.conv_kernel, 5);
    in_pool(4, || {
        let b = CpuBackend::new();
        let w = b.vector(&weight).expect("vector");
        let mut state = b.linear_state(&dims).expect("linear_state");
        let mut want_state = HostLinearState::new(&dims);
        // A prompt, then rows fewer than the window, then another prompt.
        for (step, rows) in [300usize, 2, 1, 257].into_iter().enumerate() {
            let x = values(rows * c, 10 + step as u32);
            let got = b.causal_conv1d_silu(&b.act_from_host(&x, rows, c), &w, &mut state);
            let want = reference::causal_conv1d_silu(&x, &weight, &mut want_state);
            assert_close(
                &format!("step {step} of {rows} rows"),
                &b.to_host(&got).expect("to_host"),
                &want,
            );
            let got_state = b.linear_state_to_host(&state).expect("to host");
            assert_eq!(got_state.conv, want_state.conv, "window after step {step}");
        }
    });
}
