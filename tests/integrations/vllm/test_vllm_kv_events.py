"""GCache's L3 events from a real vLLM 0.32 engine, read by a subscriber written from
docs/kv-events.md alone: plain zmq and msgpack, nothing of gcache's (the test only starts the
engine and the store with gcache's helpers).

The engine runs the connector with gcache_kv_events_endpoint and, for reference, vLLM's own KV
events: the pages GCache announces must carry the very block hashes vLLM's own events carry for
the same blocks, the prompt's tokens, medium GCACHE and locality REMOTE; a follow-up prompt's
new page is announced with its parent's hash."""

from __future__ import annotations

import time

import msgpack
import pytest

from gcache.testing.vllm_models import BLOCK_SIZE, prompt_tokens
from tests.support.vllm_support import EngineRun, gcache_spec

pytestmark = [pytest.mark.process, pytest.mark.timeout(1500)]

WAIT_S = 600.0  # an engine start on a loaded 2-core machine, then its first prompt


class DocSubscriber:
    """What docs/kv-events.md says a consumer does: SUB to the endpoint, every topic; three
    frames (topic, 8-byte big-endian seq, msgpack [ts, events, rank]); events are maps tagged
    by "type"."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.zmq = zmq
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.messages: list[tuple[bytes, int, list]] = []

    def drain(self) -> None:
        while True:
            try:
                topic, seq, payload = self.sock.recv_multipart(self.zmq.NOBLOCK)
            except self.zmq.Again:
                return
            ts, events, _rank = msgpack.unpackb(payload, raw=False)
            assert isinstance(ts, float)
            self.messages.append((topic, int.from_bytes(seq, "big"), events))

    def events(self, kind: str, medium: str | None = None) -> list[dict]:
        return [
            e
            for _, _, evs in self.messages
            for e in evs
            if e.get("type") == kind and (medium is None or e.get("medium") == medium)
        ]

    def close(self) -> None:
        self.sock.close(0)


def stored_hashes(events: list[dict], group: int = 0) -> list:
    return [h for e in events if e.get("group_idx", 0) == group for h in e["block_hashes"]]


def test_a_subscriber_from_the_docs_sees_the_pages_the_engine_saved(models, server, tmp_path):
    pytest.importorskip("zmq")
    g_ep, v_ep = f"ipc://{tmp_path}/gcache-l3.kv", f"ipc://{tmp_path}/vllm.kv"  # binds, on this host only
    prompt = prompt_tokens(4 * BLOCK_SIZE + 5, seed=11)  # 4 whole pages
    follow = prompt[: 4 * BLOCK_SIZE] + prompt_tokens(BLOCK_SIZE + 3, seed=12)  # one new page after them
    spec = dict(
        gcache_spec(
            models["llama"],
            server.address,
            [prompt, follow, follow],  # the third: the engine waits at its gate while we read
            gcache_model="tiny",
            gcache_kv_events_endpoint=g_ep,
            gcache_kv_events_pod="pod-a",
        ),
        kv_events={"endpoint": v_ep, "topic": "vllm"},
        gates=[1, 2],
    )
    gcache_sub = DocSubscriber(g_ep)
    vllm_sub = DocSubscriber(v_ep)
    run = EngineRun(spec, tmp_path / "engine")
    try:

        def until(cond, what: str) -> None:
            deadline = time.monotonic() + WAIT_S
            while not cond():
                if run.proc.poll() is not None:
                    raise AssertionError(f"engine exited before {what}:\n{run._tail()}")
                assert time.monotonic() < deadline, f"not within {WAIT_S:.0f}s: {what}\n{run._tail()}"
                time.sleep(0.1)
                gcache_sub.drain()
                vllm_sub.drain()

        until(
            lambda: (run.gates / "ready-1").exists() and len(stored_hashes(gcache_sub.events("BlockStored"))) >= 4,
            "GCache's BlockStored for the first prompt's 4 pages",
        )
        own = stored_hashes(vllm_sub.events("BlockStored"))[:4]
        assert len(own) == 4, vllm_sub.messages
        stored = gcache_sub.events("BlockStored")
        assert all(e["medium"] == "GCACHE" and e["locality"] == "REMOTE" for e in stored), stored
        assert all(e["block_size"] == BLOCK_SIZE and e["kv_cache_spec_kind"] == "full_attention" for e in stored)
        assert stored_hashes(stored) == own  # vLLM's own block hashes for the same blocks
        assert stored[0]["parent_block_hash"] is None
        assert [t for e in stored for t in e["token_ids"]] == prompt[: 4 * BLOCK_SIZE]
        topics = {t for t, _, _ in gcache_sub.messages}
        assert topics == {b"kv@pod-a@tiny"}, topics
        seqs = [s for _, s, _ in gcache_sub.messages]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # no gap
        # The follow-up: vLLM's own cache has the 4 pages, the connector saves the 5th, chained.
        run.open_gate(1)
        until(
            lambda: (run.gates / "ready-2").exists() and len(stored_hashes(gcache_sub.events("BlockStored"))) >= 5,
            "the follow-up's new page",
        )
        later = gcache_sub.events("BlockStored")[len(stored) :]
        assert later[0]["parent_block_hash"] == own[3]
        assert later[0]["token_ids"] == follow[4 * BLOCK_SIZE : 5 * BLOCK_SIZE]
        own5 = stored_hashes(vllm_sub.events("BlockStored"))
        assert later[0]["block_hashes"][0] in own5
        run.open_gate(2)
        result = run.result()
        assert result["results"][1]["num_cached_tokens"] >= 4 * BLOCK_SIZE
        assert gcache_sub.events("BlockRemoved") == []
    finally:
        run.kill()
        gcache_sub.close()
        vllm_sub.close()


def test_a_hybrid_engine_announces_its_sliding_group_with_kind_and_window(models, server, tmp_path):
    """Gemma2 (sliding window 32, full attention): the full group's pages all, with vLLM's own
    hashes; the sliding group's checkpoint tails, said to be "sliding_window", window 32, each
    run chained to the page before it."""
    pytest.importorskip("zmq")
    g_ep, v_ep = f"ipc://{tmp_path}/gcache-l3.kv", f"ipc://{tmp_path}/vllm.kv"  # binds, on this host only
    prompt = prompt_tokens(9 * BLOCK_SIZE + 3, seed=21)
    spec = dict(
        gcache_spec(models["gemma2"], server.address, [prompt, prompt], gcache_kv_events_endpoint=g_ep),
        kv_events={"endpoint": v_ep},
        gates=[1],
    )
    gcache_sub = DocSubscriber(g_ep)
    vllm_sub = DocSubscriber(v_ep)
    run = EngineRun(spec, tmp_path / "engine")
    try:
        deadline = time.monotonic() + WAIT_S

        def kinds() -> dict:
            out: dict = {}
            for e in gcache_sub.events("BlockStored"):
                out.setdefault((e["group_idx"], e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"]), [])
                out[(e["group_idx"], e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"])].append(e)
            return out

        def full_pages() -> int:
            return sum(
                len(e["block_hashes"]) for (_, kind, _), evs in kinds().items() if kind == "full_attention" for e in evs
            )

        while not ((run.gates / "ready-1").exists() and full_pages() >= 9 and len(kinds()) == 2):
            assert run.proc.poll() is None, f"engine exited:\n{run._tail()}"
            assert time.monotonic() < deadline, f"no hybrid announcements: {gcache_sub.messages}\n{run._tail()}"
            time.sleep(0.1)
            gcache_sub.drain()
            vllm_sub.drain()
        groups = kinds()
        (full_key,) = [k for k in groups if k[1] == "full_attention"]
        (swa_key,) = [k for k in groups if k[1] == "sliding_window"]
        assert full_key[2] is None and swa_key[2] == 32 and full_key[0] != swa_key[0]
        full = stored_hashes(groups[full_key], full_key[0])
        own = stored_hashes(vllm_sub.events("BlockStored"), full_key[0])[:9]
        assert full == own, (full, own)
        for e in groups[swa_key]:
            first = full.index(e["block_hashes"][0])  # a sliding page is a page of the prompt
            assert e["block_hashes"] == full[first : first + len(e["block_hashes"])]
            assert e["parent_block_hash"] == (full[first - 1] if first else None)
            assert e["token_ids"] == prompt[first * BLOCK_SIZE : (first + len(e["block_hashes"])) * BLOCK_SIZE]
        assert 0 < len(stored_hashes(groups[swa_key], swa_key[0])) < 9  # checkpoint tails only
        run.open_gate(1)
        run.result()
    finally:
        run.kill()
        gcache_sub.close()
        vllm_sub.close()
