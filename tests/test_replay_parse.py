"""Replay's log reader (stream/produce/logs.py, stream/produce/replay.py): any layout a schema's [source] table
describes, read in blocks, bad rows to the DLQ with their reason, bundles and single events."""

import gzip

import orjson
import pyarrow as pa
import pytest

from stream import rules
from stream.errors import SchemaError
from stream.featurizer.bundle import featurize_arrow_bundle
from stream.featurizer.decode import decode_event
from stream.featurizer.ingest import featurize_records
from stream.formats.arrow import is_arrow_bundle
from stream.formats.json_lines import json_lines
from stream.produce.logs import BASE_TS_MS, read_log
from stream.produce.replay import ReplayRecord, log_records
from stream.records import RawRecord
from stream.schema import load_schema, schema_from_dict
from tests.helpers import CRITEO_FILES, avazu_csv, needs_shared

LINE = "1\t5\t\t-1\t" + "\t".join(["2"] * 10) + "\t" + "\t".join(["68fd1e64"] * 25) + "\t"


def test_a_criteo_line_becomes_the_event_json_would_give(schema, tmp_path):
    path = tmp_path / "day_0.txt"
    path.write_text(LINE + "\n")
    (record,) = list(log_records([path], schema))
    event = decode_event(record.value, schema)
    assert record.key == b"day_0:0" and event.event_id == "day_0:0" and event.ts == BASE_TS_MS
    assert event.label == 1 and event.ints[:3] == (5, None, -1)
    assert event.cats[0] == "68fd1e64" and event.cats[-1] is None


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("1\t2\t3", "expected 40 tsv columns, got 3"),
        ("x" + LINE[1:], rules.reason("label", rules.LABEL)),
        ("2" + LINE[1:], rules.reason("label", rules.LABEL)),
        ("\t" + LINE[2:], rules.reason("label", rules.LABEL_MISSING)),
        (LINE.replace("\t5\t", "\t5.5\t", 1), rules.reason("I1", rules.INTEGER)),
        (LINE.replace("\t5\t", f"\t{1 << 62}\t", 1), rules.reason("I1", rules.INTEGER_RANGE)),
        (LINE.replace("\t5\t", "\t123456789012345678901\t", 1), rules.reason("I1", rules.INTEGER_RANGE)),
        (LINE.replace("68fd1e64", "ZZZZZZZZ", 1), rules.reason("C1", rules.CATEGORY_HEX)),
    ],
)
def test_bad_lines_are_explained_and_the_rest_kept(schema, tmp_path, line, reason):
    path = tmp_path / "day_1.txt"
    path.write_text("\n".join([LINE, line, LINE]) + "\n")
    records = list(log_records([path], schema))
    bad = [r for r in records if r.reason is not None]
    assert [r.events for r in records if r.reason is None] == [1, 1]
    assert [r.key for r in records if r.reason is None] == [b"day_1:0", b"day_1:2"]  # ids are line numbers
    assert len(bad) == 1 and bad[0].reason == f"day_1:1: {reason}" and bad[0].key == b"day_1:1"


def test_gzip_and_loop(schema, tmp_path):
    path = tmp_path / "day_0.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(LINE + "\n" + LINE + "\n")
    records = list(log_records([path], schema))
    assert [r.key for r in records] == [b"day_0:0", b"day_0:1"]
    looped = log_records([path], schema, loop=True)
    keys = [next(looped).key for _ in range(5)]
    assert keys == [b"day_0:0", b"day_0:1", b"day_0#1:0", b"day_0#1:1", b"day_0#2:0"]
    times = [decode_event(next(log_records([path], schema, loop=True)).value, schema).ts]
    assert times == [BASE_TS_MS]


@needs_shared(bool(CRITEO_FILES), "../shared/data/criteo")
def test_every_real_criteo_row_parses(schema):
    records = list(log_records(CRITEO_FILES, schema))
    assert len(records) == 10_381
    assert all(r.reason is None and r.events == 1 for r in records)
    times = [decode_event(r.value, schema).ts for r in records[:3]]
    assert times == [BASE_TS_MS, BASE_TS_MS + 1, BASE_TS_MS + 2]  # file order is time order


