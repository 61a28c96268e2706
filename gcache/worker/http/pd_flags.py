"""`gcache-worker --role prefill|decode|mixed` and what a role changes in the other flags."""

from __future__ import annotations

import argparse

from gcache.serving.handoff import ROLES, Role
from gcache.worker.kvcache.tiered_config import PrefetchPolicy, WritePolicy

HANDOFF_WAIT_S = 5.0  # a prefill answers at most this long after its first token (L3 writes)


def add_role_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("prefill/decode disaggregation")
    g.add_argument(
        "--role",
        choices=ROLES,
        default=Role.MIXED.value,
        help="mixed: prefill and decode (default); prefill: also answers /pd/prefill with a handoff "
        "record (needs --l3); decode: also continues handoffs on /pd/decode (needs --l3)",
    )
    g.add_argument(
        "--pd-handoff-wait-s",
        type=float,
        default=HANDOFF_WAIT_S,
        help="prefill: longest wait for the prompt's KV to reach L3 before answering (pages not "
        "there by then are recomputed by the decode worker)",
    )


def check_role(args: argparse.Namespace) -> None:
    """ValueError for a role the other flags cannot serve; fills role-dependent defaults."""
    role = Role(args.role)
    if args.prefetch_policy is None:
        # A decode worker waits for its handoff's pages (bounded by the L3 timeouts) rather
        # than recomputing a long prompt the prefill worker has just written.
        args.prefetch_policy = PrefetchPolicy.WAIT_COMPLETE if role is Role.DECODE else PrefetchPolicy.TIMEOUT
    if role is Role.MIXED:
        return
    if not args.l3 or not args.l2_mib:
        raise ValueError(f"--role {role} hands KV over through L3: give --l3 URL and --l2-mib")
    if role is Role.PREFILL and args.write_policy != WritePolicy.WRITE_THROUGH:
        raise ValueError("--role prefill writes every prompt page to L3: --write-policy must be write_through")
    if args.no_prefix_cache:
        raise ValueError(f"--role {role} needs the prefix cache (the hierarchy moves the KV)")
    if not 0 < args.pd_handoff_wait_s <= 600:
        raise ValueError("--pd-handoff-wait-s must be in (0, 600]")
