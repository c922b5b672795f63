#!/usr/bin/env bash
# Fuzzes every parser of outside data (the targets of fuzz/, see fuzz/src/lib.rs): builds them
# with cargo-fuzz (libFuzzer, AddressSanitizer) and runs each for --seconds, from the seeds that
# fuzz/seeds.py writes plus whatever earlier runs found (fuzz/corpus/TARGET, not committed).
#
#   scripts/fuzz.sh                         # every target, 30 s each
#   scripts/fuzz.sh --seconds 3600 gguf     # one target for an hour
#   scripts/fuzz.sh --fork 4 --seconds 600  # 4 worker processes per target, going on past
#                                           # crashes (each one is kept), for long runs
#   scripts/fuzz.sh --build-only            # build, run nothing (e.g. to carry the binaries)
#
# The binaries run on another machine too: copy fuzz/target/x86_64-unknown-linux-gnu/release/T
# and the corpus, and set SLUICE_REPO to a folder holding the fixtures they read
# (tests/fixtures/qwen3_5_moe-q4, crates/sluice-engine/tests/data/tiktoken, models/demo).
#
# Prints one line per target: executions, executions per second, coverage and corpus size.
# A crash, a timeout or an out-of-memory stops that target, keeps its input in
# fuzz/artifacts/TARGET/ and makes the script exit 1 (replay: `cargo fuzz run TARGET FILE`).
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`); it builds on the stable toolchain with
# RUSTC_BOOTSTRAP=1, since cargo-fuzz's sanitizer flags are otherwise nightly-only.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=30
build_only=0
fork=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --fork) fork="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done

command -v cargo-fuzz >/dev/null || {
  echo "error: cargo-fuzz is not installed: cargo install cargo-fuzz --locked" >&2
  exit 2
}
export RUSTC_BOOTSTRAP=1 RUSTUP_TOOLCHAIN="${RUSTUP_TOOLCHAIN:-stable}"
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo fuzz list)

python3 fuzz/seeds.py
cargo fuzz build -O
[ "$build_only" = 1 ] && exit 0

bin=fuzz/target/x86_64-unknown-linux-gnu/release
failed=0
printf '| target | seconds | executions | exec/s | coverage (cov / ft) | corpus | result |\n|---|---|---|---|---|---|---|\n'
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  log="fuzz/artifacts/$t/last-run.log"
  found_before=$(ls "fuzz/artifacts/$t" | grep -cE '^(crash|timeout|oom|leak)-' || true)
  mode=()
  [ "$fork" -gt 0 ] && mode=(-fork="$fork" -ignore_crashes=1 -ignore_timeouts=1 -ignore_ooms=1)
  set +e
  RAYON_NUM_THREADS=1 "$bin/$t" "fuzz/corpus/$t" -artifact_prefix="fuzz/artifacts/$t/" \
    -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 -print_final_stats=1 \
    -close_fd_mask=1 "${mode[@]}" >"$log" 2>&1
  rc=$?
  set -e
  found=$(( $(ls "fuzz/artifacts/$t" | grep -cE '^(crash|timeout|oom|leak)-' || true) - found_before ))
  if [ "$fork" -gt 0 ]; then
    # Fork mode prints no final stats: the last status line has the executions of all workers.
    execs=$(grep -oE '^#[0-9]+: cov' "$log" | tail -1 | grep -oE '[0-9]+' || echo 0)
    rate=$(grep -oE 'exec/s: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || echo 0)
  else
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
    rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  fi
  cov=$(grep -oE 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1 | sed 's/cov: //; s/ ft: / \/ /')
  corpus=$(ls "fuzz/corpus/$t" | wc -l)
  if [ "$rc" = 0 ] && [ "$found" = 0 ]; then
    result=ok
  else
    result="FAILED (exit $rc, $found new inputs kept in fuzz/artifacts/$t; see $log)"
    failed=1
  fi
  printf '| %s | %s | %s | %s | %s | %s | %s |\n' "$t" "$seconds" "$execs" "$rate" "${cov:--}" "$corpus" "$result"
  if [ "$rc" != 0 ]; then
    grep -E 'panicked|ERROR: |SUMMARY|Test unit written' "$log" | head -8 >&2 || true
  fi
done
exit "$failed"
