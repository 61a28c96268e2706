"""What workers write to Redis and routers read: key names, page ids, flags, event codec.

Keys (prefix P):
  P:workers        ZSET  member = worker URL, score = last heartbeat (unix ms): discovery
  P:w:<url>        STR   JSON registration + load, SET with PX ttl (the heartbeat)
  P:pages:<url>    HASH  8-byte page id -> 1 flags byte: the worker's current cache state
  P:ev:<url>       STREAM (MAXLEN ~): one entry per flush, absolute new flags per page
  P:l3, P:l3swa    ZSET  page id -> report time (ms): pages known to be in the shared L3
  P:l3:gone, P:l3swa:gone  ZSET  page id -> removal time (ms): pages known to have left it
                   (a router reading the L3 sets incrementally learns removals from these;
                   written by gcache.serving.announce.writer, the one writer)

A page id is the first 8 bytes of the SGLang page hash (gcache.wire.keys), so it names a whole
prefix, like the hash itself; a worker and a router compute it from the same tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from gcache.wire.keys import page_hashes_array

FORMAT_VERSION = 1
DEFAULT_PREFIX = "gcache:router"  # every Redis key's namespace unless --redis-prefix says otherwise
L1_FULL, L1_SWA, L2_FULL, L2_SWA = 1, 2, 4, 8
FLAGS_ALL = L1_FULL | L1_SWA | L2_FULL | L2_SWA
L3_FULL, L3_SWA = 1, 2  # the shared L3 view's flags

WORKER_URL_MAX = 2048
REGISTRATION_BYTES_MAX = 64 << 10  # a real one is ~300 bytes
# Printable ASCII without spaces, quotes or backslashes: a worker URL goes into Redis keys,
# HTTP headers and Prometheus labels unescaped.
_WORKER_URL = re.compile(r"https?://[!#-\[\]-~]+")

_RECORD = np.dtype([("id", ">u8"), ("flags", "u1")])
RECORD_BYTES = _RECORD.itemsize  # 9


def valid_worker_url(url: str) -> bool:
    """Whether `url` may name a worker (what publishers register and routers accept)."""
    return len(url) <= WORKER_URL_MAX and _WORKER_URL.fullmatch(url) is not None


def page_id(page_hash: str) -> int:
    """The page id of one hex page hash."""
    return int(page_hash[:16], 16)


def page_ids(tokens: ArrayLike, page_size: int) -> list[int]:
    """Page ids of every whole page of `tokens` (the worker's chain, truncated)."""
    return [int(h[:16], 16) for h in page_hashes_array(np.asarray(tokens, dtype=np.int64), page_size)]


def id_bytes(pid: int) -> bytes:
    return pid.to_bytes(8, "big")


def id_from_bytes(raw: bytes) -> int:
    if len(raw) != 8:
        raise ValueError(f"a page id is 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def encode_records(items: Iterable[tuple[int, int]]) -> bytes:
    """(page id, flags) pairs -> packed bytes (9 per page)."""
    items = list(items)
    arr = np.empty(len(items), dtype=_RECORD)
    if items:
        arr["id"] = [i for i, _ in items]
        arr["flags"] = [f for _, f in items]
    return arr.tobytes()


def decode_records(raw: bytes) -> list[tuple[int, int]]:
    if len(raw) % RECORD_BYTES:
        raise ValueError(f"event payload of {len(raw)} bytes is not a multiple of {RECORD_BYTES}")
    arr = np.frombuffer(raw, dtype=_RECORD)
    return list(zip(arr["id"].tolist(), arr["flags"].tolist()))


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def reg(self, url: str) -> str:
        return f"{self.prefix}:w:{url}"

    def pages(self, url: str) -> str:
        return f"{self.prefix}:pages:{url}"

    def events(self, url: str) -> str:
        return f"{self.prefix}:ev:{url}"

    @property
    def l3_full(self) -> str:
        return f"{self.prefix}:l3"

    @property
    def l3_swa(self) -> str:
        return f"{self.prefix}:l3swa"

    @property
    def l3_full_gone(self) -> str:
        return f"{self.prefix}:l3:gone"

    @property
    def l3_swa_gone(self) -> str:
        return f"{self.prefix}:l3swa:gone"


@dataclass(frozen=True)
class WorkerLoad:
    running: int = 0
    waiting: int = 0
    queued_tokens: int = 0  # prompt tokens still to compute (waiting: uncached estimate; running: rest of prefill)
    active_tokens: int = 0  # tokens held by running requests (Dynamo's decode blocks * page size)
    max_running: int = 0
    free_pages: int = -1  # full device pages free or held only by the evictable cache (-1: not published)


@dataclass(frozen=True)
class Registration:
    url: str
    model: str
    page_size: int
    window: int
    epoch: str
    seq: int
    ts_ms: int
    load: WorkerLoad
    dropped_events: int = 0
    role: str = "mixed"  # handoff.Role: prefill / decode / mixed (routers pool workers by it)

    def to_json(self) -> bytes:
        d = {
            "v": FORMAT_VERSION,
            "url": self.url,
            "model": self.model,
            "page_size": self.page_size,
            "window": self.window,
            "epoch": self.epoch,
            "seq": self.seq,
            "ts_ms": self.ts_ms,
            "load": self.load.__dict__,
            "dropped_events": self.dropped_events,
            "role": self.role,
        }
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Registration:
        """Parse a registration; ValueError for anything malformed (a router skips it)."""
        if len(raw) > REGISTRATION_BYTES_MAX:
            raise ValueError(f"registration of {len(raw)} bytes (at most {REGISTRATION_BYTES_MAX})")
        try:
            d = json.loads(raw)
            if d.get("v") != FORMAT_VERSION:
                raise ValueError(f"registration format {d.get('v')!r}, expected {FORMAT_VERSION}")
            load = WorkerLoad(**{k: int(v) for k, v in d["load"].items() if k in WorkerLoad.__dataclass_fields__})
            reg = cls(
                str(d["url"]),
                str(d["model"]),
                int(d["page_size"]),
                int(d["window"]),
                str(d["epoch"]),
                int(d["seq"]),
                int(d["ts_ms"]),
                load,
                int(d.get("dropped_events", 0)),
                str(d.get("role", "mixed"))[:16],  # an older worker has no role: mixed
            )
        except (KeyError, TypeError, AttributeError, RecursionError, json.JSONDecodeError) as e:
            raise ValueError(f"malformed registration: {type(e).__name__}: {str(e)[:200]}") from None
        if reg.page_size <= 0 or reg.window <= 0 or reg.seq < 0:
            raise ValueError("registration has a non-positive page_size/window or a negative seq")
        return reg
