"""Issue 31, finding 3 (b): a 0-byte value is found, over TCP and shared memory alike.

A LOOKUP answers lease 0 for a 0-byte value, which docs/protocol.md used to reserve for "none
found". The answer was never ambiguous: "lens" says found (0) or missing (-1) per key, and a
lease covers only values to be copied out of the arena, which an empty value never is. The
docs now say so; this pins the contract on the wire and through gcache.Client."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

import gcache
from tests.support.raw_protocol import OK
from tests.support.raw_shm import LOOKUP, RawShm

# Every test runs on the native client core and on the Python reference path.
pytestmark = pytest.mark.usefixtures("client_core")


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="gcs")  # short: a socket path must fit 107 bytes
    yield Path(path)
    for p in Path(path).iterdir():
        p.unlink()
    os.rmdir(path)


def test_an_empty_value_is_found_and_a_missing_one_is_not(server_factory, sock_dir):
    sock = str(sock_dir / "node.sock")
    node = server_factory(extra_args=["--unix-socket", sock])
    with gcache.Client(node.address, transport="tcp") as tcp:
        assert tcp.put(b"empty-tcp", b"") is True
    with gcache.Client(node.address, transport="shm") as shm:
        assert shm.put(b"empty-shm", b"") is True  # RESERVE of 0 bytes, COMMIT
    keys = [b"empty-tcp", b"empty-shm", b"missing"]
    for transport in ("tcp", "shm"):
        with gcache.Client(node.address, transport=transport) as client:
            assert client.get(b"empty-tcp") == b"" and client.get(b"missing") is None, transport
            assert client.get_batch(keys) == [b"", b"", None], transport
            assert client.batch_get_into(keys, [bytearray(4) for _ in keys]) == [0, 0, None], transport
    with RawShm(sock) as raw:  # the wire: "lens" tells found from missing; no lease for nothing to copy
        raw.attach()
        for meta in ({"keys": keys}, {"keys": keys, "inline_max": 1024}):
            frame = raw.request(LOOKUP, meta)
            assert frame.status == OK and frame.meta["lens"] == [0, 0, -1], frame
            assert frame.meta["lease"] == 0 and frame.payload == b"", frame
