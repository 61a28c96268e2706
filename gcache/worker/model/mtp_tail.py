"""An MTP checkpoint tail: what a request needs to continue MTP drafting at prefix length P
exactly as if it had prefilled the prefix itself (the `mtp` pool's value, kvcache/tiers/mtp_tails).

Content-addressed by the prefix's tokens only, so it must not depend on any token >= P.
Depth d's KV at position i needs token x[i+d]: positions < P - K qualify at every depth.
So a tail holds, per depth, the KV of positions [P - K - W + 1, P - K) (what later
positions' windows read) and the main model's last hidden states at [P - K, P). On a hit,
decode() gives a state standing at P - K and those K hidden rows; one MTPHead.step over
[P - K, P) with the new request's tokens (which know x[P], ...) then lands exactly where a
from-scratch prefill of the prefix would stand.
"""

from __future__ import annotations

import numpy as np

MAGIC = 0x4D545031  # "MTP1"
HEADER = 9  # int64 fields


def span(p: int, depths: int, window: int) -> tuple[int, int]:
    """[lo, hi): the positions whose KV a tail at prefix length p holds."""
    hi = p - depths
    return max(0, hi - window + 1), hi


def encode(st, p: int, config) -> bytes | None:
    """The tail of st at prefix length p, or None if st cannot give it exactly."""
    k_d, w = st.depths, config.window
    lo, hi = span(p, k_d, w)
    if not st.exact or hi < 1 or lo < st.first:
        return None
    for d in range(k_d):  # committed there, and not yet overwritten in the ring (provisional
        #                   positions past V_d reuse the slots of the oldest K)
        if st.valid[d] < hi or lo < st.valid[d] - st.cap + k_d:
            return None
    if st.h0_valid < p or p - k_d < st.h0_valid - st.cap:
        return None
    idx = np.arange(lo, hi) % st.cap
    hidx = np.arange(hi, p) % st.cap
    head = np.array(
        [MAGIC, p, k_d, w, config.kv_heads, config.head_dim, config.hidden, lo, st.k.dtype.itemsize], dtype=np.int64
    )
    parts = [head.tobytes(), st.k[:, idx].tobytes(), st.v[:, idx].tobytes(), st.h0[hidx].tobytes()]
    return b"".join(parts)


def decode(body: bytes, head, p: int, owner: object):
    """(state at P - K, hidden rows for [P - K, P)) from a tail body, None if it does not
    fit this head's model and depths (another geometry under the same key: never trust it)."""
    c, k_d = head.config, head.depths
    dt = np.dtype(c.dtype)
    if len(body) < HEADER * 8:
        return None
    h = np.frombuffer(body[: HEADER * 8], dtype=np.int64)
    lo, hi = span(p, k_d, c.window)
    want = [MAGIC, p, k_d, c.window, c.kv_heads, c.head_dim, c.hidden, lo, dt.itemsize]
    if list(h) != want:
        return None
    n = hi - lo
    kv_n = k_d * n * c.kv_heads * c.head_dim
    if len(body) != HEADER * 8 + (2 * kv_n + k_d * c.hidden) * dt.itemsize:
        return None
    arr = np.frombuffer(body[HEADER * 8 :], dtype=dt)
    shape = (k_d, n, c.kv_heads, c.head_dim)
    k, v = arr[:kv_n].reshape(shape), arr[kv_n : 2 * kv_n].reshape(shape)
    h0 = arr[2 * kv_n :].reshape(k_d, c.hidden)
    if not (np.isfinite(k).all() and np.isfinite(v).all() and np.isfinite(h0).all()):
        return None
    st = head.new_state(lo, owner)
    for d in range(k_d):
        st.write(d, lo, k[d], v[d])
    st.valid = [hi] * k_d
    st.h0_valid = hi
    st.exact = True
    return st, h0.copy()
