import pytest

from adstream.cli import build_parser
from adstream.config import build_config, load_config, parse_set
from common.errors import AdstreamError


def test_defaults_follow_stack_ports():
    config = build_config({"stack": {"kafka_port": 30000, "mlflow_port": 30100}})
    assert config.kafka.bootstrap == "127.0.0.1:30000"
    assert config.mlflow.tracking_uri == "http://127.0.0.1:30100"
    explicit = build_config({"stack": {"kafka_port": 30000}, "kafka": {"bootstrap": "broker:9092"}})
    assert explicit.kafka.bootstrap == "broker:9092"


def test_unknown_section_and_key_name_the_fix():
    with pytest.raises(AdstreamError, match=r"unknown section \[trainr\]"):
        build_config({"trainr": {}})
    with pytest.raises(AdstreamError, match=r"unknown key trainer.learning_rate.*'optim'"):
        build_config({"trainer": {"learning_rate": 0.1}})
    with pytest.raises(AdstreamError, match=r"unknown key trainer.optim.learning_rate.*'lr'"):
        build_config({"trainer": {"optim": {"learning_rate": 0.1}}})
    with pytest.raises(AdstreamError, match=r"config \[trainer.optim\]: expected a table"):
        build_config({"trainer": {"optim": 0.1}})


def test_values_are_typed():
    config = build_config({"trainer": {"optim": {"lr": "0.05"}, "model": {"hidden": "32,16"}, "batch_size": 512}})
    trainer = config.trainer
    assert trainer.optim.lr == 0.05 and trainer.model.hidden == (32, 16) and trainer.batch_size == 512
    with pytest.raises(AdstreamError, match=r"trainer.batch_size='many': expected int"):
        build_config({"trainer": {"batch_size": "many"}})


def test_file_and_set_flags(tmp_path):
    file = tmp_path / "a.toml"
    file.write_text(
        "[trainer]\nbatch_size = 32\n[trainer.optim]\nlr = 0.5\nwide_lr = 0.2\n[stream]\nbatch_events = 64\n"
    )
    config = load_config(str(file), ["trainer.optim.lr=0.25", "trainer.model.kind=fm"])
    assert config.trainer.optim.lr == 0.25 and config.trainer.optim.wide_lr == 0.2  # --set merges into the file's table
    assert config.trainer.model.kind == "fm" and config.trainer.batch_size == 32 and config.stream.batch_events == 64
    with pytest.raises(AdstreamError, match="section.key=value"):
        parse_set(["lr=1"])
    with pytest.raises(AdstreamError, match="no file"):
        load_config(str(tmp_path / "missing.toml"))


def test_every_subcommand_has_help(capsys):
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in commands:
        with pytest.raises(SystemExit) as info:
            parser.parse_args([name, "--help"])
        assert info.value.code == 0
        assert "usage: adstream " + name in capsys.readouterr().out


def test_trainer_values_out_of_range_name_the_key():
    from trainer.errors import TrainerError

    with pytest.raises(TrainerError, match=r"trainer.group.merge_every_steps=-1: must be >= 0"):
        build_config({"trainer": {"group": {"merge_every_steps": -1}}})
    with pytest.raises(TrainerError, match=r"trainer.optim.optimizer='adagrad'.*'adam', 'sgd'"):
        build_config({"trainer": {"optim": {"optimizer": "adagrad"}}})
    with pytest.raises(TrainerError, match=r"trainer.model.kind='xdeepfm'.*'lr', 'fm', 'deepfm', 'dcn'"):
        build_config({"trainer": {"model": {"kind": "xdeepfm"}}})
    with pytest.raises(TrainerError, match=r"trainer.optim.sparse_optimizer='rmsprop'.*'ftrl'"):
        build_config({"trainer": {"optim": {"sparse_optimizer": "rmsprop"}}})
    with pytest.raises(TrainerError, match=r"trainer.batch_size=0: must be >= 1"):
        build_config({"trainer": {"batch_size": 0}})
    with pytest.raises(TrainerError, match=r"trainer.device='gpu'"):
        build_config({"trainer": {"device": "gpu"}})


def test_store_policies_on_the_ram_store_are_an_error_not_ignored():
    from trainer.errors import TrainerError

    with pytest.raises(TrainerError, match=r"trainer.store.ttl_steps=5.*set trainer.store.kind = \"tiered\""):
        build_config({"trainer": {"store": {"ttl_steps": 5}}})
    with pytest.raises(TrainerError, match=r"trainer.store.eviction='lfu'"):
        build_config({"trainer": {"store": {"eviction": "lfu"}}})
    with pytest.raises(TrainerError, match=r"trainer.store.rocksdb_format='block'"):
        build_config({"trainer": {"store": {"rocksdb_format": "block"}}})
    built = build_config(
        {"trainer": {"store": {"kind": "tiered", "ttl_steps": 5, "eviction": "lfu", "rocksdb_format": "block"}}}
    )
    assert built.trainer.store.ttl_steps == 5 and built.trainer.store.eviction == "lfu"
    assert built.trainer.store.rocksdb_format == "block"


