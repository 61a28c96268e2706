"""The compute clock of the scheduling benches: CostModel fitted to the real numpy model.

`calibrate` times the real model (gcache/worker/model/transformer.py) on a grid of batch shapes and
fits CostModel's five coefficients (non-negative least squares on relative error). It
times CPU time of this process, not wall time (BLAS runs one thread, OPENBLAS_NUM_THREADS=1):
on a shared machine one batch's wall time varies up to 5x between identical runs, its CPU
time far less; the fastest of `repeats` runs counts. A fit takes ~20 s, and two fits on a busy machine can split the
attention cost between the kv_s and read_s terms differently, so `load_or_calibrate` keeps
the fit in a file; bench/worker/ttft.py defaults it to a per-machine cache file keyed by everything
the fit depends on (host, numpy, backend, model config, shapes, repeats), so every run on
this machine reuses one fit unless --recalibrate.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

import numpy as np

from gcache.worker import backend
from gcache.worker.config import ModelConfig
from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV
from gcache.worker.model.base import BatchModel
from gcache.worker.model.sim import CostModel, VirtualClock

CAL_SHAPES = [[(1, ctx)] * nd for nd in (1, 4, 16, 32) for ctx in (64, 512, 2048)] + [
    [(n, ctx)] + [(1, 300)] * nd for n in (16, 64, 128, 256, 384, 512) for ctx in (0, 1024) for nd in (0, 16)
]  # [(new tokens, context before)] per batch


def nnls_relative(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (active set: drop the most negative)."""
    active = list(range(X.shape[1]))
    A = X / y[:, None]
    while True:
        c = np.linalg.lstsq(A[:, active], np.ones(len(y)), rcond=None)[0]
        if (c >= 0).all():
            out = np.zeros(X.shape[1])
            out[active] = c
            return out
        del active[int(np.argmin(c))]


def calibrate(cfg: ModelConfig, repeats: int) -> tuple[CostModel, float]:
    """Fit CostModel to the real model's batch times on this machine; returns the model
    and the median |relative error| of the fit over the calibration shapes."""
    from gcache.worker.model.transformer import Model

    model, rng = Model(cfg), np.random.default_rng(0)
    kv = DualKVCache(cfg, 8192, 8192)
    proto = CostModel(swa_dense=True)
    f = len(cfg.full_layers) / cfg.layers
    rows, times = [], []
    for shape in CAL_SHAPES:
        reqs = [RequestKV(cfg.page_size, cfg.window) for _ in shape]
        for r, (n, ctx) in zip(reqs, shape):
            if not r.grow(kv, ctx + n):
                raise RuntimeError(f"calibration pools too small for shape {shape}")
        best = float("inf")
        for _ in range(repeats):
            for r, (n, ctx) in zip(reqs, shape):
                r.num_tokens = ctx  # K/V before ctx is whatever the pages hold: fine for timing
            work = [(rng.integers(0, 256, size=n), None, r) for r, (n, _) in zip(reqs, shape)]
            t0 = time.process_time()
            model.forward_batch(work, kv)
            best = min(best, time.process_time() - t0)
        for r in reqs:
            r.release(kv)
        rows.append(proto.features([(n, ctx + n) for n, ctx in shape], f, cfg.window))
        times.append(best)
    X, y = np.array(rows), np.array(times)
    c = nnls_relative(X, y)
    fitted = CostModel(
        base_s=float(c[0]), token_s=float(c[1]), req_s=float(c[2]), kv_s=float(c[3]), read_s=float(c[4]), swa_dense=True
    )
    return fitted, float(np.median(np.abs(X @ c / y - 1)))


def default_cache_path(cfg: ModelConfig, repeats: int) -> str:
    """~/.cache/gcache/cost_<key>.json; the key changes with anything the fit depends on."""
    key = repr(
        (
            "cpu-time-v1",
            platform.node(),
            platform.machine(),
            np.__version__,
            backend.backend_name(backend.xp),
            os.environ.get("OPENBLAS_NUM_THREADS", ""),
            cfg,
            CAL_SHAPES,
            repeats,
        )
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "gcache", f"cost_{digest}.json")


def load_or_calibrate(args, log=None) -> tuple[CostModel, float]:
    """args.cal_file set: reuse the fit saved there (unless args.recalibrate), else fit and
    save it there; empty: fit, save nothing. args.cal_repeats: timing runs per shape."""
    say = log or (lambda msg: None)
    path = args.cal_file
    if path and os.path.exists(path) and not getattr(args, "recalibrate", False):
        with open(path) as f:
            d = json.load(f)
        say(f"compute clock: fit read from {path} (fitted {d.get('fitted_at', '?')}; --recalibrate refits)")
        return CostModel(**d["cost"]), d["median_rel_error"]
    t0 = time.perf_counter()
    cost, err = calibrate(ModelConfig(dtype="float32"), args.cal_repeats)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(
                {"cost": cost.__dict__, "median_rel_error": err, "fitted_at": time.strftime("%Y-%m-%d %H:%M:%S")}, f
            )
        os.replace(tmp, path)  # atomic: a concurrent run reads the old fit or the new one, whole
    say(f"compute clock: fitted in {time.perf_counter() - t0:.0f} s" + (f", saved to {path}" if path else ""))
    return cost, err


def describe(c: CostModel, err: float, shapes: bool = True) -> str:
    return (
        f"base {c.base_s * 1e3:.2f}ms + {c.token_s * 1e6:.1f}us/token + {c.req_s * 1e3:.2f}ms/seq"
        f" + {c.kv_s * 1e9:.2f}ns/(token x key) + {c.read_s * 1e9:.1f}ns/key read;"
        f" median |error| {err:.1%}" + (f" over {len(CAL_SHAPES)} shapes" if shapes else "")
    )


def add_cost_args(ap) -> None:
    """The options load_cost reads: --cost fitted|default, --cal-repeats, --cal-file."""
    ap.add_argument(
        "--cost",
        choices=("fitted", "default"),
        default="fitted",
        help="fitted: CostModel fitted to the real numpy model here (bench/worker/ttft.py's calibrate)",
    )
    ap.add_argument("--cal-repeats", type=int, default=3)
    ap.add_argument("--cal-file", default="", help="JSON: load the fitted costs from it, or save them")


def load_cost(args, fitted_label: str = "fitted to the real numpy model") -> tuple[CostModel, str]:
    """The compute clock of a --cost fitted|default bench and the line describing it:
    CostModel()'s unfitted defaults, or load_or_calibrate(args)."""
    if args.cost == "default":
        return CostModel(), "CostModel() defaults (not fitted)"
    cost, err = load_or_calibrate(args)
    return cost, f"{fitted_label}: {describe(cost, err, shapes=False)}"


class FittedClockModel(BatchModel):
    """The real model computes each batch; the virtual clock advances by its fitted cost."""

    def __init__(self, model, cost: CostModel, clock: VirtualClock) -> None:
        self.model, self.cost, self.clock = model, cost, clock
        self.full_fraction = len(model.config.full_layers) / model.config.layers
        self.wall_s = self.fitted_s = 0.0

    def forward_batch(self, chunks, kv, all_logits: bool = False, layer_ready=None) -> list:
        shape = [(len(tokens), req.num_tokens + len(tokens)) for tokens, _, req in chunks]
        t0 = time.perf_counter()
        out = self.model.forward_batch(chunks, kv, all_logits, layer_ready=layer_ready)
        self.wall_s += time.perf_counter() - t0
        cost = self.cost.cost_s(self.cost.features(shape, self.full_fraction, self.model.config.window))
        self.fitted_s += cost
        self.clock.advance(cost)
        return out
