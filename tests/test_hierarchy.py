"""The device -> RAM -> RocksDB hierarchy: eviction, write-back, expiry, admission, checkpoints,
and the equivalence of a model trained through tiny budgets with one trained on one unbounded tier."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import store.table as store_table
from store.configs import HierarchyConfig, TableConfig
from store.errors import StoreError
from store.hierarchy import TieredStore
from store.ram import RamTier
from store.sparse_optim import SparseOptimConfig
from store.table import EmbeddingTable
from tests.helpers import tiny_hierarchy, zipf_batches
from trainer.model import CtrModel, ModelConfig
from trainer.step import train_step

# the CPU trainer's layout (RAM -> RocksDB) and the GPU trainer's (device -> RAM -> RocksDB), both on the CPU
CACHES = pytest.mark.parametrize("device_tier", [True, False], ids=["device-ram-rocksdb", "ram-rocksdb"])


@CACHES
def test_eviction_never_loses_a_dirty_row(tmp_path, device_tier):
    store = tiny_hierarchy(tmp_path / "h", device_rows=8, ram_rows=8, device_tier=device_tier)
    rng = np.random.default_rng(0)
    truth: dict[int, np.ndarray] = {}
    for step in range(1, 60):
        ids = np.unique(rng.integers(0, 100, size=6)).astype(np.int64)
        rows = torch.from_numpy(rng.normal(size=(len(ids), 6)).astype(np.float32))
        if step % 2:  # the trainer's pattern (read, then write) and bare writes (replica merges)
            store.read(ids)
        store.write(ids, rows, step=step)
        truth.update({int(i): r.numpy() for i, r in zip(ids, rows)})
    keys = np.array(sorted(truth), dtype=np.int64)
    rows, found = store.read(keys)
    assert found.all()
    np.testing.assert_array_equal(rows.numpy(), np.stack([truth[int(k)] for k in keys]))
    stats = store.stats()
    assert stats["ram_evictions"] > 0 and stats["writebacks"] > 0
    assert stats["rows_device"] <= 8 and stats["rows_ram"] <= 8
    assert set(store.all_ids().tolist()) == set(truth)
    if device_tier:  # a row lives in the device tier or the RAM tier, never both
        assert stats["device_evictions"] > 0
        assert not (set(store.device.all_ids().tolist()) & set(store.ram.all_ids().tolist()))
    else:
        assert store.device is None and stats["rows_device"] == stats["device_evictions"] == 0
    # write-backs that skip RocksDB's existence check (cached rows know they have a copy) count exactly
    assert len(store.rocks) == len(store.rocks.all_ids())
    store.flush()
    assert len(store.rocks) == len(store.rocks.all_ids()) == len(truth)


@pytest.mark.parametrize(("fmt", "factory"), [("plain", "PlainTable"), ("block", "BlockBasedTable")])
def test_the_trainers_rocksdb_format_setting_reaches_rocksdb(tmp_path, fmt, factory):
    from trainer.configs import make_tier
    from trainer.settings import StoreSettings, TrainerSettings

    store = StoreSettings(kind="tiered", path=str(tmp_path / "rocks"), rocksdb_format=fmt)
    tier = make_tier(TrainerSettings(store=store), width=6)
    assert isinstance(tier, TieredStore)
    options = sorted((tmp_path / "rocks").glob("OPTIONS-*"))[-1].read_text()  # what RocksDB opened with
    assert f"table_factory={factory}\n" in options
    tier.close()


def test_lru_and_lfu_pick_different_victims():
    tier = RamTier(2, 10 * RamTier(2, 1).row_bytes, preallocate=True)
    tier.write(np.array([1, 2, 3]), torch.zeros(3, 2), step=1)
    for _ in range(3):
        tier.write(np.array([1]), torch.zeros(1, 2), step=2)  # 1 is frequent but not recent
    tier.write(np.array([2, 3]), torch.zeros(2, 2), step=5)
    assert tier.victims(1, "lru", keep=np.array([], dtype=np.int64)).tolist() == [1]
    assert tier.victims(1, "lfu", keep=np.array([], dtype=np.int64)).tolist() in ([2], [3])
    assert tier.victims(3, "lru", keep=np.array([1])).tolist() not in ([1],)


@CACHES
def test_ttl_drops_rows_from_every_tier(tmp_path, device_tier):
    cached = {"device_rows": 4, "ram_rows": 4} if device_tier else {"ram_rows": 8}  # 8 cached rows either way
    store = tiny_hierarchy(tmp_path / "h", ttl_steps=3, device_tier=device_tier, **cached)
    store.write(np.array([7], dtype=np.int64), torch.ones(1, 6), step=1)
    for step in range(2, 12):
        store.write(np.array([100 + step], dtype=np.int64), torch.ones(1, 6), step=step)
    assert 7 not in store.all_ids().tolist()
    assert store.stats()["expired"] >= 1
    store.checkpoint(tmp_path / "ck")  # the cold tier is swept at checkpoints
    assert all(i >= 100 + 12 - 4 for i in store.rocks.all_ids().tolist())


def test_the_sweep_each_snapshot_runs_drops_expired_rows_from_rocksdb(tmp_path):
    """TTL in the product path: rows evicted to RocksDB and then unseen for ttl_steps are gone
    after the trainer's next snapshot (not only after a hierarchy checkpoint no product calls)."""
    store = tiny_hierarchy(tmp_path / "h", device_rows=2, ram_rows=2, ttl_steps=3)
    table = EmbeddingTable(store, TableConfig(dim=2, optim=SparseOptimConfig("adam")))
    store.write(np.array([7, 8, 9, 10, 11, 12], dtype=np.int64), torch.ones(6, 6), step=1)  # 7-10 evicted cold
    for step in range(2, 9):
        store.write(np.array([100 + step], dtype=np.int64), torch.ones(1, 6), step=step)
    store.io.drain()  # the write-backs have landed (they are asynchronous)
    assert 7 in store.rocks.all_ids().tolist()  # cold and expired, but still on disk
    assert table.expire_cold() >= 4
    assert not {7, 8, 9, 10} & set(store.rocks.all_ids().tolist())
    assert table.expire_cold() == 0 and EmbeddingTable(RamTier(6, 1 << 20), table.config).expire_cold() == 0


