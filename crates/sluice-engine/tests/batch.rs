//! Continuous batching on the CPU (`common/batch.rs`): requests joining and leaving a batch get
//! their results alone, with the exact kernels and with the fast (default) ones.

use std::sync::Arc;

use sluice_cpu::{CpuBackend, Kernels};

#[path = "common/reference.rs"]
#[allow(unused_macros)]
#[macro_use]
mod reference;

#[path = "common/batch.rs"]
#[macro_use]
mod batch;

mod exact {
    use super::*;
    batch_suite!(Arc::new(CpuBackend::with_kernels(Kernels::Exact)););
}

mod fast {
    use super::*;
    batch_suite!(Arc::new(CpuBackend::with_kernels(Kernels::Fast)););
}
