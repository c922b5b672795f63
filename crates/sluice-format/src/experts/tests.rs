use std::collections::HashMap;
use std::path::Path;

use super::*;
use crate::{write_safetensors, StDtype};

const E: usize = 3;
const H: usize = 64;
const I: usize = 32;

/// A tensor to write: name, dtype, shape.
type Spec = (String, StDtype, Vec<usize>);

/// Writes `specs` to `dir/file`, every tensor's bytes distinct (a pattern varied by its index).
fn write(dir: &Path, file: &str, specs: &[Spec]) {
    let bytes: Vec<Vec<u8>> = specs
        .iter()
        .enumerate()
        .map(|(k, (_, dt, shape))| {
            let n = shape.iter().product::<usize>() * dt.size();
            // Not periodic, so a slice read at the wrong offset differs.
            (0..n)
                .map(|i| ((i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 56) as u8 ^ k as u8)
                .collect()
        })
        .collect();
    let tensors: Vec<(String, StDtype, Vec<usize>, &[u8])> = specs
        .iter()
        .zip(&bytes)
        .map(|((n, d, s), b)| (n.clone(), *d, s.clone(), b.as_slice()))
        .collect();
    write_safetensors(&dir.join(file), &tensors, None).unwrap();
}

fn dense(name: String, shape: &[usize]) -> Spec {
    (name, StDtype::BF16, shape.to_vec())
}

/// An MLX 4-bit, group-32 matrix (stack) at `prefix` of logical shape `[.., rows, cols]`.
fn q4(prefix: &str, lead: &[usize], rows: usize, cols: usize) -> Vec<Spec> {
    let shape = |last: usize| [lead, &[rows, last]].concat();
    vec![
        (
            format!("{prefix}.weight"),
            StDtype::U32,
            shape(cols * 4 / 32),
        ),
        (format!("{prefix}.scales"), StDtype::BF16, shape(cols / 32)),
        (format!("{prefix}.biases"), StDtype::BF16, shape(cols / 32)),
    ]
}

fn quant() -> QuantConfig {
    QuantConfig {
        bits: 4,
        group_size: 32,
        mode: "affine".into(),
        overrides: HashMap::new(),
        override_modes: HashMap::new(),
    }
}

/// Every slice the scan reports holds exactly the bytes of the matrix it describes.
fn check_slices(t: &Tensors, s: &ExpertScan) {
    let files: Vec<Vec<u8>> = t
        .files()
        .iter()
        .map(|f| std::fs::read(f).unwrap())
        .collect();
    let at = |x: FileSlice| &files[x.file][x.offset as usize..(x.offset + x.len) as usize];
    for l in &s.layers {
        for (e, x) in l.experts.iter().enumerate() {
            for (m, sl) in x.matrices.iter().zip(x.slices.as_ref().expect("in a file")) {
                let what = format!("{} expert {e}", l.prefix);
                assert_eq!(at(sl.data), m.data.as_slice(), "{what}: data");
                assert_eq!(sl.scales.map_or(&[][..], at), m.scales.as_slice(), "{what}");
                assert_eq!(sl.biases.map_or(&[][..], at), m.biases.as_slice(), "{what}");
            }
        }
    }
}

fn err(r: Result<ExpertScan, FormatError>) -> String {
    let e = r.expect_err("a layout error");
    assert!(matches!(e, FormatError::ExpertLayout { .. }), "{e}");
    e.to_string()
}

#[test]
fn mlx_stacks_quantised() {
    let dir = tempfile::tempdir().unwrap();
    let mut specs = vec![dense("model.norm.weight".into(), &[H])];
    for l in 0..2 {
        let p = format!("model.layers.{l}.mlp.switch_mlp");
        specs.extend(q4(&format!("{p}.gate_proj"), &[E], I, H));
        specs.extend(q4(&format!("{p}.up_proj"), &[E], I, H));
        specs.extend(q4(&format!("{p}.down_proj"), &[E], H, I));
    }
    write(dir.path(), "model.safetensors", &specs);
    let t = Tensors::open_dir(dir.path()).unwrap();
    let s = scan(&t, Some(&quant())).unwrap();
    assert_eq!(s.layers.len(), 2);
    assert_eq!(
        (s.layers[1].layer, s.layers[1].prefix.as_str()),
        (1, "model.layers.1.mlp")
    );
    assert_eq!(s.layers[0].experts.len(), E);
    let [g, _, d] = &s.layers[0].experts[2].matrices;
    assert_eq!((g.rows, g.cols, d.rows, d.cols), (I, H, H, I));
    assert!(s.layers[0].experts[0].slices.unwrap()[0].scales.is_some());
    // Every expert tensor, and nothing else, is listed.
    assert_eq!(s.tensors.len(), 2 * 9);
    assert!(!s.tensors.contains("model.norm.weight"));
    check_slices(&t, &s);

    let one = layer_experts(&t, Some(&quant()), "model.layers.1.mlp").unwrap();
    assert_eq!(one.len(), E);
    assert_eq!(
        one[1][2].data.as_slice(),
        s.layers[1].experts[1].matrices[2].data.as_slice()
    );
    let e = layer_experts(&t, Some(&quant()), "model.layers.7.mlp").unwrap_err();
    assert_eq!(
        e.to_string(),
        "tensor `model.layers.7.mlp.experts`: holds no experts"
    );
}

#[test]
fn fused_gate_up_with_and_without_weight_suffix() {
    for suffix in ["", ".weight"] {
        let dir = tempfile::tempdir().unwrap();
        let p = "model.layers.0.mlp.experts";
        let specs = vec![
            dense(format!("{p}.gate_up_proj{suffix}"), &[E, 2 * I, H]),
            dense(format!("{p}.down_proj"), &[E, H, I]),
        ];
        write(dir.path(), "model.safetensors", &specs);
        let t = Tensors::open_dir(dir.path()).unwrap();
        let s = scan(&t, None).unwrap();
        assert_eq!(s.layers.len(), 1, "{suffix:?}");
        let gu = t
            .matrix_stack(&format!("{p}.gate_up_proj"), None, None)
            .unwrap();
        for (e, x) in s.layers[0].experts.iter().enumerate() {
            let [g, u, d] = &x.matrices;
            assert_eq!((g.rows, u.rows, d.rows), (I, I, H));
            assert_eq!(g.data.as_slice(), gu[e].rows(0..I).data.as_slice());
            assert_eq!(u.data.as_slice(), gu[e].rows(I..2 * I).data.as_slice());
        }
        assert_eq!(s.tensors.len(), 2);
        check_slices(&t, &s);
        assert_eq!(
            layer_experts(&t, None, "model.layers.0.mlp").unwrap().len(),
            E
        );
    }
}

#[test]
fn fused_gate_up_quantised_splits_scales_too() {
    let dir = tempfile::tempdir().unwrap();
    let p = "model.layers.0.mlp.experts";
    // The bare fused name with `.scales`/`.biases` beside it.
    let mut specs = q4(&format!("{p}.gate_up_proj"), &[E], 2 * I, H);
    specs[0].0 = format!("{p}.gate_up_proj");
    specs.extend(q4(&format!("{p}.down_proj"), &[E], H, I));
    write(dir.path(), "model.safetensors", &specs);
    let t = Tensors::open_dir(dir.path()).unwrap();
    let s = scan(&t, Some(&quant())).unwrap();
    let x = &s.layers[0].experts[1];
    assert_eq!(x.matrices[1].scales.len(), I * (H / 32) * 2);
    check_slices(&t, &s);
}

#[test]
fn per_expert_modules_across_shards() {
    let dir = tempfile::tempdir().unwrap();
    let m = |e: usize, p: &str, shape: &[usize]| {
        dense(format!("model.layers.0.mlp.experts.{e}.{p}.weight"), shape)
    };
    let proj = |e: usize| {
        vec![
            m(e, "gate_proj", &[I, H]),
            m(e, "up_proj", &[I, H]),
            m(e, "down_proj", &[H, I]),
        ]
    };
    let mut a = vec![dense("model.embed_tokens.weight".into(), &[4, H])];
    a.extend(proj(0));
    a.extend(proj(1));
    write(dir.path(), "a.safetensors", &a);
    write(dir.path(), "b.safetensors", &proj(2));
    let t = Tensors::open_dir(dir.path()).unwrap();
    let s = scan(&t, None).unwrap();
    let l = &s.layers[0];
    assert_eq!(l.experts.len(), E);
    assert_eq!(l.experts[0].slices.unwrap()[0].data.file, 0);
    assert_eq!(l.experts[2].slices.unwrap()[2].data.file, 1);
    assert!(l.experts[0].slices.unwrap()[0].scales.is_none());
    check_slices(&t, &s);
}

#[test]
fn mixtral_per_expert_w1_w3_w2() {
    let dir = tempfile::tempdir().unwrap();
    let p = "model.layers.1.block_sparse_moe";
    let mut specs = vec![dense(format!("{p}.gate.weight"), &[E, H])];
    for e in 0..E {
        // Listed down first: the order comes from the names, not the file.
        specs.push(dense(format!("{p}.experts.{e}.w2.weight"), &[H, I]));
        specs.push(dense(format!("{p}.experts.{e}.w1.weight"), &[I, H]));
        specs.push(dense(format!("{p}.experts.{e}.w3.weight"), &[I, H]));
    }
    write(dir.path(), "m.safetensors", &specs);
    let t = Tensors::open_dir(dir.path()).unwrap();
    let s = scan(&t, None).unwrap();
    assert_eq!(s.layers.len(), 1);
    let l = &s.layers[0];
    assert_eq!((l.layer, l.prefix.as_str()), (1, p));
    assert_eq!(l.experts.len(), E);
    // gate (w1) and up (w3) are [I, H], down (w2) is [H, I].
    let shapes = l.experts[2].matrices.each_ref().map(|m| (m.rows, m.cols));
    assert_eq!(shapes, [(I, H), (I, H), (H, I)]);
    // w1 is gate, w3 is up: their bytes are those tensors' bytes.
    let w = |n: &str| t.matrix(&format!("{p}.experts.2.{n}"), None, None).unwrap();
    assert_eq!(
        l.experts[2].matrices[0].data.as_slice(),
        w("w1").data.as_slice()
    );
    assert_eq!(
        l.experts[2].matrices[1].data.as_slice(),
        w("w3").data.as_slice()
    );
    assert_eq!(
        l.experts[2].matrices[2].data.as_slice(),
        w("w2").data.as_slice()
    );
    assert!(!s.tensors.contains(&format!("{p}.gate.weight")));
    check_slices(&t, &s);
    let found = layer_experts(&t, None, p).unwrap();
    assert_eq!(found.len(), E);
}

#[test]
fn mixtral_mlx_stacks_under_block_sparse_moe() {
    let dir = tempfile::tempdir().unwrap();
    let p = "model.layers.0.block_sparse_moe.switch_mlp";
    let mut specs = q4(&format!("{p}.gate_proj"), &[E], I, H);
    specs.extend(q4(&format!("{p}.up_proj"), &[E], I, H));
    specs.extend(q4(&format!("{p}.down_proj"), &[E], H, I));
    write(dir.path(), "m.safetensors", &specs);
    let t = Tensors::open_dir(dir.path()).unwrap();
    let s = scan(&t, Some(&quant())).unwrap();
    assert_eq!(s.layers[0].prefix, "model.layers.0.block_sparse_moe");
    assert_eq!(s.layers[0].experts.len(), E);
    check_slices(&t, &s);
}

#[test]
fn only_the_main_decoder_stack_is_scanned() {
    let dir = tempfile::tempdir().unwrap();
    let mut specs = Vec::new();
    for p in [
        "model.layers.0.mlp",
        "model.layers.1.mlp",
        "mtp.layers.0.mlp",
    ] {
        specs.push(dense(
            format!("{p}.switch_mlp.gate_proj.weight"),
            &[E, I, H],
        ));
        specs.push(dense(format!("{p}.switch_mlp.up_proj.weight"), &[E, I, H]));
        specs.push(dense(
            format!("{p}.switch_mlp.down_proj.weight"),
            &[E, H, I],
        ));
    }
    write(dir.path(), "model.safetensors", &specs);
    let t = Tensors::open_dir(dir.path()).unwrap();
    let s = scan(&t, None).unwrap();
    let layers: Vec<_> = s.layers.iter().map(|l| l.prefix.as_str()).collect();
    assert_eq!(layers, ["model.layers.0.mlp", "model.layers.1.mlp"]);
    assert!(s.tensors.iter().all(|n| n.starts_with("model.")));
}

#[test]
fn no_experts_is_an_empty_scan() {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "model.safetensors",
        &[dense("model.layers.0.mlp.gate_proj.weight".into(), &[I, H])],
    );
    let t = Tensors::open_dir(dir.path()).unwrap();
    let s = scan(&t, None).unwrap();
    assert!(s.layers.is_empty() && s.tensors.is_empty());
}

