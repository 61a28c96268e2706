"""Store failures never reach SGLang as exceptions: a dead store is misses and False.

Attach-time problems (no address, unreachable store) are clear errors, raised through
SGLang's real factory. A store killed in the middle of a batch (a relay SIGKILLs the
gcache-server once part of the request has gone through) gives misses / False on
every call, and the backend recovers by itself once the server is back. SGLang's own
HiCacheStorageFailureInjector wraps the backend when its test variables are set.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from gcache.common.processes import free_port

from .relay import KillingRelay
from .sglang_support import chain, page_bytes, slots

RECOVERY_WAIT_S = 20.0


def test_attach_without_an_address_is_a_clear_error(sgl, storage_config, host_pool, monkeypatch):
    _, factory = sgl
    monkeypatch.delenv("GCACHE_URL", raising=False)
    with pytest.raises(ValueError, match="no GCache address: set extra_config\\['gcache_url'\\]"):
        factory.create_backend("dynamic", storage_config(None), host_pool())


def test_attach_to_an_unreachable_store_is_a_clear_error(sgl, storage_config, host_pool):
    _, factory = sgl
    with socket.socket() as held:  # bound, not listening: refused, and no one else can take it
        held.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(ConnectionError, match=f"cannot reach the store at {address}"):
            factory.create_backend("dynamic", storage_config(address), host_pool())


def test_the_address_can_come_from_GCACHE_URL(server, storage_config, attach, host_pool, monkeypatch):
    monkeypatch.setenv("GCACHE_URL", server.address)
    backend = attach(storage_config(None), host_pool())
    assert backend.settings.url == server.address


def test_misspelled_setting_is_a_clear_error(sgl, server, storage_config, host_pool):
    _, factory = sgl
    with pytest.raises(ValueError, match="unknown extra_config key\\(s\\) \\['gcache_timeout'\\]"):
        factory.create_backend("dynamic", storage_config(server.address, gcache_timeout=1), host_pool())


def test_store_killed_mid_batch_gives_misses_then_recovers(server_factory, storage_config, attach, host_pool, sgl):
    hicache_storage, _ = sgl
    victim = server_factory("victim")
    pool = host_pool(page_size=4, pages=16, layer_num=4, head_num=4, head_dim=64, seed=20)
    page_entry = pool.get_page_buffer_meta(pool.page_slots(0))[1][0]  # bytes of one K entry
    relay = KillingRelay(victim, kill_after=3 * page_entry)  # inside the first put frame
    try:
        # TCP: the relay is the fault; over the store's Unix socket it would be bypassed.
        backend = attach(
            storage_config(relay.address, gcache_suspect_s=0.05, gcache_skip_existing=False, gcache_transport="tcp"),
            pool,
        )
        hashes = chain(8, salt=20)
        # The put frame (8 pages, K and V) is cut after 3 entries' bytes: the server dies.
        assert backend.batch_set_v1(hashes, slots(pool, list(range(8)))) == [False] * 8
        assert relay.killed.is_set() and not victim.alive()

        # Every call on the dead store answers a miss / False, never an exception.
        untouched = [page_bytes(pool, p) for p in range(8, 16)]
        assert backend.batch_get_v1(hashes, slots(pool, list(range(8, 16)))) == [False] * 8
        assert [page_bytes(pool, p) for p in range(8, 16)] == untouched
        assert backend.batch_exists(hashes) == 0
        assert backend.exists(hashes[0]) is False
        assert backend.get(hashes[0], pool.get_dummy_flat_data_page()) is None
        assert backend.batch_set(hashes[:1], [pool.get_data_page(0)]) is False
        kv = hicache_storage.PoolTransfer(
            name=hicache_storage.PoolName.KV, keys=hashes[:2], host_indices=slots(pool, [0, 1])
        )
        assert backend.batch_get_v2([kv]) == {hicache_storage.PoolName.KV: [False, False]}
        assert backend.batch_set_v2([kv]) == {hicache_storage.PoolName.KV: [False, False]}
        assert backend.batch_exists_v2(hashes).kv_hit_pages == 0
        assert backend.counters()["store_errors"] >= 1

        # The server comes back behind the same address (the relay's; its own port is new,
        # so no other test's server can have taken it meanwhile): the backend recovers by itself.
        victim.port = free_port()
        victim.start()
        deadline = time.monotonic() + RECOVERY_WAIT_S
        result = None
        while time.monotonic() < deadline:
            result = backend.batch_set_v1(hashes, slots(pool, list(range(8))))
            if result == [True] * 8:
                break
            time.sleep(0.05)
        assert result == [True] * 8
        fresh = host_pool(page_size=4, pages=16, layer_num=4, head_num=4, head_dim=64)
        again = attach(storage_config(victim.address), fresh)
        assert again.batch_get_v1(hashes, slots(fresh, list(range(8, 16)))) == [True] * 8
        assert [page_bytes(fresh, p) for p in range(8, 16)] == [page_bytes(pool, p) for p in range(8)]
    finally:
        relay.close()


def test_hung_store_costs_a_bounded_wait_then_misses(server_factory, storage_config, attach, host_pool):
    import signal

    node = server_factory("frozen")
    pool = host_pool(seed=21)
    backend = attach(storage_config(node.address, gcache_timeout_s=0.3, gcache_retries=0, gcache_suspect_s=30), pool)
    hashes = chain(2, salt=21)
    node.proc.send_signal(signal.SIGSTOP)
    wait_stopped(node.proc.pid)
    try:
        assert backend.batch_get_v1(hashes, slots(pool, [0, 1])) == [False, False]
        assert backend.batch_exists(hashes) == 0  # suspect: answered without waiting again
        assert backend.counters()["calls_while_suspect"] == 1
    finally:
        node.proc.send_signal(signal.SIGCONT)


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until the kernel shows the process stopped (SIGSTOP is delivered asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():  # every thread, not just the main one
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s}s")


@pytest.mark.parametrize("failure_prob", ["1.0", "0.0"])
def test_sglang_failure_injector_wraps_the_backend(
    failure_prob, sgl, server, storage_config, attach, host_pool, monkeypatch
):
    hicache_storage, _ = sgl
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", failure_prob)
    pool = host_pool(seed=22)
    backend = attach(storage_config(server.address), pool)
    assert isinstance(backend, hicache_storage.HiCacheStorageFailureInjector)
    assert backend._backend.mem_pool_host is pool
    hashes = chain(3, salt=22)
    ok = failure_prob == "0.0"
    before = [page_bytes(pool, p) for p in (3, 4, 5)]
    assert backend.batch_set_v1(hashes, slots(pool, [0, 1, 2])) == [ok] * 3
    assert backend.batch_exists(hashes) == (3 if ok else 0)
    assert backend.batch_get_v1(hashes, slots(pool, [3, 4, 5])) == [ok] * 3
    expected = [page_bytes(pool, p) for p in (0, 1, 2)] if ok else before
    assert [page_bytes(pool, p) for p in (3, 4, 5)] == expected
    assert backend.get_stats() is not None  # passed through to the backend


def test_random_injected_failures_never_corrupt_a_page(sgl, server, storage_config, attach, host_pool, monkeypatch):
    """Probability 0.5: whatever each call answers, a page reported read is byte-exact."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    src = host_pool(seed=23)
    backend = attach(storage_config(server.address), src)
    hashes = chain(4, salt=23)
    blank = src.get_dummy_flat_data_page()
    for _ in range(20):
        written = backend.batch_set_v1(hashes, slots(src, [0, 1, 2, 3]))
        assert written in ([True] * 4, [False] * 4)
        for page in (4, 5, 6, 7):
            src.set_from_flat_data_page(page * src.page_size, blank)
        read = backend.batch_get_v1(hashes, slots(src, [4, 5, 6, 7]))
        assert read in ([True] * 4, [False] * 4)
        for page, got in zip((4, 5, 6, 7), read):
            expected = page_bytes(src, page - 4) if got else bytes(len(page_bytes(src, 0)))
            assert page_bytes(src, page) == expected
        assert backend.batch_exists(hashes) in (0, 4)
