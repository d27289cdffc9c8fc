"""`adstream demo`: the whole path on the local stack, start to served prediction.

up -> replay synthetic impressions and their delayed clicks -> joiner (subprocess; the
fake_negative policy: every impression learned at once, a click as a positive copy) -> Faust
featurizer (subprocess) -> trainer (in process, FN-weighted loss; its progressive metrics score
each impression once against its final label) -> snapshot in MLflow -> HTTP server (subprocess)
-> a few predictions printed.

The demo's event time is short (DEMO_EVENT_RATE impressions per event-time second, clicks within
seconds: DEMO_DELAYS), so its windows close within the demo; a live system keeps the defaults.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from adstream import stack
from adstream.config import Config
from adstream.errors import CliError
from adstream.processes import cli_process, stop_process, write_toml
from common.checks import with_changes
from stream.formats.arrow import event_table
from stream.kafka.settings import KafkaSettings
from stream.kafka.topics import ensure_topics
from stream.produce.clicks import ClickDelays, interleave, split_clicks
from stream.produce.replay import replay
from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo
from stream.schema import load_schema
from trainer.loop import run_training
from trainer.metrics import auc_exact


def wait_for_model(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> dict[str, Any]:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CliError(f"serve exited with {proc.returncode}; log {log}:\n{log.read_text()[-2000:]}")
        try:
            response = httpx.get(f"{url}/model", timeout=2)
            if response.status_code == 200:
                return dict(response.json())
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise CliError(f"serve: no model loaded after {timeout_s}s; log {log}")


DEMO_EVENT_RATE = 100.0  # impressions per event-time second
DEMO_DELAYS = ClickDelays(shares=(0.9, 0.1), means_s=(2.0, 30.0))  # clicks: most within seconds
DEMO_WINDOW_S, DEMO_LATENESS_S = 20.0, 2.0
HOLDOUT_EVENTS = 5_000  # fresh events the served model scores at the end, against their labels


IDLE_EXIT_S = 8.0  # the demo's trainer stops this long after its last batch


def wait_for_batches(kafka: KafkaSettings, timeout_s: float, logs: Path) -> None:
    """Until the batches topic holds a first record (the joiner and the featurizer are running)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "demo-wait"})
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            topic = consumer.list_topics(kafka.batches_topic, timeout=10).topics[kafka.batches_topic]
            ends = [
                consumer.get_watermark_offsets(TopicPartition(kafka.batches_topic, p), timeout=10)[1]
                for p in topic.partitions
            ]
            if sum(ends) > 0:
                return
            time.sleep(0.5)
    finally:
        consumer.close()
    raise CliError(f"demo: no feature batch after {timeout_s:.0f}s; see {logs / 'join.log'} and {logs / 'stream.log'}")


def close_the_loop(
    url: str,
    kafka: KafkaSettings,
    schema: Any,
    served: dict[str, Any],
    events: list[dict[str, Any]],
    timeout_s: float = 120,
) -> dict[str, Any]:
    """Post a click for each scored event the world labels 1, then wait until the joiner's output
    holds every logged impression and those clicks; the served version's live figures from it."""
    import httpx

    from serving.judge import topic_values
    from serving.live import judged

    ids = [p["event_id"] for p in served["predictions"]]
    clicks = [  # a second after its impression: inside the demo's window
        {"impression_id": i, "ts": int(e[schema.timestamp]) + 1000} for i, e in zip(ids, events) if e[schema.label] == 1
    ]
    for start in range(0, len(clicks), 1000):
        httpx.post(f"{url}/click", json=clicks[start : start + 1000], timeout=30).raise_for_status()
    version = served["model_version"]
    deadline = time.monotonic() + timeout_s
    while True:
        figures = judged(topic_values(kafka.bootstrap, kafka.events_topic), schema.label, schema.event_id).get(version)
        if figures and figures["events"] >= len(ids) and figures["clicks"] >= len(clicks):
            break
        if time.monotonic() > deadline:
            raise CliError(f"demo: the joiner's output lacks the served impressions after {timeout_s:g}s: {figures}")
        time.sleep(2)
    return {"impressions": len(ids), "clicks_posted": len(clicks), "version": version, **figures}