def test_every_section_checks_its_values_and_names_the_key():
    from serving.errors import ServingError
    from stream.errors import StreamError

    with pytest.raises(StreamError, match=r"config kafka.partitions=0: must be >= 1"):
        build_config({"kafka": {"partitions": 0}})
    with pytest.raises(StreamError, match=r"config kafka.bootstrap='broker': write host:port"):
        build_config({"kafka": {"bootstrap": "broker"}})
    with pytest.raises(StreamError, match=r"config stream.batch_events=0: must be >= 1"):
        build_config({"stream": {"batch_events": 0}})
    with pytest.raises(ServingError, match=r"config serving.max_events=0: must be >= 1"):
        build_config({"serving": {"max_events": 0}})
    with pytest.raises(AdstreamError, match=r"config stack.kafka_port=0: must be >= 1"):
        build_config({"stack": {"kafka_port": 0}})
    with pytest.raises(AdstreamError, match=r"config mlflow.alias='latest'"):
        build_config({"mlflow": {"alias": "latest"}})


def test_settings_written_as_toml_read_back_the_same(tmp_path):
    from adstream.processes import write_toml

    config = load_config(None, ["trainer.optim.lr=0.02", "trainer.model.hidden=8,4", "trainer.store.min_count=2"])
    again = load_config(str(write_toml(config, tmp_path / "c.toml")))
    assert again == config


def test_each_demo_run_has_a_scope_of_its_own():
    """A second `make demo` on a running stack must not resume the first run's snapshot or read its events."""
    from adstream.demo import demo_config

    base = build_config({})
    first, second = demo_config(base, "r1"), demo_config(base, "r2")
    for a, b in [
        (first.kafka.events_topic, second.kafka.events_topic),
        (first.kafka.batches_topic, second.kafka.batches_topic),
        (first.stream.app_id, second.stream.app_id),
        (first.trainer.group_id, second.trainer.group_id),
        (first.trainer.snapshot.dir, second.trainer.snapshot.dir),
    ]:
        assert a != b
    assert first.kafka.bootstrap == base.kafka.bootstrap and first.stack == base.stack
    assert first.trainer.snapshot.dir.startswith(base.stack.state_dir)


def test_a_cuda_device_this_machine_cannot_give_is_an_error_naming_the_setting(monkeypatch):
    """Before any CUDA call: no GPU at all, or a replica whose local rank has no GPU of its own
    (NCCL cannot put two replicas on one GPU) — each names trainer.device and the fix."""
    import torch

    from stream.schema import load_schema
    from trainer.errors import TrainerError
    from trainer.group import check_gpu, join_group
    from trainer.settings import TrainerSettings
    from trainer.trainer import Trainer

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TrainerError, match=r"trainer.device='cuda'.*sees no GPU.*trainer.device = \"cpu\""):
        Trainer(load_schema("criteo"), TrainerSettings(device="cuda"))
    check_gpu("cpu")  # nothing to check

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_gpu("cuda:0")
    with pytest.raises(TrainerError, match=r"GPU3.*this machine has 1"):
        check_gpu("cuda:3")
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(TrainerError, match=r"GPU1 \(LOCAL_RANK 1\).*trainer.group.workers <= 1"):
        join_group("cuda")  # the second replica of two on a one-GPU machine, before NCCL is reached


def test_config_and_set_are_taken_before_or_after_the_subcommand(tmp_path):
    from adstream.cli import parse

    args = parse(["--set", "trainer.optim.lr=0.1", "bench", "step", "--set", "trainer.optim.lr=0.2", "--set", "x.y=1"])
    assert args.set == ["trainer.optim.lr=0.1", "trainer.optim.lr=0.2", "x.y=1"]  # before ones first
    config = load_config(None, args.set[:2])
    assert config.trainer.optim.lr == 0.2  # the later one wins
    file = tmp_path / "a.toml"
    file.write_text("[trainer]\nbatch_size = 32\n")
    assert parse(["train", "--workers", "2", "--config", str(file)]).config == str(file)
    assert parse(["--config", str(file), "train"]).config == str(file)
    assert parse(["train"]).set == []


def test_the_family_factor_rate_grows_with_the_square_root_of_the_batch_above_256():
    from stream.schema import load_schema
    from trainer.configs import model_config, table_config
    from trainer.model import FAMILIES
    from trainer.settings import OptimSettings, TrainerSettings

    schema = load_schema("criteo")

    def rate(batch_size: int, sparse_lr: float = 0.0) -> float:
        settings = TrainerSettings(batch_size=batch_size, optim=OptimSettings(sparse_lr=sparse_lr))
        return table_config(model_config(schema, settings), settings).optim.lr

    family = FAMILIES["dcn"].sparse_lr
    assert rate(64) == rate(256) == family  # the rate it was tuned at, and below it
    assert rate(1024) == pytest.approx(2 * family)
    assert rate(4096) == pytest.approx(4 * family)
    assert rate(4096, sparse_lr=0.1) == 0.1  # a rate the user set is taken as it is


