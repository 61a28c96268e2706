"""A writer that lies about its checksums (docs/security.md, "Checksums a writer declares").

COMMIT publishes a one-sided writer's blocks with the sums it declares, unread (one
memory pass per put); a PUT_BATCH is hashed as it lands. Whatever a writer declares,
no other reader ever gets bytes that do not match their sum: each reader path (GET
over TCP, LOOKUP inline, LOOKUP leased with the client's copy, a LOOKUP from a
client that does not check, a read back from disk), or the node's scrubber if it
gets there first, finds the value bad; the node counts it once and removes it, and
every later read is a miss. With tenants the
one-sided opcodes are off, a lying PUT over TCP stores nothing, and neither tenant
reads it. Real gcache-server processes throughout.
"""

from __future__ import annotations

import functools
import os
import tempfile
from pathlib import Path

import pytest

import gcache
from gcache import errors
from gcache._native import xxh3
from tests.support import waiting
from tests.support.raw_protocol import (
    BAD_FRAME,
    CHECKSUM_MISMATCH,
    FORBIDDEN,
    OK,
    STORED,
    RawConnection,
    raw_auth,
)
from tests.support.raw_shm import COMMIT, LOOKUP, RESERVE, RawShm

# Every test runs on the native client core and on the Python reference path.
pytestmark = pytest.mark.usefixtures("client_core")


KIB = 1024
SMALL, LARGE = 100, 64 * KIB  # inline in a LOOKUP answer / leased (over INLINE_BYTES_MAX)
XXH3 = 1
wait_until = functools.partial(waiting.wait_until, timeout_s=30, step_s=0.05)


@pytest.fixture
def sock_dir():
    path = tempfile.mkdtemp(prefix="gcd")  # short: a socket path fits 107 bytes
    yield Path(path)
    for p in Path(path).iterdir():
        p.unlink()
    os.rmdir(path)


def start(server_factory, sock_dir, extra=(), **kwargs):
    sock = str(sock_dir / "n.sock")
    return server_factory(extra_args=["--unix-socket", sock, *extra], **kwargs), sock


def counters(node, token: str | None = None) -> dict:
    with gcache.Client(node.address, transport="tcp", token=token) as c:
        return c.stats()["counters"]


def lie(raw: RawShm, items: dict[bytes, bytes]) -> None:
    """RESERVE, write each value's bytes, COMMIT with the sum of other bytes: all STORED."""
    keys = list(items)
    frame = raw.request(RESERVE, {"keys": keys, "lens": [len(v) for v in items.values()]})
    assert frame.status == OK and frame.meta["st"] == [STORED] * len(keys), frame
    for off, value in zip(frame.meta["offs"], items.values()):
        raw.arena[off : off + len(value)] = value
    sums = [xxh3(b"not " + value) for value in items.values()]
    answer = raw.request(COMMIT, {"res": frame.meta["res"], "sums": sums, "ck": XXH3})
    assert answer.status == OK and answer.meta["st"] == [STORED] * len(keys)  # published unread


def results_of(call):
    """A read's results, whether it raised ChecksumMismatchError (it met a bad value) or not."""
    try:
        return call()
    except errors.ChecksumMismatchError as bad:
        return bad.results


def values_for(prefix: bytes) -> dict[bytes, bytes]:
    return {prefix + b"-small": os.urandom(SMALL), prefix + b"-large": os.urandom(LARGE)}


