"""`adstream bench accuracy`: progressive (test-then-train) accuracy, side by side, in one run.

Every model scores each batch before it learns it, in stream order, in process (no Kafka: this
measures the learner, not the pipeline). Datasets: the real Criteo rows in file order (reported
whole and as first / second half), and the synthetic stream without and with drift (its
generator knows each event's true click probability, so the truth's own AUC is the ceiling).
Models: adstream with its defaults (the default model alone, and the champion of its challengers
with each member and a blend of them: trainer/members.py) and each `trainer.model.kind` family, an online logistic
regression (river, AdaGrad, one event at a time: one-hot categories + signed log1p integers +
missing flags), and the plain PyTorch DeepFM of `bench pipeline`. Extra rows: the drifting
stream's model frozen at 20% of the stream; batch 4096 with and without CowClip against the
default batch; and an ablation (one default changed at a time) on the real rows.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import Progress

from bench.baseline import PlainTorch, baseline_config, online_lr
from bench.pipeline import criteo_files
from common.checks import flat_fields, with_changes
from stream.featurizer.ingest import featurize_records
from stream.produce.replay import log_records, synthetic_records
from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo
from stream.records import FeatureBatch, RawRecord
from stream.schema import Schema
from trainer.batch import batch_from_features
from trainer.configs import model_config
from trainer.group import Control
from trainer.members import Members
from trainer.metrics import auc_exact, ece, logloss
from trainer.model import MODEL_KINDS
from trainer.settings import TrainerSettings
from trainer.trainer import Trainer

REAL_BATCH = 64  # 10k rows: 160 steps at 64 (at 1024 they would be 10); see the README on batch size
WINDOW = 100_000  # the synthetic streams' last-window figures
ABLATION: dict[str, dict[str, Any]] = {  # one default changed at a time
    "wide_per_event=false (one wide step per batch)": {"optim.wide_per_event": False},
    "sparse_optimizer=adagrad": {"optim.sparse_optimizer": "adagrad"},
    "sparse_optimizer=adam": {"optim.sparse_optimizer": "adam", "optim.sparse_lr": 0.01, "optim.wide_lr": 0.01},
    "wide_lr=0.01": {"optim.wide_lr": 0.01},
    "min_count=2 (shared rows)": {"store.min_count": 2},
    "dense_norm=false": {"model.dense_norm": False},
    "warmup_steps=50": {"optim.warmup_steps": 50},
    "init_std=0.001": {"optim.init_std": 0.001},
    "sparse_l2=1e-4": {"optim.sparse_l2": 1e-4},
    "lr=0.001 (old default)": {"optim.lr": 0.001},
    "embed_dim=8 (old default)": {"model.embed_dim": 8},
    "sparse_lr=0.05 (old default)": {"optim.sparse_lr": 0.05},
    "cross_rank=32 (low-rank cross)": {"model.cross_rank": 32},
}


@dataclass(frozen=True)
class Stream:
    name: str
    features: FeatureBatch  # every event, in stream order
    truth: np.ndarray | None  # true click probabilities (synthetic only)


def real_stream(schema: Schema, criteo_dir: str, logs: list[str] | None = None) -> Stream | None:
    """The real rows in file order: `logs` (any log the schema's [source] table reads, named
    "<schema>-log"), else the Criteo files under criteo_dir ("criteo-real"); None when there are none."""
    files = [Path(p) for p in logs] if logs else criteo_files(criteo_dir)
    if not files:
        return None
    parts = [
        featurize_records([RawRecord(0, i, record.value)], schema)[0]
        for i, record in enumerate(log_records(files, schema, bundle=4096, fmt="arrow"))
        if record.reason is None
    ]
    return Stream(f"{schema.name}-log" if logs else "criteo-real", FeatureBatch.concat(parts), None)


def generator_refusal(schema: Schema) -> str | None:
    """Why the synthetic generator cannot drive `schema` (None: it can)."""
    try:
        SyntheticCriteo(schema).generate(8)
    except Exception as exc:  # the generator's own limits (hex32 categories, integer fields...)
        return f"the synthetic generator cannot drive schema {schema.name!r} ({type(exc).__name__}: {exc})"
    return None


def synthetic_stream(schema: Schema, events: int, drift: float, seed: int = 7) -> Stream:
    generator = SyntheticCriteo(schema, SyntheticConfig(seed=seed, drift_per_million=drift))
    parts, truth = [], []
    for start in range(0, events, 100_000):
        chunk, p = generator.generate(min(100_000, events - start))
        truth.append(p)
        for i, record in enumerate(synthetic_records(chunk, schema, bundle=4096, fmt="arrow")):
            parts.append(featurize_records([RawRecord(0, i, record.value)], schema)[0])
    name = "synthetic" if drift == 0 else f"synthetic-drift{drift:g}"
    return Stream(name, FeatureBatch.concat(parts), np.concatenate(truth))


# --- learners: each takes a stream and batch size, returns predictions made before learning ---
# (one array, or several named ones: the champion run's, each becoming its own row)
Learner = Callable[[FeatureBatch, int], "np.ndarray | dict[str, Served]"]
CHAMPION = "adstream-champion"
BLEND = "adstream-blend (measured, not served)"
MEMBER = "member: "


@dataclass(frozen=True)
class Served:
    """A champion run's output for one row: predictions (n,) and, for the champion, which member
    served from which event on."""

    probs: np.ndarray
    switches: list[tuple[int, str]]


def champion_learner(schema: Schema, settings: TrainerSettings) -> Learner:
    """The trainer's own members (trainer/members.py) on the stream, as the loop runs them: every
    member scores then learns each batch; the champion's row holds, for each batch, the prediction
    of the member that served it (chosen before the batch). Also each member's own row (those the
    budget stopped: none) and a blend of the members' logits (an online logistic stacker,
    `blend_probs`), measured for the choice between the two and not served."""

    def learn(features: FeatureBatch, batch_size: int) -> dict[str, Served]:
        torch.manual_seed(0)
        members = Members(schema, replace(settings, batch_size=batch_size))
        control, events = Control(1), 0
        served: list[np.ndarray] = []
        each: dict[str, list[np.ndarray]] = {name: [] for name in members.names}
        switches = [(0, members.champion.name)]
        for part in features.split(batch_size):
            serving = members.champion.name
            probs = members.learn_round(batch_from_features([part]))
            served.append(probs[serving])  # type: ignore[arg-type]
            for name, p in probs.items():
                each[name].append(p)  # type: ignore[arg-type]
            events += len(part)
            if members.review(control, events, None):
                switches.append((events, members.champion.name))
        whole = {name: np.concatenate(p) for name, p in each.items() if sum(map(len, p)) == len(features)}
        out = {CHAMPION: Served(np.concatenate(served), switches)}
        out.update({MEMBER + name: Served(p, []) for name, p in whole.items()})
        if len(whole) > 1:
            out[BLEND] = Served(blend_probs(list(whole.values()), features.labels, batch_size), [])
        return out

    return learn


def blend_probs(member_probs: list[np.ndarray], labels: np.ndarray, batch_size: int, lr: float = 0.05) -> np.ndarray:
    """Progressive predictions (n,) of an online logistic stacker over the members' logits: each
    batch scored by sigmoid(w . logits + b), then (w, b) take one AdaGrad step on its logloss. It
    starts as the plain mean of the members' logits."""
    probs = np.clip(np.stack(member_probs, axis=1), 1e-7, 1 - 1e-7)  # (n, M)
    features = np.concatenate([np.log(probs) - np.log1p(-probs), np.ones((len(probs), 1))], axis=1)  # logits, 1
    w = np.concatenate([np.full(probs.shape[1], 1 / probs.shape[1]), [0.0]])  # weights, then the bias
    squares = np.full_like(w, 1e-6)
    out = np.empty(len(labels))
    for at in range(0, len(labels), batch_size):
        x = features[at : at + batch_size]
        p = 1 / (1 + np.exp(-(x @ w)))
        out[at : at + len(x)] = p
        grad = x.T @ (p - labels[at : at + len(x)]) / len(x)
        squares += grad * grad
        w -= lr * grad / np.sqrt(squares)
    return out


