#!/usr/bin/env bash
# GPU check of device-memory gets and puts (bench/store/gpu_check.py says what it checks).
# Run on a machine with an NVIDIA GPU:  bash bench/store/gpu_check.sh [gpu_check.py options]
# The whole script stays under 4 minutes: setup and the cupy install share what is
# left after 60 s kept for the check itself (which takes well under that).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
BUDGET_S=230
CHECK_S=60
left_for_setup() { echo $((BUDGET_S - CHECK_S - SECONDS)); }

if [ ! -x "$PY" ]; then
  echo "gpu_check: no .venv: running ./setup.sh (compiles the native core)"
  GCACHE_SKIP_MOONCAKE=1 timeout "$(left_for_setup)" ./setup.sh
fi

if ! "$PY" -c "import cupy" >/dev/null 2>&1; then
  # The cupy wheel needs a CUDA 12 runtime: the system's when there is one, else the
  # toolkit wheels from PyPI ([ctk], larger).
  if ls /usr/local/cuda*/lib64/libcudart.so.12* >/dev/null 2>&1 \
      || ldconfig -p 2>/dev/null | grep -q 'libcudart.so.12'; then
    pkg="cupy-cuda12x"
  else
    pkg="cupy-cuda12x[ctk]"
  fi
  echo "gpu_check: installing $pkg into .venv (pip)"
  if ! timeout "$(left_for_setup)" "$PY" -m pip install -q "$pkg"; then
    echo "gpu_check: cannot run here: pip could not install $pkg in time (no network, or no wheel here)" >&2
    exit 2
  fi
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi
exec timeout "$CHECK_S" "$PY" -m bench.store.gpu_check "$@"
