"""The one command, `adstream`, with a subcommand per job. Thin: parse flags, build config, call in.

Every subcommand takes the global --config FILE and --set section.key=value (see adstream/config.py).
"""

from __future__ import annotations

import argparse
import logging
import sys

from adstream.commands import (
    cmd_bench,
    cmd_demo,
    cmd_dlq,
    cmd_down,
    cmd_join,
    cmd_judge,
    cmd_predict,
    cmd_replay,
    cmd_serve,
    cmd_simulate,
    cmd_status,
    cmd_stream,
    cmd_topology,
    cmd_train,
    cmd_up,
)
from common.errors import AdstreamError


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

    p = sub.add_parser("replay", help="replay log files (as the schema's [source] says) or synthetic events into Kafka")
    p.add_argument(
        "paths",
        nargs="*",
        help="log files laid out as the schema's [source] table says (Criteo TSV by default; .gz too)",
    )
    p.add_argument("--synthetic", type=int, metavar="N", help="replay N events of the built-in generator instead")
    p.add_argument("--seed", type=int, default=7, help="generator seed (--synthetic)")
    p.add_argument(
        "--drift", type=float, default=0.0, help="std of the true weights' drift per million events (--synthetic)"
    )
    p.add_argument("--rate", type=float, help="events per second (default: as fast as possible)")
    p.add_argument("--limit", type=int, help="stop after N events")
    p.add_argument("--loop", action="store_true", help="replay the files again and again")
    p.add_argument(
        "--resume",
        action="store_true",
        help="after a replay that stopped early: send only the records the topics do not hold yet (by key)",
    )
    p.add_argument("--bundle", type=int, default=1, help="events per Kafka record (1 = one JSON event per record)")
    p.add_argument(
        "--bundle-format",
        choices=["json", "arrow"],
        default="json",
        help="bundle encoding: newline-separated JSON or an Arrow batch",
    )
    p.add_argument(
        "--clicks",
        action="store_true",
        help="log as an ad server does: unlabelled impressions and delayed clicks, to the joiner's two topics",
    )
    p.add_argument(
        "--event-rate",
        type=float,
        help="--clicks: impressions per event-time second (event time is rewritten; default: the rows' own times)",
    )
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("join", help="run the joiner: impressions + clicks -> labelled events, exactly once")
    p.add_argument(
        "--workers", type=int, default=1, help="joiner processes; they split the partitions (worker i: p %% N == i)"
    )
    p.add_argument(
        "--until-idle",
        type=float,
        metavar="S",
        help="a bounded log: once every input is read to its end and nothing came for S seconds, close every "
        "open window and exit (not for a live log)",
    )
    p.set_defaults(func=cmd_join)

    p = sub.add_parser("stream", help="run the Faust featurizer: events -> Arrow batches (+ DLQ)")
    p.add_argument("--loglevel", default="warning")
    p.add_argument(
        "--workers",
        type=int,
        help="worker processes of the one app; they split the partitions (default stream.workers)",
    )
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

    p = sub.add_parser(
        "judge", help="score the served model on live traffic: its logged CTRs against the joined labels, per version"
    )
    p.add_argument(
        "--offline", action="store_true", help="recompute once from the events topic as it is now, print JSON"
    )
    p.set_defaults(func=cmd_judge)

    p = sub.add_parser("predict", help="send event JSON (an object or a list) to the server")
    p.add_argument("event", help="event JSON, or - to read stdin")
    p.add_argument("--url", help="server URL (default from [serving])")
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("dlq", help="read the dead-letter topic: counts by reason, the newest rejected records")
    p.add_argument("--reason", help="only letters whose reason contains this text (case-insensitive)")
    p.add_argument("--limit", type=int, default=20, help="newest letters shown (default 20)")
    p.add_argument("--json", action="store_true", help="the letters as JSON lines (reason, stage, source, value...)")
    p.set_defaults(func=cmd_dlq)

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
    p.add_argument("--seed", type=int, default=7, help="the synthetic world (the same seed, the same stream)")
    p.add_argument("--json", help="write a summary JSON here")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "simulate",
        help="the closed loop against a hidden ad world: an ad server scores candidates, shows one, posts clicks",
    )
    stack_flags(p)
    p.add_argument("--seconds", type=float, default=300.0, help="how long the ad server runs")
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (each scores --candidates ads)")
    p.add_argument("--candidates", type=int, default=10, help="ads scored per request; one is shown")
    p.add_argument("--epsilon", type=float, default=0.1, help="chance of showing a uniform pick instead of the best")
    p.add_argument("--seed", type=int, default=11, help="the world (same seed, same world and requests)")
    p.add_argument(
        "--restart-serving-at", type=float, metavar="S", help="SIGTERM the server S seconds in, start it again"
    )
    p.add_argument("--broker-outage-at", type=float, metavar="S", help="kill the broker S seconds in...")
    p.add_argument("--outage-seconds", type=float, default=30.0, help="...and start it again after this long")
    p.add_argument(
        "--attach", action="store_true", help="only the ad server, against the pipeline running with this config"
    )
    p.add_argument("--url", help="--attach: the server's URL (default from [serving])")
    p.add_argument("--json", help="write the report here (and a picture beside it, .png)")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("bench", help="benchmarks printing JSON (not tests)")
    p.add_argument("which", choices=["pipeline", "store", "merge", "accuracy", "serving", "step", "join"])
    stack_flags(p)
    p.add_argument(
        "--events",
        type=int,
        help="synthetic events (pipeline: per stage, 100000; merge: 2000000; accuracy: 1000000; step: 200000; "
        "join: 300000)",
    )
    p.add_argument("--drift", type=float, default=0.5, help="accuracy: drift of the drifting synthetic stream")
    p.add_argument("--no-ablation", action="store_true", help="accuracy: skip the ablation rows")
    p.add_argument(
        "--log",
        action="append",
        help="accuracy: a log file of the schema as the real rows, in place of the Criteo files (repeatable)",
    )
    p.add_argument("--schema", help="accuracy: the schema (bundled name or TOML path) of --log; as --set stream.schema")
    p.add_argument("--criteo", default="../shared/data/criteo", help="folder of real Criteo TSV files")
    p.add_argument("--ids", type=int, default=50_000_000, help="store: distinct ids in the table")
    p.add_argument("--batches", type=int, default=40, help="store: timed batches of 4096 events x 26 fields")
    p.add_argument(
        "--device", default="cpu", help="store: device of the device tier; step: device timed beside the CPU (cuda:0)"
    )
    p.add_argument(
        "--batch-sizes",
        default="256,4096",
        help="step: comma-separated batch sizes (the smallest and largest compared)",
    )
    p.add_argument(
        "--peer",
        choices=["torchrec"],
        help="step: also time this peer on the same batches, in its own environment (`make peers` builds it)",
    )
    p.add_argument("--workers", help="merge: comma-separated worker counts (1,2,4,8)")
    p.add_argument(
        "--seeds", type=int, default=1, help="merge: runs per configuration, trainer seeds 0..N-1; checks on the mean"
    )
    p.add_argument("--rate", type=float, default=500.0, help="serving: requests/s of the open-loop load")
    p.add_argument("--seconds", type=float, default=30.0, help="serving: seconds of each load phase")
    p.add_argument("--fresh-seconds", type=float, default=60.0, help="serving: seconds of producing for freshness")
    p.add_argument("--step-seconds", type=float, default=10.0, help="serving: seconds of each capacity step")
    p.add_argument("--rows", type=int, default=1_000_000, help="serving: table rows for the publish-bytes figures")
    p.add_argument("--json", help="write the JSON here too")
    p.set_defaults(func=cmd_bench)
    # --config and --set after the subcommand too (`adstream train --set trainer.optim.lr=...`): their own
    # destinations, merged into the global ones by `parse` (argparse would let one replace the other)
    for command in sub.choices.values():
        command.add_argument("--config", dest="config_after", default=None, help=argparse.SUPPRESS)
        command.add_argument("--set", dest="set_after", action="append", default=[], help=argparse.SUPPRESS)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line, with --config / --set given before or after the subcommand (--set in the
    order given, before ones first; a --config after the subcommand wins)."""
    args = build_parser().parse_args(argv)
    args.set = [*args.set, *args.set_after]
    args.config = args.config_after or args.config
    return args


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    args.argv = argv  # the supervisor of `train --workers N` starts replicas with the same arguments
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args.func(args)
    except AdstreamError as exc:  # every package's errors derive from it (common/errors.py)
        print(f"adstream {args.command}: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
