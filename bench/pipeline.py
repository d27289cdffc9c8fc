"""`adstream bench pipeline`: each stage alone on the local stack, plus a plain PyTorch baseline.

Reports events/s for replay (single JSON events, Arrow bundles, raw Criteo TSV), featurization
(in process, and through the Faust worker on the broker), training (adstream's trainer and the
baseline on the same batches), and both models' progressive AUC/logloss on the real Criteo rows
(plus river's online logistic regression as a reference, when river is installed).
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from dataclasses import replace
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.baseline import PlainTorch, baseline_config, like_for_like, online_lr
from stream.featurizer.ingest import featurize_records
from stream.kafka.settings import KafkaSettings
from stream.kafka.topics import ensure_topics
from stream.produce.replay import log_records, replay, synthetic_records
from stream.produce.synthetic import SyntheticCriteo
from stream.records import FeatureBatch, RawRecord
from stream.schema import Schema, load_schema
from stream.settings import StreamSettings
from trainer.batch import Batch, batch_from_features
from trainer.metrics import ProgressiveMetrics, auc_exact, logloss
from trainer.settings import TrainerSettings
from trainer.trainer import Trainer

REAL_BATCH = 64


def _output_rates(records: list[RawRecord], schema: Schema, batch_events: int, max_bytes: int) -> dict[str, float]:
    """What a take's outputs cost: the featurizer's plan (each source partition's events sorted by
    (offset, row), cut per source partition, encoded and sized: outputs.py), beside the plain split
    and encode it replaced, on the same takes of 64 records from 4 source partitions."""
    from stream.featurizer.outputs import plan_outputs
    from stream.formats.batch_codec import encode_batch

    spread = [RawRecord(i % 4, i // 4, r.value) for i, r in enumerate(records)]
    takes = [featurize_records(spread[i : i + 64], schema)[0] for i in range(0, len(spread), 64)]
    events = sum(len(t) for t in takes)
    start = time.perf_counter()
    for take in takes:
        for part in take.split(batch_events):
            encode_batch(part)
    plain = _rate(events, time.perf_counter() - start)
    start = time.perf_counter()
    for take in takes:
        plan_outputs(take, [], batch_events, max_bytes, 4)
    return {
        "encode_batches_events_per_s": plain,
        "plan_outputs_events_per_s": _rate(events, time.perf_counter() - start),
    }


def criteo_files(criteo_dir: str | Path) -> list[Path]:
    """The real Criteo rows in time order: the 10k contiguous file first, then the samples."""
    return sorted(Path(criteo_dir).glob("*.txt"), key=lambda p: (not p.name.startswith("autoint"), p.name))


def _rate(n: int, seconds: float) -> float:
    return n / seconds if seconds > 0 else 0.0


def redirect_output(log_file: str) -> None:
    """Send this (child) process's stdout and stderr to `log_file`."""
    import sys

    with open(log_file, "ab") as log:
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())


def _worker_main(kafka: KafkaSettings, settings: StreamSettings, log_file: str) -> None:
    """The Faust worker in a child process, its output in `log_file`."""
    from stream.featurizer.app import run_worker

    redirect_output(log_file)
    run_worker(kafka, settings)


def _stop(worker: BaseProcess) -> None:
    worker.terminate()  # SIGTERM: Faust shuts down cleanly
    worker.join(20)
    if worker.is_alive():
        worker.kill()
        worker.join()