def test_lying_commits_are_never_read_over_any_path_and_leave(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir)
    honest = {b"honest": os.urandom(LARGE)}
    with gcache.Client(node.address, transport="shm") as writer:
        assert writer.put_batch(list(honest), list(honest.values())) == [True]
    paths = {name: values_for(name) for name in (b"tcp", b"shm", b"into", b"legacy", b"own")}
    with RawShm(sock) as liar:
        liar.attach()
        for items in paths.values():
            lie(liar, items)
        # The liar itself reads a miss over its own socket (GET_BATCH: the node checks first).
        assert liar.get(list(paths[b"own"])) == [None, None]

    with gcache.Client(node.address, transport="tcp") as tcp:
        assert tcp.get_batch(list(paths[b"tcp"])) == [None, None]
    with gcache.Client(node.address, transport="shm") as shm:
        small, large = paths[b"shm"]
        assert shm.get(small) is None  # inline: checked by the node before it is sent
        # Leased: the client's copy is checked (a ChecksumMismatchError), unless the
        # node's scrubber found the value bad first (then a plain miss); never a hit.
        assert results_of(lambda: shm.get_batch([large, b"honest"])) == [None, honest[b"honest"]]
        targets = [bytearray(SMALL), bytearray(LARGE)]
        assert results_of(lambda: shm.batch_get_into(list(paths[b"into"]), targets)) == [None, None]
    with RawShm(sock) as legacy:  # a reader that does not check leased values itself (no "vfy")
        legacy.attach()
        frame = legacy.request(LOOKUP, {"keys": list(paths[b"legacy"])})
        assert frame.status == OK and frame.meta["lens"] == [-1, -1] and not frame.meta["lease"]

    bad_values = 2 * len(paths)
    wait_until(lambda: counters(node)["checksum_failures_read"] == bad_values, "every bad value counted")
    all_keys = [k for items in paths.values() for k in items]
    with gcache.Client(node.address, transport="shm") as shm, gcache.Client(node.address, transport="tcp") as tcp:
        assert shm.get_batch(all_keys) == [None] * bad_values  # removed: misses, no error
        assert tcp.batch_is_exist(all_keys) == [False] * bad_values
        assert shm.get(b"honest") == tcp.get(b"honest") == honest[b"honest"]
    assert counters(node)["checksum_failures_read"] == bad_values  # each counted once


def test_a_lying_value_demoted_to_disk_is_a_miss_when_read_back(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir, memory="8MiB", disk="64MiB")
    with RawShm(sock) as liar:
        liar.attach()
        lie(liar, {b"cold": os.urandom(LARGE)})
    with gcache.Client(node.address, transport="tcp") as tcp:
        filler = [os.urandom(LARGE) for _ in range(256)]  # 16 MiB: "cold" leaves memory
        assert all(tcp.put_batch([b"f%d" % i for i in range(len(filler))], filler))
        wait_until(lambda: counters(node)["demotions_to_disk"] > 0, "a demotion")
        assert tcp.get(b"cold") is None
        c = counters(node)
        assert c["checksum_failures"] + c["checksum_failures_read"] == 1  # on disk, or still in memory
        assert tcp.get(b"cold") is None and tcp.batch_is_exist([b"cold"]) == [False]


def test_lying_put_batch_over_tcp_stores_nothing(server_factory, sock_dir):
    node, _sock = start(server_factory, sock_dir)
    value = os.urandom(LARGE)
    with RawConnection(node.port) as raw:
        frame = raw.request(
            3, {"keys": [b"t"], "lens": [len(value)], "sums": [xxh3(b"x")], "ck": XXH3}, value
        )  # PUT_BATCH
        assert frame.status == OK and frame.meta["st"] == [CHECKSUM_MISMATCH]
        assert raw.get([b"t"]) == [None]
    with gcache.Client(node.address, transport="shm") as shm:
        assert shm.get(b"t") is None
    assert counters(node)["checksum_failures_put"] == 1


def test_a_client_cannot_commit_or_release_another_connections_reservation(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir)
    value = os.urandom(LARGE)
    with RawShm(sock) as owner, RawShm(sock) as other:
        owner.attach()
        other.attach()
        frame = owner.request(RESERVE, {"keys": [b"mine"], "lens": [len(value)]})
        res, off = frame.meta["res"], frame.meta["offs"][0]
        stolen = other.request(COMMIT, {"res": res, "sums": [xxh3(b"evil")], "ck": XXH3})
        assert stolen.status == BAD_FRAME  # reservation ids are per connection
        other.release(reservations=[res], no_reply=False)  # ignored: not its reservation
        owner.arena[off : off + len(value)] = value
        answer = owner.request(COMMIT, {"res": res, "sums": [xxh3(value)], "ck": XXH3})
        assert answer.status == OK and answer.meta["st"] == [STORED]
    with gcache.Client(node.address, transport="shm") as shm:
        assert shm.get(b"mine") == value


TOKENS = {"alice": "alice-secret-token-0123456789", "bob": "bob-secret-token-0123456789ab"}