def demo_config(config: Config, run: str) -> Config:
    """The demo's own scope for one run: topics, consumer groups and snapshot folder of its own, so
    a second demo on a running stack starts from nothing (it never resumes an earlier run's snapshot
    or reads its events) and gives the same answer as the first."""
    return replace(
        config,
        kafka=config.kafka.scoped(f"demo-{run}"),
        stream=replace(
            config.stream,
            app_id=f"demo-{run}-featurizer",
            join=replace(
                config.stream.join,
                policy="fake_negative",
                window_s=DEMO_WINDOW_S,
                allowed_lateness_s=DEMO_LATENESS_S,
                app_id=f"demo-{run}-joiner",
                state_dir=str(Path(config.stack.state_dir) / "demo" / run / "join"),
            ),
        ),
        trainer=with_changes(
            config.trainer,
            {
                "group_id": f"demo-{run}-trainer",
                "snapshot.dir": str(Path(config.stack.state_dir) / "demo" / run),
                "optim.delayed_feedback": "fnw",
                "label_wait_s": DEMO_WINDOW_S + DEMO_LATENESS_S,
            },
        ),
    )


def run_demo(
    config: Config, events: int = 60_000, show: int = 5, json_path: str | None = None, seed: int = 7
) -> dict[str, Any]:
    """The whole path once, in a scope of its own (demo_config), on the synthetic world of `seed`."""
    import httpx

    start = time.perf_counter()
    config = demo_config(config, f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")
    print(f"[1/7] starting Kafka ({config.stack.bootstrap}) and MLflow ({config.stack.tracking_uri})", flush=True)
    stack.up(config.stack, config.kafka)
    ensure_topics(config.kafka)
    state = Path(config.stack.state_dir).resolve()
    logs = state / "demo-logs"
    logs.mkdir(parents=True, exist_ok=True)
    config_file = write_toml(config, Path(tempfile.mkdtemp()) / "adstream.toml")
    schema = load_schema(config.stream.schema)

    print("[2/7] starting the joiner (impressions + clicks -> labelled events) and the Faust featurizer", flush=True)
    joiner = cli_process(config_file, "join", log=logs / "join.log")
    featurizer = cli_process(config_file, "stream", log=logs / "stream.log")
    server = None
    try:
        kafka = config.kafka
        print(f"[3/7] replaying {events} synthetic impressions and their delayed clicks", flush=True)
        generator = SyntheticCriteo(schema, SyntheticConfig(seed=seed))  # the same world every run
        train_events, truth = generator.generate(events)
        labels = np.array([e[schema.label] for e in train_events])
        split = split_clicks(
            event_table(train_events, schema), schema, np.random.default_rng(seed), DEMO_DELAYS, DEMO_EVENT_RATE
        )
        records = interleave([split], schema, kafka.impressions_topic, kafka.clicks_topic, kafka.partitions)
        replayed = replay(records, kafka, total=events)  # the bar counts impressions; clicks go beside them
        print(f"      {events} impressions, {replayed.clicks} clicks, {replayed.events_per_s:,.0f} impressions/s")

        print("[4/7] training until every joined event is learned, publishing snapshots to MLflow", flush=True)
        # the joiner emits every impression and a positive copy per attributed click (how many
        # copies, a run's timing decides at the edges): learn until no batch came for IDLE_EXIT_S,
        # so every batches partition is read to its end, counting from the first batch
        wait_for_batches(kafka, 120, logs)
        summary = run_training(
            schema, config.kafka, config.trainer, config.mlflow, max_events=None, idle_exit_s=IDLE_EXIT_S
        )
        if summary.events < events:
            raise CliError(f"demo: trainer learned {summary.events} of {events} events; see {logs / 'stream.log'}")

        print("[5/7] serving the new model version", flush=True)
        server = cli_process(config_file, "serve", log=logs / "serve.log")
        url = f"http://{config.serving.host}:{config.serving.port}"
        deadline = time.monotonic() + 120
        info = wait_for_model(url, server, 120, logs / "serve.log")
        while info["model_version"] != summary.model_version and time.monotonic() < deadline:
            time.sleep(1)  # an older version was live when the server started; it polls for ours
            info = wait_for_model(url, server, 120, logs / "serve.log")

        print(f"[6/7] asking for predictions on {HOLDOUT_EVENTS:,} fresh events", flush=True)
        fresh, fresh_truth = generator.generate(HOLDOUT_EVENTS)
        # served now: their impressions and clicks are live traffic, after the replayed log's event time
        now_ms = int(time.time() * 1000)
        fresh = [{**e, schema.timestamp: now_ms} for e in fresh]
        requests = [{k: v for k, v in e.items() if k != schema.label} for e in fresh]
        response = httpx.post(f"{url}/predict", json=requests, timeout=30)
        response.raise_for_status()
        served = response.json()
        fresh_labels = np.array([e[schema.label] for e in fresh])
        fresh_ctrs = np.array([p["ctr"] for p in served["predictions"]])

        print("[7/7] closing the loop: the scored events came back as impressions; their clicks follow", flush=True)
        loop = close_the_loop(url, kafka, schema, served, fresh)
    finally:
        if server is not None:
            stop_process(server)
        stop_process(featurizer)
        stop_process(joiner)
    result = {
        "events_replayed": events,
        "clicks_replayed": len(split.click_ids),
        "replay_events_per_s": replayed.events_per_s,
        "batches_built": summary.batches_built,
        "train_steps": summary.steps,
        "progressive_auc": summary.progressive_auc,
        "progressive_logloss": summary.progressive_logloss,
        "window_auc": summary.window_auc,
        "ground_truth_auc": auc_exact(labels, truth),
        "model_version": served["model_version"],
        "champion": summary.champion,  # the member of trainer.challengers that serves (README, "Challengers")
        "members": summary.members,
        "predictions": [p["ctr"] for p in served["predictions"][:show]],
        "served_auc": auc_exact(fresh_labels, fresh_ctrs),  # the served model on HOLDOUT_EVENTS fresh events
        "served_ground_truth_auc": auc_exact(fresh_labels, fresh_truth),
        "loop": loop,
        "mlflow_ui": config.mlflow.tracking_uri,
        "seed": seed,
        "events_topic": config.kafka.events_topic,
        "wall_s": time.perf_counter() - start,
    }
    for p in served["predictions"][:show]:
        print(f"      event {p['event_id']}: CTR {p['ctr']:.4f}  (model version {served['model_version']})")
    print(
        f"progressive AUC {summary.progressive_auc:.4f} (last {config.trainer.metrics_window} events: "
        f"{summary.window_auc:.4f}; the generator's ground truth: {result['ground_truth_auc']:.4f})"
    )
    print(f"served: the champion {summary.champion!r} of the members {summary.members}")
    print(
        f"the served model on {HOLDOUT_EVENTS:,} fresh events: AUC {result['served_auc']:.4f} "
        f"(the generator's ground truth: {result['served_ground_truth_auc']:.4f})"
    )
    print(
        f"the loop: {loop['impressions']:,} scored events logged as impressions, "
        f"{loop['clicks_posted']:,} clicks posted, joined by the joiner: the served version {loop['version']} "
        f"on that live traffic: AUC {loop['auc']:.4f}, predicted CTR {loop['mean_ctr']:.4f} "
        f"vs observed {loop['observed_ctr']:.4f} (`adstream judge` keeps this up)"
    )
    print(
        f"MLflow UI: {config.mlflow.tracking_uri}  (experiment '{config.mlflow.experiment}', "
        f"model '{config.mlflow.model_name}' alias '{config.mlflow.alias}')"
    )
    print(f"the stack keeps running: `adstream status`, `adstream down`; done in {result['wall_s']:.0f}s")
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result
