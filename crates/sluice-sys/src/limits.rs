//! Limits a process puts on itself.

/// Caps this process's address space at `bytes` (`RLIMIT_AS`) and turns core dumps off
/// (`RLIMIT_CORE` 0). For a helper process that runs untrusted code: an allocation past the cap
/// fails, so the helper ends (Rust aborts on a failed allocation) instead of taking the
/// machine's memory, and leaves no core file the size of the cap behind.
#[cfg(unix)]
pub fn limit_own_memory(bytes: u64) -> std::io::Result<()> {
    for (resource, value) in [(libc::RLIMIT_CORE, 0), (libc::RLIMIT_AS, bytes)] {
        // rlim_t is u64 on Linux, not on every Unix.
        #[allow(trivial_numeric_casts)]
        let limit = libc::rlimit {
            rlim_cur: value as libc::rlim_t,
            rlim_max: value as libc::rlim_t,
        };
        #[allow(unsafe_code)]
        // SAFETY: `setrlimit` reads the struct passed by reference and changes only this
        // process's limits; it touches no Rust-visible memory.
        if unsafe { libc::setrlimit(resource, &limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Process memory limits exist on Unix only: elsewhere this is an `Unsupported` error.
#[cfg(not(unix))]
pub fn limit_own_memory(_bytes: u64) -> std::io::Result<()> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "process memory limits exist on Unix only",
    ))
}
