"""batch_get_scatter: values read from a same-host server's arena straight into many runs of
caller memory (what the vLLM connector's direct loads do with KV blocks). Exact bytes land in
every run; a value whose arena bytes were flipped, one of an unexpected size and a missing one
are misses that write nothing; a flipped value is reported for removal; a TCP client refuses."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

import gcache
from gcache import errors
from gcache.client.scatter import ScatterRuns
from tests.support.raw_shm import LOOKUP, RawShm

RUNS = 8  # runs per value
VALUE = 64 << 10


@pytest.fixture
def node_and_sock(server_factory):
    path = tempfile.mkdtemp(prefix="gcs")  # short: a socket path fits 107 bytes
    sock = str(Path(path) / "n.sock")
    yield server_factory(extra_args=["--unix-socket", sock]), sock
    for p in Path(path).iterdir():
        p.unlink()
    os.rmdir(path)


def runs_into(out: np.ndarray, values: int, sizes: list[int], order: np.ndarray) -> ScatterRuns:
    """Value i's run k goes to row order[i * RUNS + k] of `out` ([values * RUNS, VALUE // RUNS])."""
    run = VALUE // RUNS
    first = np.arange(0, values * RUNS + 1, RUNS, dtype=np.uint64)
    dst = (out.ctypes.data + order.astype(np.uint64) * run).astype(np.uint64)
    at = np.tile(np.arange(RUNS, dtype=np.uint64) * run, values)
    return ScatterRuns(sizes, first, dst, at, np.full(values * RUNS, run, dtype=np.uint64))


def flip(sock: str, key: bytes, at: int = 100) -> None:
    with RawShm(sock) as raw:
        raw.attach()
        frame = raw.request(LOOKUP, {"keys": [key]})
        raw.arena[frame.meta["offs"][0] + at] ^= 0xFF
        raw.release(leases=[frame.meta["lease"]], no_reply=False)


def test_scatter_lands_exact_bytes_and_bad_values_write_nothing(node_and_sock):
    node, sock = node_and_sock
    rng = np.random.default_rng(1)
    values = [rng.integers(0, 256, VALUE, dtype=np.uint8).tobytes() for _ in range(6)]
    keys = [b"v%d" % i for i in range(len(values))]
    client = gcache.Client(f"127.0.0.1:{node.port}", transport="shm")
    assert client.can_scatter
    assert client.put_batch(keys[:5], values[:5]) == [True] * 5  # v5 is never stored
    flip(sock, keys[2])
    order = rng.permutation(len(values) * RUNS)
    out = np.full((len(values) * RUNS, VALUE // RUNS), 7, dtype=np.uint8)
    sizes = [VALUE] * 6
    sizes[3] = VALUE - 1  # the caller expects another size: a miss
    with pytest.raises(errors.ChecksumMismatchError) as caught:
        client.batch_get_scatter(keys, runs_into(out, 6, sizes, order))
    assert caught.value.results == [VALUE, VALUE, None, None, VALUE, None]
    for i, value in enumerate(values):
        rows = out[order[i * RUNS : (i + 1) * RUNS]]
        expect = np.frombuffer(value, dtype=np.uint8).reshape(RUNS, -1) if i in (0, 1, 4) else np.full_like(rows, 7)
        assert np.array_equal(rows, expect), f"value {i}"
    # The flipped value was reported in the RELEASE: the node checked it and removed it.
    assert client.batch_is_exist([keys[2]]) == [False]
    client.close()


def test_a_tcp_client_cannot_scatter(node_and_sock):
    node, _ = node_and_sock
    client = gcache.Client(f"127.0.0.1:{node.port}", transport="tcp")
    assert not client.can_scatter
    out = np.zeros((RUNS, VALUE // RUNS), dtype=np.uint8)
    with pytest.raises(errors.TransportUnavailableError):
        client.batch_get_scatter([b"k"], runs_into(out, 1, [VALUE], np.arange(RUNS)))
    client.close()


def test_runs_that_do_not_match_the_keys_are_refused(node_and_sock):
    node, _ = node_and_sock
    client = gcache.Client(f"127.0.0.1:{node.port}", transport="shm")
    out = np.zeros((RUNS, VALUE // RUNS), dtype=np.uint8)
    with pytest.raises(errors.InvalidArgumentError):
        client.batch_get_scatter([b"a", b"b"], runs_into(out, 1, [VALUE], np.arange(RUNS)))
    client.close()
