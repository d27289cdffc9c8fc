"""The joiner's pieces without Kafka: reading impressions and clicks (bad ones get their reason),
the state's encoding and its atomic chunk commit surviving a reopen, and `replay --clicks`'s
split of labelled rows into impressions and delayed clicks, in time order and co-partitioned."""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa
import pytest

from stream.formats.arrow import encode_table, event_table
from stream.join.inputs import ClickFields, read_clicks, read_impressions
from stream.join.outputs import event_records, read_events
from stream.join.policy import Click, Emission, Entry, Impression, RowRef
from stream.join.state import PartitionState, PendingOutput, Progress, decode_entry, encode_entry
from stream.kafka.partitioner import murmur2_partition
from stream.produce.clicks import ClickDelays, interleave, split_clicks
from stream.records import RawRecord
from tests.helpers import criteo_event


def impression(i: int, **changes: object) -> dict[str, object]:
    event = criteo_event(i, **changes)
    event.pop("label")
    return event


def test_impressions_json_lines_and_arrow_give_the_same_events_and_the_same_reasons(schema):
    good = [impression(i) for i in range(3)]
    bad = [impression(9, event_id=""), impression(10, ts=-5), {**impression(11), "label": 1}]
    lines = b"\n".join(orjson.dumps(e) for e in [*good, *bad])
    from_json, rejected_json, no_bundle = read_impressions(RawRecord(0, 7, lines), schema)
    table = event_table([{**e, "label": e.get("label")} for e in [*good, *bad]], schema)
    from_arrow, rejected_arrow, bundle = read_impressions(RawRecord(0, 7, encode_table(table)), schema)
    assert no_bundle is None and bundle is not None
    assert [i.payload for i in from_arrow] == [RowRef(7, 0), RowRef(7, 1), RowRef(7, 2)]  # rows, not copies
    for got in (from_json, from_arrow):
        assert [(i.impression_id, i.ts) for i in got] == [(str(e["event_id"]), e["ts"]) for e in good]
        emitted = [Emission(i.impression_id, i.ts, n % 2, "final", i.payload) for n, i in enumerate(got)]
        records = event_records(emitted, "label", {7: bundle}.__getitem__, 1024, 1 << 20)
        events = [e for _, value in records for e in read_events(value)]
        assert events == [{**e, "label": n % 2} for n, e in enumerate(good)]
        scattered = [emitted[2], emitted[0]]  # not a run of rows: taken, in the order emitted
        records = event_records(scattered, "label", {7: bundle}.__getitem__, 1024, 1 << 20)
        assert [e for _, value in records for e in read_events(value)] == [
            {**good[2], "label": 0},
            {**good[0], "label": 0},
        ]
    reasons = [
        "event_id: must be a non-empty string or an integer",
        "ts: must be a non-negative integer (ms) below 2^62",
        "label: an impression carries no label: the joiner sets it from the clicks",
    ]
    assert [r.reason for r in rejected_json] == reasons
    assert [r.reason for r in rejected_arrow] == reasons
    assert all(r.offset == 7 for r in rejected_json + rejected_arrow)


def test_a_record_that_is_no_impression_at_all_is_one_reason(schema):
    for value, start in ((b"not json", "record: not JSON"), (b"[1, 2]", "record: not a JSON object")):
        good, bad, _ = read_impressions(RawRecord(1, 2, value), schema)
        assert good == [] and len(bad) == 1 and bad[0].reason.startswith(start)
    table = pa.table({"ts": pa.array([1, 2])})
    _, bad, bundle = read_impressions(RawRecord(1, 3, encode_table(table)), schema)
    assert bundle is None  # nothing points into it: not stored
    assert [b.reason for b in bad] == ["event_id: missing field (no such column in the Arrow bundle)"]


def test_clicks_are_read_with_the_named_fields_and_bad_ones_rejected():
    fields = ClickFields("imp", "at")
    value = b'{"imp": "a", "at": 5}\n{"imp": "", "at": 5}\n{"imp": "b"}\n{"imp": "c", "at": true}'
    good, bad = read_clicks(RawRecord(0, 1, value), fields)
    assert good == [Click("a", 5)]
    assert [b.reason for b in bad] == [
        "imp: must be a non-empty string or an integer",
        "at: missing field",
        "at: must be a non-negative integer (ms) below 2^62",
    ]