def _faust_rate(
    kafka: KafkaSettings,
    stream: StreamSettings,
    records: list,
    n_events: int,
    log_dir: Path,
    take_records: int,
    workers: int = 1,
) -> float:
    """Pre-fill a fresh events topic, start `workers` Faust workers of one app, time first-to-last
    batch arrival (the first batch's events are not counted: they arrived before the clock started)."""
    import multiprocessing

    from confluent_kafka import Consumer

    from stream.formats.batch_codec import decode_batch

    tag = uuid.uuid4().hex[:6]
    kafka = kafka.scoped(f"bench-{tag}")
    stream = replace(stream, app_id=f"bench-{tag}", take_records=take_records)
    ensure_topics(kafka)
    replay(iter(records), kafka, progress=False)
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=_worker_main, args=(kafka, stream, str(log_dir / f"bench-{tag}-{i}.log")))
        for i in range(workers)
    ]
    for process in processes:
        process.start()
    consumer = Consumer(
        {"bootstrap.servers": kafka.bootstrap, "group.id": f"bench-{tag}-check", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([kafka.batches_topic])
    seen, first_events, first, last = 0, 0, None, None
    deadline = time.monotonic() + 300
    try:
        while seen < n_events and time.monotonic() < deadline:
            for message in consumer.consume(100, timeout=0.5):
                if message.error():
                    continue
                now = time.perf_counter()
                events = len(decode_batch(message.value() or b""))
                if first is None:
                    first, first_events = now, events
                last = now
                seen += events
    finally:
        consumer.close()
        for process in processes:
            _stop(process)
    if first is None or last is None or seen < n_events:
        return float("nan")
    return _rate(seen - first_events, last - first)


def _progressive(schema: Schema, batches: list[Batch], settings: TrainerSettings) -> dict[str, float]:
    ours = Trainer(schema, settings)
    baseline = PlainTorch(baseline_config(ours.model_config))
    base_metrics = ProgressiveMetrics()
    for batch in batches:
        ours.learn(batch)
        base_metrics.update(batch.labels.numpy(), baseline.train_step(batch))
    a, b = ours.metrics.summary(), base_metrics.summary()
    return {
        "auc": a["progressive_auc"],
        "logloss": a["progressive_logloss"],
        "baseline_auc": b["progressive_auc"],
        "baseline_logloss": b["progressive_logloss"],
    }


def _tsv_log(path: Path, files: list[Path], synthetic: list[dict], schema: Schema, lines: int) -> Path:
    """A raw Criteo-layout TSV of `lines` lines."""
    if files:
        real = [line for f in files for line in f.read_text().splitlines() if line]
    else:
        names = [schema.label, *schema.integer_fields, *schema.categorical_fields]
        real = ["\t".join("" if e[k] is None else str(e[k]) for k in names) for e in synthetic]
    with open(path, "w") as out:
        for i in range(lines):
            out.write(real[i % len(real)] + "\n")
    return path


def _list_field_rates(events: int) -> dict[str, float]:
    """Featurize rates (in process) of a schema with a list field (criteo_tags), JSON and Arrow."""
    schema = load_schema("criteo_tags")
    synthetic, _ = SyntheticCriteo(schema).generate(events)
    json_records = [RawRecord(0, i, r.value) for i, r in enumerate(synthetic_records(synthetic, schema))]
    start = time.perf_counter()
    for i in range(0, len(json_records), 1024):
        featurize_records(json_records[i : i + 1024], schema)
    json_rate = _rate(events, time.perf_counter() - start)
    bundles = [RawRecord(0, i, r.value) for i, r in enumerate(synthetic_records(synthetic, schema, 1024, "arrow"))]
    start = time.perf_counter()
    for record in bundles:
        featurize_records([record], schema)
    return {
        "featurize_list_json_events_per_s": json_rate,
        "featurize_list_events_per_s": _rate(events, time.perf_counter() - start),
    }


def run_pipeline_bench(
    kafka: KafkaSettings,
    stream: StreamSettings,
    trainer_settings: TrainerSettings,
    log_dir: Path,
    events: int = 100_000,
    criteo_dir: str = "../shared/data/criteo",
) -> dict[str, Any]:
    """Every stage's figures on a running broker at `kafka` (the CLI starts the local stack)."""
    schema = load_schema(stream.schema)
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "events": events,
    }
    log_dir.mkdir(parents=True, exist_ok=True)
    generator = SyntheticCriteo(schema)
    synthetic, _ = generator.generate(events)

    # replay: pre-encoded records, so the figure is the producer's, not the generator's
    tag = uuid.uuid4().hex[:6]
    scoped = kafka.scoped(f"bench-{tag}")
    ensure_topics(scoped)
    singles = list(synthetic_records(synthetic, schema))
    result["replay_events_per_s"] = replay(iter(singles), scoped, progress=False).events_per_s
    bundles = list(synthetic_records(synthetic, schema, bundle=1024, fmt="arrow"))
    result["replay_bundled_events_per_s"] = replay(iter(bundles), scoped, progress=False).events_per_s
    # parse + check + encode + produce, from a raw TSV log of `events` lines (the real rows repeated
    # when present, else the synthetic events written as Criteo lines)
    files = criteo_files(criteo_dir)
    tsv = _tsv_log(log_dir / f"bench-{tag}.tsv", files, synthetic, schema, events)
    result["replay_criteo_tsv_events_per_s"] = replay(log_records([tsv], schema), scoped, progress=False).events_per_s
    result["replay_tsv_bundled_events_per_s"] = replay(
        log_records([tsv], schema, bundle=1024, fmt="arrow"), scoped, progress=False
    ).events_per_s
    target = 50_000.0  # --rate: how close replay holds a rate (over >= 2 s)
    paced = replay(log_records([tsv], schema), scoped, rate=target, limit=min(events, 150_000), progress=False)
    result["replay_rate_target"], result["replay_rate_achieved"] = target, paced.events_per_s
    tsv.unlink()

    # featurization, in process (the pure function the agent wraps)
    json_records = [RawRecord(0, i, r.value) for i, r in enumerate(singles)]
    start = time.perf_counter()
    for i in range(0, len(json_records), 1024):
        featurize_records(json_records[i : i + 1024], schema)
    result["featurize_json_events_per_s"] = _rate(events, time.perf_counter() - start)
    arrow_records = [RawRecord(0, i, r.value) for i, r in enumerate(bundles)]
    start = time.perf_counter()
    feature_batches = [featurize_records([r], schema)[0] for r in arrow_records]
    result["featurize_events_per_s"] = _rate(events, time.perf_counter() - start)
    result.update(_output_rates(arrow_records, schema, stream.batch_events, kafka.max_message_bytes))
    # ... and through the Faust worker on the broker
    result["faust_single_events_per_s"] = _faust_rate(kafka, stream, singles, events, log_dir, take_records=1024)
    many = list(synthetic_records(generator.generate(5 * events)[0], schema, bundle=1024, fmt="arrow"))
    result["faust_bundled_events_per_s"] = _faust_rate(kafka, stream, many, 5 * events, log_dir, take_records=4)
    result["faust_workers_2_events_per_s"] = _faust_rate(
        kafka, stream, many, 5 * events, log_dir, take_records=4, workers=2
    )
    result.update(_list_field_rates(events))

    # training: the same batches for adstream's trainer and the baseline
    batches = [batch_from_features([fb]) for fb in feature_batches]
    trainer = Trainer(schema, trainer_settings)
    start = time.perf_counter()
    for batch in batches:
        trainer.learn(batch)
    result["train_samples_per_s"] = _rate(events, time.perf_counter() - start)
    baseline = PlainTorch(like_for_like(trainer.model_config))  # the same model: the ratio is our machinery's
    start = time.perf_counter()
    for batch in batches:
        baseline.train_step(batch)
    result["baseline_train_samples_per_s"] = _rate(events, time.perf_counter() - start)
    result["train_store_rows"] = len(trainer.table)
    result["train_store_bytes"] = trainer.table.tier.bytes_used()

    # accuracy on the real rows, in file order, test-then-train; 10k rows favour small batches
    # (the trainer's defaults; the baseline keeps its own plain Adam / SparseAdam rates)
    if files:
        records = [
            RawRecord(0, i, record.value)
            for i, record in enumerate(log_records(files, schema, bundle=REAL_BATCH, fmt="arrow"))
            if record.reason is None
        ]
        real = [batch_from_features([featurize_records([r], schema)[0]]) for r in records]
        scores = _progressive(schema, real, trainer_settings)
        result.update(
            {
                "auc_real": scores["auc"],
                "logloss_real": scores["logloss"],
                "baseline_auc_real": scores["baseline_auc"],
                "baseline_logloss_real": scores["baseline_logloss"],
                "real_rows": int(sum(len(b) for b in real)),
                "real_batch_size": REAL_BATCH,
            }
        )
        features = FeatureBatch.concat([featurize_records([r], schema)[0] for r in records])
        river = online_lr(features)  # the same online LR as bench accuracy's
        labels = features.labels.astype(np.float64)
        result.update({"river_lr_auc_real": auc_exact(labels, river), "river_lr_logloss_real": logloss(labels, river)})
    return result
