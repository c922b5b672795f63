#!/usr/bin/env bash
# Decode with the fast (dp4a, 8-bit activation) one-token kernels against the exact ones, one
# binary, alternating SLUICE_CUDA_FAST_DECODE=1 and =0 in one run on the same GPU: the A/B that
# decides whether they become the default (with tests/fast_prefill.rs's bounds).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/cuda/fast_decode_ab.sh --model DIR [--model DIR ...] [--sluice BIN] [--rounds N]
                                    [-n N] [-r N]

Runs `BIN bench -m DIR --device cuda --kernels fast -p 0 -n N -r R` with SLUICE_CUDA_FAST_DECODE=0
then =1, for every round and model, and prints each model's tg figures, means and their ratio.

  --model DIR   a 4-bit checkpoint (`sluice synth --preset qwen3-30b-a3b -o DIR`); repeatable
  --sluice BIN  the binary (default target/release/sluice)
  --rounds N    alternations (default 3)
  -n N, -r N    generated tokens and repetitions per run (default 128, 3)
EOF
}

models=() sluice="target/release/sluice" rounds=3 n=128 r=3
while [ $# -gt 0 ]; do
    case "$1" in
        --model) models+=("$2"); shift 2 ;;
        --sluice) sluice="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        -n) n="$2"; shift 2 ;;
        -r) r="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
[ ${#models[@]} -gt 0 ] || { echo "error: --model DIR is required" >&2; exit 2; }
[ -x "$sluice" ] || { echo "error: $sluice is not an executable sluice binary" >&2; exit 2; }
[[ "$rounds$n$r" =~ ^[0-9]+$ ]] || { echo "error: --rounds, -n and -r take whole numbers" >&2; exit 2; }

for model in "${models[@]}"; do
    [ -e "$model" ] || { echo "error: no model at $model" >&2; exit 2; }
    exact=() fast=()
    for round in $(seq "$rounds"); do
        for mode in 0 1; do
            line=$(SLUICE_CUDA_FAST_DECODE=$mode "$sluice" bench -m "$model" --device cuda \
                --kernels fast -p 0 -n "$n" -r "$r" 2>&1 | grep -a "^ *tg$n " | tail -1) || true
            rate=$(sed -nE 's/.*: ([0-9.]+) ± .*/\1/p' <<< "$line")
            [ -n "$rate" ] || { echo "error: $sluice bench printed no tg$n figure for $model" >&2; exit 1; }
            echo "round $round  SLUICE_CUDA_FAST_DECODE=$mode  $line" >&2
            if [ "$mode" = 1 ]; then fast+=("$rate"); else exact+=("$rate"); fi
        done
    done
    python3 - "$model" "${exact[*]}" "${fast[*]}" <<'PY'
import sys
model, exact, fast = sys.argv[1], [float(x) for x in sys.argv[2].split()], [float(x) for x in sys.argv[3].split()]
me, mf = sum(exact) / len(exact), sum(fast) / len(fast)
print(f"{model}: exact {' / '.join(f'{x:.2f}' for x in exact)} (mean {me:.2f}), "
      f"fast decode {' / '.join(f'{x:.2f}' for x in fast)} (mean {mf:.2f}): {mf / me:.3f}x")
PY
done
