"""What each `adstream` subcommand does: build the config from the flags, then call into the packages.

cli.py declares the flags and dispatches here; every function takes the parsed argparse namespace.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adstream.config import Config, load_config
from adstream.errors import CliError
from adstream.preflight import check_kafka, check_log_schema, check_mlflow, check_paths
from adstream.running import announce

if TYPE_CHECKING:
    from stream.schema import Schema


def json_safe(value: Any) -> Any:
    """A value as strict JSON takes it: a float that is not finite (an AUC not measured yet: NaN)
    becomes null, in nested dicts and lists too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def json_line(value: Any) -> str:
    return json.dumps(json_safe(value), allow_nan=False)


def _config(args: argparse.Namespace) -> Config:
    config = load_config(args.config, args.set)
    stack = config.stack
    if getattr(args, "state_dir", None):
        stack = replace(stack, state_dir=args.state_dir)
    if getattr(args, "kafka_port", None):
        stack = replace(stack, kafka_port=args.kafka_port, controller_port=args.kafka_port + 1)
    if getattr(args, "mlflow_port", None):
        stack = replace(stack, mlflow_port=args.mlflow_port)
    if stack != config.stack:  # re-derive bootstrap/tracking uri from the new ports
        extra = [f"stack.{k}={v}" for k, v in asdict(stack).items()]
        config = load_config(args.config, [*args.set, *extra])
    if getattr(args, "partitions", None):
        config = replace(config, kafka=replace(config.kafka, partitions=args.partitions))
    return config


def _schema(config: Config) -> Schema:
    from stream.schema import load_schema

    return load_schema(config.stream.schema)


def cmd_up(args: argparse.Namespace) -> None:
    from adstream import stack
    from stream.kafka.topics import ensure_topics

    config = _config(args)
    stack.up(config.stack, config.kafka)
    created = ensure_topics(config.kafka)
    print(f"kafka  {config.stack.bootstrap}  topics created: {created or 'none (already there)'}")
    print(f"mlflow {config.stack.tracking_uri}  (the UI)")
    print(f"state  {config.stack.state_dir}")


def cmd_down(args: argparse.Namespace) -> None:
    from adstream import stack

    stopped = stack.down(_config(args).stack)
    print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


def cmd_status(args: argparse.Namespace) -> None:
    """The stack's services, the adstream processes running on it, each consumer group's lag, the
    dead letters by reason and the served model (exit 1 if Kafka or MLflow is down)."""
    from adstream import stack
    from adstream.processes import tree_memory
    from adstream.running import running

    config = _config(args)
    report = stack.status(config.stack)
    for name, item in report.items():
        memory = ""
        if item["pid"]:
            count, rss = tree_memory(int(item["pid"]))  # type: ignore[call-overload]
            memory = f"  {count} process{'es' if count > 1 else ''}, {rss / 2**20:,.0f} MB resident"
        line = f"{name:7s} {'up  ' if item['up'] else 'down'} {item['address']}  pid {item['pid']}"
        print(f"{line}{memory}  log {item['log']}")
    processes = running(config.stack.state_dir)
    print(f"processes: {len(processes) if processes else 'none'} announced in {config.stack.state_dir}/running")
    for p in processes:
        since = time.strftime("%H:%M:%S", time.localtime(p.started_s))
        state = "running" if p.alive else "gone (killed?)"
        print(f"  {p.command:7s} pid {p.pid:<7d} {state}  since {since}  adstream {' '.join(p.argv)}")
    if report["kafka"]["up"]:
        _status_kafka(config)
    _status_serving(config)
    if not all(item["up"] for item in report.values()):
        sys.exit(1)


