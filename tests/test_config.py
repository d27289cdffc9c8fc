import pytest

from adstream.cli import build_parser
from adstream.config import build_config, load_config, parse_set
from adstream.errors import AdstreamError


def test_defaults_follow_stack_ports():
    config = build_config({"stack": {"kafka_port": 30000, "mlflow_port": 30100}})
    assert config.kafka.bootstrap == "127.0.0.1:30000"
    assert config.mlflow.tracking_uri == "http://127.0.0.1:30100"
    explicit = build_config({"stack": {"kafka_port": 30000}, "kafka": {"bootstrap": "broker:9092"}})
    assert explicit.kafka.bootstrap == "broker:9092"


def test_unknown_section_and_key_name_the_fix():
    with pytest.raises(AdstreamError, match=r"unknown section \[trainr\]"):
        build_config({"trainr": {}})
    with pytest.raises(AdstreamError, match=r"unknown key trainer.learning_rate.*'lr'"):
        build_config({"trainer": {"learning_rate": 0.1}})


def test_values_are_typed():
    config = build_config({"trainer": {"lr": "0.05", "hidden": "32,16", "batch_size": 512}})
    assert config.trainer.lr == 0.05 and config.trainer.hidden == (32, 16) and config.trainer.batch_size == 512
    with pytest.raises(AdstreamError, match=r"trainer.batch_size='many': expected int"):
        build_config({"trainer": {"batch_size": "many"}})


def test_file_and_set_flags(tmp_path):
    file = tmp_path / "a.toml"
    file.write_text("[trainer]\nlr = 0.5\n[stream]\nbatch_events = 64\n")
    config = load_config(str(file), ["trainer.lr=0.25"])
    assert config.trainer.lr == 0.25 and config.stream.batch_events == 64
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

    with pytest.raises(TrainerError, match=r"trainer.merge_every_steps=-1: must be >= 0"):
        build_config({"trainer": {"merge_every_steps": -1}})
    with pytest.raises(TrainerError, match=r"trainer.optimizer='adagrad'.*'adam', 'sgd'"):
        build_config({"trainer": {"optimizer": "adagrad"}})
    with pytest.raises(TrainerError, match=r"trainer.model='xdeepfm'.*'lr', 'fm', 'deepfm', 'dcn'"):
        build_config({"trainer": {"model": "xdeepfm"}})
    with pytest.raises(TrainerError, match=r"trainer.sparse_optimizer='rmsprop'.*'ftrl'"):
        build_config({"trainer": {"sparse_optimizer": "rmsprop"}})


def test_store_policies_on_the_ram_store_are_an_error_not_ignored():
    from trainer.errors import TrainerError

    with pytest.raises(TrainerError, match=r"trainer.ttl_steps=5.*set trainer.store = \"tiered\""):
        build_config({"trainer": {"ttl_steps": 5}})
    with pytest.raises(TrainerError, match=r"trainer.eviction='lfu'"):
        build_config({"trainer": {"eviction": "lfu"}})
    built = build_config({"trainer": {"store": "tiered", "ttl_steps": 5, "eviction": "lfu"}})
    assert built.trainer.ttl_steps == 5 and built.trainer.eviction == "lfu"
