"""One rule set (stream/rules.py): the same bad event gets the same reason on every path it can take
(a JSON event, an Arrow bundle, a raw Criteo line through replay's log reader)."""

from __future__ import annotations

import orjson
import pyarrow as pa
import pytest

from stream import rules
from stream.featurizer.bundle import featurize_arrow_bundle
from stream.featurizer.ingest import featurize_records
from stream.formats.arrow import encode_event_bundle
from stream.produce.replay import log_records
from stream.records import RawRecord
from tests.helpers import criteo_event

# (what is wrong, the change to a good event, field, rule, paths that can carry it)
ALL, NO_TSV, JSON_ONLY = ("json", "arrow", "tsv"), ("json", "arrow"), ("json",)
BAD = [
    ("label 2", {"label": 2}, "label", rules.LABEL, ALL),
    ("no label", {"label": None}, "label", rules.LABEL_MISSING, ALL),
    ("negative time", {"ts": -5}, "ts", rules.TIMESTAMP, NO_TSV),
    ("empty event id", {"event_id": ""}, "event_id", rules.EVENT_ID, NO_TSV),
    ("integer too large", {"I3": 1 << 62}, "I3", rules.INTEGER_RANGE, ALL),
    ("integer too small", {"I4": -(1 << 62)}, "I4", rules.INTEGER_RANGE, ALL),
    ("integer as text", {"I2": "x7"}, "I2", rules.INTEGER, ("json", "tsv")),
    ("not hex", {"C5": "zz"}, "C5", rules.CATEGORY_HEX, ALL),
    ("nine hex digits", {"C6": "123456789"}, "C6", rules.CATEGORY_HEX, ALL),
    ("category too long", {"C7": "a" * 300}, "C7", rules.CATEGORY_LONG, ALL),
    ("category not a string", {"C8": 12}, "C8", rules.CATEGORY, JSON_ONLY),
]


def tsv_line(event: dict[str, object], schema) -> str:
    values = [
        event["label"],
        *(event[f] for f in schema.integer_fields),
        *(event[f] for f in schema.categorical_fields),
    ]
    return "\t".join("" if v is None else str(v) for v in values) + "\n"


def reason_via(path: str, event: dict[str, object], schema, tmp_path) -> str | None:
    """The reason the path gives for `event` (None: accepted)."""
    if path == "json":
        _, rejected = featurize_records([RawRecord(0, 0, orjson.dumps(event))], schema)
    elif path == "arrow":
        good = criteo_event(99)
        _, rejected = featurize_arrow_bundle(RawRecord(0, 0, encode_event_bundle([good, event], schema)), schema)
    else:  # replay's log reader, on a one-line Criteo file
        log = tmp_path / "day.txt"
        log.write_text(tsv_line(event, schema))
        rejects = [r.reason for r in log_records([log], schema) if r.reason is not None]
        return rejects[0].split(": ", 1)[1] if rejects else None  # past the "<file>:<row>: " prefix
    return rejected[0].reason if rejected else None


@pytest.mark.parametrize(("what", "change", "field", "rule", "paths"), BAD, ids=[b[0] for b in BAD])
def test_the_same_bad_event_gets_the_same_reason_on_every_path(schema, tmp_path, what, change, field, rule, paths):
    event = {**criteo_event(1), **change}
    expected = rules.reason(field, rule)
    assert {path: reason_via(path, event, schema, tmp_path) for path in paths} == dict.fromkeys(paths, expected)


def test_a_good_event_passes_every_path(schema, tmp_path):
    event = criteo_event(3)
    assert {path: reason_via(path, event, schema, tmp_path) for path in ALL} == dict.fromkeys(ALL, None)


def test_integer_event_ids_are_accepted_by_json_and_bundles(schema):
    event = {**criteo_event(4), "event_id": 1234}
    batch, rejected = featurize_records([RawRecord(0, 0, orjson.dumps(event))], schema)
    assert not rejected and batch.event_ids == ("1234",)
    columns = {name: pa.array([value]) for name, value in event.items()}
    columns["label"] = pa.array([event["label"]], pa.int64())
    for name in schema.integer_fields:
        columns[name] = pa.array([event[name]], pa.int64())
    table = pa.RecordBatch.from_pydict(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_batch(table)
    batch, rejected = featurize_arrow_bundle(RawRecord(0, 1, sink.getvalue().to_pybytes()), schema)
    assert not rejected and batch.event_ids == ("1234",)
