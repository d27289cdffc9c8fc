"""Delta publications on disk: a base plus its deltas applied in place serve exactly what the trainer
predicts; a delta carries only the rows changed since the previous publication; a gap, another
base or a broken delta is refused and changes nothing."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from serving.errors import ServingError
from serving.loader import apply_delta, load_served_model
from serving.predict import predict_events
from stream.featurizer.decode import event_from_mapping
from stream.featurizer.featurize import featurize
from tests.helpers import criteo_event, small_tiered_settings, trained_trainer
from trainer.batch import batch_from_features
from trainer.snapshot import read_embeddings, read_manifest
from trainer.step import predict
from trainer.trainer import Trainer

PROBE = range(0, 700, 7)  # events the trainer saw and events it never saw


def learn_more(trainer, schema, first: int, steps: int) -> None:
    for s in range(steps):
        events = [event_from_mapping(criteo_event(first + s * 50 + i), schema) for i in range(50)]
        trainer.learn(batch_from_features([featurize(events, schema)]))


def publish_base(trainer, root):
    trainer.table.take_changed()
    return trainer.checkpoints.publish_to(root / "base", trainer.checkpoints.manifest())


def publish_delta(trainer, root, base_step: int, sequence: int):
    changed = trainer.table.take_changed()
    manifest = replace(trainer.checkpoints.manifest(), base_step=base_step, sequence=sequence)
    return trainer.checkpoints.publish_delta_to(root / f"delta-{sequence}", manifest, changed), changed


def probe_events(schema):
    return [event_from_mapping(criteo_event(i), schema, require_label=False) for i in PROBE]


def trainer_predictions(trainer, schema):
    events = [event_from_mapping(criteo_event(i), schema) for i in PROBE]
    return predict(trainer.model, trainer.table, batch_from_features([featurize(events, schema)]))


@pytest.mark.parametrize("store", ["ram", "rocksdb"])
def test_base_plus_deltas_serve_the_trainers_predictions(schema, tmp_path, store):
    """In RAM (sorted arrays + overlay) or in RocksDB (tables larger than serving's RAM), alike."""
    trainer = trained_trainer(schema, 4)
    base = publish_base(trainer, tmp_path)
    base_step = read_manifest(base).base_step
    assert base_step == trainer.step and read_manifest(base).sequence == 0
    served = load_served_model(base, "1", schema, rocksdb=tmp_path / "rocks" if store == "rocksdb" else None)
    assert type(served.table.tier).__name__ == {"ram": "FrozenTier", "rocksdb": "RocksTier"}[store]
    for sequence, first in ((1, 200), (2, 400)):  # new events: old rows change and new ids arrive
        learn_more(trainer, schema, first, 2)
        delta, changed = publish_delta(trainer, tmp_path, base_step, sequence)
        rows = read_embeddings(delta)
        assert rows["ids"].numpy().tolist() == changed.tolist()  # exactly the changed rows
        assert 0 < len(changed) < len(trainer.table)
        served = apply_delta(served, delta)
        assert served.sequence == sequence and served.manifest.step == trainer.step
    np.testing.assert_allclose(
        predict_events(served, probe_events(schema), schema), trainer_predictions(trainer, schema), rtol=1e-5, atol=1e-6
    )
    assert len(served.table) == len(trainer.table)


def test_a_delta_is_refused_out_of_order_or_for_another_base_and_changes_nothing(schema, tmp_path):
    trainer = trained_trainer(schema, 3)
    base = publish_base(trainer, tmp_path)
    base_step = trainer.step
    learn_more(trainer, schema, 150, 1)
    first, _ = publish_delta(trainer, tmp_path, base_step, 1)
    learn_more(trainer, schema, 200, 1)
    second, _ = publish_delta(trainer, tmp_path, base_step, 2)
    other_base, _ = publish_delta(trainer, tmp_path / "other", base_step + 1, 1)

    served = load_served_model(base, "1", schema)
    before = predict_events(served, probe_events(schema), schema)
    with pytest.raises(ServingError, match="gap"):
        apply_delta(served, second)
    with pytest.raises(ServingError, match="base of step"):
        apply_delta(served, other_base)
    with pytest.raises(ServingError, match="kind"):
        apply_delta(served, base)
    embeddings = first / "embeddings.safetensors"  # a truncated delta
    embeddings.write_bytes(embeddings.read_bytes()[:100])
    with pytest.raises(Exception, match="unreadable"):
        apply_delta(served, first)
    np.testing.assert_array_equal(predict_events(served, probe_events(schema), schema), before)


def test_a_merge_marks_rows_changed_for_the_next_delta(schema):
    """Rows written by a merge (put) count as changed, as rows a step updated do."""
    trainer = trained_trainer(schema, 1)
    trainer.table.take_changed()
    ids = np.array([5, 3, 9], dtype=np.int64)
    rows, _ = trainer.table.stored_rows(ids)
    trainer.table.put(ids, rows, step=trainer.step)
    assert trainer.table.take_changed().tolist() == [3, 5, 9]
    assert trainer.table.take_changed().tolist() == []


@pytest.mark.parametrize("store", ["ram", "rocksdb"])
def test_rows_the_trainer_expires_leave_serving_with_the_next_delta(schema, tmp_path, store):
    """TTL expiry in the trainer's hierarchy: the delta names the expired ids and serving drops
    them, so both read the unseen-id rule for them and still predict alike."""
    settings = small_tiered_settings(tmp_path / "t", device_bytes=1 << 22, ram_bytes=1 << 24, ttl_steps=2)
    trainer = Trainer(schema, settings)
    learn_more(trainer, schema, 0, 3)
    base = publish_base(trainer, tmp_path)
    served = load_served_model(base, "1", schema, rocksdb=tmp_path / "rocks" if store == "rocksdb" else None)
    learn_more(trainer, schema, 1000, 4)  # other events: the base's rare ids go unseen past the TTL
    delta, changed = publish_delta(trainer, tmp_path, read_manifest(base).base_step, 1)
    removed = read_embeddings(delta)["removed"].numpy()
    assert len(removed) > 0 and not trainer.table.stored_rows(removed)[1].any()
    served = apply_delta(served, delta)
    assert not served.table.tier.read(removed)[1].any() and len(served.table) == len(trainer.table)
    np.testing.assert_allclose(
        predict_events(served, probe_events(schema), schema), trainer_predictions(trainer, schema), rtol=1e-5, atol=1e-6
    )


def test_a_recovery_snapshot_leaves_out_rows_ttl_expired_in_rocksdb(schema, tmp_path):
    """The product path (Checkpointer.save): rows evicted to RocksDB and then unseen past the TTL
    are neither in the snapshot nor on disk afterwards; rows still in use are."""
    tiny = 48  # bytes: budgets of a few dozen rows, so most rows soon live in RocksDB alone
    settings = small_tiered_settings(tmp_path / "t", device_bytes=32 * tiny, ram_bytes=64 * tiny, ttl_steps=2)
    trainer = Trainer(schema, settings)
    learn_more(trainer, schema, 0, 3)
    first = trainer.table.tier.all_ids()
    learn_more(trainer, schema, 5000, 4)  # other events: most of the first ids go cold, then expire
    later = featurize([event_from_mapping(criteo_event(5000 + i), schema) for i in range(200)], schema)
    unseen = set(first.tolist()) - set(later.ids.reshape(-1).tolist())
    expired = unseen & set(trainer.table.tier.rocks.all_ids().tolist())
    assert expired, "the tiny budgets should have pushed rows of the first steps into RocksDB"
    saved = read_embeddings(trainer.checkpoints.save(tmp_path / "snap"))
    ids = set(saved["ids"].tolist())
    recent = trainer.table.tier.all_ids()
    assert not expired & ids and not expired & set(trainer.table.tier.rocks.all_ids().tolist())
    assert set(recent.tolist()) <= ids and len(ids) == len(recent)


def test_a_delta_lands_in_one_servers_own_pages_never_in_the_file_another_maps(schema, tmp_path):
    """Serving workers map one base file copy-on-write (serving/loader.py shared_rows): a delta
    applied by one leaves the file, and what a second loader of the same folder serves, unchanged."""
    import hashlib

    trainer = trained_trainer(schema, 3)
    base = publish_base(trainer, tmp_path)
    before = trainer_predictions(trainer, schema)
    rows_file = base / "embeddings.safetensors"
    digest = hashlib.sha256(rows_file.read_bytes()).hexdigest()
    first = load_served_model(base, "1", schema)
    learn_more(trainer, schema, 150, 2)
    delta, changed = publish_delta(trainer, tmp_path, trainer.step - 2, 1)
    assert len(changed)  # the delta rewrites rows the base holds
    first = apply_delta(first, delta)
    second = load_served_model(base, "1", schema)  # another worker, loading the same folder now
    np.testing.assert_allclose(
        predict_events(first, probe_events(schema), schema), trainer_predictions(trainer, schema), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(predict_events(second, probe_events(schema), schema), before, rtol=1e-5, atol=1e-6)
    assert hashlib.sha256(rows_file.read_bytes()).hexdigest() == digest
