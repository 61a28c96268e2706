"""The native client core (gcache.client.native_core) against the Python reference path,
on a real gcache-server over tcp and shm: the same bytes, statuses, errors and misses.
(The client, shm and dishonest-checksum test files also run each test on both paths:
the `client_core` fixture.)"""

import os
import signal
import socket
import threading

import msgpack
import numpy as np
import pytest

import gcache
from gcache import errors
from gcache.client import native_core, pipeline
from gcache.wire.protocol import FLAG_RESPONSE, HEADER_BYTES, Opcode, decode_header, encode_header
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.process  # starts processes

VALUE_BYTES_MAX = 1 << 20
SIZES = [0, 1, 4095, 16 << 10, (16 << 10) + 1, 64 << 10, 256 << 10, VALUE_BYTES_MAX]


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    server = ServerProcess(
        tmp_path_factory.mktemp("native_core") / "data",
        memory="256MiB",
        extra_args=["--value-bytes-max", str(VALUE_BYTES_MAX)],
    ).start()
    yield server
    server.kill()


def _client(address: str, core: str, transport: str, monkeypatch, **kwargs) -> gcache.Client:
    monkeypatch.setenv(native_core.CORE_ENV, core)
    client = gcache.Client(address, transport=transport, **{"timeout_s": 10, **kwargs})
    assert client._native == (core == "native") and client.transport == transport
    return client


