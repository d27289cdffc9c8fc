"""List (multi-valued) fields end to end: the same ids on every path, the same reasons for bad
lists, the wire format, pooling, serving == training, and a synthetic list field worth learning."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson
import pytest
import torch

from serving.loader import load_served_model
from serving.predict import predict_events
from stream import rules
from stream.featurizer.bundle import featurize_arrow_bundle
from stream.featurizer.decode import decode_event, event_from_mapping
from stream.featurizer.featurize import FIELD_SHIFT, featurize, missing_id
from stream.featurizer.ingest import featurize_records
from stream.formats.arrow import encode_event_bundle
from stream.formats.batch_codec import decode_batch, encode_batch
from stream.produce.replay import log_records, synthetic_records
from stream.produce.synthetic import SyntheticCriteo
from stream.records import FeatureBatch, RawRecord
from stream.schema import load_schema
from tests.helpers import criteo_event
from trainer.batch import batch_from_features
from trainer.metrics import auc_exact
from trainer.settings import ModelSettings, StoreSettings, TrainerSettings
from trainer.step import forward
from trainer.trainer import Trainer

TAGS = load_schema("criteo_tags")
TAG_FIELD = TAGS.num_sparse  # the list field's index: after the single-id fields


def tagged(i: int, tags: object) -> dict[str, object]:
    return {**criteo_event(i), "tags": tags}


def tsv_line(event: dict[str, object]) -> str:
    fields = [event["label"], *(event[f] for f in TAGS.integer_fields), *(event[f] for f in TAGS.categorical_fields)]
    tags = event["tags"]
    cells = ["" if v is None else str(v) for v in fields] + ["|".join(tags) if isinstance(tags, list) else ""]
    return "\t".join(cells) + "\n"


def test_every_path_gives_a_list_the_same_ids(tmp_path):
    events = [tagged(0, ["0a", "ff"]), tagged(1, []), tagged(2, None), tagged(3, ["", "0a"]), tagged(4, ["1"] * 3)]
    from_json = featurize([event_from_mapping(e, TAGS) for e in events], TAGS)
    from_bundle, rejected = featurize_arrow_bundle(RawRecord(0, 0, encode_event_bundle(events, TAGS)), TAGS)
    assert not rejected
    log = tmp_path / "day.txt"
    log.write_text("".join(tsv_line(e) for e in events))
    records = [RawRecord(0, i, r.value) for i, r in enumerate(log_records([log], TAGS))]
    from_log, rejected = featurize_records(records, TAGS)
    assert not rejected
    starts, ids = from_json.lists[0]
    field = TAG_FIELD << FIELD_SHIFT
    assert starts.tolist() == [0, 2, 3, 4, 5, 8]  # an event without values has one id: the missing id
    assert ids[:5].tolist() == [field | 0x0A, field | 0xFF, missing_id(TAG_FIELD), missing_id(TAG_FIELD), field | 0x0A]
    assert ids[5:].tolist() == [field | 1] * 3
    for other in (from_bundle, from_log):
        np.testing.assert_array_equal(other.lists[0][0], starts)
        np.testing.assert_array_equal(other.lists[0][1], ids)
        np.testing.assert_array_equal(other.ids, from_json.ids)


@pytest.mark.parametrize(
    ("tags", "rule", "paths"),
    [
        (["zz"], rules.CATEGORY_HEX, ("json", "arrow", "tsv")),
        (["1"] * (rules.MAX_LIST_VALUES + 1), rules.LIST_LONG, ("json", "arrow", "tsv")),
        ("0a", rules.LIST, ("json",)),
        ([1, 2], rules.LIST, ("json",)),
    ],
)
def test_a_bad_list_gets_the_same_reason_on_every_path(tmp_path, tags, rule, paths):
    event = tagged(5, tags)
    got = {}
    if "json" in paths:
        got["json"] = featurize_records([RawRecord(0, 0, orjson.dumps(event))], TAGS)[1][0].reason
    if "arrow" in paths:
        bundle = encode_event_bundle([tagged(6, ["0a"]), event], TAGS)
        got["arrow"] = featurize_arrow_bundle(RawRecord(0, 0, bundle), TAGS)[1][0].reason
    if "tsv" in paths:
        log = tmp_path / "day.txt"
        log.write_text(tsv_line(event))
        got["tsv"] = next(r.reason for r in log_records([log], TAGS) if r.reason).split(": ", 1)[1]
    assert got == dict.fromkeys(paths, rules.reason("tags", rule))


def test_lists_travel_the_wire_and_survive_concat_and_split():
    events, _ = SyntheticCriteo(TAGS).generate(300)
    batch = featurize([event_from_mapping(e, TAGS) for e in events], TAGS)
    back = decode_batch(encode_batch(batch))
    np.testing.assert_array_equal(back.lists[0][0], batch.lists[0][0])
    np.testing.assert_array_equal(back.lists[0][1], batch.lists[0][1])
    again = FeatureBatch.concat(batch.split(37))
    np.testing.assert_array_equal(again.lists[0][0], batch.lists[0][0])
    np.testing.assert_array_equal(again.lists[0][1], batch.lists[0][1])
    part = batch.slice(10, 12)
    starts = batch.lists[0][0]
    np.testing.assert_array_equal(part.lists[0][0], starts[10:13] - starts[10])
    np.testing.assert_array_equal(part.lists[0][1], batch.lists[0][1][starts[10] : starts[12]])


@dataclass
class _Config:
    list_pooling: tuple[str, ...]


class _Rows:
    """A stand-in model that returns what it is given: the (B, F + L, E+1) rows."""

    reads_factors = True

    def __init__(self, pooling: str) -> None:
        self.config = _Config((pooling,))

    def __call__(self, rows: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return rows


@pytest.mark.parametrize("pooling", ["mean", "sum"])
def test_a_list_field_is_the_pooled_rows_of_its_values(pooling):
    trainer = Trainer(TAGS, TrainerSettings(model=ModelSettings(embed_dim=4, hidden=(8,)), threads=1))
    events = [tagged(0, ["0a", "0b", "0c"]), tagged(1, ["0b"]), tagged(2, [])]
    batch = batch_from_features([featurize([event_from_mapping(e, TAGS) for e in events], TAGS)])
    rows, _, _ = forward(_Rows(pooling), trainer.table, batch)  # type: ignore[arg-type]
    assert rows.shape == (3, TAGS.num_fields, 5)

    def row(value: int) -> torch.Tensor:
        single = batch_from_features([featurize([event_from_mapping(tagged(9, [f"{value:x}"]), TAGS)], TAGS)])
        return forward(_Rows("sum"), trainer.table, single)[0][0, -1]

    three = row(0x0A) + row(0x0B) + row(0x0C)
    torch.testing.assert_close(rows[0, -1], three / 3 if pooling == "mean" else three)
    torch.testing.assert_close(rows[1, -1], row(0x0B))
    torch.testing.assert_close(rows[:, :-1], forward(_Rows(pooling), trainer.table, batch)[0][:, :-1])


@pytest.mark.parametrize("min_count", [1, 2])
def test_serving_a_list_field_returns_the_trainers_predictions(tmp_path, min_count):
    generator = SyntheticCriteo(TAGS)
    settings = TrainerSettings(
        model=ModelSettings(embed_dim=4, hidden=(16,)), store=StoreSettings(min_count=min_count), threads=1
    )
    trainer = Trainer(TAGS, settings)
    for _ in range(4):
        events, _ = generator.generate(256)
        trainer.learn(batch_from_features([featurize([event_from_mapping(e, TAGS) for e in events], TAGS)]))
    served = load_served_model(trainer.checkpoints.save(tmp_path / "snapshots"), "1", TAGS)
    events, _ = generator.generate(200)
    request = [{k: v for k, v in e.items() if k != "label"} for e in events]  # tags as a JSON array
    decoded = [decode_event(orjson.dumps(e), TAGS, require_label=False) for e in request]
    expected = trainer.predict(batch_from_features([featurize(decoded, TAGS)]))
    np.testing.assert_allclose(predict_events(served, decoded, TAGS), expected, atol=1e-5)


def test_the_synthetic_list_field_is_worth_learning():
    """The generator's tags move the true CTR; a model that reads them beats one that cannot."""
    events, _ = SyntheticCriteo(TAGS).generate(24_000)
    aucs = {}
    for schema in (TAGS, load_schema("criteo")):  # the same events, with and without the list field
        parts = [
            featurize_records([RawRecord(0, 0, r.value)], schema)[0]
            for r in synthetic_records(events, schema, 4096, "arrow")
        ]
        features = FeatureBatch.concat(parts)
        torch.manual_seed(0)
        trainer = Trainer(schema, TrainerSettings(threads=1))
        probs = np.concatenate([trainer.learn(batch_from_features([p])).probs for p in features.split(256)])
        aucs[schema.name] = auc_exact(features.labels[12_000:], probs[12_000:])
    assert aucs["criteo-tags"] > aucs["criteo"] + 0.01, aucs
