//! The CPU's two attention paths (a task per row and head for a few rows, per row and kv head
//! for a prompt) give the same bits: a prompt attended at once equals its rows attended one by
//! one, so prefill and decode agree exactly.

use sluice_backend::{AttentionSpec, Backend, KvFormat};
use sluice_cpu::CpuBackend;

mod common;
use common::values;

#[test]
fn a_prompt_at_once_equals_its_rows_one_by_one() {
    let b = CpuBackend::new();
    for (heads, kv_heads, hd, rows) in [(32, 4, 128, 70), (16, 1, 64, 133), (8, 2, 72, 16)] {
        let (qw, kw) = (heads * hd, kv_heads * hd);
        let scale = 1.0 / (hd as f32).sqrt();
        let q = values(rows * qw, 1);
        let k = values(rows * kw, 2);
        let v = values(rows * kw, 3);
        let mut whole = b
            .kv_cache(kv_heads, hd, rows, KvFormat::F32)
            .expect("kv_cache");
        let at_once = b.attention(
            &b.act_from_host(&q, rows, qw),
            &b.act_from_host(&k, rows, kw),
            &b.act_from_host(&v, rows, kw),
            &mut whole,
            AttentionSpec::new(heads, scale),
        );
        let at_once = b.to_host(&at_once).expect("to_host");
        let mut steps = b
            .kv_cache(kv_heads, hd, rows, KvFormat::F32)
            .expect("kv_cache");
        for r in 0..rows {
            let one = b.attention(
                &b.act_from_host(&q[r * qw..(r + 1) * qw], 1, qw),
                &b.act_from_host(&k[r * kw..(r + 1) * kw], 1, kw),
                &b.act_from_host(&v[r * kw..(r + 1) * kw], 1, kw),
                &mut steps,
                AttentionSpec::new(heads, scale),
            );
            let one = b.to_host(&one).expect("to_host");
            assert_eq!(
                one,
                at_once[r * qw..(r + 1) * qw],
                "{heads}/{kv_heads} heads of {hd}, row {r} of {rows}"
            );
        }
    }
}
