"""The router's ZMQ subscriber loop (a vLLM engine's KV events, GCache's L3 events): one home.

SUB sockets on every endpoint, polled until `stop` is set; each message handed to
receive(frames, source) with the index of its endpoint. Bounded: RCVHWM messages wait per
socket (then the publisher drops, and the receiver sees a sequence gap), MAXMSGSIZE bytes per
message (a larger one closes that connection; ZMQ reconnects).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

DRAIN_MAX = 1000  # messages taken from one socket before the stop flag is looked at again


def subscribe_loop(
    endpoints: Sequence[str],
    receive: Callable[[list, int], None],
    stop: threading.Event,
    *,
    topic: str = "",
    bind: bool = False,
    rcvhwm: int = 10_000,
    max_bytes: int = 64 << 20,
) -> None:
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socks = []
    try:
        for ep in endpoints:
            s = ctx.socket(zmq.SUB)
            socks.append(s)
            s.setsockopt(zmq.RCVHWM, rcvhwm)
            s.setsockopt(zmq.MAXMSGSIZE, max_bytes + 4096)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SUBSCRIBE, topic.encode())
            if bind:
                s.bind(ep)
            else:
                s.connect(ep)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        while not stop.is_set():
            for s, _ in poller.poll(200):
                for _ in range(DRAIN_MAX):  # drain, but let the stop flag in
                    try:
                        frames = s.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    receive(frames, socks.index(s))
    finally:
        for s in socks:
            s.close(0)
