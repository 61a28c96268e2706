"""Client pieces that need no gcache-server: framing, keys, buffers, argument checks,
and the response reader against a scripted peer on a real loopback socket."""

import socket
import threading

import msgpack
import numpy as np
import pytest

from gcache import errors
from gcache.client import Client
from gcache.client.buffers import BufferRegistry, byte_view, view_address
from gcache.wire.protocol import (
    FLAG_RESPONSE,
    HEADER_BYTES,
    MAGIC,
    Header,
    Opcode,
    decode_header,
    decode_meta,
    encode_frame_head,
    encode_header,
    normalize_key,
)

# -- framing ---------------------------------------------------------------------


def test_header_round_trip():
    raw = encode_header(Opcode.GET_BATCH, 2**64 - 1, 7, 2**40, status=3, flags=FLAG_RESPONSE)
    assert len(raw) == HEADER_BYTES == 32
    assert raw[:4] == MAGIC
    assert decode_header(raw) == Header(Opcode.GET_BATCH, FLAG_RESPONSE, 2**64 - 1, 7, 3, 2**40)


def test_header_layout_is_little_endian_per_spec():
    raw = encode_header(Opcode.PING, 0x0102030405060708, 0x11, 0x22)
    assert raw[4] == 1 and raw[5] == Opcode.PING
    assert raw[8:16] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert raw[16:20] == b"\x11\0\0\0" and raw[24:32] == b"\x22" + b"\0" * 7


def test_bad_magic_and_version_rejected():
    raw = bytearray(encode_header(Opcode.PING, 1, 0, 0))
    with pytest.raises(errors.ProtocolError, match="magic"):
        decode_header(b"XXXX" + raw[4:])
    raw[4] = 2
    with pytest.raises(errors.ProtocolError, match="version"):
        decode_header(raw)


def test_meta_must_be_a_map():
    assert decode_meta(msgpack.packb({"keys": [b"a"]})) == {"keys": [b"a"]}
    with pytest.raises(errors.ProtocolError):
        decode_meta(msgpack.packb([1, 2]))
    with pytest.raises(errors.ProtocolError):
        decode_meta(b"\xc1")


def test_frame_head_carries_meta_length():
    head = encode_frame_head(Opcode.EXISTS_BATCH, 9, {"keys": [b"k"]})
    header = decode_header(head)
    assert header.meta_len == len(head) - 32
    assert decode_meta(head[32:]) == {"keys": [b"k"]}


@pytest.mark.parametrize(
    "key,raw", [(b"k", b"k"), ("k\u00e9", "k\u00e9".encode()), (bytearray(b"x"), b"x"), (b"a" * 512, b"a" * 512)]
)
def test_keys_normalised(key, raw):
    assert normalize_key(key) == raw


@pytest.mark.parametrize("key", [b"", "", b"a" * 513, 5, None])
def test_bad_keys_rejected(key):
    with pytest.raises(errors.KeyInvalidError):
        normalize_key(key)


# -- buffers ---------------------------------------------------------------------


def test_byte_view_is_the_same_memory():
    arr = np.zeros((4, 8), dtype=np.float32)
    view = byte_view(arr, writable=True)
    assert len(view) == arr.nbytes and view.format == "B"
    view[0:4] = np.float32(1.5).tobytes()
    assert arr[0, 0] == 1.5


def test_byte_view_rejects_unusable_buffers():
    with pytest.raises(errors.InvalidArgumentError, match="read-only"):
        byte_view(b"abc", writable=True)
    with pytest.raises(errors.InvalidArgumentError, match="contiguous"):
        byte_view(np.zeros((4, 4), np.uint8)[:, ::2], writable=False)
    with pytest.raises(errors.InvalidArgumentError, match="buffer protocol"):
        byte_view([1, 2, 3], writable=False)


def test_registry_resolves_addresses_inside_regions():
    registry = BufferRegistry()
    arr = np.zeros(100, np.uint8)
    start = registry.register(arr)
    assert start == arr.ctypes.data
    registry.resolve(start + 10, 5, writable=True)[:] = b"hello"
    assert arr[10:15].tobytes() == b"hello"
    with pytest.raises(errors.InvalidArgumentError, match="not inside a registered buffer"):
        registry.resolve(start + 98, 5, writable=True)
    assert registry.unregister(start)
    with pytest.raises(errors.InvalidArgumentError):
        registry.resolve(start, 1, writable=False)


