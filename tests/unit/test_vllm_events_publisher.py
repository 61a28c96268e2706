"""GCache's L3 as vLLM KV events, the connector's side (gcache.integrations.vllm.events_*):
what it encodes is what the router's decoder (and vLLM's own, where installed) reads; a page
is announced only once the store holds it; withdrawn when a lookup finds it gone, when the
announced LRU overflows, never while the store is down; a full queue drops, never blocks.

No vLLM needed: pages are built as the scheduler side builds them. The store is a real
gcache-server where its answers matter."""

from __future__ import annotations

import logging
import random
import threading

import msgpack
import pytest

from gcache import Client
from gcache.integrations.common.guarded_store import GuardedStore
from gcache.integrations.vllm.events.publisher import EventPublisher
from gcache.integrations.vllm.events.source import L3EventSource, Page, SourceLimits
from gcache.integrations.vllm.kv.stats import ConnectorStats
from gcache.router.ingest.kv_events import EngineEvents
from gcache.serving.announce.wire import KIND_FULL, KIND_SWA
from gcache.serving.redis_layout import L3_FULL, L3_SWA, page_ids
from tests.support.waiting import wait_until

BS = 16


class ListSink:
    """The frames a publisher sent (a ZMQ PUB socket's stand-in)."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.frames: list[list[bytes]] = []
        self.gate, self.entered = gate, threading.Event()

    def send(self, frames: list[bytes]) -> None:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        self.frames.append([bytes(f) for f in frames])

    def close(self) -> None:
        pass


class AllThere:
    """A store that holds every key (or, while `down`, answers nothing)."""

    def __init__(self) -> None:
        self.down = False
        self.asked: list[int] = []

    def exists_flags(self, keys: list[bytes]) -> list[bool]:
        self.asked.append(len(keys))
        return [not self.down] * len(keys)


def toks(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 30_000) for _ in range(n)]


def vh(i: int, seed: int = 0) -> int:
    return (0x9E3779B97F4A7C15 * (i + 1) + seed * 7919) % (1 << 64)


def pages(tokens: list[int], group: int = 0, kind: str = KIND_FULL, window=None, seed: int = 0, first: int = 0):
    """The scheduler side's Page for each whole page of `tokens` from page `first` on."""
    return [
        Page(
            group,
            kind,
            window,
            BS,
            vh(p, seed),
            vh(p - 1, seed) if p else None,
            tokens[p * BS : (p + 1) * BS],
            [f"k{seed}/{group}/{p}/{r}".encode() for r in range(2)],  # two values per page (two ranks)
        )
        for p in range(first, len(tokens) // BS)
    ]


def source(store, limits: SourceLimits | None = None, **kw):
    sink = ListSink()
    pub = EventPublisher("kv@pod@m", lambda: sink, **kw)
    return L3EventSource(store, pub.publish, limits or SourceLimits(), start_thread=False), pub, sink


def sent(pub: EventPublisher, sink: ListSink, n: int) -> list[list[bytes]]:
    wait_until(lambda: len(sink.frames) >= n, f"{n} messages sent")
    return sink.frames


def events_of(frames) -> list[dict]:
    return [ev for f in frames for ev in msgpack.unpackb(f[2], raw=False)[1]]


def test_stored_pages_decode_as_the_routers_l3_page_ids_and_as_vllm_events():
    t = toks(4 * BS)
    src, pub, sink = source(AllThere())
    src.saved(pages(t))
    src.run_once()
    frames = sent(pub, sink, 1)
    topic, seq, payload = frames[0]
    assert topic == b"kv@pod@m" and int.from_bytes(seq, "big") == 0
    (ev,) = events_of(frames)
    assert ev["type"] == "BlockStored" and ev["medium"] == "GCACHE" and ev["locality"] == "REMOTE"
    assert ev["block_hashes"] == [vh(p) for p in range(4)] and ev["parent_block_hash"] is None
    assert ev["token_ids"] == t and ev["block_size"] == BS and ev["group_idx"] == 0
    assert ev["kv_cache_spec_kind"] == KIND_FULL
    # The router's decoder, in shared-L3 mode, names the pages as it names prompts.
    router = EngineEvents(shared_l3=True)
    router.apply_frame(frames[0])
    assert dict(router.take().pages) == {pid: L3_FULL | L3_SWA for pid in page_ids(t, BS)}
    assert router.stats["malformed"] == 0
    # An engine's own translator does not take them for the engine's memory.
    own = EngineEvents()
    own.apply_frame(frames[0])
    assert own.pages() == 0 and own.stats["ignored_media"] == 1


@pytest.mark.process  # importing vLLM runs `file` on the interpreter
def test_vllms_own_decoder_reads_them():
    kv_events = pytest.importorskip("vllm.distributed.kv_events")  # the vLLM venv
    import msgspec

    t = toks(4 * BS)
    src, pub, sink = source(AllThere())
    src.saved(pages(t))
    src.run_once()
    payload = sent(pub, sink, 1)[0][2]
    batch = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)
    (stored,) = batch.events
    assert isinstance(stored, kv_events.BlockStored)
    assert stored.block_hashes == [vh(p) for p in range(4)] and stored.token_ids == t
    assert (stored.medium, stored.locality, stored.group_idx) == ("GCACHE", "REMOTE", 0)


