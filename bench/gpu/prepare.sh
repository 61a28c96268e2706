#!/usr/bin/env bash
# Prepares the GPU check for a bare, offline GPU machine (run HERE, with network):
#
#   bash bench/gpu/prepare.sh [--python-version 3.12] [--dest .gpu-carry] [--with-image-packages]
#
# Downloads into DEST (ignored by git; carry it with the tree to the GPU machine):
#   wheels/  what the native build needs and such a machine may lack or have too old: setuptools>=77
#            (pyproject's SPDX license string) and pybind11>=2.12, for CPython X.Y on x86-64 Linux;
#   debs/    the xxHash library (libxxhash0 + libxxhash-dev, this machine's Debian/Ubuntu packages):
#            the native core's value checksums; unpacked there with dpkg-deb -x, never installed;
#   MANIFEST the target Python version and every file with its size.
# gcache itself needs at run time numpy, msgpack and grpcio (the server's admin API), which the
# GPU image's Python has; --with-image-packages downloads them (and their dependencies) too, for
# a Python that has nothing (the clean-environment test here does that).
# Then on the GPU machine: bash bench/gpu/gpu_check.sh OUT_DIR   (see that script).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY_VERSION=3.12
DEST=.gpu-carry
IMAGE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PY_VERSION=$2; shift 2 ;;
    --dest) DEST=$2; shift 2 ;;
    --with-image-packages) IMAGE=1; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "prepare: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$PY_VERSION" in
  3.[0-9]|3.[0-9][0-9]) ;;
  *) echo "prepare: --python-version takes X.Y (e.g. 3.12), got $PY_VERSION" >&2; exit 2 ;;
esac

# A Python with pip to download with (the wheels are for PY_VERSION whatever this one is).
if [ -n "${PYTHON:-}" ]; then PIP_PY=$PYTHON
elif [ -x .venv/bin/python ]; then PIP_PY=.venv/bin/python
else PIP_PY=python3; fi

BUILD_PKGS=("setuptools>=77" "pybind11>=2.12")
IMAGE_PKGS=("numpy>=1.24" "msgpack>=1.0" "grpcio>=1.60")
pkgs=("${BUILD_PKGS[@]}")
[ "$IMAGE" = 1 ] && pkgs+=("${IMAGE_PKGS[@]}")

rm -rf "$DEST/wheels" "$DEST/debs"  # one version of each: two would stop the install there
mkdir -p "$DEST/wheels" "$DEST/debs"
echo "prepare: wheels for CPython $PY_VERSION (x86-64 Linux): ${pkgs[*]}"
"$PIP_PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version "$PY_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST/wheels" "${pkgs[@]}"

echo "prepare: the xxHash library's .deb files"
debs=(libxxhash0 libxxhash-dev)
download() { (cd "$DEST/debs" && apt-get download -o APT::Sandbox::User=root "${debs[@]}"); }
if ! download >/dev/null 2>&1; then
  echo "prepare: apt-get download failed; updating the package lists once and trying again"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  download >/dev/null
fi

{
  echo "python-version $PY_VERSION"
  echo "prepared $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$ID $VERSION_ID") $(uname -m)"
  (cd "$DEST" && find wheels debs -type f -printf '%s %p\n' | sort -k2)
} > "$DEST/MANIFEST"
echo "prepare: $(du -sh "$DEST" | cut -f1) in $DEST ($(find "$DEST/wheels" "$DEST/debs" -type f | wc -l) files):"
sed -n '3,$p' "$DEST/MANIFEST" | sed 's/^/  /'
echo "prepare: on the GPU machine, with $DEST carried: bash bench/gpu/gpu_check.sh OUT_DIR"