def test_entries_round_trip_and_a_chunk_commit_survives_a_reopen(tmp_path):
    entries = [
        Entry(Impression("a", 10, b'{"x":1}'), clicked=True, emitted=True, closed=False, due=99),
        Entry(early_click=Click("b", 7), due=50),
        Entry(Impression("c", 3, b""), emitted=True, closed=True, due=1000),
        Entry(Impression("d", 4, RowRef(12, 7)), emitted=True, due=64),
    ]
    for key, entry in zip("abcd", entries, strict=True):
        assert decode_entry(key, encode_entry(entry)) == entry
    state = PartitionState(tmp_path / "p0")
    state.stage("a", entries[0])
    state.stage("b", entries[1])
    tables = {offset: pa.table({"ts": pa.array([offset, offset + 1])}) for offset in (12, 13, 14)}
    for offset, table in tables.items():
        state.put_bundle(offset, offset + 1, encode_table(table), table)
    outputs = [
        PendingOutput("events", b"a", b'{"x":1,"label":1}'),
        PendingOutput("dlq", b"", b"?", (("reason", b"r"),)),
    ]
    state.commit(Progress(5, 3, 10, 1), outputs)
    state.stage("b", None)  # staged, never committed: a crash forgets it
    state.close()
    reopened = PartitionState(tmp_path / "p0")
    assert reopened.progress == Progress(5, 3, 10, 1)
    assert reopened.pending_outputs() == outputs
    assert dict(reopened.entries()) == {"a": entries[0], "b": entries[1]}
    reopened.preload(["a", "zz"])
    assert reopened.get("a") == entries[0] and reopened.get("zz") is None
    assert all(reopened.bundle(offset).equals(table) for offset, table in tables.items())  # read from disk
    reopened.commit(Progress(6, 3, 10, 2), [], bundles_before=15)  # 12 and 13: every row older than 15
    reopened.close()
    again = PartitionState(tmp_path / "p0")
    assert again.bundle(14).equals(tables[14])
    with pytest.raises(KeyError):
        again.bundle(13)


def test_a_changelogged_state_says_every_write_and_a_database_rebuilt_from_it_is_the_same(tmp_path):
    """ "group" joiners: each commit's keys go out as changelog records (deletes as tombstones) with
    the chunk's outputs, and also into the pending outputs a crash sends again; a database loaded
    from every record so far holds what the original holds (entries, bundles, progress)."""
    state = PartitionState(tmp_path / "p0", changelog=("app.state", 1))
    state.stage("a", Entry(Impression("a", 1, b'{"I1":1}'), due=61))
    state.stage("b", Entry(early_click=Click("b", 7), due=50))
    table = pa.table({"ts": pa.array([3, 4])})
    state.put_bundle(12, 4, encode_table(table), table)
    events = [PendingOutput("events", b"a", b'{"x":1,"label":0}', (), 1)]
    first = state.commit(Progress(5, 3, 10, 1, (), "t1", ""), events)
    assert first[:1] == events and {o.topic for o in first[1:]} == {"app.state"}
    assert {o.partition for o in first[1:]} == {1} and first[-1].key == b"m"  # the progress last
    state.stage("b", None)
    second = state.commit(Progress(6, 4, 10, 2, (), "t2", "t1"), [], bundles_before=100)
    assert [(o.key, o.value) for o in second if o.value is None] == [(b"eb", None), (second[1].key, None)]
    assert state.pending_outputs() == second  # tombstones survive the pending outputs' encoding
    records = [(o.key, o.value) for o in first[1:] + second]
    rebuilt = PartitionState(tmp_path / "rebuilt")
    rebuilt.load(records)
    rebuilt.close()
    rebuilt = PartitionState(tmp_path / "rebuilt")
    assert rebuilt.progress == state.progress == Progress(6, 4, 10, 2, (), "t2", "t1")
    assert dict(rebuilt.entries()) == dict(state.entries()) == {"a": Entry(Impression("a", 1, b'{"I1":1}'), due=61)}
    with pytest.raises(KeyError):
        rebuilt.bundle(12)  # dropped by the second commit, on both
    plain = PartitionState(tmp_path / "plain")  # no changelog: the outputs as given
    assert plain.commit(Progress(1, 1, 1, 1), events) == events


