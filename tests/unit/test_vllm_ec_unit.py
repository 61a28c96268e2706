"""GCacheECConnector's parts that need no vLLM (nor torch): the value header, the keys, the
settings, and the scheduler side's batched reads, deferral, bounds and roles against an
in-memory store behind the real GuardedStore."""

from __future__ import annotations

import logging
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from gcache import errors
from gcache.integrations.common.extra_config import SettingsError
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.vllm.ec import scheduler_side
from gcache.integrations.vllm.ec.keys import ItemKeys, item_part
from gcache.integrations.vllm.ec.scheduler_side import ECSchedulerSide
from gcache.integrations.vllm.ec.settings import ECSettings
from gcache.integrations.vllm.ec.stats import ECStats
from gcache.integrations.vllm.ec.value import (
    HEADER_BYTES,
    check_value,
    decode_header,
    encode_header,
    value_bytes,
)

H1, H2, H3 = ("a" * 64, "b" * 64, "c" * 64)  # vLLM's blake3 identifiers are 64 hex digits
WIDTH, ROWS = 8, 4


# -- the value ----------------------------------------------------------------------------------


def value(rows=ROWS, width=WIDTH, dtype="float32", fill=1.0) -> bytes:
    payload = np.full((rows, width), fill, dtype=np.float32 if dtype == "float32" else np.float16)
    return encode_header(dtype, (rows, width)) + payload.tobytes()


def test_header_round_trip_and_sizes():
    raw = encode_header("bfloat16", (576, 4096))
    assert len(raw) == HEADER_BYTES
    header = decode_header(raw)
    assert (header.dtype, header.shape, header.payload_bytes) == ("bfloat16", (576, 4096), 576 * 4096 * 2)
    assert value_bytes("float32", (4, 8)) == 64 + 128
    with pytest.raises(ValueError):
        encode_header("complex64", (1, 2))
    with pytest.raises(ValueError):
        encode_header("float32", (1, 2, 3, 4, 5))


def test_a_value_is_accepted_only_when_header_length_and_expectation_agree():
    good = bytearray(value())
    assert check_value(good, len(good), "float32", WIDTH, ROWS).shape == (ROWS, WIDTH)
    assert check_value(good, len(good), "float32", WIDTH, None) is not None  # rows unknown: any
    assert check_value(good, None, "float32", WIDTH, ROWS) is None  # a miss
    assert check_value(good, len(good) - 1, "float32", WIDTH, ROWS) is None  # short
    assert check_value(good, len(good), "float16", WIDTH, ROWS) is None  # another dtype
    assert check_value(good, len(good), "float32", WIDTH + 1, ROWS) is None  # another width
    assert check_value(good, len(good), "float32", WIDTH, ROWS + 1) is None  # another item size
    bad = bytearray(good)
    bad[0] ^= 0xFF
    assert check_value(bad, len(bad), "float32", WIDTH, ROWS) is None  # not our header
    lying = bytearray(good)
    lying[8] ^= 0x01  # payload bytes no longer match the shape
    assert check_value(lying, len(lying), "float32", WIDTH, ROWS) is None
    flat = encode_header("float32", (ROWS * WIDTH,)) + bytes(ROWS * WIDTH * 4)
    assert check_value(flat, len(flat), "float32", WIDTH, ROWS) is None  # 1-D: no width


# -- the keys -----------------------------------------------------------------------------------


def test_item_part_keeps_hex_hashes_and_hashes_anything_else():
    assert item_part(H1) == H1
    assert item_part("f" * 128) == "f" * 128  # sha512
    lora = item_part(f"my-adapter:{H1}")
    assert lora.startswith("u") and len(lora) == 65 and lora != item_part(f"other:{H1}")
    assert item_part("user-uuid-1") != item_part("user-uuid-2")
    assert item_part("A" * 64).startswith("u")  # upper case is not vLLM's: hashed


