"""GPU check: every transport into and out of device memory, and its GB/s beside cupy's own copy.

Run on a machine with an NVIDIA GPU by bench/gpu/gpu_check.sh (its client-buffers section, with the
rest of the GPU check), or alone: python -m bench.store.gpu_check. It starts its own gcache-server, then for each transport (tcp, shm; rdma where usable):
  correctness: values of many sizes (one larger than a staging slot) read with
    batch_get_into into cupy memory (one buffer with per-key offsets, and a list of
    arrays) and written with batch_put_from from cupy memory, compared byte for byte
    with a host copy; target tails past each value must stay untouched; misses are None.
  throughput: batch_get_into of the working set into one cupy buffer, beside cupy's
    host-to-device copy of the same bytes from pinned memory (cudaMemcpyAsync on a
    non-blocking stream), min/median/max over --runs, ratio of medians (target >= 0.8
    for shm and rdma; tcp is reported, its ceiling is loopback TCP);
    batch_put_from beside the device-to-host copy likewise (reported, no target).
Exit status: 0 all correct, 1 a correctness failure, 2 cannot run here (no cupy / GPU),
3 with --strict when a GET ratio is below its target.

Usage:  python -m bench.store.gpu_check [--value-size 1MiB] [--batch 128] [--runs 5] [--strict]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common.stats import spread
from gcache.common.units import KiB, MiB, parse_size

GET_TARGET = 0.8
REQUIRED = ("tcp", "shm")  # a local server offers both
TARGETED = ("shm", "rdma")  # the GET target; tcp cannot reach a PCIe copy's speed


def cannot_run(reason: str):
    print(f"gpu_check: cannot run here: {reason}", file=sys.stderr)
    sys.exit(2)


def load_cupy():
    try:
        import cupy
    except ImportError as exc:
        cannot_run(
            f"cupy is not importable ({exc}); run it on a machine with an NVIDIA GPU and cupy "
            "(bench/gpu/gpu_check.sh runs it there)"
        )
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError, or a driver/library that does not load
        cannot_run(f"no CUDA device is usable ({type(exc).__name__}: {exc})")
    if count < 1:
        cannot_run("no CUDA device is visible to cupy")
    return cupy


def fmt(stats: tuple[float, float, float]) -> str:
    return "/".join(f"{x:6.2f}" for x in stats)


class Check:
    def __init__(self, cupy, address: str, args):
        self.cupy = cupy
        self.address = address
        self.args = args
        self.failures: list[str] = []
        self.rng = np.random.default_rng(0)

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)
            print(f"  FAIL {what}")

    def correctness(self, client, transport: str) -> None:
        cp = self.cupy
        sizes = [1 + (i * 7919) % (600 * KiB) for i in range(47)] + [6 * MiB]  # 6 MiB: > a slot
        values = [self.rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
        keys = [f"gpucheck/{transport}/get/{i}".encode() for i in range(len(values))]
        self.expect(client.put_batch(keys, values) == [True] * len(keys), f"{transport}: host put_batch")

        gap = 64  # target tails that must stay untouched
        offsets = np.cumsum([0] + [n + gap for n in sizes[:-1]]).tolist()
        sentinel = np.full(offsets[-1] + sizes[-1] + gap, 0xEE, dtype=np.uint8)
        dst = cp.asarray(sentinel)
        got = client.batch_get_into(keys, dst, sizes=[n + gap for n in sizes], offsets=offsets)
        self.expect(got == sizes, f"{transport}: batch_get_into sizes")
        expected = sentinel.copy()
        for off, v in zip(offsets, values):
            expected[off : off + v.size] = v
        self.expect(
            np.array_equal(cp.asnumpy(dst), expected),
            f"{transport}: batch_get_into bytes in device memory (one buffer, offsets)",
        )

        arrays = [cp.zeros(n, dtype=cp.uint8) for n in sizes[:8]]
        self.expect(client.batch_get_into(keys[:8], arrays) == sizes[:8], f"{transport}: list sizes")
        self.expect(
            all(np.array_equal(cp.asnumpy(a), v) for a, v in zip(arrays, values)),
            f"{transport}: batch_get_into bytes (list of device arrays)",
        )

        src = cp.asarray(np.concatenate(values))
        put_keys = [f"gpucheck/{transport}/put/{i}".encode() for i in range(len(values))]
        put_offsets = np.cumsum([0] + sizes[:-1]).tolist()
        self.expect(
            client.batch_put_from(put_keys, src, sizes=sizes, offsets=put_offsets) == [True] * len(keys),
            f"{transport}: batch_put_from answers",
        )
        back = client.get_batch(put_keys)
        self.expect(
            all(b is not None and b == v.tobytes() for b, v in zip(back, values)),
            f"{transport}: batch_put_from bytes from device memory",
        )
        self.expect(client.get_into(b"gpucheck/missing", arrays[0]) is None, f"{transport}: miss")
        client.batch_remove(keys + put_keys)

    def throughput(self, client, transport: str) -> tuple:
        cp, args = self.cupy, self.args
        n, size = args.batch, args.value_size
        total = n * size
        host = self.rng.integers(0, 256, total, dtype=np.uint8)
        keys = [f"gpucheck/{transport}/bw/{i}".encode() for i in range(n)]
        offsets = [i * size for i in range(n)]
        sizes = [size] * n
        client.batch_put_from(keys, host, sizes=sizes, offsets=offsets)
        dst = cp.empty(total, dtype=cp.uint8)

        get_s = self._runs(lambda: client.batch_get_into(keys, dst, sizes=sizes, offsets=offsets))
        self.expect(np.array_equal(cp.asnumpy(dst), host), f"{transport}: throughput bytes")

        put_keys = [f"gpucheck/{transport}/bwput/{i}".encode() for i in range(n)]

        def put_once():
            client.batch_put_from(put_keys, dst, sizes=sizes, offsets=offsets)

        def remove():
            client.batch_remove(put_keys)  # values are immutable: each run stores fresh

        put_s = self._runs(put_once, between=remove)
        client.batch_remove(keys + put_keys)

        h2d_s, d2h_s = self._cupy_copies(host, total)
        rate = lambda seconds: [total / s / 1e9 for s in seconds]  # noqa: E731
        return spread(rate(get_s)), spread(rate(h2d_s)), spread(rate(put_s)), spread(rate(d2h_s))

    def _runs(self, fn, between=None) -> list[float]:
        fn()  # warm: staging allocated, connections open
        samples = []
        for _ in range(self.args.runs):
            if between:
                between()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return samples

    def _cupy_copies(self, host: np.ndarray, total: int) -> tuple[list[float], list[float]]:
        """cupy's own copies of the same bytes between pinned memory and the device."""
        cp = self.cupy
        rt = cp.cuda.runtime
        pinned_mem = cp.cuda.alloc_pinned_memory(total)
        pinned = np.frombuffer(pinned_mem, np.uint8, total)
        pinned[:] = host
        dev = cp.empty(total, dtype=cp.uint8)
        stream = cp.cuda.Stream(non_blocking=True)

        def copy(dst, src, kind):
            rt.memcpyAsync(dst, src, total, kind, stream.ptr)
            stream.synchronize()

        h2d = self._runs(lambda: copy(dev.data.ptr, pinned.ctypes.data, rt.memcpyHostToDevice))
        d2h = self._runs(lambda: copy(pinned.ctypes.data, dev.data.ptr, rt.memcpyDeviceToHost))
        return h2d, d2h


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--value-size", default="1MiB", type=parse_size)
    parser.add_argument("--batch", default=128, type=int, help="keys per batch (working set = batch x value size)")
    parser.add_argument("--runs", default=5, type=int)
    parser.add_argument("--transports", default="tcp,shm,rdma")
    parser.add_argument("--memory", default="2GiB", help="the gcache-server's memory tier")
    parser.add_argument("--strict", action="store_true", help="exit 3 when a GET ratio is below target")
    args = parser.parse_args(argv)

    cupy = load_cupy()  # before anything starts: say plainly why it cannot run
    import gcache
    from gcache import errors
    from gcache.client.device import staging as device_buffers
    from gcache.tools.devcluster.local_server import LocalServer

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"command: python -m bench.store.gpu_check {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(
        f"device: {name}; cupy {cupy.__version__}; staging {device_buffers.STAGING_BYTES_DEFAULT // MiB} MiB "
        f"in {device_buffers.SLOT_BYTES_DEFAULT // MiB} MiB slots"
    )
    print(
        f"working set: {args.batch} x {args.value_size // KiB} KiB = "
        f"{args.batch * args.value_size / MiB:.0f} MiB per batch; {args.runs} runs (min/median/max)"
    )

    rows = []
    with tempfile.TemporaryDirectory(prefix="gcache-gpucheck-") as tmp:
        server = LocalServer(Path(tmp) / "node", memory=args.memory, disk="1GiB").start()
        try:
            check = Check(cupy, server.address, args)
            for transport in args.transports.split(","):
                try:
                    client = gcache.Client(server.address, transport=transport)
                except (errors.TransportUnavailableError, ImportError) as exc:
                    # tcp and shm always work against a local server; rdma needs a device.
                    if transport in REQUIRED:
                        check.expect(False, f"{transport}: unavailable ({exc})")
                    else:
                        print(f"{transport}: skipped ({type(exc).__name__}: {exc})")
                    continue
                with client:
                    print(f"{transport}: correctness")
                    before = len(check.failures)
                    check.correctness(client, transport)
                    print(f"  {'OK' if len(check.failures) == before else 'FAILED'}")
                    rows.append((transport, *check.throughput(client, transport)))
        finally:
            server.stop()

    print(f"\n{'transport':9}  {'op':3}  {'gcache GB/s':>20}  {'cupy copy GB/s':>20}  ratio  target")
    below = False
    for transport, get, h2d, put, d2h in rows:
        ratio = get[1] / h2d[1]
        if transport in TARGETED:
            below |= ratio < GET_TARGET
            verdict = f">= {GET_TARGET} " + ("ok" if ratio >= GET_TARGET else "BELOW")
        else:
            verdict = "(reported: loopback TCP is the ceiling)"
        print(f"{transport:9}  get  {fmt(get):>20}  {fmt(h2d):>20}  {ratio:5.2f}  {verdict}")
        print(f"{transport:9}  put  {fmt(put):>20}  {fmt(d2h):>20}  {put[1] / d2h[1]:5.2f}  (reported)")
    print(
        "(get: batch_get_into into device memory vs cupy H2D from pinned memory; "
        "put: batch_put_from from device memory vs cupy D2H into pinned memory)"
    )
    if check.failures:
        print(f"\ngpu_check: {len(check.failures)} correctness failure(s): {check.failures}", file=sys.stderr)
        return 1
    print("\ngpu_check: every transport correct into and out of device memory")
    return 3 if args.strict and below else 0


if __name__ == "__main__":
    sys.exit(main())
