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
FORMATS = ("tsv", "csv", "jsonl")
TIME_FORMATS = ("epoch_ms", "epoch_s")  # or a strftime pattern such as "%y%m%d%H"
_REQUIRED = {"name", "label", "event_id", "timestamp", "categorical_encoding", "integer_fields", "categorical_fields"}
_OPTIONAL = {"float_fields", "list_fields", "list_pooling", "source"}
_SOURCE_KEYS = {
    "format",
    "header",
    "columns",
    "delimiter",
    "label",
    "event_id",
    "time",
    "time_format",
    "list_separator",
}
POOLINGS = ("mean", "sum")


@dataclass(frozen=True)
class Source:
    """How a raw log file of this schema is laid out (what `adstream replay` parses). Not part of
    the schema hash: it changes how a log is read, not what the model sees."""

    format: str = "tsv"  # "tsv", "csv" or "jsonl" (plain or .gz)
    header: bool = False  # tsv/csv: the first line names the columns
    columns: tuple[str, ...] = ()  # tsv/csv without a header: the column names ("" = label, then the fields in order)
    delimiter: str = "\t"  # tsv/csv: the field separator
    label: str = ""  # the column holding the 0/1 label ("" = the schema's label name)
    event_id: str = ""  # the column holding the event id ("" = generated: "<file stem>:<row>")
    time: str = ""  # the column holding the event time ("" = file order: a fixed base + the row index, ms)
    time_format: str = "epoch_ms"  # "epoch_ms", "epoch_s" or a strftime pattern (Avazu: "%y%m%d%H")
    list_separator: str = "|"  # tsv/csv: separates a list field's values inside a cell (jsonl: a JSON array)


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
    float_fields: tuple[str, ...] = ()  # real-valued features: dense floats only (after the integers)
    list_fields: tuple[str, ...] = ()  # multi-valued categories (tags, recent ads): one id per value, pooled
    list_pooling: tuple[str, ...] = ()  # per list field: "mean" or "sum" of its values' rows
    source: Source = Source()  # the raw log's layout, for replay

    @property
    def sparse_fields(self) -> tuple[str, ...]:
        """Sparse id columns, in order: one per integer field (its bucket), then categories."""
        return self.integer_fields + self.categorical_fields

    @property
    def dense_fields(self) -> tuple[str, ...]:
        """Dense columns, in order: signed log1p of each integer field, then each float field."""
        return self.integer_fields + self.float_fields

    @property
    def num_dense(self) -> int:
        return len(self.integer_fields) + len(self.float_fields)

    @property
    def num_sparse(self) -> int:
        """Single-id fields (one id per event each): integer buckets, then categories."""
        return len(self.integer_fields) + len(self.categorical_fields)

    @property
    def num_fields(self) -> int:
        """Fields the model sees: the single-id fields, then one pooled vector per list field. Field
        index i is also the high bits of its ids (featurize.py)."""
        return self.num_sparse + len(self.list_fields)

    def request_example(self) -> dict[str, object]:
        """One unlabelled event as `POST /predict` (and the events topic) takes it: each field a
        value of its kind (any field but the event id may be null: a missing value)."""
        category = "0000abcd" if self.categorical_encoding == "hex32" else "example"
        return {
            self.event_id: "example-1",
            self.timestamp: 1_700_000_000_000,
            **{name: 3 for name in self.integer_fields},
            **{name: 0.5 for name in self.float_fields},
            **{name: category for name in self.categorical_fields},
            **{name: [category] for name in self.list_fields},
        }

    def field_kinds(self) -> dict[str, str]:
        """Every field of an event and what it holds, in the schema's order."""
        category = f"category ({self.categorical_encoding})"
        return {
            self.event_id: "event id (string or integer)",
            self.timestamp: "event time, ms (optional at serve time: now)",
            self.label: "0/1 label (events topic only; never sent to /predict)",
            **{name: "integer or null" for name in self.integer_fields},
            **{name: "number or null" for name in self.float_fields},
            **{name: f"{category} or null" for name in self.categorical_fields},
            **{name: f"list of {category}, [] or null" for name in self.list_fields},
        }


def _names(content: dict[str, object], key: str, where: str) -> tuple[str, ...]:
    value = content.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise SchemaError(f'{where}: {key} must be a list of field names, e.g. {key} = ["a", "b"]')
    return tuple(value)


