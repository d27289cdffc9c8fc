"""docker-compose.cluster.yml really run (podman, `make images`): three brokers, MLflow on
PostgreSQL, two joiners in one group, two featurizers, two trainer nodes under torchrun, two serving
replicas behind HAProxy, each container a host on the cluster's network. While impressions and
delayed clicks stream in (every window stays open until the sentinels close them at the end, so
the faults hit the joiners' state and its changelog, and the emissions come after), one fault
after another: the leader broker of a partition SIGKILLed (and brought back), a joiner SIGKILLed
(kept down past its session timeout: its partitions move), a joiner paused (SIGSTOP) past its
session timeout and resumed, a featurizer SIGKILLed, a trainer node SIGKILLed; then a serving
replica SIGKILLed under load through the proxy. Counted at the end: every impression labelled once
with its true label (events topic), every labelled event in a feature batch (batches topic: the
featurizer is at-least-once, what it wrote twice is counted and reported), every event learned once
(the served model's event count = the batches' distinct events: the trainer drops a second copy,
trainer/replayed.py), and the requests the proxy failed.
Then a backlog times the cluster's throughput. Figures go to `.state/cluster.json`
(`ADSTREAM_CLUSTER_REPORT`); every container's whole log to `compose.log` in the test's temporary
folder (pytest keeps it where a test failed: /tmp/pytest-of-$USER/pytest-N/cluster0).

Needs podman, docker-compose and the images: `make test` builds them first; under CI=true a missing
engine fails the test."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stream.formats.batch_codec import decode_batch
from stream.join.outputs import read_events
from stream.kafka.settings import KafkaSettings
from stream.produce.clicks import interleave
from stream.produce.replay import replay, synthetic_records
from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo
from tests.helpers import criteo_event
from tests.integration.test_compose import ROOT, require_engine, until
from tests.integration.test_compose import compose as compose_project
from tests.integration.test_join import live_log, sentinel_records

pytestmark = pytest.mark.integration

PROJECT = "adstreamcluster"
FILE = "docker-compose.cluster.yml"
BOOTSTRAP = "127.0.0.1:19491,127.0.0.1:19492,127.0.0.1:19493"  # the brokers' external listeners
PROXY, MLFLOW = "http://127.0.0.1:18400", "http://127.0.0.1:15400"
PARTITIONS, WINDOW_S, LATENESS_S = 4, 1800, 60  # cluster.toml's partitions, the join's default window
EVENTS, FEED_S = 20_000, 150  # impressions streamed in over FEED_S seconds of wall time...
BACKLOG = 100_000  # labelled events put on the events topic at once, to time the cluster's throughput
# ...spanning 4x that in event time: a broker's death stalls the partitions it led for seconds (until
# the controller moves their leaders), so their clicks come later than other partitions' impressions;
# at 4x that stays inside the join's lateness allowance (60 s), as it would on a live log (at 48x a run
# had 3 clicks late by the join's own rules: dropped and counted as late, so 3 impressions negatives)
LOG_S = 4 * FEED_S
SESSION_S, TRANSACTION_S = 10, 20  # cluster.toml's joiner session and transaction timeouts
REPORT = Path(os.environ.get("ADSTREAM_CLUSTER_REPORT", ROOT / ".state" / "cluster.json"))


def compose(*args: str, timeout_s: float = 900, check: bool = True) -> str:
    return compose_project(ENV_FILE, *args, timeout_s=timeout_s, check=check, project=PROJECT, file=FILE)


ENV_FILE = Path("/nonexistent")


def podman(*args: str) -> str:
    return subprocess.run(["podman", *args], capture_output=True, text=True, check=True, timeout=120).stdout


def project_objects() -> dict[str, list[str]]:
    """The project's containers, volumes and networks still on this machine."""
    label = f"label=com.docker.compose.project={PROJECT}"
    return {
        "containers": podman("ps", "-a", "-q", "--filter", label).split(),
        "volumes": podman("volume", "ls", "-q", "--filter", label).split(),
        "networks": [n for n in podman("network", "ls", "--format", "{{.Name}}").split() if n.startswith(PROJECT)],
    }


