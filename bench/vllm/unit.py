"""The vLLM connector's unit of storage: one value per (page, layer), the old scheme, beside one
value per (page, KV cache group) holding all the group's layers, through one real gcache-server,
same run, the two interleaved round by round.

    .venv/bin/python -m bench.vllm.unit [--layers 32] [--pages 32] [--page-kib 64] [--repeats 5]
                                        [--transport shm]

Per request of `pages` pages of a `layers`-layer model (pages of `page-kib` KiB per layer, as
Llama-3-8B bf16 at block 16: 32 layers x 64 KiB), timed end to end on the host:
- per layer: batch_put_from / batch_get_into of pages x layers values straight from and into
  the KV buffer (registered with the client), what the connector did before;
- per group: the gather of each block's layers into staging slots (native copy_ranges, what
  HostMover does; a GPU does it with DMA), batch_put_from of pages values from the slots,
  then batch_get_into the slots and the scatter back into other blocks.
Both schemes read with checksums verified (the connector's default); the per-group load is
also timed without them, so the hashing's cost shows. Every round checks the loaded bytes. Keys are distinct per round (a save always writes).
Prints keys per request, save, lookup (batch_is_exist, the scheduler's probe) and load seconds (min / median / max over the rounds) and the
ratio per-layer / per-group per round.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

import gcache
from bench.common.stats import spread
from gcache.integrations.vllm.transfer.movers.host import HostMover
from gcache.integrations.vllm.transfer.numpy_view import NumpyView
from gcache.integrations.vllm.transfer.page_runs import page_runs
from gcache.integrations.vllm.transfer.staging import StagingPool
from gcache.integrations.vllm.transfer.values import GroupValues
from gcache.tools.devcluster.local_server import LocalServer


def timed(fn) -> float:
    import time

    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pages", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transport", default="shm", choices=["tcp", "shm"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    L, P, page = args.layers, args.pages, args.page_kib << 10
    blocks = 2 * P  # saved from the first half, loaded into the second
    kv = np.random.default_rng(0).integers(0, 255, (L, blocks, 8, page // 8 // 64, 64), dtype=np.uint8)
    values = GroupValues([page_runs(NumpyView(kv[i]), blocks) for i in range(L)], 1 << 30)
    mover = HostMover()
    pool = StagingPool(mover.alloc_host(P * values.value_bytes), values.value_bytes)
    memory = f"{max(1024, 3 * args.repeats * 2 * P * L * page >> 20)}MiB"
    rows: dict[str, list] = {f"{k}_{w}": [] for k in ("layer", "group") for w in ("save", "lookup", "load")}
    rows["group_load_unchecked"] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalServer(Path(tmp) / "node", memory=memory, disk="1GiB")
        server.start()
        try:
            # The connector verifies every value's checksum on read (gcache_verify_checksums);
            # the second client shows what that costs on the per-group load.
            with (
                gcache.Client(server.address, transport=args.transport, verify_checksums=True) as client,
                gcache.Client(server.address, transport=args.transport, verify_checksums=False) as unchecked,
            ):
                client.register_buffer(kv.ctypes.data, kv.nbytes)
                client.register_buffer(pool.base, pool.nbytes)
                unchecked.register_buffer(pool.base, pool.nbytes)
                for r in range(args.repeats):
                    src, dst = np.arange(P), np.arange(P, 2 * P)
                    # per (page, layer)
                    keys = [f"r{r}-p{p}-l{layer}".encode() for p in range(P) for layer in range(L)]
                    addr = [kv[layer, p].ctypes.data for p in src for layer in range(L)]
                    back = [kv[layer, p].ctypes.data for p in dst for layer in range(L)]
                    sizes = [page] * len(keys)
                    rows["layer_save"].append(timed(lambda: client.batch_put_from(keys, addr, sizes)))
                    rows["layer_lookup"].append(timed(lambda: client.batch_is_exist(keys)))
                    rows["layer_load"].append(timed(lambda: client.batch_get_into(keys, back, sizes)))
                    assert np.array_equal(kv[:, dst], kv[:, src]), "per-layer load: wrong bytes"
                    kv[:, dst] = 0
                    # per (page, group)
                    gkeys = [f"r{r}-p{p}-g0".encode() for p in range(P)]
                    gsizes = [values.value_bytes] * P

                    def save():
                        slots = pool.take(P)
                        c = values.gather(src, pool.addresses(slots))
                        mover.copy(None, c.dst, c.src, c.sizes)
                        client.batch_put_from(gkeys, [int(a) for a in pool.addresses(slots)], gsizes)
                        pool.give_back(slots)

                    def load(reader=client):
                        slots = pool.take(P)
                        got = reader.batch_get_into(gkeys, [int(a) for a in pool.addresses(slots)], gsizes)
                        assert got == gsizes, "per-group load: a value missing or short"
                        c = values.scatter(pool.addresses(slots), dst)
                        mover.copy(None, c.dst, c.src, c.sizes)
                        pool.give_back(slots)

                    rows["group_save"].append(timed(save))
                    rows["group_lookup"].append(timed(lambda: client.batch_is_exist(gkeys)))
                    rows["group_load"].append(timed(load))
                    assert np.array_equal(kv[:, dst], kv[:, src]), "per-group load: wrong bytes"
                    kv[:, dst] = 0
                    rows["group_load_unchecked"].append(timed(lambda: load(unchecked)))
                    assert np.array_equal(kv[:, dst], kv[:, src]), "per-group load: wrong bytes"
                    kv[:, dst] = 0
        finally:
            server.stop()
    mib = P * L * page / (1 << 20)
    print(
        f"vLLM connector unit: {L} layers x {P} pages x {args.page_kib} KiB = {mib:.0f} MiB per request, "
        f"{args.transport}, {args.repeats} rounds (min / median / max)"
    )
    print(f"{'scheme':10} {'keys/request':>12} {'save s':>26} {'lookup s':>26} {'load s':>26}")
    for scheme, keys in (("per layer", P * L), ("per group", P)):
        k = scheme.split()[1]
        cells = " ".join(f"{x:8.4f}" for w in ("save", "lookup", "load") for x in spread(rows[f"{k}_{w}"]))
        print(f"{scheme:10} {keys:12d} {cells}")
    lo, mid, hi = spread(rows["group_load_unchecked"])
    cost = spread(a - b for a, b in zip(rows["group_load"], rows["group_load_unchecked"]))
    rate = f"= {mib / cost[1] / 1024:.1f} GiB/s of hashing (median)" if cost[1] > 0 else "(within the noise)"
    print(
        f"per group, load without checksums: {lo:.4f} {mid:.4f} {hi:.4f} s; checksums cost per round "
        f"{cost[0]:+.4f} {cost[1]:+.4f} {cost[2]:+.4f} s {rate}"
    )
    for what in ("save", "lookup", "load"):
        ratio = spread(a / b for a, b in zip(rows[f"layer_{what}"], rows[f"group_{what}"]))
        print(f"{what}: per-layer time / per-group time, per round: {ratio[0]:.2f} {ratio[1]:.2f} {ratio[2]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": str(args.json)}, rounds=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
