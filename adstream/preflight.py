"""Before a command starts its work: its inputs, then each service it needs, once, briefly.

A command with nothing running used to retry MLflow for minutes (urllib3's backoff) or print
hundreds of librdkafka connection lines before its one useful message. Each check here either
returns or raises CliError with one line: the service, the address and the fix (exit 2 in
cli.main), within a few seconds. A service that is up but slow is the clients' business after
that (they retry as before, logged once).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from adstream.errors import CliError

if TYPE_CHECKING:
    from stream.schema import Schema

PROBE_TIMEOUT_S = 3.0  # one TCP connect or HTTP request per service


def check_paths(paths: list[str]) -> None:
    """Every path exists (a glob's folder is the user's: only plain paths are checked)."""
    missing = [p for p in paths if not any(c in p for c in "*?[") and not Path(p).exists()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if missing[1:] else ""
        raise CliError(f"no such file {missing[0]!r}{more}")


def check_kafka(bootstrap: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Some bootstrap server of `bootstrap` ("host:port,host:port") accepts a TCP connection."""
    errors = []
    for server in bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "localhost", int(port)), timeout=timeout_s):
                return
        except (OSError, ValueError) as exc:
            errors.append(f"{server}: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}")
    raise CliError(
        f"kafka at {bootstrap}: not reachable ({'; '.join(errors)}); start it with `adstream up` or set kafka.bootstrap"
    )


def check_mlflow(tracking_uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """An http(s) tracking server answers /health (a file: or sqlite: store needs no server)."""
    import httpx

    if urlparse(tracking_uri).scheme not in ("http", "https"):
        return
    try:
        response = httpx.get(f"{tracking_uri.rstrip('/')}/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise CliError(
            f"mlflow at {tracking_uri}: not reachable ({type(exc).__name__}); start it with `adstream up` "
            "or set mlflow.tracking_uri"
        ) from None
    if response.status_code >= 500:
        raise CliError(f"mlflow at {tracking_uri}: /health answered {response.status_code}; see its log")


def check_log_schema(paths: list[str], schema: Schema) -> None:
    """The first block of the first log reads under `schema`; when none of its rows does, name a
    bundled schema it reads under (a wrong --set stream.schema used to replay 0 events, exit 0)."""
    from stream.produce.logs import read_log
    from stream.schema import SCHEMA_DIR, load_schema

    files = [p for p in paths if Path(p).is_file()]
    if not files:
        return
    block = _first_block(files[0], schema, read_log)
    if block is None or block.good.num_rows or not block.bad:
        return
    fits = []
    for path in sorted(SCHEMA_DIR.glob("*.toml")):
        other = load_schema(path)
        if other.hash != schema.hash:
            tried = _first_block(files[0], other, read_log)
            if tried is not None and tried.good.num_rows:
                fits.append(other.name)
    hint = (
        f"it reads under {fits[0]!r}: run replay, stream, train and serve with --set stream.schema={fits[0]}"
        if fits
        else "no bundled schema reads it: write one (README: Schemas) and pass --set stream.schema=PATH"
    )
    raise CliError(
        f"none of the first {len(block.bad)} rows of {files[0]} reads under schema {schema.name!r} ({schema.hash}): "
        f"{block.bad[0].reason}; {hint}"
    )


def _first_block(path: str, schema: Schema, read_log: Any) -> Any:
    try:
        return next(iter(read_log([path], schema)), None)
    except Exception:  # a layout this schema's reader cannot even open: no rows read under it
        return None