def test_registry_accepts_raw_address_and_size():
    arr = np.arange(64, dtype=np.uint8)
    registry = BufferRegistry()
    registry.register(arr.ctypes.data, arr.nbytes)
    view = registry.resolve(arr.ctypes.data + 60, 4, writable=True)
    assert bytes(view) == bytes([60, 61, 62, 63])
    assert view_address(view) == arr.ctypes.data + 60


# -- argument checks: errors come before anything is sent ----------------------------


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("address", ["nohost", "h:0", "h:99999", ":80"])
def test_bad_address_rejected(address):
    with pytest.raises(errors.InvalidArgumentError):
        Client(address)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"retries": -1},
        {"retries": 11},
        {"pool_size": 0},
        {"timeout_s": 0},
        {"batch_keys_max": 0},
        {"batch_keys_max": 16385},
        {"pipeline_depth": 0},
    ],
)
def test_bad_options_rejected(kwargs):
    with pytest.raises(errors.InvalidArgumentError):
        Client(dead_address(), **kwargs)


def test_bad_calls_fail_before_connecting():
    client = Client(dead_address(), retries=0)
    buf = bytearray(8)
    with pytest.raises(errors.InvalidArgumentError):
        client.put_batch([b"a", b"b"], [b"1"])
    with pytest.raises(errors.KeyInvalidError):
        client.put(b"", b"v")
    with pytest.raises(errors.KeyInvalidError):
        client.batch_is_exist(b"not-a-list")
    with pytest.raises(errors.InvalidArgumentError, match="past the end"):
        client.get_into(b"k", buf, offset=4, size=5)
    with pytest.raises(errors.InvalidArgumentError, match="read-only"):
        client.get_into(b"k", b"immutable")
    with pytest.raises(errors.InvalidArgumentError, match="registered"):
        client.get_into(b"k", 12345, 8)
    with pytest.raises(errors.InvalidArgumentError, match="offsets and sizes"):
        client.batch_get_into([b"a"], buf)
    with pytest.raises(errors.InvalidArgumentError, match="2 keys but 1 sizes"):
        client.batch_put_from([b"a", b"b"], [buf, buf], sizes=[1])
    # Only now does a call reach the network: the server is not there.
    with pytest.raises(errors.ConnectionError):
        client.get(b"k")


def test_empty_batches_need_no_server():
    client = Client(dead_address(), retries=0)
    assert client.get_batch([]) == []
    assert client.put_batch([], []) == []
    assert client.batch_exists_prefix([]) == 0
    assert client.batch_get_into([], [], []) == []


def test_closed_client_refuses_calls():
    client = Client(dead_address())
    client.close()
    with pytest.raises(errors.ClientClosedError):
        client.get(b"k")


# -- the response reader, against a scripted peer --------------------------------------


class ScriptedPeer:
    """Accepts one connection, reads one request, then runs `script(conn, header)`."""

    def __init__(self, script):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(1)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.script = script
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.listener.accept()
        with conn:
            head = conn.recv(HEADER_BYTES, socket.MSG_WAITALL)
            header = decode_header(head)
            conn.recv(header.meta_len + header.payload_len, socket.MSG_WAITALL)
            self.script(conn, header)
        self.listener.close()


