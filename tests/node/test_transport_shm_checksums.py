"""Checksum kinds over the shared-memory transport: the client writes XXH3 (hashed
while it copies), COMMIT names the kind, LOOKUP answers "cks" to a reader that asks
and xxh64 to one from before XXH3; a block that does not match its sum is never
published, whatever its kind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

import gcache
from gcache._native import xxh3, xxh64
from tests.support.raw_protocol import OK
from tests.support.raw_shm import COMMIT, LOOKUP, RESERVE, RawShm

XXH64, XXH3 = 0, 1


# Every test runs on the native client core and on the Python reference path.
pytestmark = pytest.mark.usefixtures("client_core")


@pytest.fixture
def node_and_sock(server_factory):
    path = tempfile.mkdtemp(prefix="gck")  # short: a socket path fits 107 bytes
    sock = str(Path(path) / "n.sock")
    yield server_factory(extra_args=["--unix-socket", sock]), sock
    for p in Path(path).iterdir():
        p.unlink()
    os.rmdir(path)


def lookup(raw: RawShm, keys, ck: bool):
    meta = {"keys": keys, "ck": XXH3} if ck else {"keys": keys}
    frame = raw.request(LOOKUP, meta)
    assert frame.status == OK, frame
    if frame.meta["lease"]:
        raw.release(leases=[frame.meta["lease"]])
    return frame


def test_attach_names_the_kinds_and_the_shm_client_writes_xxh3(node_and_sock):
    node, sock = node_and_sock
    client = gcache.Client(f"127.0.0.1:{node.port}", transport="shm", verify_checksums=True)
    values = [os.urandom(n) for n in (0, 100, 5000, 256 << 10, 3 << 20)]
    keys = [b"s%d" % i for i in range(len(values))]
    assert client.put_batch(keys, values) == [True] * len(values)
    assert client.get_batch(keys) == values
    with RawShm(sock) as raw:
        assert raw.attach()["cks"] == [XXH64, XXH3]
        frame = lookup(raw, keys, ck=True)
        assert frame.meta["cks"] == [XXH3] * len(values)
        assert frame.meta["sums"] == [xxh3(v) for v in values]
        legacy = lookup(raw, keys, ck=False)  # a client from before XXH3
        assert "cks" not in legacy.meta and legacy.meta["sums"] == [xxh64(v) for v in values]


def test_commit_with_xxh3_sums_readers_verify_them(node_and_sock):
    node, sock = node_and_sock
    with RawShm(sock) as raw:
        raw.attach()
        frame = raw.request(RESERVE, {"keys": [b"good", b"bad", b"swapped"], "lens": [5, 5, 5]})
        offs, res = frame.meta["offs"], frame.meta["res"]
        for off, data in zip(offs, (b"hello", b"world", b"again")):
            raw.arena[off : off + 5] = data
        sums = [xxh3(b"hello"), xxh3(b"other"), xxh64(b"again")]  # the last: the wrong kind
        answer = raw.request(COMMIT, {"res": res, "sums": sums, "ck": XXH3})
        assert answer.status == OK and answer.meta["st"] == [0, 0, 0]  # published unread: readers check
        assert raw.get([b"good", b"bad", b"swapped"]) == [b"hello", None, None]
    # And the shm client reads what a legacy COMMIT (xxh64) stored, checking its kind.
    with RawShm(sock) as raw:
        raw.attach()
        frame = raw.request(RESERVE, {"keys": [b"old"], "lens": [3]})
        off = frame.meta["offs"][0]
        raw.arena[off : off + 3] = b"old"
        assert raw.request(COMMIT, {"res": frame.meta["res"], "sums": [xxh64(b"old")]}).meta["st"] == [0]
        assert lookup(raw, [b"old"], ck=True).meta["cks"] == [XXH64]
    client = gcache.Client(f"127.0.0.1:{node.port}", transport="shm", verify_checksums=True)
    assert client.get_batch([b"old", b"good"]) == [b"old", b"hello"]


def test_copies_from_several_threads_at_once_stay_exact(node_and_sock):
    """The copy pool serves one batch at a time; batches of other threads meanwhile copy on their own thread."""
    import threading

    node, _sock = node_and_sock
    client = gcache.Client(f"127.0.0.1:{node.port}", transport="shm", verify_checksums=True)
    failures = []

    def worker(t: int) -> None:
        values = [bytes([t, i]) * (600 << 10) for i in range(6)]  # 7 MiB a batch: the pool's size
        keys = [b"mt-%d-%d" % (t, i) for i in range(6)]
        if client.put_batch(keys, values) != [True] * 6 or client.get_batch(keys) != values:
            failures.append(t)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert failures == []
