"""The /predict body parsed without HTTP: the events in order, or a 422 naming each bad field."""

import orjson

from serving.request import Refusal, parse_predict_body
from tests.helpers import criteo_event


def unlabelled(i: int, **changes: object) -> dict[str, object]:
    event = criteo_event(i, **changes)
    event.pop("label")
    return event


def test_one_event_or_a_list_and_a_missing_time_is_now(schema):
    one = parse_predict_body(orjson.dumps(unlabelled(0)), schema, 10, now_ms=5)
    assert not isinstance(one, Refusal) and [e.event_id for e in one] == ["e0"]
    timeless = {k: v for k, v in unlabelled(1).items() if k != schema.timestamp}
    many = parse_predict_body(orjson.dumps([unlabelled(0), timeless]), schema, 10, now_ms=5)
    assert not isinstance(many, Refusal) and [e.event_id for e in many] == ["e0", "e1"] and many[1].ts == 5


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
