"""`gcache-router`: an OpenAI-compatible front that sends each request to the worker with its prefix.

gcache-router --port 8000 --redis redis://127.0.0.1:6379/0            # workers from Redis
gcache-router --port 8000 --workers http://127.0.0.1:30001,http://127.0.0.1:30002 --policy round_robin
gcache-router --port 8000 --prefill-workers http://127.0.0.1:30011 --decode-workers http://127.0.0.1:30012  # PD
gcache-router --port 8000 --pd --redis redis://127.0.0.1:6379/0    # PD pools from Redis, by the workers' --role
gcache-router --port 8000 --redis redis://127.0.0.1:6379/0 --tokenizer /models/m --block-size 16 \
    --vllm http://127.0.0.1:8001@ipc:///tmp/vllm-a.kv --vllm http://127.0.0.1:8002@ipc:///tmp/vllm-b.kv   # vLLM servers
gcache-router kv-events --engine http://127.0.0.1:8001 --events ipc:///tmp/vllm-a.kv --redis redis://...  # or beside each
gcache-router --port 8000 --redis redis://... --l3-events ipc:///tmp/gcache-l3-a.kv   # GCache connectors' L3 events

The KV-event endpoints are ipc:// paths: they stay on the host (a tcp://*:PORT endpoint would
accept every interface); a router on another host subscribes to tcp://HOST:PORT instead.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gcache.router.config import RouterConfig, add_router_args
from gcache.router.core import RouterCore
from gcache.router.pd_config import add_pd_args, pd_config
from gcache.router.pd_policy import DecodeLoad
from gcache.router.pd_server import make_pd_app
from gcache.router.server import load_tokenizers, make_app
from gcache.serving import runner
from gcache.serving.body import BODY_DEADLINE_S


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gcache-router", description="Cache-affinity router for gcache-workers (HTTP)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-in-flight", type=int, default=1024, help="requests proxied at once (503 beyond)")
    ap.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="longest wait for a worker's whole answer (504 beyond, no retry)",
    )
    ap.add_argument(
        "--connect-timeout-s",
        type=float,
        default=2.0,
        help="longest wait to connect to a worker (then the request is retried on another)",
    )
    ap.add_argument(
        "--body-timeout-s",
        type=float,
        default=BODY_DEADLINE_S,
        help="a request body not received within this is answered 408",
    )
    add_router_args(ap)
    ap.add_argument(
        "--vllm",
        action="append",
        default=[],
        metavar="URL@ENDPOINT",
        help="a vLLM OpenAI server and its --kv-events-config ZMQ endpoint (repeatable, or comma-separated): "
        "this router translates its KV events into --redis (one router per engine at a time, by a lease; "
        "`gcache-router kv-events` does the same beside the engine)",
    )
    ap.add_argument(
        "--vllm-l3",
        action="append",
        default=[],
        metavar="URL@ENDPOINT",
        help="as --vllm, for a server that runs the GCache connector: it is registered as loading the "
        "shared L3, so cache_aware credits L3 hits to it (--l3-events says what the L3 holds)",
    )
    ap.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the vLLM servers' --block-size: the page size their registrations carry before their first "
        "KV event says it, and the only block size --l3-events counts (default: --page-size for --vllm, the "
        "first event's for --l3-events)",
    )
    ap.add_argument(
        "--l3-events",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="a GCache vLLM connector's L3 event endpoint (gcache_kv_events_endpoint; repeatable, or "
        "comma-separated; give every connector's: the L3 is one namespace): what it stores in and drops from "
        "GCache's L3 goes into --redis's shared L3 view (docs/kv-events.md); pages of --block-size count "
        "(default: the first event's)",
    )
    add_pd_args(ap)  # --pd, --prefill-workers, --decode-workers, ...
    return ap.parse_args(argv)


def vllm_engines(specs: list[str]) -> list[tuple[str, str]]:
    """--vllm URL@ENDPOINT,... -> [(url, endpoint)]."""
    out: list[tuple[str, str]] = []
    for spec in (x.strip() for item in specs for x in item.split(",")):
        if not spec:
            continue
        url, sep, endpoint = spec.rpartition("@")
        if not sep or not url or not endpoint:
            raise ValueError(f"--vllm wants URL@ENDPOINT (http://HOST:PORT@ipc:///PATH), got {spec!r}")
        out.append((url.rstrip("/"), endpoint))
    return out


def start_translators(args, config: RouterConfig) -> list:
    """The in-router translators of --vllm (ValueError for bad flags)."""
    engines = [(u, e, False) for u, e in vllm_engines(args.vllm)]
    engines += [(u, e, True) for u, e in vllm_engines(args.vllm_l3)]
    if not engines:
        return []
    if not config.redis_url:
        raise ValueError("--vllm needs --redis (the translators publish there; every router reads it)")
    try:
        import zmq  # noqa: F401  (pyzmq: a dependency of gcache and of vLLM)
    except ImportError:
        raise ValueError("--vllm needs pyzmq (pip install pyzmq)") from None
    from gcache.router.ingest.translator import Translator, TranslatorConfig

    cfgs = [
        TranslatorConfig(
            engine_url=url,
            events=(endpoint,),
            redis_url=config.redis_url,
            prefix=config.redis_prefix,
            redis_timeout_s=config.redis_timeout_s,
            lease=True,
            l3=l3,
            block_size=block_size(args) or config.page_size,  # published until the engine's first event says
        )
        for url, endpoint, l3 in engines
    ]
    return [Translator(c) for c in cfgs]


def endpoints(specs: list[str]) -> tuple[str, ...]:
    """--l3-events A --l3-events B,C -> (A, B, C)."""
    return tuple(x.strip() for item in specs for x in item.split(",") if x.strip())


def start_l3_events(args, config: RouterConfig) -> list:
    """The --l3-events subscriber (ValueError for bad flags)."""
    eps = endpoints(args.l3_events)
    if not eps:
        return []
    if not config.redis_url:
        raise ValueError("--l3-events needs --redis (the shared L3 view is written there)")
    try:
        import zmq  # noqa: F401  (pyzmq: a dependency of gcache and of vLLM)
    except ImportError:
        raise ValueError("--l3-events needs pyzmq (pip install pyzmq)") from None
    from gcache.router.ingest.l3_events import L3EventsConfig, L3Subscriber

    cfg = L3EventsConfig(
        endpoints=eps,
        redis_url=config.redis_url,
        prefix=config.redis_prefix,
        redis_timeout_s=config.redis_timeout_s,
        l3_pages_max=config.l3_pages_max,
        page_size=block_size(args),
    )
    return [L3Subscriber(cfg)]


def block_size(args) -> int | None:
    """--block-size, checked (None when not given)."""
    if args.block_size is not None and not 1 <= args.block_size <= 1 << 14:
        raise ValueError(f"--block-size must be in [1, 16384], got {args.block_size}")
    return args.block_size


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["kv-events"]:  # the translator beside a vLLM server (ingest/translator.py)
        from gcache.router.ingest.translator import main as kv_events_main

        return kv_events_main(argv[1:])
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if (
            args.max_in_flight < 1
            or args.request_timeout_s <= 0
            or args.connect_timeout_s <= 0
            or args.body_timeout_s <= 0
        ):
            raise ValueError("--max-in-flight must be >= 1 and every timeout > 0")
        pd = pd_config(args)
        if pd is not None and pd.prefill_workers:
            args.workers = ",".join(pd.prefill_workers + pd.decode_workers)  # the base config's check
        config = RouterConfig.from_args(args)
        cores = [RouterCore(c) for c in pd.pools(config)] if pd is not None else [RouterCore(config)]
        if pd is not None:
            cores[1].policy = DecodeLoad(cores[1].config)  # decode pool: load and free KV
        tokenizers = load_tokenizers(config)
        subscribers = start_translators(args, config) + start_l3_events(args, config)
        cores[0].bridges = subscribers  # their counters on /metrics
    except ValueError as e:
        print(f"gcache-router: {e}", file=sys.stderr)
        return 2
    for core in cores:
        core.start()
    kw = dict(
        request_timeout_s=args.request_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        max_in_flight=args.max_in_flight,
        body_timeout_s=args.body_timeout_s,
    )
    app = make_app(cores[0], tokenizers=tokenizers, **kw) if pd is None else make_pd_app(cores[1], cores[0], pd, **kw)

    def started(port: int) -> None:
        where = config.redis_url or ",".join(config.workers)
        if pd is not None:
            where += f"; prefill/decode pools{' by role' if not pd.prefill_workers else ''}"
        print(
            f"gcache-router: serving on http://{args.host}:{port} (policy {config.policy}; workers from {where})",
            flush=True,
        )

    try:
        runner.serve_forever(app, args.host, args.port, on_started=started)
    except OSError as e:
        print(f"gcache-router: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    finally:
        for sub in subscribers:  # --vllm translators, the --l3-events subscriber
            sub.stop()
        for core in cores:
            core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
