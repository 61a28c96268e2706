"""Tiny HTTP endpoint for probes and humans.

  GET /healthz -> 200 while the process runs
  GET /readyz  -> 200 when this replica knows a Raft leader, else 503
  GET /map     -> the map as JSON ({"epoch", "nodes": [...]})

One thread serves one request at a time, each with a short socket timeout, so
a stuck client cannot pile up work on the control plane.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer

REQUEST_TIMEOUT_S = 2.0


class HttpProbe:
    def __init__(self, host: str, port: int, leader: Callable[[], str | None], map_dict: Callable[[], dict]):
        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S

            def do_GET(self):
                path = self.path.split("?", 1)[0]
                if path == "/healthz":
                    self._answer(200, {"ok": True})
                elif path == "/readyz":
                    known = leader()
                    self._answer(200 if known else 503, {"ready": bool(known), "leader": known})
                elif path == "/map":
                    self._answer(200, map_dict())
                else:
                    self._answer(404, {"error": f"no {path}; try /healthz, /readyz or /map"})

            def _answer(self, code: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args):
                pass  # probes every few seconds would flood the log

        try:
            self._server = HTTPServer((host, port), Handler)
        except OSError as e:
            raise OSError(
                f"cannot listen for HTTP on {host}:{port}: {e.strerror or e}; pick another --http HOST:PORT"
            ) from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="gcache-master-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()
