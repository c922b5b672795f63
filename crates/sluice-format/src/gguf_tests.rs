use super::*;

/// A GGUF writer for the tests: metadata (key, type, encoded value) and tensors
/// (name, dims, type id, data), laid out as llama.cpp's writer does.
pub(crate) struct Writer {
    version: u32,
    pub(crate) kv: Vec<(String, u32, Vec<u8>)>,
    pub(crate) tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

pub(crate) fn s(v: &str) -> Vec<u8> {
    let mut b = (v.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(v.as_bytes());
    b
}

impl Writer {
    pub(crate) fn new() -> Self {
        Writer {
            version: 3,
            kv: vec![("general.architecture".into(), 8, s("qwen3moe"))],
            tensors: Vec::new(),
        }
    }

    pub(crate) fn kv(mut self, key: &str, ty: u32, value: Vec<u8>) -> Self {
        self.kv.push((key.into(), ty, value));
        self
    }

    pub(crate) fn tensor(mut self, name: &str, dims: &[u64], ty: u32, data: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    /// The bytes, with each tensor's offset taken from `offsets` when given.
    fn bytes_with(&self, offsets: Option<&[u64]>) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.kv.len() as u64).to_le_bytes());
        for (k, ty, v) in &self.kv {
            b.extend(s(k));
            b.extend(ty.to_le_bytes());
            b.extend(v);
        }
        let mut offset = 0u64;
        for (i, (name, dims, ty, data)) in self.tensors.iter().enumerate() {
            b.extend(s(name));
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            let o = offsets.map_or(offset, |o| o[i]);
            b.extend(o.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        for (_, _, _, data) in &self.tensors {
            b.extend(data);
            while !b.len().is_multiple_of(32) {
                b.push(0);
            }
        }
        b
    }

    pub(crate) fn bytes(&self) -> Vec<u8> {
        self.bytes_with(None)
    }
}

fn open_bytes(bytes: &[u8]) -> Result<GgufFile, GgufError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, bytes).unwrap();
    let f = GgufFile::open(&path);
    drop(dir);
    f
}

fn valid() -> Writer {
    let q4_0_block = [vec![0u8, 0x3c], vec![0x21; 16]].concat(); // d = 1.0, codes 1 and 2
    Writer::new()
        .kv("qwen3moe.block_count", 4, 48u32.to_le_bytes().to_vec())
        .kv("general.flag", 7, vec![1])
        .kv(
            "tokenizer.ggml.tokens",
            9,
            [
                8u32.to_le_bytes().to_vec(),
                2u64.to_le_bytes().to_vec(),
                s("a"),
                s("b"),
            ]
            .concat(),
        )
        .tensor(
            "output_norm.weight",
            &[4],
            0,
            1.5f32.to_le_bytes().repeat(4),
        )
        .tensor("blk.0.attn_q.weight", &[64, 2], 2, q4_0_block.repeat(4))
}

#[test]
fn reads_metadata_and_tensors() {
    let f = open_bytes(&valid().bytes()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.architecture(), Some("qwen3moe"));
    assert_eq!(
        f.metadata("qwen3moe.block_count")
            .and_then(GgufValue::as_u64),
        Some(48)
    );
    assert_eq!(f.metadata("general.flag"), Some(&GgufValue::Bool(true)));
    let tokens = f
        .metadata("tokenizer.ggml.tokens")
        .unwrap()
        .as_array()
        .unwrap();
    assert_eq!(tokens.len(), 2);
    assert_eq!(tokens[1].as_str(), Some("b"));
    let q = f.tensor("blk.0.attn_q.weight").unwrap();
    assert_eq!(q.dims, vec![64, 2]);
    assert_eq!(q.ggml_type.name(), "Q4_0");
    assert_eq!(q.bytes, 4 * 18);
    assert_eq!(&f.tensor_bytes(q)[..3], &[0, 0x3c, 0x21]);
    let n = f.tensor("output_norm.weight").unwrap();
    assert_eq!(f.tensor_bytes(n), &1.5f32.to_le_bytes().repeat(4)[..]);
    assert_eq!(n.offset % 32, 0);
}

fn error_of(bytes: &[u8]) -> String {
    open_bytes(bytes).unwrap_err().to_string()
}

