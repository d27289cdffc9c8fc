"""`adstream bench store` on a small table: it runs end to end and its figures are consistent."""

import pytest

from bench.store import run_store_bench


def test_bench_store_runs_and_its_figures_add_up(tmp_path):
    result = run_store_bench(ids=50_000, batches=3, warmup=6, batch_events=256, workdir=str(tmp_path / "bench"))
    for store in ("in_memory", "hierarchy", "hierarchy_serial", "rocksdb_only"):
        assert result[f"{store}_rows_per_s"] > 0, store
    assert result["hierarchy_vs_in_memory"] == pytest.approx(
        result["hierarchy_rows_per_s"] / result["in_memory_rows_per_s"]
    )
    assert sum(result["hit_rate"].values()) == pytest.approx(1.0)
    # on the CPU the hierarchy runs as the trainer does: RAM -> RocksDB, no device tier
    assert result["device_budget_bytes"] == 0 and result["hit_rate"]["device"] == 0.0
    assert result["table_to_ram_budget_ratio"] == pytest.approx(10.0, rel=0.01)
    assert 0.0 <= result["prefetch_overlap"] <= 1.0 and result["disk_bytes"] > 0
