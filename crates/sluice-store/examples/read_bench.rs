//! Random aligned block reads through the store's reader (O_DIRECT), GB/s per queue depth.
//!
//! ```sh
//! cargo run --release -p sluice-store --example read_bench -- FILE [--block 2MiB] \
//!     [--qd 1,4,8,16,32] [--kind auto|uring|threads] [--seconds 2] [--region 0:1] [--seed 1]
//! ```
//!
//! Each block of the file (within `--region`, fractions of the file) is read at most once per run,
//! in random order, so neither the page cache nor a host cache serves repeats; a queue depth's
//! run stops early when the blocks run out.

use std::path::PathBuf;
use std::process::ExitCode;

use sluice_store::bench::{read_blocks, ALIGN};
use sluice_store::{IoKind, ReaderOptions};

fn parse_bytes(s: &str) -> Option<usize> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num.parse().ok()?;
    let mult = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        "g" | "gib" | "gb" => 1 << 30,
        _ => return None,
    };
    Some(n * mult)
}

struct Args {
    file: PathBuf,
    block: usize,
    qds: Vec<usize>,
    kind: IoKind,
    seconds: f64,
    region: (f64, f64),
    seed: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        file: PathBuf::new(),
        block: 2 << 20,
        qds: vec![1, 4, 8, 16, 32],
        kind: IoKind::Auto,
        seconds: 2.0,
        region: (0.0, 1.0),
        seed: 1,
    };
    let mut file = None;
    while let Some(arg) = it.next() {
        let mut val = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--block" => a.block = parse_bytes(&val()?).ok_or("bad --block")?,
            "--qd" => {
                a.qds = val()?
                    .split(',')
                    .map(|s| s.trim().parse().map_err(|_| format!("bad queue depth {s}")))
                    .collect::<Result<_, _>>()?
            }
            "--kind" => {
                a.kind = match val()?.as_str() {
                    "auto" => IoKind::Auto,
                    "uring" => IoKind::Uring,
                    "threads" => IoKind::Threads,
                    k => return Err(format!("unknown --kind {k}")),
                }
            }
            "--seconds" => a.seconds = val()?.parse().map_err(|_| "bad --seconds")?,
            "--seed" => a.seed = val()?.parse().map_err(|_| "bad --seed")?,
            "--region" => {
                let v = val()?;
                let (s, e) = v.split_once(':').ok_or("--region wants START:END")?;
                a.region = (
                    s.parse().map_err(|_| "bad --region")?,
                    e.parse().map_err(|_| "bad --region")?,
                );
            }
            "-h" | "--help" => return Err(String::new()),
            _ if file.is_none() && !arg.starts_with("--") => file = Some(PathBuf::from(arg)),
            _ => return Err(format!("unexpected argument {arg}")),
        }
    }
    a.file = file.ok_or("missing FILE")?;
    if a.block == 0 || !a.block.is_multiple_of(ALIGN) {
        return Err(format!("--block must be a positive multiple of {ALIGN}"));
    }
    if a.qds.contains(&0) {
        return Err("queue depths must be positive".into());
    }
    Ok(a)
}

fn main() -> ExitCode {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            if !e.is_empty() {
                eprintln!("error: {e}");
            }
            eprintln!(
                "usage: read_bench FILE [--block 2MiB] [--qd 1,4,8,16,32] \
                 [--kind auto|uring|threads] [--seconds 2] [--region 0:1] [--seed 1]"
            );
            return ExitCode::from(2);
        }
    };
    let size = match std::fs::metadata(&a.file) {
        Ok(m) => m.len() as usize,
        Err(e) => {
            eprintln!("error: {}: {e}", a.file.display());
            return ExitCode::FAILURE;
        }
    };
    let first = (size as f64 * a.region.0) as usize / a.block;
    let last = ((size as f64 * a.region.1.min(1.0)) as usize / a.block).min(size / a.block);
    let mut blocks: Vec<usize> = (first..last).collect();
    if blocks.is_empty() {
        eprintln!("error: no whole {}-byte block in the region", a.block);
        return ExitCode::FAILURE;
    }
    // Fisher-Yates with xorshift.
    let mut s = a.seed.max(1);
    for i in (1..blocks.len()).rev() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        blocks.swap(i, (s % (i as u64 + 1)) as usize);
    }
    let mut offsets = blocks.iter().map(|&b| (b * a.block) as u64).peekable();

    println!(
        "file {} ({:.2} GB), {} blocks of {} KiB available",
        a.file.display(),
        size as f64 / 1e9,
        blocks.len(),
        a.block >> 10
    );
    println!("| kind | direct | qd | GB/s | reads | mean latency ms | busy % |");
    println!("|---|---|---:|---:|---:|---:|---:|");
    for &qd in &a.qds {
        let opts = ReaderOptions {
            kind: a.kind,
            direct: true,
            queue_depth: qd,
            faults: None,
        };
        let run = match read_blocks(&a.file, &opts, a.block, &mut offsets, a.seconds) {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: opening {}: {e}", a.file.display());
                return ExitCode::FAILURE;
            }
        };
        for e in &run.errors {
            eprintln!("error: {e}");
        }
        let kind = match run.kind {
            IoKind::Uring => "uring",
            _ => "threads",
        };
        println!(
            "| {kind} | {} | {qd} | {:.3} | {} | {:.2} | {:.0} |",
            run.direct,
            run.bytes_read as f64 / run.secs / 1e9,
            run.reads,
            run.latency.as_secs_f64() * 1e3 / run.reads.max(1) as f64,
            100.0 * run.busy_secs / run.secs,
        );
        if !run.errors.is_empty() {
            return ExitCode::FAILURE;
        }
        if offsets.peek().is_none() {
            eprintln!("note: every block in the region has been read; stopping");
            break;
        }
    }
    ExitCode::SUCCESS
}
