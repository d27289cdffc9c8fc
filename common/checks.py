"""Settings dataclasses declare their allowed values per field; one function checks them all.

    batch_size: int = at_least(1, 256)  # events per train step
    model: str = one_of(MODEL_KINDS, "dcn")  # model family

Every settings dataclass calls `check_fields(self, "<section>", <its package's error>)` in its
__post_init__, so a bad value is refused where it is built (TOML, --set, or code) with the key
and the fix. Like everything in common/ this module imports nothing of the project: any package may use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any


def one_of(allowed: Iterable[object], default: object) -> Any:
    """A field whose value must be one of `allowed`."""
    return dataclasses.field(default=default, metadata={"one_of": tuple(allowed)})


def at_least(low: float, default: object) -> Any:
    """A numeric field that must be >= low."""
    return dataclasses.field(default=default, metadata={"at_least": low})


def default_of(component: type, name: str) -> Any:
    """The default a component's config declares for `name`: a settings section that exposes the
    same knob takes it from there, so each default is written once (trainer/settings.py)."""
    for f in dataclasses.fields(component):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            raise TypeError(f"{component.__name__}.{name} has no plain default to share")
    raise TypeError(f"{component.__name__} has no field {name!r}")


def check_fields(settings: Any, section: str, error: type[Exception]) -> None:
    """Raise `error` naming section.key, the value and the allowed values, for the first bad field."""
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        allowed = f.metadata.get("one_of")
        if allowed is not None and value not in allowed:
            raise error(f"config {section}.{f.name}={value!r}: use one of {list(allowed)}")
        low = f.metadata.get("at_least")
        if low is not None and value < low:
            raise error(f"config {section}.{f.name}={value!r}: must be >= {low}")


def with_changes(settings: Any, changes: Mapping[str, Any]) -> Any:
    """A copy of nested settings with dotted keys changed: {"optim.lr": 0.01, "batch_size": 64}."""
    nested: dict[str, dict[str, Any]] = {}
    direct: dict[str, Any] = {}
    for key, value in changes.items():
        head, dot, rest = key.partition(".")
        if dot:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[key] = value
    for head, inner in nested.items():
        direct[head] = with_changes(getattr(settings, head), inner)
    return dataclasses.replace(settings, **direct)


def flat_fields(settings: Any, prefix: str = "") -> dict[str, Any]:
    """Nested settings as one flat dict with dotted keys (for MLflow params): {"optim.lr": 0.003, ...}."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            out.update(flat_fields(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = value
    return out


def coerce_like(value: Any, default: Any) -> Any:
    """A setting's value (a TOML value or a command line's string) as the type of its `default`:
    bool ("true"/"false"/"1"/"0"), int (no fractional float), float, tuple ("a,b" split; items of
    the default's item type), str. Raises ValueError or TypeError; the caller names the key."""
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
        items = [x for x in value.split(",") if x.strip()] if isinstance(value, str) else list(value)  # "" = ()
        return tuple(type(default[0])(x) for x in items) if default else tuple(items)
    if isinstance(default, str):
        if not isinstance(value, (str, int, float)):
            raise ValueError(value)
        return str(value)
    return value