def test_item_keys_name_namespace_item_modality_dtype_width_encoder_and_model():
    keys = ItemKeys("org/tiny llava", "tenant", "bfloat16", {"image": 4096}, 2048, "0123456789abcdef")
    assert keys.key(H1, "image") == f"tenant/{H1}.ec-image-bfloat16w4096-e01234567_org-tiny-llava".encode()
    assert keys.key(H1, "audio").endswith(b"-bfloat16w2048-e01234567_org-tiny-llava")  # not measured
    spec = keys.spec(H1, "image", 576)
    assert (spec.dtype, spec.rows, spec.width) == ("bfloat16", 576, 4096)
    other = ItemKeys("another", "tenant", "bfloat16", {"image": 4096}, 2048, "0123456789abcdef")
    assert other.key(H1, "image") != keys.key(H1, "image")
    assert ItemKeys("m", None, "float32", {}, 8).key(H1, "image") == f"{H1}.ec-image-float32w8-e0_m".encode()
    with pytest.raises(ValueError, match="exceeds"):
        ItemKeys("m", "n" * 500, "float32", {}, 8).key(H1, "image")


def test_settings_defaults_and_errors():
    s = ECSettings.from_extra_config({"gcache_url": "127.0.0.1:7600"}, environ={})
    assert (s.suspect_s, s.prefetch_mib, s.wait_ms, s.defer_s, s.model) == (5.0, 256, 5.0, 5.0, None)
    s = ECSettings.from_extra_config(
        {"gcache_model": "llava", "gcache_prefetch_mib": 8, "gcache_wait_ms": 0, "gcache_defer_s": 1},
        environ={"GCACHE_URL": "127.0.0.1:7600"},
    )
    assert (s.model, s.prefetch_bytes, s.wait_ms, s.defer_s) == ("llava", 8 << 20, 0, 1)
    with pytest.raises(SettingsError, match="unknown ec_connector_extra_config"):
        ECSettings.from_extra_config({"gcache_url": "127.0.0.1:7600", "gcache_prefech_mib": 8}, environ={})
    with pytest.raises(SettingsError, match="gcache_defer_s"):
        ECSettings.from_extra_config({"gcache_url": "127.0.0.1:7600", "gcache_defer_s": -1}, environ={})
    with pytest.raises(SettingsError, match="no GCache address"):
        ECSettings.from_extra_config({}, environ={})


# -- the scheduler side -------------------------------------------------------------------------


class FakeClient:
    """batch_get_into / batch_is_exist over a dict; `gate` (an Event) holds every call until set;
    `down` makes every call a connection failure."""

    def __init__(self, data: dict):
        self.data = data
        self.gate = threading.Event()
        self.gate.set()
        self.down = False
        self.calls = []

    def _enter(self, what, keys):
        self.calls.append((what, list(keys)))
        assert self.gate.wait(10)
        if self.down:
            raise errors.ConnectionError("store down")

    def batch_get_into(self, keys, buffers, sizes):
        self._enter("get", keys)
        out = []
        for key, buf, size in zip(keys, buffers, sizes):
            v = self.data.get(key)
            if v is None or len(v) > size:
                out.append(None)
                continue
            np.frombuffer(buf, dtype=np.uint8, count=len(v))[:] = np.frombuffer(v, dtype=np.uint8)
            out.append(len(v))
        return out

    def batch_is_exist(self, keys):
        self._enter("exists", keys)
        return [k in self.data for k in keys]

    def batch_remove(self, keys):
        return [self.data.pop(k, None) is not None for k in keys]


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


KEYS = ItemKeys("m", None, "float32", {"image": WIDTH}, WIDTH)


def feature(identifier, offset, rows=ROWS):
    return SimpleNamespace(
        identifier=identifier,
        modality="image",
        mm_position=SimpleNamespace(offset=offset, length=rows, get_num_embeds=lambda: rows),
    )


def request(req_id, *identifiers):
    return SimpleNamespace(request_id=req_id, mm_features=[feature(h, 10 + 10 * i) for i, h in enumerate(identifiers)])


def side(data, load=True, save=True, **settings):
    client = FakeClient(data)
    stats = ECStats()
    store = GuardedStore(client, 60.0, stats, logging.getLogger("test"), remove_corrupt=True)
    cfg = ECSettings(url="127.0.0.1:1", **{"wait_ms": 1000.0, **settings})
    clock = Clock()
    return ECSchedulerSide(cfg, KEYS, store, stats, load=load, save=save, clock=clock), client, stats, clock


