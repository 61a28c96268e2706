"""Many connections at once against one gcache-server: one value per key, exact bytes."""

from __future__ import annotations

import os
import threading

from tests.support.raw_protocol import EXISTS, STORED, RawConnection

CLIENTS = 8


def run_clients(target) -> list:
    results: list = [None] * CLIENTS
    errors: list = []
    barrier = threading.Barrier(CLIENTS)

    def worker(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = target(i)
        except BaseException as e:  # noqa: BLE001 -- surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def test_concurrent_puts_of_one_key_leave_exactly_one_value(server):
    candidates = [os.urandom(64 << 10) for _ in range(CLIENTS)]

    def put(i: int) -> int:
        with RawConnection(server.port) as c:
            return c.put([(b"contended", candidates[i])])[0]

    statuses = run_clients(put)
    assert sorted(statuses) == [STORED] + [EXISTS] * (CLIENTS - 1)
    with RawConnection(server.port) as c:
        assert c.get([b"contended"]) == [candidates[statuses.index(STORED)]]


def test_parallel_clients_read_their_own_writes(server):
    def work(i: int) -> int:
        items = [(f"c{i}-{n}".encode(), os.urandom(1000 * (n + 1))) for n in range(20)]
        with RawConnection(server.port) as c:
            for round_ in range(5):
                chunk = items[round_ * 4 : (round_ + 1) * 4]
                assert c.put(chunk) == [STORED] * 4
                assert c.get([k for k, _ in chunk]) == [v for _, v in chunk]
            assert c.get([k for k, _ in items]) == [v for _, v in items]
            assert c.remove([k for k, _ in items[:10]]) == [0] * 10
        return len(items)

    assert run_clients(work) == [20] * CLIENTS
    with RawConnection(server.port) as c:
        ex, prefix = c.exists([f"c0-{n}".encode() for n in range(20)])
        assert ex == [False] * 10 + [True] * 10 and prefix == 0
