//! Comparisons of two models' logits ([positions, vocab] row-major), shared by the fast-kernel
//! tests of the CPU (`fast_kernels.rs`) and the GPU (`sluice-cuda/tests/fast_prefill.rs`).

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

pub fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b })
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
