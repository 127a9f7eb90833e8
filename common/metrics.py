"""Prometheus plumbing shared by both daemons: a private registry and its HTTP endpoint."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("starsd.metrics")

# A probe's answer: (HTTP status, JSON body)
Probe = Callable[[], tuple[int, dict]]


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0",
                  probes: dict[str, Probe] | None = None) -> ThreadingHTTPServer:
    """Expose ``registry`` on http://addr:port/metrics from a background thread, and each of
    ``probes`` (path -> what it answers, such as /health and /ready) beside it."""
    probes = dict(probes or {})

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
            path = self.path.split("?", 1)[0]
            try:
                if path in ("/metrics", "/"):
                    body, code, ctype = generate_latest(registry), 200, CONTENT_TYPE_LATEST
                elif path in probes:
                    code, content = probes[path]()
                    body, ctype = json.dumps(content).encode(), "application/json"
                else:
                    body, code, ctype = b'{"error": "not found"}', 404, "application/json"
            except Exception as exc:  # a failing collector or probe answers 500, and is logged
                log.exception("answering %s failed", path)
                body, code, ctype = json.dumps({"error": str(exc)}).encode(), 500, "application/json"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's signature)
            pass  # probes come every few seconds: not worth a log line each

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    log.info("metrics on http://%s:%d/metrics%s", addr, port,
             "".join(f", {p}" for p in probes))
    return server
