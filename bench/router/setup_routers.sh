#!/usr/bin/env bash
# Builds the other routers bench/router/vllm_trace.py puts beside gcache-router, each in a venv
# of its own (their Rust binaries and Python deps must not meet gcache's or vLLM's):
#
#   sglang-router==0.3.2   ${GCACHE_ROUTER_CACHE:-~/.cache/gcache}/venv-sglang-router
#   vllm-router==0.1.17    ${GCACHE_ROUTER_CACHE:-~/.cache/gcache}/venv-vllm-router
#
# Cached: a venv whose stamp matches its pin is reused as is (seconds). A router that cannot be
# installed here is reported ("setup-routers: UNAVAILABLE <name>: <reason>", the reason also in
# <venv>/.unavailable) and the script goes on: the bench skips that arm and prints why.
# Exit status 0 unless the base Python is missing.
set -uo pipefail
cd "$(dirname "$0")/../.."

CACHE="${GCACHE_ROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gcache}"
MAIN_PY="${GCACHE_MAIN_PYTHON:-.venv/bin/python}"
BASE_PY="$("$MAIN_PY" -c 'import sys; print(sys._base_executable)' 2>/dev/null || command -v python3)"
if [ -z "$BASE_PY" ]; then
  echo "setup-routers: no base Python (run ./setup.sh first)" >&2
  exit 1
fi
mkdir -p "$CACHE"

build() {  # name pin check-command
  local name="$1" pin="$2" check="$3"
  local venv="$CACHE/venv-$name" stamp="$CACHE/venv-$name/.gcache-stamp"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$pin" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "setup-routers: $name cached ($pin) in $venv"
    return 0
  fi
  rm -rf "$venv"
  if ! "$BASE_PY" -m venv "$venv" >/dev/null 2>&1; then
    echo "setup-routers: UNAVAILABLE $name: python -m venv failed"
    return 0
  fi
  if ! "$venv/bin/python" -m pip install -q "$pin" >"$venv/.install.log" 2>&1; then
    tail -3 "$venv/.install.log" >"$venv/.unavailable"
    echo "setup-routers: UNAVAILABLE $name: pip install $pin failed: $(tail -1 "$venv/.install.log")"
    return 0
  fi
  if ! "$venv/bin/python" -c "$check" >"$venv/.check.log" 2>&1; then
    tail -3 "$venv/.check.log" >"$venv/.unavailable"
    echo "setup-routers: UNAVAILABLE $name: installed but does not import: $(tail -1 "$venv/.check.log")"
    return 0
  fi
  echo "$pin" >"$stamp"
  rm -f "$venv/.unavailable"
  echo "setup-routers: $name ready ($pin) in $venv"
}

build sglang-router "sglang-router==0.3.2" "import sglang_router"
build vllm-router "vllm-router==0.1.17" "import vllm_router"
