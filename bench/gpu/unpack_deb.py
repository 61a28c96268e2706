"""Unpacks a .deb's files into a folder, as `dpkg-deb -x DEB DIR` does, where dpkg-deb is absent.

A .deb is an ar archive whose data.tar.{xz,gz,zst,bz2,} member holds the files.
Usage: python bench/gpu/unpack_deb.py DEB DIR
"""

from __future__ import annotations

import io
import sys
import tarfile


def members(data: bytes):
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not a .deb (ar) archive")
    at = 8
    while at + 60 <= len(data):
        header = data[at : at + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[at + 60 : at + 60 + size]
        at += 60 + size + (size & 1)


def unpack(deb: str, dest: str) -> None:
    with open(deb, "rb") as f:
        data = f.read()
    for name, body in members(data):
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise SystemExit(f"{deb}: {name} is zstd-compressed; Python's tarfile cannot read it (use dpkg-deb)")
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                tar.extractall(dest, filter="tar")
            return
    raise SystemExit(f"{deb}: no data.tar member")


if __name__ == "__main__":
    unpack(sys.argv[1], sys.argv[2])
