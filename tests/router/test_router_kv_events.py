"""vLLM KV events -> page flags (gcache.router.ingest.kv_events), no processes: batches built as vLLM
0.32 encodes them (msgpack; events as maps tagged by "type", or as arrays, the tag first).

The property everything rests on: a page the translator names from a BlockStored has the id
the router computes from the same tokens (redis_layout.page_ids), whatever the vLLM hashes."""

from __future__ import annotations

import random

import msgpack
import pytest

from gcache.router.ingest.kv_events import EngineEvents, Limits
from gcache.router.match import match_worker
from gcache.serving.redis_layout import L1_FULL, L1_SWA, L2_FULL, L2_SWA, page_ids

BS = 32


def stored(hashes, parent, tokens, group=0, kind="full_attention", window=None, medium="GPU", extra=None, **kw):
    ev = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": kw.pop("block_size", BS),
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
        "extra_keys": extra if extra is not None else [None] * len(hashes),
        "group_idx": group,
        "kv_cache_spec_kind": kind,
    }
    if window is not None:
        ev["kv_cache_spec_sliding_window"] = window
    ev.update(kw)
    return ev


def removed(hashes, group=0, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group}


def batch(*events, rank=0) -> bytes:
    return msgpack.packb([1.0, list(events), rank])


def frame(seq: int, payload: bytes, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


def toks(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n)]


def vh(i: int, salt: int = 0) -> int:
    """A stand-in vLLM block hash (the translator never interprets it)."""
    return (0x9E3779B97F4A7C15 * (i + 1) + salt * 7919) % (1 << 64)


def flags(ev: EngineEvents) -> dict[int, int]:
    """Everything it credits now (a snapshot)."""
    ev.failed(None)
    return dict(ev.take().pages)


def test_stored_blocks_get_the_routers_page_ids_chained_across_events():
    t = toks(5 * BS)
    ev = EngineEvents()
    ev.apply_batch(batch(stored([vh(0), vh(1)], None, t[: 2 * BS])))
    ev.apply_batch(batch(stored([vh(2), vh(3), vh(4)], vh(1), t[2 * BS :])))
    ids = page_ids(t, BS)
    assert ev.take().full  # the first take is a snapshot
    assert flags(ev) == {pid: L1_FULL | L1_SWA for pid in ids}  # full attention only: every point window-safe
    assert ev.window == 1 and ev.page_size == BS
    ev.apply_batch(batch(removed([vh(3)])))
    assert dict(ev.take().pages) == {ids[3]: 0}  # a delta: page 3 gone
    m = match_worker(ids, len(ids), {p: L1_FULL | L1_SWA for p in ids if p != ids[3]}, {}, BS, 1)
    assert m.l1 == 3


def test_a_store_whose_parent_was_never_seen_is_dropped_and_counted():
    t = toks(3 * BS, seed=1)
    ev = EngineEvents()
    ev.apply_batch(batch(stored([vh(1), vh(2)], vh(0), t[BS:])))  # joined late: block 0 never seen
    assert flags(ev) == {} and ev.stats["orphans"] == 2


def test_blocks_with_extra_keys_and_their_descendants_never_match_a_text_prompt():
    t = toks(3 * BS, seed=2)
    ev = EngineEvents()
    mm = [None, ["img-hash", 0], None]  # block 1 holds part of an image
    ev.apply_batch(batch(stored([vh(0), vh(1), vh(2)], None, t, extra=mm)))
    got = flags(ev)
    ids = page_ids(t, BS)
    assert ids[0] in got and ids[1] not in got and ids[2] not in got and len(got) == 3
    lora = EngineEvents()
    lora.apply_batch(batch(stored([vh(0)], None, t[:BS], lora_name="adapter", lora_id=1)))
    assert ids[0] not in flags(lora)


