#!/usr/bin/env bash
# Builds the Python the SGLang integration tests run in, and links it as ./.venv-sglang:
# torch 2.13.0 (CPU), sglang 0.5.23 without its dependencies, and the few packages
# that sglang's storage modules, gcache and pytest need.
#
# gcache itself is not installed there: commands run from the repository root
# (`.venv-sglang/bin/python -m pytest ...`) import it from the checkout, whose native
# module ./setup.sh built for the same Python, so nothing is compiled twice.
#
# Cached across checkouts (CI runs in a fresh clone): the venv lives in
# ${GCACHE_SGLANG_CACHE:-~/.cache/gcache}/venv-sglang-<pins>, and one whose stamp
# matches these pins is reused as is (seconds). Exits 0 with
# "setup-sglang: UNAVAILABLE ..." when the packages cannot be installed here; the
# tests then skip and say why.
set -uo pipefail
cd "$(dirname "$0")/../.."

TORCH_PIN="torch==2.13.0"
SGLANG_PIN="sglang==0.5.23"
# gcache's runtime dependencies (pyproject.toml) and the test runner; hicache_storage.py
# and backend_factory.py import only torch and the standard library.
EXTRA_DEPS=(numpy msgpack grpcio pysyncobj uhashring pytest pytest-timeout)
# SGLang's own `file` backend (HiCacheFile, the benchmark's baseline) imports
# sglang.srt.utils.common, which imports these at module level (triton is ~1 GB).
EXTRA_DEPS+=(orjson psutil pybase64 requests triton pillow starlette msgspec pydantic_core pyzmq)
STAMP_TEXT="$TORCH_PIN $SGLANG_PIN ${EXTRA_DEPS[*]} v2"
LINK=.venv-sglang
# sglang's own __init__ pulls in its whole serving stack; the tests never run it.
CHECK='import importlib.util, torch, gcache._native; assert importlib.util.find_spec("sglang")'

BASE_PY="$(.venv/bin/python -c 'import sys; print(sys._base_executable)' 2>/dev/null)"
if [ -z "$BASE_PY" ] || ! .venv/bin/python -c 'import gcache._native' 2>/dev/null; then
  echo "setup-sglang: .venv with the built gcache is missing: run ./setup.sh first" >&2
  exit 1
fi
PY_TAG="$("$BASE_PY" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')"
CACHE="${GCACHE_SGLANG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gcache}"
VENV="$CACHE/venv-sglang-0.5.23-torch-2.13.0-$PY_TAG"
STAMP="$VENV/.gcache-sglang-stamp"
LOG="$VENV/.gcache-sglang-install.log"
mkdir -p "$CACHE"

link() {  # ./.venv-sglang -> the cached venv (replacing an old real folder)
  [ -L "$LINK" ] || rm -rf "$LINK"
  ln -sfn "$VENV" "$LINK"
}

unavailable() {
  echo "setup-sglang: UNAVAILABLE: $*"
  mkdir -p "$VENV" && echo "$*" > "$VENV/.gcache-sglang-unavailable"
  link
  exit 0
}

# pip is noisy here (local mirror warnings, sglang's unmet optional deps): keep its
# output in a log and show the tail only when a step fails.
pip_quiet() { "$@" >>"$LOG" 2>&1 || { tail -n 20 "$LOG"; return 1; }; }

# One builder at a time per cache (a session and its CI may overlap).
exec 9>"$CACHE/.venv-sglang.lock"
flock -w 1800 9 || { echo "setup-sglang: waited 30 min for $CACHE/.venv-sglang.lock" >&2; exit 1; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] \
    && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  link
  echo "setup-sglang: $LINK -> $VENV is up to date ($TORCH_PIN, $SGLANG_PIN)"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
"$BASE_PY" -m venv "$VENV" || unavailable "cannot create a venv with $BASE_PY"
PIP=(pip_quiet "$VENV/bin/python" -m pip install --disable-pip-version-check)
# A CPU build of torch: here the local wheel cache provides 2.13.0+cpu; elsewhere set
# GCACHE_TORCH_INDEX_URL (e.g. PyTorch's CPU index) to avoid the CUDA build.
TORCH_ARGS=()
[ -n "${GCACHE_TORCH_INDEX_URL:-}" ] && TORCH_ARGS=(--index-url "$GCACHE_TORCH_INDEX_URL")
echo "setup-sglang: installing $TORCH_PIN into $VENV"
"${PIP[@]}" "${TORCH_ARGS[@]}" "$TORCH_PIN" || unavailable "pip could not install $TORCH_PIN"
echo "setup-sglang: installing $SGLANG_PIN (no dependencies) and ${EXTRA_DEPS[*]}"
"${PIP[@]}" --no-deps "$SGLANG_PIN" || unavailable "pip could not install $SGLANG_PIN"
"${PIP[@]}" "${EXTRA_DEPS[@]}" "$TORCH_PIN" || unavailable "pip could not install ${EXTRA_DEPS[*]}"
"$VENV/bin/python" -c "$CHECK" || unavailable "torch, sglang or gcache does not import in $VENV"
echo "$STAMP_TEXT" > "$STAMP"
link
echo "setup-sglang: $LINK -> $VENV ready in $(( $(date +%s) - start ))s" \
     "($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
