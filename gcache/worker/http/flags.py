"""`gcache-worker` flags and the engine they build."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from gcache.common.flags import add_flags, config_from_flags, flag
from gcache.serving.body import BODY_DEADLINE_S
from gcache.worker.config import ModelConfig
from gcache.worker.engine.engine import Engine, EngineConfig
from gcache.worker.engine.scheduler import SchedulerConfig
from gcache.worker.http.pd_flags import add_role_args, check_role
from gcache.worker.http.publisher import add_publisher_args
from gcache.worker.kvcache.kv_pool import DualKVCache
from gcache.worker.kvcache.tiered_config import TieredCacheConfig

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
    sched = config_from_flags(SchedulerConfig, args, SCHEDULER_NOT_FLAGS)
    name = args.model_name or f"gcache-hybrid-{cfg.layers}l-{cfg.hidden}h"
    cache_config = config_from_flags(TieredCacheConfig, args, CACHE_NOT_FLAGS, model_name=name)
    econf = config_from_flags(EngineConfig, args, ENGINE_NOT_FLAGS, scheduler=sched, cache_config=cache_config)
    return Engine(model, kv, econf), name


# Fields of the engine's configs that are no gcache-worker flag (tuning, benches, tests;
# model_name comes from --model-name, scheduler and cache_config are the configs above).
SCHEDULER_NOT_FLAGS = ("aging_tokens_per_s", "max_wait_s", "dedup_min_tokens", "estimates_per_step", "scan_max")
CACHE_NOT_FLAGS = (
    "model_name",
    "prefetches_per_step",
    "swa_checkpoint_ends",
    "mtp_tail_bytes",
    "swa_keep_spare",
    "chunk_loads",
    "load_throttle_bytes_per_s",
    "l3_write_queue_max",
    "l3_protect_prefix",
    "hit_counts_max",
)
ENGINE_NOT_FLAGS = ("preemptions_per_step_max", "tree_nodes_max", "mtp_prefix", "scheduler", "cache_config")


@dataclass(frozen=True)
class WorkerFlags:
    """gcache-worker's own flags, beside those of the engine's configs (EngineConfig,
    SchedulerConfig, TieredCacheConfig): the model, the KV pools and the HTTP side."""

    host: str = field(default="127.0.0.1", metadata=flag())
    port: int = field(default=30000, metadata=flag())
    preset: str = field(
        default="small",
        metadata=flag(
            "seeded small / large model, or shipped weights with 3 MTP blocks: tiny-mtp (trained on the stdlib "
            "source, W 64), tiny-mtp-recur (W 128, the source with recurring spans: MTP drafts that read their window)",
            choices=("small", "large", *SHIPPED_WEIGHTS),
        ),
    )
    config_json: str = field(default="", metadata=flag("ModelConfig overrides, e.g. '{\"layers\": 4}'"))
    weights: str = field(default="", metadata=flag(".npz or .safetensors (config read from the file)"))
    dtype: str = field(default="", metadata=flag(choices=("float32", "float64")))
    model_name: str = field(default="", metadata=flag())
    kv_budget_mib: float = field(default=64.0, metadata=flag())
    swa_full_ratio: float = field(default=0.5, metadata=flag("SWA pages per full page"))
    max_in_flight: int = field(default=256, metadata=flag("concurrent HTTP completions"))
    request_timeout_s: float = field(default=600.0, metadata=flag())
    body_timeout_s: float = field(
        default=BODY_DEADLINE_S,
        metadata=flag("a request body not received within this is answered 408 (it holds no slot meanwhile)"),
    )
    integrity_check_s: float = field(
        default=5.0, metadata=flag("when idle, check every cache invariant this often (0 = never)")
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gcache-worker", description="Hybrid-SWA inference worker (HTTP)")
    add_flags(ap, WorkerFlags)
    add_flags(ap, EngineConfig, not_flags=ENGINE_NOT_FLAGS)
    add_flags(ap, SchedulerConfig, not_flags=SCHEDULER_NOT_FLAGS)
    add_flags(ap, TieredCacheConfig, not_flags=CACHE_NOT_FLAGS)
    add_publisher_args(ap)  # --redis ...: publish cache state and load for gcache-router
    add_role_args(ap)  # --role prefill|decode|mixed
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)
