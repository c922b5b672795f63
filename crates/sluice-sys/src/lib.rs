//! What the operating system says about this machine and process: available memory, resident
//! memory (RSS), free disk space; and byte sizes as people write them ("6GiB", "17.2 GB").
//!
//! This is the ground floor for host facts: the engine sizes its expert cache from
//! [`mem_available_bytes`], the tools that write checkpoints check [`free_disk_bytes`] first, the
//! benchmarks read the RSS, and the command line parses its size flags as [`ByteSize`]. It knows
//! nothing about models. It also holds the binary's global allocator, [`LargePages`].
//!
//! The memory figures come from `/proc` and exist on Linux only; elsewhere they are `None`.
//!
//! ```
//! use sluice_sys::{format_bytes, ByteSize};
//!
//! let cache: ByteSize = "6GiB".parse().unwrap();
//! assert_eq!(cache.bytes(), 6 << 30);
//! assert_eq!(cache.to_string(), "6GiB");
//! assert_eq!(format_bytes(17_200_000_000), "17.2 GB");
//! ```

// The `unsafe` calls (statvfs, signal, setrlimit, mmap) live in `disk`, `signals`, `limits` and
// `alloc`, which allow them; nothing else may.
#![deny(unsafe_code)]

mod alloc;
mod disk;
mod limits;
mod proc;
mod signals;
mod size;

pub use alloc::LargePages;
pub use disk::free_disk_bytes;
pub use limits::limit_own_memory;
pub use proc::{current_rss_bytes, mem_available_bytes, peak_rss_bytes, reset_peak_rss};
pub use signals::die_quietly_on_closed_pipe;
pub use size::{format_bytes, format_bytes_binary, parse_bytes, ByteSize, ByteSizeError};
