"""`adstream bench join`: what learning from joined impressions and delayed clicks costs in accuracy,
and what the joiner costs in time and state. JSON; ends with a `targets` block.

In process (no Kafka): the drifting synthetic stream, each impression at `rate` per event-time
second with a click delay drawn from stream.produce.clicks.ClickDelays for each positive, joined by
stream/join/policy.py's Cursor at windows of 5 and 30 minutes. Every impression is scored when it arrives
(the model as it stands then, as serving would score it) and the scores are compared with the TRUE
labels: the oracle (labels known at once: the ceiling), `window` (final labels, as stale as the
window), `fake_negative` + FNW and + FNC (trainer.optim.delayed_feedback). Also each policy's share
of positives at learning time and the mean staleness of what it learns.

On the local stack: `adstream join`'s Joiner in process on its own topics: impressions/s with
bundled and single impressions (clicks/s beside), and the state bytes per pending impression vs
the impression's raw bytes (the exactly-once kills are tests/integration/test_join.py).
"""

from __future__ import annotations

import collections
import os
import time
import uuid
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from stream.join.outputs import read_events
from stream.join.policy import FIRST_EMISSIONS, Click, Cursor, Entry, Impression, JoinRules, put_into
from stream.produce.clicks import ClickDelays
from stream.records import FeatureBatch
from stream.schema import Schema
from trainer.batch import batch_from_features
from trainer.metrics import auc_exact, ece, logloss
from trainer.settings import TrainerSettings
from trainer.trainer import Trainer

CHUNK = 1024  # impressions scored together, then what the join emitted meanwhile is learned


def _arrivals(n: int, labels: np.ndarray, rate: float, rng: np.random.Generator) -> list[tuple[int, int, int]]:
    """(time ms, kind 0 = impression / 1 = click, index) for every impression and click, in time order."""
    ts = (np.arange(n) * (1000.0 / rate)).astype(np.int64)
    clicked = np.nonzero(labels == 1)[0]
    click_ts = ts[clicked] + ClickDelays().draw(len(clicked), rng)
    events = [(int(t), 0, i) for i, t in enumerate(ts.tolist())]
    events += [(int(t), 1, int(i)) for t, i in zip(click_ts.tolist(), clicked.tolist(), strict=True)]
    events.sort()
    return events


def _learn_policy(
    schema: Schema,
    settings: TrainerSettings,
    stream: FeatureBatch,
    truth_labels: np.ndarray,
    arrivals: list[tuple[int, int, int]],
    policy: str,
    rules: JoinRules | None,
) -> dict[str, Any]:
    """Score every impression on arrival, learn what the join emits; metrics against the true labels."""
    torch.manual_seed(0)
    trainer = Trainer(schema, settings)
    n = len(truth_labels)
    scores = np.zeros(n)
    entries: dict[str, Entry] = {}

    cursor = Cursor(rules, entries.get, partial(put_into, entries)) if rules is not None else None
    ts = np.zeros(n, dtype=np.int64)
    learned = positives = 0
    staleness: list[int] = []
    pending: list[int] = []
    started = time.perf_counter()

    def flush_chunk(now: int) -> None:
        nonlocal learned, positives
        if not pending:
            return
        idx = np.asarray(pending)
        scores[idx] = trainer.predict(batch_from_features([_take(stream, idx)]))
        if cursor is None:  # the oracle: learn the true labels at once
            rows, labels = idx, truth_labels[idx]
        else:
            emitted, _, _ = cursor.take()
            rows = np.asarray([int(e.impression_id) for e in emitted], dtype=np.int64)
            labels = np.asarray([e.label for e in emitted], dtype=np.float32)
            staleness.extend(now - ts[int(e.impression_id)] for e in emitted if e.kind in FIRST_EMISSIONS)
        pending.clear()
        if len(rows):
            part = _take(stream, rows)
            part = replace(part, labels=labels.astype(np.float32))
            trainer.learn(batch_from_features([part]))
            learned += len(rows)
            positives += int(labels.sum())

    for t, kind, i in arrivals:
        if kind == 0:
            ts[i] = t
            pending.append(i)
            if cursor is not None:
                cursor.impression(Impression(str(i), t, b""))
            if len(pending) >= CHUNK:
                flush_chunk(t)
        elif cursor is not None:
            cursor.click(Click(str(i), t))
    flush_chunk(int(ts.max()))
    labels = truth_labels.astype(np.float64)
    return {
        "policy": policy,
        "auc": auc_exact(labels, scores),
        "logloss": logloss(labels, scores),
        "ece": ece(labels, scores),
        "positive_share_at_learning": positives / max(learned, 1),
        "true_positive_share": float(labels.mean()),
        "events_learned": learned,
        "staleness_mean_s": float(np.mean(staleness)) / 1000 if staleness else 0.0,
        "seconds": time.perf_counter() - started,
    }


