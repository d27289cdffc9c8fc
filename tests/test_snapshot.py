import json

import numpy as np
import pytest
import torch

from serving.errors import ServingError
from serving.loader import load_served_model
from serving.predict import predict_events
from store.ram import RamTier
from store.table import EmbeddingTable
from stream.featurizer.decode import event_from_mapping
from stream.featurizer.featurize import featurize
from tests.helpers import criteo_event, trained_trainer
from trainer.batch import batch_from_features
from trainer.configs import make_optimizer
from trainer.errors import SnapshotError
from trainer.snapshot import folder_bytes, load_optimizer_state, load_snapshot, read_embeddings, read_manifest
from trainer.step import predict


def test_round_trip_restores_the_same_predictions(schema, tmp_path):
    trainer = trained_trainer(schema)
    path = trainer.checkpoints.save(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == [
        "dense.safetensors",
        "embeddings.safetensors",
        "manifest.json",
        "metrics.safetensors",
        "optimizer.safetensors",
    ]
    manifest = read_manifest(path)
    assert manifest.step == 5 and manifest.events == 250 and manifest.offsets == {"0": 5}
    assert manifest.newest_event_ms == criteo_event(249)["ts"]  # the newest of the 250 events learned
    assert manifest.schema_hash == schema.hash
    table = EmbeddingTable(RamTier(3 * trainer.table_config.dim, 1 << 26), trainer.table_config)
    restored = load_snapshot(path, table)
    events = [event_from_mapping(criteo_event(i), schema) for i in range(40)]  # some seen, some unseen
    batch = batch_from_features([featurize(events, schema)])
    expected = predict(trainer.model, trainer.table, batch)
    np.testing.assert_allclose(predict(restored.model, table, batch), expected, rtol=1e-6)
    served = load_served_model(path, "1", schema)
    np.testing.assert_allclose(predict_events(served, events, schema), expected, rtol=1e-5, atol=1e-6)
    resumed = trained_trainer(schema, 0)
    resumed.checkpoints.restore(path)
    assert resumed.newest_event_ms == manifest.newest_event_ms
    optimizer = make_optimizer(restored.model, trainer.settings)
    load_optimizer_state(path, optimizer)
    saved, live = optimizer.state_dict()["state"], trainer.optimizer.state_dict()["state"]
    assert saved.keys() == live.keys() and {"exp_avg_sq", "sum"} <= {k for v in saved.values() for k in v}
    for index in live:
        for key in live[index]:
            torch.testing.assert_close(saved[index][key], live[index][key])


def test_incomplete_or_foreign_snapshots_are_refused(schema, tmp_path):
    path = trained_trainer(schema, 1).checkpoints.save(tmp_path)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").unlink()
    with pytest.raises(SnapshotError, match="incomplete"):
        read_manifest(path)
    (path / "manifest.json").write_text(json.dumps({**manifest, "schema_hash": "0" * 16}))
    with pytest.raises(ServingError, match="schema hash"):
        load_served_model(path, "1", schema)
    (path / "manifest.json").write_text(json.dumps({**manifest, "format": "pickle"}))
    with pytest.raises(SnapshotError, match="format"):
        read_manifest(path)
    # a manifest promising rows in 2 files (sharded rows) where the second is missing
    (path / "embeddings.safetensors").rename(path / "embeddings-00000-of-00002.safetensors")
    (path / "manifest.json").write_text(json.dumps({**manifest, "shards": 2}))
    with pytest.raises(SnapshotError, match="embeddings-00001-of-00002.safetensors is unreadable"):
        read_embeddings(path)
    with pytest.raises(SnapshotError, match="embeddings-00001-of-00002"):
        load_served_model(path, "1", schema)


def test_no_pickle_anywhere(schema, tmp_path):
    path = trained_trainer(schema, 1).checkpoints.save(tmp_path)
    for file in path.iterdir():
        assert not file.read_bytes().startswith(b"\x80")  # pickle protocol header


def test_a_publication_serves_the_trainers_predictions_with_no_optimizer_state(schema, tmp_path):
    trainer = trained_trainer(schema)
    recovery = trainer.checkpoints.save(tmp_path / "snapshots")
    publication = trainer.checkpoints.publish_to(tmp_path / "publications", read_manifest(recovery))
    assert sorted(p.name for p in publication.iterdir()) == [
        "dense.safetensors",
        "embeddings.safetensors",
        "manifest.json",
    ]
    assert read_manifest(publication).kind == "publication" and read_manifest(recovery).kind == "recovery"
    assert set(read_embeddings(publication)) == {"ids", "vectors"}
    # rows: vector + two optimizer-state blocks in recovery, the vector alone in the publication
    assert folder_bytes(publication) < 0.6 * folder_bytes(recovery)
    events = [event_from_mapping(criteo_event(i), schema) for i in range(40)]  # some seen, some unseen
    expected = predict(trainer.model, trainer.table, batch_from_features([featurize(events, schema)]))
    served = load_served_model(publication, "1", schema)
    np.testing.assert_allclose(predict_events(served, events, schema), expected, rtol=1e-5, atol=1e-6)


def test_a_truncated_publication_is_refused_with_a_clear_error(schema, tmp_path):
    trainer = trained_trainer(schema)
    publication = trainer.checkpoints.publish_to(tmp_path, read_manifest(trainer.checkpoints.save(tmp_path / "snap")))
    embeddings = publication / "embeddings.safetensors"
    embeddings.write_bytes(embeddings.read_bytes()[: embeddings.stat().st_size // 2])
    with pytest.raises(SnapshotError, match="embeddings.safetensors is unreadable"):
        load_served_model(publication, "2", schema)


def test_a_snapshot_resumes_under_new_rates_but_not_under_another_row_layout(schema, tmp_path):
    """Rates and switches may change between runs (a job resumed with a lower rate, or a snapshot
    from before the wide part learned per event); rows of another width or optimizer may not."""
    from dataclasses import replace

    trainer = trained_trainer(schema, 2)
    path = trainer.checkpoints.save(tmp_path)
    config = trainer.table_config
    retuned = replace(config, optim=replace(config.optim, lr=0.01, wide_lr=0.2, wide_per_event=False, l2=1e-4))
    table = EmbeddingTable(RamTier(3 * config.dim, 1 << 26), retuned)
    load_snapshot(path, table)
    np.testing.assert_array_equal(table.export()[0], trainer.table.export()[0])
    for other in (replace(config, optim=replace(config.optim, name="adagrad")), replace(config, seed=9)):
        with pytest.raises(SnapshotError, match="cannot read"):
            load_snapshot(path, EmbeddingTable(RamTier(3 * config.dim, 1 << 26), other))


def learn_events(trainer, schema, first: int, steps: int) -> None:
    for s in range(steps):
        events = [event_from_mapping(criteo_event(first + s * 50 + i), schema) for i in range(50)]
        trainer.learn(batch_from_features([featurize(events, schema)], {0: first + s + 1}))


def test_metrics_go_on_over_the_whole_stream_after_a_resume(schema, tmp_path):
    """A trainer restored from its snapshot reports what one that never stopped reports: events,
    progressive AUC, logloss, calibration and the window all cover the events before the restart."""
    straight = trained_trainer(schema, 0)
    learn_events(straight, schema, 0, 6)
    before = trained_trainer(schema, 0)
    learn_events(before, schema, 0, 3)
    path = before.checkpoints.save(tmp_path)
    resumed = trained_trainer(schema, 0)
    resumed.checkpoints.restore(path)
    assert resumed.metrics.count == 150
    learn_events(resumed, schema, 150, 3)
    a, b = straight.metrics.summary(), resumed.metrics.summary()
    assert b["events"] == 300.0
    for key in a:
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key


def test_snapshot_errors_name_the_file(schema, tmp_path):
    path = trained_trainer(schema, 1).checkpoints.save(tmp_path)
    manifest = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(manifest[:63])
    with pytest.raises(SnapshotError, match=r"manifest\.json is unreadable"):
        read_manifest(path)
    (path / "manifest.json").write_text(manifest)
    dense = (path / "dense.safetensors").read_bytes()
    (path / "dense.safetensors").write_bytes(dense[: len(dense) // 2])
    config = trained_trainer(schema, 0).table_config
    table = EmbeddingTable(RamTier(3 * config.dim, 1 << 20), config)
    with pytest.raises(SnapshotError, match=r"dense\.safetensors is unreadable"):
        load_snapshot(path, table)


def test_a_snapshot_folder_that_cannot_be_written_is_named_at_start_and_at_write(schema, tmp_path):
    from trainer.snapshot import check_writable

    blocker = tmp_path / "in-the-way"
    blocker.write_text("a file where the folder should be")
    with pytest.raises(SnapshotError, match="trainer.snapshot.dir=.*in-the-way.*writable"):
        check_writable(blocker / "snapshots")
    check_writable(tmp_path / "fine" / "snapshots")  # made, and nothing left behind
    assert list((tmp_path / "fine" / "snapshots").iterdir()) == []
    with pytest.raises(SnapshotError, match="in-the-way/step-000000001: cannot write.*trainer.snapshot.dir"):
        trained_trainer(schema, 1).checkpoints.save(blocker)


def test_old_recovery_snapshots_are_pruned_to_keep(schema, tmp_path):
    from trainer.snapshot import latest_snapshot, prune_snapshots

    trainer = trained_trainer(schema, 0)
    for first in range(0, 250, 50):
        learn_events(trainer, schema, first, 1)
        trainer.checkpoints.save(tmp_path)
    (tmp_path / "step-000000002" / "manifest.json").unlink()  # a write cut short, older than the newest
    deleted = prune_snapshots(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000004", "step-000000005"]
    assert len(deleted) == 3 and latest_snapshot(tmp_path).name == "step-000000005"


def test_a_rows_file_names_its_optimizer_state_blocks_for_what_they_are_and_old_names_still_load(schema, tmp_path):
    """A row's two state blocks hold FTRL's z and n by default, not Adam's moments: the rows file
    says state_a / state_b; a snapshot written under the old names (exp_avg, exp_avg_sq) resumes."""
    from safetensors.torch import load_file, save_file

    trainer = trained_trainer(schema)
    path = trainer.checkpoints.save(tmp_path)
    file = path / "embeddings.safetensors"
    tensors = load_file(file)
    assert {"ids", "vectors", "state_a", "state_b"} == set(tensors)
    ids, rows = trainer.table.export()
    fresh = EmbeddingTable(RamTier(3 * trainer.table_config.dim, 1 << 26), trainer.table_config)
    load_snapshot(path, fresh)
    assert torch.equal(fresh.export()[1], rows)
    old = {"ids": tensors["ids"], "vectors": tensors["vectors"]}
    old |= {"exp_avg": tensors["state_a"], "exp_avg_sq": tensors["state_b"]}
    save_file(old, file)
    older = EmbeddingTable(RamTier(3 * trainer.table_config.dim, 1 << 26), trainer.table_config)
    load_snapshot(path, older)
    assert torch.equal(older.export()[1], rows) and np.array_equal(older.export()[0], ids)


def test_a_full_disk_is_one_line_naming_the_folder_and_leaves_no_half_snapshot(schema, tmp_path):
    """A real full disk: a 256 KiB tmpfs mounted in a user namespace of its own (`unshare -rm`), where
    the trainer writes a snapshot. safetensors reports ENOSPC as its own error type, not an OSError."""
    import shutil
    import subprocess
    import sys

    assert shutil.which("unshare"), "util-linux's unshare is needed for a filesystem that fills up"
    disk = tmp_path / "disk"
    disk.mkdir()
    script = (
        "import sys\n"
        "from stream.schema import load_schema\n"
        "from tests.helpers import trained_trainer\n"
        "from trainer.errors import SnapshotError\n"
        "trainer = trained_trainer(load_schema('criteo'), 1)\n"
        "try:\n"
        f"    trainer.checkpoints.save({str(disk)!r})\n"
        "except SnapshotError as exc:\n"
        "    print('ERROR', exc)\n"
        "import os\n"
        f"print('LEFT', sorted(os.listdir({str(disk)!r})))\n"
    )
    mount = f'mount -t tmpfs -o size=256k tmpfs {disk} && exec {sys.executable} -c "$0"'
    done = subprocess.run(["unshare", "-rm", "sh", "-c", mount, script], capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    errors = [line for line in lines if line.startswith("ERROR")]
    assert len(errors) == 1, done.stdout + done.stderr
    assert f"snapshot {disk}/step-000000001: cannot write (No space left on device)" in errors[0]
    assert "trainer.snapshot.dir" in errors[0] and "Traceback" not in done.stderr
    assert "LEFT []" in lines, done.stdout