def test_replay_clicks_splits_rows_into_impressions_and_later_clicks_each_in_its_partition(schema):
    events = [criteo_event(i, label=i % 3 == 0) for i in range(300)]
    events = [{**e, "label": int(e["label"])} for e in events]
    split = split_clicks(event_table(events, schema), schema, np.random.default_rng(0), ClickDelays(), 10.0, 1000)
    assert schema.label not in split.impressions.column_names
    assert split.impressions.column("ts").to_pylist() == [1000 + 100 * i for i in range(300)]
    assert sorted(split.click_ids) == sorted(str(e["event_id"]) for e in events if e["label"])
    imp_ts = dict(zip(split.impressions.column("event_id").to_pylist(), split.impressions.column("ts").to_pylist()))
    assert all(t >= imp_ts[k] for k, t in zip(split.click_ids, split.click_ts.tolist()))
    records = list(interleave([split], schema, "imp", "clk", 3, bundle=20, fmt="arrow"))
    seen: set[str] = set()
    for record in records:
        if record.topic == "clk":
            click = orjson.loads(record.value)
            assert record.partition == murmur2_partition(click["impression_id"].encode(), 3)
            assert click["impression_id"] in seen  # its impression went before it
        else:
            table = pa.ipc.open_stream(record.value).read_all()
            ids = table.column("event_id").to_pylist()
            assert {murmur2_partition(i.encode(), 3) for i in ids} == {record.partition}  # one partition a bundle
            seen.update(ids)
    assert seen == set(imp_ts) and sum(r.topic == "clk" for r in records) == len(split.click_ids)


def test_murmur2_matches_kafkas_java_partitioner_on_known_keys():
    # Kafka's own test vectors for Utils.murmur2 (as unsigned ints), through toPositive % 2^31
    vectors = {b"21": -973932308, b"foobar": -790332482, b"a-little-bit-long-string": -985981536}
    for key, signed in vectors.items():
        assert murmur2_partition(key, 1 << 31) == (signed & 0x7FFFFFFF)


def test_the_featurizer_reads_the_joiners_arrow_bundles_as_its_json_lines(schema):
    """Downstream nothing changes with the impressions' format: the featurizer makes the same
    features of the Arrow bundle the joiner emits as of the JSON lines it emits for the same events."""
    from stream.featurizer.ingest import featurize_records

    events = [impression(i) for i in range(50)]
    json_in, _, _ = read_impressions(RawRecord(0, 3, b"\n".join(orjson.dumps(e) for e in events)), schema)
    table = event_table([{**e, "label": None} for e in events], schema)
    arrow_in, _, bundle = read_impressions(RawRecord(0, 3, encode_table(table)), schema)
    outputs = []
    for got in (json_in, arrow_in):
        emitted = [Emission(i.impression_id, i.ts, int(n % 3 == 0), "final", i.payload) for n, i in enumerate(got)]
        records = event_records(emitted, schema.label, {3: bundle}.__getitem__, 1024, 1 << 20)
        assert len(records) == 1
        batch, rejected = featurize_records([RawRecord(0, 0, records[0][1])], schema)
        assert rejected == []
        outputs.append(batch)
    from_json, from_arrow = outputs
    assert from_arrow.labels.tolist() == from_json.labels.tolist() == [float(n % 3 == 0) for n in range(50)]
    assert np.array_equal(from_arrow.ids, from_json.ids) and np.allclose(from_arrow.dense, from_json.dense)
    assert from_arrow.event_ids == from_json.event_ids and np.array_equal(from_arrow.ts, from_json.ts)


def test_a_one_click_record_reads_as_the_same_click_inside_json_lines():
    """The short path for the usual record (one good click) equals the long one, good or bad."""
    fields = ClickFields()
    values = [
        b'{"impression_id": "a", "ts": 5}',
        b'{"impression_id": 12, "ts": 5}',
        b'{"impression_id": "a", "ts": true}',
        b'{"impression_id": "a", "ts": -1}',
        b'{"impression_id": "' + b"x" * 300 + b'", "ts": 5}',
        b'{"impression_id": ""}',
        b'{"ts": 5}',
        b"[1]",
        b"nope",
    ]
    for value in values:
        alone_good, alone_bad = read_clicks(RawRecord(0, 1, value), fields)
        twice_good, twice_bad = read_clicks(RawRecord(0, 1, value + b"\n" + value), fields)
        assert twice_good == alone_good * 2, value
        assert [b.reason for b in twice_bad] == [b.reason for b in alone_bad] * 2, value


