"""The shared-memory arena mapping under close(): issue 21, finding 10 (the stress test
with real restarts is tests/cluster/test_shm_restart_stress.py)."""

from __future__ import annotations

import os

import pytest

from gcache import errors
from gcache.client.transports.shm import MappedArena

# Every test runs on the native client core and on the Python reference path.
pytestmark = pytest.mark.usefixtures("client_core")


def test_arena_closed_mid_copy_unmaps_after_the_copy_and_refuses_new_copies():
    """The mapping outlives close() while a copy holds it; a copy after close() is ClientClosedError."""
    fd = os.memfd_create("gcache-test-arena")
    try:
        os.ftruncate(fd, 1 << 16)
        arena = MappedArena(fd, 1 << 16, "instance-a", lease_s=1.0)
    finally:
        os.close(fd)
    arena.write_from([0], [b"abc"])
    with arena._use() as mapping:
        arena.close()
        assert not mapping.closed and mapping[:3] == b"abc"  # still mapped for the copy in flight
    assert arena.map.closed
    with pytest.raises(errors.ClientClosedError):
        arena.read_into([0], [3], [0], [bytearray(3)], False)
    with pytest.raises(errors.ClientClosedError):
        arena.write_from([0], [b"abc"])
