#!/usr/bin/env bash
# Measure mlx-lm (CPU backend) on an mlx-community checkpoint directory.
set -euo pipefail

usage() {
    cat <<'H'
usage: bench/mlx_lm.sh MODEL_DIR [--available SIZE] [-p N] [-n N] [-r N] [--warmup]

Installs `mlx[cpu] mlx-lm` into a venv under $SLUICE_BENCH_HOME (default ~/.cache/sluice-bench)
and times prompt processing and generation with mlx-lm's Python API (bench/mlx_lm_bench.py:
load, then generate_step). Prints one JSON line on stdout:
  {"engine":"mlx-lm","scenario":"mmap","pp_tok_s":..,"pp_sd":..,"tg_tok_s":..,"tg_sd":..,...}
mlx-lm on a small CPU is very slow (~0.05 tok/s for the Qwen3-30B-A3B shape), hence the defaults.

  -p N            prompt tokens (default 32)
  -n N            generated tokens (default 4; tg is timed over tokens 2..N)
  -r N            repetitions (default 1)
  --warmup        one untimed run first (else repetition 1 includes reading the weights)
  --available S   run under bench/memcap with only S (e.g. 10GiB) of memory available
  -h, --help      this text
H
}
die() { echo "mlx_lm.sh: $*" >&2; exit 1; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOME_DIR="${SLUICE_BENCH_HOME:-$HOME/.cache/sluice-bench}"
VENV="$HOME_DIR/mlx-lm/venv"
MODEL="" AVAIL="" P=32 N=4 R=1 WARM=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --available) AVAIL="${2:?--available needs a size}"; shift 2 ;;
        -p) P="${2:?-p needs a number}"; shift 2 ;;
        -n) N="${2:?-n needs a number}"; shift 2 ;;
        -r) R="${2:?-r needs a number}"; shift 2 ;;
        --warmup) WARM=(--warmup); shift ;;
        -t) echo "mlx_lm.sh: -t ignored (mlx picks its own CPU threads)" >&2; shift 2 ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [[ -z "$MODEL" ]] || die "one MODEL_DIR only"; MODEL="$1"; shift ;;
    esac
done
[[ -n "$MODEL" ]] || { usage >&2; exit 2; }
[[ -f "$MODEL/config.json" ]] || die "$MODEL/config.json not found"
for v in "$P" "$N" "$R"; do [[ "$v" =~ ^[0-9]+$ && "$v" -ge 1 ]] || die "-p/-n/-r take integers >= 1 (got $v)"; done

PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "mlx_lm.sh: creating venv $VENV" >&2
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" || die "python3 -m venv failed"
fi
if ! "$PY" -c 'import mlx.core, mlx_lm' 2>/dev/null; then
    echo "mlx_lm.sh: pip install mlx[cpu] mlx-lm" >&2
    "$VENV/bin/pip" install --quiet "mlx[cpu]" mlx-lm >&2 || die "pip install mlx[cpu] mlx-lm failed"
fi

cmd=("$PY" "$HERE/mlx_lm_bench.py" "$MODEL" -p "$P" -n "$N" -r "$R" --scenario mmap ${WARM[@]+"${WARM[@]}"})
if [[ -n "$AVAIL" ]]; then
    cmd=("$HERE/memcap" --available "$AVAIL" -- "${cmd[@]}" --available "$AVAIL")
fi
echo "mlx_lm.sh: ${cmd[*]}" >&2
"${cmd[@]}"
