//! Deferred launches, replayed as CUDA graphs.
//!
//! The device records kernel launches instead of issuing them until the host needs their results
//! (a read back, a synchronisation, an upload that must follow them). A batch whose shape — the
//! kernels, grids and blocks in order — was flushed before runs as one CUDA graph: built the
//! second time that shape is seen, then replayed with only the parameters that changed updated
//! in place. A decode step of a 48-layer model is ~450 launches; replayed, the host makes one
//! launch call and one parameter update (the token id: cache lengths live on the device, and
//! buffers are reused lowest address first, so steps get the same ones), and the GPU runs the
//! kernels back to back.

use std::collections::hash_map::DefaultHasher;
use std::collections::{HashSet, VecDeque};
use std::ffi::c_void;
use std::hash::{Hash, Hasher};

use cudarc::driver::sys::{self, CUgraph, CUgraphExec, CUgraphNode, CUstream};
use cudarc::driver::{CudaFunction, DriverError};

use crate::device::Arg;

/// One recorded kernel launch.
#[derive(Clone)]
pub(crate) struct Launch {
    pub f: CudaFunction,
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub args: Vec<Arg>,
}

impl Launch {
    /// Whether `other` launches the same kernel with the same geometry and argument kinds.
    fn same_shape(&self, other: &Launch) -> bool {
        self.f.cu_function() == other.f.cu_function()
            && self.grid == other.grid
            && self.block == other.block
            && self.args.len() == other.args.len()
            && self
                .args
                .iter()
                .zip(&other.args)
                .all(|(a, b)| std::mem::discriminant(a) == std::mem::discriminant(b))
    }

    fn shape_hash(&self, h: &mut DefaultHasher) {
        (self.f.cu_function() as usize).hash(h);
        self.grid.hash(h);
        self.block.hash(h);
        for a in &self.args {
            std::mem::discriminant(a).hash(h);
        }
    }

    /// The driver's view of the arguments: pointers into `self.args`.
    pub fn param_ptrs(&self) -> Vec<*mut c_void> {
        self.args.iter().map(Arg::as_param).collect()
    }

    /// Issues it on `stream` now.
    pub fn issue(&self, stream: CUstream) -> Result<(), DriverError> {
        let mut params = self.param_ptrs();
        // SAFETY: `params` points into `self.args`, alive for the call; each kernel's parameter
        // list matches the `Arg`s its wrapper in backend.rs passes (kernels/sluice.cu), and every
        // pointer argument is a live allocation of the sizes the kernel reads and writes.
        unsafe {
            cudarc::driver::result::launch_kernel(
                self.f.cu_function(),
                self.grid,
                self.block,
                0,
                stream,
                &mut params,
            )
        }
    }

    fn node_params(&self, params: &mut [*mut c_void]) -> sys::CUDA_KERNEL_NODE_PARAMS {
        sys::CUDA_KERNEL_NODE_PARAMS {
            func: self.f.cu_function(),
            gridDimX: self.grid.0,
            gridDimY: self.grid.1,
            gridDimZ: self.grid.2,
            blockDimX: self.block.0,
            blockDimY: self.block.1,
            blockDimZ: self.block.2,
            sharedMemBytes: 0,
            kernelParams: params.as_mut_ptr(),
            extra: std::ptr::null_mut(),
            kern: std::ptr::null_mut(),
            ctx: std::ptr::null_mut(),
        }
    }
}

/// An instantiated graph: a chain of kernel nodes, one per launch of `launches`.
struct Graph {
    graph: CUgraph,
    exec: CUgraphExec,
    nodes: Vec<CUgraphNode>,
    launches: Vec<Launch>,
    shape: u64,
}

// SAFETY: the graph handles are used only by the `Graphs` that owns them, under the device's
// mutex; CUDA graph objects may move between threads when access is serialised.
unsafe impl Send for Graph {}

impl Drop for Graph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `Graph::build` and are destroyed once, here; the
        // context's stream order keeps a launched graph's work alive past its destruction.
        unsafe {
            if !self.exec.is_null() {
                sys::cuGraphExecDestroy(self.exec);
            }
            sys::cuGraphDestroy(self.graph);
        }
    }
}

fn check(r: sys::CUresult) -> Result<(), DriverError> {
    r.result()
}

