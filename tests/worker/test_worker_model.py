"""The hybrid SWA model: paged forward == dense reference, window semantics, weights I/O."""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.common.attention import AttentionKind
from gcache.serving.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from gcache.worker import backend
from gcache.worker.config import ModelConfig
from gcache.worker.kvcache.kv_pool import DualKVCache, RequestKV
from gcache.worker.model import weights as wmod
from gcache.worker.model.transformer import Model

SEQ = 160  # > W = 128, so the window matters in SWA layers
# A small hybrid model (layer 6 full, 0-5 SWA) with W = 32 for the quicker tests.
TINY = ModelConfig(
    layers=7,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    vocab_size=512,
    window=32,
    page_size=8,
    dtype="float64",
)


def scattered_cache(cfg: ModelConfig, pages: int, seed: int) -> DualKVCache:
    """A cache whose free lists are shuffled, so a request's pages land all over the pool."""
    kv = DualKVCache(cfg, pages, pages, xp=np)
    rng = np.random.default_rng(seed)
    for pool in (kv.full, kv.swa):
        got = pool.alloc(pool.num_pages)
        pool.free(list(rng.permutation(got)))
    return kv


def run_paged(model, kv, tokens, rng, decode_steps=0, poison=True):
    """Prefill `tokens` in random chunks, then greedy decode; return (logits of every position, seq)."""
    cfg = model.config
    req = RequestKV(cfg.page_size, cfg.window)
    out, seq, i = [], list(tokens), 0
    while i < len(seq):
        n = min(int(rng.integers(1, 90)), len(seq) - i)
        assert req.grow(kv, i + n)
        out.append(model.forward(seq[i : i + n], np.arange(i, i + n), req, kv, all_logits=True))
        i += n
        freed = [req.swa_pages[j] for j in req.swa_out_of_window()]
        req.free_swa_out_of_window(kv)
        if poison and freed:  # a read of a freed SWA page would now turn the logits into NaN
            kv.k_swa[:, freed] = np.nan
            kv.v_swa[:, freed] = np.nan
    for _ in range(decode_steps):
        seq.append(int(np.argmax(out[-1][-1])))
        assert req.grow(kv, len(seq))
        out.append(model.forward(seq[-1:], [len(seq) - 1], req, kv, all_logits=True))
        req.free_swa_out_of_window(kv)
    full, swa = req.held_pages()
    assert full == req.pages_for(len(seq))
    assert swa == len(req.swa_window_pages(len(seq)))
    return np.concatenate(out), seq


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-9), ("float32", 1e-4)])
def test_paged_forward_equals_reference(dtype, tol):
    cfg = ModelConfig(dtype=dtype)
    model = Model(cfg, xp=np)
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, cfg.vocab_size, SEQ).tolist()
    kv = scattered_cache(cfg, 64, seed=3)
    paged, seq = run_paged(model, kv, prompt, rng, decode_steps=8)
    ref = model.reference_logits(seq)
    assert paged.dtype == np.dtype(dtype)
    assert paged.shape == (len(seq), cfg.vocab_size)
    np.testing.assert_allclose(paged, ref, rtol=0, atol=tol)
    kv.check_integrity()


def test_paged_forward_tiny_model_many_windows():
    """Context of 5 windows, chunks up to 90 tokens (longer than W): still exact."""
    model = Model(TINY, xp=np)
    rng = np.random.default_rng(17)
    paged, seq = run_paged(
        model, scattered_cache(TINY, 40, seed=4), rng.integers(0, 512, 160).tolist(), rng, decode_steps=6
    )
    np.testing.assert_allclose(paged, model.reference_logits(seq), rtol=0, atol=1e-9)


def test_float32_tracks_float64_reference():
    toks = np.random.default_rng(1).integers(0, 4096, 48)
    l64 = Model(ModelConfig(dtype="float64"), xp=np).reference_logits(toks)
    l32 = Model(ModelConfig(dtype="float32"), xp=np).reference_logits(toks)
    np.testing.assert_allclose(l32, l64, rtol=0, atol=1e-3)
    assert np.abs(l64).max() > 1.0  # logits are not trivially tiny


