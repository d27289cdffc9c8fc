"""`adstream bench merge`: k-step merging against synchronous data parallel, in one run.

For each dataset (the synthetic stream, whose true click probabilities are known, and the real
Criteo rows), workers in {1, 2, 4} x k in {1, 4, 16, 64}, plus a synchronous data-parallel run
(gradient all-reduce every step, reported as k = 0) per worker count, and the same synchronous run
with the rows sharded across the workers (layout "sharded", trainer/shard.py: the same model, each
worker holding only the rows it owns; rows_per_replica says how many), and with 4+ workers the
same split into 2 "nodes" (layout "sharded-2-nodes": rows sharded within each node, the nodes
merging every 16 steps shard by shard; merge_bytes is what crossed between the nodes, the rest of
bytes stayed within them). The stream is dealt out
round-robin, batch i to replica i mod N (as partitions are), and every replica scores each batch
before learning it; AUC and logloss are over all replicas' predictions. One worker has nothing to
merge, so it runs once per mode (k = 1 and k = 0).

Bytes are the payload all replicas sent (dense all-reduce, ids, rows); wall seconds exclude
process start-up.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import Progress

from bench.pipeline import REAL_BATCH, criteo_files
from common.checks import with_changes
from stream.ingest import featurize_records
from stream.records import FeatureBatch, RawRecord
from stream.replay import ReplayRecord, log_records, synthetic_records
from stream.schema import load_schema
from stream.synthetic import SyntheticCriteo
from trainer.batch import Batch
from trainer.group import launch_local
from trainer.metrics import auc_exact, logloss
from trainer.settings import TrainerSettings

WORKERS = (1, 2, 4)
KS = (1, 4, 16, 64)


def _features(records: Iterable[ReplayRecord], schema_name: str) -> list[FeatureBatch]:
    schema = load_schema(schema_name)
    out = []
    for i, record in enumerate(records):
        if record.reason is None:
            batch, _ = featurize_records([RawRecord(0, i, record.value)], schema)
            if len(batch):
                out.append(batch)
    return out


def _save(batches: list[FeatureBatch], path: Path) -> None:
    np.savez(
        path,
        ids=np.concatenate([b.ids for b in batches]),
        dense=np.concatenate([b.dense for b in batches]),
        labels=np.concatenate([b.labels for b in batches]),
        sizes=np.array([len(b) for b in batches]),
    )


def _replica(data: str, settings: TrainerSettings, k: int, schema_name: str, nodes: int) -> dict[str, Any]:
    """One replica of a bench run (spawned): learn its share of the batches, merge every k rounds
    (k = 0: synchronous steps). With settings.shard_within_node: synchronous steps over rows
    sharded across the replicas of a node, `nodes` nodes of equal size merging every k rounds."""
    import torch.distributed as dist

    from trainer.loop import Control
    from trainer.replica import Trainer
    from trainer.schedule import LoopState, Round, Schedule, decide

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["LOCAL_WORLD_SIZE"] = str(world // nodes)  # what torchrun says on each of `nodes` machines
    arrays = dict(np.load(data))  # an NpzFile would re-read the array from the archive at every access
    bounds = np.concatenate([[0], np.cumsum(arrays["sizes"])])
    trainer = Trainer(load_schema(schema_name), settings)
    labels, probs = [], []
    rounds = len(arrays["sizes"]) // world  # every replica gets the same number of batches
    # the training loop's own schedule (trainer/schedule.py); this bench neither snapshots nor reports
    control, state = Control(world), LoopState()
    schedule = Schedule(world, k, snapshot_every_steps=rounds + 1, log_every_steps=rounds + 1, max_steps=rounds)
    dist.barrier()
    started, across = time.perf_counter(), 0  # across: bytes of merges (between nodes when sharded)
    for j in range(rounds):
        lo, hi = bounds[j * world + rank], bounds[j * world + rank + 1]
        batch = Batch(
            torch.from_numpy(arrays["labels"][lo:hi]),
            torch.from_numpy(arrays["dense"][lo:hi]),
            arrays["ids"][lo:hi],
        )
        mine = Round.vector(events=len(batch), idle=False, merge_due=False, snapshot_due=False)
        state, act = decide(state, Round.from_sum(control.sum(mine)), schedule)
        prob = trainer.learn_round(batch, k)
        if act.merge:
            across += trainer.merge().bytes
        assert prob is not None  # every replica has a batch every round here
        labels.append(batch.labels.numpy())
        probs.append(prob)
    dist.barrier()
    return {
        "labels": np.concatenate(labels),
        "probs": np.concatenate(probs),
        "bytes": trainer.bytes_sent,
        "merge_bytes": across,
        "wall_s": time.perf_counter() - started,
        "rows_held": len(trainer.table),
    }


def _run(data: Path, settings: TrainerSettings, workers: int, k: int, schema_name: str, layout: str) -> dict[str, Any]:
    threads = max(1, (os.cpu_count() or 1) // workers)
    changes = {"threads": threads, "group.merge_every_steps": k, "shard_within_node": layout != "replicated"}
    nodes = 2 if layout == "sharded-2-nodes" else 1
    replicas = launch_local(_replica, workers, str(data), with_changes(settings, changes), k, schema_name, nodes)
    labels = np.concatenate([r["labels"] for r in replicas])
    probs = np.concatenate([r["probs"] for r in replicas])
    wall = max(r["wall_s"] for r in replicas)
    return {
        "workers": workers,
        "k": k,
        # "replicated": every replica its own rows; "sharded": each row on one owner;
        # "sharded-2-nodes": rows sharded within each of 2 nodes, the nodes merging every k steps
        "layout": layout,
        "rows_per_replica": [int(r["rows_held"]) for r in replicas],
        "merge_bytes": int(sum(r["merge_bytes"] for r in replicas)),  # merges (between nodes when sharded)
        "auc": auc_exact(labels, probs),
        "logloss": logloss(labels, probs),
        "bytes": int(sum(r["bytes"] for r in replicas)),
        "wall_s": wall,
        "samples_per_s": len(labels) / wall,
        "events": int(len(labels)),
    }


def _checks(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets per dataset and worker count: k=16 vs k=1 and vs synchronous."""
    out = []
    for dataset in sorted({r["dataset"] for r in runs}):
        for workers in (2, 4):
            mine = [r for r in runs if r["dataset"] == dataset and r["workers"] == workers]
            by_k = {r["k"]: r for r in mine if r["layout"] == "replicated"}
            if not {0, 1, 16} <= by_k.keys():
                continue
            sharded = next((r for r in mine if r["layout"] == "sharded"), None)
            two_nodes = next((r for r in mine if r["layout"] == "sharded-2-nodes"), None)
            k1, k16, sync = by_k[1], by_k[16], by_k[0]
            out.append(
                {
                    "dataset": dataset,
                    "workers": workers,
                    "auc_k16_minus_k1": k16["auc"] - k1["auc"],
                    "auc_k16_minus_sync": k16["auc"] - sync["auc"],
                    "bytes_k1_over_k16": k1["bytes"] / max(k16["bytes"], 1),
                    "within_0.002_of_k1": abs(k16["auc"] - k1["auc"]) <= 0.002,
                    "within_0.002_of_sync": abs(k16["auc"] - sync["auc"]) <= 0.002,
                    "bytes_cut_at_least_12x": k1["bytes"] >= 12 * k16["bytes"],
                    **(_sharded_checks(sharded, sync) if sharded else {}),
                    **(_two_node_checks(two_nodes, k16) if two_nodes else {}),
                }
            )
    return out


