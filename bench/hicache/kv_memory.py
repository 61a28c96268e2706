"""KV bytes one request holds at 1K / 8K / 32K context: hybrid SWA model vs all-full-attention.

Run:  .venv/bin/python -m bench.hicache.kv_memory            (add --no-real to skip the 1K model run)

Counts the pages the request's RequestKV actually holds after a chunked prefill through the
same grow / free_swa_out_of_window code the engine uses (SWA pages that fell out of the
window go back to the pool after every chunk). At 1K the real model also runs on the pages
and its last logits are checked against the dense reference. Exits 1 if the 32K reduction
is below 6.5x.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from gcache.worker.backend import to_numpy
from gcache.worker.config import ModelConfig
from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV
from gcache.worker.model.transformer import Model

CONTEXTS = (1024, 8192, 32768)
REDUCTION_MIN_32K = 6.5


def held_bytes(cfg: ModelConfig, length: int, chunk: int, real: bool) -> tuple[int, int, tuple[int, int], float]:
    """(bytes held at `length`, peak bytes during prefill, (full, swa) pages, last-logit error)."""
    pages = -(-length // cfg.page_size)
    kv = DualKVCache(cfg, pages, pages)  # zero-filled lazily: accounting runs touch no memory
    req = RequestKV(cfg.page_size, cfg.window)
    model = Model(cfg) if real else None
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, length)
    peak, logits = 0, None
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        if not req.grow(kv, end):
            raise RuntimeError("pool too small")
        peak = max(peak, req.held_bytes(kv))
        if model is not None:
            logits = model.forward(tokens[start:end], None, req, kv)
        else:
            req.num_tokens = end  # accounting only: the KV would be written here
        req.free_swa_out_of_window(kv)
    kv.check_integrity()
    err = float("nan")
    if model is not None:
        err = float(np.abs(to_numpy(logits)[-1] - to_numpy(model.reference_logits(tokens))[-1]).max())
    return req.held_bytes(kv), peak, req.held_pages(), err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size (tokens)")
    ap.add_argument("--no-real", action="store_true", help="accounting only, also at 1K")
    args = ap.parse_args(argv)
    hybrid = ModelConfig()
    full = hybrid.all_full()
    extra = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"command: .venv/bin/python -m bench.hicache.kv_memory {extra}".rstrip())
    print(
        f"model: {hybrid.layers} layers ({len(hybrid.full_layers)} full + {len(hybrid.swa_layers)} SWA, "
        f"W={hybrid.window}), kv_heads={hybrid.kv_heads}, head_dim={hybrid.head_dim}, {hybrid.dtype}, "
        f"page={hybrid.page_size} tokens, prefill chunk={args.chunk}"
    )
    print(
        f"{'context':>8} {'hybrid KiB':>11} {'(full,swa) pages':>17} {'all-full KiB':>13} "
        f"{'reduction':>9} {'theory':>7} {'hybrid peak KiB':>16} {'1K logit err':>12}"
    )
    worst_32k = None
    for length in CONTEXTS:
        real = length == 1024 and not args.no_real
        t0 = time.perf_counter()
        h_bytes, h_peak, h_pages, err = held_bytes(hybrid, length, args.chunk, real)
        f_bytes, _, _, _ = held_bytes(full, length, args.chunk, real)
        ratio = f_bytes / h_bytes
        nf, ns, w = len(hybrid.full_layers), len(hybrid.swa_layers), hybrid.window
        theory = hybrid.layers * length / (nf * length + ns * min(w, length))
        print(
            f"{length:>8} {h_bytes / 1024:>11.0f} {str(h_pages):>17} {f_bytes / 1024:>13.0f} "
            f"{ratio:>8.2f}x {theory:>6.2f}x {h_peak / 1024:>16.0f} "
            f"{(f'{err:.1e}' if real else '-'):>12}   ({time.perf_counter() - t0:.1f}s)"
        )
        if length == 32768:
            worst_32k = ratio
    ok = worst_32k is not None and worst_32k >= REDUCTION_MIN_32K
    print(
        f"32K reduction {worst_32k:.2f}x {'>=' if ok else '<'} {REDUCTION_MIN_32K}x required "
        f"(theory for 1 full : 6 SWA is 7x as context -> infinity)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
