"""The same-host transport (transport="shm"): the server's arena mapped into the
client, LOOKUP leases, RESERVE / COMMIT, and what happens when clients misbehave
or die. Real gcache-server processes on a real Unix socket and a real memfd."""

from __future__ import annotations

import functools
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

import gcache
from gcache import errors
from gcache._native import xxh64
from gcache.client.transports.shm import ShmTransport
from tests.support import REPO_ROOT, waiting
from tests.support.raw_protocol import BAD_FRAME, OK, PING, RawConnection, raw_auth
from tests.support.raw_shm import COMMIT, FORBIDDEN, LOOKUP, RELEASE, RESERVE, RawShm

KIB, MIB = 1024, 1024 * 1024
# Every test runs on the native client core and on the Python reference path.
pytestmark = pytest.mark.usefixtures("client_core")


WAIT_S = 30  # bound on every wait for the server to act on its own
wait_until = functools.partial(waiting.wait_until, timeout_s=WAIT_S, step_s=0.05)


@pytest.fixture
def sock_dir():
    # Short: a socket path must fit 107 bytes, and pytest's tmp_path can be long.
    path = tempfile.mkdtemp(prefix="gcs")
    yield Path(path)
    for p in Path(path).iterdir():
        p.unlink()
    os.rmdir(path)


def start(server_factory, sock_dir, name="node", extra=(), **kwargs):
    sock = sock_dir / f"{name}.sock"
    return server_factory(name, extra_args=["--unix-socket", str(sock), *extra], **kwargs), str(sock)


def gauges(address) -> dict:
    with gcache.Client(address, transport="tcp") as c:
        return c.stats()["gauges"]


def counters(address) -> dict:
    with gcache.Client(address, transport="tcp") as c:
        return c.stats()["counters"]


