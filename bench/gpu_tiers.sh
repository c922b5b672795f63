#!/usr/bin/env bash
# Experts tiered over VRAM / host RAM / disk on one GPU, against llama.cpp's `--n-cpu-moe` at the
# same VRAM, one run: for the lent GPU machine (CUDA, CMake, no network). Run after
# `bench/gpu_peers.sh --prepare` (same --work), which builds llama-bench and writes the exact
# checkpoint and its Q4_0 GGUF.
set -euo pipefail

usage() {
    cat <<'EOF'
usage: bench/gpu_tiers.sh --sluice BIN [--work DIR] [--preset NAME] [--vram GiB] [--cpu-moe "N ..."]
                          [-n N] [-r N] [--runs "auto off streamed nocache"]

  --sluice BIN    the sluice binary
  --work DIR      gpu_peers.sh's work directory (default /tmp/gpu-peers): llama.cpp's build,
                  PRESET/ and PRESET.gguf
  --preset NAME   (default qwen3-30b-a3b)
  --vram GiB      sluice's --vram-budget (default 8)
  --cpu-moe LIST  llama.cpp --n-cpu-moe values to try (default "48 32 28 24"); the best whose
                  peak GPU memory fits the same budget is the baseline
  -n N, -r N      generated tokens and repetitions (default 64, 3)
  --runs LIST     which sluice runs, in order (default "auto off streamed nocache"):
                    auto      the defaults: experts in page-locked host RAM read in place, the most
                              used in VRAM, part of the misses computed by the CPU
                              (--cpu-experts auto)
                    off       the same with every miss read over PCIe (--cpu-experts off)
                    streamed  misses copied through the VRAM cache (SLUICE_CUDA_IN_PLACE=0)
                    nocache   in place with no VRAM cache (SLUICE_CUDA_EXPERT_CACHE=0)

Packs the checkpoint (once), then runs llama-bench at each --n-cpu-moe, sluice bench with the
budget and the experts in page-locked host RAM (a first tg256 fills the caches) as --runs says,
sampling GPU memory with nvidia-smi every 250 ms to report each run's peak.
EOF
}

sluice="" work="/tmp/gpu-peers" preset="qwen3-30b-a3b" vram=8 cpumoe="48 32 28 24" n=64 r=3
runs="auto off streamed nocache"
while [ $# -gt 0 ]; do
    case "$1" in
        --sluice) sluice="$2"; shift 2 ;;
        --work) work="$2"; shift 2 ;;
        --preset) preset="$2"; shift 2 ;;
        --vram) vram="$2"; shift 2 ;;
        --cpu-moe) cpumoe="$2"; shift 2 ;;
        -n) n="$2"; shift 2 ;;
        -r) r="$2"; shift 2 ;;
        --runs) runs="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
[ -n "$sluice" ] && [ -x "$sluice" ] || { echo "error: --sluice BIN is required (an executable)" >&2; exit 2; }
model="$work/$preset"
llama="$work/llama/build/bin/llama-bench"
[ -f "$model/.complete" ] && [ -f "$model.gguf" ] && [ -x "$llama" ] ||
    { echo "error: run bench/gpu_peers.sh --prepare --work $work --preset $preset first" >&2; exit 2; }
[ -d "$model-packed" ] || "$sluice" pack "$model" --out "$model-packed" >&2

mem="$work/gpu_memory.log"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 > "$mem" &
sampler=$!
trap 'kill "$sampler" 2>/dev/null || true' EXIT
peak_since() { tail -n +"$1" "$mem" | sort -n | tail -1; }

run() {
    local start
    start=$(($(wc -l < "$mem") + 1))
    echo "== $*"
    "$@" 2>&1 | grep -v '^\s*$'
    echo "   peak GPU memory: $(peak_since "$start") MiB"
}

common=(--device cuda -m "$model-packed" -p 0 -n "256,$n" -r "$r" --no-warmup
        --memory-budget 1000GiB --vram-budget "${vram}GiB")
for c in $cpumoe; do
    run "$llama" -m "$model.gguf" -ngl 99 --n-cpu-moe "$c" -p 0 -n "$n" -r "$r" -o md
done
for which in $runs; do
    case "$which" in
        auto) run "$sluice" bench "${common[@]}" --memory --cpu-experts auto ;;
        off) run "$sluice" bench "${common[@]}" --cpu-experts off ;;
        streamed) run env SLUICE_CUDA_IN_PLACE=0 "$sluice" bench "${common[@]}" --cpu-experts off ;;
        nocache) run env SLUICE_CUDA_EXPERT_CACHE=0 "$sluice" bench "${common[@]}" --cpu-experts off ;;
        *) echo "error: unknown run '$which' in --runs (auto, off, streamed, nocache)" >&2; exit 2 ;;
    esac
done
