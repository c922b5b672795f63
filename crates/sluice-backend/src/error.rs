//! What can go wrong inside a backend.

use crate::WeightError;

/// A backend failure. Operations on activations do not return errors (a backend that computes
/// asynchronously could not report them at the call anyway); a backend records the first failure
/// and reports it from [`crate::Backend::synchronize`] and from every call that brings data back
/// to the host.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The host bytes of a weight do not describe the matrix they claim to.
    #[error(transparent)]
    Weight(#[from] WeightError),
    /// This backend cannot do what was asked (a weight format, a shape), with what to do instead.
    #[error("{0}")]
    Unsupported(String),
    /// An allocation did not fit.
    #[error("out of {memory} memory allocating {what} ({needed} bytes, {free} free); {hint}")]
    OutOfMemory {
        /// `device` or `host`.
        memory: &'static str,
        what: String,
        needed: u64,
        free: u64,
        /// What the user can do about it.
        hint: String,
    },
    /// The device or its driver failed (a failed launch, a lost device).
    #[error("{0}")]
    Device(String),
}