def _take(stream: FeatureBatch, rows: np.ndarray) -> FeatureBatch:
    return FeatureBatch(
        labels=stream.labels[rows],
        dense=stream.dense[rows],
        ids=stream.ids[rows],
        ts=stream.ts[rows],
        event_ids=tuple(str(int(i)) for i in rows),
        partitions=stream.partitions[rows],
        offsets=stream.offsets[rows],
        schema_hash=stream.schema_hash,
        lists=(),
    )


def accuracy_runs(
    schema: Schema, settings: TrainerSettings, events: int, drift: float, rate: float, windows_s: tuple[float, ...]
) -> list[dict[str, Any]]:
    from bench.accuracy import synthetic_stream

    stream = synthetic_stream(schema, events, drift).features
    labels = stream.labels.astype(np.int64)
    arrivals = _arrivals(len(labels), labels, rate, np.random.default_rng(101))
    runs = [{"window_s": None, **_learn_policy(schema, settings, stream, labels, arrivals, "oracle", None)}]
    for window in windows_s:
        for policy, delayed in (("window", "none"), ("fake_negative", "fnw"), ("fake_negative", "fnc")):
            rules = JoinRules(policy=policy, window_ms=int(window * 1000), allowed_lateness_ms=0, elapsed_ms=0)
            chosen = replace(settings, optim=replace(settings.optim, delayed_feedback=delayed))
            name = policy if delayed == "none" else f"{policy}+{delayed}"
            run = _learn_policy(schema, chosen, stream, labels, arrivals, name, rules)
            runs.append({"window_s": window, **run})
            print(f"join bench: window {window:.0f}s {name}: auc {run['auc']:.4f}", flush=True)
    return runs


def joiner_runs(
    kafka: Any, stream_settings: Any, schema: Schema, events: int, state_root: Path
) -> list[dict[str, Any]]:
    """The Joiner in process on fresh topics: impressions/s bundled and single, and state bytes."""
    from stream.formats.arrow import event_table
    from stream.join.joiner import Joiner, collect_garbage_rarely
    from stream.kafka.topics import ensure_topics
    from stream.produce.clicks import interleave, split_clicks
    from stream.produce.replay import replay
    from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo
    from stream.settings import JoinSettings

    collect_garbage_rarely()  # as `adstream join`'s process does
    out = []
    # (bundle, format, window): the first two hold every impression pending to the end (the state
    # per pending impression); the third closes windows all along (close and forget: the full cost)
    for bundle, fmt, window_s in ((1000, "arrow", None), (1, "json", None), (1000, "arrow", 300.0)):
        n = events if bundle > 1 else min(events, 50_000)
        tag = uuid.uuid4().hex[:8]
        topics = kafka.scoped(f"bench-join-{tag}")
        ensure_topics(topics)
        generator = SyntheticCriteo(schema, SyntheticConfig(seed=3))
        rows, _ = generator.generate(n)
        split = split_clicks(event_table(rows, schema), schema, np.random.default_rng(1), event_rate=100.0)
        records = list(
            interleave([split], schema, topics.impressions_topic, topics.clicks_topic, topics.partitions, bundle, fmt)
        )
        raw_bytes = sum(len(r.value) for r in records if r.topic == topics.impressions_topic) / n
        replay(records, topics, progress=False)
        join = JoinSettings(
            window_s=window_s or 10 * n / 100.0, state_dir=str(state_root / tag), app_id=f"bench-join-{tag}"
        )
        joiner = Joiner(topics, replace(stream_settings, join=join))
        joiner.start()
        read, idle, started, cpu_started = 0, 0, time.perf_counter(), time.process_time()
        total = len(records)
        while read < total and idle < 20:
            got = joiner.step(0.5)  # a bounded backlog: fill chunks
            read += got
            idle = 0 if got else idle + 1
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        for part in joiner.parts.values():
            part.state.db.flush()
        entries = sum(1 for part in joiner.parts.values() for _ in part.state.entries())
        state = sum(f.stat().st_size for f in (state_root / tag).rglob("*.sst"))
        joiner.close()
        out.append(
            {
                "impressions": n,
                "window_s": join.window_s,
                "bundle": bundle,
                "format": fmt,
                "clicks": len(split.click_ids),
                "seconds": seconds,
                "impressions_per_s": n / seconds,
                "cpu_us_per_impression": cpu / n * 1e6,
                "load_average_1m": os.getloadavg()[0],
                "clicks_per_s": len(split.click_ids) / seconds,
                "records_read": read,
                "pending_entries": entries,
                "raw_bytes_per_impression": raw_bytes,
                "state_bytes_per_pending_impression": state / max(entries, 1),
            }
        )
        print(
            f"join bench: joiner {fmt} x{bundle} window {join.window_s:.0f}s: {n / seconds:,.0f} impressions/s",
            flush=True,
        )
    return out


