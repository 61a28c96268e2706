"""Many threads against one Store: one value per key, leases stay exact."""

import threading

import pytest

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


@pytest.mark.parametrize("attempts", [4096, 2])  # 2: the window-eviction fallback runs too
def test_mixed_threads_under_eviction_never_return_wrong_bytes(tmp_path, attempts):
    with Store(4 * MIB, 32 * MIB, str(tmp_path / "data"), segment_bytes=2 * MIB, eviction_attempts_max=attempts) as s:

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


def test_removes_racing_demotions_stay_removed_across_restart(tmp_path):
    # Tiny memory: nearly every put demotes a value (written outside the store
    # lock) while other threads read, remove and re-put the same keys.
    data = str(tmp_path / "data")
    threads_n, rounds = 4, 6

    def value(k):
        return bytes([k % 251]) * (48 * 1024 + k)

    def owned(t):
        return [k for k in range(120) if k % threads_n == t]

    stop = threading.Event()
    with Store(1 * MIB, 16 * MIB, data, segment_bytes=1 * MIB, eviction_attempts_max=8) as s:

        def checker():
            while not stop.is_set():
                s.check_integrity()

        check_thread = threading.Thread(target=checker)
        check_thread.start()

        def worker(t):
            for r in range(rounds):
                for k in owned(t):
                    s.put(b"k%d" % k, value(k))
                    other = (k * 7 + r) % 120
                    got = s.get(b"k%d" % other)
                    assert got is None or got == value(other)
                    if r == rounds - 1 and k % 2 == 0 or r < rounds - 1 and (k + r) % 3 == 0:
                        s.remove(b"k%d" % k)

        try:
            run_threads(threads_n, worker)
        finally:
            stop.set()
            check_thread.join()
        s.check_integrity()
        for k in range(120):
            got = s.get(b"k%d" % k)
            assert got is None if k % 2 == 0 else got in (None, value(k))
    with Store(1 * MIB, 16 * MIB, data, segment_bytes=1 * MIB) as s:
        s.check_integrity()
        for k in range(120):
            got = s.get(b"k%d" % k)
            assert got is None if k % 2 == 0 else got in (None, value(k)), k
