#!/usr/bin/env bash
# Where a decode step's GPU time goes, kernel by kernel, from the hardware counters (Nsight
# Compute, `ncu`): for a machine with a GPU and ncu but no Rust (the lent one; carry a release
# `sluice` binary). ncu runs each kernel alone with the caches flushed before it, so durations are
# those of a cold kernel without the overlap of a replayed graph: compare kernels with each other
# and with a changed binary, not with tok/s. About 5 minutes on the lent H200 (ncu slows the
# model's load and every launch it lets pass).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/cuda/profile.sh --sluice BIN --model DIR [--skip N] [--count N] [--kernels REGEX]
                             [--raw FILE]

  --sluice BIN     the sluice binary to profile
  --model DIR      the model it decodes (`sluice synth --preset qwen3-30b-a3b -o DIR` writes one in
                   ~20 s on the lent machine)
  --skip N         kernel launches to let pass first: the prompt and the first tokens (default 2000)
  --count N        launches to profile after them (default 64: a few layers of decode steps)
  --kernels REGEX  only kernels whose names match (ncu's regex; default: all)
  --raw FILE       also keep ncu's CSV there

Prints one row per kernel (means over its profiled launches): launches, grid x block, duration,
DRAM read and write bandwidth, achieved occupancy, registers per thread, and warp cycles per issued
instruction (how long a warp waits between two instructions: high means latency-bound).
EOF
}

sluice="" model="" skip=2000 count=64 kernels="" raw=""
while [ $# -gt 0 ]; do
    case "$1" in
        --sluice) sluice="$2"; shift 2 ;;
        --model) model="$2"; shift 2 ;;
        --skip) skip="$2"; shift 2 ;;
        --count) count="$2"; shift 2 ;;
        --kernels) kernels="$2"; shift 2 ;;
        --raw) raw="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
[ -n "$sluice" ] && [ -x "$sluice" ] || { echo "error: --sluice BIN is required (an executable)" >&2; exit 2; }
[ -n "$model" ] && [ -e "$model" ] || { echo "error: --model DIR is required (a model sluice loads)" >&2; exit 2; }
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
[ -n "$ncu" ] || { echo "error: ncu (Nsight Compute) not found on PATH or in /usr/local/cuda/bin" >&2; exit 1; }

csv=$(mktemp)
trap 'rm -f "$csv"' EXIT
filter=()
[ -n "$kernels" ] && filter=(-k "regex:$kernels")
# Launch by launch (no graph), so that ncu sees each kernel; clocks left as they are.
SLUICE_CUDA_GRAPHS=0 "$ncu" --clock-control none --csv --page raw --print-units base "${filter[@]}" \
    --launch-skip "$skip" --launch-count "$count" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,smsp__average_warp_latency_per_inst_issued.ratio,launch__grid_size,launch__block_size \
    "$sluice" generate -m "$model" --device cuda --prompt "Hello there" -n 64 --temperature 0 \
    > "$csv" 2> >(grep -v "^==PROF==" >&2)
[ -n "$raw" ] && cp "$csv" "$raw"
python3 - "$csv" <<'EOF'
import csv, sys
from collections import defaultdict

# ncu's CSV shares stdout with the generated text: the table starts at the header of names and
# keeps the lines with as many fields.
lines = open(sys.argv[1], newline="", errors="replace").read().splitlines()
start = next((i for i, l in enumerate(lines) if l.startswith('"ID","')), None)
if start is None:
    sys.exit("ncu profiled no kernel (is --skip past the end of the run, or --kernels too narrow?)")
head = next(csv.reader([lines[start]]))
table = [head] + [r for r in csv.reader(l for l in lines[start + 1:] if l.startswith('"'))
                  if len(r) == len(head)]
if len(table) < 3:
    sys.exit("ncu profiled no kernel (is --skip past the end of the run, or --kernels too narrow?)")
col = {name: i for i, name in enumerate(head)}
# The row after the names gives their units (its ID column is empty).
if table[1][col["ID"]] != "":
    sys.exit("ncu's CSV has no row of units after its header (this script reads ncu 2025's)")
units, data = table[1], table[2:]

def num(r, name):
    v = r[col[name]].replace(",", "")
    try:
        return float(v)
    except ValueError:
        return 0.0

def scale(name):
    """The factor to microseconds or bytes of a metric's unit (base units: --print-units base)."""
    u = units[col[name]]
    f = {"ns": 1e-3, "byte": 1.0}
    if u not in f:
        sys.exit(f"unexpected unit {u!r} for {name}")
    return f[u]

per = defaultdict(list)
for r in data:
    per[(r[col["Kernel Name"]], r[col["launch__grid_size"]], r[col["launch__block_size"]])].append(r)
us = scale("gpu__time_duration.sum")
rd, wr = scale("dram__bytes_read.sum"), scale("dram__bytes_write.sum")
out = []
for (name, grid, block), rs in per.items():
    m = lambda k, s=1.0: sum(num(r, k) for r in rs) / len(rs) * s
    t = m("gpu__time_duration.sum", us)
    out.append((t * len(rs), name, grid, block, len(rs), t,
                m("dram__bytes_read.sum", rd) / t / 1e3, m("dram__bytes_write.sum", wr) / t / 1e3,
                m("sm__warps_active.avg.pct_of_peak_sustained_active"),
                m("launch__registers_per_thread"),
                m("smsp__average_warp_latency_per_inst_issued.ratio")))
total = sum(o[0] for o in out)
print(f"{'kernel':28} {'n':>4} {'blocks x threads':>17} {'us':>7} {'share':>6} {'read GB/s':>9} "
      f"{'write GB/s':>10} {'occup %':>7} {'regs':>5} {'cyc/issue':>9}")
for o in sorted(out, reverse=True):
    _, name, grid, block, n, t, r, w, occ, regs, stall = o
    print(f"{name[:28]:28} {n:4d} {grid + ' x ' + block:>17} {t:7.2f} {o[0] / total * 100:5.1f}% "
          f"{r:9.0f} {w:10.0f} {occ:7.1f} {regs:5.0f} {stall:9.2f}")
EOF