#[test]
fn layout_errors_name_the_tensor() {
    let switch = |extra: Vec<Spec>, up_experts: usize| {
        let p = "model.layers.0.mlp.switch_mlp";
        let mut s = vec![
            dense(format!("{p}.gate_proj.weight"), &[E, I, H]),
            dense(format!("{p}.up_proj.weight"), &[up_experts, I, H]),
            dense(format!("{p}.down_proj.weight"), &[E, H, I]),
        ];
        s.extend(extra);
        s
    };
    let per_expert = |ids: &[usize], down_cols: usize| {
        ids.iter()
            .flat_map(|e| {
                let p = format!("model.layers.0.mlp.experts.{e}");
                [
                    dense(format!("{p}.gate_proj.weight"), &[I, H]),
                    dense(format!("{p}.up_proj.weight"), &[I, H]),
                    dense(format!("{p}.down_proj.weight"), &[H, down_cols]),
                ]
            })
            .collect::<Vec<_>>()
    };
    let odd = vec![
        dense(
            "model.layers.0.mlp.experts.gate_up_proj".into(),
            &[E, 2 * I + 1, H],
        ),
        dense("model.layers.0.mlp.experts.down_proj".into(), &[E, H, I]),
    ];
    let mut unknown = per_expert(&[0], I);
    unknown.push(dense(
        "model.layers.0.mlp.experts.w1.weight".into(),
        &[I, H],
    ));
    let mut uneven = per_expert(&[0], I);
    uneven.extend(per_expert(&[1], I + 8)[2..].iter().cloned());
    uneven.extend(per_expert(&[1], I)[..2].iter().cloned());
    let cases: Vec<(Vec<Spec>, &str, &str)> = vec![
        (
            switch(
                vec![dense(
                    "model.layers.0.mlp.switch_mlp.router.weight".into(),
                    &[E, H],
                )],
                E,
            ),
            "model.layers.0.mlp.switch_mlp.router.weight",
            "sluice pack cannot place it",
        ),
        (
            switch(vec![], E - 1),
            "model.layers.0.mlp.switch_mlp",
            "gate, up and down hold 3, 2 and 3 experts; they must match",
        ),
        (
            per_expert(&[0, 2], I),
            "model.layers.0.mlp.experts.1.gate_proj.weight",
            "is missing although experts up to 2 exist",
        ),
        (
            odd,
            "model.layers.0.mlp.experts.gate_up_proj",
            "expected an even number (gate then up)",
        ),
        (
            unknown,
            "model.layers.0.mlp.experts.w1.weight",
            "is not in a known expert layout",
        ),
        (
            uneven,
            "model.layers.0.mlp expert 1 down_proj",
            "every expert of a layer must have the same shape and format",
        ),
    ];
    for (specs, tensor, msg) in cases {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "model.safetensors", &specs);
        let t = Tensors::open_dir(dir.path()).unwrap();
        let e = err(scan(&t, None));
        assert!(
            e.starts_with(&format!("tensor `{tensor}`: ")) && e.contains(msg),
            "{e}"
        );
        // The per-layer entry point accepts and rejects the same.
        let e2 = layer_experts(&t, None, "model.layers.0.mlp").unwrap_err();
        assert_eq!(e2.to_string(), e);
    }
}