def _sharded_checks(sharded: dict[str, Any], sync: dict[str, Any]) -> dict[str, Any]:
    """Sharded rows vs replicated rows, both synchronous on the same batches: the same model, fewer rows a replica."""
    return {
        "sharded_auc_minus_sync": sharded["auc"] - sync["auc"],
        "sharded_bytes_over_sync": sharded["bytes"] / max(sync["bytes"], 1),
        "sharded_rows_per_replica_over_sync": max(sharded["rows_per_replica"]) / max(max(sync["rows_per_replica"]), 1),
        "sharded_samples_per_s_over_sync": sharded["samples_per_s"] / sync["samples_per_s"],
    }


def _two_node_checks(two_nodes: dict[str, Any], k16: dict[str, Any]) -> dict[str, Any]:
    """2 nodes of sharded rows merging every 16 steps vs replicas merging every 16 steps."""
    return {
        "two_nodes_bytes_across": two_nodes["merge_bytes"],
        "two_nodes_bytes_within": two_nodes["bytes"] - two_nodes["merge_bytes"],
        "two_nodes_auc_minus_replicated_k16": two_nodes["auc"] - k16["auc"],
        "two_nodes_rows_per_replica_over_replicated": max(two_nodes["rows_per_replica"])
        / max(max(k16["rows_per_replica"]), 1),
    }


def run_merge_bench(
    events: int = 2_000_000,
    criteo_dir: str = "../shared/data/criteo",
    batch_size: int = 1024,
    workers: tuple[int, ...] = WORKERS,
    ks: tuple[int, ...] = KS,
    progress: bool = True,
) -> dict[str, Any]:
    schema = load_schema("criteo")
    datasets: list[tuple[str, list[FeatureBatch], TrainerSettings]] = []
    synthetic, _ = SyntheticCriteo(schema).generate(events)
    # each run's trainer.batch_size is the batch it learns (the family's factor rate scales with it)
    synthetic_settings = TrainerSettings(batch_size=batch_size)
    datasets.append(
        (
            "synthetic",
            _features(synthetic_records(synthetic, schema, bundle=batch_size, fmt="arrow"), "criteo"),
            synthetic_settings,
        )
    )
    files = criteo_files(criteo_dir)
    if files:
        real = _features(log_records(files, schema, bundle=REAL_BATCH, fmt="arrow"), "criteo")
        datasets.append(("criteo", real, TrainerSettings(batch_size=REAL_BATCH)))
    plan = [(w, k, "replicated") for w in workers for k in ((1, 0) if w == 1 else (*ks, 0))]
    plan += [(w, 0, "sharded") for w in workers if w > 1]
    plan += [(w, 16, "sharded-2-nodes") for w in workers if w >= 4 and w % 2 == 0]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, Progress(disable=not progress) as bar:
        task = bar.add_task("bench merge", total=len(plan) * len(datasets))
        for name, batches, settings in datasets:
            data = Path(tmp) / f"{name}.npz"
            _save(batches, data)
            for w, k, layout in plan:
                runs.append({"dataset": name, **_run(data, settings, w, k, "criteo", layout)})
                bar.update(task, advance=1, description=f"{name} workers={w} k={k} {layout}")
    return {
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "synthetic_events": events,
        "synthetic_batch_size": batch_size,
        "criteo_batch_size": REAL_BATCH,
        "note": "k=0 is synchronous data parallel (layout sharded: over rows sharded across the workers); "
        "one worker runs k=1 (nothing to merge) and k=0",
        "runs": runs,
        "checks": _checks(runs),
    }