def container(service: str) -> str:
    return f"{PROJECT}_{service}_1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The cluster up (project adstreamcluster); down -v after, and nothing of it left behind."""
    global ENV_FILE
    require_engine()
    token = uuid.uuid4().hex
    ENV_FILE = tmp_path_factory.mktemp("cluster") / ".env"
    ENV_FILE.write_text(f"ADSTREAM_SERVING_TOKEN={token}\n")
    try:
        compose("up", "-d")
        yield token
    finally:
        if project_objects()["containers"]:
            # every container's whole log kept beside the run (pytest's basetemp outlives a CI clone)
            logs = compose("logs", "--no-color", "--timestamps", check=False)
            (ENV_FILE.parent / "compose.log").write_text(logs)
            print(f"the cluster's logs: {ENV_FILE.parent / 'compose.log'}\n" + logs[-12000:])
        compose("down", "-v", "--timeout", "20", timeout_s=600, check=False)
    left = project_objects()
    assert left == {"containers": [], "volumes": [], "networks": []}, f"left behind: {left}"


def _consume_all(bootstrap: str, topic: str, done, timeout_s: float, quiet_s: float = 5.0) -> list:
    """Every committed record of `topic`, read from the start until done(records) and nothing new
    came for quiet_s, or the timeout."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"check-{uuid.uuid4().hex[:6]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "fetch.max.bytes": 64 << 20,
        }
    )
    consumer.subscribe([topic])
    out: list = []
    deadline = time.monotonic() + timeout_s
    last_new = time.monotonic()
    try:
        while time.monotonic() < deadline:
            batch = [m for m in consumer.consume(1000, timeout=0.5) if m.error() is None]
            out += batch
            if batch:
                last_new = time.monotonic()
            elif done(out) and time.monotonic() - last_new >= quiet_s:
                break
    finally:
        consumer.close()
    return out


def _copies(msgs: list, ids: set[str], imp_ts: dict) -> dict[str, list[dict]]:
    """Every copy of these events on the events topic: where, its label, the record's time and the
    joiner chunk that wrote it (stream/join/joiner.py's JOINED_BY header)."""
    from stream.join.joiner import JOINED_BY

    found: dict[str, list[dict]] = collections.defaultdict(list)
    for m in msgs:
        by = dict(m.headers() or []).get(JOINED_BY, b"").decode()
        for e in read_events(m.value()):
            if e["event_id"] in ids:
                at = {"record": f"{m.partition()}:{m.offset()}", "label": e["label"], "by": by}
                found[e["event_id"]].append(
                    {**at, "written_ms": m.timestamp()[1], "event_ts": int(imp_ts.get(e["event_id"], -1))}
                )
    return dict(found)


def _leader(kafka: KafkaSettings, topic: str, partition: int) -> int:
    from confluent_kafka.admin import AdminClient

    metadata = AdminClient({"bootstrap.servers": kafka.bootstrap}).list_topics(topic, timeout=30)
    return metadata.topics[topic].partitions[partition].leader


def _sigkill(service: str) -> None:
    """SIGKILL the container's process (podman kill: the restart policy leaves it down until started)."""
    podman("kill", "--signal", "KILL", container(service))


def _running(service: str) -> bool:
    return podman("inspect", "-f", "{{.State.Running}}", container(service)).strip() == "true"


def _log_lines(service: str) -> list[str]:
    """The service's container's whole log so far (stdout and stderr), by line."""
    logs = subprocess.run(["podman", "logs", container(service)], capture_output=True, text=True, timeout=60)
    return (logs.stdout + logs.stderr).splitlines()


def _first_line_after(service: str, text: str, after: float) -> float | None:
    """Seconds from `after` (a wall-clock time) to the first log line of the service's process
    holding `text` logged after it (adstream's log lines start with their UTC time)."""
    import datetime

    for line in _log_lines(service):
        if text not in line or len(line) < 23 or not line[:4].isdigit():
            continue
        try:
            at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=datetime.UTC).timestamp()
        except ValueError:
            continue
        if at > after:
            return round(at - after, 1)
    return None


def _holds_partitions(service: str) -> bool:
    """Whether the joiner's newest assignment (its last "holds partitions [...]" line) is not empty."""
    held = [line for line in _log_lines(service) if "holds partitions [" in line]
    return bool(held) and not held[-1].rstrip().endswith("[]")


