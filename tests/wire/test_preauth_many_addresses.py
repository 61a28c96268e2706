"""Issue 31, finding 2: a reconnect storm spread over many source addresses locks no tenant out.

320 attacker addresses (127.1.x.y) hold one socket each that never authenticates, and open it
again at once whenever the node drops it: with a pre-auth budget of 64, a storm that never
ends. The node used to drop a socket of "the address holding the most", ties going to hash-map
order: a client opening several connections at once became that address and lost its own
connections, and one opening them one at a time lost the ties. Now a new connection never
pushes out one of its own address while others hold places, a reconnect (from an address that
lost an unauthenticated connection lately) pushes out another reconnect, so the storm churns
its own sockets, and addresses that authenticated lately go last. Legitimate clients open 8
connections at once: raw, from a new address each round, and gcache.Client (8 threads, no
retries) from 127.0.0.1, which health checks probe (connect, close) before the storm. Every one
gets in. Outcomes are asserted, not times."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

import gcache
from tests.support.raw_protocol import RawConnection, raw_auth

pytestmark = pytest.mark.process

ATTACKERS = [f"127.1.{i // 200}.{i % 200 + 1}" for i in range(320)]
PREAUTH_MAX = 64
AT_ONCE = 8
ROUNDS = 10
TOKEN = "alice-secret-0123456789"
AUTH_FILE = f"""
[tenants.alice]
token = "{TOKEN}"
roles = ["read", "write"]
"""


class SourcedConnection(RawConnection):
    """A RawConnection from a chosen loopback source address."""

    def __init__(self, port: int, source: str, timeout_s: float = 30.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s, source_address=(source, 0))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._next_id = 1


class Storm:
    """One silent socket per attacker address, opened again as soon as the node closes it."""

    def __init__(self, port: int):
        self.port = port
        self.reconnects = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _connect(self, address: str) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10, source_address=(address, 0))
        except OSError:
            return None  # e.g. the accept queue stayed full: try again on the next pass
        s.setblocking(False)
        return s

    def _run(self) -> None:
        poller = select.poll()
        by_fd: dict[int, tuple[str, socket.socket]] = {}
        missing = list(ATTACKERS)
        while not self._stop.is_set():
            retry = []
            for address in missing:
                s = self._connect(address)
                if s is None:
                    retry.append(address)
                    continue
                by_fd[s.fileno()] = (address, s)
                poller.register(s, select.POLLIN)
            missing = retry
            for fd, _events in poller.poll(50):
                address, s = by_fd[fd]
                try:
                    if s.recv(4096):
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                poller.unregister(fd)  # closed by the node: open it again at once
                del by_fd[fd]
                s.close()
                missing.append(address)
                self.reconnects += 1
        for _, s in by_fd.values():
            s.close()

    def start(self) -> None:
        self._thread.start()

    def wait_raging(self, timeout_s: float = 30.0) -> None:
        """Until the node has dropped 4 sockets per attacker address (bounded): the storm is on."""
        deadline = time.monotonic() + timeout_s
        while self.reconnects < 4 * len(ATTACKERS) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def open_and_authenticate(port: int, source: str) -> int:
    """AT_ONCE connections from `source`, all opened before any authenticates; how many got in."""
    conns = []
    try:
        for _ in range(AT_ONCE):
            conns.append(SourcedConnection(port, source))
        admitted = 0
        for n, conn in enumerate(conns):
            try:
                raw_auth(conn, TOKEN)
                assert conn.put([(f"{source}-{n}".encode(), b"v")]) == [0]
                admitted += 1
            except (OSError, AssertionError):
                pass  # dropped before its AUTH was through
        return admitted
    finally:
        for conn in conns:
            conn.close()


def client_round(port: int, round_no: int, errors: list[str]) -> int:
    """gcache.Client from 127.0.0.1, 8 threads at once (8 pooled connections), no retries: calls that
    succeeded (the others' errors are added to `errors`)."""
    ok = []
    with gcache.Client(
        f"127.0.0.1:{port}", token=TOKEN, transport="tcp", timeout_s=30.0, retries=0, pool_size=AT_ONCE
    ) as client:
        barrier = threading.Barrier(AT_ONCE)

        def call(n: int) -> None:
            barrier.wait(timeout=30)
            key, value = f"client-{round_no}-{n}".encode(), b"value" * 8
            try:
                if client.put(key, value) and client.get(key) == value:
                    ok.append(n)
            except (gcache.errors.GCacheError, OSError) as e:
                errors.append(f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=call, args=(n,)) for n in range(AT_ONCE)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    return len(ok)


def test_a_storm_from_320_addresses_locks_out_no_client_opening_8_connections_at_once(server_factory, tmp_path):
    auth_file = tmp_path / "auth.toml"
    auth_file.write_text(AUTH_FILE)
    auth_file.chmod(0o600)
    node = server_factory(
        extra_args=[
            *("--auth-file", str(auth_file), "--auth-timeout-s", "120"),
            *("--preauth-connections-max", str(PREAUTH_MAX)),
            *("--preauth-connections-per-address-max", str(AT_ONCE)),
        ]
    )
    for _ in range(3):  # health checks: connect, close, never authenticate
        socket.create_connection(("127.0.0.1", node.port), timeout=30).close()
    storm = Storm(node.port)
    storm.start()
    try:
        storm.wait_raging()
        raw_admitted = [open_and_authenticate(node.port, f"127.2.0.{r + 1}") for r in range(ROUNDS)]
        client_errors: list[str] = []
        client_ok = [client_round(node.port, r, client_errors) for r in range(ROUNDS)]
        reconnects = storm.reconnects
    finally:
        storm.stop()
    with raw_auth(SourcedConnection(node.port, "127.3.0.1"), TOKEN) as probe:
        counters = probe.stats()["counters"]
    total = ROUNDS * AT_ONCE
    outcome = (
        f"raw: {sum(raw_admitted)} of {total} got in {raw_admitted}; "
        f"gcache.Client: {sum(client_ok)} of {total} {client_ok} {client_errors[:1]}"
    )
    assert (sum(raw_admitted), sum(client_ok)) == (total, total), outcome + str(counters)
    assert reconnects > len(ATTACKERS) and counters["preauth_dropped"] >= reconnects  # it did rage
    assert counters["errors_busy"] == 0