def run_join_bench(
    schema: Schema,
    settings: TrainerSettings,
    kafka: Any,
    stream_settings: Any,
    state_root: Path,
    events: int = 300_000,
    drift: float = 0.5,
    rate: float = 5.0,
) -> dict[str, Any]:
    windows = (300.0, 1800.0)
    runs = accuracy_runs(schema, settings, events, drift, rate, windows)
    joiner = joiner_runs(kafka, stream_settings, schema, 200_000, state_root)
    latency = latency_runs(kafka, stream_settings, schema, state_root)
    kills = kill_run(kafka, stream_settings, schema, state_root)
    print(f"join bench: 5 kills: {kills}", flush=True)
    result = {
        "events": events,
        "impressions_per_event_second": rate,
        "window_share_of_stream_30min": min(1.0, rate * 1800 / events),
        "click_delays": {"shares": ClickDelays().shares, "means_s": ClickDelays().means_s},
        "accuracy": runs,
        "joiner": joiner,
        "latency": latency,
        "kills": kills,
    }
    result["targets"] = check_targets(result)
    return result


def check_targets(result: dict[str, Any]) -> dict[str, Any]:
    def find(window: float | None, policy: str) -> dict[str, Any]:
        return next(r for r in result["accuracy"] if r["window_s"] == window and r["policy"] == policy)

    oracle, fnw, window = find(None, "oracle"), find(1800.0, "fake_negative+fnw"), find(1800.0, "window")
    bundled = next(r for r in result["joiner"] if r["bundle"] > 1)  # the first: every impression pending
    single = next(r for r in result["joiner"] if r["bundle"] == 1)
    ratio = bundled["state_bytes_per_pending_impression"] / bundled["raw_bytes_per_impression"]
    kills = result["kills"]
    return {
        "window: 0 lost, 0 duplicated, 0 wrong labels across 5 SIGKILLs": [
            kills["lost"] + kills["duplicated"] + kills["wrong_label"],
            0,
            kills["lost"] + kills["duplicated"] + kills["wrong_label"] == 0 and kills["kills"] == 5,
        ],
        "fake_negative+FNW within 0.005 AUC of the oracle (30-minute window)": [
            oracle["auc"] - fnw["auc"],
            0.005,
            oracle["auc"] - fnw["auc"] <= 0.005,
        ],
        "fake_negative+FNW ahead of window (30-minute window)": [
            fnw["auc"] - window["auc"],
            0.0,
            fnw["auc"] > window["auc"],
        ],
        "joiner >= 50k impressions/s per process, bundled": [
            bundled["impressions_per_s"],
            50_000,
            bundled["impressions_per_s"] >= 50_000,
        ],
        "joiner >= 30k impressions/s per process, single JSON impressions": [
            single["impressions_per_s"],
            30_000,
            single["impressions_per_s"] >= 30_000,
        ],
        "state <= 2x the raw bytes of a pending impression": [ratio, 2.0, ratio <= 2.0],
    }


# --- the joiner on the local stack: latency and kills ----------------------------------------
def _spawn_joiner(kafka: Any, stream_settings: Any) -> Any:
    """`adstream join`'s worker in a child process (spawned: a fresh interpreter, as the CLI's)."""
    import multiprocessing

    from stream.join.joiner import run_joiner

    child = multiprocessing.get_context("spawn").Process(target=run_joiner, args=(kafka, stream_settings))
    child.start()
    return child


def _read_committed(bootstrap: str, group: str) -> Any:
    from confluent_kafka import Consumer

    return Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )


