"""Device (GPU) arrays in get_into / batch_get_into / put_from / batch_put_from, staged
through pinned host memory (gcache.client.device.staging), against a real gcache-server
over tcp and shm.

Without a GPU the device is HostMemoryBackend: "device memory" is host memory exposed
through __cuda_array_interface__ (FakeDeviceArray), and its copies are memmoves run in
stream order only when waited for, so a slot read before its copy ran, or reused before
its copy ran, shows as wrong bytes. The chunking and staging code is the one a GPU runs.
The tests at the bottom use a real cupy + GPU and skip without one.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

import gcache
from bench.gpu.host_cupy import HostArray, HostCupy
from gcache import errors
from gcache.client.device import arrays as device_arrays
from gcache.client.device import staging as device_buffers
from gcache.client.device.arrays import HostMemoryBackend
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.process  # starts processes

TRANSPORTS = ["tcp", "shm"]
STAGING = 32 * 1024  # 4 slots of 8 KiB: a few dozen small values wrap around the slots
SLOT = 8 * 1024
SENTINEL = 0xEE


class FakeDeviceArray:
    """Host memory that presents itself only as a device array (no buffer protocol)."""

    def __init__(self, host: np.ndarray, readonly: bool = False):
        self.host = host
        self.readonly = readonly

    @property
    def __cuda_array_interface__(self) -> dict:
        cai = dict(self.host.__array_interface__)
        cai["data"] = (cai["data"][0], self.readonly)
        cai.update(version=3, stream=None)
        return cai


def device(nbytes: int, fill: int = SENTINEL) -> FakeDeviceArray:
    return FakeDeviceArray(np.full(nbytes, fill, dtype=np.uint8))


def payloads(seed: int, sizes: list[int]) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in sizes]


def packed(values: list[bytes], gap: int = 0) -> tuple[FakeDeviceArray, list[int], list[int]]:
    """One device buffer holding the values back to back (`gap` sentinel bytes after each)."""
    offsets, at = [], 0
    for v in values:
        offsets.append(at)
        at += len(v) + gap
    buf = device(at)
    for off, v in zip(offsets, values):
        buf.host[off : off + len(v)] = np.frombuffer(v, np.uint8)
    return buf, offsets, [len(v) for v in values]


@pytest.fixture(scope="module")
def server_address(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("device") / "node").start()
    yield server.address
    server.kill()


@pytest.fixture(params=TRANSPORTS)
def staged(request, server_address):
    """(client on this transport, its HostMemoryBackend staging, key prefix)."""
    client = gcache.Client(server_address, transport=request.param)
    assert client.transport == request.param
    staging = device_buffers.attach(client, HostMemoryBackend(), staging_bytes=STAGING, slot_bytes=SLOT)
    yield client, staging, f"{request.node.name}/".encode()
    client.close()


def test_round_trip_exact_bytes_across_slots_and_staging_bound(staged):
    client, staging, prefix = staged
    # 40 small values (several per slot, 4 slots reused many times), two larger than a
    # slot (one after the other through the whole staging buffer), one larger than it.
    sizes = [1 + (i * 977) % 3000 for i in range(40)] + [12 * 1024, 50 * 1024, 10 * 1024]
    values = payloads(1, sizes)
    keys = [prefix + b"%d" % i for i in range(len(values))]
    src, offsets, lens = packed(values)

    assert client.batch_put_from(keys, src, sizes=lens, offsets=offsets) == [True] * len(keys)
    assert client.get_batch(keys) == values  # stored bytes, read back on the host path

    gap = 16  # each target is larger than its value: the tail must stay untouched
    dst, dst_offsets, _ = packed([b"\0" * n for n in sizes], gap)
    dst.host[:] = SENTINEL
    capacities = [n + gap for n in sizes]
    assert client.batch_get_into(keys, dst, sizes=capacities, offsets=dst_offsets) == sizes
    for off, value in zip(dst_offsets, values):
        assert dst.host[off : off + len(value)].tobytes() == value
        assert dst.host[off + len(value) : off + len(value) + gap].tobytes() == bytes([SENTINEL]) * gap

    # Staging was allocated once (lazily, its configured size); only the value larger
    # than the whole staging buffer took a temporary one, once per direction.
    assert staging.backend.pinned_allocations == [STAGING, 50 * 1024, 50 * 1024]
    assert staging.stats["large"] == 6
    assert staging.stats["chunks"] > 2 * staging.slot_count  # slots were reused in both directions


def test_list_of_device_arrays_and_mixed_host_buffers(staged):
    client, _, prefix = staged
    values = payloads(2, [5000, 100, 7000, 3, 9000])
    keys = [prefix + b"%d" % i for i in range(len(values))]
    sources = [FakeDeviceArray(np.frombuffer(v, np.uint8).copy()) for v in values]
    sources[1] = bytearray(values[1])  # a host buffer among device arrays
    assert client.batch_put_from(keys, sources) == [True] * 5
    assert client.get_batch(keys) == values

    targets = [device(len(v) + 1) for v in values]
    host_target = bytearray(b"\xee" * 200)
    targets[3] = host_target
    assert client.batch_get_into(keys, targets) == [len(v) for v in values]
    for i, (target, value) in enumerate(zip(targets, values)):
        got = bytes(host_target) if i == 3 else target.host.tobytes()
        assert got[: len(value)] == value
        assert got[len(value) :] == bytes([SENTINEL]) * (len(got) - len(value))


def test_single_key_calls_with_offset_and_size(staged):
    client, _, prefix = staged
    value = payloads(3, [3000])[0]
    src = device(4000)
    src.host[500:3500] = np.frombuffer(value, np.uint8)
    assert client.put_from(prefix + b"k", src, 500, 3000) is True
    assert client.get(prefix + b"k") == value
    dst = device(5000)
    assert client.get_into(prefix + b"k", dst, 1000, 3000) == 3000
    assert dst.host[1000:4000].tobytes() == value
    assert dst.host[:1000].tobytes() + dst.host[4000:].tobytes() == bytes([SENTINEL]) * 2000


def test_misses_are_none_and_leave_targets_untouched(staged):
    client, _, prefix = staged
    value = payloads(4, [2000])[0]
    assert client.put(prefix + b"hit", value)
    keys = [prefix + b"miss0", prefix + b"hit", prefix + b"miss1"]
    targets = [device(2000), device(2000), device(20 * 1024)]  # the last one is a large slot
    assert client.batch_get_into(keys, targets) == [None, 2000, None]
    assert targets[1].host.tobytes() == value
    for t in (targets[0], targets[2]):
        assert t.host.tobytes() == bytes([SENTINEL]) * len(t.host)
    assert client.get_into(prefix + b"miss2", targets[0]) is None


def test_too_small_targets_raise_after_the_rest_is_read(staged):
    client, _, prefix = staged
    values = payloads(5, [1000, 3000, 2000, 20 * 1024])
    keys = [prefix + b"%d" % i for i in range(4)]
    assert client.put_batch(keys, values) == [True] * 4
    # key 1 gets a chunk slot too small for it; key 3 a large target (> a slot) too small for it.
    targets = [device(1000), device(2999), device(2000), device(18 * 1024)]
    with pytest.raises(errors.BufferTooSmallError) as caught:
        client.batch_get_into(keys, targets)
    exc = caught.value
    assert exc.keys == [keys[1], keys[3]]
    assert exc.sizes == [3000, 20 * 1024]
    assert exc.results == [1000, None, 2000, None]
    assert targets[0].host.tobytes() == values[0]
    assert targets[2].host.tobytes() == values[2]
    for t in (targets[1], targets[3]):
        assert t.host.tobytes() == bytes([SENTINEL]) * len(t.host)
    with pytest.raises(errors.BufferTooSmallError) as caught:
        client.get_into(keys[1], device(10))
    assert caught.value.sizes == [3000]


def test_bad_device_arrays_are_refused_and_nothing_is_stored(staged):
    client, staging, prefix = staged
    strided = FakeDeviceArray(np.zeros(4096, dtype=np.uint8)[::2])  # not C-contiguous
    with pytest.raises(errors.InvalidArgumentError, match="not C-contiguous"):
        client.batch_put_from([prefix + b"a", prefix + b"b"], [device(10), strided])
    with pytest.raises(errors.InvalidArgumentError, match="not C-contiguous"):
        client.get_into(prefix + b"a", strided)
    with pytest.raises(errors.InvalidArgumentError, match="read-only"):
        client.batch_get_into([prefix + b"a"], [FakeDeviceArray(np.zeros(10, np.uint8), readonly=True)])
    with pytest.raises(errors.InvalidArgumentError, match="pass offsets and sizes"):
        client.batch_put_from([prefix + b"a"], device(10))
    with pytest.raises(errors.InvalidArgumentError, match="runs past the end"):
        client.batch_put_from([prefix + b"a"], device(10), sizes=[11], offsets=[0])
    with pytest.raises(errors.InvalidArgumentError, match="1 keys but 2 buffers"):
        client.batch_get_into([prefix + b"a"], [device(10), device(10)])
    # Calls that take host buffers only say which calls take device arrays.
    with pytest.raises(errors.InvalidArgumentError, match="batch_get_into / put_from"):
        client.put(prefix + b"a", device(10))
    assert client.batch_is_exist([prefix + b"a", prefix + b"b"]) == [False, False]
    assert staging.backend.copies == 0


def test_c_contiguous_multi_dimensional_device_array(staged):
    client, _, prefix = staged
    host = np.arange(3 * 256, dtype=np.float32).reshape(3, 256)
    assert client.put_from(prefix + b"f", FakeDeviceArray(host)) is True
    assert client.get(prefix + b"f") == host.tobytes()
    out = FakeDeviceArray(np.zeros((3, 256), dtype=np.float32))
    assert client.get_into(prefix + b"f", out) == host.nbytes
    assert np.array_equal(out.host, host)


def test_staging_rejects_sizes_without_two_slots():
    with pytest.raises(errors.InvalidArgumentError, match="two slots"):
        device_buffers.DeviceStaging(HostMemoryBackend(), staging_bytes=SLOT, slot_bytes=SLOT)


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_without_cupy_a_device_array_gets_a_clear_error(server_address):
    with gcache.Client(server_address, transport="tcp") as client:
        with pytest.raises(device_arrays.DeviceUnavailableError, match="cupy is not importable"):
            client.batch_get_into([b"k"], [device(10)])


# -- the cupy glue, against a stand-in cupy made of host memory (bench/gpu/host_cupy.py) ----


@pytest.fixture
def stand_in_cupy(monkeypatch):
    cupy = HostCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy.module)
    return cupy


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cupy_backend_glue_round_trip(stand_in_cupy, server_address, transport):
    values = payloads(6, [100, 5 * 1024 * 1024, 3000])  # the middle one is larger than a slot
    keys = [f"glue/{transport}/{i}".encode() for i in range(3)]
    with gcache.Client(server_address, transport=transport) as client:
        sources = [HostArray(np.frombuffer(v, np.uint8).copy()) for v in values]
        assert client.batch_put_from(keys, sources) == [True] * 3
        assert client.get_batch(keys) == values
        targets = [HostArray(np.zeros(len(v), np.uint8)) for v in values]
        assert client.batch_get_into(keys, targets) == [len(v) for v in values]
        assert [t.host.tobytes() for t in targets] == values
        staging = device_buffers.staging_for(client)
    assert isinstance(staging.backend, device_arrays.CupyBackend)
    assert stand_in_cupy.pinned[0][1] - stand_in_cupy.pinned[0][0] == device_buffers.STAGING_BYTES_DEFAULT
    assert stand_in_cupy.copies == {1: 3, 2: 3}
    assert stand_in_cupy.waited_on == {0, 1}  # the current stream and the arrays' (legacy) stream


def test_gpu_check_script_runs_end_to_end_on_the_stand_in(stand_in_cupy, capsys):
    gpu_check = importlib.import_module("bench.store.gpu_check")
    rc = gpu_check.main(
        ["--batch", "4", "--value-size", "64KiB", "--runs", "2", "--memory", "256MiB", "--transports", "tcp,shm"]
    )
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "every transport correct into and out of device memory" in out.out
    for transport in TRANSPORTS:
        assert f"{transport}: correctness\n  OK" in out.out
        assert any(line.startswith(f"{transport:9}  get  ") for line in out.out.splitlines())
    assert "working set: 4 x 64 KiB = 0 MiB per batch; 2 runs" in out.out


# -- a real GPU -------------------------------------------------------------------------


def _cupy_device_count() -> int:
    if importlib.util.find_spec("cupy") is None:
        return 0
    import cupy

    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        return 0


@pytest.fixture
def cupy_module():
    cupy = pytest.importorskip("cupy", reason="cupy is not installed (pip install cupy-cuda12x)")
    if _cupy_device_count() < 1:
        pytest.skip("cupy is installed but no CUDA device is visible")
    return cupy


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cupy_round_trip_on_a_gpu(cupy_module, server_address, transport):
    cupy = cupy_module
    values = payloads(7, [1 + (i * 7919) % (300 * 1024) for i in range(64)])
    keys = [f"cupy/{transport}/{i}".encode() for i in range(len(values))]
    with gcache.Client(server_address, transport=transport) as client:
        host = np.frombuffer(b"".join(values), np.uint8)
        src = cupy.asarray(host)
        offsets = np.cumsum([0] + [len(v) for v in values[:-1]]).tolist()
        sizes = [len(v) for v in values]
        assert client.batch_put_from(keys, src, sizes=sizes, offsets=offsets) == [True] * len(keys)
        assert client.get_batch(keys) == values
        dst = cupy.zeros(host.size, dtype=cupy.uint8)
        assert client.batch_get_into(keys, dst, sizes=sizes, offsets=offsets) == sizes
        assert cupy.asnumpy(dst).tobytes() == host.tobytes()
        assert client.batch_get_into([b"cupy/missing"], [dst[:10]]) == [None]
