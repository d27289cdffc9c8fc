"""Which member serves: the rules behind trainer.challengers, as pure functions.

A trainer learns its own configuration (member 0, "default") and, beside it, each challenger of
trainer.challengers: the same batches, each member scoring every batch before it learns it
(progressive validation). trainer/members.py runs them; an entry's changes ("model.kind=lr
optim.sparse_optimizer=adagrad") are read and checked where the settings are built
(trainer/settings.py, challenger_changes); this module decides:

    challenger_settings  a challenger's whole settings (its own store path and snapshot folder)
    within_budget        which challengers keep learning, cheapest first, by their measured cost
    choose_champion      the member to serve, from every member's logloss and AUC over the window

Selection, not a blend: on the synthetic stream and the first half of the real rows, the member
chosen this way scored within 0.0003 AUC of the best member in hindsight (switch_every 500-5,000,
window 5,000-10,000, margin 0-1%); a blend of the members' logits must serve every member at
once, which the serving side's one-model latency budget has no room for (bench accuracy prints
the blend beside the champion: README, "Challengers").
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from common.checks import with_changes
from trainer.settings import TrainerSettings, challenger_changes

DEFAULT_MEMBER = "default"  # member 0: the trainer's own configuration
AUC_SLACK = 0.002  # a challenger whose window AUC is lower than the champion's by more does not take over


def member_slug(text: str) -> str:
    """A challenger's name as a folder and metric name: "model.kind=lr optim.sparse_optimizer=adagrad"
    -> "kind-lr_sparse_optimizer-adagrad"."""
    parts = [item.partition(".")[2].replace("=", "-") for item in text.split()]
    return re.sub(r"[^A-Za-z0-9_.-]", "-", "_".join(parts))


def challenger_settings(settings: TrainerSettings, text: str, index: int) -> TrainerSettings:
    """A challenger's settings: the trainer's with its changes, no challengers of its own, its own
    RocksDB folder and snapshot folder (the same budgets), no Prometheus port or learn log."""
    slug = member_slug(text)
    store = settings.store
    changes = {
        **challenger_changes(settings, text, index),
        "challengers": (),
        "metrics_port": 0,
        "learn_log": "",
        "snapshot.dir": f"{settings.snapshot.dir}/challengers/{slug}",
        "store.path": f"{store.path}-{slug}",
        "store.numa_paths": tuple(f"{path}/{slug}" for path in store.numa_paths),
    }
    return with_changes(settings, changes)  # type: ignore[no-any-return]


def within_budget(costs: Sequence[float], budget: float) -> list[bool]:
    """Which challengers keep learning: `costs` are their seconds per step relative to the default
    member's (1.0 = as dear); the cheapest are kept first while the challengers' share of the whole
    step, kept / (1 + kept), stays within `budget`."""
    keep = [False] * len(costs)
    spent = 0.0
    for i in sorted(range(len(costs)), key=lambda i: costs[i]):
        if (spent + costs[i]) / (1 + spent + costs[i]) > budget:
            break
        keep[i] = True
        spent += costs[i]
    return keep


def choose_champion(current: int, window_logloss: Sequence[float], window_auc: Sequence[float], margin: float) -> int:
    """The member to serve next: the one with the lowest logloss over the window, if it beats the
    serving member's by `margin` (relative: hysteresis, so noise does not flip the served model) and
    its AUC there is not lower by more than AUC_SLACK; else the serving member stays. Members
    without figures yet (NaN) neither take over nor are left for one."""
    losses = [x if math.isfinite(x) else math.inf for x in window_logloss]
    best = min(range(len(losses)), key=lambda i: (losses[i], i))
    if best == current or not math.isfinite(losses[best]):
        return current
    if not math.isfinite(losses[current]):
        return best
    auc_best, auc_current = window_auc[best], window_auc[current]
    auc_ok = not (math.isfinite(auc_best) and math.isfinite(auc_current)) or auc_best >= auc_current - AUC_SLACK
    return best if losses[best] < losses[current] * (1 - margin) and auc_ok else current
