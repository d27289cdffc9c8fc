"""The one command, `adstream`, with a subcommand per job. Thin: parse flags, build config, call in.

Every subcommand takes the global --config FILE and --set section.key=value (see adstream/config.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, replace
from typing import Any

from adstream.config import Config, load_config
from adstream.errors import AdstreamError, CliError


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


def cmd_up(args: argparse.Namespace) -> None:
    from adstream import stack
    from stream.topics import ensure_topics

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
    from adstream import stack

    report = stack.status(_config(args).stack)
    for name, item in report.items():
        print(f"{name:7s} {'up  ' if item['up'] else 'down'} {item['address']}  pid {item['pid']}  log {item['log']}")
    if not all(item["up"] for item in report.values()):
        sys.exit(1)


def cmd_replay(args: argparse.Namespace) -> None:
    from stream.replay import criteo_records, replay, synthetic_records
    from stream.schema import load_schema
    from stream.synthetic import SyntheticConfig, SyntheticCriteo
    from stream.topics import ensure_topics

    config = _config(args)
    schema = load_schema(config.stream.schema)
    ensure_topics(config.kafka)
    if args.synthetic:
        generator = SyntheticCriteo(schema, SyntheticConfig(seed=args.seed, drift_per_million=args.drift))

        def chunks() -> Any:
            left = args.synthetic
            while left > 0:
                events, _ = generator.generate(min(left, 10_000))
                left -= len(events)
                yield from synthetic_records(events, schema, args.bundle, args.bundle_format)

        records, total = chunks(), args.synthetic
    elif args.paths:
        records, total = criteo_records(args.paths, schema, args.loop, args.bundle, args.bundle_format), None
    else:
        raise CliError("replay: give Criteo TSV file(s) or --synthetic N")
    summary = replay(records, config.kafka, rate=args.rate, limit=args.limit, total=total)
    print(json.dumps(asdict(summary)))


def cmd_stream(args: argparse.Namespace) -> None:
    from stream.app import run_worker

    config = _config(args)
    run_worker(config.kafka, config.stream, loglevel=args.loglevel)


def cmd_train(args: argparse.Namespace) -> None:
    import os

    from stream.schema import load_schema
    from trainer.loop import run_training

    config = _config(args)
    workers = args.workers or config.trainer.group.workers
    if workers < 1:
        raise CliError(f"train --workers {workers}: use 1 or more replicas")
    if workers > 1 and "WORLD_SIZE" not in os.environ:  # supervise N replicas (torchrun sets WORLD_SIZE itself)
        from trainer.group import supervise

        code = supervise(args.argv, workers, config.trainer.group.max_restarts)
        if code:
            raise CliError(f"train: the replica group failed (exit {code}); see the log above")
        return
    summary = run_training(
        load_schema(config.stream.schema),
        config.kafka,
        config.trainer,
        config.mlflow,
        max_steps=args.max_steps,
        max_events=args.max_events,
        idle_exit_s=args.idle_exit,
    )
    print(json.dumps(asdict(summary)))


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from serving.app import create_app, registry_fetch
    from stream.schema import load_schema

    config = _config(args)
    serving = config.serving
    if args.port:
        serving = replace(serving, port=args.port)
    if args.alias:
        serving = replace(serving, alias=args.alias)
    schema = load_schema(config.stream.schema)
    fetch = registry_fetch(config.mlflow.tracking_uri, config.mlflow.model_name, serving, schema)
    app = create_app(serving, schema, fetch)
    uvicorn.run(app, host=serving.host, port=serving.port, log_level="warning")


def cmd_predict(args: argparse.Namespace) -> None:
    import httpx

    config = _config(args)
    text = sys.stdin.read() if args.event == "-" else args.event
    url = args.url or f"http://{config.serving.host}:{config.serving.port}"
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"predict: the event is not valid JSON ({exc})") from None
    response = httpx.post(f"{url}/predict", json=body, timeout=10)
    print(json.dumps(response.json(), indent=2))
    if response.status_code != 200:
        sys.exit(1)


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

    run_demo(_config(args), events=args.events, json_path=args.json)


def cmd_bench(args: argparse.Namespace) -> None:
    from bench.pipeline import run_pipeline_bench

    if args.which == "store":
        from bench.store import run_store_bench

        result = run_store_bench(ids=args.ids, batches=args.batches, device=args.device)
    elif args.which == "merge":
        from bench.merge import run_merge_bench

        result = run_merge_bench(events=args.events or 2_000_000, criteo_dir=args.criteo)
    elif args.which == "accuracy":
        from bench.accuracy import run_accuracy_bench
        from stream.schema import load_schema

        config = _config(args)
        result = run_accuracy_bench(
            load_schema(config.stream.schema),
            config.trainer,
            events=args.events or 1_000_000,
            drift=args.drift,
            criteo_dir=args.criteo,
            ablation=not args.no_ablation,
        )
    else:
        from pathlib import Path

        from adstream import stack

        config = _config(args)
        stack.up(config.stack, config.kafka)
        log_dir = Path(config.stack.state_dir).resolve() / "bench-logs"
        result = run_pipeline_bench(
            config.kafka, config.stream, config.trainer, log_dir, events=args.events or 100_000, criteo_dir=args.criteo
        )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adstream", description="Streaming online CTR learning: Kafka -> Faust -> PyTorch -> MLflow -> HTTP."
    )
    parser.add_argument("--config", help="TOML config file (default: $ADSTREAM_CONFIG or ./adstream.toml)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override one setting")
    sub = parser.add_subparsers(dest="command", required=True)

    def stack_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--state-dir", help="folder for data, logs and pid files")
        p.add_argument("--kafka-port", type=int, help="broker port (the controller takes the next one)")
        p.add_argument("--mlflow-port", type=int, help="MLflow server port")

    p = sub.add_parser("up", help="start the local Kafka broker and MLflow server, create the topics")
    stack_flags(p)
    p.add_argument("--partitions", type=int, help="partitions of each topic created")
    p.set_defaults(func=cmd_up)
    p = sub.add_parser("down", help="stop the local stack")
    stack_flags(p)
    p.set_defaults(func=cmd_down)
    p = sub.add_parser("status", help="show the local stack (exit 1 if something is down)")
    stack_flags(p)
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("replay", help="replay Criteo TSV files (.txt/.gz) or synthetic events into Kafka")
    p.add_argument("paths", nargs="*", help="Criteo TSV files (the Kaggle train file or day_N files)")
    p.add_argument("--synthetic", type=int, metavar="N", help="replay N events of the built-in generator instead")
    p.add_argument("--seed", type=int, default=7, help="generator seed (--synthetic)")
    p.add_argument(
        "--drift", type=float, default=0.0, help="std of the true weights' drift per million events (--synthetic)"
    )
    p.add_argument("--rate", type=float, help="events per second (default: as fast as possible)")
    p.add_argument("--limit", type=int, help="stop after N events")
    p.add_argument("--loop", action="store_true", help="replay the files again and again")
    p.add_argument("--bundle", type=int, default=1, help="events per Kafka record (1 = one JSON event per record)")
    p.add_argument(
        "--bundle-format",
        choices=["json", "arrow"],
        default="json",
        help="bundle encoding: newline-separated JSON or an Arrow batch",
    )
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("stream", help="run the Faust featurizer: events -> Arrow batches (+ DLQ)")
    p.add_argument("--loglevel", default="warning")
    p.set_defaults(func=cmd_stream)

    p = sub.add_parser("train", help="train online from the batches topic, publish snapshots to MLflow")
    p.add_argument(
        "--workers",
        type=int,
        help="replicas, one process each, merged every trainer.group.merge_every_steps (default trainer.group.workers)",
    )
    p.add_argument("--max-steps", type=int, help="stop after N steps")
    p.add_argument("--max-events", type=int, help="stop after N events")
    p.add_argument("--idle-exit", type=float, help="stop after S seconds without batches")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("serve", help="serve CTR predictions over HTTP from the registry alias")
    p.add_argument("--port", type=int)
    p.add_argument("--alias", help="registry alias to serve ('latest' = highest version)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("predict", help="send event JSON (an object or a list) to the server")
    p.add_argument("event", help="event JSON, or - to read stdin")
    p.add_argument("--url", help="server URL (default from [serving])")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("topology", help="show this machine's GPU/NIC/NUMA layout and the placement plan")
    p.add_argument("--matrix", help="read an `nvidia-smi topo -m` output from this file instead of this machine")
    p.add_argument(
        "--storage",
        action="append",
        default=[],
        metavar="NODE=PATH",
        help="RocksDB directory for the GPUs of a NUMA node (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=cmd_topology)

    p = sub.add_parser("demo", help="the whole path on the local stack, ending in served predictions")
    stack_flags(p)
    p.add_argument("--events", type=int, default=60_000, help="synthetic events to replay and learn")
    p.add_argument("--json", help="write a summary JSON here")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="benchmarks printing JSON (not tests)")
    p.add_argument("which", choices=["pipeline", "store", "merge", "accuracy"])
    stack_flags(p)
    p.add_argument(
        "--events", type=int, help="synthetic events (pipeline: per stage, 100000; merge: 2000000; accuracy: 1000000)"
    )
    p.add_argument("--drift", type=float, default=0.5, help="accuracy: drift of the drifting synthetic stream")
    p.add_argument("--no-ablation", action="store_true", help="accuracy: skip the ablation rows")
    p.add_argument("--criteo", default="../shared/data/criteo", help="folder of real Criteo TSV files")
    p.add_argument("--ids", type=int, default=50_000_000, help="store: distinct ids in the table")
    p.add_argument("--batches", type=int, default=40, help="store: timed batches of 4096 events x 26 fields")
    p.add_argument("--device", default="cpu", help="store: device of the device tier (cuda:0 on a GPU machine)")
    p.add_argument("--json", help="write the JSON here too")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # the supervisor of `train --workers N` starts replicas with the same arguments
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args.func(args)
    except AdstreamError as exc:  # every package's errors derive from it (adstream/errors.py)
        print(f"adstream {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