def reply(header, meta, payload=b"", request_id=None, status=0):
    body = msgpack.packb(meta, use_bin_type=True)
    rid = header.request_id if request_id is None else request_id
    return encode_header(header.opcode, rid, len(body), len(payload), status, FLAG_RESPONSE) + body + payload


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
def test_response_trickled_byte_by_byte_is_read_exactly():
    value = bytes(range(256)) * 3

    def script(conn, header):
        for b in reply(header, {"lens": [len(value)], "sums": [0]}, value):
            conn.sendall(bytes([b]))

    peer = ScriptedPeer(script)
    assert Client(peer.address, transport="tcp", retries=0).get(b"k") == value


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
def test_wrong_request_id_is_a_protocol_error():
    peer = ScriptedPeer(
        lambda conn, h: conn.sendall(reply(h, {"ex": [True], "prefix": 1}, request_id=h.request_id + 1))
    )
    with pytest.raises(errors.ProtocolError, match="out of order"):
        Client(peer.address, transport="tcp", retries=0).is_exist(b"k")


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
def test_lengths_not_matching_payload_is_a_protocol_error():
    peer = ScriptedPeer(lambda conn, h: conn.sendall(reply(h, {"lens": [5], "sums": [0]}, b"abc")))
    with pytest.raises(errors.ProtocolError):
        Client(peer.address, transport="tcp", retries=0).get(b"k")


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
def test_error_status_maps_to_typed_error():
    peer = ScriptedPeer(
        lambda conn, h: conn.sendall(reply(h, {"error": "too many keys", "kind": "batch_keys"}, status=3))
    )
    with pytest.raises(errors.LimitExceededError, match="too many keys"):
        Client(peer.address, transport="tcp", retries=0).get(b"k")


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
def test_silent_peer_times_out_instead_of_hanging():
    release = threading.Event()
    peer = ScriptedPeer(lambda conn, h: release.wait(10))
    try:
        with pytest.raises(errors.TimeoutError, match="no progress"):
            Client(peer.address, transport="tcp", retries=0, timeout_s=0.3).get(b"k")
    finally:
        release.set()


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
def test_peer_closing_mid_response_is_a_connection_error():
    peer = ScriptedPeer(lambda conn, h: conn.sendall(reply(h, {"lens": [100], "sums": [0]}, b"x" * 100)[:-10]))
    with pytest.raises(errors.ConnectionError, match="closed the connection"):
        Client(peer.address, transport="tcp", retries=0).get(b"k")


@pytest.mark.parametrize("keys", [[b"a"], [b"x" * 255], [b"y" * 256], [b"z" * 512], [b"a", b"b"]])
def test_keys_meta_encoding_matches_msgpack(keys):
    from gcache.wire.protocol import encode_keys_meta

    assert encode_keys_meta(keys) == msgpack.packb({"keys": keys}, use_bin_type=True)


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
@pytest.mark.parametrize("into", [False, True])
def test_bytes_failing_their_checksum_are_a_miss_in_results_never_a_value(into):
    """A value whose bytes do not match the server's xxh64 raises, and the exception's
    results say miss for it (the good key keeps its answer)."""
    from gcache._native import xxh64

    good, bad = b"good value", b"bits flipped"

    def script(conn, header):
        conn.sendall(reply(header, {"lens": [len(good), len(bad)], "sums": [xxh64(good), xxh64(b"x")]}, good + bad))

    peer = ScriptedPeer(script)
    client = Client(peer.address, transport="tcp", retries=0, verify_checksums=True)
    with pytest.raises(errors.ChecksumMismatchError) as caught:
        if into:
            buf = bytearray(64)
            client.batch_get_into([b"a", b"b"], buf, [32, 32], [0, 32])
        else:
            client.get_batch([b"a", b"b"])
    assert caught.value.keys == [b"b"]
    assert caught.value.results == ([len(good), None] if into else [good, None])


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
def test_a_node_from_before_xxh3_refusing_a_trailing_put_is_a_clear_error():
    """The refusal a pre-XXH3 node gives a PUT without "sums" names the cause and the way out."""

    def script(conn, header):
        error = {"error": 'PUT_BATCH needs "keys", "lens" and "sums" of equal length', "kind": "BAD_FRAME"}
        conn.sendall(reply(header, error, status=1))

    peer = ScriptedPeer(script)
    with pytest.raises(errors.ProtocolError, match="before XXH3.*GCACHE_CHECKSUM=xxh64"):
        Client(peer.address, transport="tcp", retries=0).put_batch([b"k"], [b"v" * (64 << 10)])  # trailed


@pytest.mark.process
@pytest.mark.usefixtures("client_core")
def test_a_node_from_before_xxh3_failing_every_sum_in_the_map_is_a_clear_error():
    """Small values carry XXH3 sums in the map; a pre-XXH3 node checks them as xxh64 and
    refuses them all, without the "ck" a new node echoes: the client names the cause."""

    def script(conn, header):
        conn.sendall(reply(header, {"st": [3, 3]}))

    peer = ScriptedPeer(script)
    with pytest.raises(errors.ProtocolError, match="before XXH3.*GCACHE_CHECKSUM=xxh64"):
        Client(peer.address, transport="tcp", retries=0).put_batch([b"a", b"b"], [b"x", b"y"])