#[test]
fn expert_prefixes() {
    assert_eq!(
        expert_prefix("model.layers.12.mlp.switch_mlp.up_proj.scales"),
        Some(("model.layers.12.mlp".into(), "model".into(), 12))
    );
    assert_eq!(
        expert_prefix("language_model.model.layers.0.mlp.experts.3.down_proj.weight"),
        Some((
            "language_model.model.layers.0.mlp".into(),
            "language_model.model".into(),
            0
        ))
    );
    assert_eq!(
        expert_prefix("model.layers.0.mlp.experts.gate_up_proj"),
        Some(("model.layers.0.mlp".into(), "model".into(), 0))
    );
    assert_eq!(
        expert_prefix("model.layers.0.mlp.shared_expert.up_proj.weight"),
        None
    );
    assert_eq!(expert_prefix("model.layers.0.mlp.gate.weight"), None);
    assert_eq!(expert_prefix("model.layers.x.mlp.experts.0.w"), None);
    assert_eq!(
        expert_prefix("model.layers.7.block_sparse_moe.experts.0.w1.weight"),
        Some(("model.layers.7.block_sparse_moe".into(), "model".into(), 7))
    );
    assert_eq!(
        expert_prefix("model.layers.7.block_sparse_moe.gate.weight"),
        None
    );
    assert_eq!(expert_prefix("model.layers.7.self_attn.experts.0.w1"), None);
}
