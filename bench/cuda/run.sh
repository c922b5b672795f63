#!/usr/bin/env bash
# Microbenchmarks behind the decode kernels' design notes, for a machine with nvcc (the lent GPU
# machine); each prints microseconds per launch from CUDA graphs over distinct weights (L2 cold):
#   decode_kernels    sluice's own decode kernels (kernels/sluice.cu) alone on realistic layouts:
#                     the MoE's gate/up and down (expert width 768 and 512) and dense products
#   gemv_layouts      4-bit one-token product layouts against a plain read of the same bytes
#   pdl_chain         a decode-like chain of kernels with plain vs programmatic edges
#   scattered_reads   8 expert-sized reads spread over allocations of 0.25-48 GB (TLB reach)
#   route_chain       the router (route_gemv and variants) in a graph with programmatic launches
#   attention_chain   decode attention (attention_decode) the same way, with parts left out
#   launch_floor      what a kernel boundary alone costs in such a graph (tiny kernels)
#   int8_decode       the decode products with 8-bit activations (dp4a) against the exact ones
# usage: bench/cuda/run.sh [NAME...]   (default: all; sm_90, or ARCH=80 ...)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
arch="${ARCH:-90}"
out="${TMPDIR:-/tmp}/sluice-cuda-bench"
mkdir -p "$out"
# sluice.cu with its programmatic-launch comments made instructions (as kernels.rs does at load).
sed 's|// sluice-pdl: ||' "$here/../../crates/sluice-cuda/kernels/sluice.cu" > "$out/sluice_pdl.cu"
for name in "${@:-decode_kernels gemv_layouts pdl_chain scattered_reads route_chain attention_chain launch_floor int8_decode}"; do
    for n in $name; do
        echo "== $n"
        nvcc -O3 -arch="sm_$arch" -w -I "$here/../../crates/sluice-cuda/kernels" -I "$out" -o "$out/$n" "$here/$n.cu"
        if [ "$n" = decode_kernels ]; then "$out/$n" 768 && "$out/$n" 512; else "$out/$n"; fi
    done
done
