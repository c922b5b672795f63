#!/usr/bin/env bash
# CPU decode by thread count, one or two sluice binaries alternating in one run: the scaling
# figure of issue 15 (tg at 16 threads over tg at 8) and an A/B of a change to it, on the same
# host in the same minutes (hosts differ from call to call by more than most changes).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/cpu_threads.sh --model DIR [--sluice BIN] [--baseline BIN] [--threads LIST]
                            [--rounds N] [-n N] [-r N] [--profile]

Runs `BIN bench -m DIR --device cpu -t T -p 0 -n N -r R` for every round, thread count and
binary in turn (the baseline first), then prints each binary's mean tok/s per thread count and
the ratios between thread counts (each over the next one in LIST) and between the binaries.

  --model DIR     a checkpoint (`sluice synth --preset qwen3-30b-a3b -o DIR` for issue 15's)
  --sluice BIN    the binary to measure (default target/release/sluice)
  --baseline BIN  a second binary, run alternating with the first (e.g. main's)
  --threads LIST  comma-separated thread counts (default 16,8)
  --rounds N      rounds of the whole alternation (default 3)
  -n N, -r N      generated tokens and repetitions per run (default 64, 2)
  --profile       then, once per binary at the first thread count, SLUICE_CPU_PROFILE=1: the
                  team's waits ("team:" lines) and the products' bandwidth

Example (the lent 16-core host, CPU only):
  bench/cpu_threads.sh --model /dev/shm/q30 --sluice ./new --baseline ./old --threads 16,8
EOF
}

model="" sluice="target/release/sluice" baseline="" threads="16,8" rounds=3 n=64 r=2 profile=0
while [ $# -gt 0 ]; do
    case "$1" in
        --model) model="$2"; shift 2 ;;
        --sluice) sluice="$2"; shift 2 ;;
        --baseline) baseline="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        -n) n="$2"; shift 2 ;;
        -r) r="$2"; shift 2 ;;
        --profile) profile=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
[ -n "$model" ] && [ -e "$model" ] || { echo "error: --model DIR is required (a checkpoint directory or GGUF)" >&2; exit 2; }
for b in "$sluice" ${baseline:+"$baseline"}; do
    [ -x "$b" ] || { echo "error: $b is not an executable sluice binary" >&2; exit 2; }
done
[[ "$threads" =~ ^[0-9]+(,[0-9]+)*$ ]] || { echo "error: --threads takes numbers separated by commas, e.g. 16,8" >&2; exit 2; }
[[ "$rounds$n$r" =~ ^[0-9]+$ ]] || { echo "error: --rounds, -n and -r take whole numbers" >&2; exit 2; }

bins=()
[ -n "$baseline" ] && bins+=("baseline=$baseline")
bins+=("sluice=$sluice")
IFS=, read -r -a counts <<< "$threads"
results=$(mktemp)
trap 'rm -f "$results"' EXIT

for round in $(seq "$rounds"); do
    for t in "${counts[@]}"; do
        for entry in "${bins[@]}"; do
            name=${entry%%=*} bin=${entry#*=}
            line=$("$bin" bench -m "$model" --device cpu -t "$t" -p 0 -n "$n" -r "$r" 2>&1 |
                grep -a "^ *tg$n " | tail -1) || true
            rate=$(sed -nE 's/.*: ([0-9.]+) ± .*/\1/p' <<< "$line")
            if [ -z "$rate" ]; then
                echo "error: $bin bench -t $t printed no tg$n figure" >&2
                exit 1
            fi
            echo "round $round  $name  $t threads  $line" >&2
            echo "$name $t $rate" >> "$results"
        done
    done
done

python3 - "$results" "$threads" ${baseline:+baseline} <<'PY'
import sys
from collections import defaultdict
path, threads = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
names = ["sluice"] + (["baseline"] if len(sys.argv) > 3 else [])
runs = defaultdict(list)
for line in open(path):
    name, t, rate = line.split()
    runs[(name, int(t))].append(float(rate))
mean = {k: sum(v) / len(v) for k, v in runs.items()}
print("| binary | threads | tg tok/s (each round) | mean |")
print("|---|---|---|---|")
for name in names:
    for t in threads:
        rates = " / ".join(f"{x:.2f}" for x in runs[(name, t)])
        print(f"| {name} | {t} | {rates} | {mean[(name, t)]:.2f} |")
for name in names:
    for a, b in zip(threads, threads[1:]):
        print(f"{name}: {a} threads over {b}: {mean[(name, a)] / mean[(name, b)]:.2f}x")
if "baseline" in names:
    for t in threads:
        print(f"{t} threads: sluice over baseline {mean[('sluice', t)] / mean[('baseline', t)]:.2f}x")
PY

if [ "$profile" = 1 ]; then
    for entry in "${bins[@]}"; do
        name=${entry%%=*} bin=${entry#*=}
        echo "== $name, SLUICE_CPU_PROFILE=1, ${counts[0]} threads"
        SLUICE_CPU_PROFILE=1 "$bin" bench -m "$model" --device cpu -t "${counts[0]}" -p 0 -n 32 -r 1 2>&1 |
            grep -aE "team:|products on|tg32 " || true
    done
fi