def _status_kafka(config: Config) -> None:
    from adstream.running import consumer_lags
    from stream.errors import StreamError
    from stream.kafka.dead_letters import read_dead_letters

    kafka = config.kafka
    groups = {
        config.stream.join.app_id: [kafka.impressions_topic, kafka.clicks_topic],
        config.stream.app_id: [kafka.events_topic],
        config.trainer.group_id: [kafka.batches_topic],
    }
    print("consumer groups (lag: records past the group's committed offsets):")
    try:
        lags = consumer_lags(kafka.bootstrap, groups)
    except Exception as exc:  # a status line, not a reason to fail the whole report
        print(f"  unavailable ({exc})")
        lags = {}
    for group, info in lags.items():
        topics = ", ".join(f"{topic} {lag:,}" for topic, lag in info["lag"].items())
        print(f"  {group:28s} {topics}" + ("" if info["committed"] else "  (nothing committed yet)"))
    _status_joiner(config)
    try:
        letters = read_dead_letters(kafka, limit=0, timeout_s=10)
    except StreamError as exc:
        print(f"dead letters: unavailable ({exc})")
        return
    print(
        f"dead letters: {letters.total:,} in {kafka.dlq_topic}"
        + (" (`adstream dlq` shows them)" if letters.total else "")
    )
    for reason, count in list(letters.by_reason.items())[:10]:
        print(f"  {count:8,d}  {reason}")


def _status_joiner(config: Config) -> None:
    """The joiner workers' own counters, from their Prometheus endpoints (worker i on port + i)."""
    from adstream.running import joiner_counters

    join = config.stream.join
    if not join.metrics_port:
        return
    workers = joiner_counters(config.stream.metrics_host, join.metrics_port)
    for i, counters in enumerate(workers):
        shown = ", ".join(f"{name} {value:,.0f}" for name, value in counters.items())
        print(f"joiner worker {i}: {shown}")


