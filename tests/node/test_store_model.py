"""Random operation sequences against a dict model, with check_integrity after every step.

A get returns the model's exact bytes or a miss (the store is a cache), never
anything else; a remove'd key never comes back, even across restarts."""

from pathlib import Path

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gcache._native import Store

KIB = 1 << 10
MIB = 1 << 20
KEYS = st.sampled_from([b"k%d" % i for i in range(12)])
SIZES = st.sampled_from([0, 1, 3 * KIB, 4 * KIB, 70 * KIB, 200 * KIB, 400 * KIB])


class StoreModel(RuleBasedStateMachine):
    @initialize(attempts=st.sampled_from([2, 4096]))
    def open(self, attempts):
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="gcache-model-"))
        self.model = {}  # key -> bytes (may be missing from the store: it is a cache)
        self.removed = set()
        self.leases = []
        self.attempts = attempts
        self.store = self._open()

    def _open(self):
        # Few FIFO attempts, so the fragmentation fallback (window eviction) runs often too.
        return Store(
            1 * MIB,
            2 * MIB,
            str(self.dir),
            segment_bytes=512 * KIB,
            value_bytes_max=512 * KIB,
            eviction_attempts_max=self.attempts,
        )

    @rule(key=KEYS, size=SIZES, seed=st.integers(0, 255))
    def put(self, key, size, seed):
        value = bytes([seed]) * size
        present = self.store.contains(key)
        status = self.store.put(key, value)
        if present:
            assert status == Store.EXISTS
        else:
            assert status in (Store.STORED, Store.NO_SPACE)
            self.model.pop(key, None)  # a cache may have dropped the old value
            if status == Store.STORED:
                self.model[key] = value
                self.removed.discard(key)

    @rule(key=KEYS)
    def get(self, key):
        got = self.store.get(key)
        if key in self.removed or key not in self.model:
            assert got is None
        else:
            assert got is None or got == self.model[key]
            if got is None:  # evicted: forget it so a new put is legal
                del self.model[key]

    @rule(key=KEYS)
    def acquire(self, key):
        lease = self.store.acquire(key)
        if lease is None:
            self.model.pop(key, None)
            return
        assert key in self.model and bytes(lease.data) == self.model[key]
        self.leases.append((lease, self.model[key]))

    @precondition(lambda self: self.leases)
    @rule()
    def release(self):
        lease, expected = self.leases.pop(0)
        assert bytes(lease.data) == expected  # held through all evictions since
        lease.release()

    @rule(key=KEYS)
    def remove(self, key):
        existed = self.store.remove(key)
        if existed:
            assert key in self.model
        self.model.pop(key, None)
        self.removed.add(key)

    @rule()
    def flush(self):
        self.store.flush()

    @precondition(lambda self: not self.leases)
    @rule(warm=st.booleans())
    def restart(self, warm):
        if warm:
            self.store.flush()
        self.store.close()
        self.store = self._open()

    @invariant()
    def integrity(self):
        if hasattr(self, "store"):
            self.store.check_integrity()
            for key in self.removed:
                assert not self.store.contains(key)

    def teardown(self):
        for lease, _ in self.leases:
            lease.release()
        self.leases.clear()
        if hasattr(self, "store"):
            self.store.close()
        for p in self.dir.iterdir():
            p.unlink()
        self.dir.rmdir()


StoreModel.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_store_matches_dict_model = pytest.mark.slow(StoreModel.TestCase)
