"""The controller's read-only HTTP API, beside its /metrics and on the same host (loopback by
default): what the Python API answers about pending demands, for tools that speak HTTP.

    GET /v1/why/<demand>   200 {cause, line, checks, free, nodes, plan, ...}   (Controller.why)
                           404 {"error": "unknown demand ..."}
    GET /v1/pending        200 {"pending": [each demand with its why]}
    anything else          404 {"error": ...}; a failure inside: 500 {"error": ...}

Read-only, no token (like /metrics): it changes nothing. The port is remembered in the store so
a restarted controller answers on the same one.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable
from urllib.parse import unquote

from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        log.debug("api: " + format, *args)

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body, default=str).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        path = self.path.split("?", 1)[0]
        try:
            if path.startswith("/v1/why/") and len(path) > len("/v1/why/"):
                self._send(200, self.server.why(unquote(path[len("/v1/why/"):])))
            elif path == "/v1/pending":
                self._send(200, {"pending": self.server.pending()})
            else:
                self._send(404, {"error": f"no such path {path!r}; try /v1/why/<demand> or /v1/pending"})
        except KeyError as exc:
            self._send(404, {"error": str(exc.args[0] if exc.args else exc)})
        except Exception as exc:  # noqa: BLE001 - one bad request never stops the server
            log.warning("api %s: %s", path, exc)
            self._send(500, {"error": f"{type(exc).__name__}: {exc}"})


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    why: Callable[[str], dict]
    pending: Callable[[], list[dict]]


class _Server6(_Server):
    address_family = socket.AF_INET6


class ApiServer:
    """Serves the routes above in a thread of the controller."""

    def __init__(self, store: Store, why: Callable[[str], dict], pending: Callable[[], list[dict]],
                 host: str = "127.0.0.1", port: int | None = None) -> None:
        saved = (store.get("meta", "api") or {}).get("port")
        last: Exception | None = None
        for p in [p for p in (port, saved) if p] + [0]:
            try:
                self._server = (_Server6 if ":" in host else _Server)((host, int(p)), _Handler)
                break
            except OSError as exc:  # taken (by another process): the next choice
                last = exc
        else:  # pragma: no cover - even port 0 failed
            raise RuntimeError(f"controller api: cannot listen on {host}: {last}")
        self._server.why, self._server.pending = why, pending
        self.host = host
        self.port = int(self._server.server_address[1])
        if self.port != saved:
            store.put("meta", "api", {"port": self.port})
        self._thread = threading.Thread(target=self._server.serve_forever, name="controller-api", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