@CACHES
def test_a_write_larger_than_the_top_cache_goes_through_in_chunks(tmp_path, device_tier):
    """A replica merge writes back every row touched since the last merge: more than the top cache holds."""
    store = tiny_hierarchy(tmp_path / "h", device_rows=4, ram_rows=4, device_tier=device_tier)
    ids = np.arange(11, dtype=np.int64)
    rows = torch.from_numpy(np.repeat(ids[:, None], 6, 1).astype(np.float32))
    store.write(ids, rows, step=1)
    got, found = store.read(ids)
    assert found.all()
    torch.testing.assert_close(got.cpu(), rows)
    assert len(store.caches[0]) <= 4 and store.stats()["writebacks"] >= 11 - 8


@CACHES
def test_checkpoint_restore_round_trip(tmp_path, device_tier):
    store = tiny_hierarchy(tmp_path / "h", device_rows=4, ram_rows=4, device_tier=device_tier)
    ids = np.arange(20, dtype=np.int64)
    for chunk in np.array_split(ids, 5):
        store.write(chunk, torch.from_numpy(np.repeat(chunk[:, None], 6, 1).astype(np.float32)), step=3)
    store.checkpoint(tmp_path / "ck")
    store.write(np.array([0, 99], dtype=np.int64), torch.full((2, 6), -1.0), step=4)  # after the checkpoint
    config = store.config
    store.close()
    restored = TieredStore.restore(tmp_path / "ck", config)
    rows, found = restored.read(np.array([0, 5, 19, 99], dtype=np.int64))
    assert found.tolist() == [True, True, True, False]
    assert rows[:3, 0].tolist() == [0.0, 5.0, 19.0] and restored.step == 3
    with pytest.raises(StoreError, match="not a complete checkpoint"):
        TieredStore.restore(tmp_path / "nothing", config)


