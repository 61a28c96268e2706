"""The router in front of vLLM servers and a mix with gcache-workers, no processes: the view
is filled directly (what RedisSync would read), static workers, no Redis.

  * each worker is matched under its own tokenizer (a gcache-worker by bytes, a vLLM server
    by its model's), and only serves its own model names; a body the byte tokenizer refused
    never goes to a gcache-worker
  * --length-buckets: a prompt goes to its length group only
  * image affinity: the first image's content hash picks a home by rendezvous hashing, that
    every router agrees on; load and a real text match still win
"""

from __future__ import annotations

import pytest

from gcache.router.config import RouterConfig, parse_length_buckets, parse_tokenizer_arg
from gcache.router.core import RouterCore, RouteRequest
from gcache.router.policies import Candidate, Prompt, image_home_of
from gcache.router.state import WorkerView
from gcache.serving.announce.engines import EngineInfo, parse_info, with_info
from gcache.serving.redis_layout import L1_FULL, L1_SWA, Registration, WorkerLoad, page_ids

A, B, C = "http://127.0.0.1:9101", "http://127.0.0.1:9102", "http://127.0.0.1:9103"
VLLM_PS = 32


def reg(url, page_size=16, window=1, running=0, model="m") -> Registration:
    return Registration(url, model, page_size, window, "e", 0, 0, WorkerLoad(running=running))


def core(workers, views: dict, **kw) -> RouterCore:
    c = RouterCore(RouterConfig(workers=tuple(workers), refresh_interval_s=0, **kw))
    for url, (r, info, flags) in views.items():
        c.view.workers[url] = WorkerView(url, reg=r, flags=flags, info=info)
    return c


def held(tokens, ps) -> dict:
    return {pid: L1_FULL | L1_SWA for pid in page_ids(tokens, ps)}


VLLM = EngineInfo("vllm", ("m",))


def test_each_worker_is_matched_under_its_own_tokenizer():
    byte_prompt = list(range(3, 200))
    hf_prompt = [7] * 40 + list(range(500, 700))
    c = core(
        [A, B],
        {
            A: (reg(A), EngineInfo(), held(byte_prompt[:160], 16)),
            B: (reg(B, VLLM_PS), VLLM, held(hf_prompt[:224], VLLM_PS)),
        },
        tokenizers=(("", "/models/m"),),
    )
    assert c.tokenizer_key(A, EngineInfo()) == "" and c.tokenizer_key(B, VLLM) == "hf:"
    both = RouteRequest({"": byte_prompt, "hf:": hf_prompt}, "m")
    seen = c.explain(both)
    assert seen[A]["l1"] == 160 and seen[B]["l1"] == 224
    assert c.pick(both) == B  # 224 of its 240 tokens beats 160 of A's 197: each under its own tokenizer
    other = RouteRequest({"": byte_prompt, "hf:": [9] * 240}, "m")  # B has nothing of this one
    assert c.pick(other) == A


def test_models_a_refused_body_and_an_unknown_model():
    c = core(
        [A, B, C],
        {
            A: (reg(A), EngineInfo(), {}),
            B: (reg(B, VLLM_PS, model="m1"), EngineInfo("vllm", ("m1",)), {}),
            C: (reg(C, VLLM_PS, model="m2"), EngineInfo("vllm", ("m2", "m2-alias")), {}),
        },
        tokenizers=(("", "/models/m"),),
    )
    toks = list(range(3, 100))
    both = lambda model: RouteRequest({"": toks, "hf:": toks}, model)  # noqa: E731
    assert set(c.explain(both("m2-alias"))) == {C}  # only the workers registered under the name
    assert set(c.explain(both(None))) == {A, B, C}  # no name: the servers' default models
    assert set(c.explain(both("m"))) == {A}  # the gcache-worker's registered name
    assert set(c.explain(both("anything"))) == {A}  # a name nobody registered: gcache-workers take any
    assert set(c.explain(RouteRequest({"hf:": toks}, None))) == {B, C}  # the byte parse refused it: not A
    assert c.model_served("anything")
    assert c.tokenizer_keys("m1") == {"hf:"} and c.tokenizer_keys(None) == {"", "hf:"}
    only_vllm = core(
        [B, C], {B: (reg(B), EngineInfo("vllm", ("m1",)), {}), C: (reg(C), EngineInfo("vllm", ("m2",)), {})}
    )
    assert not only_vllm.model_served("nope") and only_vllm.model_served("m2") and only_vllm.model_served(None)
    assert only_vllm.pick(RouteRequest({"": toks}, "nope")) is None