def test_bundles_count_events_and_pass_bad_lines(schema, tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("\n".join([LINE] * 5 + ["bad"] + [LINE] * 2) + "\n")
    json_records = list(log_records([path], schema, bundle=3))
    assert sorted((r.reason is None, r.events) for r in json_records) == [(False, 0), (True, 1), (True, 3), (True, 3)]
    assert next(r for r in json_records if r.events == 3).value.count(b"\n") == 2
    arrow_records = [r for r in log_records([path], schema, bundle=4, fmt="arrow") if r.reason is None]
    assert [r.events for r in arrow_records] == [4, 3] and is_arrow_bundle(arrow_records[0].value)
    batch, rejected = featurize_arrow_bundle(RawRecord(0, 0, arrow_records[0].value), schema)
    assert not rejected and batch.event_ids == ("a:0", "a:1", "a:2", "a:3")


def test_json_lines_are_json_for_any_value():
    table = pa.table({"event_id": ['a"b', "c\\d", None, "e\nf"], "x": pa.array([1.5, None, 1e20, -2.0])})
    rows = [orjson.loads(line) for line in json_lines(table)]
    assert rows == table.to_pylist()


def test_an_avazu_csv_replays_with_no_code_but_its_schema(tmp_path):
    schema = load_schema("avazu")
    path = avazu_csv(tmp_path / "train.csv", rows=50, bad_rows=(7, 20))
    records = list(log_records([path], schema))
    good = [r for r in records if r.reason is None]
    bad = [r for r in records if r.reason is not None]
    assert len(good) == 48 and len(bad) == 2
    # the column and the format it failed, not the event field's rule (a user reads the log's words)
    assert bad[0].reason == "train:7: ts: the log's column 'hour' does not parse as its [source] time_format '%y%m%d%H'"
    assert bad[1].reason == f"train:20: {rules.reason('click', rules.LABEL)}"
    event = decode_event(good[0].value, schema)
    assert event.event_id == "10000000000000000000" and event.ts == 1413849600000  # 14102100: 2014-10-21 00h
    assert event.cats[schema.categorical_fields.index("site_id")].startswith("site")
    batch, rejected = featurize_records([RawRecord(0, i, r.value) for i, r in enumerate(good)], schema)
    assert len(batch) == 48 and not rejected and batch.dense.shape == (48, 0)


def test_jsonl_logs_and_explicit_columns(tmp_path):
    base = {
        "name": "tiny",
        "label": "y",
        "event_id": "id",
        "timestamp": "t",
        "categorical_encoding": "string",
        "integer_fields": ["n"],
        "float_fields": ["price"],
        "categorical_fields": ["ad"],
    }
    jsonl = schema_from_dict(
        {**base, "source": {"format": "jsonl", "event_id": "id", "time": "sec", "time_format": "epoch_s"}}
    )
    path = tmp_path / "log.jsonl"
    path.write_text(
        '{"id": "a", "sec": 10, "y": 1, "n": 3, "price": 0.5, "ad": "x"}\n'
        '{"id": "b", "sec": 11, "y": 0, "n": null, "price": 1, "ad": null}\n'
        "not json\n"
    )
    records = list(log_records([path], jsonl))
    events = [decode_event(r.value, jsonl) for r in records if r.reason is None]
    assert [(e.event_id, e.ts, e.ints, e.floats) for e in events] == [
        ("a", 10_000, (3,), (0.5,)),
        ("b", 11_000, (None,), (1.0,)),
    ]
    assert [r.reason.split(": ", 1)[1][:20] for r in records if r.reason] == ["record: not valid JS"]
    csv = schema_from_dict(
        {
            **base,
            "source": {"format": "csv", "columns": ["id", "t", "y", "n", "price", "ad"], "event_id": "id", "time": "t"},
        }
    )
    path = tmp_path / "log.csv"
    path.write_text("a,5,1,2,0.25,x\nb,6,0,,abc,y\n")
    records = list(log_records([path], csv))
    (good,) = [r for r in records if r.reason is None]
    assert decode_event(good.value, csv).floats == (0.25,)
    assert [r.reason for r in records if r.reason] == [f"log:1: {rules.reason('price', rules.FLOAT)}"]


def test_a_bad_source_table_names_the_key(schema):
    base = {
        "name": "x",
        "label": "y",
        "event_id": "id",
        "timestamp": "t",
        "categorical_encoding": "string",
        "integer_fields": [],
        "categorical_fields": ["a"],
    }
    with pytest.raises(SchemaError, match="source.format='xml'"):
        schema_from_dict({**base, "source": {"format": "xml"}})
    with pytest.raises(SchemaError, match=r"unknown key\(s\) \['sep'\] in \[source\]"):
        schema_from_dict({**base, "source": {"sep": ","}})
    with pytest.raises(SchemaError, match="source.time_format='hours'"):
        schema_from_dict({**base, "source": {"time_format": "hours"}})
    # [source] changes how a log is read, not what the model sees: the hash ignores it
    assert schema_from_dict({**base, "source": {"format": "csv", "header": True}}).hash == schema_from_dict(base).hash


def test_replay_records_are_frozen(schema, tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(LINE + "\n")
    record = next(log_records([path], schema))
    assert isinstance(record, ReplayRecord)
    with pytest.raises(AttributeError):
        record.events = 2  # type: ignore[misc]
    assert next(read_log([path], schema)).good.num_rows == 1