def test_admission_needs_min_count_sightings_and_trains_the_fields_shared_row():
    shared = np.array([1000, 2000], dtype=np.int64)  # one shared row per field (column)
    table = EmbeddingTable(RamTier(3 * 2, 1 << 20), TableConfig(dim=2, min_count=2), shared_ids=shared)
    first = table.lookup(np.array([[5, 6], [5, 7]], dtype=np.int64))
    # every id is new: each occurrence reads and trains its field's shared row
    assert sorted(first.unique_ids.tolist()) == [1000, 2000] and first.new == 0
    assert first.inverse.tolist() == [0, 1, 0, 1]
    table.update(first, torch.ones(2, 2), step=1)
    assert sorted(table.tier.all_ids().tolist()) == [1000, 2000]
    np.testing.assert_array_equal(table.sketch.estimate(np.array([5, 6, 7, 8])), [1, 1, 1, 0])
    second = table.lookup(np.array([[5, 8]], dtype=np.int64))
    # 5's second sighting admits it (scored with the shared row it has trained so far); 8 still waits
    assert sorted(second.unique_ids.tolist()) == [5, 2000] and second.new == 1
    shared_now = table.shared_vectors()
    torch.testing.assert_close(second.vectors[second.inverse], shared_now[[0, 1]])
    table.update(second, torch.ones(2, 2), step=2)
    assert sorted(table.tier.all_ids().tolist()) == [5, 1000, 2000] and table.stats()["admissions"] == 1


def _train(tier, batches, prefetch: bool = False):
    """Train a small model through `tier`; with prefetch, each step announces the next batch (the
    trainer's loop does the same), so its cold rows are read while evictions write others back."""
    config = ModelConfig(num_fields=5, num_dense=3, embed_dim=3, hidden=(8,), seed=1, kind="deepfm")
    table = EmbeddingTable(tier, TableConfig(dim=config.row_dim, seed=2, optim=SparseOptimConfig("adam", lr=0.05)))
    model = CtrModel(config)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step, batch in enumerate(batches, start=1):
        if prefetch and step < len(batches):
            table.prefetch(batches[step].ids)
        train_step(model, opt, table, batch, step)
    return model, table