def stored(*identifiers, **kw):
    return {KEYS.key(h, "image"): value(**kw) for h in identifiers}


def schedule(s, req, hits_expected):
    """What vLLM's scheduler does for a request it schedules: ask, allocate, build the step."""
    found = [s.has_cache_item(f.identifier) for f in req.mm_features]
    assert found == hits_expected
    for i in range(len(req.mm_features)):
        s.update_state_after_alloc(req, i)
    return s.build_step({req.request_id: [i for i, hit in enumerate(found) if not hit]})


def test_a_requests_items_are_read_in_one_batch_and_handed_to_the_worker():
    s, client, stats, _ = side(stored(H1, H3))
    req = request("r1", H1, H2, H3)
    assert s.ensure_cache_available(req, 0)  # the read ended within the step's wait
    assert client.calls == [("get", [KEYS.key(h, "image") for h in (H1, H2, H3)])]
    loads, saves = schedule(s, req, [True, False, True])
    assert set(loads) == {H1, H3} and loads[H1].header.shape == (ROWS, WIDTH)
    assert set(saves) == {H2} and saves[H2].key == KEYS.key(H2, "image")
    snap = stats.snapshot()
    assert (snap["items_found"], snap["items_missing"], snap["items_encoded"]) == (2, 1, 1)
    assert snap["items_load_planned"] == 2
    assert s.held_bytes == 0  # handed over: the metadata holds the bytes now
    assert s.ensure_cache_available(req, 0) and len(client.calls) == 1  # asked once per request


def test_items_covered_by_cached_kv_are_not_read():
    s, client, stats, _ = side(stored(H1, H2))
    assert s.ensure_cache_available(request("r1", H1, H2), 15)  # H1 spans [10, 14)
    assert client.calls == [("get", [KEYS.key(H2, "image")])]


def test_a_request_is_deferred_while_its_read_runs_then_served():
    s, client, stats, clock = side(stored(H1), wait_ms=0)
    client.gate.clear()
    req = request("r1", H1)
    assert not s.ensure_cache_available(req, 0)
    assert not s.ensure_cache_available(req, 0)
    assert not s.has_cache_item(H1)
    client.gate.set()
    assert s.wait_idle(5)
    assert s.ensure_cache_available(req, 0)
    assert s.has_cache_item(H1)
    assert stats.snapshot()["deferred_steps"] == 2


def test_a_step_waits_for_reads_at_most_wait_ms_in_all():
    s, client, stats, clock = side(stored(H1, H2), wait_ms=20)
    client.gate.clear()
    for r in ("r1", "r2", "r3"):
        assert not s.ensure_cache_available(request(r, H1), 0)
    assert s._wait_left == 0  # the step's budget is spent: later requests do not wait
    s.build_step({})
    assert s._wait_left == pytest.approx(0.02)
    client.gate.set()


def test_a_read_slower_than_defer_s_is_given_up_and_the_encoder_runs():
    s, client, stats, clock = side(stored(H1), wait_ms=0, defer_s=2)
    client.gate.clear()
    req = request("r1", H1)
    assert not s.ensure_cache_available(req, 0)
    clock.now = 2.5
    assert s.ensure_cache_available(req, 0)
    assert not s.has_cache_item(H1)
    client.gate.set()
    assert s.wait_idle(5)
    assert s.ensure_cache_available(req, 0) and not s.has_cache_item(H1)  # the late answer is dropped
    assert stats.snapshot()["defer_timeouts"] == 1
    assert s.held_bytes == 0


def test_a_dead_store_is_a_miss_at_once():
    s, client, stats, _ = side(stored(H1))
    client.down = True
    req = request("r1", H1)
    assert s.ensure_cache_available(req, 0)
    assert not s.has_cache_item(H1)
    assert stats.snapshot()["store_errors"] == 1
    assert s.ensure_cache_available(request("r2", H1), 0)  # suspect: answered without a call
    assert stats.snapshot()["calls_while_suspect"] == 1
    assert s.held_bytes == 0


