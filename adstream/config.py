"""One config for every component, from an optional TOML file plus `--set section.key=value` flags.

    [stack]   adstream.settings.StackSettings     [kafka]    stream.kafka.settings.KafkaSettings
    [stream]  stream.settings.StreamSettings    [trainer]  trainer.settings.TrainerSettings
    [mlflow]  trainer.settings.MlflowSettings   [serving]  serving.settings.ServingSettings
    [trainer.model], [trainer.optim], [trainer.store], [trainer.snapshot], [trainer.group]: the
    trainer's sub-settings (trainer/settings.py); `--set trainer.optim.lr=0.01` reaches them too.

An unknown section or key is an error that lists the valid ones. kafka.bootstrap and
mlflow.tracking_uri follow the stack's ports unless set explicitly; serving.alias follows
mlflow.alias.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from adstream.errors import CliError
from adstream.settings import StackSettings
from common.checks import coerce_like
from serving.settings import ServingSettings
from stream.join.policy import check_delayed_feedback
from stream.kafka.settings import KafkaSettings
from stream.settings import StreamSettings
from trainer.settings import MlflowSettings, TrainerSettings

SECTIONS: dict[str, type] = {
    "stack": StackSettings,
    "kafka": KafkaSettings,
    "stream": StreamSettings,
    "trainer": TrainerSettings,
    "mlflow": MlflowSettings,
    "serving": ServingSettings,
}


@dataclass(frozen=True)
class Config:
    stack: StackSettings = field(default_factory=StackSettings)
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    stream: StreamSettings = field(default_factory=StreamSettings)
    trainer: TrainerSettings = field(default_factory=TrainerSettings)
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)

    def __post_init__(self) -> None:
        # the joiner and the trainer run apart, but one config: its policy's labels need their loss
        check_delayed_feedback(self.stream.join.policy, self.trainer.optim.delayed_feedback)


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    try:
        return coerce_like(value, default)
    except (TypeError, ValueError):
        raise CliError(
            f"config {section}.{key}={value!r}: expected {type(default).__name__} like {default!r}"
        ) from None


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    """One settings dataclass from a {key: value} table; nested settings from nested tables."""
    if not isinstance(values, dict):
        raise CliError(f"config [{where}]: expected a table of settings, got {values!r}")
    defaults = cls()
    names = [f.name for f in fields(cls)]
    changes: dict[str, Any] = {}
    for key, value in values.items():
        if key not in names:
            raise CliError(f"config: unknown key {where}.{key}; valid keys of [{where}]: {sorted(names)}")
        default = getattr(defaults, key)
        if dataclasses.is_dataclass(default):
            changes[key] = _build(type(default), value, f"{where}.{key}")
        else:
            changes[key] = _coerce(where, key, value, default)
    return replace(defaults, **changes)  # the dataclass checks its own values (common/checks.py)


def build_config(sections: dict[str, dict[str, Any]]) -> Config:
    """Validate a {section: {key: value or {key: value}}} mapping into a Config."""
    built: dict[str, Any] = {}
    for section, values in sections.items():
        if section not in SECTIONS:
            raise CliError(f"config: unknown section [{section}]; valid sections: {sorted(SECTIONS)}")
        built[section] = _build(SECTIONS[section], values, section)
    config = Config(**built)
    kafka_given = "bootstrap" in sections.get("kafka", {})
    mlflow_given = "tracking_uri" in sections.get("mlflow", {})
    if not kafka_given:
        config = replace(config, kafka=replace(config.kafka, bootstrap=config.stack.bootstrap))
    if not mlflow_given:
        config = replace(config, mlflow=replace(config.mlflow, tracking_uri=config.stack.tracking_uri))
    if not config.serving.alias:  # serving follows the alias the trainer moves unless told otherwise
        config = replace(config, serving=replace(config.serving, alias=config.mlflow.alias))
    if not config.trainer.label_wait_s:  # fake-negative metrics wait as long as the join may label
        join = config.stream.join
        config = replace(config, trainer=replace(config.trainer, label_wait_s=join.window_s + join.allowed_lateness_s))
    return config


def parse_set(assignments: list[str]) -> dict[str, dict[str, Any]]:
    """["trainer.optim.lr=0.01", ...] -> {"trainer": {"optim": {"lr": "0.01"}}}."""
    out: dict[str, Any] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        path = [part.strip() for part in key.split(".")]
        if not sep or len(path) < 2 or not all(path):
            raise CliError(f"--set {item!r}: write section.key=value, e.g. trainer.optim.lr=0.01")
        table = out
        for part in path[:-1]:
            table = table.setdefault(part, {})
        table[path[-1]] = value
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def load_config(path: str | None = None, assignments: list[str] | None = None) -> Config:
    """From `path`, else $ADSTREAM_CONFIG, else ./adstream.toml if present; then the --set assignments."""
    chosen = path or os.environ.get("ADSTREAM_CONFIG") or ("adstream.toml" if Path("adstream.toml").is_file() else None)
    sections: dict[str, dict[str, Any]] = {}
    if chosen:
        file = Path(chosen)
        if not file.is_file():
            raise CliError(f"config: no file at {file}")
        try:
            sections = tomllib.loads(file.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise CliError(f"config {file}: not valid TOML: {exc}") from None
    _merge(sections, parse_set(assignments or []))
    return build_config(sections)


def as_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}
