#!/usr/bin/env bash
# Installs everything GCache needs into ./.venv, from nothing:
# redis-server (for the side-by-side bench and its tests), the Python package
# with its native core compiled by its own build, and the test/bench/docs extras
# (docs: mkdocs + its Material theme, for the docs site's strict build in .ci/run).

set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3}"

# Debian packages: redis-server (the side-by-side bench and its tests);
# libibverbs1 + libnuma1 (what the Mooncake wheel links against); openssl (the
# throwaway CA of the TLS tests and `gcache-cluster up --tls`); python3-pyverbs
# (rdma-core's verbs bindings: the RDMA transport, where a device exists);
# clang-format (the C++ style check, gcache_native/format_check.sh);
# libxxhash-dev (XXH3 / XXH64, the value checksums the native core links).
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v openssl >/dev/null 2>&1 || missing+=(openssl)
command -v clang-format >/dev/null 2>&1 || missing+=(clang-format)
for pkg in libibverbs1 libnuma1 python3-pyverbs libxxhash-dev; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]} (Debian packages)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PYTHON" -m venv .venv
fi
# setuptools>=77 in the venv too: tests/native_debug.sh builds without isolation, and
# pyproject's SPDX `license` string needs it
.venv/bin/python -m pip install -q --upgrade pip "setuptools>=77"
echo "setup: building and installing gcache (compiles gcache_native/, about a minute)"
.venv/bin/python -m pip install -q -e ".[test,bench,docs]"

# pyverbs comes from the distribution (the pip package needs rdma-core's build
# tree); it is importable from the venv when both are the same Python version.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
tag=$(.venv/bin/python -c 'import sys; print(f"cpython-{sys.version_info[0]}{sys.version_info[1]}")')
if ls /usr/lib/python3/dist-packages/pyverbs/ 2>/dev/null | grep -q "$tag"; then
  ln -sfn /usr/lib/python3/dist-packages/pyverbs "$site/pyverbs"
else
  echo "setup: pyverbs for this Python not found; the RDMA transport will say so (tcp and shm work)"
fi

# Mooncake Store is only a peer for `gcache-bench --vs mooncake`; its wheel
# may not install on every machine, and nothing else needs it.
if [ "${GCACHE_SKIP_MOONCAKE:-0}" != "1" ]; then
  .venv/bin/python -m pip install -q mooncake-transfer-engine-non-cuda >/dev/null 2>&1 \
    && echo "setup: mooncake-transfer-engine-non-cuda installed (for --vs mooncake)" \
    || echo "setup: mooncake wheel not installable here; gcache-bench --vs mooncake will say so"
fi
echo "setup: done"
