"""Admin HTTP endpoint of gcache-server (stdlib http.server, one thread).

GET /metrics  Prometheus text (see prometheus.render)
GET /healthz  200 while the process runs
GET /readyz   200 while serving, 503 once shutdown began
GET /cluster  JSON: the cluster agent's view (node id, state, epochs, rebalance
              counters); {"cluster": false} on a standalone node
POST /flush   writes the memory tier and warm list to disk, 200 when done
POST /drain   asks the master to drain this node (active failover); the body,
              if any, is the reason. 202 with the /cluster JSON; 409 on a
              standalone node

With --auth-file the POST endpoints need `Authorization: Bearer TOKEN` of a
tenant with the admin role: 401 without a valid token, 403 without the role.
The GET endpoints stay open (they carry counters and states, never key names).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gcache.server import prometheus
from gcache.wire.auth import bearer_token

log = logging.getLogger("gcache.server.admin")

REASON_BYTES_MAX = 1024  # of a POST /drain body


class AdminHttpServer:
    """Serves the admin endpoints in a daemon thread until close()."""

    def __init__(
        self,
        host: str,
        port: int,
        stats: Callable[[], dict],
        flush: Callable[[], None],
        ready: Callable[[], bool],
        cluster: Callable[[], dict | None] = lambda: None,
        drain: Callable[[str], dict | None] = lambda reason: None,
        auth=None,
    ):
        handler = _make_handler(stats, flush, ready, cluster, drain, auth)
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as e:
            raise OSError(
                e.errno, f"admin HTTP {host}:{port}: {e.strerror}; pick a free --admin-port, or 0 to turn it off"
            ) from e
        # Request threads are joined on close, so a POST /flush in progress
        # finishes before the process exits; Handler.timeout bounds each one.
        self._httpd.daemon_threads = False
        self._httpd.block_on_close = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="gcache-admin-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._httpd.shutdown()
            self._thread.join(timeout=5)
        self._httpd.server_close()


def _make_handler(stats, flush, ready, cluster, drain, auth):
    flush_lock = threading.Lock()  # one flush at a time

    class Handler(BaseHTTPRequestHandler):
        server_version = "gcache-admin"
        timeout = 10  # seconds a client may take to send its request

        def _reply(self, code: int, body: str, content_type: str = "text/plain; charset=utf-8") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            self._answer(self._get)

        def do_POST(self) -> None:  # noqa: N802
            self._answer(self._post)

        def _answer(self, handle) -> None:
            try:
                handle()
            except Exception as e:  # noqa: BLE001 -- answer 500 instead of dropping the connection
                log.exception("admin %s %s failed", self.command, self.path)
                self._reply(500, f"internal error: {e}\n")

        def _get(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, prometheus.render(stats()), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/healthz":
                self._reply(200, "ok\n")
            elif path == "/readyz":
                if ready():
                    self._reply(200, "ready\n")
                else:
                    self._reply(503, "shutting down\n")
            elif path == "/cluster":
                view = cluster()
                self._reply(
                    200,
                    json.dumps(view if view is not None else {"cluster": False}, sort_keys=True) + "\n",
                    "application/json",
                )
            else:
                self._reply(404, "not found; try /metrics, /healthz, /readyz, /cluster, POST /flush or POST /drain\n")

        def _body(self) -> str:
            try:
                length = min(int(self.headers.get("Content-Length") or 0), REASON_BYTES_MAX)
            except ValueError:
                length = 0
            return self.rfile.read(length).decode("utf-8", "replace").strip() if length > 0 else ""

        def _admin_allowed(self) -> bool:
            """Answers 401/403 and returns False unless the request carries an admin token."""
            if auth is None:
                return True
            tenant = auth.by_token(bearer_token(self.headers.get("Authorization")))
            if tenant is None:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="gcache-admin"')
                body = (
                    b"this node has --auth-file: send 'Authorization: Bearer TOKEN' with the token "
                    b"of a tenant that has the admin role\n"
                )
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return False
            if not tenant.has("admin"):
                self._reply(
                    403,
                    f"tenant {tenant.name!r} lacks the admin role needed for POST "
                    f'{self.path.split("?", 1)[0]}; add "admin" to its roles in the auth file\n',
                )
                return False
            return True

        def _post(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/flush", "/drain") and not self._admin_allowed():
                return
            if path == "/flush":
                with flush_lock:
                    flush()
                self._reply(200, "flushed\n")
            elif path == "/drain":
                reason = self._body()
                view = drain(f"operator: POST /drain{': ' + reason if reason else ''}")
                if view is None:
                    self._reply(409, "this node is standalone (no --master): there is no cluster to drain it into\n")
                else:
                    self._reply(202, json.dumps(view, sort_keys=True) + "\n", "application/json")
            else:
                self._reply(404, "not found; the POST endpoints are /flush and /drain\n")

        def log_message(self, fmt, *args) -> None:
            log.debug("admin %s " + fmt, self.client_address[0], *args)

    return Handler
