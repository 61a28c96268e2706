"""GCacheEmbeddingStore as the store of SGLang 0.5.23's global multimodal embedding cache,
through SGLang's own EmbeddingStoreFactory and EmbeddingCacheController, against real
gcache-server processes.

The controller is SGLang's class, driven the way its encoder server drives it (batch_is_exist,
prefetch, check_prefetch_progress, get_pool_views; insert_batch after a ViT forward). Two
things a CPU-only machine lacks are stood in for (gcache/testing/sglang_embedding.py):
pinned pools (SGLang's _create_pools is asked for unpinned ones) and the CUDA copy of a ViT
output into the pool (stage_into_pool does store_to_pool_async + wait_store_to_pool's work with
SGLang's own page-run copy). Item hashes are SGLang's hash_feature of the preprocessed tensor.
Every check is an outcome (bytes, hits, counters), never a time.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time

import numpy as np
import pytest
import torch

import gcache
from gcache.integrations.sglang.embedding_values import HEADER_BYTES, SEGMENT_BYTES, Header
from gcache.testing.sglang_embedding import (
    load_controller_module,
    make_controller,
    pool_embedding,
    sglang_item_hash,
    stage_into_pool,
)
from tests.support.raw_shm import LOOKUP, RawShm

MODEL = "llava-tiny"
WAIT_S = 60.0  # an outcome's deadline on a loaded machine, never a measured time
CONFIG_ENV = "GCACHE_SGLANG_EMBEDDING_CONFIG"


@pytest.fixture(scope="module")
def emb():
    """(EmbeddingStoreFactory, Modality, the store class) with "gcache" registered."""
    load_controller_module()
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
    from sglang.srt.multimodal.modality import Modality

    from gcache.integrations.sglang.embedding_store import GCacheEmbeddingStore, register

    register()
    return EmbeddingStoreFactory, Modality, GCacheEmbeddingStore


@pytest.fixture
def make_store(emb, monkeypatch):
    """make_store(address, **settings): SGLang's factory builds the store the way the encoder
    server does (create_backend(name), no arguments: the settings come from the environment)."""
    factory = emb[0]
    made = []

    def make(address, **settings):
        config = {"gcache_url": address, "gcache_model": MODEL, **settings}
        monkeypatch.setenv(CONFIG_ENV, json.dumps(config))
        store = factory.create_backend("gcache")
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.fixture
def controllers():
    """controller(store, dim, dtype, pool_mib=4, audio_dim=None): SGLang's controller; stopped at teardown."""
    made = []

    def make(store, dim, dtype=torch.float32, pool_mib=4.0, audio_dim=None):
        controller = make_controller(store, image_dim=dim, dtype=dtype, pool_mib=pool_mib, audio_dim=audio_dim)
        made.append(controller)
        return controller

    yield make
    for controller in made:
        controller.stop()


def rows(n, dim, dtype, seed):
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.view(torch.uint8).numpy()) == bytes(b.contiguous().view(torch.uint8).numpy())
    )


def put_through(controller, hashes, tensors, modality) -> None:
    """An encoder's misses, after its ViT forward: staged into the pool, then insert_batch (one
    batch PUT on the controller's io thread), waited for."""
    assert stage_into_pool(controller, hashes, tensors, modality) == list(hashes)
    controller.insert_batch(list(hashes), modality)
    controller.insert_queue.join()


def fetch_through(controller, req_id, hashes, tokens, modality) -> list:
    """What the encoder server does for a request: batch_is_exist, prefetch the hits, wait for
    check_prefetch_progress, read each hit from the pool (get_pool_views). None per miss."""
    exist = asyncio.run(controller.batch_is_exist(list(hashes)))
    hits = [h for h, e in zip(hashes, exist) if e]
    if hits:
        controller.prefetch(req_id, hits, [tokens[hashes.index(h)] for h in hits], modality)
        deadline = time.monotonic() + WAIT_S
        while not controller.check_prefetch_progress(req_id):
            assert time.monotonic() < deadline, "the prefetch never finished"
            time.sleep(0.005)
    return [pool_embedding(controller, h) if e else None for h, e in zip(hashes, exist)]


# -- the factory and the CLI ----------------------------------------------------------------


