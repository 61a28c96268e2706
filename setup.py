"""Builds gcache._native from the C++ sources under gcache_native/ during install.

The sources sit in folders by job (store/, eviction/, core/, disk/, server/, client/,
common/, bindings/; their include layers: tests/support/layers.py); includes are spelled from gcache_native/, e.g.
`#include "store/store.h"`.

GCACHE_NATIVE_DEBUG=1 at build time builds the debug flavour: -DGCACHE_DEBUG
turns on GCACHE_ASSERT (common/assert.h) and runs Store::check_integrity after
every store operation; tests/native_debug.sh builds it apart from the release
module and runs the store and node tests against it.
"""

import glob
import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

DEBUG = os.environ.get("GCACHE_NATIVE_DEBUG", "") == "1"

optimize = ["-O1", "-g0", "-DGCACHE_DEBUG"] if DEBUG else ["-O2", "-g0"]

native = Pybind11Extension(
    "gcache._native",
    sorted(glob.glob("gcache_native/**/*.cpp", recursive=True)),
    include_dirs=["gcache_native"],
    cxx_std=17,
    extra_compile_args=optimize + ["-Wall", "-Wno-unused-function", "-pthread"],
    # libxxhash (Debian libxxhash-dev, setup.sh): XXH3 / XXH64, the value checksums.
    # libdl: dlopen / dlsym (client/cuda_copy.cpp finds the loaded CUDA libraries; part of libc
    # from glibc 2.34, a separate library before).
    libraries=["xxhash", "dl"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
