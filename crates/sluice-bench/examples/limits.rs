//! Prints the machine's limits: DRAM read bandwidth and raw disk read throughput.
//!
//! `cargo run --release -p sluice-bench --example limits -- [FILE]` (FILE: a large file on the
//! disk to measure, such as a model's largest safetensors shard; without it only memory runs).

use sluice_bench::limits::{disk, memory_read, DiskOptions, DEFAULT_MEMORY_BYTES};
use sluice_sys::{format_bytes, format_bytes_binary};

fn main() -> anyhow::Result<()> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let m = memory_read(threads, DEFAULT_MEMORY_BYTES);
    println!(
        "memory read: {:.1} GB/s with {} threads over {}",
        m.gbps,
        m.threads,
        format_bytes_binary(m.bytes as u64)
    );
    if let Some(file) = std::env::args_os().nth(1) {
        let r = disk(&DiskOptions::new(file))?;
        println!(
            "disk: {} ({}), {}",
            r.file.display(),
            format_bytes(r.file_bytes),
            if r.direct { "O_DIRECT" } else { "buffered" }
        );
        for p in [&r.sequential, &r.random_qd1, &r.random_qdn] {
            println!(
                "  {:<10} {:>8} QD{:<2}: {:>6.2} GB/s, {:>6.2} ms/request ({} in {:.2} s, {} requests)",
                p.name,
                format_bytes_binary(p.request_bytes as u64),
                p.queue_depth,
                p.gbps,
                p.mean_latency_ms,
                format_bytes(p.bytes),
                p.seconds,
                p.requests
            );
        }
        for n in &r.notes {
            println!("  note: {n}");
        }
    }
    Ok(())
}