def _source(content: object, schema_label: str, where: str) -> Source:
    if content is None:
        return Source()
    if not isinstance(content, dict):
        raise SchemaError(f'{where}: [source] must be a table, e.g. [source] format = "csv"')
    unknown = set(content) - _SOURCE_KEYS
    if unknown:
        raise SchemaError(
            f"{where}: unknown key(s) {sorted(unknown)} in [source]; allowed keys: {sorted(_SOURCE_KEYS)}"
        )
    fmt = content.get("format", "tsv")
    if fmt not in FORMATS:
        raise SchemaError(f"{where}: source.format={fmt!r}; use one of {list(FORMATS)}")
    header = content.get("header", False)
    columns = _names(content, "columns", f"{where} [source]")
    time_format = str(content.get("time_format", "epoch_ms"))
    if time_format not in TIME_FORMATS and "%" not in time_format:
        raise SchemaError(
            f"{where}: source.time_format={time_format!r}; use one of {list(TIME_FORMATS)} or a strftime pattern"
        )
    delimiter = str(content.get("delimiter", "\t" if fmt == "tsv" else ","))
    if len(delimiter) != 1:
        raise SchemaError(f'{where}: source.delimiter={delimiter!r}; use one character, e.g. ","')
    return Source(
        format=str(fmt),
        header=bool(header),
        columns=columns,
        delimiter=delimiter,
        label=str(content.get("label", "")) or schema_label,
        event_id=str(content.get("event_id", "")),
        time=str(content.get("time", "")),
        time_format=time_format,
        list_separator=str(content.get("list_separator", "|")),
    )


def _pooling(value: object, lists: tuple[str, ...], where: str) -> tuple[str, ...]:
    """list_pooling: one word for every list field, or a table {field = "mean" | "sum"}."""
    chosen = dict.fromkeys(lists, value) if isinstance(value, str) else value
    if not isinstance(chosen, dict) or set(chosen) - set(lists):
        raise SchemaError(f'{where}: list_pooling={value!r}; write "mean", "sum" or a table of list fields')
    out = tuple(str(chosen.get(name, "mean")) for name in lists)
    for name, pool in zip(lists, out, strict=True):
        if pool not in POOLINGS:
            raise SchemaError(f"{where}: list_pooling of {name} is {pool!r}; use one of {list(POOLINGS)}")
    return out


def schema_from_dict(content: dict[str, object], where: str = "schema") -> Schema:
    """Validate a parsed schema file. Errors name the key and the fix."""
    unknown = set(content) - _REQUIRED - _OPTIONAL
    if unknown:
        raise SchemaError(f"{where}: unknown key(s) {sorted(unknown)}; allowed keys: {sorted(_REQUIRED | _OPTIONAL)}")
    missing = _REQUIRED - set(content)
    if missing:
        raise SchemaError(f"{where}: missing key(s) {sorted(missing)}")
    if content["categorical_encoding"] not in ENCODINGS:
        raise SchemaError(f"{where}: categorical_encoding={content['categorical_encoding']!r}; use one of {ENCODINGS}")
    ints = _names(content, "integer_fields", where)
    floats = _names(content, "float_fields", where)
    cats = _names(content, "categorical_fields", where)
    lists = _names(content, "list_fields", where)
    pooling = _pooling(content.get("list_pooling", "mean"), lists, where)
    names = [content["label"], content["event_id"], content["timestamp"], *ints, *floats, *cats, *lists]
    if len(set(names)) != len(names):
        raise SchemaError(f"{where}: a field name appears twice: {names}")
    if len(ints) + len(cats) + len(lists) >= 1 << 20:
        raise SchemaError(f"{where}: too many fields ({len(ints) + len(cats) + len(lists)}); at most 2^20")
    source = _source(content.get("source"), str(content["label"]), where)
    # the hash covers what the model sees: not [source], and optional keys only when they say something
    hashed = {k: v for k, v in content.items() if k != "source" and (k in _REQUIRED or v)}
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":")).encode()
    return Schema(
        name=str(content["name"]),
        label=str(content["label"]),
        event_id=str(content["event_id"]),
        timestamp=str(content["timestamp"]),
        categorical_encoding=str(content["categorical_encoding"]),
        integer_fields=ints,
        categorical_fields=cats,
        hash=hashlib.sha256(canonical).hexdigest()[:16],
        float_fields=floats,
        list_fields=lists,
        list_pooling=pooling,
        source=source,
    )


def schema_file(name_or_path: str | Path) -> Path:
    """The file of a bundled schema's name ("criteo"), or the path itself."""
    path = Path(name_or_path)
    return SCHEMA_DIR / f"{name_or_path}.toml" if not path.suffix else path


def load_schema(name_or_path: str | Path = "criteo") -> Schema:
    """Load a bundled schema by name ("criteo") or any schema file by path."""
    path = schema_file(name_or_path)
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
