//! `--device`: which backend runs the model. The one place that names the backends; every
//! command is written once, generic over [`sluice_backend::Backend`], and [`with_engine!`] runs
//! it on the one chosen here.

use std::str::FromStr;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use sluice_backend::Backend as _;
use sluice_cpu::{CpuBackend, Kernels};
use sluice_cuda::{CudaBackend, HostCompute};

/// What `--device` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// The first GPU when one is usable, else the CPU (said on stderr).
    Auto,
    Cpu,
    /// CUDA device `N`.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" | "gpu" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device `{s}` (use auto, cpu, cuda or cuda:N)")),
        }
    }
}

/// A backend, ready to load a model on.
pub enum Picked {
    Cpu(Arc<CpuBackend>),
    Cuda(Arc<CudaBackend>),
}

/// A backend to load a model on only to read its shapes (`sluice info`): the CPU's maps the
/// weights in place without reading them.
pub fn shape_probe() -> Arc<CpuBackend> {
    Arc::new(CpuBackend::new())
}

/// Opens the backend `device` asks for with `kernels` (the CPU's; on a GPU, `fast` is the
/// prefill's 8-bit activations, and the CPU's for experts it computes beside the GPU as
/// `cpu_experts` says); a GPU that cannot be used is a one-line error (or, for `auto`, a note
/// and the CPU).
pub fn pick(device: Device, kernels: Kernels, cpu_experts: HostCompute) -> Result<Picked> {
    let cpu = || Picked::Cpu(Arc::new(CpuBackend::with_kernels(kernels)));
    let gpu = |b: CudaBackend| {
        Picked::Cuda(Arc::new(
            b.with_fast_kernels(kernels == Kernels::Fast)
                .with_host_compute(cpu_experts, kernels),
        ))
    };
    match device {
        Device::Cpu => Ok(cpu()),
        Device::Cuda(n) => sluice_cuda::open(n)
            .map(gpu)
            .map_err(|e| anyhow!("--device cuda:{n}: {e}")),
        Device::Auto if sluice_cuda::device_count() == 0 => Ok(cpu()),
        Device::Auto => match sluice_cuda::open(0) {
            Ok(b) => {
                eprintln!(
                    "sluice: --device auto: using {} (--device cpu for the CPU)",
                    b.describe()
                );
                Ok(gpu(b))
            }
            Err(e) => {
                eprintln!("sluice: --device auto: the GPU is not usable ({e}); using the CPU");
                Ok(cpu())
            }
        },
    }
}

/// Binds `$backend` to the backend `$device` picks (the CPU's with `$kernels`; on a GPU, the CPU
/// computing experts as `$cpu_experts` says) and runs `$body` with it (once per backend type, so
/// the body can call generic functions).
macro_rules! with_backend {
    ($device:expr, $kernels:expr, $cpu_experts:expr, |$backend:ident| $body:expr) => {
        match $crate::device::pick($device, $kernels, $cpu_experts)? {
            $crate::device::Picked::Cpu($backend) => $body,
            $crate::device::Picked::Cuda($backend) => $body,
        }
    };
}

/// Loads the model of `$args` (a [`crate::ModelArgs`]) on its `--device` and runs `$body` with
/// the engine bound to `$engine`.
macro_rules! with_engine {
    ($args:expr, |$engine:ident| $body:expr) => {
        with_backend!(
            $args.device,
            $args.kernels(),
            $args.stream.cpu_experts,
            |backend| {
                let $engine = $crate::load($args, backend)?;
                $body
            }
        )
    };
}
