"""GCache as SGLang's HiCache L3 backend: what the backend adds over the raw client.

One run, three systems on the same host pool pages, 128-page batches (SGLang's
STORAGE_BATCH_SIZE), one set and one get per repeat and system. Per repeat the raw
client and the backend run back to back (alternating which goes first), then
HiCacheFile, whose dirty pages are flushed before the next repeat, so the pair sees
the same machine state (a shared 2-core box is noisy):

  raw gcache.Client   batch_put_from / batch_get_into on the pages' (pointer, size)
                      entries, keys and pointers computed before the clock starts:
                      the floor for any GCache backend;
  GCache backend      GCacheHiCacheStorage.batch_set_v1 / batch_get_v1 (interface_v1,
                      zero copy) as SGLang's controller calls them: keys built, pointers
                      taken from get_page_buffer_meta, existing pages probed, bytes moved;
  HiCacheFile         SGLang's own `file` backend on local disk, through the legacy path
                      the controller uses for it (get_data_page + batch_set;
                      batch_get + set_from_flat_data_page). Files are read right after
                      being written, so reads come from the OS page cache.

Every repeat writes fresh pages (new hashes), and its keys / files are removed after
it, so the working set is one batch per system. The host pool runs SGLang's own
page code (HostPoolStandIn; the real MHATokenToKVPoolHost needs a GPU build). Reads
are checked byte for byte against the written pages. Target (issue 9): the backend
adds <= 10% over the raw client (median time per batch).

Usage (in the SGLang venv, tests/integrations/setup_venv.sh):
  .venv-sglang/bin/python -m bench.sglang.backend [--repeats 9] [--pages 128]
      [--layout page_first] [--page-size 16] [--layers 8] [--heads 8] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from bench.common.stats import spread  # noqa: E402
from gcache.testing.sglang_modules import HostPoolStandIn, load_sglang_storage  # noqa: E402
from gcache.tools.devcluster.local_server import LocalServer  # noqa: E402
from gcache.wire.keys import page_hashes  # noqa: E402

TARGET_OVERHEAD = 0.10
DYNAMIC = {
    "backend_name": "gcache",
    "module_path": "gcache.integrations.sglang.backend",
    "class_name": "GCacheHiCacheStorage",
    "interface_v1": 1,
}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--pages", type=int, default=128, help="pages per batch (SGLang: 128)")
    p.add_argument(
        "--layout", default="page_first", choices=["page_first", "page_first_direct", "page_head", "layer_first"]
    )
    p.add_argument("--page-size", type=int, default=16, help="tokens per page")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8, help="KV heads on this rank")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--server-memory", default="1GiB")
    p.add_argument("--work-dir", default=None, help="server data and HiCacheFile files (default: a temp dir)")
    args = p.parse_args(argv)
    if not 1 <= args.repeats <= 100 or not 1 <= args.pages <= 4096:
        p.error("--repeats must be in [1, 100] and --pages in [1, 4096]")
    return args


def storage_config(hicache_storage, extra):
    return hicache_storage.HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/model",
        extra_config=extra,
    )


def page_slots(pool, pages):
    import torch

    return torch.cat([pool.page_slots(p) for p in pages])


RAW, BACKEND, FILE = "raw gcache.Client", "GCache backend (v1)", "SGLang HiCacheFile (disk)"
SYSTEMS = (RAW, BACKEND, FILE)


class Systems:
    """The three systems over one host pool: pages [0, n) are written; each system reads
    into its own n pages after them, so reads can run back to back and be checked after."""

    def __init__(self, args, work: Path):
        import torch

        self.hicache_storage, factory = load_sglang_storage()
        self.n = n = args.pages
        self.pool = HostPoolStandIn(
            layout=args.layout,
            page_size=args.page_size,
            pages=4 * n,
            layer_num=args.layers,
            head_num=args.heads,
            head_dim=args.head_dim,
        )
        raw_bytes = self.pool.kv_buffer.view(-1).view(torch.uint8)
        raw_bytes.copy_(
            torch.randint(0, 256, raw_bytes.shape, generator=torch.Generator().manual_seed(9), dtype=torch.uint8)
        )
        self.src = page_slots(self.pool, range(n))
        self.dst = {name: page_slots(self.pool, range((i + 1) * n, (i + 2) * n)) for i, name in enumerate(SYSTEMS)}
        self.server = LocalServer(work / "gcache", memory=args.server_memory, disk="256MiB").start()
        config = storage_config(self.hicache_storage, dict(DYNAMIC, gcache_url=self.server.address))
        self.backend = factory.create_backend("dynamic", config, self.pool)
        self.backend.register_mem_pool_host(self.pool)
        self.backend.on_host_pools_registered()
        self.client = self.backend.client  # the raw runs share its connections and registration
        file_config = storage_config(self.hicache_storage, {"file_storage_path": str(work / "hicache-file")})
        self.file = factory.create_backend("file", file_config, self.pool)
        self.file.register_mem_pool_host(self.pool)
        self.kv = self.backend._kv_pages()
        self.page_bytes = self.kv.page_bytes
        self.hashes = {}

    def fresh(self, repeat: int) -> None:
        """New page hashes for every system: every batch writes pages the store lacks."""
        for i, name in enumerate(SYSTEMS):
            first = (repeat * len(SYSTEMS) + i) * 10_000_000
            self.hashes[name] = page_hashes(range(first, first + self.n * self.pool.page_size), self.pool.page_size)

    def blank_and_check(self, name: str, check: bool) -> None:
        """Checks `name`'s read pages against the written ones, then zeroes them."""
        import torch

        size, first = self.pool.page_size, int(self.dst[name][0])
        blank = self.pool.get_dummy_flat_data_page()
        for p in range(self.n):
            if check:
                a = self.pool.get_data_page(p * size).view(torch.uint8)
                b = self.pool.get_data_page(first + p * size).view(torch.uint8)
                if not torch.equal(a, b):
                    raise RuntimeError(f"{name}: page {p} read back different bytes")
            self.pool.set_from_flat_data_page(first + p * size, blank)

    def run(self, name: str, op: str) -> float:
        """One batch of `op` ("set" / "get") through system `name`; its seconds."""
        hashes, dst = self.hashes[name], self.dst[name]
        if name == RAW:  # keys and pointers ready before the clock: only the transfer is timed
            keys, src_ptrs, sizes = self.kv.locate([f"raw{h[3:]}" for h in hashes], self.src)
            dst_ptrs = self.kv.locate(hashes, dst)[1]
        size = self.pool.page_size
        start = time.perf_counter()
        if name == RAW and op == "set":
            ok = self.client.batch_put_from(keys, src_ptrs, sizes)
        elif name == RAW:
            ok = [g == s for g, s in zip(self.client.batch_get_into(keys, dst_ptrs, sizes), sizes)]
        elif name == BACKEND:
            ok = (self.backend.batch_set_v1 if op == "set" else self.backend.batch_get_v1)(
                hashes, self.src if op == "set" else dst
            )
        elif op == "set":  # what SGLang's controller does for the file backend (_generic_page_set)
            ok = [
                self.file.batch_set(hashes, [self.pool.get_data_page(self.src[i * size]) for i in range(len(hashes))])
            ]
        else:  # _generic_page_get
            pages = self.file.batch_get(hashes, [self.pool.get_dummy_flat_data_page() for _ in hashes])
            ok = [page is not None for page in pages]
            for i, page in enumerate(pages):
                self.pool.set_from_flat_data_page(dst[i * size], page)
        seconds = time.perf_counter() - start
        if not all(ok):
            raise RuntimeError(f"{name} {op}: {ok.count(False)} of {len(ok)} failed")
        return seconds

    def backend_own_work(self) -> tuple[float, float]:
        """(seconds to build one batch's keys and pointers, seconds of its EXISTS probe):
        the backend's work besides the transfer, timed alone (less exposed to noise)."""
        hashes = self.hashes[BACKEND]
        start = time.perf_counter()
        keys = self.kv.locate(hashes, self.src)[0]
        middle = time.perf_counter()
        self.client.batch_is_exist(keys)
        return middle - start, time.perf_counter() - middle

    def forget(self) -> None:
        """Drops this repeat's pages: the working set stays one batch per system."""
        self.client.batch_remove(self.kv.keys.entries(self.hashes[BACKEND]))
        self.client.batch_remove(self.kv.locate([f"raw{h[3:]}" for h in self.hashes[RAW]], self.src)[0])
        self.file.clear()

    def close(self):
        self.backend.close()
        self.server.stop()