def test_hybrid_groups_full_and_sliding_flags_and_the_evicted_window_is_no_hit():
    """Group 0 full attention, group 1 sliding window 32 (one block): the SWA group's store
    skips the out-of-window blocks (its token ids cover all, its hashes only the kept ones)
    and comes first in the batch; the full group's store names them."""
    t = toks(4 * BS, seed=3)
    ids = page_ids(t, BS)
    hs = [vh(i) for i in range(4)]
    ev = EngineEvents()
    ev.apply_batch(
        batch(
            stored(hs[3:], None, t, group=1, kind="sliding_window", window=32),
            stored(hs, None, t, group=0),
        )
    )
    f = flags(ev)
    assert ev.window == 32
    assert f == {ids[0]: L1_FULL, ids[1]: L1_FULL, ids[2]: L1_FULL, ids[3]: L1_FULL | L1_SWA}
    prompt_ids = ids + page_ids(t + toks(BS, seed=9), BS)[4:]  # the same prefix, one more page
    assert match_worker(prompt_ids, 4, f, {}, BS, 32).l1 == 4  # resumes after page 3 (its window is live)
    assert match_worker(prompt_ids, 4, f, {}, BS, 32).raw_l1 == 4
    assert match_worker(ids[:3], 3, f, {}, BS, 32).l1 == 0  # at page 2 the window was evicted: no hit
    ev.apply_batch(batch(removed(hs[3:], group=1)))  # the sliding block is reused for something else
    f2 = dict(ev.take().pages)
    assert f2 == {ids[3]: L1_FULL}
    assert match_worker(prompt_ids, 4, {**f, **f2}, {}, BS, 32).l1 == 0  # raw overlap 4, window-safe 0


def test_cpu_medium_is_l2_and_remote_or_unknown_media_are_not_the_engines():
    t = toks(BS, seed=4)
    ev = EngineEvents()
    ev.apply_batch(batch(stored([vh(0)], None, t, medium="CPU")))
    ev.apply_batch(batch(stored([vh(9)], None, toks(BS, 5), medium="GCACHE")))
    ev.apply_batch(batch(stored([vh(8)], None, toks(BS, 6), locality="REMOTE")))
    assert flags(ev) == {page_ids(t, BS)[0]: L2_FULL | L2_SWA}
    assert ev.stats["ignored_media"] == 2


def test_array_encoded_events_as_older_vllm_and_sglang_send_them():
    t = toks(2 * BS, seed=7)
    ev = EngineEvents()
    ev.apply_batch(msgpack.packb([1.0, [["BlockStored", [vh(0), vh(1)], None, t, BS, None, "GPU"]]]))
    assert set(flags(ev)) == set(page_ids(t, BS))
    ev.apply_batch(msgpack.packb([2.0, [["AllBlocksCleared"]]]))
    assert flags(ev) == {} and ev.stats["cleared"] == 1


def test_sequence_gap_or_engine_restart_clears_what_it_holds():
    t = toks(2 * BS, seed=8)
    ev = EngineEvents()
    ev.apply_frame(frame(0, batch(stored([vh(0)], None, t[:BS]))), now=1.0)
    ev.apply_frame(frame(1, batch(stored([vh(1)], vh(0), t[BS:]))), now=2.0)
    assert len(flags(ev)) == 2 and ev.last_event_at == 2.0
    ev.apply_frame(frame(5, batch()))  # 2..4 lost: removals may have been missed
    assert flags(ev) == {} and ev.stats["gaps"] == 1
    ev.apply_frame(frame(6, batch(stored([vh(0)], None, t[:BS]))))
    ev.apply_frame(frame(0, batch()))  # the engine restarted
    assert flags(ev) == {} and ev.stats["restarts"] == 1
    ev.apply_frame(frame(1, batch(stored([vh(0)], None, t[:BS]))))
    assert len(flags(ev)) == 1


HOSTILE = [
    b"",
    b"\xc1",  # never used in msgpack
    msgpack.packb({"ts": 1}),
    msgpack.packb([1.0, "events", 0]),
    msgpack.packb([1.0, [], -1]),
    msgpack.packb([1.0, [], 1 << 40]),
    msgpack.packb([1.0, [1, None, "x", {"type": 5}, {"type": "Nope"}, ["BlockStored"]]]),
    batch(stored([vh(0)], None, [1, 2, 3])),  # tokens do not cover the block
    batch(stored([vh(0)], None, [-1] * BS)),
    batch(stored([vh(0)], None, [1 << 33] * BS)),
    batch(stored([-1], None, [1] * BS)),
    batch(stored(["str-hash"], None, [1] * BS)),
    batch(stored([vh(0)], None, [1] * BS, block_size=0)),
    batch(stored([vh(0)], None, [1] * BS, block_size=True)),
    batch(stored([vh(0)], None, [1] * BS, group=-3)),
    batch(stored([vh(0)], None, [1] * BS, extra=[None, None])),
    batch(stored([vh(0)], None, [1] * BS, kind="sliding_window")),  # no window
    batch(stored([], None, [])),
    batch({"type": "BlockRemoved", "block_hashes": "all"}),
    batch(["BlockStored", [vh(0)], None, [1] * BS, BS, None, "GPU", None, None, 0, "full", 1, 2, 3, 4, 5, 6]),
]