def adstream_learner(schema: Schema, settings: TrainerSettings, freeze_at: int | None = None) -> Learner:
    def learn(features: FeatureBatch, batch_size: int) -> np.ndarray:
        torch.manual_seed(0)
        trainer = Trainer(schema, replace(settings, batch_size=batch_size))
        probs, seen = [], 0
        for part in features.split(batch_size):
            batch = batch_from_features([part])
            frozen = freeze_at is not None and seen >= freeze_at
            probs.append(trainer.predict(batch) if frozen else trainer.learn(batch).probs)
            seen += len(part)
        return np.concatenate(probs)

    return learn


def baseline_learner(schema: Schema) -> Learner:
    """The plain PyTorch DeepFM of `bench pipeline` (hashed nn.EmbeddingBag + SparseAdam + Adam)."""

    def learn(features: FeatureBatch, batch_size: int) -> np.ndarray:
        torch.manual_seed(0)
        baseline = PlainTorch(baseline_config(model_config(schema, TrainerSettings())), lr=0.001, sparse_lr=0.01)
        return np.concatenate([baseline.train_step(batch_from_features([p])) for p in features.split(batch_size)])

    return learn


def river_learner(lr: float = 0.03) -> Learner:
    def learn(features: FeatureBatch, batch_size: int) -> np.ndarray:
        return online_lr(features, lr)

    return learn


