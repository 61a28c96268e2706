"""One deadline per client call (issue 21, finding 9): the Deadline object's logic,
checked on a fake clock, and a call against a peer that never answers ending by its
call_timeout_s instead of after its per-wait timeout_s."""

from __future__ import annotations

import inspect
import socket
import time

import pytest

from gcache import errors
from gcache.client import deadline as call_deadline
from gcache.client.client import ServerClient
from gcache.client.cluster_client import ClusterClient
from gcache.client.deadline import Deadline

# Every test runs on the native client core and on the Python reference path.
pytestmark = pytest.mark.usefixtures("client_core")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_deadline_counts_down_caps_waits_and_raises_a_gcache_timeout():
    clock = FakeClock()
    d = Deadline(2.0, clock)
    assert d.left() == 2.0 and not d.expired
    assert d.cap(5.0) == 2.0 and d.cap(0.5) == 0.5
    clock.now += 1.5
    assert d.cap(5.0) == 0.5 and d.cap(0.25) == 0.25
    d.check("h:1", "waiting")  # time left: nothing raised
    clock.now += 0.5
    assert d.expired and d.cap(5.0) == 0.0
    with pytest.raises(errors.TimeoutError, match=r"ran out of its 2s \(call_timeout_s\) while waiting"):
        d.check("h:1", "waiting")


def test_using_sets_the_threads_deadline_and_restores_the_outer_one():
    outer, inner = Deadline(1.0), Deadline(2.0)
    assert call_deadline.current() is None
    with call_deadline.using(outer):
        with call_deadline.using(inner):
            assert call_deadline.current() is inner
        assert call_deadline.current() is outer
    assert call_deadline.current() is None


def test_both_clients_have_the_same_default_timeout_and_call_bound():
    server = inspect.signature(ServerClient.__init__).parameters
    cluster = inspect.signature(ClusterClient.__init__).parameters
    assert server["timeout_s"].default == cluster["timeout_s"].default == call_deadline.TIMEOUT_S_DEFAULT
    assert call_deadline.call_timeout_for(2.0, 1, None) == 4.0
    assert call_deadline.call_timeout_for(2.0, 1, 0.5) == 0.5
    with pytest.raises(errors.InvalidArgumentError, match="call_timeout_s"):
        call_deadline.call_timeout_for(2.0, 1, 0)
    client = ServerClient("127.0.0.1:1", transport="tcp", timeout_s=0.5, retries=3)
    assert client.call_timeout_s == 2.0
    client.close()


@pytest.mark.process
def test_a_call_to_a_peer_that_never_answers_ends_by_its_call_timeout():
    """The peer's kernel accepts the connection (listen backlog) and nothing ever answers:
    each socket wait alone may last timeout_s (5 s); the call ends by call_timeout_s."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    address = "{}:{}".format(*hung.getsockname())
    bound_s = 0.6
    try:
        client = ServerClient(address, transport="tcp", timeout_s=5.0, retries=2, call_timeout_s=bound_s)
        started = time.monotonic()
        with pytest.raises(errors.TimeoutError):
            client.get_batch([b"k1", b"k2"])
        elapsed = time.monotonic() - started
        client.close()
    finally:
        hung.close()
    assert elapsed < 3 * bound_s, f"{elapsed:.2f}s for a call bounded by {bound_s}s"
