"""A loopback TCP relay that kills the store after part of a request went through.

The backend talks to the relay; the relay forwards to the gcache-server. Once it has
forwarded `kill_after` request bytes it SIGKILLs the server (one shot), so the kill
lands inside a batch, deterministically: some of the batch reached the server, the
rest never will. Afterwards it only forwards. Every socket wait is bounded.
"""

from __future__ import annotations

import socket
import threading

WAIT_S = 10.0
CHUNK = 64 * 1024


class KillingRelay:
    def __init__(self, server, kill_after: int):
        self.server = server
        self.kill_after = kill_after
        self.forwarded = 0
        self.killed = threading.Event()
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._sockets: list = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self):
        while not self._stop.is_set():
            try:
                down, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.server.port), timeout=WAIT_S)
            except OSError:
                down.close()  # the store is down: the client sees its connection closed
                continue
            for sock in (down, up):
                sock.settimeout(WAIT_S)
                self._sockets.append(sock)
            for src, dst, request in ((down, up, True), (up, down, False)):
                t = threading.Thread(target=self._pump, args=(src, dst, request), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, src, dst, request: bool):
        try:
            while not self._stop.is_set():
                data = src.recv(CHUNK)
                if not data:
                    break
                if request and not self.killed.is_set():
                    with self._lock:
                        room = self.kill_after - self.forwarded
                        part = data[: max(room, 0)]
                        self.forwarded += len(part)
                    if part:
                        dst.sendall(part)
                    if len(part) < len(data):  # the rest of the batch never arrives
                        self.server.kill()
                        self.killed.set()
                        break
                    continue
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def close(self):
        self._stop.set()
        self._listener.close()
        for sock in self._sockets:  # wakes the pumps blocked in recv
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(WAIT_S)
