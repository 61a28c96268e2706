"""`gcache-router` in prefill/decode mode: its flags, and the two pools' RouterConfigs."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from gcache.router.config import RouterConfig, RouterPolicy
from gcache.serving.handoff import Role


@dataclass(frozen=True)
class PDConfig:
    prefill_workers: tuple[str, ...] = ()  # static pools (otherwise: Redis, by registered role)
    decode_workers: tuple[str, ...] = ()
    min_prompt_tokens: int = 0  # shorter prompts skip the prefill pool (served whole on a decode worker)
    prefill_timeout_s: float = 120.0  # one prefill attempt (first token + L3 writes); then retried once
    l3_down_s: float = 5.0  # after a prefill worker reports L3 down, serve mixed this long
    decode_policy: str = RouterPolicy.LEAST_LOAD  # decode pool: by load (prefill pool: --policy)

    def __post_init__(self) -> None:
        if bool(self.prefill_workers) != bool(self.decode_workers):
            raise ValueError("--prefill-workers and --decode-workers go together")
        if not 0 <= self.min_prompt_tokens <= 1 << 30:
            raise ValueError("--pd-min-prompt-tokens must be in [0, 2^30]")
        for name in ("prefill_timeout_s", "l3_down_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ValueError(f"{name} must be in (0, 3600]")

    def pools(self, base: RouterConfig) -> tuple[RouterConfig, RouterConfig]:
        """(prefill pool, decode pool) configs: static lists, or Redis filtered by role."""
        if self.prefill_workers:
            pre = dataclasses.replace(base, workers=self.prefill_workers)
            dec = dataclasses.replace(base, workers=self.decode_workers, policy=self.decode_policy)
        else:
            pre = dataclasses.replace(base, roles=(Role.PREFILL.value,))
            dec = dataclasses.replace(base, roles=(Role.DECODE.value,), policy=self.decode_policy)
        return pre, dec


def _urls(text: str) -> tuple[str, ...]:
    return tuple(u.strip() for u in (text or "").split(",") if u.strip())


def add_pd_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("prefill/decode disaggregation")
    g.add_argument(
        "--pd",
        action="store_true",
        help="pair prefill and decode workers (pools from Redis by their --role, or the two lists below)",
    )
    g.add_argument("--prefill-workers", default="", metavar="URL,...", help="static prefill pool (implies --pd)")
    g.add_argument("--decode-workers", default="", metavar="URL,...", help="static decode pool (implies --pd)")
    g.add_argument(
        "--pd-min-prompt-tokens",
        type=int,
        default=PDConfig.min_prompt_tokens,
        help="prompts shorter than this go straight to a decode worker (no handoff)",
    )
    g.add_argument("--pd-prefill-timeout-s", type=float, default=PDConfig.prefill_timeout_s)
    g.add_argument(
        "--pd-l3-down-s",
        type=float,
        default=PDConfig.l3_down_s,
        help="after a prefill worker reports its L3 down, serve requests whole on decode workers this long",
    )


def pd_config(args: argparse.Namespace) -> PDConfig | None:
    """None when the router is not in PD mode."""
    pre, dec = _urls(args.prefill_workers), _urls(args.decode_workers)
    if not (args.pd or pre or dec):
        return None
    if not (pre or dec) and not args.redis_url:
        raise ValueError("--pd needs --redis (pools by role) or --prefill-workers and --decode-workers")
    return PDConfig(
        prefill_workers=pre,
        decode_workers=dec,
        min_prompt_tokens=args.pd_min_prompt_tokens,
        prefill_timeout_s=args.pd_prefill_timeout_s,
        l3_down_s=args.pd_l3_down_s,
    )