@CACHES
@pytest.mark.parametrize(
    "pipelined, prefetch, split",
    [(False, False, False), (True, False, False), (True, True, False), (True, True, True)],
    ids=["serial", "async-writeback", "prefetch", "prefetch-split-reads"],
)
def test_tiny_budgets_train_the_same_model_as_one_unbounded_tier(
    tmp_path, monkeypatch, pipelined, prefetch, split, device_tier
):
    if split:  # every prefetch read as two parallel multi-gets
        monkeypatch.setattr("store.pipeline.SPLIT_READ_ROWS", 2)
    batches = zipf_batches(40)
    reference_model, reference = _train(RamTier(12, 1 << 26), batches)
    cached = {"device_rows": 160, "ram_rows": 40} if device_tier else {"ram_rows": 160}
    tier = tiny_hierarchy(tmp_path / "h", width=12, pipelined=pipelined, device_tier=device_tier, **cached)
    tiered_model, tiered = _train(tier, batches, prefetch)
    stats = tiered.tier.stats()
    assert stats["device_evictions" if device_tier else "ram_evictions"] > 0 and stats["writebacks"] > 0
    if prefetch:  # rows came from the prefetch while write-backs of evicted rows were in flight
        assert stats["io_prefetched_rows"] > 0 and stats["io_prefetches"] == len(batches) - 1
    ids, rows = reference.export()
    tiered_ids, tiered_rows = tiered.export()
    np.testing.assert_array_equal(ids, tiered_ids)
    torch.testing.assert_close(tiered_rows, rows, rtol=1e-5, atol=1e-6)
    for a, b in zip(reference_model.parameters(), tiered_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_prefetched_row_written_after_the_prefetch_is_read_new(tmp_path):
    store = tiny_hierarchy(tmp_path / "h", width=4, device_rows=2, ram_rows=2)
    old = torch.full((1, 4), 1.0)
    store.io.write(np.array([7]), old, np.array([1]), np.array([1]), new_rows=1)
    store.io.drain()
    store.io.prefetch(np.array([7]))  # reads the old row in the background...
    store.io.write(np.array([7]), old + 1, np.array([2]), np.array([1]), new_rows=0)  # ...then it changes
    store.io.drain()  # landed: no in-flight copy to read, so only the stale mark keeps the old row out
    rows, found = store.io.read(np.array([7]))
    assert found.all() and rows[0, 0].item() == 2.0
    assert store.io.counters["prefetch_stale"] == 1
    store.close()


def test_an_announced_batchs_dedup_is_reused_only_by_its_own_lookup(tmp_path, monkeypatch):
    """The announced batch's dedup is worked out at its prefetch; a lookup of other ids in
    between (a merge, a prediction) gets its own, and the announced batch's lookup reuses it."""
    table = EmbeddingTable(tiny_hierarchy(tmp_path / "h", width=6), TableConfig(dim=2))
    announced, current, other = (np.array([[5, 3], [3, 9]]), np.array([[1, 2]]), np.array([[4, 4, 8]]))
    table.prefetch(announced)
    table.lookup(current)
    calls = []
    real_unique = store_table.unique_inverse
    monkeypatch.setattr(store_table, "unique_inverse", lambda *a: calls.append(1) or real_unique(*a))
    between = table.lookup(other)
    assert calls and between.unique_ids.tolist() == [4, 8] and between.inverse.tolist() == [0, 0, 1]
    calls.clear()
    mine = table.lookup(announced)
    assert not calls  # reused
    assert mine.unique_ids.tolist() == [3, 5, 9] and mine.inverse.tolist() == [1, 0, 0, 2]
    torch.testing.assert_close(mine.vectors[mine.inverse], table.lookup(announced).vectors[mine.inverse])
    table.tier.close()


@CACHES
def test_a_write_after_a_remove_does_not_reuse_the_reads_slots(tmp_path, device_tier):
    """The write reuses the top-cache slots its read found only if nothing changed in between: a
    removal frees a slot, and writing into it without re-indexing would lose the row."""
    store = tiny_hierarchy(tmp_path / "h", device_rows=8, ram_rows=8, device_tier=device_tier)
    ids = np.array([1, 2, 3], dtype=np.int64)
    store.write(ids, torch.zeros(3, 6), step=1)
    store.read(ids)
    store.remove(np.array([2], dtype=np.int64))
    store.write(ids, torch.arange(18, dtype=torch.float32).view(3, 6), step=2)
    rows, found = store.read(ids)
    assert found.all()
    torch.testing.assert_close(rows.cpu(), torch.arange(18, dtype=torch.float32).view(3, 6))
    store.close()


def test_a_failed_background_write_is_raised_on_the_trainers_thread(tmp_path, monkeypatch):
    store = tiny_hierarchy(tmp_path / "h", width=4, device_rows=2, ram_rows=2)

    def broken(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(store.rocks, "put", broken)
    store.io.write(np.array([7]), torch.ones(1, 4), np.array([1]), np.array([1]), new_rows=1)
    with pytest.raises(StoreError, match="background write failed: disk on fire"):
        store.io.drain()


def test_a_failed_prefetch_is_raised_on_the_trainers_thread(tmp_path, monkeypatch):
    store = tiny_hierarchy(tmp_path / "h", width=4, device_rows=2, ram_rows=2)

    def broken(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(store.rocks, "read", broken)
    store.io.prefetch(np.array([7]))
    with pytest.raises(StoreError, match="background read failed: disk on fire"):
        store.io.read(np.array([7]))


CHILD = """
import sys, numpy as np, torch
sys.path.insert(0, {root!r})
from tests.helpers import tiny_hierarchy, zipf_batches
from store.sparse_optim import SparseOptimConfig
from store.table import EmbeddingTable
from store.configs import TableConfig
store = tiny_hierarchy({path!r}, width=12, device_rows=160, ram_rows=40)
table = EmbeddingTable(store, TableConfig(dim=4, seed=2, optim=SparseOptimConfig("adam", lr=0.05)))
rng = np.random.default_rng(1)
batches = zipf_batches(100000)
for step, batch in enumerate(batches, start=1):
    table.prefetch(batches[step].ids)  # the pipelined path: the next batch's rows read ahead
    lookup = table.lookup(batch.ids)
    table.update(lookup, torch.from_numpy(rng.normal(size=tuple(lookup.vectors.shape)).astype(np.float32)), step)
    if step % 5 == 0:
        store.checkpoint({ck!r} + f"/step-{{step:06d}}", extra={{"step": step}})
"""


def _replay_to(step: int, path) -> dict[int, np.ndarray]:
    store = tiny_hierarchy(path, width=12, device_rows=160, ram_rows=40)
    table = EmbeddingTable(store, TableConfig(dim=4, seed=2, optim=SparseOptimConfig("adam", lr=0.05)))
    rng = np.random.default_rng(1)
    for s, batch in enumerate(zipf_batches(step), start=1):
        lookup = table.lookup(batch.ids)
        table.update(lookup, torch.from_numpy(rng.normal(size=tuple(lookup.vectors.shape)).astype(np.float32)), s)
    ids, rows = table.export()
    return dict(zip(ids.tolist(), rows.numpy()))


def test_sigkill_mid_training_reopens_at_the_last_checkpoint(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    code = CHILD.format(root=root, path=str(tmp_path / "live"), ck=str(ck))
    child = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len([p for p in ck.iterdir() if not p.name.endswith(".partial")]) < 3:
        time.sleep(0.05)
    time.sleep(np.random.default_rng().uniform(0, 0.5))  # somewhere in the middle of later steps
    child.send_signal(signal.SIGKILL)
    child.wait()
    complete = sorted(p for p in ck.iterdir() if not p.name.endswith(".partial") and (p / "manifest.json").is_file())
    assert len(complete) >= 3
    last = complete[-1]
    step = int(last.name.split("-")[1])
    row = RamTier(12, 1).row_bytes
    config = HierarchyConfig(
        device_bytes=160 * row, ram_bytes=40 * row, disk_bytes=1 << 30, path=str(tmp_path / "reopened")
    )
    restored = TieredStore.restore(last, config)
    assert restored.step == step
    expected = _replay_to(step, tmp_path / "replay")
    ids = np.array(sorted(expected), dtype=np.int64)
    assert sorted(restored.all_ids().tolist()) == ids.tolist()
    rows, found = restored.read(ids)
    assert found.all()
    np.testing.assert_array_equal(rows.numpy(), np.stack([expected[i] for i in ids.tolist()]))


def test_trainer_on_the_hierarchy_snapshots_and_serves_the_same_predictions(schema, tmp_path):

    from serving.loader import load_served_model
    from serving.predict import predict_events
    from stream.featurizer.decode import event_from_mapping
    from stream.featurizer.featurize import featurize
    from tests.helpers import criteo_event, small_tiered_settings
    from trainer.batch import batch_from_features
    from trainer.snapshot import load_snapshot
    from trainer.step import predict
    from trainer.trainer import Trainer

    row = RamTier(3 * 5, 1).row_bytes
    settings = small_tiered_settings(
        tmp_path / "rocks", device_bytes=2500 * row, ram_bytes=1500 * row, disk_bytes=1 << 30
    )
    trainer = Trainer(schema, settings)
    for s in range(6):
        events = [event_from_mapping(criteo_event(s * 40 + i), schema) for i in range(40)]
        trainer.learn(batch_from_features([featurize(events, schema)]))
    tier = trainer.table.tier
    assert isinstance(tier, TieredStore) and tier.device is None  # a CPU trainer: RAM -> RocksDB
    assert trainer.table.stats()["ram_evictions"] > 0 and trainer.table.stats()["writebacks"] > 0
    path = trainer.checkpoints.save(tmp_path / "snap")
    events = [event_from_mapping(criteo_event(i), schema) for i in range(60)]
    batch = batch_from_features([featurize(events, schema)])
    expected = predict(trainer.model, trainer.table, batch)
    served = load_served_model(path, "1", schema)
    np.testing.assert_allclose(predict_events(served, events, schema), expected, rtol=1e-5, atol=1e-6)
    fresh = EmbeddingTable(
        tiny_hierarchy(tmp_path / "other", width=15, device_rows=2500, ram_rows=1500), trainer.table_config
    )
    restored = load_snapshot(path, fresh)
    np.testing.assert_allclose(predict(restored.model, fresh, batch), expected, rtol=1e-5, atol=1e-6)


def test_the_loop_holds_one_batch_ahead_and_announces_it_before_handing_out_the_current():
    from trainer.loop import one_ahead

    events: list[str] = []

    class Recorder:
        def prefetch(self, batch):
            events.append(f"prefetch {batch}")

    stream = iter(["b1", None, "b2", "b3"])  # None: an idle round
    for batch in one_ahead(stream, Recorder()):  # type: ignore[arg-type]
        events.append(f"learn {batch}")
    assert events == ["learn b1", "prefetch b2", "learn None", "prefetch b3", "learn b2", "learn b3"]
