"""The SGLang embedding store's pure parts (no torch, no sglang): keys, the header, segments,
where a payload lies in SGLang's page runs, and the settings."""

from __future__ import annotations

import json

import pytest

from gcache.integrations.sglang.embedding_settings import CONFIG_ENV, EmbeddingSettings, SettingsError, read_config
from gcache.integrations.sglang.embedding_values import (
    HEADER_BYTES,
    SEGMENT_BYTES,
    EmbeddingFormatError,
    EmbeddingKeys,
    Header,
    Piece,
    content_tag,
    dtype_tag,
    key_digest,
    model_tag,
    place,
    segment_spans,
)
from gcache.wire.protocol import KEY_BYTES_MAX


def test_keys_name_model_content_dtype_width_and_namespace():
    keys = EmbeddingKeys("Qwen/Qwen2.5-VL-7B-Instruct")
    base = keys.base("12345678901234567890", "torch.bfloat16", 3584)
    assert base == "emb1.12345678901234567890.bfloat16x3584_Qwen-Qwen2.5-VL-7B-Instruct"
    assert keys.header_key(base) == (base + ".h").encode()
    assert keys.data_keys(base, 3) == [(base + f".d{i}").encode() for i in range(3)]
    assert keys.probe_keys(base) == [(base + ".h").encode(), (base + ".d0").encode()]
    assert EmbeddingKeys("m", "tenant-a").base("1", "float16", 8) == "tenant-a/emb1.1.float16x8_m"

    # Every field separates items: another hash, dtype, width, model or namespace is another key.
    variants = {
        EmbeddingKeys("m").base("1", "float16", 8),
        EmbeddingKeys("m").base("2", "float16", 8),
        EmbeddingKeys("m").base("1", "bfloat16", 8),
        EmbeddingKeys("m").base("1", "float16", 16),
        EmbeddingKeys("m2").base("1", "float16", 8),
        EmbeddingKeys("m", "ns").base("1", "float16", 8),
    }
    assert len(variants) == 6


def test_content_and_model_fields():
    assert content_tag(123) == "123" and content_tag("ab-CD_9") == "ab-CD_9"
    # Anything else (dots, slashes, spaces, too long) is "~" + sha256: never equal to a plain one.
    for odd in ("a.b", "x/y", "has space", "z" * 129, ""):
        tag = content_tag(odd)
        assert tag.startswith("~") and len(tag) == 65
    assert content_tag("a.b") != content_tag("a/b")
    assert model_tag("/mnt/models/llava") == "mnt-models-llava"
    long = model_tag("x" * 300)
    assert len(long) == 96 and long != model_tag("x" * 301)
    with pytest.raises(EmbeddingFormatError):
        model_tag(" ")
    assert dtype_tag("torch.float8_e4m3fn") == "float8_e4m3fn"
    with pytest.raises(EmbeddingFormatError):
        dtype_tag("Float 32")
    with pytest.raises(EmbeddingFormatError):
        EmbeddingKeys("m", "bad/ns")
    with pytest.raises(EmbeddingFormatError, match="shorten gcache_namespace"):
        EmbeddingKeys("m", "n" * 450)
    with pytest.raises(EmbeddingFormatError):
        EmbeddingKeys("m").base("1", "float16", 0)


def test_the_longest_key_fits_the_protocol():
    keys = EmbeddingKeys("m" * 200, "n" * 200)
    base = keys.base("~" * 200, "float8_e4m3fnuz", 10**12)
    assert len(keys.data_keys(base, 100000)[-1]) <= KEY_BYTES_MAX