def summary(times: list[float], nbytes: int) -> tuple[float, float, float, float]:
    lo, mid, hi = spread(times)
    return lo, mid, hi, nbytes / mid / 1e9


def main(argv=None) -> int:
    args = parse_args(argv)
    work_ctx = tempfile.TemporaryDirectory(prefix="gcache-sglang-bench-") if args.work_dir is None else None
    work = Path(args.work_dir or work_ctx.name)
    systems = Systems(args, work)
    times = {(name, op): [] for name in SYSTEMS for op in ("set", "get")}
    own = []
    try:
        for repeat in range(args.repeats + 1):  # repeat 0 warms every path up, untimed
            systems.fresh(repeat)
            # The raw client and the backend run back to back, first one then the other
            # (alternating), so both see the same machine; HiCacheFile's disk work comes
            # after both, and its dirty pages are flushed (untimed) before the next pair.
            pair = (RAW, BACKEND) if repeat % 2 else (BACKEND, RAW)
            for name, op in [(n, "set") for n in pair] + [(n, "get") for n in pair] + [(FILE, "set"), (FILE, "get")]:
                seconds = systems.run(name, op)
                if repeat:
                    times[(name, op)].append(seconds)
            os.sync()
            for name in SYSTEMS:
                systems.blank_and_check(name, check=True)
            if repeat:
                own.append(systems.backend_own_work())
            systems.forget()
    finally:
        systems.close()
        if work_ctx is not None:
            work_ctx.cleanup()

    batch_bytes = args.pages * systems.page_bytes
    print("GCache as SGLang 0.5.23's HiCache L3 backend: v1 throughput of one batch")
    print(f"command: .venv-sglang/bin/python -m bench.sglang.backend {shlex.join(argv or sys.argv[1:])}")
    print(
        f"working set: {args.pages} pages x {systems.page_bytes} B = "
        f"{batch_bytes / 2**20:.1f} MiB per batch ({args.layout}; {args.page_size} tokens x "
        f"{args.layers} layers x {args.heads} KV heads x {args.head_dim} dim, bf16, K+V); "
        f"{args.repeats} repeats after one warm-up; one local gcache-server "
        f"(memory tier {args.server_memory}); HiCacheFile in {work} (page cache)"
    )
    print(
        f"{'op':4} {'system':28} {'min ms':>9} {'median ms':>10} {'max ms':>9} {'GB/s':>7}"
        "  median / raw median  (median of same-repeat ratios)"
    )
    for op in ("set", "get"):
        raw_times = times[(RAW, op)]
        for name in SYSTEMS:
            lo, mid, hi, gbps = summary(times[(name, op)], batch_bytes)
            paired = statistics.median(t / r for t, r in zip(times[(name, op)], raw_times))
            print(
                f"{op:4} {name:28} {lo * 1e3:9.2f} {mid * 1e3:10.2f} {hi * 1e3:9.2f} {gbps:7.2f}"
                f"  {mid / statistics.median(raw_times):5.2f}x  ({paired:5.2f}x)"
            )
    locate_ms = statistics.median(o[0] for o in own) * 1e3
    probe_ms = statistics.median(o[1] for o in own) * 1e3
    print(
        f"backend's own work per batch (medians): keys + pointers {locate_ms:.2f} ms (set, get), "
        f"EXISTS probe {probe_ms:.2f} ms (set); the rest is the same transfer as the raw client"
    )
    for op in ("set", "get"):
        ratio = statistics.median(times[(BACKEND, op)]) / statistics.median(times[(RAW, op)])
        paired = statistics.median(b / r for b, r in zip(times[(BACKEND, op)], times[(RAW, op)]))
        verdict = "met" if ratio <= 1 + TARGET_OVERHEAD else "MISSED"
        print(
            f"backend overhead on {op}: {(ratio - 1) * 100:+.1f}% over the raw client, median vs "
            f"median (target <= {TARGET_OVERHEAD * 100:.0f}%: {verdict}); same-repeat median "
            f"{(paired - 1) * 100:+.1f}%"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
