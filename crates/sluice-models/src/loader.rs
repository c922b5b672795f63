//! Reading a checkpoint's weights by name: shapes checked against the config, bytes counted for
//! [`crate::ModelInfo`], handed to the backend.

use std::ops::Range;
use std::sync::Arc;

use sluice_backend::{Backend, ExpertSource, FfnWeights, HostBytes, HostExpert, HostMatrix};
use sluice_format::{ModelDir, QuantConfig};

use crate::{Experts, ModelError};

pub(crate) struct Loader<'a, B: Backend> {
    pub dir: &'a ModelDir,
    pub backend: &'a B,
    quant: Option<&'a QuantConfig>,
    /// Streams the routed experts when set.
    expert_source: Option<Arc<dyn ExpertSource>>,
    /// Running totals for [`ModelInfo`]: everything, the embedding table, the routed experts.
    bytes: usize,
    embed_bytes: usize,
    expert_bytes: usize,
}

impl<'a, B: Backend> Loader<'a, B> {
    pub fn new(
        dir: &'a ModelDir,
        backend: &'a B,
        expert_source: Option<Arc<dyn ExpertSource>>,
    ) -> Self {
        Loader {
            dir,
            backend,
            quant: dir.quantization.as_ref(),
            expert_source,
            bytes: 0,
            embed_bytes: 0,
            expert_bytes: 0,
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.dir.tensors.contains(name)
    }

    pub fn upload(&mut self, tensor: &str, m: HostMatrix) -> Result<B::Weight, ModelError> {
        self.bytes += m.nbytes();
        self.backend.weight(m).map_err(|source| ModelError::Weight {
            tensor: tensor.to_string(),
            source,
        })
    }

    /// The matrix of module `prefix` in host memory, `[out, in]`, before any upload.
    pub fn host_matrix(
        &self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<HostMatrix, ModelError> {
        Ok(self
            .dir
            .tensors
            .matrix(prefix, self.quant, Some((out, inp)))?)
    }

    /// The matrix of module `prefix`, `[out, in]`.
    pub fn matrix(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<B::Weight, ModelError> {
        let m = self.host_matrix(prefix, out, inp)?;
        self.upload(prefix, m)
    }

    /// The rows `ranges` of module `prefix` (`[out, in]`), in that order, as a matrix of their
    /// own: a fused projection de-interleaved once at load.
    pub fn matrix_rows(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
        ranges: &[Range<usize>],
    ) -> Result<B::Weight, ModelError> {
        let m = self.host_matrix(prefix, out, inp)?.gather_rows(ranges);
        self.upload(prefix, m)
    }

    /// A stacked 3-D tensor `[n, out, in]` of module `prefix` as one matrix `[n * out, in]` (mlx's
    /// per-head `MultiLinear` projections).
    pub fn stacked_matrix(
        &mut self,
        prefix: &str,
        n: usize,
        out: usize,
        inp: usize,
    ) -> Result<B::Weight, ModelError> {
        let parts = self
            .dir
            .tensors
            .matrix_stack(prefix, self.quant, Some((n, out, inp)))?;
        let join = |f: fn(&HostMatrix) -> &HostBytes| {
            HostBytes::from_vec(
                parts
                    .iter()
                    .flat_map(|m| f(m).as_slice())
                    .copied()
                    .collect(),
            )
        };
        let m = HostMatrix::new(
            parts[0].format,
            n * out,
            inp,
            join(|m| &m.data),
            join(|m| &m.scales),
            join(|m| &m.biases),
        )
        .map_err(|e| ModelError::Unsupported(format!("tensor `{prefix}`: {e}")))?;
        self.upload(prefix, m)
    }

    /// The token embedding table (counted apart: a token reads one row of it).
    pub fn embeddings(
        &mut self,
        prefix: &str,
        vocab: usize,
        hidden: usize,
    ) -> Result<B::Weight, ModelError> {
        let before = self.bytes;
        let w = self.matrix(prefix, vocab, hidden)?;
        self.embed_bytes += self.bytes - before;
        Ok(w)
    }

    pub fn vector(&mut self, name: &str, len: usize) -> Result<B::Vector, ModelError> {
        self.vector_plus(name, len, 0.0)
    }

    /// A 1-D tensor with `offset` added to every element (zero-centred norms store `w - 1`).
    pub fn vector_plus(
        &mut self,
        name: &str,
        len: usize,
        offset: f32,
    ) -> Result<B::Vector, ModelError> {
        let mut v = self.dir.tensors.vector_f32(name, Some(len))?;
        if offset != 0.0 {
            v.iter_mut().for_each(|w| *w += offset);
        }
        self.upload_vector(name, v)
    }

    /// A tensor of exactly `len` values whatever its shape (e.g. conv taps stored
    /// `[channels, kernel, 1]` or `[channels, 1, kernel]`), flattened.
    pub fn flat(&mut self, name: &str, len: usize) -> Result<B::Vector, ModelError> {
        let (v, shape) = self.dir.tensors.to_f32(name)?;
        if v.len() != len {
            return Err(ModelError::Unsupported(format!(
                "tensor `{name}` has shape {shape:?}, expected {len} values"
            )));
        }
        self.upload_vector(name, v)
    }

    fn upload_vector(&mut self, name: &str, v: Vec<f32>) -> Result<B::Vector, ModelError> {
        self.bytes += v.len() * 4;
        self.backend
            .vector(&v)
            .map_err(|source| ModelError::Weight {
                tensor: name.to_string(),
                source,
            })
    }

    /// gpt-oss's per-expert biases of the MoE block at `prefix`, each `[experts * width]`: the
    /// released layout's `experts.gate_up_proj_bias` (`[experts, 2 * inter]`, gate and up
    /// interleaved) and `experts.down_proj_bias`, or mlx's `experts.{gate,up,down}_proj.bias`.
    pub fn expert_biases(
        &mut self,
        prefix: &str,
        experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<FfnWeights<B::Vector>, ModelError> {
        let under = format!("{prefix}.experts");
        let read = |name: &str, len: usize| -> Result<Vec<f32>, ModelError> {
            let (v, shape) = self.dir.tensors.to_f32(name)?;
            if v.len() != len {
                return Err(ModelError::Unsupported(format!(
                    "tensor `{name}` has shape {shape:?}, expected {len} values"
                )));
            }
            Ok(v)
        };
        let fused = format!("{under}.gate_up_proj_bias");
        let (gate, up, down_name) = if self.has(&fused) {
            let gu = read(&fused, experts * 2 * inter)?;
            let half = |first: usize| gu.iter().skip(first).step_by(2).copied().collect();
            (half(0), half(1), format!("{under}.down_proj_bias"))
        } else {
            (
                read(&format!("{under}.gate_proj.bias"), experts * inter)?,
                read(&format!("{under}.up_proj.bias"), experts * inter)?,
                format!("{under}.down_proj.bias"),
            )
        };
        let down = read(&down_name, experts * hidden)?;
        Ok(FfnWeights {
            gate: self.upload_vector(&format!("{under} gate biases"), gate)?,
            up: self.upload_vector(&format!("{under} up biases"), up)?,
            down: self.upload_vector(&down_name, down)?,
        })
    }

    /// A dense SwiGLU block `{prefix}.{gate,up,down}_proj`.
    pub fn ffn(
        &mut self,
        prefix: &str,
        hidden: usize,
        inter: usize,
    ) -> Result<FfnWeights<B::Weight>, ModelError> {
        Ok(FfnWeights {
            gate: self.matrix(&format!("{prefix}.gate_proj"), inter, hidden)?,
            up: self.matrix(&format!("{prefix}.up_proj"), inter, hidden)?,
            down: self.matrix(&format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }

    /// The routed experts of decoder layer `layer` under `mlp` (e.g. `model.layers.0.mlp`),
    /// `[hidden -> inter -> hidden]` each: from the expert source when there is one, else from
    /// the checkpoint.
    pub fn experts(
        &mut self,
        layer: usize,
        mlp: &str,
        experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Experts<B>, ModelError> {
        let Some(source) = self.expert_source.clone() else {
            let host = self.resident_experts(mlp, experts, hidden, inter)?;
            let bytes: usize = host
                .iter()
                .map(|e| e.gate.nbytes() + e.up.nbytes() + e.down.nbytes())
                .sum();
            self.bytes += bytes;
            self.expert_bytes += bytes;
            let resident = self
                .backend
                .experts(host)
                .map_err(|source| ModelError::Weight {
                    tensor: format!("{mlp} experts"),
                    source,
                })?;
            return Ok(Experts::Resident(resident));
        };
        let bad = |msg: String| ModelError::Config {
            file: source.name(),
            msg,
        };
        let l = source
            .layer(layer)
            .ok_or_else(|| bad(format!("no experts for layer {layer} (`{mlp}`)")))?;
        let got = [l.gate, l.up, l.down].map(|m| (m.rows, m.cols));
        let want = [(inter, hidden), (inter, hidden), (hidden, inter)];
        if l.experts != experts || got != want {
            return Err(bad(format!(
                "layer {layer}: {} experts of shapes {got:?}, the config needs {experts} of {want:?}",
                l.experts
            )));
        }
        let bytes = (l.bytes_per_expert * l.experts as u64) as usize;
        self.bytes += bytes;
        self.expert_bytes += bytes;
        // Every expert held in the source's memory and computed from there (a GPU reading it in
        // place): no routing read per call.
        let in_host = self
            .backend
            .experts_in_host(&source, layer)
            .map_err(|source| ModelError::Weight {
                tensor: format!("{mlp} experts"),
                source,
            })?;
        Ok(match in_host {
            Some(experts) => Experts::Resident(experts),
            None => Experts::Streamed { source, layer },
        })
    }

    /// The routed experts under `mlp`, from whichever layout the checkpoint uses (found by
    /// `sluice_format::experts`, the scanner `sluice pack` and unpacked streaming use too),
    /// checked against the config's count and shapes.
    fn resident_experts(
        &self,
        mlp: &str,
        experts: usize,
        hidden: usize,
        inter: usize,
    ) -> Result<Vec<HostExpert>, ModelError> {
        let found = sluice_format::experts::layer_experts(&self.dir.tensors, self.quant, mlp)?;
        let want = [(inter, hidden), (inter, hidden), (hidden, inter)];
        // Every expert of a layer has expert 0's shapes (the scanner checks it).
        let got = found
            .first()
            .map(|e| [0, 1, 2].map(|i| (e[i].rows, e[i].cols)));
        if found.len() != experts || got != Some(want) {
            return Err(ModelError::Unsupported(format!(
                "{}: `{mlp}` holds {} experts of shapes {:?} (gate, up, down); the config needs \
                 {experts} of {want:?}",
                self.dir.path.display(),
                found.len(),
                got.unwrap_or_default()
            )));
        }
        Ok(found
            .into_iter()
            .map(|[gate, up, down]| FfnWeights { gate, up, down })
            .collect())
    }

    /// Bytes read by every token (all counted weights but the embeddings and routed experts),
    /// and bytes of routed experts.
    pub fn counted(&self) -> (usize, usize) {
        (
            self.bytes - self.embed_bytes - self.expert_bytes,
            self.expert_bytes,
        )
    }
}