def test_a_later_run_chains_to_its_parent_and_sliding_groups_say_their_window():
    t = toks(6 * BS, seed=1)
    src, pub, sink = source(AllThere())
    src.saved(pages(t[: 2 * BS]))
    src.run_once()
    src.saved(pages(t, first=2) + pages(t, group=1, kind=KIND_SWA, window=32, first=4))
    src.run_once()
    frames = sent(pub, sink, 2)
    assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1]
    later = events_of(frames[1:])
    assert [(e["group_idx"], e["parent_block_hash"], len(e["block_hashes"])) for e in later] == [
        (0, vh(1), 4),
        (1, vh(3), 2),
    ]
    assert later[1]["kv_cache_spec_kind"] == KIND_SWA and later[1]["kv_cache_spec_sliding_window"] == 32
    router = EngineEvents(shared_l3=True)
    for f in frames:
        router.apply_frame(f)
    ids = page_ids(t, BS)
    flags = dict(router.take().pages)
    # Full pages are all there; only pages the sliding group also holds are window-safe.
    assert flags == {pid: L3_FULL | (L3_SWA if i >= 4 else 0) for i, pid in enumerate(ids)}


@pytest.mark.process
def test_a_page_is_announced_only_once_the_store_holds_every_value_of_it(server):
    client = Client(server.address)
    store = GuardedStore(client, 5.0, ConnectorStats(), logging.getLogger("test"))
    t = toks(3 * BS, seed=2)
    ps = pages(t, seed=2)
    now = [0.0]
    sink = ListSink()
    pub = EventPublisher("t", lambda: sink)
    src = L3EventSource(store, pub.publish, SourceLimits(confirm_s=30.0), clock=lambda: now[0], start_thread=False)
    src.saved(ps)
    src.run_once()
    assert src.stats["confirm_rounds"] == 1 and src.stats["announced"] == 0
    # Another request's lookup misses page 0 while its save is in flight: it stays pending.
    src.missing([ps[0]])
    src.run_once()
    assert (ps[0].group_idx, ps[0].block_hash) in src.pending and src.stats["removed_missing"] == 0
    # The saves land (asynchronously, as the worker side's): page 0 whole, page 1 half.
    for key in list(ps[0].keys) + [ps[1].keys[0]]:
        client.put(key, b"x" * 64)
    src.run_once()
    (ev,) = events_of(sent(pub, sink, 1))
    assert ev["block_hashes"] == [vh(0, 2)]
    client.put(ps[1].keys[1], b"x" * 64)
    src.run_once()
    assert events_of(sent(pub, sink, 2)[1:])[0]["block_hashes"] == [vh(1, 2)]
    # Page 2 never lands: after confirm_s it is given up, never announced.
    now[0] = 31.0
    src.run_once()
    assert src.stats["unconfirmed"] == 1 and not src.pending and src.stats["announced"] == 2
    pub.close()
    assert len(sink.frames) == 2
    client.close()