#[test]
fn every_defect_is_a_one_line_error_naming_the_file() {
    let good = valid().bytes();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"GGML....".to_vec(), "not a GGUF file"),
        (good[..6].to_vec(), "truncated"),
        (
            {
                let mut w = valid();
                w.version = 1;
                w.bytes()
            },
            "version 1 is not supported",
        ),
        // Cut inside the tensor data: the last tensor runs past the end.
        (
            good[..good.len() - 40].to_vec(),
            "run past the end of the file",
        ),
        (valid().kv("x", 42, vec![]).bytes(), "unknown value type 42"),
        (
            valid().kv("general.flag", 7, vec![0]).bytes(),
            "appears twice",
        ),
        (valid().kv("b", 7, vec![2]).bytes(), "boolean byte 2"),
        (
            valid()
                .kv(
                    "huge",
                    9,
                    [4u32.to_le_bytes(), [0xff; 4]]
                        .concat()
                        .into_iter()
                        .chain(u64::MAX.to_le_bytes())
                        .collect(),
                )
                .bytes(),
            "longer than the file",
        ),
        (
            valid().kv("s", 8, u64::MAX.to_le_bytes().to_vec()).bytes(),
            "truncated",
        ),
        (
            valid().tensor("t", &[10], 2, vec![0; 18]).bytes(),
            "not whole Q4_0 blocks",
        ),
        (
            valid().tensor("t", &[32], 77, vec![0; 18]).bytes(),
            "unknown ggml type 77",
        ),
        (valid().tensor("t", &[], 0, vec![]).bytes(), "0 dimensions"),
        (
            valid().tensor("t", &[u64::MAX, 4], 0, vec![]).bytes(),
            "overflow",
        ),
        (
            valid()
                .tensor("output_norm.weight", &[4], 0, vec![0; 16])
                .bytes(),
            "appears twice",
        ),
        (
            valid()
                .kv("general.alignment", 4, 24u32.to_le_bytes().to_vec())
                .bytes(),
            "not a power of two",
        ),
        (valid().bytes_with(Some(&[0, 8])), "not aligned"),
        (valid().bytes_with(Some(&[0, 0])), "overlap"),
        (
            valid().bytes_with(Some(&[0, 1 << 40])),
            "run past the end of the file",
        ),
    ];
    for (bytes, want) in cases {
        let e = error_of(&bytes);
        assert!(e.contains(want), "wanted {want:?}, got {e:?}");
        assert!(e.contains("model.gguf: "), "{e}");
        assert!(!e.contains('\n'), "{e}");
    }
}

#[test]
fn every_truncation_of_a_valid_file_is_refused_without_panic() {
    let good = valid().bytes();
    for n in 0..good.len() - 32 {
        // Cutting only trailing padding can leave a valid file; anything before the last tensor's
        // data must fail.
        assert!(
            open_bytes(&good[..n]).is_err(),
            "a file cut at {n} bytes was accepted"
        );
    }
}

#[test]
fn ggml_type_table_matches_ggml() {
    let q4k = GgmlType::from_id(12).unwrap();
    assert_eq!(
        (q4k.name(), q4k.block_elements(), q4k.block_bytes()),
        ("Q4_K", 256, 144)
    );
    let mx = GgmlType::from_id(39).unwrap();
    assert_eq!(
        (mx.name(), mx.block_elements(), mx.block_bytes()),
        ("MXFP4", 32, 17)
    );
    assert!(GgmlType::from_id(4).is_none(), "Q4_2 was removed from ggml");
}

#[test]
fn long_values_display_short_without_splitting_a_character() {
    let v = GgufValue::String("é".repeat(100));
    let shown = v.to_string();
    assert!(shown.ends_with("(200 bytes)"), "{shown}");
    assert!(shown.chars().count() < 60, "{shown}");
    let a = GgufValue::Array((0..100).map(GgufValue::U32).collect());
    assert_eq!(a.to_string(), "[100 values]");
    assert_eq!(
        GgufValue::Array(vec![GgufValue::I32(-1), GgufValue::F32(0.5)]).to_string(),
        "[-1, 0.5]"
    );
}

#[test]
fn gguf_bytes_lays_out_as_the_test_writer() {
    let w = valid();
    let bytes = w.bytes();
    let f = open_bytes(&bytes).unwrap();
    let tensors: Vec<_> = f
        .tensors()
        .iter()
        .map(|t| (t.name.as_str(), &t.dims[..], t.ggml_type, f.tensor_bytes(t)))
        .collect();
    assert_eq!(gguf_bytes(f.metadata_entries(), &tensors), bytes);
}

/// The tensors of `valid()`'s file with three more, as (name, dims, type, data).
fn six_tensors() -> Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    let f32_t = GgmlType::from_id(0).unwrap();
    (0..6u8)
        .map(|i| {
            let n = 4 + i as u64;
            let data: Vec<u8> = (0..n)
                .flat_map(|j| (i as f32 + j as f32).to_le_bytes())
                .collect();
            (format!("blk.{i}.w"), vec![n], f32_t, data)
        })
        .collect()
}

/// Writes `tensors` as a split set (`split_gguf_bytes`), `per_part` tensors a part; the paths in
/// order.
fn write_split(
    dir: &Path,
    prefix: &str,
    kv: &[(String, GgufValue)],
    tensors: &[(String, Vec<u64>, GgmlType, Vec<u8>)],
    per_part: usize,
) -> Vec<PathBuf> {
    let t: Vec<_> = tensors
        .iter()
        .map(|(name, dims, ty, data)| (name.as_str(), &dims[..], *ty, &data[..]))
        .collect();
    let parts = split_gguf_bytes(kv, &t, per_part);
    let n = parts.len();
    parts
        .iter()
        .enumerate()
        .map(|(i, bytes)| {
            let path = dir.join(format!("{prefix}-{:05}-of-{n:05}.gguf", i + 1));
            std::fs::write(&path, bytes).unwrap();
            path
        })
        .collect()
}

