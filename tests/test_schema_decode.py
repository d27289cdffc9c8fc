import orjson
import pytest

from stream.decode import decode_event, event_from_mapping, split_bundle
from stream.errors import DecodeError, SchemaError
from stream.schema import load_schema, schema_from_dict
from tests.helpers import criteo_event


def test_valid_event_decodes_every_field(schema):
    event = decode_event(orjson.dumps(criteo_event(3, I5=None, C7="")), schema)
    assert event.event_id == "e3" and event.label == 1
    assert len(event.ints) == 13 and len(event.cats) == 26
    assert event.ints[4] is None and event.cats[6] is None
    assert event.cats[0] == criteo_event(3)["C1"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"I3": "12"}, "I3"),
        ({"I3": 1.5}, "I3"),
        ({"I3": True}, "I3"),
        ({"C2": "xyz"}, "C2"),
        ({"C2": "123456789"}, "C2"),
        ({"C2": 5}, "C2"),
        ({"label": 2}, "label"),
        ({"ts": -1}, "ts"),
        ({"event_id": ""}, "event_id"),
    ],
)
def test_bad_values_name_the_field(schema, change, field):
    with pytest.raises(DecodeError) as info:
        event_from_mapping(criteo_event(1, **change), schema)
    assert info.value.field == field


def test_missing_field_is_named(schema):
    event = criteo_event(1)
    del event["C26"]
    with pytest.raises(DecodeError, match="C26: missing field"):
        event_from_mapping(event, schema)


def test_label_optional_for_serving_only(schema):
    event = criteo_event(1)
    del event["label"]
    with pytest.raises(DecodeError) as info:
        event_from_mapping(event, schema)
    assert info.value.field == "label"
    assert event_from_mapping(event, schema, require_label=False).label is None


def test_not_json_and_not_object(schema):
    with pytest.raises(DecodeError, match="not valid JSON"):
        decode_event(b"{oops", schema)
    with pytest.raises(DecodeError, match="expected a JSON object"):
        decode_event(b"[1, 2]", schema)


def test_bundle_splits_lines():
    assert list(split_bundle(b'{"a":1}\n\n{"b":2}\n')) == [b'{"a":1}', b'{"b":2}']


def test_schema_hash_is_stable_and_content_based(schema):
    assert load_schema("criteo").hash == schema.hash
    content = {
        "name": "criteo",
        "label": "label",
        "event_id": "event_id",
        "timestamp": "ts",
        "categorical_encoding": "hex32",
        "integer_fields": list(schema.integer_fields),
        "categorical_fields": list(schema.categorical_fields),
    }
    assert schema_from_dict(content).hash == schema.hash
    content["categorical_fields"] = content["categorical_fields"][:-1]
    assert schema_from_dict(content).hash != schema.hash


def test_schema_errors_name_the_key(tmp_path):
    with pytest.raises(SchemaError, match="unknown key"):
        schema_from_dict({"nam": "x"})
    with pytest.raises(SchemaError, match="categorical_encoding"):
        schema_from_dict(
            {
                "name": "x",
                "label": "l",
                "event_id": "i",
                "timestamp": "t",
                "categorical_encoding": "md5",
                "integer_fields": [],
                "categorical_fields": [],
            }
        )
    with pytest.raises(SchemaError, match="no file"):
        load_schema(tmp_path / "nope.toml")