@pytest.mark.process
def test_an_announced_page_a_lookup_misses_is_removed_but_not_while_the_store_is_down(server):
    client = Client(server.address, timeout_s=1, retries=0)
    store = GuardedStore(client, 60.0, ConnectorStats(), logging.getLogger("test"))
    t = toks(3 * BS, seed=3)
    ps = pages(t, seed=3)
    for p in ps:
        for key in p.keys:
            client.put(key, b"x" * 64)
    src, pub, sink = source(store)
    src.saved(ps)
    src.run_once()
    sent(pub, sink, 1)
    src.missing([ps[2], pages(toks(BS, seed=9), seed=9)[0]])  # one announced, one never
    src.run_once()
    (ev,) = events_of(sent(pub, sink, 2)[1:])
    assert ev["type"] == "BlockRemoved" and ev["block_hashes"] == [vh(2, 3)] and ev["medium"] == "GCACHE"
    assert src.stats["removed_missing"] == 1
    # The store goes down: a miss now says nothing about what it holds.
    server.kill()
    assert store.exists_flags([ps[0].keys[0]]) == [False] and store.down
    src.missing([ps[0]])
    src.run_once()
    assert src.stats["missing_while_down"] == 1 and src.stats["removed_missing"] == 1
    assert (ps[0].group_idx, ps[0].block_hash) in src.announced
    pub.close()
    assert len(sink.frames) == 2
    client.close()


def test_the_announced_lru_withdraws_its_oldest_pages():
    t = toks(5 * BS, seed=4)
    src, pub, sink = source(AllThere(), SourceLimits(pages_max=3))
    src.saved(pages(t[: 3 * BS], seed=4))
    src.run_once()
    src.saved(pages(t, seed=4, first=3))
    src.run_once()
    later = events_of(sent(pub, sink, 2)[1:])
    assert [e["type"] for e in later] == ["BlockStored", "BlockRemoved"]
    assert later[1]["block_hashes"] == [vh(0, 4), vh(1, 4)]
    assert src.stats["withdrawn_lru"] == 2 and len(src.announced) == 3
    router = EngineEvents(shared_l3=True)
    for f in sink.frames:
        router.apply_frame(f)
    ids = page_ids(t, BS)
    assert set(dict(router.take().pages)) == set(ids[2:])  # what the connector still vouches for


def test_full_queues_drop_and_count_and_never_block_the_scheduler():
    store = AllThere()
    src = L3EventSource(store, lambda events: True, SourceLimits(inbox_max=1), start_thread=False)
    t = toks(2 * BS, seed=5)
    src.saved(pages(t[:BS], seed=5))
    src.saved(pages(t, seed=5, first=1))  # the inbox holds one notice: dropped
    assert src.stats["notices_dropped"] == 1
    # The publisher's queue: one batch in the sink (held), one queued, the third dropped.
    gate = threading.Event()
    sink = ListSink(gate)
    pub = EventPublisher("t", lambda: sink, queue_max=1)
    assert pub.publish([{"type": "AllBlocksCleared"}])
    wait_until(sink.entered.is_set, "the first batch in the sink")
    assert pub.publish([{"type": "AllBlocksCleared"}])
    assert not pub.publish([{"type": "AllBlocksCleared"}])
    assert pub.stats["dropped"] == 1
    gate.set()
    pub.close()
    assert [int.from_bytes(f[1], "big") for f in sink.frames] == [0, 1]


def test_a_store_that_is_down_announces_nothing_and_keeps_the_pages_waiting():
    store = AllThere()
    store.down = True
    src, pub, sink = source(store)
    src.saved(pages(toks(2 * BS, seed=6), seed=6))
    src.run_once()
    assert src.stats["announced"] == 0 and len(src.pending) == 2
    store.down = False
    src.run_once()
    assert src.stats["announced"] == 2
    assert len(events_of(sent(pub, sink, 1))) == 1