fn arch_kv() -> Vec<(String, GgufValue)> {
    vec![
        (
            "general.architecture".into(),
            GgufValue::String("qwen3moe".into()),
        ),
        ("qwen3moe.block_count".into(), GgufValue::U32(6)),
    ]
}

#[test]
fn a_split_set_opens_from_any_part_as_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = six_tensors();
    let paths = write_split(dir.path(), "m", &arch_kv(), &tensors, 2);
    assert_eq!(paths.len(), 3);
    for opened in &paths {
        let f = GgufFile::open(opened).unwrap();
        assert_eq!(
            f.paths(),
            paths.iter().map(PathBuf::as_path).collect::<Vec<_>>()
        );
        assert_eq!(f.path(), paths[0]);
        assert_eq!(f.architecture(), Some("qwen3moe"));
        assert_eq!(
            f.metadata("qwen3moe.block_count")
                .and_then(GgufValue::as_u64),
            Some(6)
        );
        assert_eq!(f.tensors().len(), 6);
        for (i, (name, dims, ty, data)) in tensors.iter().enumerate() {
            let t = f.tensor(name).unwrap();
            assert_eq!((&t.dims, t.ggml_type, t.part), (dims, *ty, i / 2), "{name}");
            assert_eq!(f.tensor_bytes(t), &data[..], "{name}");
            assert_eq!(f.tensor_host_bytes(t).as_slice(), &data[..], "{name}");
        }
        let total: u64 = paths
            .iter()
            .map(|p| std::fs::metadata(p).unwrap().len())
            .sum();
        assert_eq!(f.file_bytes(), total);
    }
}

#[test]
fn broken_split_sets_are_refused_naming_the_part() {
    let tensors = six_tensors();
    let error = |setup: &dyn Fn(&[PathBuf])| -> String {
        let dir = tempfile::tempdir().unwrap();
        let paths = write_split(dir.path(), "m", &arch_kv(), &tensors, 2);
        setup(&paths);
        let e = GgufFile::open(&paths[0]).unwrap_err().to_string();
        assert!(!e.contains('\n'), "{e}");
        e
    };
    let e = error(&|p| std::fs::remove_file(&p[2]).unwrap());
    assert!(
        e.contains("part 3") && e.contains("m-00003-of-00003.gguf") && e.contains("missing"),
        "{e}"
    );
    // A part of another set of the same name: its split.no says so.
    let e = error(&|p| std::fs::copy(&p[1], &p[2]).map(|_| ()).unwrap());
    assert!(
        e.contains("m-00003-of-00003.gguf") && e.contains("split.no 1"),
        "{e}"
    );
    // A tensor in two parts.
    let e = error(&|p| {
        let mut t = six_tensors();
        t[4].0 = t[0].0.clone();
        let dir = p[0].parent().unwrap();
        write_split(dir, "m", &arch_kv(), &t, 2);
    });
    assert!(e.contains("blk.0.w") && e.contains("two parts"), "{e}");
    // A set short of a part's tensors (split.tensors.count counts them).
    let e = error(&|p| {
        let short = &six_tensors()[..5];
        let b = gguf_bytes(
            &[
                ("split.no".into(), GgufValue::U16(2)),
                ("split.count".into(), GgufValue::U16(3)),
            ],
            &short[4..]
                .iter()
                .map(|(n, d, t, x)| (n.as_str(), &d[..], *t, &x[..]))
                .collect::<Vec<_>>(),
        );
        std::fs::write(&p[2], b).unwrap();
    });
    assert!(
        e.contains("hold 5 tensors") && e.contains("split.tensors.count"),
        "{e}"
    );
    // Renamed parts cannot be found.
    let dir = tempfile::tempdir().unwrap();
    let paths = write_split(dir.path(), "m", &arch_kv(), &tensors, 2);
    let renamed = dir.path().join("first.gguf");
    std::fs::rename(&paths[0], &renamed).unwrap();
    let e = GgufFile::open(&renamed).unwrap_err().to_string();
    assert!(
        e.contains("-NNNNN-of-00003.gguf") && e.contains("--merge"),
        "{e}"
    );
}

#[test]
fn split_names_follow_llama_cpp() {
    let names = split_names(Path::new("/m/Qwen3-30B-Q4_K_M-00002-of-00003.gguf"), 3).unwrap();
    assert_eq!(
        names,
        (1..=3)
            .map(|i| PathBuf::from(format!("/m/Qwen3-30B-Q4_K_M-0000{i}-of-00003.gguf")))
            .collect::<Vec<_>>()
    );
    for bad in [
        "m.gguf",
        "m-00001-of-00004.gguf",
        "m-00004-of-00003.gguf",
        "m-00000-of-00003.gguf",
        "m-1-of-3.gguf",
        "m-00001-of-00003.bin",
    ] {
        assert!(split_names(Path::new(bad), 3).is_none(), "{bad}");
    }
}