@pytest.mark.parametrize("payload", HOSTILE)
def test_malformed_or_hostile_batches_are_dropped_and_counted_and_change_nothing(payload):
    t = toks(BS, seed=10)
    ev = EngineEvents()
    ev.apply_batch(batch(stored([vh(0)], None, t)))
    before = flags(ev)
    ev.apply_batch(payload)
    assert ev.stats["bad_batches"] + ev.stats["malformed"] >= 1
    assert flags(ev) == before


def test_random_bytes_and_mutated_batches_never_raise():
    rng = random.Random(0)
    good = batch(stored([vh(0), vh(1)], None, toks(2 * BS)), removed([vh(0)]))
    ev = EngineEvents(Limits(batch_bytes_max=1 << 16))
    for i in range(3000):
        if i % 2:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
        else:
            b = bytearray(good)
            for _ in range(rng.randrange(1, 6)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            raw = bytes(b)
        ev.apply_frame([b"kv", i.to_bytes(8, "big"), raw])
    ev.apply_frame([b"kv"])  # wrong frame count
    ev.apply_frame([b"kv", b"123", b""])  # a short sequence number
    ev.apply_batch(b"\x00" * ((1 << 16) + 1))  # over the byte limit
    assert ev.stats["bad_frames"] == 2 and ev.stats["bad_batches"] > 0
    ev.take()


def test_bounds_held_blocks_chain_and_dirty_pages():
    t = toks(8 * BS, seed=11)
    ids = page_ids(t, BS)
    ev = EngineEvents(Limits(pages_max=4, chain_max=6, dirty_max=2))
    ev.apply_batch(batch(stored([vh(i) for i in range(8)], None, t)))
    got = dict(ev.take().pages)
    # the chain kept the last 6 names (blocks 0-1 unnamed), the held set the newest 4: the
    # oldest go (what a bound forgets is never credited, so it can cost hits, never misroute)
    assert set(got) == set(ids[4:]) and ev.stats["evicted"] == 2 and ev.stats["unresolved"] == 2
    assert len(ev.chain) == 6
    ev.apply_batch(batch(removed([vh(4), vh(5), vh(6)])))  # three changes > dirty_max: a snapshot next
    b = ev.take()
    assert b.full and dict(b.pages) == {ids[7]: L1_FULL | L1_SWA} and ev.stats["dropped_dirty"] == 1


def test_several_sliding_groups_each_must_hold_the_page_and_the_window_is_the_largest():
    t = toks(2 * BS, seed=12)
    ids = page_ids(t, BS)
    hs = [vh(0), vh(1)]
    ev = EngineEvents()
    ev.apply_batch(
        batch(
            stored(hs, None, t, group=0),
            stored(hs, None, t, group=1, kind="sliding_window", window=64),
            stored(hs[1:], None, t, group=2, kind="mamba"),
        )
    )
    assert ev.window == 64
    assert flags(ev) == {ids[0]: L1_FULL, ids[1]: L1_FULL | L1_SWA}
    ev.apply_batch(batch(stored(hs, None, t, group=3, kind="chunked_local_attention")))
    assert ev.stats["ignored_groups"] == 1


def test_data_parallel_ranks_are_held_apart():
    t = toks(BS, seed=13)
    ev = EngineEvents()
    ev.apply_batch(batch(stored([vh(0)], None, t), rank=0))
    ev.apply_batch(batch(stored([vh(0)], None, t), rank=1))
    ev.apply_batch(batch(removed([vh(0)]), rank=0))
    assert flags(ev) == {page_ids(t, BS)[0]: L1_FULL | L1_SWA}  # rank 1 still holds it
    ev.apply_batch(batch({"type": "AllBlocksCleared"}, rank=1))
    assert flags(ev) == {}


def test_l2_from_the_cpu_offload_and_l1_together():
    t = toks(BS, seed=14)
    ev = EngineEvents()
    ev.apply_batch(batch(stored([vh(0)], None, t), stored([vh(0)], None, t, medium="CPU")))
    assert flags(ev) == {page_ids(t, BS)[0]: L1_FULL | L1_SWA | L2_FULL | L2_SWA}