def test_resume_from_shared_prefix_with_only_window_swa():
    """A second request reuses another's pages (as from the prefix tree): full KV for all of the
    prefix, SWA KV only for its last W tokens; its logits equal the reference."""
    cfg = TINY
    model = Model(cfg, xp=np)
    rng = np.random.default_rng(11)
    kv = scattered_cache(cfg, 40, seed=5)
    seq = rng.integers(0, cfg.vocab_size, 130).tolist()
    prefix = 96
    owner = RequestKV(cfg.page_size, cfg.window)
    assert owner.grow(kv, prefix)
    model.forward(seq[:prefix], None, owner, kv)
    owner.free_swa_out_of_window(kv)
    swa = [p if i in owner.swa_window_pages(prefix) else None for i, p in enumerate(owner.swa_pages)]
    req = RequestKV.from_prefix(cfg.page_size, cfg.window, prefix, owner.full_pages, swa)
    assert req.grow(kv, len(seq))
    got = model.forward(seq[prefix:], None, req, kv, all_logits=True)
    np.testing.assert_allclose(got, model.reference_logits(seq)[prefix:], rtol=0, atol=1e-9)
    assert req.swa_out_of_window(len(seq)) == list(range(prefix // 8, (len(seq) - 32) // 8))


def _last_logits(model, toks):
    return model.reference_logits(toks)[-1]


@pytest.mark.parametrize("layers,window", [(1, 128), (3, 16)])
def test_swa_receptive_field_is_exact(layers, window):
    """All-SWA model: a token at distance d from the last position changes its logits iff
    d <= layers * (W - 1) (each SWA layer reaches back W - 1 positions)."""
    cfg = ModelConfig(layers=layers, window=window, layer_pattern=(AttentionKind.SWA,) * layers, dtype="float64")
    model = Model(cfg, xp=np)
    n = layers * (window - 1) + 40
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, n)
    base = _last_logits(model, toks)
    reach = layers * (window - 1)
    for d, changes in ((reach + 1, False), (reach + 7, False), (reach, True), (1, True)):
        other = toks.copy()
        other[n - 1 - d] = (other[n - 1 - d] + 1) % cfg.vocab_size
        same = np.array_equal(_last_logits(model, other), base)
        assert same != changes, f"distance {d}"


def test_full_layers_see_tokens_outside_the_window():
    cfg = TINY
    model = Model(cfg, xp=np)
    toks = np.random.default_rng(4).integers(0, cfg.vocab_size, 7 * 31 + 10)  # beyond the SWA reach
    other = toks.copy()
    other[0] += 1
    assert not np.allclose(_last_logits(model, toks), _last_logits(model, other))


def test_all_swa_paged_ignores_out_of_window_pages():
    """The paged path of a 1-layer all-SWA model: out-of-window SWA pages are poisoned with
    NaN by run_paged, and a changed old token leaves the last logits bit-identical."""
    cfg = dataclasses.replace(TINY, layers=1, layer_pattern=(AttentionKind.SWA,))
    model = Model(cfg, xp=np)
    toks = np.random.default_rng(9).integers(0, cfg.vocab_size, 100).tolist()
    other = list(toks)
    other[10] = (other[10] + 5) % cfg.vocab_size
    a, _ = run_paged(model, scattered_cache(cfg, 40, 1), toks, np.random.default_rng(0))
    b, _ = run_paged(model, scattered_cache(cfg, 40, 2), other, np.random.default_rng(0))
    assert np.isfinite(a).all()
    assert np.array_equal(a[-1], b[-1])
    assert not np.array_equal(a[10], b[10])


def test_forward_batch_equals_single_forwards():
    cfg = TINY
    model = Model(cfg, xp=np)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (70, 20, 1)]
    kv = scattered_cache(cfg, 40, seed=8)
    reqs = [RequestKV(cfg.page_size, cfg.window) for _ in seqs]
    for r, s in zip(reqs, seqs):
        assert r.grow(kv, len(s))
    batch = model.forward_batch([(s, None, r) for s, r in zip(seqs, reqs)], kv)
    assert [r.num_tokens for r in reqs] == [len(s) for s in seqs]
    for s, got in zip(seqs, batch):
        assert got.shape == (1, cfg.vocab_size)
        np.testing.assert_allclose(got[0], model.reference_logits(s)[-1], rtol=0, atol=1e-9)


