//! `sluice pack` on the fixtures: every expert's bytes land in its block unchanged, every other
//! tensor stays in the resident file unchanged, and the user's files are never put at risk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sluice_format::{write_safetensors, HostBytes, HostMatrix, ModelDir, StDtype, Tensors};
use sluice_store::{
    checksum, pack, Manifest, PackError, PackOptions, PackSummary, EXPERTS_FILE, MANIFEST_FILE,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn run(src: &Path, out: &Path, force: bool) -> Result<PackSummary, PackError> {
    pack(src, out, &PackOptions { force }, &|done, total| {
        assert!(done <= total, "{done} > {total}")
    })
}

/// A copy of a fixture's directory (tests that may delete things work on copies).
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn is_expert_tensor(name: &str) -> bool {
    // gpt-oss's per-expert biases stay resident.
    let bias = name.ends_with("_proj_bias") || name.ends_with("_proj.bias");
    !bias
        && [".mlp.", ".block_sparse_moe."].iter().any(|m| {
            name.contains(&format!("{m}switch_mlp.")) || name.contains(&format!("{m}experts."))
        })
}

/// The source's experts of the MoE block at `prefix`, in whichever layout it has.
fn source_experts(dir: &ModelDir, prefix: &str) -> Vec<[HostMatrix; 3]> {
    let t = &dir.tensors;
    let q = dir.quantization.as_ref();
    let stack = |n: &str| t.matrix_stack(&format!("{prefix}.{n}"), q, None).unwrap();
    if t.contains(&format!("{prefix}.switch_mlp.gate_proj.weight")) {
        let (g, u, d) = (
            stack("switch_mlp.gate_proj"),
            stack("switch_mlp.up_proj"),
            stack("switch_mlp.down_proj"),
        );
        return (0..g.len())
            .map(|e| [g[e].clone(), u[e].clone(), d[e].clone()])
            .collect();
    }
    // mlx's gpt-oss: stacks under `experts.`.
    if t.contains(&format!("{prefix}.experts.gate_proj.weight")) {
        let (g, u, d) = (
            stack("experts.gate_proj"),
            stack("experts.up_proj"),
            stack("experts.down_proj"),
        );
        return (0..g.len())
            .map(|e| [g[e].clone(), u[e].clone(), d[e].clone()])
            .collect();
    }
    // gpt-oss's released mxfp4 blocks: gate and up rows interleaved.
    if t.contains(&format!("{prefix}.experts.gate_up_proj_blocks")) {
        let (gu, d) = (stack("experts.gate_up_proj"), stack("experts.down_proj"));
        let rows = |first: usize| -> Vec<std::ops::Range<usize>> {
            (first..gu[0].rows).step_by(2).map(|r| r..r + 1).collect()
        };
        return (0..gu.len())
            .map(|e| {
                [
                    gu[e].gather_rows(&rows(0)),
                    gu[e].gather_rows(&rows(1)),
                    d[e].clone(),
                ]
            })
            .collect();
    }
    // gpt-oss as transformers keeps it: [E, hidden, 2 * inter], gate and up columns
    // interleaved; down [E, inter, hidden].
    if t.contains(&format!("{prefix}.experts.gate_up_proj_bias")) {
        let (gu, d) = (stack("experts.gate_up_proj"), stack("experts.down_proj"));
        return (0..gu.len())
            .map(|e| {
                let gu = gu[e].transposed().unwrap();
                let rows = |first: usize| -> Vec<std::ops::Range<usize>> {
                    (first..gu.rows).step_by(2).map(|r| r..r + 1).collect()
                };
                [
                    gu.gather_rows(&rows(0)),
                    gu.gather_rows(&rows(1)),
                    d[e].transposed().unwrap(),
                ]
            })
            .collect();
    }
    if t.contains(&format!("{prefix}.experts.gate_up_proj")) {
        let (gu, d) = (stack("experts.gate_up_proj"), stack("experts.down_proj"));
        let i = gu[0].rows / 2;
        return (0..gu.len())
            .map(|e| [gu[e].rows(0..i), gu[e].rows(i..2 * i), d[e].clone()])
            .collect();
    }
    // Per-expert modules: gate, up, down are Mixtral's w1, w3, w2.
    let names = match t.contains(&format!("{prefix}.experts.0.w1.weight")) {
        true => ["w1", "w3", "w2"],
        false => ["gate_proj", "up_proj", "down_proj"],
    };
    (0..)
        .take_while(|e| t.contains(&format!("{prefix}.experts.{e}.{}.weight", names[0])))
        .map(|e| {
            names.map(|p| {
                t.matrix(&format!("{prefix}.experts.{e}.{p}"), q, None)
                    .unwrap()
            })
        })
        .collect()
}

fn same(a: &HostMatrix, b: &HostMatrix, what: &str) {
    assert_eq!(
        (a.rows, a.cols, a.format),
        (b.rows, b.cols, b.format),
        "{what}"
    );
    assert!(a.data.as_slice() == b.data.as_slice(), "{what}: data");
    assert!(a.scales.as_slice() == b.scales.as_slice(), "{what}: scales");
    assert!(a.biases.as_slice() == b.biases.as_slice(), "{what}: biases");
}

/// Checks a packed directory against the checkpoint it came from (`experts_from` supplies the
/// expert matrices, `resident_from` the other tensors).
fn check_packed(out: &Path, experts_from: &Path, resident_from: &Path, s: &PackSummary) {
    let m = Manifest::open(out).unwrap().expect("experts.json");
    m.check_file_len(out).unwrap();
    let bin = std::fs::read(out.join(EXPERTS_FILE)).unwrap();
    assert_eq!(bin.len() as u64, m.file_len());
    assert_eq!(bin.len() as u64, s.expert_bytes);
    assert_eq!(m.layers.len(), s.layers);
    assert_eq!(m.layers.iter().map(|l| l.experts).sum::<usize>(), s.blocks);
    let src = ModelDir::open(experts_from).unwrap();
    for l in &m.layers {
        let want = source_experts(&src, &l.prefix);
        assert_eq!(want.len(), l.experts, "{}", l.prefix);
        for (e, w) in want.iter().enumerate() {
            let at = l.block_offset(e) as usize;
            let block = &bin[at..at + l.stride as usize];
            assert_eq!(checksum(block), l.checksums[e], "{} expert {e}", l.prefix);
            assert!(block[l.block_bytes as usize..].iter().all(|&b| b == 0));
            let got = l.matrices(&HostBytes::from_vec(block.to_vec()));
            for j in 0..3 {
                same(&got[j], &w[j], &format!("{} expert {e} proj {j}", l.prefix));
            }
        }
    }

    // Resident tensors: all the others, unchanged; no experts.
    let res_src = Tensors::open_dir(resident_from).unwrap();
    let res = Tensors::open_dir(out).unwrap();
    assert_eq!(res.files().len(), 1);
    assert_eq!(
        std::fs::metadata(&res.files()[0]).unwrap().len(),
        s.resident_bytes
    );
    assert!(res.names().all(|n| !is_expert_tensor(n)));
    let mut kept = 0;
    for x in res_src.iter().filter(|x| !is_expert_tensor(&x.name)) {
        let y = res.get(&x.name).unwrap();
        assert_eq!((x.dtype, &x.shape), (y.dtype, &y.shape), "{}", x.name);
        assert!(x.bytes.as_slice() == y.bytes.as_slice(), "{}", x.name);
        kept += 1;
    }
    assert_eq!(kept, res.len());

    // The other files, unchanged; the directory still opens as a model.
    for e in std::fs::read_dir(resident_from).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_str().unwrap().to_string();
        if name.ends_with(".safetensors") || name.ends_with(".index.json") {
            assert!(name == "model.safetensors" || !out.join(&name).exists());
            continue;
        }
        assert_eq!(
            std::fs::read(&p).unwrap(),
            std::fs::read(out.join(&name)).unwrap(),
            "{name}"
        );
    }
    ModelDir::open(out).unwrap();
    assert!(!with_partial(out).exists());
}