def test_the_factory_builds_the_store_from_the_environment(emb, server, make_store):
    factory, _, cls = emb
    from sglang.srt.mem_cache.embedding_store import EmbeddingStore

    store = make_store(server.address, gcache_namespace="tenant-a", gcache_timeout_s=3)
    assert type(store) is cls and isinstance(store, EmbeddingStore)
    assert (store.settings.url, store.settings.namespace, store.settings.timeout_s) == (server.address, "tenant-a", 3)
    assert store.settings.verify_checksums is True
    assert factory._registry["gcache"]["module_path"] == "gcache.integrations.sglang.embedding_store"
    with pytest.raises(ValueError, match="Registered backends: \\['mooncake', 'gcache'"):
        factory.create_backend("gcache2")


def test_settings_problems_are_clear_errors_at_start(emb, server, monkeypatch):
    factory = emb[0]
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"gcache_url": server.address}))
    with pytest.raises(ValueError, match="needs a model identity: set gcache_model"):
        factory.create_backend("gcache")
    monkeypatch.setenv(CONFIG_ENV, json.dumps({"gcache_url": server.address, "gcache_model": "m", "gcache_modle": 1}))
    with pytest.raises(ValueError, match="unknown GCACHE_SGLANG_EMBEDDING_CONFIG key\\(s\\) \\['gcache_modle'\\]"):
        factory.create_backend("gcache")
    monkeypatch.setenv(CONFIG_ENV, "{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        factory.create_backend("gcache")
    import socket

    with socket.socket() as held:  # bound, not listening: refused
        held.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{held.getsockname()[1]}"
        monkeypatch.setenv(CONFIG_ENV, json.dumps({"gcache_url": address, "gcache_model": "m"}))
        with pytest.raises(ConnectionError, match=f"cannot reach the store at {address}"):
            factory.create_backend("gcache")


def test_sglang_cli_accepts_gcache_once_registered(emb):
    # SGLang's --mm-global-cache-backend has argparse choices ["mooncake"]; register() adds
    # "gcache" to every parser ServerArgs builds.
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    (action,) = [a for a in parser._actions if "--mm-global-cache-backend" in a.option_strings]
    assert action.choices == ["mooncake", "gcache"]
    args = parser.parse_args(
        ["--model-path", "m", "--encoder-only", "--enable-mm-global-cache", "--mm-global-cache-backend", "gcache"]
    )
    server_args = ServerArgs.from_cli_args(args)
    assert (server_args.enable_mm_global_cache, server_args.mm_global_cache_backend) == (True, "gcache")


# -- round trips through SGLang's controller --------------------------------------------------


@pytest.mark.parametrize(
    "dtype, dim, tokens",
    [
        (torch.float32, 256, 300),  # 2 of the controller's pages (256 rows each), the last partial
        (torch.bfloat16, 384, 170),
        (torch.float16, 128, 1000),
        (torch.float8_e4m3fn, 512, 77),
    ],
)
def test_controller_round_trip_is_byte_exact(dtype, dim, tokens, emb, server, make_store, controllers):
    _, modality, _ = emb
    writer = controllers(make_store(server.address), dim, dtype)
    embeddings = [rows(tokens, dim, dtype, seed=s) for s in (1, 2)]
    hashes = ["1111", "2222"]
    put_through(writer, hashes, embeddings, modality.IMAGE)
    assert writer.embedding_store.counters()["items_written"] == 2

    # What the store holds: a header naming dtype and shape, then the rows, under the documented keys.
    name = str(dtype).removeprefix("torch.")
    base = f"emb1.1111.{name}x{dim}_{MODEL}"
    with gcache.Client(server.address) as raw:
        header, data = raw.get_batch([f"{base}.h", f"{base}.d0"])
    assert Header.unpack(header).rows == tokens and Header.unpack(header).dtype == name
    assert data == bytes(embeddings[0].view(torch.uint8).numpy())

    # A fresh encoder (its own pool, its own client) reads them back.
    store = make_store(server.address)
    reader = controllers(store, dim, dtype)
    got = fetch_through(reader, "req-1", hashes + ["3333"], [tokens] * 3, modality.IMAGE)
    assert got[2] is None
    assert same_bytes(got[0], embeddings[0]) and same_bytes(got[1], embeddings[1])
    counts = store.counters()
    assert (counts["items_read"], counts["bytes_staged"]) == (2, 0)  # zero copy: straight into the pages


def test_vision_and_audio_pools_of_different_widths(emb, server, make_store, controllers):
    _, modality, _ = emb
    writer = controllers(make_store(server.address), 256, audio_dim=128)
    image, audio = rows(40, 256, torch.float32, 3), rows(50, 128, torch.float32, 4)
    put_through(writer, ["img"], [image], modality.IMAGE)
    put_through(writer, ["aud"], [audio], modality.AUDIO)
    store = make_store(server.address)
    reader = controllers(store, 256, audio_dim=128)
    assert store.layouts() == [("float32", 128), ("float32", 256)]
    # batch_is_exist names no modality: an item of either width is found.
    assert same_bytes(fetch_through(reader, "r", ["img"], [40], modality.IMAGE)[0], image)
    assert same_bytes(fetch_through(reader, "r2", ["aud"], [50], modality.AUDIO)[0], audio)
    # The audio item asked for as an image by another encoder: found (a width of a registered
    # pool), but not in the vision pool's width: the fetch misses, the controller gives the
    # pages back, the encoder runs.
    other = controllers(make_store(server.address), 256, audio_dim=128)
    assert fetch_through(other, "r3", ["aud"], [50], modality.IMAGE) == [None]
    assert "aud" not in other.entries


def test_a_fragmented_pool_reads_through_one_staging_copy(emb, server, make_store, controllers):
    _, modality, _ = emb
    dim = 1024  # float32: 64 rows per controller page (256 KiB)
    writer = controllers(make_store(server.address), dim, pool_mib=5)
    item = rows(400, dim, torch.float32, 5)  # 7 pages
    put_through(writer, ["big"], [item], modality.IMAGE)

    store = make_store(server.address)
    reader = controllers(store, dim, pool_mib=5)  # 16 vision pages
    fill = [rows(256, dim, torch.float32, 10 + i) for i in range(4)]  # 4 pages each: the pool full
    assert stage_into_pool(reader, ["f0", "f1", "f2", "f3"], fill, modality.IMAGE) == ["f0", "f1", "f2", "f3"]
    with reader.lock:  # SGLang's own eviction of two entries: free pages 0-3 and 8-11
        reader._evict_entry("f0")
        reader._evict_entry("f2")
    got = fetch_through(reader, "frag", ["big"], [400], modality.IMAGE)[0]
    runs = reader.entries["big"].page_runs
    assert [(r.start, r.length) for r in runs] == [(0, 4), (8, 3)]
    assert same_bytes(got, item)
    assert store.counters()["bytes_staged"] == item.numel() * 4  # the one value, split over two runs
    assert same_bytes(pool_embedding(reader, "f1"), fill[1]) and same_bytes(pool_embedding(reader, "f3"), fill[3])


# -- the store's calls with SGLang's buffers (what the controller's io thread passes) ----------


def addresses(tensor, row_spans):
    """(addresses, sizes) of these (first row, rows) spans of a 2-D tensor."""
    row = tensor.shape[1] * tensor.element_size()
    return [tensor.data_ptr() + r * row for r, _ in row_spans], [n * row for _, n in row_spans]


def test_multi_buffer_items_in_any_split_and_segments(server_factory, make_store):
    server = server_factory("big", memory="256MiB")
    dim = 4096
    src = rows(2000, dim, torch.float32, 6)  # 16 KiB rows
    dst = torch.zeros(2000, dim, dtype=torch.float32)
    writer, reader = make_store(server.address), make_store(server.address)
    writer.register_buffer(src)
    reader.register_buffer(dst)

    # Item A: rows 0-99 written from three runs, read into two other runs.
    ptrs, sizes = addresses(src, [(0, 30), (500, 50), (60, 20)])
    assert writer.batch_put_from_multi_buffers(["a"], [ptrs], [sizes]) == [True]
    dptrs, dsizes = addresses(dst, [(1000, 70), (10, 30)])
    assert reader.batch_get_into_multi_buffers(["a"], [dptrs], [dsizes]) == [True]
    expected = torch.cat([src[0:30], src[500:550], src[60:80]])
    assert same_bytes(torch.cat([dst[1000:1070], dst[10:40]]), expected)

    # Item B: 1,300 rows (20.3 MiB) is two values (16 MiB segments); read into runs split at
    # row 1,100 (17.2 MiB): the first segment lands in place, the second spans both runs.
    nbytes = 1300 * dim * 4
    assert writer.batch_put(["b"], [src[100].data_ptr()], [nbytes]) == [True]
    with gcache.Client(server.address) as raw:
        keys = writer.item_keys("b", "float32", dim, nbytes)
        assert [k.decode().rsplit(".", 1)[1] for k in keys] == ["h", "d0", "d1"]
        assert [len(v) for v in raw.get_batch(keys)] == [HEADER_BYTES, SEGMENT_BYTES, nbytes - SEGMENT_BYTES]
    staged_before = reader.counters()["bytes_staged"]
    bptrs, bsizes = addresses(dst, [(100, 1100), (1300, 200)])
    assert reader.batch_get_into_multi_buffers(["b"], [bptrs], [bsizes]) == [True]
    assert same_bytes(torch.cat([dst[100:1200], dst[1300:1500]]), src[100:1400])
    assert reader.counters()["bytes_staged"] - staged_before == nbytes - SEGMENT_BYTES

    # Single-buffer calls, existence, and a second put of stored items (skipped by its probe).
    assert reader.batch_is_exist(["a", "b", "c"]) == [True, True, False]
    targets = [dst[1600].data_ptr(), dst[1700].data_ptr()]
    assert reader.batch_get(["a", "c"], targets, [100 * dim * 4] * 2) == [True, False]
    assert same_bytes(dst[1600:1700], expected)
    assert writer.batch_put_from_multi_buffers(["a"], [ptrs], [sizes]) == [True]
    assert writer.counters()["items_skipped_existing"] == 1


def test_bad_arguments_are_misses_never_exceptions(server, make_store):
    store = make_store(server.address)
    held = torch.zeros(100, 64, dtype=torch.float32)
    assert store.batch_is_exist(["x"]) == [False]  # nothing registered: no dtype or width to look for
    assert store.get_key("x") == "emb1.x."
    store.register_buffer(held)
    store.register_buffer(torch.zeros(8))  # 1-D: not registered, logged
    store.register_buffer(held[:, :32])  # not contiguous: not registered
    assert store.layouts() == [("float32", 64)]
    assert store.get_key("x") == f"emb1.x.float32x64_{MODEL}.h"
    outside = torch.zeros(10, 64)
    row = 64 * 4
    assert store.batch_put(["a", "b"], [outside.data_ptr(), held.data_ptr()], [row, row]) == [False, True]
    assert store.batch_put(["c"], [held.data_ptr()], [row + 4]) == [False]  # not whole rows
    assert store.batch_put(["d"], [held.data_ptr() + 99 * row], [2 * row]) == [False]  # past the end
    assert store.batch_get_into_multi_buffers(["a", "b"], [[held.data_ptr()]], [[row]]) == [False, False]
    assert store.batch_get_into_multi_buffers(["b"], [[]], [[]]) == [False]
    assert store.counters()["items_refused"] == 4
    assert store.batch_get(["b"], [held[5].data_ptr()], [row]) == [True]


# -- corruption, foreign headers, a dead store -----------------------------------------------


def flip_byte(unix_socket: str, key: bytes, at: int) -> None:
    """Flips one byte of a stored value in the server's arena: its checksum no longer matches."""
    with RawShm(unix_socket) as raw:
        raw.attach()
        frame = raw.request(LOOKUP, {"keys": [key]})
        assert frame.meta["lens"][0] > at, f"{key!r} is not stored"
        raw.arena[frame.meta["offs"][0] + at] ^= 0xFF
        raw.release(leases=[frame.meta["lease"]], no_reply=False)


@pytest.mark.parametrize("part", ["d0", "h"])
def test_a_corrupted_value_is_a_miss_then_stored_again(part, emb, server_factory, make_store, controllers):
    _, modality, _ = emb
    sock = f"{tempfile.mkdtemp(prefix='gc-emb-')}/node.sock"
    server = server_factory("node", extra_args=["--unix-socket", sock])
    writer = controllers(make_store(server.address), 256)
    item = rows(300, 256, torch.float32, 7)
    put_through(writer, ["42"], [item], modality.IMAGE)
    flip_byte(sock, f"emb1.42.float32x256_{MODEL}.{part}".encode(), at=20)

    store = make_store(server.address)
    reader = controllers(store, 256)
    assert fetch_through(reader, "r1", ["42"], [300], modality.IMAGE) == [None]  # exists, then the read fails
    assert not reader.has_local_embedding("42") and "42" not in reader.entries  # pages given back
    counts = store.counters()
    assert (counts["items_read"], counts["corrupt_values_removed"]) == (0, 1)
    # The bad value was removed, so the next encoder's put stores good bytes instead of finding it "there".
    assert asyncio.run(reader.batch_is_exist(["42"])) == [False]
    put_through(controllers(make_store(server.address), 256), ["42"], [item], modality.IMAGE)
    assert same_bytes(fetch_through(reader, "r2", ["42"], [300], modality.IMAGE)[0], item)


def test_a_header_that_disagrees_is_a_miss(server, make_store):
    store = make_store(server.address)
    pool = torch.zeros(400, 64, dtype=torch.bfloat16)
    store.register_buffer(pool)
    src = rows(300, 64, torch.bfloat16, 8)
    pool[:300] = src
    row = 64 * 2
    assert store.batch_put(["7"], [pool.data_ptr()], [300 * row]) == [True]
    h, d0 = store.item_keys("7", "bfloat16", 64, 300 * row)
    with gcache.Client(server.address) as raw:
        good = Header.unpack(raw.get(h))

    # Another token count under the same SGLang hash: a miss, the stored item left alone.
    assert store.batch_get(["7"], [pool[300].data_ptr()], [100 * row]) == [False]
    assert store.counters()["headers_other_shape"] == 1 and store.batch_is_exist(["7"]) == [True]

    # A header naming another dtype under this key (valid checksum, wrong content): a miss,
    # and the item's values are removed so a good writer can store it again.
    with gcache.Client(server.address) as raw:
        assert raw.batch_remove([h]) == [True]
        wrong = Header("float16", good.rows, good.width, good.payload_bytes, good.segment_bytes, good.digest)
        assert raw.put(h, wrong.pack())
    assert store.batch_get(["7"], [pool[100].data_ptr()], [300 * row]) == [False]
    assert store.counters()["headers_foreign"] == 1
    with gcache.Client(server.address) as raw:
        assert raw.batch_is_exist([h, d0]) == [False, False]
    pool[:300] = src
    assert store.batch_put(["7"], [pool.data_ptr()], [300 * row]) == [True]
    pool[:] = 0
    assert store.batch_get(["7"], [pool[50].data_ptr()], [300 * row]) == [True]
    assert same_bytes(pool[50:350], src)


def test_a_killed_store_costs_misses_only(emb, server_factory, make_store, controllers):
    _, modality, _ = emb
    victim = server_factory("victim")
    store = make_store(victim.address, gcache_suspect_s=0.05)
    encoder = controllers(store, 256)
    item = rows(100, 256, torch.float32, 9)
    put_through(encoder, ["k1"], [item], modality.IMAGE)
    victim.kill()
    assert not victim.alive()

    # Every call answers a miss / False; nothing raises into the controller or its io thread.
    assert asyncio.run(encoder.batch_is_exist(["k1", "k2"])) == [True, False]  # k1: its own pool
    assert fetch_through(encoder, "r", ["k2"], [100], modality.IMAGE) == [None]
    pool = encoder.vision_pool.tensor
    assert store.batch_is_exist(["k1"]) == [False]
    assert store.batch_get(["k1"], [pool.data_ptr()], [100 * 256 * 4]) == [False]
    assert store.batch_put(["k9"], [pool.data_ptr()], [100 * 256 * 4]) == [False]
    encoder.prefetch("r2", ["k3"], [100], modality.IMAGE)  # a hit the store can no longer serve
    deadline = time.monotonic() + WAIT_S
    while not encoder.check_prefetch_progress("r2"):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert not encoder.has_local_embedding("k3") and "k3" not in encoder.entries
    put_through(encoder, ["k4"], [rows(100, 256, torch.float32, 10)], modality.IMAGE)  # PUT fails: kept locally
    assert encoder.has_local_embedding("k4") and encoder.entries["k4"].ref_count == 0
    assert encoder.io_thread.is_alive()
    counts = store.counters()
    assert counts["store_errors"] >= 1 and counts["items_write_failed"] >= 2

    # The store comes back: the next calls reach it again.
    victim.start()
    deadline = time.monotonic() + WAIT_S
    while store.batch_put(["k4"], [pool.data_ptr()], [100 * 256 * 4]) != [True]:
        assert time.monotonic() < deadline, "the store never answered again"
        time.sleep(0.05)
    assert store.batch_is_exist(["k4"]) == [True]


# -- content addressing ------------------------------------------------------------------------


class TinyTower:
    """A seeded patch-embedding "vision tower": (3, H, W) pixels -> (H/8 * W/8, width) rows.
    Counts its forwards (an encoder that finds an item in the cache never runs it)."""

    def __init__(self, width: int, dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(3 * 64, width, generator=gen) / 8
        self.dtype = dtype
        self.forwards = 0

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        patches = pixels.unfold(1, 8, 8).unfold(2, 8, 8).permute(1, 2, 0, 3, 4).reshape(-1, 3 * 64)
        return (patches @ self.weight).to(self.dtype)


def preprocess(path, size=32, mean=0.5) -> torch.Tensor:
    """A processor: decode, resize, scale and normalize (the tensor SGLang hashes)."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB").resize((size, size)), dtype=np.float32) / 255.0
    return torch.from_numpy((pixels - mean) / 0.25).permute(2, 0, 1).contiguous()


def picture(seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (48, 48, 3), dtype=np.uint8))


class Encoder:
    """The encoder server's cache path for one image per request: hash the preprocessed
    tensor, look the item up (batch_is_exist + prefetch), run the tower only on a miss, and
    insert what it computed."""

    def __init__(self, controller, tower, modality):
        self.controller, self.tower, self.modality = controller, tower, modality
        self.requests = 0

    def embed(self, pixels: torch.Tensor):
        self.requests += 1
        mm_hash = sglang_item_hash(pixels)
        tokens = (pixels.shape[1] // 8) * (pixels.shape[2] // 8)
        got = fetch_through(self.controller, f"req-{self.requests}", [mm_hash], [tokens], self.modality)[0]
        if got is not None:
            return got, mm_hash
        out = self.tower(pixels)
        put_through(self.controller, [mm_hash], [out], self.modality)
        return out, mm_hash


def test_content_addressing_holds(emb, server, make_store, controllers, tmp_path):
    _, modality, _ = emb
    width, dtype = 192, torch.bfloat16
    picture(1).save(tmp_path / "cat.png")
    (tmp_path / "mirror").mkdir()
    picture(1).save(tmp_path / "mirror" / "IMG_0001.png")  # the same pixels, another URL / file name
    picture(2).save(tmp_path / "dog.png")

    def encoder(**settings):
        tower = TinyTower(width, dtype)
        return Encoder(controllers(make_store(server.address, **settings), width, dtype), tower, modality.IMAGE)

    a = encoder()
    cat_a, cat_hash = a.embed(preprocess(tmp_path / "cat.png"))
    assert a.tower.forwards == 1

    # A fresh encoder sees the same picture under another name: the same item, its tower idle.
    b = encoder()
    cat_b, mirror_hash = b.embed(preprocess(tmp_path / "mirror" / "IMG_0001.png"))
    assert mirror_hash == cat_hash and b.tower.forwards == 0 and same_bytes(cat_b, cat_a)

    # Another picture; the same picture preprocessed otherwise (size, normalization): other
    # items, each encoded.
    _, dog_hash = b.embed(preprocess(tmp_path / "dog.png"))
    _, big_hash = b.embed(preprocess(tmp_path / "cat.png", size=48))
    _, mean_hash = b.embed(preprocess(tmp_path / "cat.png", mean=0.4))
    assert len({cat_hash, dog_hash, big_hash, mean_hash}) == 4 and b.tower.forwards == 3

    # The same picture for another model, in another namespace, or from a tower of another dtype
    # or width: never the stored item.
    for settings in ({"gcache_model": "llava-tiny-v2"}, {"gcache_namespace": "tenant-b"}):
        other = encoder(**settings)
        other.embed(preprocess(tmp_path / "cat.png"))
        assert other.tower.forwards == 1, settings
    for other_dtype, other_width in ((torch.float16, width), (dtype, 2 * width)):
        controller = controllers(make_store(server.address), other_width, other_dtype)
        other = Encoder(controller, TinyTower(other_width, other_dtype), modality.IMAGE)
        other.embed(preprocess(tmp_path / "cat.png"))
        assert other.tower.forwards == 1, (other_dtype, other_width)
    # Another encoder of the same model identity (gcache_model, wherever its weights are
    # mounted) finds it.
    c = encoder()
    c.embed(preprocess(tmp_path / "cat.png"))
    assert c.tower.forwards == 0