impl Graph {
    /// A graph of `launches` (its `launches` left empty for the caller to fill); with
    /// `programmatic`, each kernel may start once the one before it has started (the kernels wait
    /// for their predecessor's results themselves: PDL_WAIT in kernels/sluice.cu).
    fn build(launches: &[Launch], shape: u64, programmatic: bool) -> Result<Graph, DriverError> {
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: `graph` is written by the driver.
        check(unsafe { sys::cuGraphCreate(&mut graph, 0) })?;
        let mut g = Graph {
            graph,
            exec: std::ptr::null_mut(),
            nodes: Vec::with_capacity(launches.len()),
            launches: Vec::new(),
            shape,
        };
        for l in launches {
            let mut params = l.param_ptrs();
            let p = l.node_params(&mut params);
            let mut node: CUgraphNode = std::ptr::null_mut();
            let prev = g.nodes.last().copied();
            let deps = match (prev, programmatic) {
                (Some(n), false) => vec![n],
                _ => vec![],
            };
            // SAFETY: `p` points at `params`, which points into `l.args`, all alive for the call
            // (the driver copies the parameter values); `deps` holds the previous node or none.
            check(unsafe {
                sys::cuGraphAddKernelNode_v2(&mut node, g.graph, deps.as_ptr(), deps.len(), &p)
            })?;
            if let (Some(prev), true) = (prev, programmatic) {
                let edge = sys::CUgraphEdgeData {
                    from_port: sys::CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC as u8,
                    to_port: 0,
                    type_: sys::CUgraphDependencyType_enum::CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
                        as u8,
                    reserved: [0; 5],
                };
                // SAFETY: both nodes belong to `g.graph`; the edge data is read during the call.
                check(unsafe { sys::cuGraphAddDependencies_v2(g.graph, &prev, &node, &edge, 1) })?;
            }
            g.nodes.push(node);
        }
        // SAFETY: `g.graph` is a complete graph; `exec` is written by the driver.
        check(unsafe { sys::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0) })?;
        Ok(g)
    }

    fn matches(&self, launches: &[Launch]) -> bool {
        self.launches.len() == launches.len()
            && self
                .launches
                .iter()
                .zip(launches)
                .all(|(a, b)| a.same_shape(b))
    }

    /// Brings the nodes' arguments to those of `launches` (same shape) and launches the graph;
    /// the functions of the nodes it updated go to `updated`.
    fn replay(
        &mut self,
        launches: Vec<Launch>,
        stream: CUstream,
        updated: &mut Vec<usize>,
    ) -> Result<(), DriverError> {
        for ((node, old), new) in self.nodes.iter().zip(&mut self.launches).zip(launches) {
            if old.args != new.args {
                updated.push(new.f.cu_function() as usize);
                let mut params = new.param_ptrs();
                let p = new.node_params(&mut params);
                // SAFETY: `node` belongs to the graph `exec` was instantiated from, and the new
                // parameters launch the same kernel with the same geometry; the values are copied.
                check(unsafe { sys::cuGraphExecKernelNodeSetParams_v2(self.exec, *node, &p) })?;
                *old = new;
            }
        }
        // SAFETY: `exec` is a live instantiated graph; it runs in `stream`'s order.
        check(unsafe { sys::cuGraphLaunch(self.exec, stream) })
    }
}

/// Batches shorter than this are issued launch by launch: a graph would not pay for itself.
const MIN_GRAPH_LAUNCHES: usize = 16;
/// Graphs kept (least recently used dropped first).
const MAX_GRAPHS: usize = 8;
/// Shapes remembered as seen once.
const MAX_SEEN: usize = 64;

/// Recorded launches waiting for a flush, and the graphs built from earlier flushes.
#[derive(Default)]
pub(crate) struct Graphs {
    /// Whether graphs chain their kernels with programmatic edges.
    programmatic: bool,
    pending: Vec<Launch>,
    /// Most recently used last.
    graphs: VecDeque<Graph>,
    seen: HashSet<u64>,
    seen_order: VecDeque<u64>,
    /// Functions of the nodes that the last replay updated (for `SLUICE_CUDA_GRAPHS=stats`).
    pub updated: Vec<usize>,
}

/// How a flush ran its launches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flushed {
    /// Launch by launch (a short batch, or a shape seen for the first time).
    Issued,
    /// As a new graph.
    Built,
    /// As an earlier graph, its changed parameters updated.
    Replayed,
}

impl Graphs {
    pub fn new(programmatic: bool) -> Graphs {
        Graphs {
            programmatic,
            ..Graphs::default()
        }
    }

    pub fn record(&mut self, launch: Launch) {
        self.pending.push(launch);
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Runs every pending launch on `stream`, in order.
    pub fn flush(&mut self, stream: CUstream) -> Result<Flushed, DriverError> {
        let launches = std::mem::take(&mut self.pending);
        let issue = |launches: Vec<Launch>| {
            launches.iter().try_for_each(|l| l.issue(stream))?;
            Ok(Flushed::Issued)
        };
        if launches.len() < MIN_GRAPH_LAUNCHES {
            return issue(launches);
        }
        let mut h = DefaultHasher::new();
        launches.iter().for_each(|l| l.shape_hash(&mut h));
        let shape = h.finish();
        self.updated.clear();
        if let Some(i) = self
            .graphs
            .iter()
            .position(|g| g.shape == shape && g.matches(&launches))
        {
            let mut g = self.graphs.remove(i).expect("index from position");
            let r = g.replay(launches, stream, &mut self.updated);
            self.graphs.push_back(g);
            return r.map(|_| Flushed::Replayed);
        }
        if !self.seen.contains(&shape) {
            // First sight: most shapes (a prompt's prefill) never come back.
            self.seen.insert(shape);
            self.seen_order.push_back(shape);
            if self.seen_order.len() > MAX_SEEN {
                if let Some(old) = self.seen_order.pop_front() {
                    self.seen.remove(&old);
                }
            }
            return issue(launches);
        }
        let Ok(mut g) = Graph::build(&launches, shape, self.programmatic) else {
            // A graph the driver will not build (out of memory, say) still runs launch by launch.
            return issue(launches);
        };
        g.launches = launches;
        // SAFETY: `exec` is a live instantiated graph; it runs in `stream`'s order.
        check(unsafe { sys::cuGraphLaunch(g.exec, stream) })?;
        if self.graphs.len() == MAX_GRAPHS {
            self.graphs.pop_front();
        }
        self.graphs.push_back(g);
        Ok(Flushed::Built)
    }
}
