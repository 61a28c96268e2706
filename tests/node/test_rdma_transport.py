"""Transport "rdma" (docs/protocol.md, "RDMA").

Three layers, tested where each can run:
- without any RDMA device (every machine): the RDMA_CONNECT hook of a real
  server, the refusals and their reasons (transport="rdma", auto -> tcp, a
  server started with a missing --rdma-device exits 3);
- the whole transport with a software stand-in for the verbs layer
  (`Fabric`: RDMA hardware cannot exist here, so its READ / WRITE / key
  checks are memmove plus the checks a NIC makes), over the real native
  server, the real RDMA_CONNECT hook and the real LOOKUP / RESERVE / COMMIT;
- the verbs calls themselves (gcache.wire.rdma_verbs) only where pyverbs and a
  device exist: skipped elsewhere with the precise reason.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import threading

import msgpack
import pytest

import gcache
from gcache import _native, errors
from gcache.client.transports import rdma as rdma_transport
from gcache.client.transports import shm_ops
from gcache.server.rdma import RdmaRegion
from gcache.wire import rdma_verbs
from tests.support import waiting
from tests.support.raw_protocol import BAD_FRAME, FORBIDDEN, INTERNAL, LOOKUP, OK, RDMA_CONNECT, RawConnection
from tests.support.servers import run_server_cli

WAIT_S = 10.0
wait_until = functools.partial(waiting.wait_until, timeout_s=WAIT_S, step_s=0.01)


def host_rdma_reason(name: str | None = None) -> str | None:
    """None when this host can open an RDMA device (`name`, else the first), else why not."""
    try:
        rdma_verbs.Device(rdma_verbs.load(), name).close()
    except rdma_verbs.RdmaUnavailable as exc:
        return str(exc)
    return None


HOST_REASON = host_rdma_reason()


def native_config(tmp_path, **extra) -> dict:
    return {"port": 0, "data_dir": str(tmp_path / "data"), "memory_bytes": 16 << 20, "disk_bytes": 0, **extra}


# -- without a device: refusals and their reasons ------------------------------


def test_rdma_connect_without_handler_is_refused_and_the_connection_stays(server):
    with RawConnection(server.port) as c:
        frame = c.request(RDMA_CONNECT, {"qpn": 7, "psn": 1, "lid": 0, "gid": rdma_verbs.ZERO_GID, "mtu": 3})
        assert frame.status == FORBIDDEN
        assert frame.meta["error"] == (
            "this gcache-server has no RDMA (start it with --rdma-device NAME); use transport='tcp'"
        )
        assert c.ping()["version"]


@pytest.mark.skipif(HOST_REASON is None, reason="this host has a usable RDMA device")
def test_transport_rdma_names_why_it_is_unavailable(server):
    with pytest.raises(errors.TransportUnavailableError) as info:
        gcache.Client(server.address, transport="rdma")
    assert str(info.value) == f"RDMA is not usable here: {HOST_REASON}"
    if HOST_REASON.startswith("pyverbs is not importable"):
        assert rdma_verbs.PYVERBS_INSTALL_HINT in HOST_REASON
    else:  # pyverbs is there, the kernel has no device
        assert HOST_REASON.startswith("no RDMA device")


def test_transport_rdma_refuses_a_token_before_touching_a_device():
    with pytest.raises(errors.TransportUnavailableError, match="RDMA is off with authentication"):
        rdma_transport.RdmaTransport("127.0.0.1:1", 1.0, 1.0, token="t0ken")


@pytest.mark.skipif(HOST_REASON is None, reason="this host has a usable RDMA device")
def test_auto_falls_back_to_tcp_without_shm_and_rdma(server_factory, monkeypatch):
    monkeypatch.delenv("GCACHE_TRANSPORT", raising=False)
    node = server_factory(extra_args=("--unix-socket", ""))  # no shm either
    with gcache.Client(node.address) as client:
        assert client.transport == "tcp"
        value = os.urandom(70_000)
        assert client.put(b"k", value) is True
        assert client.get(b"k") == value


@pytest.mark.process
@pytest.mark.skipif(HOST_REASON is None, reason="this host has a usable RDMA device")
def test_server_with_a_missing_rdma_device_exits_3(tmp_path):
    name = "gcache_no_such_device"
    expected = host_rdma_reason(name)
    proc = run_server_cli(
        "--port",
        "0",
        "--admin-port",
        "0",
        "--data-dir",
        str(tmp_path / "data"),
        "--memory",
        "16MiB",
        "--disk",
        "0",
        "--rdma-device",
        name,
    )
    assert proc.returncode == 3, proc.stderr
    assert f"--rdma-device {name}: {expected}" in proc.stderr
    assert not (tmp_path / "data").exists(), "the device is checked before the store opens"


@pytest.mark.process
def test_server_refuses_rdma_with_authentication(tmp_path):
    from gcache.tools.devcluster.local_security import write_auth_file

    proc = run_server_cli(
        "--port",
        "0",
        "--admin-port",
        "0",
        "--data-dir",
        str(tmp_path / "data"),
        "--memory",
        "16MiB",
        "--disk",
        "0",
        "--rdma-device",
        "mlx5_0",
        "--auth-file",
        str(write_auth_file(tmp_path / "auth")),
    )
    assert proc.returncode == 2, proc.stderr
    assert "--rdma-device with --auth-file: RDMA would reach every tenant's values" in proc.stderr
    assert not (tmp_path / "data").exists()


# -- the RDMA_CONNECT hook of the native server (no hardware involved) ---------


class RecordingHandler:
    """An RDMA_CONNECT handler that records its calls and answers as told."""

    def __init__(self):
        self.calls: list[tuple[int, bytes]] = []
        self.closed_ids: list[int] = []
        self.answer = lambda conn_id, meta: msgpack.packb({"conn": conn_id, "echo": meta})

    def __call__(self, conn_id, meta):
        self.calls.append((conn_id, meta))
        return self.answer(conn_id, meta)

    def closed(self, conn_id):
        self.closed_ids.append(conn_id)


def test_rdma_connect_hook_passes_meta_and_connection_ids_and_reports_closes(tmp_path):
    server = _native.Server(native_config(tmp_path))
    handler = RecordingHandler()
    server.set_rdma_connect_handler(handler)
    server.start()
    try:
        meta = msgpack.packb({"qpn": 5, "anything": b"\x00\xff"})
        with RawConnection(server.port) as a, RawConnection(server.port) as b:
            first = a.request(RDMA_CONNECT, meta)
            again = a.request(RDMA_CONNECT, meta)  # the same connection keeps its id
            other = b.request(RDMA_CONNECT, meta)
            assert (first.status, again.status, other.status) == (OK, OK, OK)
            id_a, id_b = first.meta["conn"], other.meta["conn"]
            assert again.meta["conn"] == id_a and id_a != id_b
            assert first.meta["echo"] == meta
            assert handler.calls == [(id_a, meta), (id_a, meta), (id_b, meta)]

            handler.answer = lambda conn_id, m: (_ for _ in ()).throw(ValueError("qpn 5 is not mine"))
            frame = a.request(RDMA_CONNECT, meta)
            assert (frame.status, frame.meta["error"]) == (BAD_FRAME, "qpn 5 is not mine")
            handler.answer = lambda conn_id, m: (_ for _ in ()).throw(RuntimeError("device gone"))
            frame = a.request(RDMA_CONNECT, meta)
            assert (
                frame.status == INTERNAL and "the RDMA handler failed: RuntimeError: device gone" in frame.meta["error"]
            )
            handler.answer = lambda conn_id, m: "not bytes"
            frame = a.request(RDMA_CONNECT, meta)
            assert frame.status == INTERNAL and "returned <class 'str'>, not bytes" in frame.meta["error"]
            handler.answer = lambda conn_id, m: msgpack.packb([1, 2])
            frame = a.request(RDMA_CONNECT, meta)
            assert frame.status == INTERNAL and "is not a msgpack map" in frame.meta["error"]
            assert a.ping()["version"]  # every refusal left the connection usable
            assert handler.closed_ids == []
        wait_until(lambda: sorted(handler.closed_ids) == sorted([id_a, id_b]), "closed() of both connections")

        with RawConnection(server.port) as c:  # a connection without RDMA_CONNECT: no closed()
            assert c.ping()["version"]
        server.set_rdma_connect_handler(None)
        with RawConnection(server.port) as c:
            assert c.request(RDMA_CONNECT, meta).status == FORBIDDEN
        assert sorted(handler.closed_ids) == sorted([id_a, id_b])
        with pytest.raises(TypeError, match="closed"):
            server.set_rdma_connect_handler(lambda conn_id, m: b"\x80")
    finally:
        server.stop(1)


def test_endpoint_checks_name_the_bad_field():
    good = {"qpn": 9, "psn": 3, "lid": 0, "gid": "FE80:0000:0000:0000:0000:0000:0000:0001", "mtu": 5}
    assert rdma_verbs.parse_endpoint(good) == {**good, "gid": good["gid"].lower()}
    for field, value in (
        ("qpn", 0),
        ("qpn", 1 << 24),
        ("psn", -1),
        ("mtu", 6),
        ("lid", True),
        ("gid", "fe80::1"),
        ("gid", None),
    ):
        with pytest.raises(ValueError, match=repr(field)):
            rdma_verbs.parse_endpoint({**good, field: value})


def test_gid_choice_prefers_a_routable_roce_v2_gid():
    fe80 = "fe80:0000:0000:0000:0000:0000:0000:0001"
    v4 = "0000:0000:0000:0000:0000:ffff:0a00:0001"
    table = [(0, fe80, False), (1, fe80, True), (2, v4, False), (3, v4, True)]
    assert rdma_verbs.choose_gid_index(table, ethernet=True) == 3
    assert rdma_verbs.choose_gid_index(table[:3], ethernet=True) == 1
    assert rdma_verbs.choose_gid_index([(0, rdma_verbs.ZERO_GID, True), (4, fe80, False)], ethernet=True) == 4
    assert rdma_verbs.choose_gid_index(table, ethernet=False) == 0
    with pytest.raises(rdma_verbs.RdmaUnavailable, match="no usable GID"):
        rdma_verbs.choose_gid_index([(0, rdma_verbs.ZERO_GID, True)], ethernet=True)


def _pyverbs_reason() -> str | None:
    try:
        rdma_verbs.load()
    except rdma_verbs.RdmaUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.skipif(_pyverbs_reason() is not None, reason=f"needs pyverbs: {_pyverbs_reason()}")
def test_queue_pair_attributes_and_work_requests_build_with_the_real_pyverbs():
    """The verbs structures need no device: their field names and values are checked here."""
    verbs = rdma_verbs.load()
    local = type("Local", (), {"port": 1, "mtu": 5, "ethernet": True, "gid_index": 3, "rd_atomic": 16})
    peer = rdma_verbs.parse_endpoint(
        {"qpn": 0x1234, "psn": 99, "lid": 0, "mtu": 3, "gid": "0000:0000:0000:0000:0000:ffff:0a00:0002"}
    )
    attr = rdma_verbs.connect_attributes(verbs, local, peer, psn=7)
    assert (attr.path_mtu, attr.dest_qp_num, attr.rq_psn, attr.sq_psn) == (3, 0x1234, 99, 7)
    assert (attr.max_dest_rd_atomic, attr.max_rd_atomic, attr.min_rnr_timer) == (16, 16, 12)
    assert (attr.timeout, attr.retry_cnt, attr.rnr_retry) == (14, 7, 7)
    route = attr.ah_attr
    assert (route.is_global, route.port_num, route.sgid_index, route.hop_limit) == (1, 1, 3, 64)
    assert route.dgid == peer["gid"]
    local.ethernet = False  # InfiniBand with a LID: routed by LID, no GRH
    attr = rdma_verbs.connect_attributes(verbs, local, {**peer, "lid": 5}, psn=7)
    assert (attr.ah_attr.is_global, attr.ah_attr.dlid) == (0, 5)
    for write, opcode in ((True, verbs.e.IBV_WR_RDMA_WRITE), (False, verbs.e.IBV_WR_RDMA_READ)):
        wr = rdma_verbs.work_request(verbs, write, 4096, 11, 8192, 22, 100, wr_id=5)
        assert (wr.wr_id, wr.opcode, wr.num_sge, wr.send_flags) == (5, opcode, 1, verbs.e.IBV_SEND_SIGNALED)


# -- the whole transport over a software stand-in for the verbs layer ----------

REM_ACCESS_ERR, LOC_PROT_ERR, WR_FLUSH_ERR = 10, 4, 5


class FakeVerbsError(Exception):
    pass


class Fabric:
    """Memory regions and queue pairs of one process, moving bytes as a NIC would:
    a work request must name a registered local region (lkey) and a remote one
    open to peers (rkey), inside their bounds, on a connected queue pair."""

    def __init__(self):
        self.regions: dict[int, tuple[int, int, bool]] = {}  # key -> (addr, length, remote)
        self.qps: dict[int, FakeQueuePair] = {}
        self.keys = itertools.count(0x1000)
        self.lock = threading.Lock()
        self.fail_status = 0  # completion status of the next fail_left work requests
        self.fail_left = 0
        self.corrupt_next_read = False  # flip a byte of the next READ's landed bytes
        self.reads = self.writes = 0
        self.closed: dict[str, int] = {}  # queue pairs closed, by device name

    def fail(self, status: int, times: int = 1) -> None:
        self.fail_status, self.fail_left = status, times

    def device(self, name: str) -> FakeDevice:
        return FakeDevice(self, name)


class FakeMR:
    def __init__(self, fabric: Fabric, addr: int, length: int, remote: bool):
        self.fabric, self.buf, self.length = fabric, addr, length
        self.lkey = self.rkey = next(fabric.keys)
        fabric.regions[self.lkey] = (addr, length, remote)

    def close(self):
        self.fabric.regions.pop(self.lkey, None)


class FakeDevice:
    v = type("verbs", (), {"PyverbsError": FakeVerbsError})
    port, gid_index = 1, 0

    def __init__(self, fabric: Fabric, name: str):
        self.fabric, self.name = fabric, name

    def register(self, address, length, remote):
        return FakeMR(self.fabric, address, length, remote)

    def queue_pair(self, depth):
        return FakeQueuePair(self.fabric, depth, self.name)

    def close(self):
        pass


class FakeQueuePair:
    def __init__(self, fabric: Fabric, depth: int, owner: str):
        self.fabric, self.depth, self.owner = fabric, depth, owner
        self.qp_num = next(fabric.keys)
        self.psn = 77
        self.peer: int | None = None
        self.failed = False
        self.done: list[tuple[int, int]] = []
        fabric.qps[self.qp_num] = self

    def endpoint(self):
        return {
            "qpn": self.qp_num,
            "psn": self.psn,
            "lid": 0,
            "gid": "fe80:0000:0000:0000:0000:0000:0000:0001",
            "mtu": 5,
        }

    def connect(self, peer):
        if peer["qpn"] not in self.fabric.qps:
            raise FakeVerbsError(f"no queue pair {peer['qpn']}")
        self.peer = peer["qpn"]

    def _inside(self, key, addr, length, remote):
        region = self.fabric.regions.get(key)
        return (
            region is not None
            and (region[2] or not remote)
            and region[0] <= addr
            and addr + length <= region[0] + region[1]
        )

    def post(self, write, local_addr, lkey, remote_addr, rkey, length, wr_id):
        if self.peer is None:
            raise FakeVerbsError("post on a queue pair that is not connected")
        if len(self.done) >= self.depth:
            raise FakeVerbsError("send queue full")
        f = self.fabric
        peer = f.qps.get(self.peer)
        status = 0
        if self.failed:
            status = WR_FLUSH_ERR
        elif f.fail_left:
            status, f.fail_left = f.fail_status, f.fail_left - 1
        elif not self._inside(lkey, local_addr, length, remote=False):
            status = LOC_PROT_ERR
        elif peer is None or not self._inside(rkey, remote_addr, length, remote=True):
            status = REM_ACCESS_ERR
        if status:
            self.failed = True  # a failed work request puts an RC queue pair in the error state
        elif write:
            ctypes.memmove(remote_addr, local_addr, length)
            f.writes += 1
        else:
            ctypes.memmove(local_addr, remote_addr, length)
            f.reads += 1
            if f.corrupt_next_read:
                f.corrupt_next_read = False
                byte = ctypes.c_ubyte.from_address(local_addr)
                byte.value ^= 0xFF
        self.done.append((wr_id, status))

    def poll(self, most):
        out, self.done = self.done[:most], self.done[most:]
        return out

    def close(self):
        if self.fabric.qps.pop(self.qp_num, None) is not None:
            self.fabric.closed[self.owner] = self.fabric.closed.get(self.owner, 0) + 1


@pytest.fixture
def fabric_node(tmp_path, monkeypatch):
    """An in-process native server whose arena is 'registered' on a Fabric, and
    clients whose rdma_verbs device is that Fabric. Yields (server, region, fabric)."""
    monkeypatch.delenv("GCACHE_TRANSPORT", raising=False)
    fabric = Fabric()
    monkeypatch.setattr(rdma_verbs, "load", lambda: None)
    monkeypatch.setattr(rdma_verbs, "Device", lambda verbs, name: fabric.device(name or "fake0"))
    server = _native.Server(native_config(tmp_path))
    region = RdmaRegion(server, fabric.device("fake-server0"))
    server.start()
    try:
        yield server, region, fabric
    finally:
        server.stop(1)
        region.close()


def values_for(n: int, seed: int) -> dict[bytes, bytes]:
    rng = __import__("random").Random(seed)
    return {f"key-{seed}-{i}".encode(): rng.randbytes(rng.choice([0, 1, 63, 4096, 70_000, 300_000])) for i in range(n)}


def test_rdma_transport_roundtrips_through_rounds_of_a_small_staging_buffer(fabric_node, monkeypatch):
    server, region, fabric = fabric_node
    monkeypatch.setattr(rdma_transport, "STAGING_BYTES", 256 << 10)  # forces rounds and one growth
    items = values_for(40, seed=1)
    big = os.urandom(600_000)  # larger than the staging buffer: it grows
    with gcache.Client(f"127.0.0.1:{server.port}", pool_size=2) as client:
        assert client.transport == "rdma"  # auto: no Unix socket here, the fabric is the device
        assert client.put_batch(list(items), list(items.values())) == [True] * len(items)
        assert client.put(b"big", big) is True
        assert client.put(b"big", b"other") is True  # EXISTS: immutable, still a success
        keys = list(items) + [b"big", b"missing"]
        assert client.get_batch(keys) == list(items.values()) + [big, None]
        buffers = [bytearray(len(v) + 5) for v in items.values()]
        sizes = client.batch_get_into(list(items), buffers)
        assert sizes == [len(v) for v in items.values()]
        assert all(bytes(b[: len(v)]) == v and b[len(v) :] == bytes(5) for b, v in zip(buffers, items.values()))
        assert region.queue_pairs() >= 1
    moved = sum(1 for v in items.values() if v)  # an empty value needs no work request
    # Values up to INLINE_BYTES_MAX come inside the LOOKUP answer: only larger ones are READ.
    leased = sum(1 for v in items.values() if len(v) > shm_ops.INLINE_BYTES_MAX)
    assert (fabric.writes, fabric.reads) == (moved + 1, 2 * leased + 1)
    with gcache.Client(f"127.0.0.1:{server.port}", transport="tcp") as tcp:  # the bytes are the server's
        assert tcp.get_batch(keys) == list(items.values()) + [big, None]
    wait_until(lambda: region.queue_pairs() == 0, "the server to destroy every closed connection's queue pair")


def test_a_value_corrupted_on_the_wire_is_never_returned(fabric_node):
    server, region, fabric = fabric_node
    value = os.urandom(40_000)  # over shm_ops.INLINE_BYTES_MAX: READ, not inline
    with gcache.Client(f"127.0.0.1:{server.port}", transport="rdma", retries=0) as client:
        assert client.put(b"k", value) is True
        fabric.corrupt_next_read = True
        with pytest.raises(errors.ChecksumMismatchError) as info:
            client.get_batch([b"k"])
        assert info.value.keys == [b"k"] and info.value.results == [None]
        assert client.get(b"k") == value  # the stored bytes were never touched


def test_a_failed_work_request_breaks_only_its_connection(fabric_node):
    server, region, fabric = fabric_node
    value = os.urandom(40_000)  # over shm_ops.INLINE_BYTES_MAX: READ, not inline
    with gcache.Client(f"127.0.0.1:{server.port}", transport="rdma", pool_size=1, retries=1) as client:
        assert client.put(b"k", value) is True
        assert fabric.closed == {}
        fabric.fail(REM_ACCESS_ERR)
        assert client.get(b"k") == value  # retried on a fresh connection and queue pair
        assert fabric.closed.get("fake0") == 1 and fabric.fail_left == 0
        fabric.fail(REM_ACCESS_ERR)
        assert client.put(b"k2", value) is True  # a failed WRITE: the retry's RESERVE + COMMIT store it
        assert client.get(b"k2") == value
        assert fabric.closed.get("fake0") == 2
        wait_until(lambda: fabric.closed.get("fake-server0") == 2, "the server to drop both broken queue pairs")
        assert region.queue_pairs() == 1
        fabric.fail(REM_ACCESS_ERR, times=3)  # the first try, and each retry (an idle one is retried once more)
        with pytest.raises(errors.ConnectionError, match="work completion status 10"):
            client.get(b"k")
        assert client.get(b"k") == value


def test_a_server_without_rdma_refuses_and_auto_uses_tcp(tmp_path, monkeypatch):
    monkeypatch.delenv("GCACHE_TRANSPORT", raising=False)
    fabric = Fabric()
    monkeypatch.setattr(rdma_verbs, "load", lambda: None)
    monkeypatch.setattr(rdma_verbs, "Device", lambda verbs, name: fabric.device("fake0"))
    server = _native.Server(native_config(tmp_path))  # no RdmaRegion: RDMA_CONNECT refused
    server.start()
    try:
        address = f"127.0.0.1:{server.port}"
        with pytest.raises(errors.TransportUnavailableError, match="refused RDMA: .*--rdma-device NAME"):
            gcache.Client(address, transport="rdma")
        assert fabric.qps == {} and fabric.closed == {"fake0": 1}  # the client's queue pair did not leak
        with gcache.Client(address) as client:
            assert client.transport == "tcp"
            assert client.put(b"k", b"v") is True and client.get(b"k") == b"v"
    finally:
        server.stop(1)


def test_lookup_answers_carry_the_registered_region(fabric_node):
    server, region, fabric = fabric_node
    with RawConnection(server.port) as c:
        frame = c.request(LOOKUP, {"keys": [b"absent"]})
        assert frame.status == OK
        assert (frame.meta["addr"], frame.meta["rkey"]) == (server.arena_address, region.mr.rkey)


# -- the verbs calls themselves: only with pyverbs and a device ----------------


@pytest.mark.skipif(HOST_REASON is not None, reason=f"needs an RDMA device: {HOST_REASON}")
def test_real_device_roundtrip(server_factory, monkeypatch):
    monkeypatch.delenv("GCACHE_TRANSPORT", raising=False)
    device = os.environ.get(rdma_verbs.RDMA_DEVICE_ENV) or rdma_verbs.device_names(rdma_verbs.load())[0]
    node = server_factory(extra_args=("--unix-socket", "", "--rdma-device", device))
    items = values_for(30, seed=7)
    with gcache.Client(node.address, transport="rdma") as client:
        assert client.transport == "rdma"
        assert client.put_batch(list(items), list(items.values())) == [True] * len(items)
        assert client.get_batch(list(items) + [b"missing"]) == list(items.values()) + [None]


def test_a_bad_endpoint_is_answered_bad_frame_and_leaks_no_queue_pair(fabric_node):
    server, region, fabric = fabric_node
    endpoint = {"qpn": 0, "psn": 1, "lid": 0, "gid": rdma_verbs.ZERO_GID, "mtu": 5}
    with RawConnection(server.port) as c:
        frame = c.request(RDMA_CONNECT, endpoint)
        assert frame.status == BAD_FRAME
        assert frame.meta["error"] == "RDMA endpoint field 'qpn' must be an integer in [1, 16777215], got 0"
        frame = c.request(RDMA_CONNECT, {**endpoint, "qpn": 12345})  # no such queue pair on the fabric
        assert frame.status == BAD_FRAME and frame.meta["error"].startswith(
            "cannot connect a queue pair to the client's endpoint"
        )
        assert region.queue_pairs() == 0 and fabric.closed == {"fake-server0": 1}
        assert c.ping()["version"]


def test_dropping_a_server_with_rdma_connections_open_does_not_hang(tmp_path):
    server = _native.Server(native_config(tmp_path))
    handler = RecordingHandler()
    server.set_rdma_connect_handler(handler)
    server.start()
    c = RawConnection(server.port)
    try:
        assert c.request(RDMA_CONNECT, {}).status == OK
        del server  # stops with the GIL released: the connection's closed() can run
        assert handler.closed_ids == [handler.calls[0][0]]
    finally:
        c.close()


def test_concurrent_rdma_puts_each_get_a_reservation_share(tmp_path, monkeypatch):
    # A small reservation budget (4 MiB: 1 MiB per connection, so 512 KiB put chunks),
    # three threads putting at once from one address: each RDMA connection holds its
    # own share, so no put is refused for the budget (one shared share refused some).
    import threading

    monkeypatch.delenv("GCACHE_TRANSPORT", raising=False)
    fabric = Fabric()
    monkeypatch.setattr(rdma_verbs, "load", lambda: None)
    monkeypatch.setattr(rdma_verbs, "Device", lambda verbs, name: fabric.device(name or "fake0"))
    server = _native.Server(native_config(tmp_path, memory_bytes=64 << 20, put_reserve_bytes_max=4 << 20))
    region = RdmaRegion(server, fabric.device("fake-server0"))
    server.start()
    failures: list[str] = []
    try:
        with gcache.Client(f"127.0.0.1:{server.port}", transport="rdma", pool_size=4) as client:

            def put_batches(t: int) -> None:
                for b in range(4):
                    keys = [b"t%d-b%d-%d" % (t, b, i) for i in range(8)]
                    values = [bytes([t, b, i]) * (256 * 1024 // 3) for i in range(8)]
                    if client.put_batch(keys, values) != [True] * 8:
                        failures.append(f"thread {t} batch {b} not stored")
                    elif client.get_batch(keys) != values:
                        failures.append(f"thread {t} batch {b} read back wrong")

            threads = [threading.Thread(target=put_batches, args=(t,)) for t in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert not any(t.is_alive() for t in threads)
            assert client._transport.put_chunk_bytes == 512 << 10
        assert failures == []
        assert server.stats()["counters"]["puts_reserve_refused"] == 0
    finally:
        server.stop(1)
        region.close()
