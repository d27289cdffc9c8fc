"""Records that arrived on another partition than their id's: which, and what is sent to their own.

The joiner keeps an impression's state in the partition its id hashes to (murmur2, Java's default
partitioner). A producer that places keys otherwise puts some impressions or clicks on the wrong
partition; the joiner moves them to theirs inside the chunk's transaction (stream/join/joiner.py),
each kind in its own format: a JSON impression as its JSON line, an Arrow bundle's impressions as
the rows of an Arrow bundle, a click as a click record. Pure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import pyarrow as pa

from stream.formats.arrow import encode_table
from stream.formats.clicks import click_record
from stream.join.inputs import ClickFields
from stream.join.policy import Click, Impression, RowRef


def split_by_home(
    items: Sequence[Impression | Click], homes: Sequence[int], partition: int
) -> tuple[list[Impression | Click], dict[int, list[Impression | Click]]]:
    """(the items whose home is `partition`, in order; the others by their home partition)."""
    kept: list[Impression | Click] = []
    away: defaultdict[int, list[Impression | Click]] = defaultdict(list)
    for item, home in zip(items, homes, strict=True):
        (kept if home == partition else away[home]).append(item)
    return kept, dict(away)


def moved_value(
    moved: Sequence[Impression | Click], impressions: bool, bundle: pa.Table | None, fields: ClickFields
) -> bytes:
    """The one record value that carries `moved` to their partition: newline-separated click
    records or JSON lines, or an Arrow bundle of the rows they were in `bundle`."""
    if not impressions:
        return b"\n".join(click_record(c.impression_id, c.ts, fields.impression_id, fields.time) for c in moved)
    if isinstance(moved[0].payload, RowRef):  # type: ignore[union-attr]
        assert bundle is not None
        rows = pa.array([i.payload.row for i in moved], pa.int64())  # type: ignore[union-attr]
        return encode_table(bundle.take(rows))
    return b"\n".join(i.payload for i in moved)  # type: ignore[union-attr,misc]
