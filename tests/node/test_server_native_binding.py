"""gcache._native.Server, the object the daemon drives, used in-process."""

from __future__ import annotations

import os
import socket

import pytest

from gcache import _native
from tests.support.raw_protocol import STORED, RawConnection


def config(tmp_path, **extra) -> dict:
    return {"port": 0, "data_dir": str(tmp_path / "data"), "memory_bytes": 16 << 20, "disk_bytes": 64 << 20, **extra}


def test_port_zero_picks_a_free_port_and_serves(tmp_path):
    server = _native.Server(config(tmp_path))
    assert server.port > 0 and server.arena_fd >= 0 and server.arena_bytes == 16 << 20
    server.start()
    try:
        with RawConnection(server.port) as c:
            value = os.urandom(5000)
            assert c.put([(b"k", value)]) == [STORED]
            assert c.get([b"k"]) == [value]
        stats = server.stats()
        assert stats["counters"]["puts_stored"] == 1 and stats["counters"]["connections_accepted"] == 1
        assert len(stats["histograms"]["get_batch"]) == 32
        server.check_integrity()
    finally:
        server.stop(1)
        server.stop(1)  # idempotent
    server.flush()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()


def test_unknown_config_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="memory_byte"):
        _native.Server(config(tmp_path, memory_byte=1))


@pytest.mark.process
def test_taken_port_raises_bind_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(_native.BindError, match="Address already in use") as info:
            _native.Server(config(tmp_path, port=taken.getsockname()[1]))
    assert isinstance(info.value, OSError)


def test_unresolvable_host_raises_bind_error(tmp_path):
    with pytest.raises(_native.BindError, match="--host"):
        _native.Server(config(tmp_path, host="no-such-host.invalid"))
