"""Which transport a Client uses: `transport=` "tcp", "shm", "rdma" or "auto".

"auto" (the default; $GCACHE_TRANSPORT may name another) decides once, when
the client is created:
- shm when the server's PING names a Unix socket this process can reach and
  that socket leads to the same server instance (so a proxy or a port forward
  to another host never ends up on a local server by the same path);
- else rdma when pyverbs and an RDMA device are usable and the server has
  registered its arena (`--rdma-device`);
- else tcp, which always works. A server unreachable at that moment means tcp.
Asking for "shm" or "rdma" explicitly raises TransportUnavailableError with
the reason when it cannot work.
"""

from __future__ import annotations

import logging
import os

from gcache import errors
from gcache.client.connection import Connection
from gcache.client.transports.base import TcpTransport, Transport

TRANSPORTS = ("auto", "tcp", "shm", "rdma")
TRANSPORT_ENV = "GCACHE_TRANSPORT"
log = logging.getLogger("gcache.client")


def transport_kind(kind: str | None) -> str:
    """The transport asked for: `kind`, or $GCACHE_TRANSPORT where `kind` is "auto"/None."""
    if kind is None or kind == "auto":
        kind = os.environ.get(TRANSPORT_ENV, "").strip().lower() or "auto"
        where = f"${TRANSPORT_ENV}"
    else:
        where = "transport"
    if kind not in TRANSPORTS:
        raise errors.InvalidArgumentError(f"{where} must be one of {', '.join(TRANSPORTS)}, got {kind!r}")
    return kind


def _shm(address, timeout_s, connect_timeout_s, token, copy_threads) -> tuple[Transport, Connection]:
    """A ShmTransport with its first connection; TransportUnavailableError with the reason."""
    from gcache.client.transports.shm import ShmTransport, discover

    if token:
        raise errors.TransportUnavailableError(
            "shared memory is off with authentication: the arena holds every tenant's values"
        )
    try:
        path, instance = discover(address, timeout_s, connect_timeout_s)
    except errors.GCacheError as exc:
        raise errors.TransportUnavailableError(f"cannot ask {address} for its Unix socket: {exc}") from exc
    if path is None:
        raise errors.TransportUnavailableError(
            f"gcache-server at {address} offers no Unix socket (--unix-socket, or it has --auth-file)"
        )
    if not os.path.exists(path):
        raise errors.TransportUnavailableError(
            f"gcache-server at {address} listens on {path}, which this process cannot see: "
            "it runs on another host or in another filesystem namespace"
        )
    transport = ShmTransport(
        address, path, timeout_s, connect_timeout_s, expected_instance=instance, copy_threads=copy_threads
    )
    try:
        return transport, transport.connect()
    except errors.TransportUnavailableError:
        transport.close()
        raise
    except errors.GCacheError as exc:
        transport.close()
        raise errors.TransportUnavailableError(f"cannot attach to {path}: {exc}") from exc


def _rdma(address, timeout_s, connect_timeout_s, token) -> tuple[Transport, Connection]:
    try:
        from gcache.client.transports.rdma import RdmaTransport
    except ImportError as exc:
        raise errors.TransportUnavailableError(f"the RDMA transport cannot load: {exc}") from exc

    transport = RdmaTransport(address, timeout_s, connect_timeout_s, token)  # raises if unusable
    try:
        return transport, transport.connect()
    except errors.TransportUnavailableError:
        transport.close()
        raise
    except errors.GCacheError as exc:  # as for shm: under auto, an unreachable server means tcp
        transport.close()
        raise errors.TransportUnavailableError(f"cannot set up RDMA with {address}: {exc}") from exc
    except BaseException:
        transport.close()
        raise


def open_transport(
    kind: str | None, address: str, timeout_s: float, connect_timeout_s: float, token: str | None, copy_threads: int = 0
) -> tuple[Transport, Connection | None]:
    """The transport for `kind`, and the connection opened while choosing it (or None)."""
    kind = transport_kind(kind)
    if kind == "tcp":
        return TcpTransport(address, timeout_s, connect_timeout_s, token), None
    if kind == "shm":
        return _shm(address, timeout_s, connect_timeout_s, token, copy_threads)
    if kind == "rdma":
        return _rdma(address, timeout_s, connect_timeout_s, token)
    why_not = []
    for name, pick in (
        ("shm", lambda: _shm(address, timeout_s, connect_timeout_s, token, copy_threads)),
        ("rdma", lambda: _rdma(address, timeout_s, connect_timeout_s, token)),
    ):
        try:
            return pick()
        except errors.TransportUnavailableError as exc:
            log.debug("transport %s not used for %s: %s", name, address, exc)
            why_not.append(f"{name}: {exc}")
    _log_tcp_choice_once(address, "; ".join(why_not))
    return TcpTransport(address, timeout_s, connect_timeout_s, token), None


_TCP_LOGGED_MAX = 1024  # addresses remembered, so the log line comes once per node
_tcp_logged: set[str] = set()


def _log_tcp_choice_once(address: str, why_not: str) -> None:
    """Says once per process and node why "auto" fell back to TCP (a fifth of shm's speed on
    the same host), not for every client."""
    if address in _tcp_logged or len(_tcp_logged) >= _TCP_LOGGED_MAX:
        return
    _tcp_logged.add(address)
    log.info("transport 'auto' chose TCP for %s (%s)", address, why_not)
