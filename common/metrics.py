"""Prometheus plumbing shared by both daemons: a private registry and its HTTP endpoint."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger("starsd.metrics")


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "0.0.0.0") -> None:
    """Expose ``registry`` on http://addr:port/metrics from a background thread."""
    start_http_server(port, addr=addr, registry=registry)
    log.info("metrics on http://%s:%d/metrics", addr, port)