def _status_serving(config: Config) -> None:
    import os

    import httpx

    url = f"http://{config.serving.host}:{config.serving.port}"
    token = config.serving.token or os.environ.get("ADSTREAM_SERVING_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(f"{url}/model", headers=headers, timeout=2)
    except httpx.HTTPError:
        print(f"serving: no server at {url}")
        return
    if response.status_code != 200:
        print(f"serving: {url} answers {response.status_code}: {response.text[:200]}")
        return
    info = response.json()
    newest = info.get("newest_event_ms") or 0
    age = f", newest event learned {time.time() - newest / 1000:,.0f} s ago" if newest else ""
    champion = f", champion {info.get('champion', 'default')} ({info.get('family')})"
    print(f"serving: {url} version {info['model_version']} (step {info['step']}{champion}){age}")
    log = info.get("log")
    if log:
        print(
            f"serving log: {log['delivered']:,} records delivered to Kafka, {log['waiting']:,} waiting, "
            f"{log['dropped']:,} dropped (queue full {log['queue_full']:,}, failed {log['failed']:,}, "
            f"at shutdown {log['shutdown']:,}); {log['pending_shown']:,} candidates waiting for POST /shown"
        )
    _status_judge(config)


def _status_judge(config: Config) -> None:
    """The judge's newest report: the last served versions on live traffic."""
    path = Path(config.serving.judge.report_file)
    if not path.exists():
        return
    report = json.loads(path.read_text())
    versions = sorted(report["versions"].items(), key=lambda kv: (len(kv[0]), kv[0]))[-3:]
    age = time.time() - report["time_ms"] / 1000
    for version, m in versions:
        auc = "n/a" if m["auc"] is None else f"{m['auc']:.4f}"
        print(
            f"judge: version {version} (deltas {m['first_sequence']:.0f}-{m['last_sequence']:.0f}) on live traffic: "
            f"{m['events']:,.0f} impressions, AUC {auc}, predicted CTR {m['mean_ctr']:.4f} vs observed "
            f"{m['observed_ctr']:.4f} (report {age:,.0f} s old)"
        )


def cmd_replay(args: argparse.Namespace) -> None:
    from stream.kafka.topics import ensure_topics
    from stream.produce.replay import log_records, replay, synthetic_records
    from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo

    config = _config(args)
    schema = _schema(config)
    check_paths(args.paths)  # the inputs first, then the broker
    check_log_schema(args.paths, schema)
    check_kafka(config.kafka.bootstrap)
    ensure_topics(config.kafka)
    if args.clicks:
        if args.resume:
            raise CliError("replay --clicks --resume: not supported (clicks are keyed by impression id); replay anew")
        records, total = _impressions_and_clicks(args, config, schema)
    elif args.synthetic:
        generator = SyntheticCriteo(schema, SyntheticConfig(seed=args.seed, drift_per_million=args.drift))

        def chunks() -> Any:
            left = args.synthetic
            while left > 0:
                events, _ = generator.generate(min(left, 10_000))
                left -= len(events)
                yield from synthetic_records(events, schema, args.bundle, args.bundle_format)

        records, total = chunks(), args.synthetic
    elif args.paths:
        records, total = log_records(args.paths, schema, args.loop, args.bundle, args.bundle_format), None
    else:
        raise CliError("replay: give log file(s) (laid out as the schema's [source] says) or --synthetic N")
    skip = None
    if args.resume:
        from stream.produce.replay import held_keys

        skip = held_keys(config.kafka, [config.kafka.events_topic, config.kafka.dlq_topic])
        print(f"resume: the topics hold {len(skip)} record keys; those are skipped", file=sys.stderr)
    summary = replay(records, config.kafka, rate=args.rate, limit=args.limit, total=total, skip=skip)
    print(json_line(asdict(summary)))


def _impressions_and_clicks(args: argparse.Namespace, config: Config, schema: Schema) -> tuple[Any, int | None]:
    """replay --clicks: the labelled rows (synthetic or a log) as impressions + delayed clicks."""
    import numpy as np

    from stream.formats.arrow import event_table
    from stream.produce.clicks import Split, interleave, split_clicks
    from stream.produce.logs import read_log
    from stream.produce.replay import ReplayRecord
    from stream.produce.synthetic import SyntheticConfig, SyntheticCriteo

    rng = np.random.default_rng(args.seed + 101)
    join = config.stream.join
    if args.synthetic:
        generator = SyntheticCriteo(schema, SyntheticConfig(seed=args.seed, drift_per_million=args.drift))

        def splits() -> Any:
            left, done = args.synthetic, 0
            while left > 0:
                events, _ = generator.generate(min(left, 10_000))
                table = event_table(events, schema)
                yield split_clicks(table, schema, rng, event_rate=args.event_rate, start_ms=_start(args, done))
                left, done = left - len(events), done + len(events)

        source, total = splits(), args.synthetic
    elif args.paths:

        def splits() -> Any:
            done = 0
            for block in read_log(args.paths, schema, args.loop):
                for bad in block.bad:
                    yield ReplayRecord(bad.where.encode(), bad.raw, 0, f"{bad.where}: {bad.reason}")
                split: Split = split_clicks(
                    block.good, schema, rng, event_rate=args.event_rate, start_ms=_start(args, done)
                )
                done += block.good.num_rows
                yield split

        source, total = splits(), None
    else:
        raise CliError("replay --clicks: give labelled log file(s) or --synthetic N")
    if join.click_impression_id != "impression_id" or join.click_time != "ts":
        raise CliError(
            "replay --clicks writes clicks as {impression_id, ts}; leave stream.join.click_* at their defaults"
        )
    kafka = config.kafka
    partitions = _partitions(config, kafka.impressions_topic)
    span = round(join.allowed_lateness_s * 1000)  # no bundle moves the joiner's watermark past a click still to send
    records = interleave(
        source, schema, kafka.impressions_topic, kafka.clicks_topic, partitions, args.bundle, args.bundle_format, span
    )
    return records, total


def _partitions(config: Config, topic: str) -> int:
    from confluent_kafka.admin import AdminClient

    metadata = AdminClient({"bootstrap.servers": config.kafka.bootstrap}).list_topics(topic, timeout=30)
    return len(metadata.topics[topic].partitions) or config.kafka.partitions


def _start(args: argparse.Namespace, done: int) -> int | None:
    """The event time of row `done` under --event-rate (rows of every block on one clock)."""
    from stream.produce.synthetic import SyntheticConfig

    if args.event_rate is None:
        return None
    return SyntheticConfig().start_ms + int(done * 1000 / args.event_rate)


def cmd_join(args: argparse.Namespace) -> None:
    from stream.join.joiner import run_joiners

    config = _config(args)
    if args.workers < 1:
        raise CliError(f"join --workers {args.workers}: use 1 or more worker processes")
    if args.until_idle is not None and args.until_idle <= 0:
        raise CliError(f"join --until-idle {args.until_idle}: seconds without input before closing, > 0")
    check_kafka(config.kafka.bootstrap)
    with announce(config.stack.state_dir, "join"):
        code = run_joiners(config.kafka, config.stream, args.workers, args.until_idle)
    sys.exit(code)


def cmd_stream(args: argparse.Namespace) -> None:
    from stream.featurizer.app import run_worker, run_workers

    config = _config(args)
    workers = args.workers or config.stream.workers
    if workers < 1:
        raise CliError(f"stream --workers {workers}: use 1 or more worker processes")
    check_kafka(config.kafka.bootstrap)
    with announce(config.stack.state_dir, "stream"):
        if workers == 1:
            run_worker(config.kafka, config.stream, loglevel=args.loglevel)
            return
        code = run_workers(config.kafka, config.stream, workers, loglevel=args.loglevel)
    sys.exit(code)


def cmd_train(args: argparse.Namespace) -> None:
    import os

    from trainer.loop import run_training

    config = _config(args)
    workers = args.workers or config.trainer.group.workers
    if workers < 1:
        raise CliError(f"train --workers {workers}: use 1 or more replicas")
    schema = _schema(config)
    replica = "WORLD_SIZE" in os.environ  # one of a group's replicas (ours or torchrun's)
    if not replica:  # a replica (restarted, maybe mid-outage) retries instead
        check_kafka(config.kafka.bootstrap)  # both before an MLflow run is opened
        check_mlflow(config.mlflow.tracking_uri)
    if workers > 1 and not replica:  # supervise N replicas
        from trainer.group import supervise

        with announce(config.stack.state_dir, "train"):
            code = supervise(args.argv, workers, config.trainer.group.max_restarts)
        if code > 128:  # stopped by its operator: the replicas got the signal and stopped with it
            print(f"train: stopped by signal {code - 128}; the {workers} replicas stopped with it", file=sys.stderr)
            sys.exit(code)
        if code:
            raise CliError(f"train: the replica group failed (exit {code}); see the log above")
        return
    role = f"train-{os.environ['RANK']}" if "RANK" in os.environ else "train"  # a replica of a group: its rank
    for stop in (signal.SIGTERM, signal.SIGINT):  # the MLflow run ends KILLED, not left RUNNING (SIGINT
        signal.signal(stop, _interrupt)  # too: a shell's background job starts with it ignored)
    with announce(config.stack.state_dir, role):
        summary = run_training(
            schema,
            config.kafka,
            config.trainer,
            config.mlflow,
            max_steps=args.max_steps,
            max_events=args.max_events,
            idle_exit_s=args.idle_exit,
        )
    print(json_line(asdict(summary)))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_serve(args: argparse.Namespace) -> None:
    from serving.workers import run_server

    config = _config(args)
    serving = config.serving
    if args.port:
        serving = replace(serving, port=args.port)
    if args.alias:
        serving = replace(serving, alias=args.alias)
    check_mlflow(config.mlflow.tracking_uri)
    with announce(config.stack.state_dir, "serve"):
        run_server(serving, _schema(config), config.mlflow.tracking_uri, config.mlflow.model_name, config.kafka)


def cmd_judge(args: argparse.Namespace) -> None:
    config = _config(args)
    check_kafka(config.kafka.bootstrap)
    schema = _schema(config)
    if args.offline:
        from serving.judge import topic_values
        from serving.live import judged

        values = topic_values(config.kafka.bootstrap, config.kafka.events_topic)
        print(json.dumps(judged(values, schema.label, schema.event_id), indent=2))
        return
    from serving.judge import run_judge

    for stop in (signal.SIGTERM, signal.SIGINT):  # a stopped judge writes its last report
        signal.signal(stop, _interrupt)
    with announce(config.stack.state_dir, "judge"):
        run_judge(
            schema,
            config.kafka,
            config.serving.judge,
            config.mlflow.tracking_uri,
            config.mlflow.model_name,
            config.stream.join.policy,
        )


def cmd_predict(args: argparse.Namespace) -> None:
    import httpx

    config = _config(args)
    text = sys.stdin.read() if args.event == "-" else args.event
    url = args.url or f"http://{config.serving.host}:{config.serving.port}"
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"predict: the event is not valid JSON ({exc})") from None
    try:
        response = httpx.post(f"{url}/predict", json=body, timeout=10)
    except httpx.TransportError as exc:
        raise CliError(
            f"predict: no answer from {url} ({type(exc).__name__}); start the server with `adstream serve`"
        ) from None
    print(json.dumps(response.json(), indent=2))
    if response.status_code != 200:
        sys.exit(1)


