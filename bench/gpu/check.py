"""The GPU check: GCache's vLLM connector path and device buffers on a real GPU, in one run.

Run through bench/gpu/gpu_check.sh (which builds the native core from the carried files first);
`--dry-run` runs all of it but the CUDA calls, on CPU tensors (HostMover for CudaMover, a cupy
made of host memory for cupy). It starts its own gcache-server and checks, printing as it goes
and writing OUT/gpu_check.json (rewritten after every section, so a crash keeps what ran):

1. environment: device, driver, torch, CUDA, the copy methods this process has (vLLM's
   swap_blocks_batch, the native cudaMemcpyAsync loop, cuMemcpyBatchAsync, cupy).
2. round trip per layout (LBHNC, LBNHC, BLHNC; GPU-shaped KV built as vLLM's
   create_kv_cache_views does, with torch as_strided over one buffer): the group's pages of
   random blocks gathered through GroupValues into a StagingPool registered with the client,
   put in segments, the KV zeroed, read back, scattered into other random blocks; byte-exact,
   every other block still zero. Over shm, and over tcp for LBNHC.
3. ordering: a write still queued on the compute stream (after torch.cuda._sleep) is in the
   saved bytes when the save stream waits on a compute event; a load lands after a kernel that
   zeroes the blocks. The same without the waits is reported (not checked).
4. throughput by value size (64 KiB to 4 MiB; 64 KiB pages: 1 to 64 layers per value) for
   LBHNC (one run per layer) and BLHNC (one run per value): save (event, D2H gather, put) and
   load (get, H2D scatter) GB/s through the store over shm, min/median/max, beside a single
   large pinned copy in the same run (ratio of medians; target >= 0.8 for values >= 1 MiB),
   and the copies alone.
5. copy methods: every usable method byte-exact, and its GB/s for 64 KiB and 1 MiB runs.
6. host memory: torch pinned vs mmap + cudaHostRegister: allocation time, single-copy GB/s.
7. the client's device buffers (bench/store/gpu_check.py: correctness and GB/s into and out of
   cupy memory, tcp and shm) and the worker's cupy backend (model logits on cupy vs numpy; KV
   pages device -> pinned host pool -> store -> host pool -> device, byte-exact).

Exit status: 0 every check holds; 1 a check failed; 2 cannot run here (no GPU, without
--dry-run); 3 with --strict when a throughput target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

from bench.common.stats import spread
from gcache.common.units import GiB, KiB, MiB

LAYOUTS = ("LBHNC", "LBNHC", "BLHNC")
TARGET = 0.8  # of the single large pinned copy, values >= 1 MiB
GPU_SCALE = dict(
    layers=32, heads=8, tokens=16, head_dim=128, blocks=512, saved=64, page=64 * KiB, working_set=512 * MiB, runs=3
)
DRY_SCALE = dict(layers=4, heads=2, tokens=4, head_dim=8, blocks=32, saved=8, page=4 * KiB, working_set=4 * MiB, runs=2)
VALUE_SIZES_IN_PAGES = (1, 4, 16, 64)  # 64 KiB .. 4 MiB on a GPU (4 KiB .. 256 KiB in the dry run)


class CannotRun(Exception):
    pass


# -- tensors: torch on the GPU, torch or numpy on the CPU ---------------------------------


class Tensors:
    """The few tensor operations the check needs, on torch (cuda or cpu) or numpy."""

    def __init__(self, device: str):
        self.device = device
        self.torch = None
        if device == "cuda" or (device == "cpu" and _has("torch")):
            import torch

            self.torch = torch
        self.kind = f"torch-{device}" if self.torch is not None else "numpy"

    def alloc(self, nbytes: int):
        if self.torch is not None:
            return self.torch.zeros(nbytes, dtype=self.torch.uint8, device=self.device)
        return np.zeros(nbytes, dtype=np.uint8)

    def fill_random(self, buf, seed: int) -> None:
        if self.torch is not None:
            buf.random_(0, 256, generator=self.torch.Generator(device=self.device).manual_seed(seed))
        else:
            buf[:] = np.random.default_rng(seed).integers(0, 256, buf.size, dtype=np.uint8)

    def views(self, buf, layout: str, dims: dict) -> list:
        """One [B, H, N, C] view per layer over `buf`, strided as `layout` (bf16 elements)."""
        stride, acc = {}, 1
        for d in reversed(layout):
            stride[d] = acc
            acc *= dims[d]
        shape = [dims[d] for d in "BHNC"]
        strides = [stride[d] for d in "BHNC"]
        if self.torch is not None:
            typed = buf.view(self.torch.bfloat16)
            return [typed.as_strided(shape, strides, l * stride["L"]) for l in range(dims["L"])]
        from gcache.integrations.vllm.transfer.numpy_view import NumpyView

        typed = buf.view(np.uint16)
        return [
            NumpyView(np.lib.stride_tricks.as_strided(typed[l * stride["L"] :], shape, [s * 2 for s in strides]))
            for l in range(dims["L"])
        ]

    def fill(self, buf, byte: int) -> None:
        """Every byte of `buf` set (a kernel queued on the current stream on a GPU)."""
        if self.torch is not None:
            buf.fill_(byte)
        else:
            buf.fill(byte)

    def pages(self, view, ids):
        """A copy of these blocks' pages of one layer view (on the device), as 16-bit integers
        (compared bit for bit: random bf16 bytes hold NaNs)."""
        if self.torch is not None:
            return view[self.torch.as_tensor(list(ids), device=self.device)].contiguous().view(self.torch.int16)
        return view.array[list(ids)].copy()

    def equal(self, a, b) -> bool:
        if self.torch is not None:
            return bool(self.torch.equal(a, b))
        return bool(np.array_equal(a, b))

    def any_nonzero(self, view, ids) -> bool:
        if not len(ids):
            return False
        return bool(self.pages(view, ids).any())

    def sleep(self, ms: float) -> None:
        """Queues ~ms of GPU time on the current stream (nothing on the CPU)."""
        if self.device == "cuda":
            self.torch.cuda._sleep(int(ms * 2_000_000))  # cycles at ~2 GHz

    def host_bytes(self, buf) -> np.ndarray:
        if self.torch is not None:
            return buf.cpu().numpy()
        return buf

    def synchronize(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# -- the check ------------------------------------------------------------------------------


class Check:
    def __init__(self, args, mover, tensors: Tensors, client, address: str, report: dict, out: Path):
        self.args = args
        self.mover = mover
        self.t = tensors
        self.client = client
        self.address = address
        self.report = report
        self.out = out
        self.scale = DRY_SCALE if args.dry_run else GPU_SCALE
        self.rng = np.random.default_rng(args.seed)
        self.started = time.perf_counter()

    # ---- bookkeeping ----
    def expect(self, ok: bool, name: str, **detail) -> bool:
        self.report["checks"].append(dict(name=name, ok=bool(ok), **detail))
        print(f"  {'ok  ' if ok else 'FAIL'} {name}" + (f"  {detail}" if detail and not ok else ""), flush=True)
        return bool(ok)

    def save_report(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=2, default=str))

    def time_left(self) -> float:
        return self.args.deadline_s - (time.perf_counter() - self.started)

    def out_of_time(self, what: str) -> bool:
        """True (and said, in the report too) when under a minute of the run's time is left."""
        if self.time_left() >= 60:
            return False
        self.report["skipped"].append(what)
        print(f"  skipped (out of time): {what}", flush=True)
        return True

    def section(self, name: str, fn) -> None:
        print(f"\n== {name}", flush=True)
        if self.out_of_time(name):
            return
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # one section's failure is reported, the others still run
            self.expect(False, f"{name}: raised", error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())
        self.report["seconds"][name] = round(time.perf_counter() - t0, 2)
        self.save_report()

    def dims(self, layers: int | None = None, page: int | None = None) -> dict:
        s = self.scale
        c = 2 * s["head_dim"]  # bf16 elements of one token and head: K then V
        dims = dict(L=layers or s["layers"], B=s["blocks"], H=s["heads"], N=s["tokens"], C=c)
        if page is not None:  # tokens per block for this page size
            dims["N"] = page // (dims["H"] * c * 2)
        return dims

    def kv(self, layout: str, dims: dict, seed: int):
        buf = self.t.alloc(dims["L"] * dims["B"] * dims["H"] * dims["N"] * dims["C"] * 2)
        self.t.fill_random(buf, seed)
        return buf, self.t.views(buf, layout, dims)

    def group(self, views, blocks: int, segment_bytes_max: int):
        from gcache.integrations.vllm.transfer.page_runs import page_runs
        from gcache.integrations.vllm.transfer.values import GroupValues

        return GroupValues([page_runs(v, blocks) for v in views], segment_bytes_max=segment_bytes_max)

    # ---- the moves, as the connector makes them ----
    def save(self, values, block_ids, slot_addresses, stream):
        """Event on compute, save stream waits, D2H gather; returns the copy's event."""
        m = self.mover
        m.wait_event(stream, m.record(m.compute_stream()))
        g = values.gather(block_ids, slot_addresses)
        m.copy(stream, g.dst, g.src, g.sizes)
        return m.record(stream)

    def load(self, values, slot_addresses, block_ids, stream):
        m = self.mover
        m.wait_event(stream, m.record(m.compute_stream()))
        s = values.scatter(slot_addresses, block_ids)
        m.copy(stream, s.dst, s.src, s.sizes)
        return m.record(stream)

    @staticmethod
    def value_keys(prefix: str, blocks, values, slot_addresses):
        from gcache.integrations.vllm.kv.keys import segment_keys

        keys, addresses, sizes = [], [], []
        for block, address in zip(blocks, slot_addresses):
            for key, (at, length) in zip(
                segment_keys(f"{prefix}/{block}".encode(), values.segments), values.segment_spans()
            ):
                keys.append(key)
                addresses.append(int(address) + at)
                sizes.append(length)
        return keys, addresses, sizes

    # ---- 2. round trips ----
    def round_trips(self) -> None:
        import gcache
        from gcache.integrations.vllm.transfer.staging import StagingPool

        s = self.scale
        for seed, (layout, transport) in enumerate([(lay, "shm") for lay in LAYOUTS] + [("LBNHC", "tcp")]):
            dims = self.dims()
            buf, views = self.kv(layout, dims, seed=seed)
            values = self.group(views, dims["B"], segment_bytes_max=-(-3 * self.dims_value(dims) // 4))
            pool = StagingPool(self.mover.alloc_host(s["saved"] * values.value_bytes), values.value_bytes)
            saved = self.rng.choice(dims["B"], s["saved"], replace=False).tolist()
            loaded = self.rng.choice(dims["B"], s["saved"], replace=False).tolist()
            reference = [self.t.pages(v, saved) for v in views]
            save_stream, load_stream = self.mover.new_stream("save"), self.mover.new_stream("load")
            with gcache.Client(self.address, transport=transport) as client:
                client.register_buffer(pool.base, pool.nbytes)
                slots = pool.take(len(saved))
                self.mover.synchronize(self.save(values, saved, pool.addresses(slots), save_stream))
                keys, addresses, sizes = self.value_keys(
                    f"rt/{layout}/{transport}", saved, values, pool.addresses(slots)
                )
                stored = client.batch_put_from(keys, addresses, sizes)
                pool.give_back(slots)
                self.t.fill(buf, 0)  # on the compute stream
                slots = pool.take(len(saved))
                _, targets, _ = self.value_keys("", saved, values, pool.addresses(slots))
                got = client.batch_get_into(keys, targets, sizes)
                self.mover.synchronize(self.load(values, pool.addresses(slots), loaded, load_stream))
                pool.give_back(slots)
                client.batch_remove(keys)
            self.t.synchronize()
            exact = all(self.t.equal(self.t.pages(v, loaded), ref) for v, ref in zip(views, reference, strict=True))
            others = [b for b in range(dims["B"]) if b not in set(loaded)]
            untouched = not any(self.t.any_nonzero(v, others) for v in views)
            self.expect(
                stored == [True] * len(keys) and got == sizes and exact and untouched,
                f"round trip {layout} over {transport}: {len(saved)} random blocks, "
                f"{values.value_bytes // KiB} KiB values in {values.segments} segments, "
                f"{values.runs_per_page} runs per page",
                stored=stored.count(True),
                got=sum(1 for g, n in zip(got, sizes) if g == n),
                exact=exact,
                others_zero=untouched,
            )
            del buf, views, reference

    @staticmethod
    def dims_value(dims: dict) -> int:
        return dims["L"] * dims["H"] * dims["N"] * dims["C"] * 2

    # ---- 3. ordering ----
    def ordering(self) -> None:
        from gcache.integrations.vllm.transfer.staging import StagingPool

        t, m = self.t, self.mover
        dims = self.dims(layers=4)
        buf, views = self.kv("LBHNC", dims, seed=11)
        values = self.group(views, dims["B"], segment_bytes_max=1 << 40)
        ids = list(range(0, dims["B"], 2))
        memory = m.alloc_host(len(ids) * values.value_bytes)
        pool = StagingPool(memory, values.value_bytes)
        staged = np.frombuffer(memory, dtype=np.uint8)
        addresses = pool.addresses(list(range(len(ids))))
        save_stream, load_stream = m.new_stream("save"), m.new_stream("load")
        results = {}
        for waits in (True, False):
            staged[:] = 0
            t.sleep(50)  # the compute stream is busy; the fill below is queued behind it
            fill = 0xA5 if waits else 0x5A
            t.fill(buf, fill)
            if waits:
                event = self.save(values, ids, addresses, save_stream)
            else:  # no wait on compute: reads whatever the blocks hold when the DMA runs
                g = values.gather(ids, addresses)
                m.copy(save_stream, g.dst, g.src, g.sizes)
                event = m.record(save_stream)
            m.synchronize(event)
            results[waits] = float((staged == fill).mean())
            t.synchronize()
        self.expect(
            results[True] == 1.0,
            "ordering: a write queued on the compute stream is in the saved bytes (save stream waits on its event)",
            fraction_new_bytes=results[True],
        )
        self.report["figures"]["ordering_save_without_wait_fraction_new_bytes"] = results[False]
        print(f"  (without the wait, {results[False]:.0%} of the saved bytes were the new ones)")

        loads = {}
        for waits in (True, False):
            staged[:] = 0x3C
            t.synchronize()
            t.sleep(50)
            t.fill(buf, 0)  # vLLM zeroing new blocks, queued
            if waits:
                event = self.load(values, addresses, ids, load_stream)
            else:
                s = values.scatter(addresses, ids)
                m.copy(load_stream, s.dst, s.src, s.sizes)
                event = m.record(load_stream)
            m.synchronize(event)
            t.synchronize()
            host = t.host_bytes(buf)
            # Every byte of the loaded blocks' pages: 0x3C when the load landed after the zeroing.
            g = values.gather(ids, addresses)
            offsets = (g.src - int(views[0].data_ptr())).tolist()  # layer 0's view starts the buffer
            pieces = [host[o : o + n] for o, n in zip(offsets, g.sizes.tolist())]
            loads[waits] = float(np.mean([np.mean(p == 0x3C) for p in pieces]))
        self.expect(
            loads[True] == 1.0,
            "ordering: a load lands after a kernel that zeroes the blocks (load stream waits on compute)",
            fraction_loaded_bytes=loads[True],
        )
        self.report["figures"]["ordering_load_without_wait_fraction_loaded_bytes"] = loads[False]
        print(f"  (without the wait, {loads[False]:.0%} of the blocks' bytes were the loaded ones)")

    # ---- 4. throughput through the store ----
    def throughput(self) -> None:
        from gcache.integrations.vllm.transfer.staging import StagingPool

        s, m, client = self.scale, self.mover, self.client
        page, ws, runs = s["page"], s["working_set"], s["runs"]
        memory = m.alloc_host(ws)
        client.register_buffer(int(np.frombuffer(memory, np.uint8).ctypes.data), ws)
        peak = self.single_copy(memory, ws)
        self.report["figures"]["single_copy_gbps"] = peak
        print(f"  single {ws // MiB} MiB pinned copy: D2H {fmt(peak['d2h'])}  H2D {fmt(peak['h2d'])} GB/s")
        rows = []
        save_stream, load_stream = m.new_stream("save"), m.new_stream("load")
        # the sizes that have a target first, then the small ones: a run short of time drops those
        first = sorted(VALUE_SIZES_IN_PAGES, key=lambda p: (p * page < MiB, p))
        for pages, layout in [(p, lay) for p in first for lay in ("LBHNC", "BLHNC")]:
            if self.out_of_time(f"throughput {layout} {pages * page // KiB} KiB"):
                continue
            size = pages * page
            n = ws // size
            dims = self.dims(layers=pages, page=page)
            dims["B"] = 2 * n
            buf, views = self.kv(layout, dims, seed=pages)
            values = self.group(views, dims["B"], segment_bytes_max=1 << 40)
            assert values.value_bytes == size, (values.value_bytes, size)
            pool = StagingPool(memory, size)
            addresses = pool.addresses(list(range(n)))
            order = self.rng.permutation(dims["B"]).tolist()
            saved, loaded = order[:n], order[n:]  # disjoint: the saved blocks stay as they were
            keys = [f"bw/{layout}/{size}/{i}".encode() for i in range(n)]
            sizes = [size] * n
            t = dict(save=[], load=[], d2h=[], h2d=[])
            ok = True
            for run in range(runs + 1):  # the first run warms up
                client.batch_remove(keys)
                t0 = time.perf_counter()
                m.synchronize(self.save(values, saved, addresses, save_stream))
                t1 = time.perf_counter()
                ok &= client.batch_put_from(keys, addresses.tolist(), sizes) == [True] * n
                t2 = time.perf_counter()
                got = client.batch_get_into(keys, addresses.tolist(), sizes)
                t3 = time.perf_counter()
                m.synchronize(self.load(values, addresses, loaded, load_stream))
                t4 = time.perf_counter()
                ok &= got == sizes
                if run:
                    t["save"].append(t2 - t0)
                    t["d2h"].append(t1 - t0)
                    t["load"].append(t4 - t2)
                    t["h2d"].append(t4 - t3)
            self.t.synchronize()
            exact = all(self.t.equal(self.t.pages(v, loaded[:8]), self.t.pages(v, saved[:8])) for v in views[:4])
            client.batch_remove(keys)
            gbps = {k: spread([n * size / x / 1e9 for x in v]) for k, v in t.items()}
            row = dict(
                layout=layout,
                value_kib=size // KiB,
                values=n,
                runs_per_value=values.runs_per_page,
                **{f"{k}_gbps": v for k, v in gbps.items()},
                save_ratio=round(gbps["save"][1] / peak["d2h"][1], 3),
                load_ratio=round(gbps["load"][1] / peak["h2d"][1], 3),
            )
            rows.append(row)
            self.expect(
                ok and exact, f"throughput {layout} {size // KiB} KiB values: every value stored, read back, exact"
            )
            print(
                f"  {layout} {size // KiB:5} KiB x {n:5}: save {fmt(gbps['save'])} (copy {fmt(gbps['d2h'])})  "
                f"load {fmt(gbps['load'])} (copy {fmt(gbps['h2d'])}) GB/s; "
                f"of the single copy: save {row['save_ratio']:.2f} load {row['load_ratio']:.2f}",
                flush=True,
            )
            del buf, views
        self.report["figures"]["throughput"] = rows
        if self.args.dry_run:
            print("  (dry run: host memory copies; the target is for a GPU)")
            return
        met = [r["save_ratio"] >= TARGET and r["load_ratio"] >= TARGET for r in rows if r["value_kib"] * KiB >= MiB]
        self.report["figures"]["target_met"] = bool(met) and all(met)
        verdict = "met" if met and all(met) else "MISSED"
        print(f"  target: save and load >= {TARGET} of the single copy for values >= 1 MiB: {verdict}")

    def single_copy(self, memory: memoryview, nbytes: int) -> dict:
        """One descriptor of `nbytes` each way between the pinned memory and the device, GB/s spread."""
        m = self.mover
        dev = self.t.alloc(nbytes)
        host = int(np.frombuffer(memory, np.uint8).ctypes.data)
        dptr = int(dev.data_ptr()) if self.t.torch is not None else int(dev.ctypes.data)
        stream = m.new_stream("save")
        out = {}
        for name, dst, src in (("d2h", host, dptr), ("h2d", dptr, host)):
            times = []
            for run in range(self.scale["runs"] + 1):
                t0 = time.perf_counter()
                m.copy(stream, np.array([dst]), np.array([src]), np.array([nbytes]))
                m.synchronize(m.record(stream))
                if run:
                    times.append(time.perf_counter() - t0)
            out[name] = spread([nbytes / x / 1e9 for x in times])
        return out

    # ---- 5. copy methods ----
    def copy_methods(self) -> None:
        from gcache.integrations.vllm.transfer.staging import StagingPool

        if self.args.dry_run:
            self.report["figures"]["copy_methods"] = "dry run: the host mover's native memmoves only"
            print("  (dry run: the host mover's native memmoves; on a GPU every copy method the process has)")
            return
        from gcache.integrations.vllm.transfer.movers.cuda import CudaMover

        reasons = self.mover.reasons
        order = [m for m in ("native-loop", "cupy", "vllm", "native-batch") if reasons.get(m) is None]
        ws = self.scale["working_set"] // 4
        table = {}
        for method in order:  # native-batch last: a wrong ABI would show here, after the rest is saved
            if self.out_of_time(f"copy method {method}"):
                continue
            mover = CudaMover(method=method)
            memory = mover.alloc_host(ws)
            table[method] = {}
            for page in (64 * KiB, 1 * MiB):
                dims = self.dims(layers=4, page=page)
                n = ws // (4 * page)
                dims["B"] = 2 * n
                buf, views = self.kv("LBHNC", dims, seed=5)
                values = self.group(views, dims["B"], segment_bytes_max=1 << 40)
                pool = StagingPool(memory, values.value_bytes)
                addresses = pool.addresses(list(range(n)))
                saved, loaded = list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
                stream = mover.new_stream("load")
                times = {"d2h": [], "h2d": []}
                for run in range(self.scale["runs"] + 1):
                    g = values.gather(saved, addresses)
                    t0 = time.perf_counter()
                    mover.copy(stream, g.dst, g.src, g.sizes)
                    mover.synchronize(mover.record(stream))
                    t1 = time.perf_counter()
                    s = values.scatter(addresses, loaded)
                    mover.copy(stream, s.dst, s.src, s.sizes)
                    mover.synchronize(mover.record(stream))
                    t2 = time.perf_counter()
                    if run:
                        times["d2h"].append(t1 - t0)
                        times["h2d"].append(t2 - t1)
                exact = all(self.t.equal(self.t.pages(v, loaded), self.t.pages(v, saved)) for v in views)
                self.expect(exact, f"copy method {method}: {page // KiB} KiB runs, byte-exact both ways")
                table[method][f"{page // KiB}KiB"] = {k: spread([ws / x / 1e9 for x in v]) for k, v in times.items()}
                print(
                    f"  {method:12} {page // KiB:5} KiB runs: D2H {fmt(table[method][f'{page // KiB}KiB']['d2h'])}  "
                    f"H2D {fmt(table[method][f'{page // KiB}KiB']['h2d'])} GB/s",
                    flush=True,
                )
                del buf, views
            self.report["figures"]["copy_methods"] = table
            self.save_report()

    # ---- 6. host memory ----
    def host_memory(self) -> None:
        if self.args.dry_run:
            self.report["figures"]["host_memory"] = "dry run: mmap'd host memory"
            print("  (dry run: mmap'd host memory; on a GPU torch-pinned vs cudaHostRegister'ed)")
            return
        from gcache.integrations.vllm.transfer.movers.cuda import CudaMover

        nbytes = self.scale["working_set"]
        table = {}
        for kind in ("pinned", "registered"):
            mover = CudaMover(host_memory=kind)
            t0 = time.perf_counter()
            memory = mover.alloc_host(nbytes)
            alloc_s = time.perf_counter() - t0
            saved, self.mover = self.mover, mover
            try:
                table[kind] = dict(alloc_s=round(alloc_s, 3), **self.single_copy(memory, nbytes))
            finally:
                self.mover = saved
            print(
                f"  {kind:10}: {nbytes // MiB} MiB allocated in {alloc_s:.3f} s; D2H {fmt(table[kind]['d2h'])} "
                f"H2D {fmt(table[kind]['h2d'])} GB/s"
            )
        self.report["figures"]["host_memory"] = table

    # ---- 7. the client's device buffers, the worker's cupy backend ----
    def client_buffers(self) -> None:
        from bench.store import gpu_check as client_check

        cupy = self.cupy()
        args = argparse.Namespace(
            value_size=1 * MiB if not self.args.dry_run else 64 * KiB,
            batch=128 if not self.args.dry_run else 4,
            runs=self.scale["runs"],
        )
        check = client_check.Check(cupy, self.address, args)
        import gcache

        rows = {}
        try:
            self._client_buffers(check, rows, gcache)
        finally:
            if self.args.dry_run:
                sys.modules.pop("cupy", None)
        self.report["figures"]["client_device_buffers"] = rows

    def _client_buffers(self, check, rows: dict, gcache) -> None:
        for transport in ("tcp", "shm"):
            with gcache.Client(self.address, transport=transport) as client:
                before = len(check.failures)
                check.correctness(client, transport)
                self.expect(
                    len(check.failures) == before,
                    f"client device buffers over {transport}: batch_get_into / batch_put_from into and out of "
                    "cupy memory, byte-exact, tails untouched, misses None",
                    failures=check.failures[before:],
                )
                get, h2d, put, d2h = check.throughput(client, transport)
                rows[transport] = dict(get_gbps=get, h2d_gbps=h2d, put_gbps=put, d2h_gbps=d2h)
                print(f"  {transport}: get {fmt(get)} vs H2D {fmt(h2d)}; put {fmt(put)} vs D2H {fmt(d2h)} GB/s")

    def cupy(self):
        if not self.args.dry_run:
            import cupy

            return cupy
        from bench.gpu.host_cupy import HostCupy

        # gcache's device staging imports cupy itself: the stand-in is cupy for this section only.
        stand_in = HostCupy().module
        sys.modules["cupy"] = stand_in
        return stand_in

    def worker_backend(self) -> None:
        from gcache.common.attention import AttentionKind
        from gcache.worker import backend
        from gcache.worker.config import ModelConfig
        from gcache.worker.kvcache.kv_pool import DualKVCache
        from gcache.worker.kvcache.tiers.host_pool import HostKVPool
        from gcache.worker.model.transformer import Model

        xp = np if self.args.dry_run else backend.select_backend("cupy")
        self.report["environment"]["worker_backend"] = backend.backend_name(xp)
        cfg = ModelConfig.small()
        tokens = np.arange(3, 40) % cfg.vocab_size
        got = backend.to_numpy(Model(cfg, xp=xp).reference_logits(tokens))
        want = Model(cfg, xp=np).reference_logits(tokens)
        err = float(np.max(np.abs(got - want)))
        self.expect(
            bool(np.allclose(got, want, rtol=1e-3, atol=1e-3)),
            f"worker backend {backend.backend_name(xp)}: model logits match numpy's",
            max_abs_diff=err,
        )
        kv = DualKVCache(cfg, 8, 8, xp=xp)
        rng = np.random.default_rng(2)
        kv.k_full[...] = xp.asarray(rng.standard_normal(kv.k_full.shape).astype(cfg.dtype))
        kv.v_full[...] = xp.asarray(rng.standard_normal(kv.v_full.shape).astype(cfg.dtype))
        k0, v0 = backend.to_numpy(kv.k_full).copy(), backend.to_numpy(kv.v_full).copy()
        pool = HostKVPool(cfg, 4, 4, xp=xp)
        raw = pool.buffer(AttentionKind.FULL)
        self.client.register_buffer(int(raw.ctypes.data), raw.nbytes)
        src_pages, dst_pages, slots = [1, 3, 5], [2, 4, 6], [0, 1, 2]
        pool.store_from_device(kv, AttentionKind.FULL, src_pages, slots)
        keys = [f"worker/{s}".encode() for s in slots]
        size = pool.page_bytes[AttentionKind.FULL]
        stored = self.client.batch_put_from(keys, [pool.address(AttentionKind.FULL, s) for s in slots], [size] * 3)
        raw[...] = 0
        kv.k_full[...] = 0
        kv.v_full[...] = 0
        got_sizes = self.client.batch_get_into(keys, [pool.address(AttentionKind.FULL, s) for s in slots], [size] * 3)
        for layer in range(len(cfg.full_layers)):
            pool.load_layer(kv, AttentionKind.FULL, layer, dst_pages, slots)
        k1, v1 = backend.to_numpy(kv.k_full), backend.to_numpy(kv.v_full)
        exact = np.array_equal(k1[:, dst_pages], k0[:, src_pages]) and np.array_equal(
            v1[:, dst_pages], v0[:, src_pages]
        )
        self.client.batch_remove(keys)
        self.expect(
            stored == [True] * 3 and got_sizes == [size] * 3 and exact,
            f"worker backend {backend.backend_name(xp)}: KV pages device -> pinned host pool -> store -> device, exact",
        )


def fmt(stats) -> str:
    return "/".join(f"{x:.2f}" for x in stats)


def environment(args, mover, tensors: Tensors) -> dict:
    env = dict(
        dry_run=args.dry_run,
        python=platform.python_version(),
        machine=platform.machine(),
        tensors=tensors.kind,
        mover=mover.describe(),
        cpus=os.cpu_count(),
    )
    from gcache import _native

    env["native"] = dict(debug=bool(_native.DEBUG), module=_native.__file__, cuda_copy=_native.cuda_copy_probe())
    if not args.dry_run:
        torch = tensors.torch
        props = torch.cuda.get_device_properties(0)
        env.update(
            torch=torch.__version__,
            torch_cuda=torch.version.cuda,
            device=props.name,
            device_memory_gib=round(props.total_memory / GiB, 1),
        )
        try:
            env["nvidia_smi"] = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            env["nvidia_smi"] = f"not run: {exc}"
    return env


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json")
    parser.add_argument("--dry-run", action="store_true", help="everything but the CUDA calls, on CPU tensors")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", default=None, help="the gcache-server's memory tier (default 8GiB; dry run 256MiB)")
    parser.add_argument(
        "--sections",
        default="round_trips,ordering,client_buffers,worker_backend,host_memory,throughput,copy_methods",
        help="in this order: the sections that can run long, or crash on a new copy method, come last",
    )
    parser.add_argument("--deadline-s", type=float, default=420.0, help="sections starting later are skipped")
    parser.add_argument("--strict", action="store_true", help="exit 3 when a throughput target is missed")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    if args.dry_run:
        from gcache.integrations.vllm.transfer.movers.host import HostMover

        tensors, mover = Tensors("cpu"), HostMover()
    else:
        try:
            from gcache.integrations.vllm.transfer.movers.cuda import CudaMover, CudaUnavailableError

            mover = CudaMover()
        except CudaUnavailableError as exc:
            print(f"gpu_check: cannot run here: {exc} (--dry-run runs it on CPU tensors)", file=sys.stderr)
            return 2
        tensors = Tensors("cuda")

    import gcache
    from gcache.tools.devcluster.local_server import LocalServer

    report = dict(
        command="bash bench/gpu/gpu_check.sh " + " ".join(sys.argv[1:] if argv is None else argv),
        started=time.strftime("%Y-%m-%d %H:%M:%S"),
        environment=environment(args, mover, tensors),
        checks=[],
        skipped=[],
        figures={},
        seconds={},
    )
    print(json.dumps(report["environment"], indent=1, default=str))
    memory = args.memory or ("256MiB" if args.dry_run else "8GiB")
    with tempfile.TemporaryDirectory(prefix="gcache-gpucheck-") as tmp:
        server = LocalServer(Path(tmp) / "node", memory=memory, disk="1GiB").start()
        try:
            with gcache.Client(server.address, transport="shm") as client:
                check = Check(args, mover, tensors, client, server.address, report, args.out)
                for name in args.sections.split(","):
                    check.section(name, getattr(check, name))
        finally:
            server.stop()
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    report["ok"] = not failed
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    print(
        f"\ngpu_check: {len(report['checks']) - len(failed)} of {len(report['checks'])} checks hold"
        + (f"; FAILED: {failed}" if failed else "")
        + f"; report: {args.out / 'gpu_check.json'}"
    )
    if failed:
        return 1
    return 3 if args.strict and not args.dry_run and not report["figures"].get("target_met") else 0


if __name__ == "__main__":
    sys.exit(main())