def test_forward_rejects_bad_input_and_changes_nothing():
    cfg = ModelConfig()
    model = Model(cfg, xp=np)
    kv = DualKVCache(cfg, 8, 8, xp=np)
    req = RequestKV(cfg.page_size, cfg.window)
    with pytest.raises(ValueError, match="grow"):
        model.forward([1, 2, 3], None, req, kv)
    assert req.grow(kv, 20)
    with pytest.raises(ValueError, match="positions"):
        model.forward([1, 2, 3], [1, 2, 3], req, kv)
    with pytest.raises(ValueError, match="token ids"):
        model.forward([1, cfg.vocab_size], None, req, kv)
    with pytest.raises(ValueError, match="1-D"):
        model.forward([], None, req, kv)
    with pytest.raises(ValueError, match="twice"):
        model.forward_batch([([1], None, req), ([2], None, req)], kv)
    with pytest.raises(ValueError, match="layer pattern"):
        model.forward([1], None, req, DualKVCache(cfg.all_full(), 8, 8, xp=np))
    assert req.num_tokens == 0
    assert not kv.k_full.any() and not kv.k_swa.any()
    req.swa_pages[0] = None  # a freed SWA page that the next chunk still needs
    with pytest.raises(ValueError, match="not all live"):
        model.forward([1], None, req, kv)


# ---- weights ------------------------------------------------------------------------
SMALL = ModelConfig(
    layers=3,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=96,
    vocab_size=300,
    window=16,
    page_size=4,
    seed=42,
)


def test_seeded_weights_are_deterministic():
    a, b = wmod.init_weights(SMALL), wmod.init_weights(SMALL)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    c = wmod.init_weights(dataclasses.replace(SMALL, seed=43))
    assert not np.array_equal(a["embed.weight"], c["embed.weight"])


@pytest.mark.parametrize("ext", ["npz", "safetensors"])
def test_weights_round_trip_gives_identical_logits(tmp_path, ext):
    w = wmod.init_weights(SMALL)
    path = tmp_path / f"m.{ext}"
    (wmod.save_npz if ext == "npz" else wmod.save_safetensors)(path, SMALL, w)
    cfg, loaded = wmod.load(path)
    assert cfg == SMALL
    toks = np.arange(50) % SMALL.vocab_size
    before = Model(SMALL, w, xp=np).reference_logits(toks)
    assert np.array_equal(Model(cfg, loaded, xp=np).reference_logits(toks), before)


def test_safetensors_header_layout(tmp_path):
    path = tmp_path / "m.safetensors"
    wmod.save_safetensors(path, SMALL, wmod.init_weights(SMALL))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0
    assert ModelConfig.from_json(header["__metadata__"]["gcache_config"]) == SMALL
    e = header["embed.weight"]
    assert e["dtype"] == "F32" and e["shape"] == [300, 64] and e["data_offsets"][0] == 0
    assert len(raw) == 8 + n + max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")


def _write_st(path, tensors: dict[str, tuple[str, list[int], bytes]], meta=None):
    header, blob = {}, b""
    for name, entry in tensors.items():
        if isinstance(entry, dict):  # a raw (possibly malformed) header entry
            header[name] = entry
            continue
        dt, shape, data = entry
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [len(blob), len(blob) + len(data)]}
        blob += data
    if meta is not None:
        header["__metadata__"] = meta
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob)


def test_safetensors_reads_f16_and_bf16(tmp_path):
    vals = np.array([1.5, -2.0, 0.25], dtype=np.float32)
    bf16 = (vals.view(np.uint32) >> 16).astype("<u2").tobytes()
    _write_st(
        tmp_path / "x.safetensors", {"a": ("F16", [3], vals.astype("<f2").tobytes()), "b": ("BF16", [1, 3], bf16)}
    )
    t, meta = wmod.read_safetensors(tmp_path / "x.safetensors")
    assert meta == {}
    assert np.array_equal(t["a"], vals.astype(np.float16)) and np.array_equal(t["b"][0], vals)


