"""The client under failure and concurrency: dead, hung and restarted servers, many threads."""

import os
import signal
import threading
import time

import pytest

from gcache import Client, errors
from tests.support.servers import ServerProcess
from tests.support.slots import busy_connection

# Every test runs on the native client core and on the Python reference path.
pytestmark = pytest.mark.usefixtures("client_core")


def test_killed_server_gives_connection_error(server):
    client = Client(server.address, timeout_s=2, retries=2)
    assert client.put(b"k", b"v")
    server.kill()
    with pytest.raises(errors.ConnectionError, match=server.address):
        client.get(b"k")
    with pytest.raises(errors.ConnectionError, match="refused"):
        client.get(b"k")  # the pool holds nothing stale: a fresh connect is refused
    client.close()


def wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP is asynchronous: on a loaded box the server can still answer one more request
    after kill() returns, so wait until the kernel reports the process stopped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s")


def test_hung_server_times_out_instead_of_hanging(server):
    client = Client(server.address, timeout_s=0.5, retries=2)
    client.ping()
    os.kill(server.proc.pid, signal.SIGSTOP)
    wait_stopped(server.proc.pid)
    try:
        with pytest.raises(errors.TimeoutError, match="no progress"):
            client.get(b"k")
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    client.close()


def test_client_recovers_when_server_restarts_on_the_same_port(server, tmp_path):
    client = Client(server.address, timeout_s=5, retries=3, retry_backoff_s=0.05)
    assert client.put(b"before", b"1")
    server.kill()
    restarted = ServerProcess(tmp_path / "restarted")
    restarted.port = server.port  # a new server process where the client expects one
    restarted.start()
    try:
        # The pooled connection is stale; the call retries on a fresh one and succeeds.
        assert client.put(b"after", b"2") is True
        assert client.get(b"after") == b"2"
    finally:
        client.close()
        restarted.kill()


def test_threads_sharing_one_client_see_exact_bytes_or_a_miss(server):
    client = Client(server.address, pool_size=4, timeout_s=10)
    shared_key = b"shared"
    shared_value = bytes(range(256)) * 64
    failures: list[str] = []

    def worker(n: int):
        try:
            own = b"own-%d" % n
            own_value = bytes([n]) * (1000 + n)
            for i in range(30):
                if not client.put(shared_key, shared_value):
                    failures.append("shared put not admitted")
                got = client.get(shared_key)
                if got != shared_value:
                    failures.append(f"shared get returned {None if got is None else len(got)}")
                client.put(own, own_value)
                if client.get(own) != own_value:
                    failures.append(f"thread {n} read wrong bytes for its own key")
                buf = bytearray(len(own_value))
                if client.get_into(own, buf) != len(own_value) or buf != own_value:
                    failures.append(f"thread {n} get_into mismatch")
        except Exception as exc:  # surfaced through `failures`
            failures.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert client._pool.open_count <= 4
    client.close()


def test_concurrent_first_puts_of_one_key_all_succeed(server):
    client = Client(server.address, pool_size=8)
    value = b"v" * 4096
    barrier = threading.Barrier(8)
    results = []

    def put():
        barrier.wait()
        results.append(client.put(b"race", value))

    threads = [threading.Thread(target=put) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 8
    assert client.get(b"race") == value
    client.close()


def test_pool_exhaustion_is_a_bounded_wait(server):
    client = Client(server.address, pool_size=1, timeout_s=0.3)
    conn = client._pool.acquire()  # hold the only connection
    try:
        with pytest.raises(errors.PoolExhaustedError, match="pool_size"):
            client.ping()
    finally:
        client._pool.release(conn)
    assert client.ping()["version"]
    client.close()


def test_server_at_its_connection_limit_gives_busy_error(server_factory):
    node = server_factory("busy", extra_args=["--connections-max", "1"])
    holder = busy_connection(node)  # the only slot, with a frame under way: never closed for room
    other = Client(node.address, retries=1, retry_backoff_s=0.01)
    with pytest.raises(errors.ServerBusyError, match="connections-max"):
        other.ping()
    holder.close()
    with Client(node.address, retries=6, retry_backoff_s=0.05) as later:
        assert later.ping()["version"]  # the slot frees once the server sees the close
    other.close()


def test_pooled_connection_closed_by_server_idle_timeout_is_replaced(server_factory):
    node = server_factory("idle", extra_args=["--idle-timeout-s", "0.3"])
    with Client(node.address, retries=0) as client:
        assert client.put(b"k", b"v")
        # Wait until the server has closed the pooled connection (no timing assertion).
        conn = client._pool.acquire()
        conn.sock.settimeout(10)
        assert conn.sock.recv(1) == b""  # EOF: the server dropped it
        conn.sock.settimeout(None)
        client._pool.release(conn)
        assert client.get(b"k") == b"v"  # retried once on a fresh connection, though retries=0


def test_retry_backoff_is_capped_so_a_failing_call_stays_bounded():
    from gcache.common.processes import free_port

    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens: every attempt is refused at once
    fast = Client(nowhere, timeout_s=5, retries=10, retry_backoff_s=0.01)
    assert [fast.backoff_s(a) for a in (0, 1, 6, 7, 9)] == [0.01, 0.02, 0.64, 1.0, 1.0]
    # call_timeout_s well above ten sleeps: every retry runs (the default, timeout_s * 11,
    # may end it sooner: the call's deadline caps the retries too).
    slow = Client(nowhere, timeout_s=0.05, retries=10, retry_backoff_s=10, call_timeout_s=60)
    assert {slow.backoff_s(a) for a in range(10)} == {0.05}  # not 10 * 2^9 s
    with pytest.raises(errors.ConnectionError, match=r"refused.*gave up after 11 attempt"):
        slow.ping()  # ten sleeps of 0.05 s
    fast.close()
    slow.close()
