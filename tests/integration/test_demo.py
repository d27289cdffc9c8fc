"""`adstream demo` twice on one stack: the same synthetic world, a scope of its own each run, so
the second run gives the first run's answer (it used to resume the first run's snapshot, stop
after one batch and report an AUC of 0.48)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from adstream.demo import run_demo
from tests.integration.helpers import free_port

pytestmark = pytest.mark.integration


def test_the_demo_gives_the_same_honest_answer_twice(isolated, tmp_path):
    config = replace(isolated, serving=replace(isolated.serving, port=free_port()))
    first = run_demo(config, events=60_000, show=3, seed=11)
    second = run_demo(config, events=60_000, show=3, seed=11)
    for run in (first, second):
        assert run["events_replayed"] == 60_000 and len(run["predictions"]) == 3
        assert run["progressive_auc"] > 0.6  # a learner that resumed and stopped at once sat at 0.48
        assert run["members"][0] == "default" and run["champion"] in (*run["members"], *isolated.trainer.challengers)
    assert first["ground_truth_auc"] == second["ground_truth_auc"]  # the same world
    assert first["events_topic"] != second["events_topic"]  # ... replayed into a scope of its own
    # the answer compared is the served model's AUC on the same fresh events (measured over 11 runs:
    # 0.7869-0.7886, and once 0.7980 in CI: the live inputs' arrival order sets the learner's path,
    # and once in a while a better one, so the two runs are held within 0.02, not 0.01); the
    # progressive AUC scores a model on its way (measured 0.66-0.77): it is only held above chance
    for run in (first, second):
        assert run["served_auc"] > run["served_ground_truth_auc"] - 0.1
    assert first["served_ground_truth_auc"] == second["served_ground_truth_auc"]
    assert abs(first["served_auc"] - second["served_auc"]) < 0.02
    assert first["model_version"] != second["model_version"]
    for run in (first, second):  # the loop: what was served came back through the joiner, clicks and all
        loop = run["loop"]
        assert loop["events"] == loop["impressions"] == 5_000 and loop["clicks"] == loop["clicks_posted"] > 0
        assert abs(loop["auc"] - run["served_auc"]) <= 1e-9  # judged on the joined labels == the demo's own
