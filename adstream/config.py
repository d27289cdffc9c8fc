"""One config for every component, from an optional TOML file plus `--set section.key=value` flags.

    [stack]   adstream.settings.StackSettings     [kafka]    stream.settings.KafkaSettings
    [stream]  stream.settings.StreamSettings    [trainer]  trainer.settings.TrainerSettings
    [mlflow]  trainer.settings.MlflowSettings   [serving]  serving.settings.ServingSettings

An unknown section or key is an error that lists the valid ones. kafka.bootstrap and
mlflow.tracking_uri follow the stack's ports unless set explicitly.
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
from serving.settings import ServingSettings
from stream.settings import KafkaSettings, StreamSettings
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


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    where = f"{section}.{key}"
    try:
        if isinstance(default, bool):
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                return value.lower() in ("true", "1")
            return bool(value)
        if isinstance(default, int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if isinstance(default, float):
            return float(value)
        if isinstance(default, tuple):
            items = value.split(",") if isinstance(value, str) else list(value)
            return tuple(type(default[0])(x) for x in items) if default else tuple(items)
        if isinstance(default, str):
            if not isinstance(value, (str, int, float)):
                raise ValueError(value)
            return str(value)
    except (TypeError, ValueError):
        raise CliError(f"config {where}={value!r}: expected {type(default).__name__} like {default!r}") from None
    return value


def build_config(sections: dict[str, dict[str, Any]]) -> Config:
    """Validate a {section: {key: value}} mapping into a Config."""
    built: dict[str, Any] = {}
    for section, values in sections.items():
        if section not in SECTIONS:
            raise CliError(f"config: unknown section [{section}]; valid sections: {sorted(SECTIONS)}")
        if not isinstance(values, dict):
            raise CliError(f"config [{section}]: expected a table of settings, got {values!r}")
        cls = SECTIONS[section]
        defaults = cls()
        names = {f.name for f in fields(cls)}
        for key in values:
            if key not in names:
                raise CliError(f"config: unknown key {section}.{key}; valid keys of [{section}]: {sorted(names)}")
        built[section] = replace(
            defaults, **{k: _coerce(section, k, v, getattr(defaults, k)) for k, v in values.items()}
        )
    config = Config(**built)
    kafka_given = "bootstrap" in sections.get("kafka", {})
    mlflow_given = "tracking_uri" in sections.get("mlflow", {})
    if not kafka_given:
        config = replace(config, kafka=replace(config.kafka, bootstrap=config.stack.bootstrap))
    if not mlflow_given:
        config = replace(config, mlflow=replace(config.mlflow, tracking_uri=config.stack.tracking_uri))
    return config


def parse_set(assignments: list[str]) -> dict[str, dict[str, Any]]:
    """["trainer.lr=0.01", ...] -> {"trainer": {"lr": "0.01"}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot:
            raise CliError(f"--set {item!r}: write section.key=value, e.g. trainer.lr=0.01")
        out.setdefault(section.strip(), {})[name.strip()] = value
    return out


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
    for section, values in parse_set(assignments or []).items():
        sections.setdefault(section, {}).update(values)
    return build_config(sections)


def as_dict(config: Config) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}
