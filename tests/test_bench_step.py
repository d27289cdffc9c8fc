"""`adstream bench step` on a small stream: every (device, batch) run learns the same events, and
its ratios are the runs' own figures."""

import pytest

from adstream.cli import main
from bench.step import WARMUP_SHARE, run_step_bench
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
