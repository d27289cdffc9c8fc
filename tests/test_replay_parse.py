import gzip

import pytest

from stream.decode import event_from_mapping
from stream.errors import DecodeError
from stream.replay import criteo_file_lines, criteo_records, parse_criteo_line
from tests.helpers import CRITEO_FILES, needs_shared

LINE = "1\t5\t\t-1\t" + "\t".join(["2"] * 10) + "\t" + "\t".join(["68fd1e64"] * 25) + "\t"


def test_parse_line_keeps_missing_and_negative(schema):
    event = parse_criteo_line(LINE, schema, "f:0", 123)
    assert event["label"] == 1 and event["I1"] == 5 and event["I2"] is None and event["I3"] == -1
    assert event["C1"] == "68fd1e64" and event["C26"] is None
    assert event_from_mapping(event, schema).event_id == "f:0"


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("1\t2\t3", "expected 40"),
        ("x" + LINE[1:], "label"),
        (LINE.replace("\t5\t", "\t5.5\t", 1), "I1"),
        (LINE.replace("68fd1e64", "ZZZZZZZZ", 1), "C1"),
    ],
)
def test_bad_lines_are_explained(schema, line, reason):
    with pytest.raises(DecodeError, match=reason):
        parse_criteo_line(line, schema, "f:0", 0)


def test_gzip_and_bad_lines_become_rejects(schema, tmp_path):
    path = tmp_path / "day_0.gz"
    with gzip.open(path, "wt") as fh:
        fh.write(LINE + "\n" + "garbage\n" + LINE + "\n")
    records = list(criteo_records([path], schema))
    assert [r[2] is None for r in records] == [True, False, True]
    assert "line 2 of day_0" in records[1][2]
    assert records[0][0] == b"day_0:0" and records[2][0] == b"day_0:2"


def test_loop_repeats_with_new_event_ids(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text(LINE + "\n")
    lines = criteo_file_lines([path], loop=True)
    first, second = next(lines), next(lines)
    assert first[0] != second[0]


@needs_shared(bool(CRITEO_FILES), "../shared/data/criteo")
def test_every_real_criteo_row_parses(schema):
    records = list(criteo_records(CRITEO_FILES, schema))
    assert len(records) == 10_381
    assert all(reason is None and count == 1 for _, _, reason, count in records)


def test_bundles_count_events_and_pass_bad_lines(schema, tmp_path):
    from stream.bundle import is_arrow_bundle

    path = tmp_path / "a.txt"
    path.write_text("\n".join([LINE] * 5 + ["bad"] + [LINE] * 2) + "\n")
    json_records = list(criteo_records([path], schema, bundle=3))
    assert [(r[2] is None, r[3]) for r in json_records] == [(True, 3), (False, 0), (True, 3), (True, 1)]
    assert json_records[0][1].count(b"\n") == 2
    arrow_records = list(criteo_records([path], schema, bundle=4, fmt="arrow"))
    assert [r[3] for r in arrow_records] == [4, 0, 3] and is_arrow_bundle(arrow_records[0][1])
