"""Schema files: which fields an event has, read from TOML, versioned by a content hash.

A new log format (Avazu, a company's own) needs a schema file, not code. The hash covers the
parsed content (not comments or layout), so serving can refuse a snapshot trained on another
schema.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from stream.errors import SchemaError

SCHEMA_DIR = Path(__file__).parent / "schemas"
ENCODINGS = ("hex32", "string")
_KEYS = {
    "name",
    "label",
    "event_id",
    "timestamp",
    "categorical_encoding",
    "integer_fields",
    "categorical_fields",
}


@dataclass(frozen=True)
class Schema:
    name: str
    label: str  # field holding the 0/1 label
    event_id: str  # field holding the event id (also the Kafka key)
    timestamp: str  # field holding event time in ms
    categorical_encoding: str  # "hex32" (collision-free ids) or "string" (64-bit hash)
    integer_fields: tuple[str, ...]  # count-like features: log-bucket ids AND dense floats
    categorical_fields: tuple[str, ...]  # categories: one id each
    hash: str  # content hash, 16 hex chars

    @property
    def sparse_fields(self) -> tuple[str, ...]:
        """Sparse id columns, in order: one per integer field (its bucket), then categories."""
        return self.integer_fields + self.categorical_fields

    @property
    def num_dense(self) -> int:
        return len(self.integer_fields)

    @property
    def num_sparse(self) -> int:
        return len(self.integer_fields) + len(self.categorical_fields)


def schema_from_dict(content: dict[str, object], where: str = "schema") -> Schema:
    """Validate a parsed schema file. Errors name the key and the fix."""
    unknown = set(content) - _KEYS
    if unknown:
        raise SchemaError(f"{where}: unknown key(s) {sorted(unknown)}; allowed keys: {sorted(_KEYS)}")
    missing = _KEYS - set(content)
    if missing:
        raise SchemaError(f"{where}: missing key(s) {sorted(missing)}")
    if content["categorical_encoding"] not in ENCODINGS:
        raise SchemaError(f"{where}: categorical_encoding={content['categorical_encoding']!r}; use one of {ENCODINGS}")
    ints = tuple(str(f) for f in content["integer_fields"])  # type: ignore[attr-defined]
    cats = tuple(str(f) for f in content["categorical_fields"])  # type: ignore[attr-defined]
    names = [content["label"], content["event_id"], content["timestamp"], *ints, *cats]
    if len(set(names)) != len(names):
        raise SchemaError(f"{where}: a field name appears twice: {names}")
    if len(ints) + len(cats) >= 1 << 20:
        raise SchemaError(f"{where}: too many fields ({len(ints) + len(cats)}); at most 2^20")
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return Schema(
        name=str(content["name"]),
        label=str(content["label"]),
        event_id=str(content["event_id"]),
        timestamp=str(content["timestamp"]),
        categorical_encoding=str(content["categorical_encoding"]),
        integer_fields=ints,
        categorical_fields=cats,
        hash=hashlib.sha256(canonical).hexdigest()[:16],
    )


def load_schema(name_or_path: str | Path = "criteo") -> Schema:
    """Load a bundled schema by name ("criteo") or any schema file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SCHEMA_DIR / f"{name_or_path}.toml"
    if not path.is_file():
        raise SchemaError(
            f"schema {str(name_or_path)!r}: no file at {path}; bundled: "
            f"{sorted(p.stem for p in SCHEMA_DIR.glob('*.toml'))}"
        )
    try:
        content = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise SchemaError(f"schema {path}: not valid TOML: {exc}") from exc
    return schema_from_dict(content, where=str(path))
