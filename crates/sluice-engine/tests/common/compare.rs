//! Comparisons of two models' logits ([positions, vocab] row-major), shared by the fast-kernel
//! tests of the CPU (`fast_kernels.rs`) and the GPU (`sluice-cuda/tests/fast_prefill.rs`); they
//! include `reference.rs` beside it as `reference`.

use crate::reference::argmax;

/// max|got - want| / max|want|.
pub fn max_diff_over_max_ref(got: &[f32], want: &[f32]) -> f32 {
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got
        .iter()
        .zip(want)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    max_diff / max_ref
}

/// The bounds the fast kernels are held to against the exact ones (`what` names the case). The
/// fixtures have random weights and near-uniform routers: a small change flips an expert choice,
/// which changes that token's state at every later layer, so their bounds are loose (a wrong
/// layout or scale gives a KL of order 1 and chance agreement). The demo model is trained: its
/// bounds are what generation sees.
///
/// `gpt_oss-q4` draws its gate and up projections four times wider than the other fixtures (so
/// that the clamped SwiGLU's limit bites), which magnifies the activations' rounding: measured
/// on the CPU, mean KL 3.5e-2 decoding and 1.02e-1 for the prompt (argmax agreement 93.5% and
/// 74.2%); its KL bound is 0.2.
pub fn assert_fast_within_bounds(demo: bool, what: &str, kl: f64, agree: f64) {
    let (max_kl, min_agree) = match (demo, what.starts_with("gpt_oss-q4")) {
        (true, _) => (1e-2, 0.9),
        (false, true) => (0.2, 0.7),
        (false, false) => (0.1, 0.7),
    };
    assert!(kl < max_kl, "{what}: mean KL {kl:.2e} >= {max_kl}");
    assert!(
        agree >= min_agree,
        "{what}: argmax agrees at {:.1}% < {:.0}%",
        agree * 100.0,
        min_agree * 100.0
    );
}

pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = row
        .iter()
        .map(|&v| (v as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    row.iter().map(|&v| v as f64 - lse).collect()
}

/// Mean over positions of KL(exact || fast), and the share of positions whose argmax agrees.
pub fn kl_and_agreement(exact: &[f32], fast: &[f32], vocab: usize) -> (f64, f64) {
    let (mut kl, mut agree, mut n) = (0.0, 0, 0);
    for (e, f) in exact.chunks(vocab).zip(fast.chunks(vocab)) {
        let (le, lf) = (log_softmax(e), log_softmax(f));
        kl += le
            .iter()
            .zip(&lf)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
        agree += usize::from(argmax(e) == argmax(f));
        n += 1;
    }
    (kl / n as f64, agree as f64 / n as f64)
}

/// Mean negative log-likelihood of `tokens[1..]` from full-sequence logits.
pub fn mean_nll(logits: &[f32], tokens: &[u32], vocab: usize) -> f64 {
    let rows = logits.chunks(vocab).take(tokens.len() - 1);
    let total: f64 = rows
        .enumerate()
        .map(|(t, row)| -log_softmax(row)[tokens[t + 1] as usize])
        .sum();
    total / (tokens.len() - 1) as f64
}
