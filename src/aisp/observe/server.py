"""The observability server of ``aisp run``: one HTTP server per process for ``/metrics``
(Prometheus: the pipeline's families with the process's) and, with the dashboard on, the
dashboard's page, ``/dashboard/state`` and ``/dashboard/events``
(``aisp.observe.dashboard``). ``aisp serve`` mounts the same endpoints in its own app."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from aisp.observe.dashboard import DashboardState, page, sse
from aisp.observe.export.metrics import TextExposition, metrics_registry
from aisp.observe.view import PipelineView

__all__ = ["ObserveServer"]


class ObserveServer:
    """Serves ``executor``'s ``/metrics`` (and the dashboard if ``dashboard``) on ``host:port``
    (0: a free port) in a daemon thread, from construction until ``close()``; ``registry``:
    the metrics (default: ``metrics_registry(executor)``)."""

    def __init__(
        self,
        executor: PipelineView,
        port: int,
        *,
        dashboard: bool,
        host: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
    ) -> None:
        text = TextExposition(registry if registry is not None else metrics_registry(executor))
        state = DashboardState(executor) if dashboard else None
        stop = self._stop = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path, _, query = self.path.partition("?")
                if path == "/metrics":
                    self._reply(200, CONTENT_TYPE_LATEST, text.render())
                elif state is None:
                    self._reply(404, "application/json", b'{"error": "not found"}')
                elif path in ("/", "/dashboard", "/dashboard/"):
                    self._reply(200, "text/html; charset=utf-8", page())
                elif path == "/dashboard/state":
                    body = state.with_history() if "history=1" in query.split("&") else state.update()
                    self._reply(200, "application/json", json.dumps(body).encode())
                elif path == "/dashboard/events":
                    self._events(state)
                else:
                    self._reply(404, "application/json", b'{"error": "not found"}')

            def _events(self, state: DashboardState) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                try:
                    for chunk in sse(state, stop):
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return

            def _reply(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, name="aisp-observe", daemon=True).start()

    def close(self) -> None:
        """Stop serving (event streams end within a second)."""
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
