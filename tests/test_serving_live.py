"""The served model's live figures: read from the joiner's output, kept per version as records
come, equal to the offline recomputation over all records at once."""

import math

import numpy as np
import orjson
import pyarrow as pa

from serving.live import LiveScores, judged, metrics_of, outcomes_of
from stream.formats.arrow import encode_table
from trainer.metrics import auc_exact


def emitted(i: int, version: str, ctr: float, label: int, sequence: int = 0) -> bytes:
    served = {"version": version, "step": 5, "sequence": sequence, "ctr": ctr, "served_ms": 1}
    return orjson.dumps({"event_id": f"i{i}", "ts": 1, "C1": "00000001", "served": served, "label": label})


def test_outcomes_are_the_logged_impressions_of_a_record_only():
    plain = orjson.dumps({"event_id": "r", "ts": 1, "label": 1})  # replayed, not served: skipped
    record = b"\n".join([emitted(1, "3", 0.25, 0), plain, emitted(2, "4", 0.5, 1, sequence=2)])
    got = outcomes_of(record, "label", "event_id")
    assert [(o.impression_id, o.version, o.sequence, o.ctr, o.label) for o in got] == [
        ("i1", "3", 0, 0.25, 0),
        ("i2", "4", 2, 0.5, 1),
    ]
    arrow = encode_table(pa.table({"event_id": ["a"], "served": ["x"], "label": [1]}))
    assert outcomes_of(arrow, "label", "event_id") == [] and outcomes_of(plain, "label", "event_id") == []


def test_metrics_of_known_answers():
    ctrs, labels = np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.0, 0.0, 1.0, 1.0])
    m = metrics_of(ctrs, labels)
    assert m["auc"] == 1.0 and m["events"] == 4 and m["clicks"] == 2
    assert math.isclose(m["mean_ctr"], 0.25) and m["observed_ctr"] == 0.5 and math.isclose(m["calibration"], 0.5)
    assert math.isclose(m["logloss"], -np.mean(np.log([0.9, 0.8, 0.3, 0.4])))
    assert math.isnan(metrics_of(ctrs, np.zeros(4))["auc"]) and math.isnan(metrics_of(ctrs, np.zeros(4))["calibration"])


def test_live_figures_equal_the_offline_recomputation_under_positive_copies():
    """fake_negative's shape: each impression emitted at once labelled 0, a clicked one's positive
    copy later, records of mixed sizes; versions change along the way, with deltas."""
    rng = np.random.default_rng(3)
    n = 3000
    version = np.repeat(["1", "2", "3"], n // 3)
    ctr = rng.uniform(0.01, 0.6, n)
    clicked = rng.random(n) < ctr
    lines = [(i, emitted(i, version[i], float(ctr[i]), 0, sequence=i % 7)) for i in range(n)]
    copies = [(i + int(rng.integers(1, 400)), emitted(i, version[i], float(ctr[i]), 1)) for i in np.nonzero(clicked)[0]]
    stream = [line for _, line in sorted(lines + copies, key=lambda x: x[0])]
    records, start = [], 0
    while start < len(stream):
        size = int(rng.integers(1, 50))
        records.append(b"\n".join(stream[start : start + size]))
        start += size
    live = LiveScores()
    for record in records:
        live.add(outcomes_of(record, "label", "event_id"))
    streamed, offline = live.report(), judged(records, "label", "event_id")
    assert sorted(streamed) == sorted(offline) == ["1", "2", "3"]
    for v in streamed:
        for key, value in offline[v].items():
            assert abs(streamed[v][key] - value) <= 1e-9, (v, key)
        mask = version == v
        assert abs(streamed[v]["auc"] - auc_exact(clicked[mask], ctr[mask])) <= 1e-12  # against the truth
        assert streamed[v]["events"] == mask.sum() and streamed[v]["last_sequence"] == 6


def test_past_its_bound_the_oldest_version_is_forgotten_whole():
    live = LiveScores(most_impressions=4)
    live.add(outcomes_of(b"\n".join(emitted(i, "1", 0.5, 0) for i in range(3)), "label", "event_id"))
    live.add(outcomes_of(b"\n".join(emitted(i, "2", 0.5, 0) for i in range(3, 6)), "label", "event_id"))
    assert sorted(live.report()) == ["2"] and live.forgotten_versions == 1
    live.add(outcomes_of(emitted(3, "2", 0.5, 1), "label", "event_id"))  # a copy still finds its impression
    assert live.report()["2"]["clicks"] == 1
