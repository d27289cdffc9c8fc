"""The /predict body parsed without HTTP: the events in order, or a 422 naming each bad field."""

import orjson

from serving.request import Refusal, parse_clicks, parse_predict_body, parse_shown
from tests.helpers import unlabelled


def test_one_event_or_a_list_and_a_missing_time_is_now(schema):
    one = parse_predict_body(orjson.dumps(unlabelled(0)), schema, 10, now_ms=5)
    assert not isinstance(one, Refusal) and [e.event_id for e in one.events] == ["e0"] and one.shown == [True]
    timeless = {k: v for k, v in unlabelled(1).items() if k != schema.timestamp}
    many = parse_predict_body(orjson.dumps([unlabelled(0), timeless]), schema, 10, now_ms=5)
    assert not isinstance(many, Refusal) and [e.event_id for e in many.events] == ["e0", "e1"]
    assert many.events[1].ts == 5 and many.items[1][schema.timestamp] == 5  # what is logged is what was scored


def test_an_event_without_an_id_gets_one_and_shown_is_per_event_or_per_request(schema):
    idless = {k: v for k, v in unlabelled(0).items() if k != schema.event_id}
    got = parse_predict_body(orjson.dumps([idless, {**unlabelled(1), "shown": False}]), schema, 10, now_ms=5)
    assert not isinstance(got, Refusal)
    assigned = got.events[0].event_id
    assert len(assigned) == 32 and got.items[0][schema.event_id] == assigned and got.events[1].event_id == "e1"
    assert got.shown == [True, False] and "shown" not in got.items[1]
    assert parse_predict_body(orjson.dumps(idless), schema, 10, 5).events[0].event_id != assigned  # type: ignore[union-attr]
    deferred = parse_predict_body(orjson.dumps([unlabelled(0), {**unlabelled(1), "shown": True}]), schema, 10, 5, False)
    assert not isinstance(deferred, Refusal) and deferred.shown == [False, True]
    bad = parse_predict_body(orjson.dumps([unlabelled(0), {**unlabelled(1), "shown": "no"}]), schema, 10, 5)
    assert isinstance(bad, Refusal) and [d["loc"] for d in bad.detail] == [["body", 1, "shown"]]


def test_clicks_and_shown_bodies_one_or_many_with_each_bad_field_named():
    assert parse_clicks(b'{"impression_id": "a", "ts": 7}', now_ms=5, most=10) == [("a", 7)]
    assert parse_clicks(b'[{"impression_id": "a"}, {"impression_id": "b", "ts": 9}]', 5, 10) == [("a", 5), ("b", 9)]
    assert parse_shown(b'[{"impression_id": "a"}, {"impression_id": "b", "propensity": 0.25}]', 10) == [
        ("a", None),
        ("b", 0.25),
    ]
    cases = [
        (
            parse_clicks(b'[{"impression_id": "a", "ts": -1}, {"ts": 3}]', 5, 10),
            [["body", 0, "ts"], ["body", 1, "impression_id"]],
        ),
        (parse_clicks(b'{"impression_id": "", "ts": "soon"}', 5, 10), [["body", "impression_id"], ["body", "ts"]]),
        (parse_clicks(b'{"impression_id": "a", "time": 3}', 5, 10), [["body", "time"]]),
        (parse_clicks(b'["a"]', 5, 10), [["body", 0]]),
        (parse_clicks(b"[]", 5, 10), [["body"]]),
        (parse_clicks(b"{nope", 5, 10), [["body"]]),
        (parse_shown(b'{"impression_id": "a", "propensity": 0}', 10), [["body", "propensity"]]),
        (parse_shown(b'{"impression_id": "a", "propensity": true}', 10), [["body", "propensity"]]),
        (parse_shown(b'[{"impression_id": "a"}, {"impression_id": "b"}]', 1), [["body"]]),
    ]
    for got, locs in cases:
        assert isinstance(got, Refusal) and got.status == 422 and [d["loc"] for d in got.detail] == locs, got


def test_each_bad_field_is_named_by_its_place(schema):
    bad = parse_predict_body(orjson.dumps([unlabelled(0), unlabelled(1, C3="nothex!")]), schema, 10, now_ms=5)
    assert isinstance(bad, Refusal) and bad.status == 422
    assert [d["loc"] for d in bad.detail] == [["body", 1, "C3"]]
    alone = parse_predict_body(orjson.dumps(unlabelled(1, C3="nothex!")), schema, 10, now_ms=5)
    assert isinstance(alone, Refusal) and alone.detail[0]["loc"] == ["body", "C3"]


def test_not_json_and_too_many_events_are_refused_whole(schema):
    for body, start in ((b"{nope", "request body is not valid JSON"), (b"[]", "send 1 to 2 events, got 0")):
        got = parse_predict_body(body, schema, 2, now_ms=5)
        assert isinstance(got, Refusal) and got.detail[0]["loc"] == ["body"] and got.detail[0]["msg"].startswith(start)
    three = orjson.dumps([unlabelled(i) for i in range(3)])
    assert isinstance(parse_predict_body(three, schema, 2, now_ms=5), Refusal)