def test_header_round_trip_and_checks():
    base = EmbeddingKeys("m").base("9", "bfloat16", 64)
    header = Header.of(base, "bfloat16", rows=300, width=64, element_size=2)
    raw = header.pack()
    assert len(raw) == HEADER_BYTES == 64
    assert Header.unpack(raw) == header
    assert header.payload_bytes == 300 * 64 * 2 and header.segment_bytes == SEGMENT_BYTES
    assert header.digest == key_digest(base)
    assert Header.unpack(raw).check(header) is None

    def changed(**fields):
        return Header(**{**header.__dict__, **fields})

    assert changed(dtype="float16").check(header) == "foreign"
    assert changed(width=32).check(header) == "foreign"
    assert changed(digest=key_digest(base + "x")).check(header) == "foreign"
    assert changed(rows=299, payload_bytes=299 * 128).check(header) == "shape"
    assert changed(segment_bytes=1 << 20).check(header) == "shape"
    for bad in (raw[:-1], b"XXXX" + raw[4:], raw[:4] + b"\x02\x00" + raw[6:], raw[:8] + b"\xff" * 16 + raw[24:]):
        with pytest.raises(EmbeddingFormatError):
            Header.unpack(bad)


def test_segment_spans():
    assert segment_spans(100, 1000) == [(0, 100)]
    assert segment_spans(2500, 1000) == [(0, 1000), (1000, 1000), (2000, 500)]
    assert segment_spans(2000, 1000) == [(0, 1000), (1000, 1000)]
    assert len(segment_spans(SEGMENT_BYTES + 1)) == 2
    with pytest.raises(EmbeddingFormatError):
        segment_spans(0)


def test_place_maps_spans_onto_page_runs():
    # One run: every span in place.
    assert place([(0, 10)], [10]) == [[Piece(0, 0, 10)]]
    # Runs of 4, 6, 5 bytes; spans of 6: the first crosses runs 0-1, the second 1-2, the last in 2.
    spans = segment_spans(15, 6)
    assert place(spans, [4, 6, 5]) == [
        [Piece(0, 0, 4), Piece(1, 0, 2)],
        [Piece(1, 2, 4), Piece(2, 0, 2)],
        [Piece(2, 2, 3)],
    ]
    # A span over three runs.
    assert place([(0, 9)], [2, 3, 4]) == [[Piece(0, 0, 2), Piece(1, 0, 3), Piece(2, 0, 4)]]
    with pytest.raises(EmbeddingFormatError):
        place([(0, 11)], [10])
    with pytest.raises(EmbeddingFormatError):
        place([(0, 1)], [0])


def test_settings_from_json_env_file_and_errors(tmp_path):
    s = EmbeddingSettings.from_config(
        None,
        environ={CONFIG_ENV: json.dumps({"gcache_url": "h:1", "gcache_model": "m", "gcache_staging_mib": 8})},
    )
    assert (s.url, s.model, s.staging_mib, s.verify_checksums, s.skip_existing) == ("h:1", "m", 8, True, True)
    # The address may come from GCACHE_URL; the object from a file the variable names.
    path = tmp_path / "emb.json"
    path.write_text(json.dumps({"gcache_namespace": "t"}))
    s = EmbeddingSettings.from_config(None, environ={CONFIG_ENV: str(path), "GCACHE_URL": "h:2"})
    assert (s.url, s.namespace, s.model) == ("h:2", "t", None)
    assert EmbeddingSettings.from_config({"gcache_url": "h:3"}, environ={}).url == "h:3"
    assert read_config(None, environ={}) == {}
    for config, message in [
        ({"gcache_url": "h:1", "gcache_modell": "m"}, "unknown GCACHE_SGLANG_EMBEDDING_CONFIG key"),
        ({"gcache_url": "h:1", "backend_name": "gcache"}, "unknown GCACHE_SGLANG_EMBEDDING_CONFIG key"),
        ({"gcache_url": "h:1", "gcache_staging_mib": 0}, "gcache_staging_mib"),
        ({"gcache_url": "h:1", "gcache_model": ""}, "gcache_model"),
        ({}, "no GCache address"),
        ("[1]", "must be a JSON object"),
        ("{", "is not JSON"),
    ]:
        with pytest.raises(SettingsError, match=message):
            EmbeddingSettings.from_config(config, environ={})
    with pytest.raises(SettingsError, match="a JSON object or the path of a file"):
        EmbeddingSettings.from_config(None, environ={CONFIG_ENV: str(tmp_path / "absent.json")})
