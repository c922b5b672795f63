#!/usr/bin/env bash
# llama.cpp's own server tests (tools/server/tests of a llama.cpp source tree) against
# `sluice serve`, through bench/llama_server_shim.py: the API-shape files (Anthropic Messages,
# OpenAI Responses, chat completions). Many of their tests expect llama.cpp's tiny models'
# exact outputs or llama.cpp-only routes and features; the pass counts and failures are printed.
#
#   bench/llama_server_suite.sh LLAMA_CPP_DIR [pytest args...]
#
# Needs python3 with venv and PyPI (pytest, requests, openai, anthropic); builds nothing:
# run `cargo build --release -p sluice-cli` first (SLUICE_BIN, SLUICE_MODEL override).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
llama=${1:?usage: bench/llama_server_suite.sh LLAMA_CPP_DIR [pytest args...]}
shift
tests="$llama/tools/server/tests"
[ -d "$tests/unit" ] || { echo "no $tests/unit: not a llama.cpp source tree" >&2; exit 2; }
venv=${SUITE_VENV:-$here/../target/llama-server-suite-venv}
if [ ! -x "$venv/bin/pytest" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "pytest~=8.3" "requests~=2.32" "openai~=2.14.0" "filelock~=3.16" \
    "prometheus-client~=0.20" "wget~=3.2"
fi
cd "$tests"
LLAMA_SERVER_BIN_PATH="$here/llama_server_shim.py" "$venv/bin/python" -m pytest -q -p no:cacheprovider \
  -rf unit/test_compat_anthropic.py unit/test_compat_oai_responses.py unit/test_chat_completion.py "$@" \
  2>&1 | grep -E "^(FAILED|ERROR)|passed|failed"
