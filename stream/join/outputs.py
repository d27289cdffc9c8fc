"""The joiner's output: what the join emitted -> records for `adstream.events`. Pure.

    [Emission] --event_records--> [(key, value)]: JSON lines for JSON impressions,
                                   Arrow bundles for impressions that came in Arrow bundles

A JSON impression comes out as its JSON object with the label spliced in (`labelled`). An impression
of an Arrow bundle (payload: a RowRef) comes out as a row of an Arrow bundle: the rows are taken
from the stored bundles a bundle at a time and the label column set, so a bundled stream stays
columnar from the ad server to the featurizer. The events of one impression (under fake_negative its
negative, then its positive copy) stay in the order they were emitted. `read_events` reads any
events-topic record back into dicts (tests and benches compare them with the truth).
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pyarrow as pa

from stream.formats.arrow import encode_table, is_arrow_bundle
from stream.join.policy import Emission, RowRef


def labelled(payload: bytes, label_field: str, label: int) -> bytes:
    """An impression's JSON object with `"<label_field>": label` added before its closing brace."""
    return b"%s,%s:%d}" % (payload[: payload.rindex(b"}")], orjson.dumps(label_field), label)


def event_records(
    emitted: list[Emission],
    label_field: str,
    bundle_of: Callable[[int], pa.Table],
    bundle_events: int,
    limit: int,
) -> list[tuple[bytes, bytes]]:
    """Labelled events as (key, value) records of at most `bundle_events` events and `limit` bytes
    (key: the first event's impression id). `bundle_of(offset)`: the stored Arrow bundle a RowRef
    points into."""
    as_json = [e for e in emitted if not isinstance(e.payload, RowRef)]
    as_rows = [e for e in emitted if isinstance(e.payload, RowRef)]
    return _json_records(as_json, label_field, bundle_events, limit) + _arrow_records(
        as_rows, label_field, bundle_of, bundle_events, limit
    )


def _json_records(emitted: list[Emission], label_field: str, most: int, limit: int) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = []
    lines: list[bytes] = []
    size, first = 0, b""
    for e in emitted:
        assert isinstance(e.payload, bytes)
        line = labelled(e.payload, label_field, e.label)
        if lines and (len(lines) >= most or size + len(line) + 1 + len(first) > limit):
            out.append((first, b"\n".join(lines)))
            lines, size = [], 0
        if not lines:
            first = e.impression_id.encode()
        lines.append(line)
        size += len(line) + 1
    if lines:
        out.append((first, b"\n".join(lines)))
    return out


def _arrow_records(
    emitted: list[Emission], label_field: str, bundle_of: Callable[[int], pa.Table], most: int, limit: int
) -> list[tuple[bytes, bytes]]:
    """The rows a bundle at a time (one take per stored bundle; an impression's events share a
    bundle, so their order holds), with the label column, cut into records."""
    if not emitted:
        return []
    groups: dict[int, list[Emission]] = {}
    for e in emitted:
        groups.setdefault(e.payload.offset, []).append(e)  # type: ignore[union-attr]
    tables, labels, ids = [], [], []
    for offset, group in groups.items():
        table = bundle_of(offset)
        if label_field in table.column_names:
            table = table.drop_columns([label_field])
        rows = [e.payload.row for e in group]  # type: ignore[union-attr]
        if rows == list(range(rows[0], rows[0] + len(rows))):  # a run (a bundle emitted at once, or closing)
            tables.append(table.slice(rows[0], len(rows)))  # no copy
        else:
            tables.append(table.take(pa.array(rows, pa.int64())))
        labels += [e.label for e in group]
        ids += [e.impression_id for e in group]
    whole = pa.concat_tables(tables, promote_options="permissive").combine_chunks()
    whole = whole.append_column(label_field, pa.array(labels, pa.int64()))
    out = []
    start = 0
    while start < whole.num_rows:
        n = min(most, whole.num_rows - start)
        value = encode_table(whole.slice(start, n))
        while len(value) > limit and n > 1:  # rows larger than usual: fewer per record
            n //= 2
            value = encode_table(whole.slice(start, n))
        out.append((ids[start].encode(), value))
        start += n
    return out


def read_events(value: bytes) -> list[dict]:
    """An events-topic record (a JSON object, JSON lines or an Arrow bundle) -> its events as dicts."""
    if is_arrow_bundle(value):
        return pa.ipc.open_stream(pa.py_buffer(value)).read_all().to_pylist()
    return [orjson.loads(line) for line in value.split(b"\n") if line.strip()]
