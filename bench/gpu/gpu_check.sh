#!/usr/bin/env bash
# The GPU check, on a bare and offline GPU machine (Python 3.12 with torch and cupy, no vLLM, no
# apt, no package index), from the files bench/gpu/prepare.sh put in .gpu-carry/ here:
#
#   bash bench/gpu/gpu_check.sh OUT_DIR [--dry-run] [check.py options]
#
# 1. unpacks the carried xxHash .debs (dpkg-deb -x) into build/gpu/prefix, never into /;
# 2. installs the carried wheels (pip --no-index, nothing but the carried files) into
#    build/gpu/site, a folder on PYTHONPATH in front of the machine's own packages: a venv made
#    from the machine's python3 (itself a venv, /opt/torch/.venv) would not see its torch and cupy;
# 3. builds the native core in place against the unpacked xxHash (CPATH, LIBRARY_PATH, an rpath);
# 4. runs bench/gpu/check.py, which starts a gcache-server and checks (its docstring says what),
#    printing as it goes and writing OUT_DIR/gpu_check.json; this script's output goes to
#    OUT_DIR/gpu_check.log too. The whole script stays under 8 minutes.
# --dry-run runs all of it but the CUDA calls, on CPU tensors, here as well as there.
# Environment: GCACHE_GPU_PYTHON (default python3), GCACHE_GPU_CARRY (default .gpu-carry),
# GCACHE_GPU_WORK (default build/gpu), GCACHE_GPU_BUDGET_S (default 470). Exit status: check.py's
# (0 all hold, 1 a check failed, 2 cannot run here, 3 --strict and a throughput target missed);
# 4 the preparation failed.
set -euo pipefail
START=$SECONDS
BUDGET_S=${GCACHE_GPU_BUDGET_S:-470}  # 8 minutes, less a margin (a slow dry run may give more)
CHECK_MIN_S=120  # the check always gets this long, even when the build ate the budget
cd "$(dirname "$0")/../.."
REPO=$PWD

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
  sed -n '2,19p' "$0"; exit 2
fi
OUT=$1; shift
DRY=()
for a in "$@"; do [ "$a" = "--dry-run" ] && DRY=(--dry-run); done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/gpu_check.log") 2>&1

PY=${GCACHE_GPU_PYTHON:-python3}
CARRY=$(realpath -m "${GCACHE_GPU_CARRY:-.gpu-carry}")
WORK=$(realpath -m "${GCACHE_GPU_WORK:-build/gpu}")
fail() { echo "gpu_check: $*" >&2; exit 4; }
step() { echo "gpu_check: [$((SECONDS - START)) s] $*"; }

step "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
[ -f "$CARRY/MANIFEST" ] || fail "no $CARRY/MANIFEST: run 'bash bench/gpu/prepare.sh' where there is network, and carry .gpu-carry with the tree"
want=$(awk '/^python-version/ {print $2}' "$CARRY/MANIFEST")
have=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
if [ "$want" != "$have" ]; then
  msg="the carried files are for Python $want, this python is $have (bash bench/gpu/prepare.sh --python-version $have)"
  [ ${#DRY[@]} -eq 0 ] && fail "$msg"
  echo "gpu_check: $msg; the dry run goes on (pip says if a carried wheel does not fit)"
fi
for tool in g++ "$PY"; do command -v "$tool" >/dev/null || fail "$tool is not here (the native build needs a C++ compiler)"; done
"$PY" -c 'import os, sysconfig; p = os.path.join(sysconfig.get_paths()["include"], "Python.h"); assert os.path.exists(p), p' \
  || fail "this python has no C headers (Python.h), which the native build needs"

# 1. the xxHash library, unpacked
PREFIX=$WORK/prefix
rm -rf "$PREFIX"; mkdir -p "$PREFIX"
for deb in "$CARRY"/debs/*.deb; do
  if command -v dpkg-deb >/dev/null; then dpkg-deb -x "$deb" "$PREFIX"
  else "$PY" "$REPO/bench/gpu/unpack_deb.py" "$deb" "$PREFIX"; fi
done
LIBDIR=$(dirname "$(find "$PREFIX" -name 'libxxhash.so*' | sort | head -1)")
[ -f "$PREFIX/usr/include/xxhash.h" ] && [ -d "$LIBDIR" ] || fail "the carried .debs hold no xxhash.h / libxxhash.so"
step "xxHash unpacked: $PREFIX/usr/include/xxhash.h, $LIBDIR"

# 2. the carried wheels, nothing else
SITE=$WORK/site
rm -rf "$SITE"
env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
  "$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$CARRY/wheels" \
  --target "$SITE" "$CARRY"/wheels/*.whl || fail "pip could not install the carried wheels"
step "installed into $SITE: $(cd "$SITE" && ls -d *.dist-info | sed 's/.dist-info//' | tr '\n' ' ')"
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"

# 3. the native core, against the unpacked xxHash
step "building the native core (gcache_native/, in place)"
CPATH="$PREFIX/usr/include${CPATH:+:$CPATH}" LIBRARY_PATH="$LIBDIR${LIBRARY_PATH:+:$LIBRARY_PATH}" \
  LDFLAGS="${LDFLAGS:-} -Wl,-rpath,$LIBDIR" \
  "$PY" setup.py -q build_ext --inplace -j "$(nproc)" --build-temp "$WORK/temp-$have" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; fail "the native build failed (log: $WORK/build.log)"; }
module=$("$PY" -c 'import gcache._native as n; print(n.__file__)') || fail "gcache._native does not import"
step "native core: $module; libxxhash: $(ldd "$module" | awk '/libxxhash/ {print $3}')"

if [ ${#DRY[@]} -eq 0 ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
fi

# 4. the check, in what is left of the 8 minutes
left=$((BUDGET_S - (SECONDS - START)))
if [ "$left" -lt "$CHECK_MIN_S" ]; then
  step "the preparation took past the budget of $BUDGET_S s; the check still gets $CHECK_MIN_S s"
  left=$CHECK_MIN_S
fi
step "running bench/gpu/check.py ($left s left)"
set +e
PYTHONUNBUFFERED=1 timeout "$left" "$PY" -m bench.gpu.check --out "$OUT" --deadline-s "$((left - 30))" "$@"
rc=$?
set -e
[ $rc -eq 124 ] && echo "gpu_check: the check ran past the 8 minutes; $OUT/gpu_check.json holds the sections that ran"
step "done (exit $rc); report: $OUT/gpu_check.json, log: $OUT/gpu_check.log"
exit $rc