def test_a_knob_the_settings_and_a_component_both_declare_has_one_default():
    """trainer/configs.py maps the [trainer.*] sections onto the components' own configs; where both
    declare a knob, the section takes the component's default (common.checks.default_of), so a
    component built alone behaves as the trainer's default. This fails if either writes its own."""
    import dataclasses

    from store.configs import HierarchyConfig, TableConfig
    from store.sparse_optim import SparseOptimConfig
    from trainer.model import ModelConfig
    from trainer.settings import ModelSettings, OptimSettings, StoreSettings

    def defaults(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}

    same = [  # (settings section, component, settings name -> component name)
        (ModelSettings, ModelConfig, {"kind": "kind", "hidden": "hidden", "cross_layers": "cross_layers"}),
        (ModelSettings, ModelConfig, {"cross_rank": "cross_rank", "dense_norm": "dense_norm"}),
        (StoreSettings, HierarchyConfig, {"eviction": "policy", "ttl_steps": "ttl_steps", "pipelined": "pipelined"}),
        (StoreSettings, HierarchyConfig, {"rocksdb_format": "rocksdb_format"}),
        (StoreSettings, TableConfig, {"min_count": "min_count", "admission_bytes": "admission_bytes"}),
        (OptimSettings, TableConfig, {"init_std": "init_std"}),
        (OptimSettings, SparseOptimConfig, {"sparse_optimizer": "name", "sparse_l2": "l2", "clip_ratio": "clip_ratio"}),
        (OptimSettings, SparseOptimConfig, {"initial_accumulator": "initial_accumulator"}),
        (OptimSettings, ModelConfig, {"delayed_feedback": "delayed_feedback"}),
    ]
    # not the same knob by design: embed_dim and sparse_lr (0 = the family's default, resolved in
    # trainer/configs.py), wide_lr / wide_per_event (a table alone learns its last column as the
    # others), the byte budgets (required of a store: never a hidden default)
    for section, component, names in same:
        ours, theirs = defaults(section), defaults(component)
        for name, their_name in names.items():
            assert ours[name] == theirs[their_name], f"{section.__name__}.{name} vs {component.__name__}.{their_name}"


@pytest.mark.parametrize(
    ("policy", "delayed", "fits"),
    [
        ("window", "none", True),
        ("window", "fnw", False),
        ("fake_negative", "fnw", True),
        ("fake_negative", "fnc", True),
        ("fake_negative", "none", False),
        ("elapsed", "fnw", True),
        ("elapsed", "none", False),
    ],
)
def test_a_join_policy_and_the_trainers_delayed_feedback_must_fit(policy, delayed, fits):
    """The joiner and the trainer run apart but read one config: a policy whose labels the trainer
    would learn with the wrong weights is refused at start, naming both settings."""
    sections = {"stream": {"join": {"policy": policy}}, "trainer": {"optim": {"delayed_feedback": delayed}}}
    if fits:
        assert build_config(sections).stream.join.policy == policy
    else:
        with pytest.raises(AdstreamError, match=rf"stream.join.policy='{policy}'.*trainer.optim.delayed_feedback"):
            build_config(sections)


def test_serving_follows_the_alias_the_trainer_moves_unless_given_its_own():
    assert build_config({}).serving.alias == "live"
    assert build_config({"mlflow": {"alias": "prod"}}).serving.alias == "prod"
    assert build_config({"mlflow": {"alias": "prod"}, "serving": {"alias": "latest"}}).serving.alias == "latest"


def test_cluster_settings_are_checked_and_the_cluster_file_reads():
    """What only a cluster sets: replication checked against itself, the joiner's assignment one of
    two; docker/cluster.toml (the cluster's containers) builds as is."""
    with pytest.raises(AdstreamError, match=r"kafka.min_insync_replicas=3 > replication_factor=2.*lower it"):
        build_config({"kafka": {"replication_factor": 2, "min_insync_replicas": 3}})
    with pytest.raises(AdstreamError, match=r"stream.join.assignment='groups'.*'group'"):
        build_config({"stream": {"join": {"assignment": "groups"}}})
    with pytest.raises(AdstreamError, match=r"stream.join.session_timeout_s"):
        build_config({"stream": {"join": {"session_timeout_s": 1}}})
    import tomllib
    from pathlib import Path

    cluster = build_config(tomllib.loads((Path(__file__).parents[1] / "docker" / "cluster.toml").read_text()))
    assert cluster.kafka.replication_factor == 3 and cluster.kafka.min_insync_replicas == 2
    assert cluster.stream.join.assignment == "group" and cluster.trainer.challengers == ()
