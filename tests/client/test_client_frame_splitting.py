"""A GET whose found values exceed the server's frame payload limit is split by the
client on LIMIT_EXCEEDED and retried on the same connection, unseen by the caller."""

from __future__ import annotations

import random

import pytest

from gcache import Client, errors

# Every test runs on the native client core and on the Python reference path.
pytestmark = pytest.mark.usefixtures("client_core")


KIB = 1 << 10
FRAME_LIMIT = 256 * KIB
SMALL_FRAMES = ["--frame-payload-bytes-max", "256KiB", "--value-bytes-max", "64KiB"]


def values(count: int, size: int = 60 * KIB) -> dict[bytes, bytes]:
    rng = random.Random(count)
    return {b"v%d" % i: rng.randbytes(size) for i in range(count)}


def limit_errors(client: Client) -> int:
    return client.stats()["counters"]["errors_limit_exceeded"]


def test_get_batch_over_the_frame_limit_is_split_transparently(server_factory):
    node = server_factory(extra_args=SMALL_FRAMES)
    items = values(40)  # 2.3 MiB found in one GET frame: 9x the server's frame limit
    with Client(node.address, frame_payload_bytes_max=FRAME_LIMIT, verify_checksums=True) as c:
        assert c.put_batch(list(items), list(items.values())) == [True] * 40
        keys = [b"missing-first", *items, b"missing-last"]
        before = limit_errors(c)
        assert c.get_batch(keys) == [None, *items.values(), None]
        assert limit_errors(c) > before  # the split path really ran
        assert c.get(b"v7") == items[b"v7"]
        assert c.ping()["epoch"] == 0  # the connection stayed usable


def test_pipelined_get_frames_each_split(server_factory):
    node = server_factory(extra_args=SMALL_FRAMES)
    items = values(64)
    with Client(
        node.address, frame_payload_bytes_max=FRAME_LIMIT, batch_keys_max=16, pipeline_depth=4, pool_size=1
    ) as c:
        assert c.put_batch(list(items), list(items.values())) == [True] * 64
        before = limit_errors(c)
        keys = list(items)
        random.Random(3).shuffle(keys)
        assert c.get_batch(keys) == [items[k] for k in keys]  # 4 frames of 16 keys, ~1 MiB each
        assert limit_errors(c) - before >= 4
        assert c.batch_is_exist(keys) == [True] * 64


def test_one_value_over_the_frame_limit_raises_a_clear_error(server_factory):
    node = server_factory("shrunk")
    big = random.Random(1).randbytes(300 * KIB)
    with Client(node.address) as c:
        assert c.put(b"big", big) and c.put(b"small", b"s")
    assert node.stop() == 0
    node = server_factory("shrunk", extra_args=SMALL_FRAMES)  # same data dir, smaller limits
    # Over TCP the value must travel in one frame; one-sided transports (shm) serve it.
    with Client(node.address, transport="tcp") as c:
        with pytest.raises(errors.LimitExceededError, match="frame-payload-bytes-max"):
            c.get_batch([b"small", b"big"])
        assert c.get(b"small") == b"s"  # the split half with the small value still works
