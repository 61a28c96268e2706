"""Connection slots in tests: a node's /metrics values, and a connection that holds a slot the
node never closes to make room (a frame under way), for tests of BUSY."""

from __future__ import annotations

import socket
import urllib.request

from tests.support import waiting
from tests.support.raw_protocol import PUT_BATCH, frame_bytes


def metric(node, name: str) -> int:
    """One unlabelled value of the node's admin /metrics, e.g. gcache_requests_total."""
    with urllib.request.urlopen(f"http://127.0.0.1:{node.admin_port}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return int(float(line.split()[1]))
    raise AssertionError(f"{name} not in the node's /metrics")


def busy_connection(node) -> socket.socket:
    """A connection that sent a PUT's header and one byte of its metadata: a frame under way,
    so its slot is never closed to make room. Returns once the node has read the header (no
    other traffic may run meanwhile: it waits for requests_total to grow)."""
    before = metric(node, "gcache_requests_total")
    head = frame_bytes(PUT_BATCH, {"keys": [b"k"], "lens": [1], "sums": [0]}, b"x")
    s = socket.create_connection(("127.0.0.1", node.port), timeout=30)
    s.sendall(head[:33])
    waiting.wait_until(lambda: metric(node, "gcache_requests_total") > before, "the node to read the header", 30, 0.05)
    return s