def _pattern(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _outcome(call):
    """What a call answered: its value, or its error's type, keys, sizes and per-key results."""
    try:
        return ("ok", call())
    except errors.GCacheError as exc:
        return (type(exc).__name__, getattr(exc, "keys", None), getattr(exc, "sizes", None), exc.results)


def _script(c: gcache.Client, ns: bytes) -> list:
    """Every operation the client has, with hits, misses and per-key problems; returns what each
    answered, keys without the namespace so two clients' answers compare."""
    k = [ns + b"v%d" % i for i in range(len(SIZES))]
    values = [_pattern(size, size) for size in SIZES]
    out = [_outcome(lambda: c.put(k[0], values[0]))]
    out.append(_outcome(lambda: c.put_batch(k[1:], values[1:])))
    out.append(_outcome(lambda: c.put_batch(k[:2], values[:2])))  # exist already: True
    big = ns + b"big"
    out.append(_outcome(lambda: c.put_batch([big, ns + b"ok"], [b"x" * (VALUE_BYTES_MAX + 1), b"fine"])))
    missing = ns + b"missing"
    out.append(_outcome(lambda: c.get_batch([*k, missing, big])))
    out.append(_outcome(lambda: [c.get(key) for key in (k[2], missing)]))
    buf = np.zeros(sum(SIZES) + 100, dtype=np.uint8)
    offsets = np.cumsum([0, *SIZES])[:-1].tolist()
    out.append(_outcome(lambda: c.batch_get_into([*k, missing], buf, [*SIZES, 100], [*offsets, sum(SIZES)])))
    out.append(bytes(buf[: sum(SIZES)]) == b"".join(values))
    small = [bytearray(size) for size in SIZES]
    small[5] = bytearray(10)  # too small for its value: left untouched, the others still read
    out.append(_outcome(lambda: c.batch_get_into(k, small)))
    out.append([bytes(s) for s in small])
    out.append(_outcome(lambda: c.get_into(k[3], bytearray(3))))
    out.append(_outcome(lambda: c.batch_is_exist([*k, missing])))
    out.append(_outcome(lambda: c.batch_exists_prefix([k[0], k[1], missing, k[2]])))
    out.append(_outcome(lambda: c.batch_remove([k[0], missing, k[0]])))
    out.append(_outcome(lambda: c.batch_remove([k[0]])))
    out.append(_outcome(lambda: c.get(k[0])))

    def unprefixed(x):
        if isinstance(x, bytes) and x.startswith(ns):
            return x[len(ns) :]
        if isinstance(x, (list, tuple)):
            return type(x)(unprefixed(y) for y in x)
        return x

    return unprefixed(out)


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_every_operation_answers_as_the_reference(node, monkeypatch, transport, verify):
    with (
        _client(node.address, "native", transport, monkeypatch, verify_checksums=verify) as native,
        _client(node.address, "python", transport, monkeypatch, verify_checksums=verify) as reference,
    ):
        ns = f"{transport}{verify}/".encode()
        got = _script(native, b"n" + ns)
        want = _script(reference, b"p" + ns)
        assert got == want
        assert got[4][1][2] == _pattern(SIZES[2], SIZES[2])  # the answers hold the real bytes
        # Each reads what the other wrote, byte for byte.
        for size in SIZES[1:]:
            assert native.get(b"p" + ns + b"v%d" % SIZES.index(size)) == _pattern(size, size)
            assert reference.get(b"n" + ns + b"v%d" % SIZES.index(size)) == _pattern(size, size)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_batch_over_several_frames_answers_as_the_reference(node, monkeypatch, transport):
    """Frames of 3 keys / 100 KiB: slices, shm RESERVE chunks, answers in key order. (Over tcp a
    call of several frames runs on the reference pipeline, which keeps several in flight.)"""
    n, size = 20, 40 << 10
    values = [_pattern(size, i) for i in range(n)]
    answers = []
    for core in ("native", "python"):
        with _client(node.address, core, transport, monkeypatch, batch_keys_max=3) as c:
            c.frame_payload_bytes_max = 100 << 10
            keys = [f"{core}{transport}split{i}".encode() for i in range(n)]
            answers.append(
                (
                    c.put_batch(keys, values),
                    c.get_batch(keys + [b"nope"]) == values + [None],
                    c.batch_is_exist(keys[:5] + [b"nope"] + keys[5:]),
                    c.batch_exists_prefix(keys[:7] + [b"nope"]),
                    c.batch_remove(keys[::2]),
                    c.get_batch(keys[:4]) == [None, values[1], None, values[3]],
                )
            )
    assert answers[0] == answers[1]
    assert answers[0][0] == [True] * n and answers[0][1] and answers[0][5]


def test_the_native_core_is_what_runs(node, monkeypatch):
    """With the core on, no call goes through the Python pipeline."""

    def refused(*args, **kwargs):
        raise AssertionError("the reference pipeline ran")

    for transport in ("tcp", "shm"):
        with _client(node.address, "native", transport, monkeypatch) as c:
            monkeypatch.setattr(pipeline, "run", refused)
            assert c.put(b"runs" + transport.encode(), b"v" * 5000)
            assert c.get(b"runs" + transport.encode()) == b"v" * 5000
            assert c.is_exist(b"runs" + transport.encode()) and c.remove(b"runs" + transport.encode())
            monkeypatch.undo()


def test_an_unusable_core_warns_once_and_the_reference_runs(node, monkeypatch):
    monkeypatch.setattr(native_core, "_LOAD_ERROR", "gcache._native has no client core (test)")
    monkeypatch.setattr(native_core, "_warned", set())
    with pytest.warns(RuntimeWarning, match="no client core.*Python reference path"):
        c = gcache.Client(node.address, transport="tcp")
    with c:
        assert c._native is False
        assert c.put(b"fallback", b"x") and c.get(b"fallback") == b"x"
    monkeypatch.setattr(native_core, "_LOAD_ERROR", None)
    with pytest.warns(RuntimeWarning, match="does not drive transport 'rdma'"):
        assert native_core.usable_for("rdma") is False


def test_a_bad_core_choice_is_refused(node, monkeypatch):
    monkeypatch.setenv(native_core.CORE_ENV, "fast")
    with pytest.raises(errors.InvalidArgumentError, match="GCACHE_CLIENT_CORE"):
        gcache.Client(node.address, transport="tcp")


def _serve_one(sock: socket.socket, answer: dict, seen: list) -> None:
    header = decode_header(sock.recv(HEADER_BYTES, socket.MSG_WAITALL))
    seen.append(msgpack.unpackb(sock.recv(header.meta_len, socket.MSG_WAITALL), raw=False))
    if header.payload_len:
        seen.append(sock.recv(header.payload_len, socket.MSG_WAITALL))
    body = msgpack.packb(answer, use_bin_type=True)
    sock.sendall(encode_header(header.opcode, header.request_id, len(body), 0, 0, FLAG_RESPONSE) + body)


@pytest.mark.parametrize("entries", [1, 20])
def test_extra_put_entries_reach_the_request_map(entries):
    """A PUT's optional map entries (e.g. a value description) pass through the core as they are."""
    from gcache._native import CoreConnection, checksum

    extra = {f"x{i}": i * 1.5 for i in range(entries)}
    ours, theirs = socket.socketpair()
    seen: list = []
    peer = threading.Thread(target=_serve_one, args=(theirs, {"st": [0], "ck": 1}, seen))
    peer.start()
    try:
        extra_bytes, count = native_core.encode_extra_entries(extra)
        statuses, ck = CoreConnection(ours.fileno()).put([b"k"], [b"value"], 1, 7, extra_bytes, count, 5.0)
    finally:
        peer.join(10)
        ours.close()
        theirs.close()
    assert (statuses, ck) == ([0], True)
    meta, payload = seen
    assert meta == {"keys": [b"k"], "lens": [5], "ck": 1, "sums": [checksum(b"value", 1)], "epoch": 7, **extra}
    assert payload == b"value"
    assert native_core.encode_extra_entries(None) == (b"", 0)


def test_a_core_error_keeps_the_connection_contract(monkeypatch):
    """An answer to another request: ProtocolError, the connection is dropped (not reused)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        with conn:
            header = decode_header(conn.recv(HEADER_BYTES, socket.MSG_WAITALL))
            conn.recv(header.meta_len, socket.MSG_WAITALL)
            body = msgpack.packb({"ex": [True], "prefix": 1})
            conn.sendall(encode_header(Opcode.EXISTS_BATCH, header.request_id + 1, len(body), 0, 0, 1) + body)
            conn.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setenv(native_core.CORE_ENV, "native")
    client = gcache.Client(f"127.0.0.1:{listener.getsockname()[1]}", transport="tcp", retries=0)
    with pytest.raises(errors.ProtocolError, match="out of order"):
        client.is_exist(b"k")
    assert client._pool.open_count == 0
    client.close()
    listener.close()
    thread.join(10)


@pytest.mark.usefixtures("client_core")
@pytest.mark.parametrize("size", [10, 64 << 10])  # sums in the map; sums trailing the values
def test_the_puts_worth_goes_out_on_either_path(size):
    """put_batch(..., worth=): the same "worth" field (gcache.wire.worth) on the native and the reference path."""
    from gcache.wire.worth import ValueKind, Worth, worth_field

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    seen: list = []

    def serve():
        conn, _ = listener.accept()
        with conn:
            _serve_one(conn, {"st": [0, 0], "ck": 1}, seen)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    worth = [Worth(ValueKind.STATE_CHECKPOINT, 512), Worth(ValueKind.ATTENTION_PAGE, 16)]
    with gcache.Client(f"127.0.0.1:{listener.getsockname()[1]}", transport="tcp", retries=0) as c:
        assert c.put_batch([b"k", b"j"], [b"v" * size, b"w" * size], worth=worth) == [True, True]
    thread.join(10)
    listener.close()
    assert seen[0]["worth"] == worth_field(worth) and seen[0]["keys"] == [b"k", b"j"]


# -- the one-key calls (gcache.client.one_key): get() and is_exist() on an idle connection ------


def _general_path_refused(monkeypatch, client) -> None:
    """From here on a get() or is_exist() of `client` that left the one-key path fails the test."""

    def refused(*args, **kwargs):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(client, "_get_general", refused)
    monkeypatch.setattr(client, "_exists", refused)


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_key_calls_take_the_fast_path_and_answer_as_the_reference(node, monkeypatch, transport, verify):
    ns = f"one/{transport}{verify}/".encode()
    keys = [ns + b"%d" % size for size in SIZES]
    values = [_pattern(size, size + 7) for size in SIZES]
    with (
        _client(node.address, "native", transport, monkeypatch, verify_checksums=verify) as native,
        _client(node.address, "python", transport, monkeypatch, verify_checksums=verify) as reference,
    ):
        assert native.put_batch(keys, values) == [True] * len(keys)  # leaves an idle connection
        _general_path_refused(monkeypatch, native)
        for key, value in zip(keys, values):
            got = native.get(key)
            assert got == reference.get(key) == value and type(got) is bytes
            assert native.is_exist(key) is reference.is_exist(key) is True
        missing = ns + b"missing"
        assert native.get(missing) is reference.get(missing) is None
        assert native.is_exist(missing) is reference.is_exist(missing) is False
        assert native.get(ns.decode() + "0") == b""  # a str key, an empty value: b"", not a miss
        with pytest.raises(errors.KeyInvalidError):
            native.get(b"")
        with pytest.raises(errors.KeyInvalidError):
            native.is_exist(b"x" * 513)
        assert native._pool.open_count == 1  # one connection served every call


def test_the_spin_setting_is_checked_and_zero_turns_it_off(node, monkeypatch):
    for bad in ("fast", "-1", "10001"):
        monkeypatch.setenv(native_core.SPIN_ENV, bad)
        with pytest.raises(errors.InvalidArgumentError, match="GCACHE_CLIENT_SPIN_US"):
            gcache.Client(node.address, transport="tcp")
    monkeypatch.setenv(native_core.SPIN_ENV, "0")  # every wait blocks at once: the same answers
    for transport in ("tcp", "shm"):
        with _client(node.address, "native", transport, monkeypatch) as c:
            assert c.put(b"nospin" + transport.encode(), b"s" * 5000)
            assert c.get(b"nospin" + transport.encode()) == b"s" * 5000 and c.get(b"nospin/none") is None
            conn = c._pool.take_idle()
            assert conn.native.spin_us == 0.0
            c._pool.release(conn)


def _outcome_of(call) -> tuple:
    """An error's type and message (and an AuthError's kind), or ("ok", the answer)."""
    try:
        return ("ok", call())
    except errors.GCacheError as exc:
        return (type(exc).__name__, str(exc), getattr(exc, "kind", None))


def _one_key_failures(node, monkeypatch, transport: str, fail, readable: bool = True, **kwargs) -> list:
    """A native client and a reference client, each with an idle connection, then `fail()`, then
    one get() and one is_exist() of each: their outcomes, native first, and which native calls
    began on the one-key path (a failure there goes on in the general path, as the retry loop
    would). `readable`: the warm-up reads its value back too."""
    from gcache.client import one_key

    began = []
    for name, fn in (("get", one_key.get), ("exists", one_key.exists)):

        def counted(client, key, fn=fn, name=name):
            began.append(name)
            return fn(client, key)

        monkeypatch.setattr(one_key, name, counted)
    clients = [_client(node.address, core, transport, monkeypatch, **kwargs) for core in ("native", "python")]
    for c in clients:
        assert c.put(b"warm", b"w") and (not readable or c.get(b"warm") == b"w")
    began.clear()
    fail()
    try:
        out = [(_outcome_of(lambda: c.get(b"warm")), _outcome_of(lambda: c.is_exist(b"warm"))) for c in clients]
    finally:
        for c in clients:
            c.close()
    return [out[0], out[1], began]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_key_calls_to_a_killed_server_fail_as_the_reference(server_factory, monkeypatch, transport):
    node = server_factory()
    native, reference, began = _one_key_failures(node, monkeypatch, transport, node.kill, timeout_s=2, retries=2)
    assert native == reference and began == ["get", "exists"]
    assert native[0][0] == "ConnectionError" and "gave up after 3 attempt(s)" in native[0][1]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_key_calls_to_a_hung_server_time_out_as_the_reference(server_factory, monkeypatch, transport):
    from tests.client.test_client_faults import wait_stopped

    node = server_factory()

    def hang():
        os.kill(node.proc.pid, signal.SIGSTOP)
        wait_stopped(node.proc.pid)

    try:
        native, reference, began = _one_key_failures(node, monkeypatch, transport, hang, timeout_s=0.5, retries=1)
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)
    assert native == reference and began == ["get", "exists"]
    assert native[0][0] == native[1][0] == "TimeoutError" and "made no progress" in native[0][1]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_one_key_calls_after_a_restart_retry_as_the_reference(server_factory, monkeypatch, transport, tmp_path):
    node = server_factory()

    restarted = ServerProcess(tmp_path / "restarted")
    restarted.port = node.port  # a new server process where the clients expect one

    def restart():
        node.kill()
        restarted.start()

    try:
        native, reference, began = _one_key_failures(node, monkeypatch, transport, restart, timeout_s=5, retries=2)
    finally:
        restarted.kill()
    # The idle connection died with the old server: one retry at once on a fresh one, a miss there.
    assert native == reference == (("ok", None), ("ok", False)) and began == ["get", "exists"]


def test_a_refused_one_key_call_raises_as_the_reference(server_factory, monkeypatch, tmp_path):
    """A status answer (here FORBIDDEN: a tenant without the read role) raises the reference's
    error (not retried)."""
    path = tmp_path / "auth.toml"
    path.write_text(f'[tenants.writer]\ntoken = "{WRITER}"\nroles = ["write"]\n')
    path.chmod(0o600)
    node = server_factory(extra_args=["--auth-file", str(path)])
    native, reference, began = _one_key_failures(
        node, monkeypatch, "tcp", lambda: None, readable=False, token=WRITER, retries=2
    )
    assert native == reference and began == ["get", "exists"]
    assert native[0][0] == "AuthError" and native[0][2] == "forbidden"


WRITER = "writer-secret-0123456789"
