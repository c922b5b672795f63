#!/usr/bin/env bash
# The browser test of `sluice serve`'s web page (test.mjs): starts the server on the bundled demo
# model (its experts streaming through a small cache) with an API key, drives the page in
# headless Chromium through playwright-core (pinned in package-lock.json), stops the server.
#
#   tests/browser/run.sh [--require] [--screenshots DIR] [--sluice PATH]
#
# --require (CI): install what is missing (Debian's chromium, node) and fail if anything keeps
# the test from running. Without it a missing Chromium or node is reported as NOT RUN.
# --sluice: the binary to test (default: target/release/sluice, built if missing).
set -euo pipefail
cd "$(dirname "$0")/../.."

require=0
shots=()
sluice=""
while [ $# -gt 0 ]; do
  case "$1" in
    --require) require=1 ;;
    --screenshots) shots=(--screenshots "$(realpath -m "$2")"); shift ;;
    --sluice) sluice="$2"; shift ;;
    *) echo "usage: $0 [--require] [--screenshots DIR] [--sluice PATH]" >&2; exit 2 ;;
  esac
  shift
done

not_run() {
  if [ "$require" = 1 ]; then
    echo "error: the browser test cannot run: $1" >&2
    exit 1
  fi
  echo "browser test NOT RUN: $1 (tests/browser/run.sh --require installs what it can)" >&2
  exit 0
}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  command -v apt-get >/dev/null || return 1
  as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

chromium=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$chromium" ] && [ "$require" = 1 ]; then
  echo "== installing chromium (apt)"
  apt_install chromium || true
  chromium=$(command -v chromium || true)
fi
[ -n "$chromium" ] || not_run "no Chromium (apt-get install chromium)"
if ! command -v npm >/dev/null && [ "$require" = 1 ]; then
  echo "== installing node (apt)"
  apt_install nodejs npm || true
fi
command -v npm >/dev/null || not_run "no node/npm"
"$chromium" --version

echo "== playwright-core (npm ci)"
(cd tests/browser && npm ci --no-audit --no-fund --loglevel=error)

if [ -z "$sluice" ]; then
  sluice=${CARGO_TARGET_DIR:-target}/release/sluice
  echo "== cargo build --release -p sluice-cli"
  cargo build --release --locked -p sluice-cli
fi

log=$(mktemp)
key="browser-test-key"
# The bundled demo model (not $SLUICE_MODEL), so that its experts stream through the default cache.
env -u SLUICE_MODEL "$sluice" serve --port 0 --api-key "$key" 2>"$log" &
server=$!
trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; rm -f "$log"' EXIT
base=""
for _ in $(seq 600); do
  base=$(sed -n 's|.*web page: \(http://[^ ]*\)/ .*|\1|p' "$log" | head -n1)
  [ -n "$base" ] && break
  kill -0 "$server" 2>/dev/null || { cat "$log" >&2; echo "error: sluice serve exited" >&2; exit 1; }
  sleep 0.1
done
[ -n "$base" ] || { cat "$log" >&2; echo "error: sluice serve did not start" >&2; exit 1; }
echo "== browser test against $base"
if ! node tests/browser/test.mjs --base "$base" --api-key "$key" --chromium "$chromium" "${shots[@]}"; then
  echo "--- sluice serve's log" >&2
  cat "$log" >&2
  exit 1
fi
