"""Many threads against one Store: one value per key, leases stay exact."""
import os
import threading

from gcache._native import Store

MIB = 1 << 20


def run_threads(n, target):
    start = threading.Barrier(n)
    errors = []

    def body(i):
        try:
            start.wait()
            target(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def test_concurrent_puts_of_one_key_leave_exactly_one_value(tmp_path):
    with Store(16 * MIB, 64 * MIB, str(tmp_path / "data")) as s:
        for round_ in range(5):
            key = b"shared%d" % round_
            values = [bytes([i]) * (256 * 1024) for i in range(16)]
            results = [None] * 16

            def put(i):
                results[i] = s.put(key, values[i])

            run_threads(16, put)
            assert sorted(results).count(Store.STORED) == 1
            assert all(r in (Store.STORED, Store.EXISTS) for r in results)
            winner = values[results.index(Store.STORED)]
            assert s.get(key) == winner
            s.check_integrity()


def test_mixed_threads_under_eviction_never_return_wrong_bytes(tmp_path):
    with Store(4 * MIB, 32 * MIB, str(tmp_path / "data"), segment_bytes=2 * MIB) as s:
        def value(k):
            return bytes([k % 251]) * (64 * 1024 + k)

        def worker(t):
            for j in range(150):
                k = (t * 7919 + j * 31) % 200
                s.put(b"k%d" % k, value(k))
                lease = s.acquire(b"k%d" % ((k * 13) % 200))
                if lease is not None:
                    kk = (k * 13) % 200
                    assert bytes(lease.data) == value(kk)
                    lease.release()
                if j % 37 == 0:
                    s.remove(b"k%d" % ((k + 1) % 200))

        run_threads(4, worker)
        s.check_integrity()
        assert s.stats()["leases_active"] == 0
