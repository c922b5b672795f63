//! Benchmarks and the machine limits they are compared against.

pub mod limits;
pub mod model;
