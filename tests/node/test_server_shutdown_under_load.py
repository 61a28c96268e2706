"""SIGTERM while a client streams large pipelined PUT batches: the server exits 0
after its grace period, the client call ends (no hang), and every value the
client saw acknowledged is there, byte for byte, after a restart."""

from __future__ import annotations

import random
import signal
import threading

from gcache import Client, errors

KIB = 1 << 10
BATCH_KEYS = 64
VALUE_BYTES = 64 * KIB  # 4 MiB per put_batch, 16 frames of 256 KiB
BATCHES_MAX = 24  # 96 MiB at most: fits the 128 MiB memory tier, so nothing is evicted


def batch(b: int) -> dict[bytes, bytes]:
    rng = random.Random(b)
    return {b"b%d-%d" % (b, i): rng.randbytes(VALUE_BYTES) for i in range(BATCH_KEYS)}


def test_sigterm_mid_put_batch_exits_0_and_keeps_every_acknowledged_value(server_factory):
    node = server_factory("load", memory="128MiB", extra_args=["--shutdown-grace-s", "1"])
    acked: dict[bytes, bytes] = {}
    outcome: list = []
    three_done = threading.Event()

    def writer() -> None:
        client = Client(
            node.address,
            timeout_s=10,
            retries=1,
            retry_backoff_s=0.01,
            frame_payload_bytes_max=256 * KIB,
            pipeline_depth=8,
            pool_size=1,
        )
        try:
            for b in range(BATCHES_MAX):
                items = batch(b)
                stored = client.put_batch(list(items), list(items.values()))
                acked.update((k, v) for (k, v), ok in zip(items.items(), stored) if ok)
                if b == 2:
                    three_done.set()
            outcome.append("finished")
        except (errors.ConnectionError, errors.TimeoutError) as exc:
            outcome.append(exc)
        finally:
            three_done.set()
            client.close()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    assert three_done.wait(120)
    node.proc.send_signal(signal.SIGTERM)  # the writer is mid-way through a later batch
    assert node.proc.wait(timeout=60) == 0, node.log()
    thread.join(timeout=60)
    assert not thread.is_alive(), "a client call blocked past its timeout after the server stopped"
    assert len(outcome) == 1
    if isinstance(outcome[0], BaseException):  # cut off: a connection error naming the server
        assert isinstance(outcome[0], errors.ConnectionError) and node.address in str(outcome[0])
    assert len(acked) >= 3 * BATCH_KEYS

    again = server_factory("load", memory="128MiB")  # same data dir: flushed at shutdown
    with Client(again.address, frame_payload_bytes_max=256 * KIB) as client:
        keys = list(acked)
        got = client.get_batch(keys)
        lost = [k for k, v in zip(keys, got) if v != acked[k]]
        assert not lost, f"{len(lost)} acknowledged values lost or changed, e.g. {lost[:3]}"