def _all_in_sync(kafka: KafkaSettings, since: float, out: dict) -> None:
    """Polls until every partition of adstream's topics has its 3 replicas in sync again; the
    seconds since `since` into out["replicas_in_sync_after_s"]."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    time.sleep(5)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            topics = admin.list_topics(timeout=10).topics
            ours = [p for t, m in topics.items() if t.startswith("adstream") for p in m.partitions.values()]
            if ours and all(len(p.isrs) == 3 for p in ours):
                out["replicas_in_sync_after_s"] = round(time.time() - since, 1)
                return
        except Exception:  # the broker answering is what is waited for
            pass
        time.sleep(1)


@pytest.mark.timeout(2400)
def test_the_cluster_loses_duplicates_and_mislabels_nothing_through_six_faults(cluster):
    token = cluster
    auth = {"Authorization": f"Bearer {token}"}
    kafka = KafkaSettings(bootstrap=BOOTSTRAP, partitions=PARTITIONS, replication_factor=3, min_insync_replicas=2)
    until("MLflow on PostgreSQL answering", lambda: httpx.get(f"{MLFLOW}/health", timeout=2).status_code == 200, 600)

    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap})
    topic = admin.list_topics(kafka.impressions_topic, timeout=60).topics[kafka.impressions_topic]
    assert len(topic.partitions) == PARTITIONS and all(len(p.replicas) == 3 for p in topic.partitions.values())
    resource = ConfigResource(ConfigResource.Type.TOPIC, kafka.events_topic)
    configs = admin.describe_configs([resource])[resource].result(60)
    assert configs["min.insync.replicas"].value == "2"

    from stream.schema import load_schema

    schema = load_schema("criteo")
    log = live_log(schema, EVENTS, (31, 6), EVENTS / LOG_S, WINDOW_S, LATENESS_S, PARTITIONS)
    split, imp_ts, in_window = log.split, log.imp_ts, log.in_window
    records = list(interleave([split], schema, kafka.impressions_topic, kafka.clicks_topic, PARTITIONS, 20, "arrow"))
    tail_records = sentinel_records(log, schema, kafka, PARTITIONS)

    # each fault must hit a process at work: the joiner killed at 40 s holds partitions by then only
    # if both had joined the group before the feed (a CI run's joiner-1 had not: nothing moved)
    until("both joiners holding partitions", lambda: all(map(_holds_partitions, ("joiner-1", "joiner-2"))), 300)
    fed: dict[str, object] = {}

    def feed() -> None:
        try:
            started = time.monotonic()
            replay(records, kafka, rate=len(records) / FEED_S, progress=False)
            fed["seconds"] = time.monotonic() - started
        except Exception as exc:  # reported below
            fed["error"] = exc

    feeding = threading.Thread(target=feed)
    feeding.start()
    faults: dict[str, dict] = {}

    def fault(name: str, at_s: float, act, undo=None, down_s: float = 0.0) -> None:
        """At at_s into the feed: act(); after down_s, undo()."""
        time.sleep(max(0.0, at_s - (time.monotonic() - t0)))
        faults[name] = {"at_s": round(time.monotonic() - t0, 1), "wall": time.time()}
        act()
        if undo is not None:
            time.sleep(down_s)
            undo()
            faults[name]["back_after_s"] = round(time.monotonic() - t0 - faults[name]["at_s"], 1)

    t0 = time.monotonic()
    leader = _leader(kafka, kafka.impressions_topic, 0)
    fault(
        "leader broker SIGKILLed",
        15,
        lambda: _sigkill(f"kafka-{leader}"),
        lambda: podman("start", container(f"kafka-{leader}")),
        15,
    )
    broker = faults["leader broker SIGKILLed"]
    broker["broker"] = leader
    threading.Thread(target=_all_in_sync, args=(kafka, broker["wall"], broker), daemon=True).start()
    fault(
        "joiner SIGKILLed",
        40,
        lambda: _sigkill("joiner-1"),
        lambda: podman("start", container("joiner-1")),
        SESSION_S + TRANSACTION_S + 5,
    )
    pause = lambda: podman("kill", "--signal", "STOP", container("joiner-2"))  # noqa: E731
    resume = lambda: podman("kill", "--signal", "CONT", container("joiner-2"))  # noqa: E731
    fault("joiner paused past its session", 85, pause, resume, SESSION_S + TRANSACTION_S + 5)
    fault("featurizer SIGKILLed", 120, lambda: _sigkill("stream-1"), lambda: podman("start", container("stream-1")), 5)
    fault(
        "trainer node SIGKILLed", 135, lambda: _sigkill("trainer-1"), lambda: podman("start", container("trainer-1")), 5
    )
    feeding.join(300)
    assert not feeding.is_alive() and "error" not in fed, fed.get("error")
    replay(tail_records, kafka, progress=False)  # the sentinels close every window
    fed_s = time.monotonic() - t0

    # the joiners: every impression once, with its true label
    def labelled(msgs: list) -> list[dict]:
        return [e for m in msgs for e in read_events(m.value()) if not e["event_id"].startswith("sentinel-")]

    event_msgs = _consume_all(kafka.bootstrap, kafka.events_topic, lambda m: len(labelled(m)) >= EVENTS, 600, 15)
    out = labelled(event_msgs)
    joined_s = time.monotonic() - t0
    first = collections.Counter(e["event_id"] for e in out)
    positives = {e["event_id"] for e in out if e["label"] == 1}
    joiner = {
        "lost": len(set(imp_ts) - set(first)),
        "duplicated": sum(v - 1 for v in first.values()),
        "wrong_label": len(positives ^ in_window),
        "foreign": len(set(first) - set(imp_ts)),
    }
    twice = sorted(i for i, n in first.items() if n > 1)[:8]  # traced to the joiner chunks that wrote them
    duplicates = _copies(event_msgs, set(twice), imp_ts) if twice else {}

    # the featurizers: every labelled event in a batch (at-least-once: what they wrote twice counted)
    def batch_ids(msgs: list) -> list[str]:
        return [i for m in msgs for i in decode_batch(m.value()).event_ids if not i.startswith("sentinel-")]

    batch_msgs = _consume_all(kafka.bootstrap, kafka.batches_topic, lambda m: len(set(batch_ids(m))) >= EVENTS, 600, 15)
    in_batches = collections.Counter(batch_ids(batch_msgs))
    every_id: collections.Counter[str] = collections.Counter()
    sources: dict[str, set[tuple[int, int]]] = collections.defaultdict(set)  # event id -> its source records
    for m in batch_msgs:
        part = decode_batch(m.value())
        every_id.update(part.event_ids)
        for i, p, o in zip(part.event_ids, part.partitions.tolist(), part.offsets.tolist()):
            sources[i].add((p, o))
    ends = {m.partition(): m.offset() + 1 for m in batch_msgs}
    featurizer = {
        "lost": len(set(imp_ts) - set(in_batches)),
        "written_twice": sum(v - 1 for v in in_batches.values()),
        # an event from two records of the events topic: the trainer could not tell its copies apart
        "from_two_source_records": sum(len(s) > 1 for s in sources.values()),
    }

    # the trainer nodes: the served model has learned every event once, up to the topic's end
    def caught_up() -> dict | None:
        model = httpx.get(f"{PROXY}/model", headers=auth, timeout=5)
        if model.status_code != 200:
            return None
        info = model.json()
        offsets = {int(p): o for p, o in info["offsets"].items()}
        return info if all(offsets.get(p, 0) >= end for p, end in ends.items()) else None

    served = until("the served model at the batches' end", caught_up, 600, every_s=3)
    trained_s = time.monotonic() - t0
    trainer = {
        "learned": served["events"],
        "distinct_batch_events": len(every_id),  # the sentinels' too
        "batch_events": sum(every_id.values()),
        "duplicated_or_lost": served["events"] - len(every_id),
    }
    import mlflow

    client = mlflow.MlflowClient(MLFLOW)
    run = client.search_runs([client.get_experiment_by_name("adstream").experiment_id], order_by=["start_time DESC"])[0]
    merges = run.data.metrics.get("merges")
    trainer["merges_since_last_start"] = merges
    trainer["dropped_as_written_twice_since_last_start"] = run.data.metrics.get("replayed_events")
    trainer["bytes_per_merge"] = round(run.data.metrics["merge_bytes"] / merges) if merges else None

    # recovery: from each fault to the first line saying the survivor (or the restarted one) works again
    recovered = {
        "joiner SIGKILLed": ("joiner-2", "holds partitions [0, 1, 2, 3]"),
        "joiner paused past its session": ("joiner-1", "holds partitions [0, 1, 2, 3]"),
        "trainer node SIGKILLed": ("trainer-0", "resumes from"),
    }
    for name, (service, text) in recovered.items():
        faults[name]["recovered_after_s"] = _first_line_after(service, text, faults[name]["wall"])
    for f in faults.values():
        f.pop("wall")

    # a serving replica SIGKILLed under load through the proxy
    requests = [{k: v for k, v in criteo_event(i).items() if k != "label"} for i in range(8)]
    outcomes: list[str] = []  # "200", another status, or the client's exception: what failed is reported
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                try:
                    outcomes.append(str(client.post(f"{PROXY}/predict", json=requests, headers=auth).status_code))
                except httpx.HTTPError as e:
                    outcomes.append(type(e).__name__)
                time.sleep(0.02)

    loaders = [threading.Thread(target=load) for _ in range(4)]
    for t in loaders:
        t.start()
    time.sleep(5)
    killed_at = len(outcomes)
    _sigkill("serving-1")
    time.sleep(10)
    podman("start", container("serving-1"))
    time.sleep(5)
    stop.set()
    for t in loaders:
        t.join(30)
    serving = {
        "requests": len(outcomes),
        "after_kill": len(outcomes) - killed_at,
        "failed": sum(s != "200" for s in outcomes),
        "failures": dict(collections.Counter(s for s in outcomes if s != "200")),
        # why the proxy took the killed replica out (its last DOWN line: the one before is its start)
        "taken_out_by": [line for line in _log_lines("proxy") if "serving-1 is DOWN" in line][-1].split("reason: ")[-1],
    }

    # throughput: a backlog of labelled events put straight onto the events topic (the joiners'
    # output), featurized, learned and published by the cluster: events/s from the first record sent
    # to the served model counting them all (README "More than one machine" has the one-process figure)
    backlog, _ = SyntheticCriteo(schema, SyntheticConfig(seed=41)).generate(BACKLOG)
    before = caught_up_events = served["events"]
    started = time.monotonic()
    replay(synthetic_records(backlog, schema, 256, "arrow"), kafka, progress=False)

    def backlog_served() -> int | None:
        model = httpx.get(f"{PROXY}/model", headers=auth, timeout=5)
        events = model.json()["events"] if model.status_code == 200 else 0
        return events if events >= before + BACKLOG else None

    caught_up_events = until("the backlog learned and served", backlog_served, 900, every_s=1)
    seconds = time.monotonic() - started
    throughput = {"events": BACKLOG, "seconds": round(seconds, 1), "events_per_s": round(BACKLOG / seconds)}
    throughput["learned"] = caught_up_events - before

    report = {
        "events": EVENTS,
        "throughput": throughput,
        "feed_s": round(fed_s, 1),
        "all_joined_s": round(joined_s, 1),
        "all_learned_s": round(trained_s, 1),
        "faults": faults,
        "joiner": joiner,
        "joiner_duplicates": duplicates,
        "featurizer": featurizer,
        "trainer": trainer,
        "serving": serving,
    }
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    # each message names its stage first: pytest's one-line summary of a failure says which one
    assert joiner == {"lost": 0, "duplicated": 0, "wrong_label": 0, "foreign": 0}, f"joiner: {joiner} {duplicates}"
    assert featurizer["lost"] == 0 and featurizer["from_two_source_records"] == 0, f"featurizer: {featurizer}"
    assert trainer["duplicated_or_lost"] == 0, f"trainer: {trainer}"
    assert serving["failed"] == 0 and serving["after_kill"] > 100, f"serving: {serving}"
    # the first request that could not connect took it out, not the health checks seconds later
    # (docker/cluster/haproxy.cfg `observe layer4 ... on-error mark-down`)
    assert serving["taken_out_by"].startswith("Health analyze"), f"serving: {serving}"
    assert all(_running(s) for s in ("kafka-1", "kafka-2", "kafka-3", "joiner-1", "joiner-2", "trainer-0", "trainer-1"))
