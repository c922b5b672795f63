//! Writes safetensors files (used by packing and synthesis tools, and by tests).

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use serde_json::{json, Map, Value};

use crate::safetensors::StDtype;

/// Builds the header (length prefix included, padded with spaces to a multiple of 8 bytes so
/// that the data section starts aligned) for `tensors` laid out in order.
pub fn safetensors_header(
    tensors: &[(String, StDtype, Vec<usize>, &[u8])],
    metadata: Option<&BTreeMap<String, String>>,
) -> io::Result<Vec<u8>> {
    for (name, dtype, shape, data) in tensors {
        let want = tensor_bytes(name, *dtype, shape)?;
        if data.len() != want {
            return Err(invalid(format!(
                "tensor `{name}`: {} bytes given, shape {shape:?} of {dtype} needs {want}",
                data.len()
            )));
        }
    }
    let entries: Vec<(String, StDtype, Vec<usize>)> = tensors
        .iter()
        .map(|(n, d, s, _)| (n.clone(), *d, s.clone()))
        .collect();
    safetensors_header_for(&entries, metadata)
}

/// The header for tensors of the given names, dtypes and shapes laid out in order, for writers
/// that stream the data after it.
pub fn safetensors_header_for(
    tensors: &[(String, StDtype, Vec<usize>)],
    metadata: Option<&BTreeMap<String, String>>,
) -> io::Result<Vec<u8>> {
    let mut header = Map::new();
    if let Some(md) = metadata {
        let md: Map<String, Value> = md
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
            .collect();
        header.insert("__metadata__".to_string(), Value::Object(md));
    }
    let mut seen = HashSet::new();
    let mut offset = 0usize;
    for (name, dtype, shape) in tensors {
        if name == "__metadata__" || !seen.insert(name.as_str()) {
            return Err(invalid(format!(
                "tensor name `{name}` repeated or reserved"
            )));
        }
        let len = tensor_bytes(name, *dtype, shape)?;
        header.insert(
            name.clone(),
            json!({
                "dtype": dtype.name(),
                "shape": shape,
                "data_offsets": [offset, offset + len],
            }),
        );
        offset += len;
    }
    let mut text = serde_json::to_vec(&Value::Object(header)).map_err(io::Error::other)?;
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + text.len());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    Ok(out)
}

fn invalid(m: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, m)
}

fn tensor_bytes(name: &str, dtype: StDtype, shape: &[usize]) -> io::Result<usize> {
    shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| invalid(format!("tensor `{name}`: shape {shape:?} overflows")))
}

/// Writes `tensors` (name, dtype, shape, little-endian bytes) to `path` in the given order.
/// The header is padded to a multiple of 8 bytes; `metadata` becomes `__metadata__`.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, StDtype, Vec<usize>, &[u8])],
    metadata: Option<&BTreeMap<String, String>>,
) -> io::Result<()> {
    let header = safetensors_header(tensors, metadata)?;
    let mut w = BufWriter::new(File::create(path)?);
    w.write_all(&header)?;
    for (_, _, _, data) in tensors {
        w.write_all(data)?;
    }
    w.flush()
}
