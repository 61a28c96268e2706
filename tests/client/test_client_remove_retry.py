"""A REMOVE batch retried after a dropped connection keeps the answers it already had."""

import socket
import threading

from gcache import Client
from gcache.wire.protocol import HEADER


class DropAfterFrames:
    """A loopback proxy that forwards whole response frames and, on the first
    connection only, cuts it instead of forwarding response frame number `cut_at`."""

    def __init__(self, upstream_port: int, cut_at: int):
        self.upstream_port = upstream_port
        self.cut_at = cut_at
        self.connections = 0
        self.sockets = []  # closed only in close(): closing under a thread blocked in recv lets the fd be reused
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self.sockets += [client, upstream]
            cut_at = self.cut_at if self.connections == 1 else None
            threading.Thread(target=self._copy, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._responses, args=(upstream, client, cut_at), daemon=True).start()

    @staticmethod
    def _copy(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    @staticmethod
    def _responses(src, dst, cut_at):
        buffered, frames = b"", 0
        try:
            while data := src.recv(65536):
                buffered += data
                while len(buffered) >= HEADER.size:
                    _, _, opcode, _, _, meta_len, _, payload_len = HEADER.unpack_from(buffered)
                    end = HEADER.size + meta_len + payload_len
                    if len(buffered) < end:
                        break
                    frames += 1
                    if frames == cut_at:
                        raise OSError("cut")
                    dst.sendall(buffered[:end])
                    buffered = buffered[end:]
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)  # wakes the other direction's thread
                except OSError:
                    pass

    def close(self):
        self.listener.close()
        for s in self.sockets:
            s.close()


def test_answers_from_before_a_dropped_connection_survive_the_retry(server):
    keys = [f"rm-{i}".encode() for i in range(4)]
    direct = Client(server.address)
    assert all(direct.put_batch(keys, [b"v"] * 4))
    # Two frames of two keys; the proxy delivers the first answer, then drops
    # the connection instead of the second, so the client retries both frames.
    proxy = DropAfterFrames(server.port, cut_at=2)
    client = Client(f"127.0.0.1:{proxy.port}", transport="tcp", batch_keys_max=2, retries=2, retry_backoff_s=0.01)
    try:
        removed = client.batch_remove(keys)
        assert proxy.connections == 2  # it really was retried on a fresh connection
        assert removed[:2] == [True, True]  # answered before the drop: kept, not overwritten by NOT_FOUND
        assert direct.batch_is_exist(keys) == [False] * 4
    finally:
        client.close()
        direct.close()
        proxy.close()
