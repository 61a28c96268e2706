"""Builds gcache._native from the C++ sources under gcache_native/ during install.

The sources sit in folders by job (store/, eviction/, disk/, server/, client/,
common/, bindings/); includes are spelled from gcache_native/, e.g.
`#include "store/store.h"`.
"""
import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "gcache._native",
    sorted(glob.glob("gcache_native/**/*.cpp", recursive=True)),
    include_dirs=["gcache_native"],
    cxx_std=17,
    extra_compile_args=["-O2", "-g0", "-Wall", "-Wno-unused-function", "-pthread"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