def test_values_of_another_shape_or_dtype_are_misses():
    data = {
        KEYS.key(H1, "image"): value(rows=ROWS + 1),  # longer than the buffer: not read
        KEYS.key(H2, "image"): value(dtype="float16"),  # shorter, another dtype
        KEYS.key(H3, "image"): b"\0" * value_bytes("float32", (ROWS, WIDTH)),  # no header
    }
    s, client, stats, _ = side(data)
    req = request("r1", H1, H2, H3)
    assert s.ensure_cache_available(req, 0)
    assert [s.has_cache_item(h) for h in (H1, H2, H3)] == [False, False, False]
    snap = stats.snapshot()
    assert snap["items_missing"] + snap["items_bad"] == 3 and snap["items_bad"] == 2


def test_ready_bytes_are_bounded_by_prefetch_mib(monkeypatch):
    item = value_bytes("float32", (ROWS, WIDTH))
    s, client, stats, _ = side(stored(H1, H2, H3))
    monkeypatch.setattr(type(s.settings), "prefetch_bytes", property(lambda self: 2 * item))
    assert s.ensure_cache_available(request("r1", H1, H2, H3), 0)
    assert [s.has_cache_item(h) for h in (H1, H2, H3)] == [True, True, False]
    assert stats.snapshot()["items_over_budget"] == 1
    assert s.held_bytes == 2 * item
    s.request_finished(request("r1"))  # never scheduled (aborted): its items are let go
    assert s.held_bytes == 0 and s.sizes()["ready"] == 0


def test_an_item_two_requests_need_is_read_once_and_held_until_both_are_done():
    s, client, stats, _ = side(stored(H1))
    r1, r2 = request("r1", H1), request("r2", H1)
    assert s.ensure_cache_available(r1, 0) and s.ensure_cache_available(r2, 0)
    assert len(client.calls) == 1
    schedule(s, r1, [True])
    assert s.has_cache_item(H1)  # r2 still holds it
    s.request_finished(r2)
    assert not s.has_cache_item(H1) and s.held_bytes == 0


def test_lookup_state_is_bounded(monkeypatch):
    monkeypatch.setattr(scheduler_side, "REQUESTS_MAX", 3)
    s, client, stats, _ = side(stored(H1))
    for i in range(10):
        assert s.ensure_cache_available(request(f"r{i}", H1), 0)
    assert s.sizes()["lookups"] == 3
    assert s.held_bytes == value_bytes("float32", (ROWS, WIDTH))  # held by the 3 remembered


def test_a_full_fetch_queue_is_a_miss_not_a_wait():
    s, client, stats, _ = side(stored(H1, H2), wait_ms=0, fetch_queue_jobs_max=1)
    client.gate.clear()
    assert not s.ensure_cache_available(request("r1", H1), 0)  # running
    while not client.calls:  # the queue's thread took it
        time.sleep(0.001)
    assert not s.ensure_cache_available(request("r2", H1), 0)  # queued
    assert s.ensure_cache_available(request("r3", H2), 0)  # refused: encoded
    assert stats.snapshot()["fetches_refused"] == 1
    client.gate.set()
    assert s.wait_idle(5)


def test_a_producer_only_engine_asks_existence_and_skips_encoding_stored_items():
    s, client, stats, _ = side(stored(H1), load=False, save=True)
    req = request("r1", H1, H2)
    assert s.ensure_cache_available(req, 0)
    assert client.calls == [("exists", [KEYS.key(H1, "image"), KEYS.key(H2, "image")])]
    loads, saves = schedule(s, req, [True, False])
    assert loads == {} and set(saves) == {H2}
    assert s.ensure_cache_available(request("r2", H1), 0) and len(client.calls) == 1  # remembered


def test_a_consumer_only_engine_names_nothing_to_save():
    s, client, stats, _ = side(stored(H1), load=True, save=False)
    req = request("r1", H1, H2)
    assert s.ensure_cache_available(req, 0)
    loads, saves = schedule(s, req, [True, False])
    assert set(loads) == {H1} and saves == {}