def cmd_dlq(args: argparse.Namespace) -> None:
    """The dead-letter topic: counts by reason, then the newest letters (one line each, or JSON lines)."""
    from stream.errors import StreamError
    from stream.kafka.dead_letters import read_dead_letters

    config = _config(args)
    check_kafka(config.kafka.bootstrap)
    try:
        found = read_dead_letters(config.kafka, args.reason, args.limit)
    except StreamError as exc:
        raise CliError(str(exc)) from None
    if args.json:
        for letter in found.newest:
            print(json_line({**asdict(letter), "value": letter.value.decode("utf-8", "replace")}))
        return
    print(f"{config.kafka.dlq_topic}: {found.total} dead letters")
    for reason, count in found.by_reason.items():
        print(f"  {count:8d}  {reason}")
    if found.newest:
        matching = f" with a reason containing {args.reason!r}" if args.reason else ""
        print(f"the newest {len(found.newest)}{matching} (partition:offset  stage  source  reason  record):")
    for x in found.newest:
        record = x.value[:160].decode("utf-8", "replace").replace("\n", "\\n")
        cut = f" ... ({x.truncated} bytes)" if x.truncated else ""
        print(f"  {x.partition}:{x.offset}  {x.stage}  {x.source}  {x.reason}  {record}{cut}")