# --- scoring ---------------------------------------------------------------------------------
def score(labels: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    return {"auc": auc_exact(labels, probs), "logloss": logloss(labels, probs), "ece": ece(labels, probs)}


def auc_by_tenth(labels: np.ndarray, probs: np.ndarray) -> list[float | None]:
    """The AUC of each tenth of the stream, in stream order (None for a tenth with one class only)."""
    out: list[float | None] = []
    for piece in np.array_split(np.arange(len(labels)), 10):
        y = labels[piece]
        out.append(auc_exact(y, probs[piece]) if 0 < y.sum() < len(y) else None)
    return out


def rows_of(
    stream: Stream, model: str, batch_size: int, out: np.ndarray | dict[str, Served], seconds: float
) -> list[dict[str, Any]]:
    """The rows of one learner's run: one model's, or a champion run's (its champion, members, blend)."""
    if isinstance(out, np.ndarray):
        return rows_for(stream, model, batch_size, out, seconds)
    rows = []
    for name, served in out.items():
        for row in rows_for(stream, name, batch_size, served.probs, seconds):
            if served.switches:
                row["switches"] = served.switches  # [(events before, member that served from there)]
            rows.append(row)
    return rows


def rows_for(stream: Stream, model: str, batch_size: int, probs: np.ndarray, seconds: float) -> list[dict[str, Any]]:
    labels = stream.features.labels.astype(np.float64)
    n = len(labels)
    base = {
        "model": model,
        "batch_size": batch_size,
        "samples_per_s": n / seconds if seconds > 0 else 0.0,
    }
    if stream.truth is None:  # real rows: whole, first half, second half
        half = n // 2
        pieces = [("", slice(0, n)), ("/first-half", slice(0, half)), ("/second-half", slice(half, n))]
        return [
            {
                "dataset": stream.name + suffix,
                **base,
                "events": s.stop - s.start,
                **score(labels[s], probs[s]),
                "auc_by_tenth": auc_by_tenth(labels[s], probs[s]),  # in stream order (bench/plots.py)
                "truth_auc": None,
            }
            for suffix, s in pieces
        ]
    window = slice(max(0, n - WINDOW), n)
    truth_auc = auc_exact(labels, stream.truth)
    window_auc, window_truth = auc_exact(labels[window], probs[window]), auc_exact(labels[window], stream.truth[window])
    return [
        {
            "dataset": stream.name,
            **base,
            "events": n,
            **score(labels, probs),
            "auc_by_tenth": auc_by_tenth(labels, probs),
            "truth_auc": truth_auc,
            "gap_to_truth": truth_auc - auc_exact(labels, probs),
            "window_events": window.stop - window.start,
            "window_auc": window_auc,
            "window_truth_auc": window_truth,
            "window_gap_to_truth": window_truth - window_auc,
            "window_logloss": logloss(labels[window], probs[window]),
            "window_ece": ece(labels[window], probs[window]),
        }
    ]


def run_accuracy_bench(
    schema: Schema,
    settings: TrainerSettings,
    events: int = 1_000_000,
    drift: float = 0.5,
    criteo_dir: str = "../shared/data/criteo",
    ablation: bool = True,
    progress: bool = True,
    logs: list[str] | None = None,
) -> dict[str, Any]:
    """Every (dataset, model) pair, plus the extra rows of the module docstring. JSON-ready.
    `logs`: log files of `schema` to use as the real rows instead of the Criteo files; the
    synthetic datasets are skipped (and the JSON says why) when the generator cannot drive the schema."""
    result: dict[str, Any] = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "defaults": flat_fields(settings),
        "runs": [],
    }
    batch = settings.batch_size
    families = {f"adstream-{kind}": with_changes(settings, {"model.kind": kind}) for kind in MODEL_KINDS}
    jobs: list[tuple[Callable[[], Stream | None], list[tuple[str, int, Learner]]]] = []
    real_jobs = [("adstream", REAL_BATCH, adstream_learner(schema, settings))]
    real_jobs += [(CHAMPION, REAL_BATCH, champion_learner(schema, settings))]
    real_jobs += [
        (name, REAL_BATCH, adstream_learner(schema, s))
        for name, s in families.items()
        if s.model.kind != settings.model.kind
    ]
    real_jobs += [("river-lr", 1, river_learner()), ("pytorch-deepfm", REAL_BATCH, baseline_learner(schema))]
    if ablation:
        real_jobs += [
            (f"ablation: {name}", REAL_BATCH, adstream_learner(schema, with_changes(settings, change)))
            for name, change in ABLATION.items()
        ]
    jobs.append((lambda: real_stream(schema, criteo_dir, logs), real_jobs))
    refusal = generator_refusal(schema)
    if refusal is not None:
        result["synthetic"] = f"skipped: {refusal}"
    synthetic_jobs = [
        ("adstream", batch, adstream_learner(schema, settings)),
        (CHAMPION, batch, champion_learner(schema, settings)),
    ]
    synthetic_jobs += [
        (name, batch, adstream_learner(schema, s))
        for name, s in families.items()
        if s.model.kind != settings.model.kind
    ]
    synthetic_jobs += [
        ("river-lr", 1, river_learner()),
        ("pytorch-deepfm", batch, baseline_learner(schema)),
        ("adstream-b4096", 4096, adstream_learner(schema, settings)),
        ("adstream-b4096-cowclip", 4096, adstream_learner(schema, with_changes(settings, {"optim.clip_ratio": 1.0}))),
    ]
    if refusal is None:
        jobs.append((lambda: synthetic_stream(schema, events, 0.0), synthetic_jobs))
    drift_jobs = [
        ("adstream", batch, adstream_learner(schema, settings)),
        (CHAMPION, batch, champion_learner(schema, settings)),
        ("adstream-frozen-at-20%", batch, adstream_learner(schema, settings, freeze_at=events // 5)),
        ("river-lr", 1, river_learner()),
    ]
    if refusal is None:
        jobs.append((lambda: synthetic_stream(schema, events, drift), drift_jobs))
    total = sum(len(j) for _, j in jobs)
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("bench accuracy", total=total)
        for make_stream, learners in jobs:
            stream = make_stream()
            if stream is None:
                result["real_rows"] = f"no rows in {logs}" if logs else f"no Criteo rows under {criteo_dir}"
                bar.advance(task, len(learners))
                continue
            # warm-up (lazy imports, allocator, thread pools), so the first model's samples/s is not penalized
            learners[0][2](stream.features.split(512)[0], learners[0][1])
            for name, batch_size, learn in learners:
                bar.update(task, description=f"{stream.name}: {name}")
                started = time.perf_counter()
                probs = learn(stream.features, batch_size)
                result["runs"] += rows_of(stream, name, batch_size, probs, time.perf_counter() - started)
                bar.advance(task)
    result["targets"] = check_targets(result["runs"], settings.challengers_budget)
    return result


def _find(runs: list[dict[str, Any]], dataset: str, model: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["dataset"] == dataset and r["model"] == model), None)


def champion_targets(runs: list[dict[str, Any]], budget: float) -> dict[str, Any]:
    """The champion's floors on every whole data set: within 0.002 of the best member (AUC and
    logloss), no worse than online LR; its last window on the synthetic streams; its cost."""
    out: dict[str, Any] = {}
    for name in sorted({r["dataset"] for r in runs if "/" not in r["dataset"]}):
        champion, lr = _find(runs, name, CHAMPION), _find(runs, name, "river-lr")
        members = [r for r in runs if r["dataset"] == name and r["model"].startswith(MEMBER)]
        if champion is None:
            continue
        if members:
            best_auc, best_loss = max(m["auc"] for m in members), min(m["logloss"] for m in members)
            out[f"{name}: champion auc >= best member - 0.002"] = [
                champion["auc"],
                best_auc - 0.002,
                champion["auc"] >= best_auc - 0.002,
            ]
            out[f"{name}: champion logloss <= best member + 0.002"] = [
                champion["logloss"],
                best_loss + 0.002,
                champion["logloss"] <= best_loss + 0.002,
            ]
        if lr is not None:
            out[f"{name}: champion auc >= online LR"] = [champion["auc"], lr["auc"], champion["auc"] >= lr["auc"]]
            out[f"{name}: champion logloss <= online LR"] = [
                champion["logloss"],
                lr["logloss"],
                champion["logloss"] <= lr["logloss"],
            ]
        single = _find(runs, name, "adstream")
        if champion.get("window_gap_to_truth") is not None and single is not None:
            if name == "synthetic":
                out[f"{name}: champion's last-window gap to truth <= 0.01"] = [
                    champion["window_gap_to_truth"],
                    0.01,
                    champion["window_gap_to_truth"] <= 0.01,
                ]
            else:
                out[f"{name}: champion's last-window AUC >= the single default model's - 0.002"] = [
                    champion["window_auc"],
                    single["window_auc"] - 0.002,
                    champion["window_auc"] >= single["window_auc"] - 0.002,
                ]
        if name == "synthetic" and single is not None:
            share = 1 - champion["samples_per_s"] / single["samples_per_s"]
            out[f"{name}: challengers' share of the time <= budget {budget} + 10%"] = [
                share,
                budget * 1.1,
                share <= budget * 1.1,
            ]
    return out


def check_targets(runs: list[dict[str, Any]], budget: float = 0.5) -> dict[str, Any]:
    """The issue's floors, each with the figures it compares."""
    out: dict[str, Any] = champion_targets(runs, budget)
    real = sorted({r["dataset"].split("/")[0] for r in runs if not r["dataset"].startswith("synthetic")})
    for part in [p for name in real for p in (name, f"{name}/second-half")]:
        ours, lr, deepfm = (_find(runs, part, m) for m in ("adstream", "river-lr", "pytorch-deepfm"))
        if ours and lr and deepfm:
            out[f"{part}: auc >= online LR + 0.005"] = [
                ours["auc"],
                lr["auc"] + 0.005,
                ours["auc"] >= lr["auc"] + 0.005,
            ]
            out[f"{part}: logloss <= online LR"] = [ours["logloss"], lr["logloss"], ours["logloss"] <= lr["logloss"]]
            out[f"{part}: auc >= plain DeepFM"] = [ours["auc"], deepfm["auc"], ours["auc"] >= deepfm["auc"]]
    syn = _find(runs, "synthetic", "adstream")
    if syn:
        out["synthetic: last-window gap to truth <= 0.01"] = [
            syn["window_gap_to_truth"],
            0.01,
            syn["window_gap_to_truth"] <= 0.01,
        ]
    drifting = [r for r in runs if r["dataset"].startswith("synthetic-drift")]
    online = next((r for r in drifting if r["model"] == "adstream"), None)
    frozen = next((r for r in drifting if r["model"] == "adstream-frozen-at-20%"), None)
    if online and frozen:
        out["drift: last-window gap to truth <= 0.015"] = [
            online["window_gap_to_truth"],
            0.015,
            online["window_gap_to_truth"] <= 0.015,
        ]
        out["drift: frozen model's last-window AUC (behind the online one)"] = [
            frozen["window_auc"],
            online["window_auc"],
            frozen["window_auc"] < online["window_auc"],
        ]
    small, big = _find(runs, "synthetic", "adstream"), _find(runs, "synthetic", "adstream-b4096-cowclip")
    if small and big:
        out["batch 4096 + CowClip: auc within 0.003 of the default batch"] = [
            big["auc"],
            small["auc"],
            big["auc"] >= small["auc"] - 0.003,
        ]
        out["batch 4096 + CowClip: >= 3x samples/s"] = [
            big["samples_per_s"],
            small["samples_per_s"],
            big["samples_per_s"] >= 3 * small["samples_per_s"],
        ]
    return out
