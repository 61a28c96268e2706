"""One image's embedding through GCache as SGLang's embedding store: what a save and a load cost,
next to a memcpy of its bytes.

Every repeat stores a fresh item (a new SGLang item hash), so each save writes and each load
reads, and removes its values after it (the working set stays one item per system, as in a
warm store whose memory is reused); one uncounted repeat comes first. The systems run back to
back in one process on one gcache-server (same machine state):

  memcpy           the payload copied from one pool to the other (gcache._native.copy_ranges):
                   the floor for moving these bytes at all on this host;
  raw client       gcache.Client batch_put_from / batch_get_into of the payload as one value,
                   key and address ready: GCache's floor;
  store save/load  GCacheEmbeddingStore.batch_put_from_multi_buffers / batch_get_into_multi_buffers
                   as SGLang's controller io thread calls them (one item, one page run): the
                   existence probe, header, payload, checks (checksums verified on load);
  store exists     batch_is_exist (header + first payload key);
  controller       SGLang's EmbeddingCacheController: insert_batch until its io thread has put
                   the item, prefetch until check_prefetch_progress (its io loop polls every
                   1 ms; the encoder server polls progress every 5 ms, this bench every 0.2 ms).

Default item: 1296 tokens x 3584 (bfloat16), 9.3 MB: Qwen2.5-VL-7B's embedding of a 1008 x 1008
image. Loads are checked byte for byte.

Usage (in the SGLang venv, tests/integrations/setup_venv.sh):
  .venv-sglang/bin/python -m bench.sglang.embedding [--repeats 9] [--tokens 1296] [--dim 3584]
      [--dtype bfloat16] [--transport auto|tcp|shm]
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from bench.common.stats import spread  # noqa: E402
from gcache.testing.sglang_embedding import (  # noqa: E402
    load_controller_module,
    make_controller,
    stage_into_pool,
)
from gcache.tools.devcluster.local_server import LocalServer  # noqa: E402

POLL_S = 0.0002
ROWS = (
    "memcpy",
    "raw client put",
    "raw client get",
    "store save",
    "store load",
    "store exists",
    "controller insert",
    "controller prefetch",
)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--tokens", type=int, default=1296, help="rows of the embedding")
    p.add_argument("--dim", type=int, default=3584, help="width of a row")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--transport", default="auto", choices=["auto", "tcp", "shm"])
    p.add_argument("--server-memory", default="1GiB")
    args = p.parse_args(argv)
    if not 3 <= args.repeats <= 100 or not 1 <= args.tokens <= 100_000 or not 1 <= args.dim <= 65_536:
        p.error("--repeats in [3, 100], --tokens in [1, 100000], --dim in [1, 65536]")
    return args


def wait(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not finish in {timeout_s} s")
        time.sleep(POLL_S)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import numpy as np
    import torch

    load_controller_module()
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
    from sglang.srt.multimodal.modality import Modality

    from gcache._native import copy_ranges
    from gcache.integrations.sglang.embedding_store import register

    register(cli=False)
    dtype = getattr(torch, args.dtype)
    item = torch.randn(args.tokens, args.dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    nbytes = item.numel() * item.element_size()
    pool_mib = max(64.0, 8 * nbytes / 2**20)  # room for every repeat's item in each pool
    samples = {row: [] for row in ROWS}
    with tempfile.TemporaryDirectory(prefix="gc-bench-emb-") as work:
        server = LocalServer(Path(work) / "gcache", memory=args.server_memory, disk="256MiB").start()
        try:
            config = {"gcache_url": server.address, "gcache_model": "bench", "gcache_transport": args.transport}
            stores = [EmbeddingStoreFactory.create_backend("gcache", storage_config=config) for _ in range(2)]
            writer, reader = (make_controller(s, image_dim=args.dim, dtype=dtype, pool_mib=pool_mib) for s in stores)
            transport = stores[0].client.transport
            src = torch.empty_like(item)
            src.copy_(item)
            dst = torch.zeros_like(item)
            for store in stores:
                store.register_buffer(src)
                store.register_buffer(dst)
            raw = stores[0].client
            u64 = lambda v: np.asarray([v], dtype=np.uint64)  # noqa: E731
            for r in range(-1, args.repeats):  # -1: the warm-up, not counted
                h = f"{r + 1}{time.time_ns()}"
                start = time.perf_counter()
                copy_ranges(u64(dst.data_ptr()), u64(src.data_ptr()), u64(nbytes))
                samples["memcpy"].append(time.perf_counter() - start)
                dst.zero_()

                key = f"raw-{h}".encode()
                start = time.perf_counter()
                ok = raw.batch_put_from([key], [src.data_ptr()], [nbytes])
                samples["raw client put"].append(time.perf_counter() - start)
                start = time.perf_counter()
                got = raw.batch_get_into([key], [dst.data_ptr()], [nbytes])
                samples["raw client get"].append(time.perf_counter() - start)
                if ok != [True] or got != [nbytes] or not torch.equal(dst.view(torch.uint8), src.view(torch.uint8)):
                    raise RuntimeError("raw client round trip failed")
                dst.zero_()

                start = time.perf_counter()
                ok = stores[0].batch_put_from_multi_buffers([h], [[src.data_ptr()]], [[nbytes]])
                samples["store save"].append(time.perf_counter() - start)
                start = time.perf_counter()
                got = stores[1].batch_get_into_multi_buffers([h], [[dst.data_ptr()]], [[nbytes]])
                samples["store load"].append(time.perf_counter() - start)
                start = time.perf_counter()
                exists = stores[1].batch_is_exist([h])
                samples["store exists"].append(time.perf_counter() - start)
                if ok != [True] or got != [True] or exists != [True]:
                    raise RuntimeError(f"store round trip failed: {ok} {got} {exists}")
                if not torch.equal(dst.view(torch.uint8), src.view(torch.uint8)):
                    raise RuntimeError("the store loaded other bytes")
                dst.zero_()

                c = f"c{h}"
                if stage_into_pool(writer, [c], [item], Modality.IMAGE) != [c]:
                    raise RuntimeError("the writer's pool is full")
                start = time.perf_counter()
                writer.insert_batch([c], Modality.IMAGE)
                writer.insert_queue.join()
                samples["controller insert"].append(time.perf_counter() - start)
                start = time.perf_counter()
                reader.prefetch(f"req{r}", [c], [args.tokens], Modality.IMAGE)
                wait(lambda: reader.check_prefetch_progress(f"req{r}"), "prefetch")  # noqa: B023
                samples["controller prefetch"].append(time.perf_counter() - start)
                views = reader.get_pool_views([c])[0]
                if views is None or not torch.equal(torch.cat(views).view(torch.uint8), item.view(torch.uint8)):
                    raise RuntimeError("the controller loaded other bytes")
                reader.release_pool_views([c])
                # This repeat's values out of the store, its entries out of the pools.
                raw.batch_remove([key, *stores[0].item_keys(h, args.dtype, args.dim, nbytes)])
                raw.batch_remove(stores[0].item_keys(c, args.dtype, args.dim, nbytes))
                for controller in (writer, reader):
                    with controller.lock:
                        controller._evict_entry(c)
                if r < 0:
                    for values in samples.values():
                        values.clear()
            for controller in (writer, reader):
                controller.stop()
            counters = stores[1].counters()
            for store in stores:
                store.close()
        finally:
            server.kill()

    print(f"command: {shlex.join([sys.executable, '-m', 'bench.sglang.embedding', *(argv or sys.argv[1:])])}")
    print(
        f"item: {args.tokens} x {args.dim} {args.dtype} = {nbytes / 1e6:.2f} MB; transport {transport}; "
        f"{args.repeats} repeats; one gcache-server ({args.server_memory}) on this host; cores {os.cpu_count()}"
    )
    print(f"{'':22}{'min ms':>9}{'median':>9}{'max':>9}{'GB/s (median)':>15}{'x memcpy':>10}")
    memcpy = spread(samples["memcpy"])[1]
    for row in ROWS:
        lo, mid, hi = spread(samples[row])
        rate = "" if row == "store exists" else f"{nbytes / mid / 1e9:15.2f}"
        print(f"{row:22}{lo * 1e3:9.3f}{mid * 1e3:9.3f}{hi * 1e3:9.3f}{rate:>15}{mid / memcpy:10.1f}")
    print(f"reader counters: bytes_staged={counters['bytes_staged']} items_read={counters['items_read']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