def value_of(key: bytes, size: int) -> bytes:
    return (key * (size // max(1, len(key)) + 1))[:size]


def test_auto_picks_shm_and_every_method_matches_tcp(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir)
    sizes = [0, 1, 63, 4 * KIB, 256 * KIB + 3, 3 * MIB]
    with gcache.Client(node.address) as shm, gcache.Client(node.address, transport="tcp") as tcp:
        assert shm.transport == "shm" and tcp.transport == "tcp"
        assert sock in repr(shm)
        for writer, reader in ((shm, tcp), (tcp, shm), (shm, shm)):
            tag = f"{writer.transport}>{reader.transport}".encode()
            keys = [tag + b"-%d" % n for n in sizes]
            values = [os.urandom(n) for n in sizes]
            assert writer.put_batch(keys, values) == [True] * len(keys)
            assert writer.put_batch(keys[:1], values[:1]) == [True]  # EXISTS is success
            assert reader.get_batch(keys + [b"missing"]) == values + [None]
            assert reader.get(keys[3]) == values[3]
            # Into one buffer at offsets, and into separate buffers.
            total = sum(sizes)
            buf = bytearray(total + 10)
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            assert reader.batch_get_into(keys, buf, sizes=sizes, offsets=offsets) == sizes
            assert bytes(buf[:total]) == b"".join(values) and bytes(buf[total:]) == bytes(10)
            targets = [bytearray(n + 1) for n in sizes]
            assert reader.batch_get_into(keys, targets) == sizes
            assert [bytes(t[:n]) for t, n in zip(targets, sizes)] == values
            assert reader.batch_is_exist(keys + [b"missing"]) == [True] * len(keys) + [False]
        # A value larger than its target: BufferTooSmallError, that target untouched, others served.
        small = bytearray(b"\xee" * 10)
        other = bytearray(4 * KIB)
        with pytest.raises(errors.BufferTooSmallError) as info:
            shm.batch_get_into([b"shm>shm-%d" % (4 * KIB), b"shm>shm-%d" % (4 * KIB)], [small, other])
        assert bytes(small) == b"\xee" * 10
        assert info.value.results == [None, 4 * KIB] and info.value.sizes == [4 * KIB]
        assert shm.batch_remove([b"shm>shm-1", b"missing"]) == [True, False]
        assert tcp.get(b"shm>shm-1") is None
    c = counters(node.address)
    assert c["shm_attaches"] >= 1 and c["shm_lease_expiries"] == 0


def test_values_larger_than_a_put_chunk_and_a_batch_over_the_lookup_limit(server_factory, sock_dir):
    # 20 MiB in 8 MiB put chunks (RESERVE/COMMIT pipelined), and a LOOKUP whose found
    # bytes exceed --frame-payload-bytes-max: the client splits it, as a GET.
    node, _ = start(
        server_factory,
        sock_dir,
        memory="128MiB",
        extra=["--frame-payload-bytes-max", "4MiB", "--value-bytes-max", "4MiB"],
    )
    keys = [b"chunk-%d" % i for i in range(10)]
    values = [os.urandom(2 * MIB) for _ in keys]
    with gcache.Client(node.address, transport="shm") as c:
        assert c.put_batch(keys, values) == [True] * 10
        assert c.get_batch(keys) == values
        targets = [bytearray(2 * MIB) for _ in keys]
        assert c.batch_get_into(keys, targets) == [2 * MIB] * 10
        assert [bytes(t) for t in targets] == values
        with pytest.raises(errors.ValueTooLargeError):
            c.put(b"too-large", bytes(4 * MIB + 1))
    # A RELEASE has no answer: the client's last one may still be on its way when it closes.
    wait_until(lambda: gauges(node.address)["leases_active"] == 0, "the client's last leases released")


def test_a_lease_pins_its_value_until_released(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir)
    value = os.urandom(MIB)
    with gcache.Client(node.address, transport="tcp") as tcp:
        assert tcp.put(b"pinned", value)
        with RawShm(sock) as raw:
            raw.attach()
            frame = raw.request(LOOKUP, {"keys": [b"pinned", b"missing"]})
            assert frame.status == OK
            off, length, miss = frame.meta["offs"][0], frame.meta["lens"][0], frame.meta["lens"][1]
            assert (length, miss) == (MIB, -1) and frame.meta["sums"][0] == xxh64(value)
            assert bytes(raw.arena[off : off + length]) == value
            assert gauges(node.address)["leases_active"] == 1
            free_before = gauges(node.address)["arena_free_bytes"]
            assert tcp.remove(b"pinned") is True  # gone from the index ...
            assert tcp.get(b"pinned") is None
            assert bytes(raw.arena[off : off + length]) == value  # ... but its block is not reused
            assert gauges(node.address)["arena_free_bytes"] == free_before
            raw.release(leases=[frame.meta["lease"]])  # no answer: the next request's is next
            assert raw.request(PING, {}).status == OK
            assert gauges(node.address)["leases_active"] == 0
            assert gauges(node.address)["arena_free_bytes"] > free_before
            # Releasing again, or an id never handed out, is harmless.
            answer = raw.release(leases=[frame.meta["lease"], 12345], no_reply=False)
            assert answer.status == OK and answer.meta == {"released": 0}


def test_a_crashed_client_never_pins_memory(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir)
    with gcache.Client(node.address, transport="tcp") as tcp:
        assert tcp.put_batch([b"a", b"b"], [b"x" * KIB, b"y" * KIB]) == [True, True]
    # A real process maps the arena, leases two values, reserves a block, and dies.
    script = textwrap.dedent(f"""
        import os
        from tests.support.raw_shm import RawShm, LOOKUP, RESERVE
        raw = RawShm({sock!r})
        raw.attach()
        assert raw.request(LOOKUP, {{"keys": [b"a", b"b"]}}).meta["lease"]
        assert raw.request(RESERVE, {{"keys": [b"c"], "lens": [4096]}}).meta["res"]
        print("held", flush=True)
        os.kill(os.getpid(), 9)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert proc.stdout.strip() == "held", proc.stderr
    wait_until(lambda: gauges(node.address)["leases_active"] == 0, "the dead client's leases dropped")
    wait_until(lambda: gauges(node.address)["put_reserved_bytes"] == 0, "its reservation released")
    with gcache.Client(node.address, transport="shm") as c:
        assert c.get(b"c") is None  # never committed
        assert c.put(b"c", b"z" * 4096) and c.get(b"c") == b"z" * 4096


def test_leases_expire_and_a_late_reservation_closes_its_connection(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir, extra=["--shm-lease-s", "0.3"])
    with gcache.Client(node.address, transport="tcp") as tcp:
        assert tcp.put(b"k", b"v" * KIB)
    with RawShm(sock) as raw:
        raw.attach()
        assert raw.request(LOOKUP, {"keys": [b"k"]}).meta["lease"]
        wait_until(lambda: gauges(node.address)["leases_active"] == 0, "the lease expired")
        assert raw.request(PING, {}).status == OK  # an expired lease costs the client nothing else
        assert raw.request(RESERVE, {"keys": [b"late"], "lens": [KIB]}).meta["res"]
        # The client may still be writing there: past the deadline the server closes
        # the connection, and only then frees the block.
        assert raw.closed_by_server()
    wait_until(lambda: gauges(node.address)["put_reserved_bytes"] == 0, "the reservation released")
    c = counters(node.address)
    assert c["shm_lease_expiries"] == 1 and c["shm_reservation_expiries"] == 1
    with gcache.Client(node.address, transport="tcp") as tcp:
        assert tcp.get(b"late") is None


def test_commit_trusts_declared_sums_readers_check_and_bad_requests_change_nothing(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir)
    with RawShm(sock) as raw:
        raw.attach()
        frame = raw.request(RESERVE, {"keys": [b"good", b"bad", b"bad"], "lens": [5, 5, 5]})
        assert frame.status == OK
        st, offs, res = frame.meta["st"], frame.meta["offs"], frame.meta["res"]
        assert st[:2] == [0, 0] and st[2] in (0, 1)  # the duplicate: reserved too, or already there
        raw.arena[offs[0] : offs[0] + 5] = b"hello"
        raw.arena[offs[1] : offs[1] + 5] = b"world"
        sums = [xxh64(b"hello"), xxh64(b"other"), 0]
        answer = raw.request(COMMIT, {"res": res, "sums": sums})
        # COMMIT does not read the blocks (one memory pass per put): both are published,
        # and the first reader (here a GET over the socket) finds "bad" a miss.
        assert answer.status == OK and answer.meta["st"][:2] == [0, 0]
        assert raw.get([b"good", b"bad"]) == [b"hello", None]
        assert counters(node.address)["checksum_failures_read"] == 1
        # Unknown or already used reservation ids, a wrong number of sums, missing
        # fields: BAD_FRAME, and the connection stays usable.
        for meta in ({"res": res, "sums": sums}, {"res": 999, "sums": []}, {"sums": []}, {"res": 1}):
            bad = raw.request(COMMIT, meta)
            assert bad.status == BAD_FRAME and bad.meta["error"], meta
        held = raw.request(RESERVE, {"keys": [b"x"], "lens": [3]}).meta["res"]
        assert raw.request(COMMIT, {"res": held, "sums": [1, 2]}).status == BAD_FRAME  # released
        assert raw.request(COMMIT, {"res": held, "sums": [1]}).status == BAD_FRAME  # gone
        assert raw.request(RESERVE, {"keys": [b"x"], "lens": [1, 2]}).status == BAD_FRAME
        assert raw.request(LOOKUP, {"lens": [1]}).status == BAD_FRAME  # no keys
        raw.release(leases=["not-an-id"])  # no-reply RELEASE: malformed, ignored silently
        assert raw.request(PING, {}).status == OK
    assert gauges(node.address)["put_reserved_bytes"] == 0
    with RawConnection(node.port) as tcp_raw:  # the arena is only handed out on the Unix socket
        refused = tcp_raw.request(8, {})
        assert refused.status == FORBIDDEN and "unix-socket" in refused.meta["error"]
        assert tcp_raw.request(PING, {}).status == OK


def test_auth_node_offers_no_shared_memory(server_factory, sock_dir, tmp_path):
    token = "shm-tenant-secret-0123456789"
    auth = tmp_path / "auth.toml"
    auth.write_text(f'[tenants.t]\ntoken = "{token}"\nroles = ["read", "write"]\n')
    auth.chmod(0o600)
    node, sock = start(server_factory, sock_dir, extra=["--auth-file", str(auth)])
    with pytest.raises(errors.TransportUnavailableError, match="authentication"):
        gcache.Client(node.address, token=token, transport="shm")
    with gcache.Client(node.address, token=token) as c:
        assert c.transport == "tcp" and c.put(b"k", b"v") and c.get(b"k") == b"v"
    with RawShm(sock) as raw:  # even asked directly over the socket, authenticated
        raw_auth(raw, token)
        for opcode, meta in ((8, {}), (LOOKUP, {"keys": [b"k"]}), (RESERVE, {"keys": [b"x"], "lens": [1]})):
            refused = raw.request(opcode, meta)
            assert refused.status == FORBIDDEN and "auth-file" in refused.meta["error"], opcode
        assert raw.get([b"k"]) == [b"v"]


def test_socket_of_another_server_is_refused(server_factory, sock_dir):
    a, _ = start(server_factory, sock_dir, name="a")
    b, sock_b = start(server_factory, sock_dir, name="b")
    instance_a = gcache.Client(a.address, transport="tcp").ping()["instance"]
    transport = ShmTransport(a.address, sock_b, 5.0, 1.0, expected_instance=instance_a)
    with pytest.raises(errors.TransportUnavailableError, match="another gcache-server"):
        transport.connect()
    transport.close()


def test_server_restart_maps_the_new_arena(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir)
    value = os.urandom(64 * KIB)
    with gcache.Client(node.address, transport="shm", retries=3) as c:
        assert c.put(b"survivor", value)
        node.stop()  # SIGTERM: flushed to disk, reloaded by the warm restart
        node.start()
        assert c.get(b"survivor") == value  # a fresh connection, the new instance's arena
        assert c.put(b"after", b"a" * 100) and c.get(b"after") == b"a" * 100


def test_writer_racing_evictions_never_returns_wrong_bytes(server_factory, sock_dir):
    # A small arena, no disk: the writer's puts evict constantly while readers
    # lease, copy and verify. Every answer is the exact value of its key, or a miss.
    node, _ = start(server_factory, sock_dir, memory="4MiB", disk="0")
    sizes = [KIB, 16 * KIB, 64 * KIB]
    keys = [b"race-%04d" % i for i in range(400)]
    size_of = {k: sizes[i % len(sizes)] for i, k in enumerate(keys)}
    problems: list[str] = []
    stop = threading.Event()

    def writer():
        with gcache.Client(node.address, transport="shm") as c:
            rng = random.Random(1)
            for _ in range(60):
                batch = rng.sample(keys, 16)
                c.put_batch(batch, [value_of(k, size_of[k]) for k in batch])
        stop.set()

    def reader(seed: int):
        rng = random.Random(seed)
        with gcache.Client(node.address, transport="shm") as c:
            while not stop.is_set():
                batch = rng.sample(keys, 8)
                try:
                    if rng.random() < 0.5:
                        got = c.get_batch(batch)
                        bad = [k for k, v in zip(batch, got) if v is not None and v != value_of(k, size_of[k])]
                    else:
                        bufs = [bytearray(size_of[k]) for k in batch]
                        got = c.batch_get_into(batch, bufs)
                        bad = [
                            k
                            for k, n, b in zip(batch, got, bufs)
                            if n is not None and bytes(b[:n]) != value_of(k, size_of[k])
                        ]
                except errors.ChecksumMismatchError:
                    continue  # caught by the check: never returned as a hit
                if bad:
                    problems.append(f"wrong bytes for {bad}")

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in (2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    assert problems == []
    c = counters(node.address)
    assert c["evictions_memory"] > 0, "the race needs evictions"
    # The clients' last RELEASEs (no reply) and closes are handled after they return.
    wait_until(lambda: gauges(node.address)["leases_active"] == 0, "the readers' leases dropped")
    assert gauges(node.address)["put_reserved_bytes"] == 0


def test_bytes_changed_in_the_arena_are_never_a_hit_to_a_checking_reader(server_factory, sock_dir, monkeypatch):
    BIG = 64 * KIB  # over shm_ops.INLINE_BYTES_MAX: copied out of the arena under a lease
    # A value the node has checked ("vf") is copied without a hash while its lease
    # provably holds (as a GET_BATCH is sent); a copy that ends after the lease, a value
    # not checked yet, or a client with verify_checksums checks every value. Here the
    # block really holds other bytes (written through the mapping, as a reused block
    # would): a checking reader never returns them, reports the offset in its RELEASE,
    # and the node checks the block itself and removes the value.
    from gcache.client.transports import shm_ops

    node, sock = start(server_factory, sock_dir)

    def scribble(key: bytes) -> None:
        with RawShm(sock) as raw:
            raw.attach()
            frame = raw.request(LOOKUP, {"keys": [key]})  # no "vfy": the node checks it first
            off = frame.meta["offs"][0]
            raw.arena[off : off + 4] = b"BBBB"
            raw.release(leases=[frame.meta["lease"]], no_reply=False)

    with (
        gcache.Client(node.address, transport="shm") as c,
        gcache.Client(node.address, transport="shm", verify_checksums=True) as checked,
    ):
        assert c.put(b"k", b"A" * BIG) and c.put(b"ok", b"C" * 100)  # "k" is leased, "ok" inline
        assert c.put(b"k1", b"E" * BIG)
        scribble(b"k")
        scribble(b"k1")
        assert checked.get(b"ok") == b"C" * 100
        with pytest.raises(errors.ChecksumMismatchError) as info:
            checked.get_batch([b"k", b"ok"])
        assert info.value.results == [None, b"C" * 100]
        with pytest.raises(errors.ChecksumMismatchError) as info:
            checked.get(b"k1")  # one key (gcache.client.one_key on the native core): the same error
        assert info.value.keys == [b"k1"] and info.value.results == [None]
        wait_until(lambda: counters(node.address)["checksum_failures_read"] == 2, "the bad values reported")
        assert c.get(b"k") is None and checked.get(b"k") is None  # removed: a miss from now on
        assert c.batch_get_into([b"k", b"ok"], [bytearray(BIG), bytearray(100)]) == [None, 100]
        # The lease counted as lapsed for every copy: even without verify_checksums.
        assert c.put(b"k2", b"D" * BIG)
        scribble(b"k2")
        monkeypatch.setattr(shm_ops, "LEASE_TRUST", 0.0)
        buf = bytearray(BIG)
        with pytest.raises(errors.ChecksumMismatchError) as got:
            c.batch_get_into([b"k2", b"ok"], [buf, bytearray(100)])
        assert got.value.results == [None, 100]
    wait_until(lambda: gauges(node.address)["leases_active"] == 0, "the leases dropped")


def test_a_false_bad_report_removes_nothing(server_factory, sock_dir):
    # RELEASE "bad" only makes the node check the block itself: a reader that reports
    # a sound value costs one hash and changes nothing.
    node, sock = start(server_factory, sock_dir)
    value = os.urandom(64 * KIB)
    with gcache.Client(node.address, transport="shm") as c:
        assert c.put(b"k", value)
    with RawShm(sock) as raw:
        raw.attach()
        frame = raw.request(LOOKUP, {"keys": [b"k"], "ck": 1, "vfy": True})
        assert frame.meta["lens"] == [len(value)] and frame.meta["lease"]
        assert raw.request(RELEASE, {"leases": [frame.meta["lease"]], "bad": frame.meta["offs"]}).status == OK
    assert counters(node.address)["checksum_failures_read"] == 0
    with gcache.Client(node.address, transport="tcp") as tcp:
        assert tcp.get(b"k") == value


def test_small_values_come_inline_and_large_ones_leased(server_factory, sock_dir):
    # LOOKUP with "inline_max": small values travel in the answer (no lease outlives
    # it), larger ones are leased; one answer can mix both, in key order.
    node, sock = start(server_factory, sock_dir)
    small, large = os.urandom(100), os.urandom(100 * KIB)
    with gcache.Client(node.address, transport="tcp") as tcp:
        assert tcp.put_batch([b"s", b"l", b"e"], [small, large, b""]) == [True] * 3
    with RawShm(sock) as raw:
        raw.attach()
        frame = raw.request(LOOKUP, {"keys": [b"l", b"s", b"x", b"e"], "inline_max": 1024})
        assert frame.status == OK and frame.meta["inl"] == [False, True, False, True]
        assert frame.meta["lens"] == [len(large), len(small), -1, 0] and frame.payload == small
        off = frame.meta["offs"][0]
        assert bytes(raw.arena[off : off + len(large)]) == large
        # Only the large value stays leased (the inline ones' leases end once sent).
        wait_until(lambda: gauges(node.address)["leases_active"] == 1, "the inline values' leases dropped")
        raw.release(leases=[frame.meta["lease"]])
        assert raw.request(PING, {}).status == OK
        assert gauges(node.address)["leases_active"] == 0
    with gcache.Client(node.address, transport="shm") as c:
        assert c.get_batch([b"l", b"s", b"x", b"e"]) == [large, small, None, b""]
        targets = [bytearray(len(large)), bytearray(50), bytearray(10)]
        with pytest.raises(errors.BufferTooSmallError) as info:
            c.batch_get_into([b"l", b"s", b"e"], targets)
        assert info.value.results == [len(large), None, 0] and bytes(targets[0]) == large
