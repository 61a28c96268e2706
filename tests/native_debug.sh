#!/usr/bin/env bash
# The native core's debug job: builds gcache._native with GCACHE_NATIVE_DEBUG=1
# (-DGCACHE_DEBUG: GCACHE_ASSERT on, Store::check_integrity after every store
# operation) into build/native-debug, apart from the release module in gcache/
# (left untouched), lays a copy of the package with the debug module in
# build/debug-tree, and runs the store and node tests there (store, disk,
# eviction, server, protocol and shm test files, the native client core's; or the pytest arguments given).
# Exits non-zero when the build or a test fails.
#
#   bash tests/native_debug.sh                      # the default test files
#   bash tests/native_debug.sh tests/node/test_store_disk.py -k reclaim
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
py="${PYTHON:-$repo/.venv/bin/python}"
out=$repo/build/native-debug
tree=$repo/build/debug-tree

# The build needs pybind11 (the release build gets it in pip's isolated build env).
mkdir -p "$out"
pylib=""
if ! "$py" -c "import pybind11" 2>/dev/null; then
  pylib=$out/pylib
  "$py" -c "import sys; sys.path.insert(0, '$pylib'); import pybind11" 2>/dev/null \
    || "$py" -m pip install -q --target "$pylib" "pybind11>=2.12"
fi

echo "native_debug: building the debug module into build/native-debug (a few minutes)"
GCACHE_NATIVE_DEBUG=1 PYTHONPATH="$pylib" "$py" setup.py -q build_ext \
  --build-lib "$out/lib" --build-temp "$out/temp" >"$out.log" 2>&1 \
  || { tail -50 "$out.log"; echo "native_debug: build failed (log: build/native-debug.log)"; exit 1; }
so=$(ls "$out"/lib/gcache/_native*.so)

# The package and tests, with the debug module in place of the release one.
# Tests run from inside the tree, so `python -m gcache...` subprocesses (the
# servers the tests start) import it too.
rm -rf "$tree"
mkdir -p "$tree"
cp -r gcache tests pyproject.toml "$tree/"
find "$tree" -name __pycache__ -type d -prune -exec rm -rf {} +
rm -f "$tree"/gcache/_native*.so
cp "$so" "$tree/gcache/"

cd "$tree"
export PYTHONPATH=$tree
"$py" -c "
import gcache._native as n, sys
if not n.DEBUG or not n.__file__.startswith('$tree/'):
    sys.exit('native_debug: not the debug module: ' + n.__file__)
print('native_debug: testing', n.__file__)
"
if [ "$#" -gt 0 ]; then
  args=("$@")
else
  mapfile -t args < <(find tests -name 'test_store_*.py' -o -name 'test_eviction_*.py' -o -name 'test_server_*.py' \
    -o -name 'test_protocol_*.py' -o -name 'test_transport_shm.py' -o -name 'test_native_core.py' | sort)
fi
"$py" -m pytest -q -p no:cacheprovider "${args[@]}"
