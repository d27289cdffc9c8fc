"""Each long-running process's Prometheus endpoint (`/metrics` on a port of its own).

On by default (stream 9300, joiner 9200, trainer 9400; worker or rank i adds i); a port another
process holds is said once and the process goes on without an endpoint: a second trainer on one
machine must not die for its metrics.
"""

from __future__ import annotations

import logging

log = logging.getLogger("adstream.metrics")


def serve_metrics(port: int, host: str, setting: str) -> bool:
    """Start the endpoint on host:port (0: off); False when off or the port is taken (logged)."""
    from prometheus_client import start_http_server

    if not port:
        return False
    try:
        start_http_server(port, addr=host)
    except OSError as exc:
        log.warning("metrics: port %d on %s not available (%s): no /metrics here; set %s", port, host, exc, setting)
        return False
    return True
