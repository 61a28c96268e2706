"""PD pieces without processes: a request continued after handed tokens equals one that sampled
them itself (greedy and seeded sampling); the handoff record's checks; the prefill side's
stored-prefix rule."""

from __future__ import annotations

import numpy as np
import pytest

from gcache.serving.errors import HTTPError
from gcache.serving.handoff import KNOWN_POOLS, Handoff, Role, expected_pools, parse_pd_body
from gcache.wire.keys import page_hashes_array
from gcache.worker.engine.request import SamplingParams
from gcache.worker.kvcache.tiered_config import TieredCacheConfig
from gcache.worker.kvcache.tiers.host_cache import stored_prefix
from gcache.worker.model.transformer import Model
from tests.support.tiered_cache_support import CFG, build_engine

PS, W = CFG.page_size, CFG.window
PROMPT = [int(t) for t in np.random.default_rng(7).integers(3, 250, size=70)]


@pytest.fixture(scope="module")
def model():
    return Model(CFG)


def run_one(engine, prompt, params, handed=()):
    r = engine.add_request(prompt, params, handed=handed)
    engine.run_until_idle()
    engine.close()
    return list(r.output)


@pytest.mark.parametrize(
    "params", [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.8, seed=5)]
)
def test_a_request_continued_after_its_handed_first_token_equals_the_whole_run(model, params):
    whole = run_one(build_engine(model, 64, 32, TieredCacheConfig()), PROMPT, params)
    for hc in (TieredCacheConfig(), TieredCacheConfig(l2_bytes=1 << 20)):
        cont = run_one(build_engine(model, 64, 32, hc), PROMPT, params, handed=whole[:1])
        assert cont == whole  # the handed token, then the same tokens (same RNG draws)


def test_handed_tokens_are_checked(model):
    engine = build_engine(model, 64, 32, TieredCacheConfig())
    with pytest.raises(ValueError, match="handed"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=1), handed=(5,))
    with pytest.raises(ValueError, match="handed"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=4), handed=(CFG.vocab_size,))
    engine.close()


def record(prompt=PROMPT, model="m", **over) -> dict:
    keys = page_hashes_array(prompt, PS)
    h = Handoff("m", PS, W, len(prompt), 42, 1, tuple(keys), expected_pools(len(prompt), PS, W), len(keys), "cmpl-1", 0)
    return {**h.to_dict(), "model": model, **over}


def test_a_handoff_record_round_trips_and_describes_its_pools():
    h = Handoff.from_dict(record())
    assert h.to_dict() == record() and h.pools == {"full": (0, 8), "swa": (4, 8)}  # 70 tokens: 8 pages, W=32
    assert KNOWN_POOLS == ("full", "swa")
    h.validate("m", PS, W, PROMPT, CFG.vocab_size)


@pytest.mark.parametrize(
    "over, why",
    [
        ({"v": 2}, "v=1"),
        ({"pools": {"full": [0, 8], "mtp": [0, 8]}}, "unknown KV pool"),
        ({"pools": {"full": [0, 99]}}, "outside"),
        ({"sampled": 2}, "out of range"),
        ({"pages": "abc"}, "list of page hashes"),
        ({"first_token": None}, "malformed"),
    ],
)
def test_malformed_records_are_refused(over, why):
    with pytest.raises(HTTPError, match=why) as e:
        Handoff.from_dict(record(**over))
    assert e.value.status == 400


def test_a_record_for_another_prompt_model_or_geometry_is_refused():
    h = Handoff.from_dict(record())
    other = [PROMPT[0] + 1] + PROMPT[1:]
    cases = [
        (("x", PS, W, PROMPT), "model"),
        (("m", 16, W, PROMPT), "page size"),
        (("m", PS, W, PROMPT[:-1]), "prompt"),
        (("m", PS, W, other), "page-hash chain"),
    ]
    for args, why in cases:
        with pytest.raises(HTTPError, match=why):
            h.validate(*args, CFG.vocab_size)
    short = Handoff.from_dict(record(pools={"full": [0, 7], "swa": [4, 8]}))
    with pytest.raises(HTTPError, match="every whole page"):
        short.validate("m", PS, W, PROMPT, CFG.vocab_size)
    with pytest.raises(HTTPError, match="vocabulary"):
        Handoff.from_dict(record(first_token=CFG.vocab_size)).validate("m", PS, W, PROMPT, CFG.vocab_size)


def test_pd_bodies_and_roles():
    assert parse_pd_body({"path": "/v1/completions", "request": {"prompt": "x"}}, False)[2] is None
    with pytest.raises(HTTPError, match="path"):
        parse_pd_body({"request": {}}, False)
    assert Role.MIXED.serves_prefill() and Role.MIXED.serves_decode()
    assert not Role.PREFILL.serves_decode() and not Role.DECODE.serves_prefill()


class Page:
    def __init__(self, in_l3=True, queued=False, swa=None):
        self.in_l3, self.l3_queued, self.swa = in_l3, queued, swa


class Host:
    def __init__(self, pages):
        self.pages = pages

    def get(self, k):
        return self.pages.get(k)


def test_the_stored_prefix_counts_leading_pages_in_l3_with_their_tail_swa():
    keys = list("abcd")
    done = {k: Page(swa=1 if k in "cd" else None) for k in keys}
    assert stored_prefix(Host(done), keys, swa_lo=2) == (4, False)
    assert stored_prefix(Host({**done, "b": Page(in_l3=False, queued=True)}), keys, 2) == (1, True)
    assert stored_prefix(Host({**done, "d": Page(swa=None)}), keys, 2) == (3, False)  # tail SWA missing
    assert stored_prefix(Host({k: v for k, v in done.items() if k != "a"}), keys, 2) == (0, False)