@pytest.mark.parametrize(
    "bad,msg",
    [
        ({"a": ("F32", [4], b"\0" * 12)}, "byte length"),
        ({"a": ("I8", [4], b"\0" * 4)}, "unsupported dtype"),
        ({"a": ("F32", [1], b"\0" * 4), "b": {"dtype": "F32"}}, "malformed header entry"),
    ],
)
def test_safetensors_rejects_malformed_files(tmp_path, bad, msg):
    _write_st(tmp_path / "bad.safetensors", bad)
    with pytest.raises(ValueError, match=msg):
        wmod.read_safetensors(tmp_path / "bad.safetensors")


def test_safetensors_rejects_truncated_and_overlapping(tmp_path):
    p = tmp_path / "t.safetensors"
    p.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        wmod.read_safetensors(p)
    raw = json.dumps(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        }
    ).encode()
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 12)
    with pytest.raises(ValueError, match="overlap"):
        wmod.read_safetensors(p)


def test_weights_layout_mismatch_is_a_clear_error(tmp_path):
    w = wmod.init_weights(SMALL)
    w["layers.0.attn.wq"] = w["layers.0.attn.wq"][:, :8]
    with pytest.raises(ValueError, match="layers.0.attn.wq has shape"):
        Model(SMALL, w, xp=np)
    del w["lm_head.weight"]
    with pytest.raises(ValueError, match="missing"):
        wmod.save_npz(tmp_path / "x.npz", SMALL, w)
    assert not (tmp_path / "x.npz").exists()
    np.savez(tmp_path / "plain.npz", a=np.zeros(2))
    with pytest.raises(ValueError, match="gcache_config"):
        wmod.load_npz(tmp_path / "plain.npz")


# ---- config and tokenizer ---------------------------------------------------------------
def test_config_layouts():
    cfg = ModelConfig()
    assert cfg.full_layers == (6, 13) and len(cfg.swa_layers) == 12
    big = ModelConfig.large()
    assert len(big.full_layers) == 10 and len(big.swa_layers) == 60
    assert cfg.all_full().swa_layers == () and cfg.all_full().hidden == cfg.hidden
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="layer_pattern"):
        ModelConfig(layers=2, layer_pattern=(AttentionKind.FULL,))
    with pytest.raises(ValueError, match="kv_heads"):
        ModelConfig(heads=6, kv_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(dtype="float16")


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == BOS_ID and all(0 <= i < 256 for i in ids[1:])
    assert tok.decode(ids) == text
    assert tok.decode(ids + [EOS_ID]) == text


def test_tokenizer_specials_and_range():
    tok = ByteTokenizer(4096)
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode([BOS_ID, 104, EOS_ID], skip_special=False) == "<|bos|>h<|eos|>"
    assert tok.decode([256 + 3 + 0x41 - 3 + 256]) == tok.decode([0x41 + 512])  # folded ids are bytes
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([4096])


CUPY = backend._cupy_with_device()


@pytest.mark.skipif(CUPY is None, reason="needs cupy and a CUDA device")
def test_cupy_backend_matches_numpy():
    cfg = TINY
    rng = np.random.default_rng(21)
    toks = rng.integers(0, cfg.vocab_size, 90).tolist()
    gpu, cpu = Model(cfg, xp=CUPY), Model(cfg, xp=np)
    kv = DualKVCache(cfg, 20, 20, xp=CUPY)
    req = RequestKV(cfg.page_size, cfg.window)
    got = []
    for lo in range(0, 90, 25):
        hi = min(90, lo + 25)
        assert req.grow(kv, hi)
        got.append(backend.to_numpy(gpu.forward(toks[lo:hi], None, req, kv, all_logits=True)))
        req.free_swa_out_of_window(kv)
    np.testing.assert_allclose(np.concatenate(got), cpu.reference_logits(toks), rtol=0, atol=1e-9)
    with pytest.raises(ValueError, match="backend"):
        cpu.forward(toks[:1], None, RequestKV(cfg.page_size, cfg.window), kv)