def test_tokenizer_per_model_and_unregistered_servers_take_the_default():
    c = core(
        [A, B],
        {B: (reg(B), EngineInfo("vllm", ("big",)), {})},
        tokenizers=(("", "/models/small"), ("big", "/models/big")),
    )
    assert c.tokenizer_key(B, EngineInfo("vllm", ("big",))) == "hf:big"
    assert c.tokenizer_key(A, EngineInfo()) == "hf:"  # static, nothing registered: the default tokenizer
    plain = core([A], {A: (reg(A), EngineInfo(), {})}, tokenizers=(("", "/models/small"),))
    assert plain.tokenizer_key(A, EngineInfo()) == ""  # a registered gcache-worker keeps its bytes


def test_an_untokenizable_request_still_routes_by_load():
    c = core([B, C], {B: (reg(B, running=5), VLLM, {}), C: (reg(C, running=0), VLLM, {})})
    assert c.tokenizer_key(B, VLLM) == "hf:"  # no --tokenizer: the server routes it with no tokens
    req = RouteRequest({"hf:": []}, "m")  # the template could not render it
    assert c.pick(req) == C


@pytest.mark.parametrize(
    "text,bounds",
    [("64K,256K", (65536, 262144)), ("0-64K,64K-256K,256K-1M", (65536, 262144)), ("100", (100,)), ("", ())],
)
def test_length_bucket_flags(text, bounds):
    assert parse_length_buckets(text) == bounds


def test_bad_length_buckets_and_tokenizer_flags_are_refused():
    with pytest.raises(ValueError):
        RouterConfig(workers=(A,), length_buckets=(200, 100))
    with pytest.raises(ValueError):
        parse_length_buckets("lots")
    with pytest.raises(ValueError):
        RouterConfig(workers=(A,), tokenizers=(("", "/a"), ("", "/b")))
    assert parse_tokenizer_arg("m=/x") == ("m", "/x") and parse_tokenizer_arg("/x") == ("", "/x")


def test_length_buckets_keep_long_and_short_prompts_apart():
    urls = [A, B, C]
    c = core(urls, {u: (reg(u), EngineInfo(), {}) for u in urls}, length_buckets=(100, 1000))
    short, mid, long = [5] * 50, [5] * 500, [5] * 5000
    assert set(c.explain(short)) == {A} and set(c.explain(mid)) == {B} and set(c.explain(long)) == {C}
    # a named group wins over the spread; an empty group borrows the nearest (longer first)
    named = core(
        urls,
        {
            A: (reg(A), EngineInfo("vllm", ("m",), bucket=2), {}),
            B: (reg(B), EngineInfo(), {}),
            C: (reg(C), EngineInfo(), {}),
        },
        length_buckets=(100, 1000),
    )
    assert set(named.explain(RouteRequest({"": long, "hf:": long}))) == {A}
    assert set(named.explain(short)) == {B}  # B, C spread over 0..2 by their place among the unnamed
    assert named.pick(mid) in (B, C)
    # the affinity still applies within a group
    g0 = EngineInfo(bucket=0)
    two = core(
        [A, B, C],
        {A: (reg(A), g0, {}), B: (reg(B), g0, held([5] * 48, 16)), C: (reg(C), EngineInfo(bucket=1), {})},
        length_buckets=(10_000,),
    )
    assert set(two.explain(short)) == {A, B} and two.pick(short) == B


