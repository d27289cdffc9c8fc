"""`adstream bench step` on a small stream: every (device, batch) run learns the same events, and
its ratios are the runs' own figures."""

import numpy as np
import pytest

from adstream.cli import main
from bench import peer
from bench.accuracy import synthetic_stream
from bench.step import WARMUP_SHARE, run_step_bench
from trainer.model import CtrModel, ModelConfig
from trainer.settings import ModelSettings, StoreSettings, TrainerSettings


def test_bench_step_times_each_batch_size_over_the_same_events(schema):
    settings = TrainerSettings(model=ModelSettings(embed_dim=4, hidden=(16,)), threads=1)
    result = run_step_bench(schema, settings, events=6000, batch_sizes=(50, 600), progress=False)
    runs = {run["batch"]: run for run in result["runs"]}
    assert sorted(runs) == [50, 600] and all(run["device"] == "cpu" for run in runs.values())
    for batch, run in runs.items():
        steps = -(-6000 // batch)
        assert run["steps"] == steps - max(1, int(steps * WARMUP_SHARE))  # the warm-up share is not timed
        assert run["events"] <= run["steps"] * batch and run["events_per_s"] == pytest.approx(
            run["events"] / run["seconds"]
        )
    assert result["batch_speedup"]["cpu"] == pytest.approx(runs[600]["events_per_s"] / runs[50]["events_per_s"])
    # the network alone is timed beside each run: a share of the step, never all of it (the step also
    # looks rows up and updates them), and the ceiling is the large batch at that pace over the small
    assert all(0 < run["network_ms_per_step"] < run["ms_per_step"] for run in runs.values())
    assert result["batch_speedup_ceiling"]["cpu"] == pytest.approx(
        600_000 / runs[600]["network_ms_per_step"] / runs[50]["events_per_s"]
    )
    assert "device_vs_cpu" not in result and result["gpu"] is None  # the CPU alone: nothing to compare with


def test_bench_step_runs_the_tiered_store_each_run_on_its_own_rocksdb(schema, tmp_path):
    settings = TrainerSettings(
        model=ModelSettings(embed_dim=4, hidden=(16,)),
        store=StoreSettings(kind="tiered", ram_bytes=40_000, path=str(tmp_path / "unused")),
        threads=1,
    )
    result = run_step_bench(schema, settings, events=3000, batch_sizes=(100, 300), progress=False)
    assert result["store"] == "tiered" and [run["batch"] for run in result["runs"]] == [100, 300]
    assert not (tmp_path / "unused").exists()  # every run had a RocksDB of its own, removed after


def test_bench_step_refuses_batch_sizes_it_cannot_read(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "step", "--batch-sizes", "256,x"])
    assert exit_info.value.code == 2 and "--batch-sizes '256,x'" in capsys.readouterr().err


def test_bench_step_sets_a_plain_loop_of_the_same_model_and_the_lr_family_beside_it(schema):
    settings = TrainerSettings(model=ModelSettings(embed_dim=4, hidden=(16,)), threads=1)
    result = run_step_bench(schema, settings, events=3000, batch_sizes=(100, 300), progress=False)
    ours = {run["batch"]: run for run in result["runs"]}
    plain = {run["batch"]: run for run in result["plain_torch"]}
    assert sorted(plain) == [100, 300]
    for batch in (100, 300):
        assert result["vs_plain_torch"][str(batch)] == pytest.approx(
            ours[batch]["events_per_s"] / plain[batch]["events_per_s"]
        )
        assert ours[batch]["host_ms_per_step"] == pytest.approx(
            ours[batch]["ms_per_step"] - ours[batch]["network_ms_per_step"]
        )
    lr = result["lr_family"]
    assert lr["batch"] == 300 and sorted(lr["host_ms_per_step_runs"])[1] == lr["host_ms_per_step"]
    assert lr["network_ms_per_step"] < ours[300]["network_ms_per_step"]  # no MLP, no cross
    targets = result["targets"]
    assert targets["default model >= 0.8x plain PyTorch of the same model (batch 300)"] == [
        result["vs_plain_torch"]["300"],
        0.8,
        result["vs_plain_torch"]["300"] >= 0.8,
    ]
    assert targets["lr family host work <= 6 ms per step (batch 300)"][0] == lr["host_ms_per_step"]
    assert "peer" not in result and not any("TorchRec" in name for name in targets)


def test_bench_step_without_the_peers_environment_says_how_to_build_it(schema, monkeypatch, tmp_path):
    monkeypatch.setitem(peer.PEERS, "torchrec", tmp_path / "nowhere" / "bin" / "python")
    settings = TrainerSettings(model=ModelSettings(embed_dim=4, hidden=(16,)), threads=1)
    result = run_step_bench(schema, settings, events=2000, batch_sizes=(200,), progress=False, peer="torchrec")
    assert "make peers" in result["peer"]["error"] and str(tmp_path / "nowhere") in result["peer"]["error"]
    assert "vs_peer" not in result and result["runs"][0]["events_per_s"] > 0  # the rest of the bench ran


def test_the_peer_refuses_a_model_it_does_not_build(schema, monkeypatch, tmp_path):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.touch()
    monkeypatch.setitem(peer.PEERS, "torchrec", python)
    config = ModelConfig(num_fields=3, num_dense=2, kind="deepfm")
    features = synthetic_stream(schema, 100, drift=0.0).features
    result = peer.run_peer("torchrec", features, config, TrainerSettings(), 50, 0.1)
    assert "kind='deepfm'" in result["error"] and "default model" in result["error"]


def test_the_peer_numbers_each_fields_ids_from_zero():
    ids = np.array([[70, 5], [12, 5], [70, 9], [3, 5]])
    rows, sizes = peer.numbered_per_field(ids)
    assert rows.tolist() == [[2, 0], [1, 0], [2, 1], [0, 0]] and sizes.tolist() == [3, 2]


def test_parameters_per_part_and_dense_multiply_adds_by_hand():
    config = ModelConfig(num_fields=3, num_dense=2, embed_dim=4, hidden=(8, 4), kind="dcn", cross_layers=2)
    model = CtrModel(config)
    width = 3 * 4 + 2  # x0 = [factors, dense]
    assert peer.part_sizes(model, rows=10) == {
        "rows": 10 * 5,
        "cross": 2 * (width * width + width),
        "mlp": (width * 8 + 8) + (8 * 4 + 4) + (4 + 1),
        "wide": 1 + 2,
    }
    assert peer.dense_macs_per_event(model) == 2 * width * width + width * 8 + 8 * 4 + 4 + 2
