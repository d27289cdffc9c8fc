"""Each benchmark's picture is drawn from its JSON (#29 item 12): a PNG for every bench that has one."""

from __future__ import annotations

import numpy as np
import pytest

from bench.plots import plot_bench

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _drawn(which, result, tmp_path):
    png = plot_bench(which, result, tmp_path / f"{which}.png")
    assert png is not None and png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 10_000
    return png


def test_accuracy_draws_the_auc_of_each_tenth_per_model(tmp_path):
    from bench.accuracy import run_accuracy_bench
    from stream.schema import load_schema
    from tests.helpers import avazu_csv
    from trainer.settings import ModelSettings, TrainerSettings

    log = avazu_csv(tmp_path / "avazu.csv", 2000)
    settings = TrainerSettings(model=ModelSettings(embed_dim=4, hidden=(16,)), threads=1)
    result = run_accuracy_bench(load_schema("avazu"), settings, logs=[str(log)], ablation=False, progress=False)
    whole = next(r for r in result["runs"] if r["dataset"] == "avazu-log" and r["model"] == "adstream")
    assert len(whole["auc_by_tenth"]) == 10 and all(0 < a < 1 for a in whole["auc_by_tenth"])
    _drawn("accuracy", result, tmp_path)


def test_serving_draws_the_latency_cdf_and_the_freshness_histogram(tmp_path):
    from bench.serving import Load, _histogram

    rng = np.random.default_rng(0)
    load = Load(rng.lognormal(0, 0.5, 2000), 10.0, ("1",)).summary()
    assert set(load["cdf_ms"]) >= {"50", "99", "99.9"} and load["cdf_ms"]["50"] <= load["cdf_ms"]["99"]
    freshness = {"histogram_s": _histogram(rng.gamma(3, 1.0, 500))}
    assert sum(freshness["histogram_s"]["counts"]) == 500
    _drawn("serving", {"adstream_1": load, "mlflow_pyfunc_1": load, "freshness": freshness}, tmp_path)


@pytest.mark.parametrize(
    "which, result",
    [
        (
            "merge",
            {
                "runs": [
                    {
                        "workers": w,
                        "k": k,
                        "layout": "replicated",
                        "bytes": 10**9 // (k or 1),
                        "auc": 0.8,
                        "window_auc": 0.81,
                        "auc_by_tenth": [0.7 + 0.01 * i for i in range(10)],
                    }
                    for w in (2, 4, 8)
                    for k in (0, 1, 16, 64)
                ]
            },
        ),
        ("store", {"in_memory_rows_per_s": 1e6, "hierarchy_cold_rows_per_s": 2e5, "hierarchy_rows_per_s": 7e5}),
        (
            "join",
            {
                "accuracy": [
                    {"policy": "oracle", "window_s": None, "auc": 0.82},
                    {"policy": "window", "window_s": 1800.0, "auc": 0.8},
                ],
                "joiner": [{"format": "arrow", "bundle": 1000, "window_s": 300.0, "impressions_per_s": 24000.0}],
            },
        ),
    ],
)
def test_merge_store_and_join_draw_their_figures(which, result, tmp_path):
    _drawn(which, result, tmp_path)


def test_a_bench_without_a_picture_draws_nothing(tmp_path):
    assert plot_bench("pipeline", {}, tmp_path / "p.png") is None and not (tmp_path / "p.png").exists()