def test_with_tenants_a_lie_stores_nothing_and_one_sided_writes_are_refused(server_factory, sock_dir, tmp_path):
    auth = tmp_path / "auth.toml"
    auth.write_text(
        "".join(f'[tenants.{name}]\ntoken = "{token}"\nroles = ["read", "write"]\n' for name, token in TOKENS.items())
    )
    auth.chmod(0o600)
    node, sock = start(server_factory, sock_dir, extra=["--auth-file", str(auth)])
    value = os.urandom(LARGE)
    with RawConnection(node.port) as alice:
        raw_auth(alice, TOKENS["alice"])
        meta = {"keys": [b"shared"], "lens": [len(value)], "sums": [xxh3(b"x")], "ck": XXH3}
        lied = alice.request(3, meta, value)  # PUT_BATCH, hashed as it lands
        assert lied.status == OK and lied.meta["st"] == [CHECKSUM_MISMATCH]
        assert alice.get([b"shared"]) == [None]
        # One-sided writes would let a tenant write blocks outside its namespace: refused.
        for opcode, m in ((RESERVE, {"keys": [b"x"], "lens": [1]}), (COMMIT, {"res": 1, "sums": [0]})):
            refused = alice.request(opcode, m)
            assert refused.status == FORBIDDEN, opcode
    with RawShm(sock) as over_socket:  # the same over the Unix socket
        raw_auth(over_socket, TOKENS["alice"])
        assert over_socket.request(8, {}).status == FORBIDDEN  # SHM_ATTACH: no arena for a tenant
        assert over_socket.request(RESERVE, {"keys": [b"x"], "lens": [1]}).status == FORBIDDEN
    with gcache.Client(node.address, token=TOKENS["bob"]) as bob:
        assert bob.get(b"shared") is None and bob.put(b"shared", b"bob's") and bob.get(b"shared") == b"bob's"
    with gcache.Client(node.address, token=TOKENS["alice"]) as alice_client:
        assert alice_client.get(b"shared") is None  # bob's value lives in bob's namespace
    assert counters(node, TOKENS["alice"])["checksum_failures_put"] == 1


def test_the_scrubber_checks_committed_values_so_readers_copy_them_unhashed(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir)
    value = os.urandom(LARGE)
    with gcache.Client(node.address, transport="shm") as c:
        assert c.put(b"honest", value)
    with RawShm(sock) as raw:
        raw.attach()
        lie(raw, {b"liar": os.urandom(LARGE)})

        def lookup_vf():
            frame = raw.request(LOOKUP, {"keys": [b"honest", b"liar"], "ck": XXH3, "vfy": True})
            if frame.meta["lease"]:
                raw.release(leases=[frame.meta["lease"]])
            return frame.meta["vf"], frame.meta["lens"]

        # Off every request's path, the node checks both: "honest" is marked checked
        # ("vf": a leased copy needs no hash), "liar" leaves.
        wait_until(lambda: lookup_vf() == ([True, False], [LARGE, -1]), "the scrubber's pass")
    assert counters(node)["checksum_failures_read"] == 1
    with gcache.Client(node.address, transport="shm") as c:
        assert c.get_batch([b"honest", b"liar"]) == [value, None]


def test_without_the_scrubber_every_leased_copy_is_hashed_and_a_lie_is_caught_by_its_reader(server_factory, sock_dir):
    node, sock = start(server_factory, sock_dir, extra=["--no-shm-scrub"])
    honest, lying = os.urandom(LARGE), os.urandom(LARGE)
    with gcache.Client(node.address, transport="shm") as c:
        assert c.put(b"honest", honest)
    with RawShm(sock) as raw:
        raw.attach()
        lie(raw, {b"liar": lying})
        frame = raw.request(LOOKUP, {"keys": [b"honest", b"liar"], "ck": XXH3, "vfy": True})
        assert frame.meta["vf"] == [False, False]  # nobody has read them: unchecked
        raw.release(leases=[frame.meta["lease"]])
    with gcache.Client(node.address, transport="shm") as c:
        with pytest.raises(errors.ChecksumMismatchError) as info:  # found by the reader's copy
            c.get_batch([b"honest", b"liar"])
        assert info.value.results == [honest, None]
        wait_until(lambda: counters(node)["checksum_failures_read"] == 1, "the reader's report")
        assert c.get_batch([b"honest", b"liar"]) == [honest, None]  # removed: a miss now