def _latencies(consumer: Any, done: Any, policy: str, out: list[tuple[int, float]]) -> None:
    """Until done: (label, wall time minus event time (= the impression's production)) of each
    first emission (under fake_negative, the label-0 ones; under window, every one)."""
    while not done.is_set():
        for message in consumer.consume(500, 0.05):
            if message.error() is None:
                now = time.time() * 1000
                for event in read_events(message.value()):
                    if event["label"] == 0 or policy == "window":
                        out.append((event["label"], now - event["ts"]))


def _percentile(latencies: list[tuple[int, float]], label: int | None, q: float) -> float:
    values = [ms for lab, ms in latencies if label is None or lab == label]
    return float(np.percentile(values, q)) if values else float("nan")


def latency_runs(
    kafka: Any, stream_settings: Any, schema: Schema, state_root: Path, seconds: float = 12.0, rate: float = 1000.0
) -> list[dict[str, Any]]:
    """Impressions produced live (event time = wall time, `rate` per second, one JSON record each)
    with clicks ~0.5 s later; per policy, the wall time from an impression's production to its
    first labelled emission on the events topic (window 3 s, lateness 0.5 s)."""
    import heapq
    import threading

    from confluent_kafka import Producer

    from stream.formats.clicks import click_record
    from stream.kafka.partitioner import murmur2_partition
    from stream.kafka.topics import ensure_topics
    from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo
    from stream.settings import JoinSettings

    out = []
    rows, _ = SyntheticCriteo(schema, SyntheticConfig(seed=5)).generate(int(seconds * rate))
    for policy in ("window", "fake_negative"):
        tag = uuid.uuid4().hex[:8]
        topics = kafka.scoped(f"bench-joinlat-{tag}")
        ensure_topics(topics)
        join = JoinSettings(
            policy=policy,
            window_s=3.0,
            allowed_lateness_s=0.5,
            state_dir=str(state_root / tag),
            app_id=f"bench-joinlat-{tag}",
        )
        child = _spawn_joiner(topics, replace(stream_settings, join=join))
        consumer = _read_committed(topics.bootstrap, f"bench-joinlat-{tag}-reader")
        consumer.subscribe([topics.events_topic])
        latencies: list[tuple[int, float]] = []
        done = threading.Event()

        reader = threading.Thread(target=_latencies, args=(consumer, done, policy, latencies), daemon=True)
        reader.start()
        time.sleep(8)  # the joiner's start (a spawned interpreter, init_transactions)
        producer = Producer({"bootstrap.servers": topics.bootstrap, "linger.ms": 2})
        clicks: list[tuple[float, str]] = []
        start = time.time()
        for i, row in enumerate(rows):
            due = start + i / rate
            while True:
                now = time.time()
                while clicks and clicks[0][0] <= now:
                    _, key = heapq.heappop(clicks)
                    producer.produce(
                        topics.clicks_topic,
                        click_record(key, int(now * 1000)),
                        key.encode(),
                        partition=murmur2_partition(key.encode(), topics.partitions),
                    )
                if now >= due:
                    break
                time.sleep(min(due - now, 0.001))
            event = {k: v for k, v in row.items() if k != schema.label} | {schema.timestamp: int(time.time() * 1000)}
            raw = str(event[schema.event_id]).encode()
            producer.produce(
                topics.impressions_topic, orjson.dumps(event), raw, partition=murmur2_partition(raw, topics.partitions)
            )
            producer.poll(0)
            if row[schema.label]:
                heapq.heappush(
                    clicks,
                    (time.time() + float(np.random.default_rng(i).exponential(0.5)), str(event[schema.event_id])),
                )
        producer.flush(30)
        time.sleep(join.window_s + 3)
        done.set()
        reader.join(10)
        consumer.close()
        child.kill()
        child.join()

        out.append(
            {
                "policy": policy,
                "impressions": len(rows),
                "emitted_first": len(latencies),
                "latency_p50_ms": _percentile(latencies, None, 50),
                "latency_p99_ms": _percentile(latencies, None, 99),
                # window: a click emits at once, an unclicked impression when its window closes
                "positives_p50_ms": _percentile(latencies, 1, 50) if policy == "window" else None,
                "negatives_p50_ms": _percentile(latencies, 0, 50) if policy == "window" else None,
                "window_s": join.window_s,
                "chunk_wait_s": join.chunk_wait_s,
            }
        )
        print(
            f"join bench: latency {policy}: p50 {out[-1]['latency_p50_ms']:.0f} ms, "
            f"p99 {out[-1]['latency_p99_ms']:.0f} ms",
            flush=True,
        )
    return out