def cmd_topology(args: argparse.Namespace) -> None:
    from pathlib import Path

    from store.placement import describe, make_plan
    from store.topology import discover, parse_topo_matrix

    topology = parse_topo_matrix(Path(args.matrix).read_text()) if args.matrix else discover()
    storage = {}
    for item in args.storage:
        node, sep, path = item.partition("=")
        if not sep or not node.isdigit():
            raise CliError(f"topology --storage {item!r}: write NUMA_NODE=PATH, e.g. 0=/nvme0/adstream")
        storage[int(node)] = path
    plan = make_plan(topology, storage)
    if args.json:
        print(
            json.dumps(
                {
                    "topology": asdict(topology)
                    | {"links": {f"{a}-{b}": link.kind for (a, b), link in topology.links.items()}},
                    "plan": asdict(plan) | {"routes": [asdict(r) for r in plan.routes.values()]},
                },
                default=str,
            )
        )
    else:
        print(describe(topology, plan))


def cmd_demo(args: argparse.Namespace) -> None:
    from adstream.demo import run_demo

    run_demo(_config(args), events=args.events, json_path=args.json, seed=args.seed)


def cmd_simulate(args: argparse.Namespace) -> None:
    from adstream.simulate import run_simulation

    if args.rate <= 0 or args.seconds <= 0 or args.candidates < 1 or not 0 <= args.epsilon <= 1:
        raise CliError("simulate: --rate and --seconds > 0, --candidates >= 1, --epsilon in [0, 1]")
    result = run_simulation(
        _config(args),
        seconds=args.seconds,
        rate=args.rate,
        candidates=args.candidates,
        epsilon=args.epsilon,
        seed=args.seed,
        restart_serving_at_s=args.restart_serving_at,
        broker_outage_at_s=args.broker_outage_at,
        outage_s=args.outage_seconds,
        attach=args.attach,
        url=args.url,
        json_path=args.json,
    )
    shown = {k: v for k, v in result.items() if k not in ("over_time", "new_campaign", "judge")}
    shown["new_campaign"] = {k: v for k, v in result["new_campaign"].items() if k != "series"}
    print(json.dumps(shown, indent=2, default=float))
    if not all(met for _, _, met in result["floors"].values()):
        sys.exit(1)


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise CliError(f"--batch-sizes {text!r}: give positive integers separated by commas, e.g. 256,4096")
    return sizes