fn with_partial(out: &Path) -> PathBuf {
    let mut s = out.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// `__metadata__` of a safetensors file.
fn metadata(path: &Path) -> Option<serde_json::Value> {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    h.get("__metadata__").cloned()
}

#[test]
fn packs_every_fixture_layout_byte_identically() {
    for name in [
        "qwen3_moe-q4",
        "qwen3_moe-hf",
        "qwen3_moe-transformers",
        "qwen3_5_moe-q4",
        "qwen3_5_moe-bf16",
        "mixtral-q4",
        "mixtral-hf",
        "glm4_moe-hf",
        "deepseek_v3-q4",
        "deepseek_v3-hf",
        "gpt_oss-q4",
        "gpt_oss-mxfp4",
        "gpt_oss-hf",
        "gpt_oss-transformers",
        "gpt_oss-transformers-dense",
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("packed");
        let src = fixture(name);
        let s = run(&src, &out, false).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(s.layers > 0 && s.experts_per_layer > 0, "{name}");
        check_packed(&out, &src, &src, &s);
        let md = metadata(&out.join("model.safetensors"));
        let want = metadata(&Tensors::open_dir(&src).unwrap().files()[0]);
        assert_eq!(md, want, "{name}");
    }
}

#[test]
fn packs_the_fused_gate_up_layout() {
    // Rewrite the per-expert official fixture into transformers 5's fused layout.
    let hf = fixture("qwen3_moe-hf");
    let dir = ModelDir::open(&hf).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let fused = tmp.path().join("fused");
    std::fs::create_dir_all(&fused).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(hf.join(f), fused.join(f)).unwrap();
    }
    let mut owned: Vec<(String, StDtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut prefixes = BTreeMap::new();
    for x in dir.tensors.iter() {
        if let Some(i) = x.name.find(".mlp.experts.") {
            prefixes.insert(x.name[..i + 4].to_string(), x.dtype);
        } else {
            owned.push((
                x.name.clone(),
                x.dtype,
                x.shape.clone(),
                x.bytes.as_slice().to_vec(),
            ));
        }
    }
    for (prefix, dtype) in &prefixes {
        let ex = source_experts(&dir, prefix);
        let (mut gu, mut d) = (Vec::new(), Vec::new());
        for [g, u, dn] in &ex {
            gu.extend_from_slice(g.data.as_slice());
            gu.extend_from_slice(u.data.as_slice());
            d.extend_from_slice(dn.data.as_slice());
        }
        let [g, _, dn] = &ex[0];
        owned.push((
            format!("{prefix}.experts.gate_up_proj"),
            *dtype,
            vec![ex.len(), 2 * g.rows, g.cols],
            gu,
        ));
        owned.push((
            format!("{prefix}.experts.down_proj"),
            *dtype,
            vec![ex.len(), dn.rows, dn.cols],
            d,
        ));
    }
    let views: Vec<_> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), *d, s.clone(), b.as_slice()))
        .collect();
    write_safetensors(&fused.join("model.safetensors"), &views, None).unwrap();

    let out = tmp.path().join("packed");
    let s = run(&fused, &out, false).unwrap();
    assert_eq!(s.layers, prefixes.len());
    // The blocks hold exactly the per-expert source's matrices.
    check_packed(&out, &hf, &fused, &s);
}

