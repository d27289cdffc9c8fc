"""The served model judged on live traffic: the CTRs it returned against the joined labels. Pure.

    events-topic record --outcomes_of--> [Outcome] (the labelled impressions serving logged: their
                                          "served" object, serving/impressions.py)
    [Outcome] --LiveScores.add--> per served version: each impression's CTR and label
              --LiveScores.report--> {version: {events, clicks, auc, logloss, mean_ctr,
                                                observed_ctr, calibration, first_sequence, last_sequence}}
    all records at once --judged--> the same report, recomputed offline in one pass (a test pins the
                                    two to 1e-9)

Which label: an impression's label is the highest the joiner emitted for it. Under the "window"
policy that is its one, final label. Under "fake_negative" (and "elapsed") the joiner emits the
impression at once labelled 0 and a positive copy when a click comes, so the label becomes 1 when
its copy is read, a late click's correction included: the figures of an impression younger than
the attribution window still count it as unclicked if its click has not come yet.
A version's figures cover every delta publication applied to it (`first_sequence`..`last_sequence`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import orjson

from serving.impressions import SERVED
from stream.formats.arrow import is_arrow_bundle
from trainer.metrics import auc_exact, logloss

MARKER = b'"served"'  # a labelled event from serving carries it; others are skipped unparsed


@dataclass(frozen=True)
class Outcome:
    """One emission of a logged impression: which model scored it, what it said, the label it got."""

    impression_id: str
    version: str  # the served version (its registry number)
    sequence: int  # deltas applied to that version when it scored
    ctr: float  # the CTR /predict returned
    label: int  # 0 or 1, as the joiner emitted it


def outcomes_of(value: bytes, label_field: str, id_field: str) -> list[Outcome]:
    """The logged impressions in one events-topic record (JSON lines; Arrow bundles come from log
    replays, not from serving, and hold none)."""
    if MARKER not in value or is_arrow_bundle(value):
        return []
    out = []
    for line in value.split(b"\n"):
        if MARKER not in line:
            continue
        event = orjson.loads(line)
        served = event.get(SERVED)
        if isinstance(served, dict):
            out.append(
                Outcome(
                    str(event[id_field]),
                    str(served["version"]),
                    int(served["sequence"]),
                    float(served["ctr"]),
                    int(event[label_field]),
                )
            )
    return out


def metrics_of(ctrs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """AUC, logloss and calibration of CTRs (n,) against labels (n,); NaN where undefined."""
    n = len(ctrs)
    clicks = float(labels.sum())
    mean_ctr = float(ctrs.mean()) if n else float("nan")
    observed = clicks / n if n else float("nan")
    return {
        "events": float(n),
        "clicks": clicks,
        "auc": auc_exact(labels, ctrs) if n else float("nan"),
        "logloss": logloss(labels, ctrs) if n else float("nan"),
        "mean_ctr": mean_ctr,
        "observed_ctr": observed,
        # predicted over observed: 1 is calibrated, above 1 over-predicts
        "calibration": mean_ctr / observed if n and observed > 0 else float("nan"),
    }


@dataclass
class _Version:
    ctrs: list[float] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    row: dict[str, int] = field(default_factory=dict)  # impression id -> its place in ctrs/labels
    first_sequence: int = 1 << 62
    last_sequence: int = -1


class LiveScores:
    """Per served version, each logged impression's CTR and label so far, as records arrive.
    At most `most_impressions` are kept: past it the oldest versions are forgotten whole."""

    def __init__(self, most_impressions: int = 5_000_000) -> None:
        self.most = most_impressions
        self._versions: dict[str, _Version] = {}  # in the order they were first seen
        self._kept = 0
        self._where: dict[str, str] = {}  # impression id -> its version
        self.forgotten_versions = 0

    def add(self, outcomes: Iterable[Outcome]) -> set[str]:
        """Take a record's outcomes; returns the versions whose figures changed."""
        changed = set()
        for o in outcomes:
            version = self._where.get(o.impression_id)
            if version is not None:  # a positive copy (or a duplicate): the label so far
                v = self._versions[version]
                i = v.row[o.impression_id]
                v.labels[i] = max(v.labels[i], o.label)
                changed.add(version)
                continue
            v = self._versions.setdefault(o.version, _Version())
            v.row[o.impression_id] = len(v.ctrs)
            v.ctrs.append(o.ctr)
            v.labels.append(o.label)
            v.first_sequence = min(v.first_sequence, o.sequence)
            v.last_sequence = max(v.last_sequence, o.sequence)
            self._where[o.impression_id] = o.version
            self._kept += 1
            changed.add(o.version)
        while self._kept > self.most and len(self._versions) > 1:
            oldest = next(iter(self._versions))
            gone = self._versions.pop(oldest)
            for impression_id in gone.row:
                del self._where[impression_id]
            self._kept -= len(gone.ctrs)
            self.forgotten_versions += 1
        return changed

    def report(self, versions: Iterable[str] | None = None) -> dict[str, dict[str, float]]:
        """The figures of `versions` (default: every version kept)."""
        out = {}
        for name in self._versions if versions is None else versions:
            v = self._versions.get(name)
            if v is None:
                continue
            figures = metrics_of(np.asarray(v.ctrs, dtype=np.float64), np.asarray(v.labels, dtype=np.float64))
            out[name] = {**figures, "first_sequence": float(v.first_sequence), "last_sequence": float(v.last_sequence)}
        return out


def judged(values: Iterable[bytes], label_field: str, id_field: str) -> dict[str, dict[str, float]]:
    """The report recomputed from every record at once: each impression's first emission says how it
    was served, its label is the highest of its emissions; then figures per version."""
    first: dict[str, Outcome] = {}
    label: dict[str, int] = {}
    for value in values:
        for o in outcomes_of(value, label_field, id_field):
            first.setdefault(o.impression_id, o)
            label[o.impression_id] = max(label.get(o.impression_id, 0), o.label)
    by_version: dict[str, list[str]] = {}
    for impression_id, o in first.items():
        by_version.setdefault(o.version, []).append(impression_id)
    out = {}
    for version, ids in by_version.items():
        ctrs = np.array([first[i].ctr for i in ids], dtype=np.float64)
        labels = np.array([label[i] for i in ids], dtype=np.float64)
        sequences = [first[i].sequence for i in ids]
        out[version] = {
            **metrics_of(ctrs, labels),
            "first_sequence": float(min(sequences)),
            "last_sequence": float(max(sequences)),
        }
    return out