def test_image_affinity_is_consistent_and_yields_to_a_text_match_and_to_load():
    urls = [A, B, C]
    cands = [Candidate(u, 0) for u in urls]
    homes = {}
    for i in range(60):
        img = bytes([i]) * 32
        p = Prompt(10, lambda ps: [], {}, 16, image=img)
        homes[img] = image_home_of(p, cands)
        assert image_home_of(p, list(reversed(cands))) == homes[img]  # order-free: every router agrees
    assert set(homes.values()) == set(urls)  # spread over the workers
    moved = sum(image_home_of(Prompt(10, lambda ps: [], {}, 16, image=i), cands[:2]) != h for i, h in homes.items())
    assert moved == sum(h == C for h in homes.values())  # C leaving moves only C's images

    img = next(i for i, h in homes.items() if h == C)
    c = core(urls, {u: (reg(u), EngineInfo(), {}) for u in urls})
    text = list(range(3, 99))
    assert c.pick(RouteRequest({"": text}, image=img)) == C
    warm = core(
        urls, {A: (reg(A), EngineInfo(), held(text, 16)), B: (reg(B), EngineInfo(), {}), C: (reg(C), EngineInfo(), {})}
    )
    assert warm.pick(RouteRequest({"": text}, image=img)) == A  # 96 of 96 tokens cached beats the image bonus
    busy = core(
        urls, {A: (reg(A), EngineInfo(), {}), B: (reg(B), EngineInfo(), {}), C: (reg(C, running=40), EngineInfo(), {})}
    )
    assert busy.pick(RouteRequest({"": text}, image=img)) != C  # the imbalance guard: load says otherwise
    off = core(urls, {u: (reg(u), EngineInfo(), {}) for u in urls}, image_weight=0.0)
    assert off.explain(RouteRequest({"": text}, image=img))[C]["score"] == 0.0  # no bonus


def test_engine_info_round_trips_and_never_trusts_its_input():
    r = reg(A).to_json()
    info = EngineInfo("vllm", ("a", "b"), 2, True)
    assert parse_info(with_info(r, info)) == info
    assert Registration.from_json(with_info(r, info)).url == A  # the layout's parser ignores it
    assert parse_info(r) == EngineInfo()
    for bad in (b"[]", b"{", b'{"engine": 5}', b'{"engine": {"kind": "sglang"}}'):
        assert parse_info(bad) == EngineInfo()
    odd = parse_info(b'{"engine": {"kind": "vllm", "models": ["ok", 5, ""], "bucket": -1, "l3": "yes"}}')
    assert odd == EngineInfo("vllm", ("ok",), None, False)


def test_the_shared_l3_counts_only_for_servers_that_can_load_it():
    from gcache.serving.redis_layout import L3_FULL, L3_SWA

    prompt = list(range(3, 200))
    c = core(
        [A, B, C],
        {
            A: (reg(A, VLLM_PS), EngineInfo("vllm", ("m",)), {}),
            B: (reg(B, VLLM_PS), EngineInfo("vllm", ("m",), l3=True), {}),
            C: (reg(C, VLLM_PS), EngineInfo("vllm", ("m",)), {}),
        },
        tokenizers=(("", "/models/m"),),
    )
    with c.view.lock:
        for pid in page_ids(prompt, VLLM_PS):
            c.view.l3[pid] = L3_FULL | L3_SWA
    seen = c.explain(RouteRequest({"hf:": prompt}, "m"))
    assert seen[B]["l3"] == 192 and seen[A]["l3"] == 0 == seen[C]["l3"]
    assert c.pick(RouteRequest({"hf:": prompt}, "m")) == B  # tier-aware: an L3 hit only where it loads