#[test]
fn refuses_to_overwrite_or_touch_the_source() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("model");
    copy_dir(&fixture("qwen3_moe-q4"), &src);
    let out = tmp.path().join("packed");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("marker"), b"x").unwrap();

    let e = run(&src, &out, false).unwrap_err();
    assert!(matches!(e, PackError::Exists(_)), "{e}");
    assert!(e.to_string().contains("--force"), "{e}");
    assert!(out.join("marker").exists());

    let s = run(&src, &out, true).unwrap();
    assert!(!out.join("marker").exists());
    check_packed(&out, &src, &src, &s);

    // The source itself, an ancestor of it, or a `.partial` name that would be the source.
    for bad in [
        src.clone(),
        tmp.path().to_path_buf(),
        src.join(".."),
        tmp.path().join("model/../model"),
    ] {
        let e = run(&src, &bad, true).unwrap_err();
        assert!(matches!(e, PackError::SourceOverlap { .. }), "{e}");
    }
    let src2 = tmp.path().join("x.partial");
    copy_dir(&fixture("qwen3_moe-q4"), &src2);
    let e = run(&src2, &tmp.path().join("x"), true).unwrap_err();
    assert!(matches!(e, PackError::SourceOverlap { .. }), "{e}");
    // Nothing was removed from the sources.
    ModelDir::open(&src).unwrap();
    ModelDir::open(&src2).unwrap();

    // A packed directory is not packed again.
    let e = run(&out, &tmp.path().join("again"), false).unwrap_err();
    assert!(matches!(e, PackError::AlreadyPacked(_)), "{e}");
    assert!(e.to_string().contains("experts.json"), "{e}");
    assert!(!tmp.path().join("again").exists());
}

#[test]
fn replaces_a_stale_partial_and_reports_bad_sources() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("packed");
    let partial = with_partial(&out);
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::write(partial.join("junk"), b"old").unwrap();
    let s = run(&fixture("qwen3_5_moe-q4"), &out, false).unwrap();
    assert!(!out.join("junk").exists());
    check_packed(
        &out,
        &fixture("qwen3_5_moe-q4"),
        &fixture("qwen3_5_moe-q4"),
        &s,
    );

    // A truncated shard: an error naming the file, no panic, nothing written.
    let src = tmp.path().join("cut");
    copy_dir(&fixture("qwen3_moe-q4"), &src);
    let f = src.join("model.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let out2 = tmp.path().join("cut-packed");
    let e = run(&src, &out2, false).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("model.safetensors") && !msg.contains('\n'),
        "{msg}"
    );
    assert!(!out2.exists() && !with_partial(&out2).exists());

    // A dense model has nothing to pack.
    let dense = tmp.path().join("dense");
    std::fs::create_dir_all(&dense).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("qwen3_moe-q4").join(f), dense.join(f)).unwrap();
    }
    write_safetensors(
        &dense.join("model.safetensors"),
        &[(
            "model.embed_tokens.weight".into(),
            StDtype::F32,
            vec![2, 2],
            &[0u8; 16][..],
        )],
        None,
    )
    .unwrap();
    let e = run(&dense, &tmp.path().join("dense-packed"), false).unwrap_err();
    assert!(matches!(e, PackError::NoExperts(_)), "{e}");
    assert!(!tmp.path().join(MANIFEST_FILE).exists());
}
