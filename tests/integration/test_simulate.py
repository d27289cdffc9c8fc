"""The closed loop on the real broker and MLflow, through a serving restart and a broker outage:
`adstream simulate`'s ad server scores candidates, shows one, posts its clicks; every shown
impression and every click comes out of the joiner once, serving's log dropped nothing, and the
judge's live figures equal their offline recomputation."""

from __future__ import annotations

import json

import pytest

from adstream.simulate import run_simulation

pytestmark = pytest.mark.integration


def test_the_loop_loses_nothing_through_a_restart_and_an_outage(isolated, tmp_path):
    result = run_simulation(
        isolated,
        seconds=30,
        rate=20,
        restart_serving_at_s=8,
        broker_outage_at_s=15,
        outage_s=5,
        json_path=str(tmp_path / "simulate.json"),
        history_impressions=4000,
    )
    lost = result["losses"]
    assert lost["impressions_shown"] >= 300 and lost["clicks_posted"] > 0
    assert {k: v for k, v in lost.items() if k.endswith(("_lost", "_twice", "_unknown"))} == {
        "impressions_lost": 0,
        "impressions_twice": 0,
        "impressions_unknown": 0,
        "clicks_lost": 0,
        "clicks_twice": 0,
    }
    assert {"serving_sigterm_at", "serving_started_again_at", "broker_killed_at", "broker_back_at"} <= set(
        result["faults"]
    )
    assert result["served_log"]["dropped"] == 0
    assert result["judge"]["equal"], result["judge"]
    assert result["versions"] and all(0 <= v["mean_served_ctr"] <= 1 for v in result["versions"].values())
    from mlflow.tracking import MlflowClient  # the judge's figures, on the served versions in the registry

    client = MlflowClient(isolated.mlflow.tracking_uri)
    first = client.get_model_version(f"sim-{result['run']}", min(result["versions"], key=int))
    assert float(first.tags["live_events"]) > 0
    assert client.get_metric_history(first.run_id, "live_auc")
    saved = json.loads((tmp_path / "simulate.json").read_text())
    assert saved["losses"] == lost and (tmp_path / "simulate.png").stat().st_size > 10_000
