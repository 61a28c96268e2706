"""Connections that never authenticate (or never send a request) cannot lock anyone out
(issue 21, finding 1). The attack of the issue against a real gcache-server: 256 idle sockets
from each of four loopback addresses (127.0.0.2..5), then a reconnect storm (every socket the
node closes is opened again at once), while legitimate clients connect from a fifth address
and from an attacker's own. Every legitimate client gets in; outcomes are asserted, not times.

With --auth-file the unauthenticated sockets live in the pre-auth budget, where the oldest go
first; without it the longest-idle connections are closed to make room."""

from __future__ import annotations

import contextlib
import select
import socket
import threading

import pytest

import gcache
from gcache import errors
from gcache.wire.auth import auth_mac, token_id
from tests.support.raw_protocol import AUTH, BUSY, STORED, RawConnection, raw_auth
from tests.support.slots import busy_connection

pytestmark = pytest.mark.process

ATTACKERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")
IDLE_PER_ADDRESS = 256
LEGIT_ATTEMPTS = 12
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


class Attack:
    """IDLE_PER_ADDRESS idle sockets per attacker address, each opened again as soon as the node
    closes it (one thread per address) until stop()."""

    def __init__(self, port: int):
        self.port = port
        self.reconnects = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._sockets: dict[str, list[socket.socket]] = {a: [] for a in ATTACKERS}

    def _connect(self, address: str) -> socket.socket | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10, source_address=(address, 0))
        except OSError:
            return None  # e.g. the backlog was full for the connect timeout: try again later
        s.setblocking(False)
        return s

    def open_idle(self) -> None:
        for address in ATTACKERS:
            for _ in range(IDLE_PER_ADDRESS):
                s = self._connect(address)
                if s is not None:
                    self._sockets[address].append(s)

    def start_storm(self) -> None:
        for address in ATTACKERS:
            t = threading.Thread(target=self._storm, args=(address,), daemon=True)
            t.start()
            self._threads.append(t)

    def _storm(self, address: str) -> None:
        sockets = self._sockets[address]
        by_fd: dict[int, socket.socket] = {}
        poller = select.poll()

        def watch(s: socket.socket) -> None:
            by_fd[s.fileno()] = s
            poller.register(s, select.POLLIN)

        for s in sockets:
            watch(s)
        while not self._stop.is_set():
            while len(by_fd) < IDLE_PER_ADDRESS and not self._stop.is_set():
                s = self._connect(address)
                if s is None:
                    break
                sockets.append(s)
                watch(s)
            for fd, _events in poller.poll(50):
                s = by_fd[fd]
                try:
                    data = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the node: open it again at once
                    poller.unregister(fd)
                    del by_fd[fd]
                    sockets.remove(s)
                    s.close()
                    with self._lock:
                        self.reconnects += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)
        for sockets in self._sockets.values():
            for s in sockets:
                s.close()
            sockets.clear()


@contextlib.contextmanager
def attack(port: int):
    a = Attack(port)
    try:
        a.open_idle()
        yield a
    finally:
        a.stop()


def legit_round_trip(port: int, n: int, token: str | None) -> None:
    """A fresh client from 127.0.0.1 (the fifth address): connect, authenticate, put, get."""
    with gcache.Client(f"127.0.0.1:{port}", token=token, transport="tcp", timeout_s=30.0, retries=0) as client:
        key, value = f"legit-{n}".encode(), f"value-{n}".encode() * 8
        assert client.put(key, value) is True
        assert client.get(key) == value


def raw_round_trip(conn: RawConnection, key: bytes) -> None:
    assert conn.put([(key, b"v:" + key)]) == [STORED]
    assert conn.get([key]) == [b"v:" + key]


def write_auth_file(tmp_path) -> str:
    path = tmp_path / "auth.toml"
    path.write_text(AUTH_FILE)
    path.chmod(0o600)
    return str(path)