def test_replay_clicks_cuts_bundles_that_would_span_more_than_the_lateness_allowance(schema):
    """A bundle's newest impression moves the joiner's watermark; clicks are sent between bundles, so
    a bundle spanning more event time than the allowance would let a window close before its click
    came. With max_span_ms no bundle spans more, and a click follows every impression of its time."""
    events = [{**criteo_event(i, label=i % 4 == 0), "label": int(i % 4 == 0)} for i in range(600)]
    split = split_clicks(event_table(events, schema), schema, np.random.default_rng(1), ClickDelays(), 20.0, 0)
    for span in (None, 5_000):
        records = list(interleave([split], schema, "imp", "clk", 2, bundle=100, fmt="arrow", max_span_ms=span))
        spans = []
        for record in records:
            if record.topic == "imp":
                ts = pa.ipc.open_stream(record.value).read_all().column("ts").to_pylist()
                spans.append(max(ts) - min(ts))
        assert sum(r.events for r in records if r.topic == "imp") == 600
        if span is None:
            assert max(spans) > 5_000  # 100 rows of one partition at 20/s: ~10 s of event time
        else:
            assert max(spans) <= span


@pytest.mark.parametrize(
    "value",
    [
        b'{"event_id": "a", "ts": 5, "I1": 3}',
        b'  {"event_id": 17, "ts": 0}  ',
        b'{"event_id": "a", "ts": 5, "label": null}',
        b'{"event_id": "a", "ts": 5, "label": 1}',
        b'{"event_id": true, "ts": 5}',
        b'{"event_id": "", "ts": 5}',
        b'{"event_id": "' + b"x" * 300 + b'", "ts": 5}',
        b'{"event_id": "a", "ts": "5"}',
        b'{"event_id": "a", "ts": -1}',
        b'{"ts": 5}',
        b"[1, 2]",
        b"not json",
        b'{"event_id": "a", "ts": 5}\n{"event_id": "b", "ts": 6}',
    ],
)
def test_the_short_read_of_one_json_impression_is_the_long_reads_answer(schema, value):
    from stream.join.inputs import one_impression

    short = one_impression(value, schema)
    good, bad, _ = read_impressions(RawRecord(0, 9, value), schema)
    if short is not None:
        assert good == [short] and bad == []
    else:  # the long way: a reason, a label to drop, or several lines
        assert bad or len(good) != 1 or b"label" in value


def test_records_on_another_partition_are_moved_as_their_own_kind_and_read_back_the_same(schema):
    """What the joiner sends to an id's own partition (stream/join/reroute.py) reads back as the same
    impressions and clicks: JSON lines, the rows of an Arrow bundle, click records."""
    from stream.join.reroute import moved_value, split_by_home

    events = [{k: v for k, v in criteo_event(i).items() if k != "label"} for i in range(6)]
    homes = [0, 1, 0, 2, 1, 0]
    json_items, _, _ = read_impressions(RawRecord(0, 5, b"\n".join(orjson.dumps(e) for e in events)), schema)
    table = event_table(events, schema)
    arrow_items, _, bundle = read_impressions(RawRecord(0, 6, encode_table(table)), schema)
    fields = ClickFields("impression_id", "ts")
    clicks = [Click(str(e["event_id"]), int(e["ts"]) + 5) for e in events]
    for items, impressions, carried in ((json_items, True, None), (arrow_items, True, bundle), (clicks, False, None)):
        kept, away = split_by_home(items, homes, 0)
        assert [i.impression_id for i in kept] == [items[k].impression_id for k in (0, 2, 5)]
        assert sorted(away) == [1, 2]
        for q, moved in away.items():
            value = moved_value(moved, impressions, carried, fields)
            if impressions:
                back, bad, _ = read_impressions(RawRecord(q, 0, value), schema)
                assert [(i.impression_id, i.ts) for i in back] == [(m.impression_id, m.ts) for m in moved]
            else:
                back_clicks, bad = read_clicks(RawRecord(q, 0, value), fields)
                assert back_clicks == list(moved)
            assert bad == []


def test_a_group_joiner_keeps_a_current_database_and_resends_a_chunk_ahead(tmp_path):
    """open_state's first two answers (the third, a restore, reads the changelog from Kafka:
    tests/integration/test_join_group.py): the committed token is the database's -> kept as is;
    it is the database's previous one -> kept, its last chunk to be sent again."""
    from stream.join.group import open_state
    from stream.kafka.settings import KafkaSettings

    state = PartitionState(tmp_path / "p3", changelog=("app.state", 3))
    state.commit(Progress(1, 1, 5, 1, (), "t1", ""), [])
    sent = state.commit(Progress(2, 1, 5, 2, (), "t2", "t1"), [PendingOutput("events", b"k", b"v", (), 3)])
    state.close()
    for committed, resend in (("t2", False), ("t1", True)):
        reopened, again = open_state(tmp_path / "p3", committed, ("app.state", 3), KafkaSettings())
        assert (reopened.progress.token, again) == ("t2", resend)
        assert reopened.pending_outputs() == sent
        reopened.close()