def cmd_bench(args: argparse.Namespace) -> None:
    from bench.pipeline import run_pipeline_bench

    if args.which == "store":
        from bench.store import run_store_bench

        result = run_store_bench(ids=args.ids, batches=args.batches, device=args.device)
    elif args.which == "merge":
        from bench.merge import WORKERS, run_merge_bench

        if args.seeds < 1:
            raise CliError(f"bench merge --seeds {args.seeds}: use 1 or more (runs per configuration)")
        workers = tuple(int(w) for w in args.workers.split(",")) if args.workers else WORKERS
        result = run_merge_bench(
            events=args.events or 2_000_000, criteo_dir=args.criteo, workers=workers, seeds=args.seeds
        )
    elif args.which == "serving":
        from pathlib import Path

        from adstream import stack
        from bench.serving import run_serving_bench

        config = _config(args)
        with stack.running(config.stack, config.kafka):
            result = run_serving_bench(
                config,
                Path(config.stack.state_dir).resolve() / "bench-logs",
                rate=args.rate,
                seconds=args.seconds,
                fresh_s=args.fresh_seconds,
                rows=args.rows,
                step_s=args.step_seconds,
            )
    elif args.which == "step":
        from bench.step import run_step_bench

        config = _config(args)
        sizes = _batch_sizes(args.batch_sizes)
        result = run_step_bench(
            _schema(config), config.trainer, args.events or 200_000, sizes, args.device, peer=args.peer
        )
    elif args.which == "join":
        from pathlib import Path

        from adstream import stack
        from bench.join import run_join_bench

        config = _config(args)
        with stack.running(config.stack, config.kafka):
            result = run_join_bench(
                _schema(config),
                config.trainer,
                config.kafka,
                config.stream,
                Path(config.stack.state_dir).resolve() / "bench-join",
                events=args.events or 300_000,
                drift=args.drift,
            )
    elif args.which == "accuracy":
        from bench.accuracy import run_accuracy_bench

        config = _config(args)
        if args.schema:
            config = replace(config, stream=replace(config.stream, schema=args.schema))
        if args.log:
            check_paths(args.log)
        result = run_accuracy_bench(
            _schema(config),
            config.trainer,
            events=args.events or 1_000_000,
            drift=args.drift,
            criteo_dir=args.criteo,
            ablation=not args.no_ablation,
            logs=args.log,
        )
    else:
        from pathlib import Path

        from adstream import stack

        config = _config(args)
        log_dir = Path(config.stack.state_dir).resolve() / "bench-logs"
        with stack.running(config.stack, config.kafka):
            result = run_pipeline_bench(
                config.kafka,
                config.stream,
                config.trainer,
                log_dir,
                events=args.events or 100_000,
                criteo_dir=args.criteo,
            )
    text = json.dumps(json_safe(result), indent=2)
    print(text)
    if args.json:
        from pathlib import Path

        from bench.plots import plot_bench

        with open(args.json, "w") as fh:
            fh.write(text)
        png = plot_bench(args.which, result, Path(args.json).with_suffix(".png"))
        if png is not None:
            print(f"bench {args.which}: the picture is {png}", file=sys.stderr)
