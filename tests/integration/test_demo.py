"""`adstream demo` twice on one stack: the same synthetic world, a scope of its own each run, so
the second run gives the first run's answer, to within what the joiner's arrival order moves it
(it used to resume the first run's snapshot, stop after one batch and report an AUC of 0.48)."""

from __future__ import annotations

from dataclasses import replace

from adstream.demo import run_demo
from tests.integration.helpers import free_port


def test_the_demo_gives_the_same_honest_answer_twice(isolated, tmp_path):
    config = replace(isolated, serving=replace(isolated.serving, port=free_port()))
    first = run_demo(config, events=60_000, show=3, seed=11)
    second = run_demo(config, events=60_000, show=3, seed=11)
    for run in (first, second):
        assert run["events_replayed"] == 60_000 and len(run["predictions"]) == 3
        assert run["progressive_auc"] > 0.6  # a learner that resumed and stopped at once sat at 0.48
    assert first["ground_truth_auc"] == second["ground_truth_auc"]  # the same world
    assert first["events_topic"] != second["events_topic"]  # ... replayed into a scope of its own
    # the same world, not the same order: the joiner interleaves two live inputs as they arrive, so
    # the model's path (and which impressions are final when it stops) differs a little run to run
    # (measured: 0.012 and 0.029 apart); a run that resumed another would sit near 0.5
    assert abs(first["progressive_auc"] - second["progressive_auc"]) < 0.05
    assert first["model_version"] != second["model_version"]
