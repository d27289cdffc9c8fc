"""Kafka records of events -> one FeatureBatch of the good ones + the rejects. Pure (but for a log line).

    [RawRecord] --featurize_records--> JSON events: json_batch.py (checked and featurized together)
                                       Arrow bundles: bundle.py (a column at a time)
                --featurize_isolating--> the same, a record that crashes it costing only itself

The featurizer's entry point (the Faust agent, stream/featurizer/app.py, is a thin shell around
featurize_isolating). It sits above the three modules it dispatches to: featurize.py (the per-field
rules), json_batch.py and bundle.py, which import featurize.py and never this.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from stream.errors import DecodeError
from stream.featurizer.bundle import featurize_arrow_bundle
from stream.featurizer.decode import parse_json, split_bundle
from stream.featurizer.json_batch import featurize_json_events
from stream.formats.arrow import is_arrow_bundle
from stream.records import FeatureBatch, RawRecord, Rejected
from stream.schema import Schema

log = logging.getLogger("adstream.stream")


def featurize_records(records: Sequence[RawRecord], schema: Schema) -> tuple[FeatureBatch, list[Rejected]]:
    """Kafka records -> one batch of the good events + the rejects (each with a reason).

    A record holds one JSON event, a bundle of newline-separated JSON events, or an Arrow bundle
    (see bundle.py). The JSON events of all the records are checked and featurized together
    (json_batch.py), then the Arrow bundles'. The Faust agent is a thin shell around this function.
    A record given twice (the same partition and offset) is featurized once (once_each).
    """
    records = once_each(records)
    parts: list[FeatureBatch] = []
    objs: list[object] = []
    lines: list[bytes] = []
    partitions: list[int] = []
    offsets: list[int] = []
    rejected: list[Rejected] = []
    for record in records:
        if is_arrow_bundle(record.value):
            batch, bad = featurize_arrow_bundle(record, schema)
            parts.append(batch)
            rejected.extend(bad)
            continue
        seen, unparsed = 0, []  # (line number, line, error) of the lines that are not JSON objects
        for line in split_bundle(record.value):
            seen += 1
            try:
                obj = parse_json(line)
            except DecodeError as exc:
                unparsed.append((seen, line, exc))
                continue
            if not isinstance(obj, dict):  # JSON, but not an event: garbage lines can read as numbers
                unparsed.append((seen, line, DecodeError("", f"expected a JSON object, got {type(obj).__name__}")))
                continue
            objs.append(obj)
            lines.append(line)
            partitions.append(record.partition)
            offsets.append(record.offset)
        if not seen:
            rejected.append(Rejected(record.partition, record.offset, record.value, "record: empty"))
        elif unparsed:
            rejected.append(unparsed_lines(record, seen, unparsed))
    if objs:
        batch, bad = featurize_json_events(objs, lines, partitions, offsets, schema)
        parts.insert(0, batch)
        rejected.extend(bad)
    if not parts:
        return FeatureBatch.empty(
            schema.num_dense, schema.num_sparse, schema.hash, len(schema.list_fields), schema.name
        ), rejected
    return FeatureBatch.concat(parts), rejected


def once_each(records: Sequence[RawRecord]) -> Sequence[RawRecord]:
    """The records, each (partition, offset) once, the first time it comes. Faust can hand one take
    the same record twice (a rebalance seeks a partition back to its committed offset while records
    past it are still in the take); featurized twice, its events would be numbered twice over as
    rows of one record (outputs.in_source_order) and so pass the trainer's check as new events."""
    seen = {(r.partition, r.offset) for r in records}
    if len(seen) == len(records):
        return records
    out, seen = [], set()
    for r in records:
        if (r.partition, r.offset) not in seen:
            seen.add((r.partition, r.offset))
            out.append(r)
    return out


def unparsed_lines(record: RawRecord, lines: int, unparsed: Sequence[tuple[int, bytes, Exception]]) -> Rejected:
    """The lines of one record that are not JSON objects, as one dead letter: a megabyte of garbage is one
    entry a user can act on, not thousands (the record itself when no line parsed)."""
    if len(unparsed) == 1:
        _, line, exc = unparsed[0]
        return Rejected(record.partition, record.offset, line, str(exc))
    first_line, _, first_exc = unparsed[0]
    value = record.value if len(unparsed) == lines else b"\n".join(line for _, line, _ in unparsed)
    reason = f"record: {len(unparsed)} of {lines} lines are not JSON objects (first, line {first_line}: {first_exc})"
    return Rejected(record.partition, record.offset, value, reason)


def featurize_isolating(records: Sequence[RawRecord], schema: Schema) -> tuple[FeatureBatch, list[Rejected]]:
    """featurize_records, but a record that makes it fail (a bug its checks missed, not bad input
    they know) costs only itself: the records are then featurized one by one and the culprit is
    rejected with the error's name, so the good events beside it still reach a batch."""
    try:
        return featurize_records(records, schema)
    except Exception:
        log.exception("featurize failed on %d records; isolating the record that fails", len(records))
    parts, rejected = [], []
    for record in records:
        try:
            batch, bad = featurize_records([record], schema)
        except Exception as exc:
            bad, batch = (
                [
                    Rejected(
                        record.partition,
                        record.offset,
                        record.value,
                        f"record: featurizer crashed ({type(exc).__name__})",
                    )
                ],
                None,
            )
        rejected += bad
        if batch is not None and len(batch):
            parts.append(batch)
    return (FeatureBatch.concat(parts) if parts else featurize_records([], schema)[0]), rejected