def kill_run(
    kafka: Any, stream_settings: Any, schema: Schema, state_root: Path, events: int = 20_000, kills: int = 5
) -> dict[str, Any]:
    """`window` on a replay of impressions + clicks with a SIGKILL of the joiner at `kills` random
    points (each restart resumes from its state); the emitted events against the truth, one by one."""
    import os
    import random
    import signal

    from stream.formats.arrow import event_table
    from stream.kafka.partitioner import murmur2_partition
    from stream.kafka.topics import ensure_topics
    from stream.produce.clicks import interleave, split_clicks
    from stream.produce.replay import replay
    from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo
    from stream.settings import JoinSettings

    tag = uuid.uuid4().hex[:8]
    topics = kafka.scoped(f"bench-joinkill-{tag}")
    ensure_topics(topics)
    window_s, lateness_s, rate = 60.0, 5.0, 100.0
    rows, _ = SyntheticCriteo(schema, SyntheticConfig(seed=13)).generate(events)
    split = split_clicks(event_table(rows, schema), schema, np.random.default_rng(13), event_rate=rate)
    imp_ts = dict(
        zip(
            split.impressions.column(schema.event_id).to_pylist(),
            split.impressions.column(schema.timestamp).to_pylist(),
            strict=True,
        )
    )
    in_window = {
        k for k, t in zip(split.click_ids, split.click_ts.tolist(), strict=True) if t - imp_ts[k] <= window_s * 1000
    }
    end = max(imp_ts.values()) + int((window_s + lateness_s + 10) * 1000)
    sentinels: dict[int, dict[str, Any]] = {}
    for n in range(1000):  # an impression past every window in each partition closes them all
        key = f"sentinel-{n}"
        sentinels.setdefault(
            murmur2_partition(key.encode(), topics.partitions), {**rows[0], schema.event_id: key, schema.timestamp: end}
        )
    tail = split_clicks(event_table(list(sentinels.values()), schema), schema, np.random.default_rng(0))
    tail = replace(tail, click_ids=[], click_ts=np.zeros(0, np.int64))
    args = (schema, topics.impressions_topic, topics.clicks_topic, topics.partitions)
    replay([*interleave([split], *args, bundle=100, fmt="arrow"), *interleave([tail], *args)], topics, progress=False)
    join = JoinSettings(
        window_s=window_s,
        allowed_lateness_s=lateness_s,
        state_dir=str(state_root / tag),
        app_id=f"bench-joinkill-{tag}",
        take_records=16,
    )
    settings = replace(stream_settings, join=join)
    rng = random.Random(13)
    started = time.perf_counter()
    for _ in range(kills):
        child = _spawn_joiner(topics, settings)
        time.sleep(rng.uniform(6.0, 10.0))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
    child = _spawn_joiner(topics, settings)
    consumer = _read_committed(topics.bootstrap, f"bench-joinkill-{tag}-reader")
    consumer.subscribe([topics.events_topic])
    seen: collections.Counter[str] = collections.Counter()
    labels: dict[str, int] = {}
    deadline, quiet_since = time.monotonic() + 300, time.monotonic()
    while time.monotonic() < deadline and (len(seen) < len(imp_ts) or time.monotonic() - quiet_since < 5):
        got = [m for m in consumer.consume(500, 0.5) if m.error() is None]
        if got:
            quiet_since = time.monotonic()
        for message in got:
            for event in read_events(message.value()):
                if not str(event[schema.event_id]).startswith("sentinel-"):
                    seen[event[schema.event_id]] += 1
                    labels[event[schema.event_id]] = event[schema.label]
    consumer.close()
    child.kill()
    child.join()
    truth = {k: int(k in in_window) for k in imp_ts}
    return {
        "impressions": events,
        "clicks": len(split.click_ids),
        "kills": kills,
        "seconds": time.perf_counter() - started,
        "lost": sum(1 for k in truth if k not in seen),
        "duplicated": sum(1 for v in seen.values() if v > 1),
        "wrong_label": sum(1 for k, label in labels.items() if truth.get(k) != label),
        "unknown": sum(1 for k in seen if k not in truth),
    }
