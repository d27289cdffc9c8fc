"""The CUDA paths, pinned to the CPU's answers: a trainer whose model and device tier live in HBM
learns what the same trainer learns on the CPU (RAM store, and device -> RAM -> RocksDB with rows
evicted down and read back), and a snapshot a GPU trainer writes restores and serves on a CPU
host. The storage contract runs over the HBM tiers too (tests/helpers.py adds them to TIERS).

Collected only where torch sees a GPU (conftest.py); CI has none. On a GPU machine:
`pytest tests/test_cuda.py tests/test_store.py -k cuda`."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from serving.loader import load_served_model
from serving.predict import predict_events
from stream.featurizer.decode import event_from_mapping
from stream.featurizer.featurize import featurize
from stream.schema import load_schema
from trainer.batch import batch_from_features
from trainer.settings import TrainerSettings
from trainer.trainer import Trainer

from .helpers import criteo_event
from .test_merge import assert_states_close, make_batches, settings, state

SCHEMA = load_schema("criteo")
GPU = "cuda"


def on(device: str, sparse: str, store: str, path: str) -> TrainerSettings:
    """Dense Adam, `sparse` rows; the tiered store holds 1,000 rows in HBM and 600 in RAM while the
    batches touch ~2,200 ids, so rows go down to RocksDB and come back every step."""
    tiered = {"kind": "tiered", "device_bytes": 100_000, "ram_bytes": 60_000, "path": path} if store == "tiered" else {}
    return replace(settings("adam", sparse, per_event=True, **tiered), device=device)  # the default learner


@pytest.mark.parametrize("store", ["ram", "tiered"])
@pytest.mark.parametrize("sparse", ["adam", "adagrad"])
def test_a_trainer_on_cuda_learns_what_it_learns_on_the_cpu(tmp_path, store, sparse):
    cpu = Trainer(SCHEMA, on("cpu", sparse, store, str(tmp_path / "cpu")))
    gpu = Trainer(SCHEMA, on(GPU, sparse, store, str(tmp_path / "gpu")))
    assert next(gpu.model.parameters()).device.type == GPU
    batches = make_batches(seed=3, steps=8)
    for batch in batches[:-1]:
        cpu.learn(batch)
        gpu.learn(batch)
    held_out = batches[-1]
    np.testing.assert_allclose(gpu.predict(held_out), cpu.predict(held_out), rtol=1e-4, atol=1e-5)
    assert_states_close(state(gpu), state(cpu), atol=1e-4)
    if store == "tiered":  # the HBM tier really evicted rows, and some came back from RocksDB
        stats = gpu.table.stats()
        assert stats["rows_device"] > 0 and stats["device_evictions"] > 0 and stats["hit_rate_rocksdb"] > 0
        gpu.table.tier.close()
        cpu.table.tier.close()


def test_a_snapshot_written_on_cuda_restores_and_serves_on_the_cpu(tmp_path):
    gpu = Trainer(SCHEMA, on(GPU, "adam", "ram", ""))
    for batch in make_batches(seed=5, steps=4):
        gpu.learn(batch)
    path = gpu.checkpoints.save(tmp_path / "snapshots")
    assert path is not None
    events = [event_from_mapping(criteo_event(i), SCHEMA) for i in range(40)]  # ids seen and unseen
    batch = batch_from_features([featurize(events, SCHEMA)])
    expected = gpu.predict(batch)
    cpu = Trainer(SCHEMA, on("cpu", "adam", "ram", ""))
    cpu.checkpoints.restore(path)
    np.testing.assert_allclose(cpu.predict(batch), expected, rtol=1e-5, atol=1e-6)
    assert_states_close(state(cpu), state(gpu))
    served = load_served_model(path, "1", SCHEMA)  # serving's loader, on a host with no GPU in use
    np.testing.assert_allclose(predict_events(served, events, SCHEMA), expected, rtol=1e-5, atol=1e-6)


def test_a_cpu_snapshot_resumes_on_cuda_and_learns_on_as_the_cpu_does(tmp_path):
    """Recovery onto a GPU: the rows and their Adam state go into the HBM hierarchy, the dense
    weights and moments into the model on the GPU, and both trainers then learn the same."""
    cpu = Trainer(SCHEMA, on("cpu", "adam", "tiered", str(tmp_path / "cpu")))
    batches = make_batches(seed=11, steps=8)
    for batch in batches[:4]:
        cpu.learn(batch)
    path = cpu.checkpoints.save(tmp_path / "snapshots")
    assert path is not None
    gpu = Trainer(SCHEMA, on(GPU, "adam", "tiered", str(tmp_path / "gpu")))
    gpu.checkpoints.restore(path)
    assert gpu.step == cpu.step == 4
    for batch in batches[4:]:
        cpu.learn(batch)
        gpu.learn(batch)
    assert_states_close(state(gpu), state(cpu), atol=1e-4)
    gpu.table.tier.close()
    cpu.table.tier.close()
