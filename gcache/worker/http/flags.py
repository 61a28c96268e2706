"""`gcache-worker` flags and the engine they build."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from gcache.serving.body import BODY_DEADLINE_S
from gcache.worker.config import ModelConfig
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.scheduler import POLICIES, SchedulerConfig
from gcache.worker.http.pd_flags import add_role_args, check_role
from gcache.worker.http.publisher import add_publisher_args
from gcache.worker.kvcache.hicache_config import PREFETCH_POLICIES, WRITE_POLICIES, HiCacheConfig
from gcache.worker.kvcache.kv_pool import DualKVCache

PRESETS_DIR = Path(__file__).resolve().parents[1] / "model/presets"
TINY_MTP_WEIGHTS = PRESETS_DIR / "tiny_mtp_stdlib.npz"
TINY_MTP_RECUR_WEIGHTS = PRESETS_DIR / "tiny_mtp_recur.npz"  # MTP drafts that read their window
SHIPPED_WEIGHTS = {"tiny-mtp": TINY_MTP_WEIGHTS, "tiny-mtp-recur": TINY_MTP_RECUR_WEIGHTS}


def build_engine(args: argparse.Namespace) -> tuple[Engine, str]:
    from gcache.worker import backend

    check_role(args)  # ValueError for a role these flags cannot serve
    from gcache.worker.model.transformer import Model
    from gcache.worker.model.weights import load

    weights = None
    if args.preset in SHIPPED_WEIGHTS and not args.weights:
        args.weights = str(SHIPPED_WEIGHTS[args.preset])  # the shipped trained weights (gcache.tools.train_mtp)
    if args.weights:
        cfg, weights = load(args.weights)
    else:
        overrides = json.loads(args.config_json) if args.config_json else {}
        base = ModelConfig.large if args.preset == "large" else ModelConfig.small
        cfg = base(**overrides)
    if args.dtype:
        cfg = cfg.with_dtype(args.dtype)
    if args.mtp_layers and weights is None and cfg.mtp_layers < args.mtp_layers:
        cfg = dataclasses.replace(cfg, mtp_layers=args.mtp_layers)  # seeded MTP blocks (random: low acceptance)
    if args.mtp_layers > cfg.mtp_layers:
        raise SystemExit(f"--mtp-layers {args.mtp_layers}: the weights have {cfg.mtp_layers} MTP layers")
    xp = backend.select_backend()
    model = Model(cfg, weights, xp)
    kv = DualKVCache.from_budget(cfg, int(args.kv_budget_mib * (1 << 20)), args.swa_full_ratio, xp)
    sched = SchedulerConfig(
        policy=args.policy,
        max_waiting=args.max_waiting,
        max_running=args.max_running,
        max_tokens_per_step=args.max_tokens_per_step,
        chunk_tokens=args.chunk_tokens,
    )
    name = args.model_name or f"gcache-hybrid-{cfg.layers}l-{cfg.hidden}h"
    hicache = HiCacheConfig(
        l2_bytes=int(args.l2_mib * (1 << 20)),
        l2_swa_full_ratio=args.l2_swa_full_ratio,
        l3_url=args.l3,
        model_name=name,
        write_policy=args.write_policy,
        write_threshold=args.write_threshold,
        prefetch_policy=args.prefetch_policy,
        prefetch_timeout_s=args.prefetch_timeout_s,
        swa_checkpoint_pages=args.swa_checkpoint_pages,
        layerwise_load=not args.no_layerwise_load,
        l3_timeout_s=args.l3_timeout_s,
    )
    econf = EngineConfig(
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens,
        prefix_cache=not args.no_prefix_cache,
        mtp_layers=args.mtp_layers,
        scheduler=sched,
        hicache=hicache,
    )
    return Engine(model, kv, econf), name


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gcache-worker", description="Hybrid-SWA inference worker (HTTP)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument(
        "--preset",
        choices=("small", "large", *SHIPPED_WEIGHTS),
        default="small",
        help="seeded small / large model, or shipped weights with 3 MTP blocks: tiny-mtp (trained on the stdlib "
        "source, W 64), tiny-mtp-recur (W 128, the source with recurring spans: MTP drafts that read their window)",
    )
    ap.add_argument("--config-json", default="", help="ModelConfig overrides, e.g. '{\"layers\": 4}'")
    ap.add_argument("--weights", default="", help=".npz or .safetensors (config read from the file)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="")
    ap.add_argument(
        "--mtp-layers",
        type=int,
        choices=range(0, 4),
        default=0,
        metavar="K",
        help="speculative decoding: K MTP drafts per step, verified in one forward (0 = off; "
        "the weights need >= K MTP blocks, or seeded ones are made)",
    )
    ap.add_argument("--model-name", default="")
    ap.add_argument("--kv-budget-mib", type=float, default=64.0)
    ap.add_argument("--swa-full-ratio", type=float, default=0.5, help="SWA pages per full page")
    ap.add_argument("--policy", choices=POLICIES, default="ttft")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--max-waiting", type=int, default=1024)
    ap.add_argument("--max-running", type=int, default=32)
    ap.add_argument("--max-tokens-per-step", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=8192)
    ap.add_argument("--max-new-tokens", type=int, default=2048)
    ap.add_argument("--max-in-flight", type=int, default=256, help="concurrent HTTP completions")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--body-timeout-s",
        type=float,
        default=BODY_DEADLINE_S,
        help="a request body not received within this is answered 408 (it holds no slot meanwhile)",
    )
    ap.add_argument(
        "--integrity-check-s",
        type=float,
        default=5.0,
        help="when idle, check every cache invariant this often (0 = never)",
    )
    h = ap.add_argument_group("cache hierarchy (L1 device / L2 host / L3 GCache)")
    h.add_argument(
        "--l2-mib",
        type=float,
        default=0.0,
        help="host-memory KV pool (L2), MiB; pages evicted from the device go here (0 = no L2)",
    )
    h.add_argument(
        "--l2-swa-full-ratio",
        type=float,
        default=0.25,
        help="SWA slots per full slot in L2 (L2 keeps SWA only at checkpoints)",
    )
    h.add_argument(
        "--l3",
        default="",
        metavar="URL",
        help="GCache as L3: host:port of one gcache-server or gcache://m1:p,... for a cluster "
        "(needs --l2-mib); pages are keyed by --model-name, so workers of one model share them",
    )
    h.add_argument(
        "--write-policy",
        choices=WRITE_POLICIES,
        default="write_through",
        help="write_through: cached pages go to L2/L3 at once; write_through_selective: once hit "
        "--write-threshold times; write_back: when evicted from the device",
    )
    h.add_argument("--write-threshold", type=int, default=2, help="hits before write_through_selective writes a page")
    h.add_argument(
        "--prefetch-policy",
        choices=PREFETCH_POLICIES,
        default=None,
        help="a queued request prefetches from L3 while it waits; best_effort: admit it whenever "
        "it is its turn; wait_complete: not before the prefetch is done; timeout: wait at "
        "most --prefetch-timeout-s (default: wait_complete with --role decode, else timeout)",
    )
    h.add_argument("--prefetch-timeout-s", type=float, default=0.5)
    h.add_argument(
        "--swa-checkpoint-pages",
        type=int,
        default=0,
        help="also keep SWA KV for the window before every N pages (0: only at request ends "
        "and branch points); more checkpoints = more resumable points, more SWA bytes",
    )
    h.add_argument(
        "--no-layerwise-load",
        action="store_true",
        help="load host KV for all layers before computing (default: layer by layer, overlapped)",
    )
    h.add_argument(
        "--l3-timeout-s",
        type=float,
        default=2.0,
        help="longest wait on GCache per call; after a failure L3 is skipped for a while",
    )
    add_publisher_args(ap)  # --redis ...: publish cache state and load for gcache-router
    add_role_args(ap)  # --role prefill|decode|mixed
    return ap.parse_args(argv)