def test_unauthenticated_sockets_and_a_reconnect_storm_lock_no_tenant_out(server_factory, tmp_path):
    node = server_factory(extra_args=["--auth-file", write_auth_file(tmp_path)])
    # Authenticated before the attack, from an attacker's address: never dropped to make room.
    veteran = raw_auth(SourcedConnection(node.port, ATTACKERS[0]), TOKEN)
    with attack(node.port) as a:
        # Idle phase: 4 x 256 sockets that never authenticate.
        legit_round_trip(node.port, 0, TOKEN)
        with raw_auth(SourcedConnection(node.port, ATTACKERS[1]), TOKEN) as same_address:
            raw_round_trip(same_address, b"same-address")
        # Storm phase: every socket the node drops comes back at once.
        a.start_storm()
        for n in range(1, LEGIT_ATTEMPTS + 1):
            legit_round_trip(node.port, n, TOKEN)
        raw_round_trip(veteran, b"veteran")
        with raw_auth(SourcedConnection(node.port, "127.0.0.6"), TOKEN) as probe:
            stats = probe.stats()
    veteran.close()
    counters, gauges = stats["counters"], stats["gauges"]
    assert a.reconnects > 0  # the node did cut the attackers' sockets ...
    assert counters["preauth_dropped"] > 0  # ... to make room in the pre-auth budget
    assert gauges["connections_unauthenticated"] <= 256
    assert counters["errors_busy"] == 0  # nobody was refused
    assert counters["auth_successes"] == LEGIT_ATTEMPTS + 4  # each attempt, same_address, veteran, probe


def test_idle_sockets_and_a_reconnect_storm_lock_no_client_out(server_factory):
    """Without --auth-file: 4 x 256 idle sockets fill every slot (1,024); the longest-idle ones
    are closed to make room for a client with work to do."""
    node = server_factory()
    with attack(node.port) as a:
        legit_round_trip(node.port, 0, None)
        with SourcedConnection(node.port, ATTACKERS[1]) as same_address:  # that address is at its cap
            raw_round_trip(same_address, b"same-address")
        a.start_storm()
        for n in range(1, LEGIT_ATTEMPTS + 1):
            legit_round_trip(node.port, n, None)
        with SourcedConnection(node.port, "127.0.0.6") as probe:
            stats = probe.stats()
    counters = stats["counters"]
    assert a.reconnects > 0
    assert counters["connections_closed_for_room"] > 0
    assert counters["errors_busy"] == 0
    assert counters["connections_refused_address"] == 0


def test_busy_connections_are_never_closed_to_make_room(server_factory):
    """Without --auth-file, when every slot is held by a connection with a frame under way,
    a new one is answered BUSY: only idle connections make room."""
    node = server_factory(extra_args=["--connections-max", "2", "--connections-per-address-max", "0"])
    busy = [busy_connection(node) for _ in range(2)]
    try:
        with RawConnection(node.port) as extra:
            frame = extra.recv_frame()
        assert frame.status == BUSY and frame.meta["kind"] == "BUSY", frame
        assert "connections_max" in frame.meta["error"]
        for s in busy:  # neither was closed for room
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in busy:
            s.close()


def test_authenticated_connections_are_never_dropped_auth_beyond_the_caps_is_busy(server_factory, tmp_path):
    """With --auth-file the caps count authenticated connections; past them an AUTH is answered
    BUSY (gcache.errors.ServerBusyError), and the connection holding the slot stays."""
    node = server_factory(extra_args=["--auth-file", write_auth_file(tmp_path), "--connections-max", "1"])
    with raw_auth(RawConnection(node.port), TOKEN) as holder:
        with pytest.raises(errors.ServerBusyError, match="authenticated connections"):
            with gcache.Client(node.address, token=TOKEN, transport="tcp", retries=0) as client:
                client.ping()
        raw_round_trip(holder, b"holder")


def test_a_client_in_the_middle_of_its_auth_outlives_silent_sockets_from_its_own_address(server_factory, tmp_path):
    """The issue's 127.0.0.1 case: engines share the attacker's address. A connection that has
    asked for its nonce outlives a flood of silent sockets from that address, far past its share:
    the silent ones are dropped first."""
    node = server_factory(
        extra_args=[
            *("--auth-file", write_auth_file(tmp_path), "--auth-timeout-s", "60"),
            *("--preauth-connections-per-address-max", "8"),
        ]
    )
    legit = SourcedConnection(node.port, ATTACKERS[0])
    nonce = legit.request(AUTH, {}).meta["nonce"]  # answered: the node has read a frame of it
    flood = []
    try:
        for _ in range(64):
            flood.append(
                socket.create_connection(("127.0.0.1", node.port), timeout=30, source_address=(ATTACKERS[0], 0))
            )
        # A later connection authenticated: the accept loop (one, in order) has taken every flood socket.
        with raw_auth(SourcedConnection(node.port, "127.0.0.6"), TOKEN):
            pass
        answer = legit.request(AUTH, {"id": token_id(TOKEN), "mac": auth_mac(TOKEN, nonce)})
        assert answer.status == 0 and answer.meta["tenant"] == "alice", answer
        raw_round_trip(legit, b"mid-auth")
        stats = legit.stats()
        assert stats["counters"]["preauth_dropped"] == 64 + 1 - 8  # every one of them a silent socket
    finally:
        legit.close()
        for s in flood:
            s.close()
