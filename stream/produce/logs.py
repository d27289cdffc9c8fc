"""Raw log files -> checked Arrow tables in the bundle layout, by the schema's [source] table.

Vectorized: a file is read in blocks by pyarrow's CSV reader (tsv/csv) or JSON reader (jsonl),
plain or gzip, every column as text (JSON: as parsed); each column is then converted by its
field's kind, and a value that does not parse is a reason, not an exception. The converted table
is checked by bundle.check_table, the same rules every other path uses, so a bad row gets the
reason a JSON event with that value would get. A line with the wrong number of columns is its
own reject. Only the good rows go on, already in the layout of an Arrow bundle.

Event ids and times: from the columns the [source] table names, else "<file stem>:<row>" and a
fixed base time plus the row's index in the whole replay (ms), so file order is time order.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson

from stream import rules
from stream.errors import StreamError
from stream.featurizer.bundle import check_table
from stream.formats.arrow import bundle_schema
from stream.schema import Schema

BASE_TS_MS = 1_400_000_000_000  # the time of row 0 when a log has no time column
BLOCK_BYTES = 4 << 20  # text read per block
_INTEGER = r"^[+-]?\d{1,18}$"  # what int64 holds exactly; longer digit runs are out of range
_LONG_INTEGER = r"^[+-]?\d{19,}$"
_FLOAT = r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$"


@dataclass(frozen=True)
class BadLine:
    """A log line (or row) that will not become an event, bound for the dead-letter topic."""

    where: str  # "<file stem>:<row>" or "<file stem>" when the row is unknown
    raw: bytes  # the line, or the row as JSON text
    reason: str


@dataclass(frozen=True, eq=False)
class LogBlock:
    """One block of a log: its good rows as a bundle-layout table, and the rest with reasons."""

    good: pa.Table  # event_id, ts, label, integer, float and categorical fields; one row per event (maybe none)
    bad: tuple[BadLine, ...]


def _columns(schema: Schema) -> list[str]:
    """The column names of a log without a header line."""
    if schema.source.columns:
        return list(schema.source.columns)
    return [
        schema.source.label,
        *schema.integer_fields,
        *schema.float_fields,
        *schema.categorical_fields,
        *schema.list_fields,
    ]


def _open(path: Path) -> io.BufferedIOBase:
    if not path.is_file():
        raise StreamError(f"replay: no file at {path}")
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")  # type: ignore[return-value]


def _text_blocks(path: Path, schema: Schema, bad: list[BadLine]) -> Iterator[pa.Table]:
    """Tables of text columns (null for an empty value); malformed lines are appended to `bad`
    (their `where` is "<stem>:<row>", the row counting data lines from 0)."""
    source = schema.source
    if source.format == "jsonl":
        yield from _json_blocks(path, bad)
        return
    if source.header:
        with _open(path) as fh:
            names = fh.readline().decode("utf-8", "replace").rstrip("\r\n").split(source.delimiter)
        names = [name.strip().strip('"') for name in names]
    else:
        names = _columns(schema)

    def malformed(row: pcsv.InvalidRow) -> str:
        where = f"{path.stem}:{row.number - 1 - int(source.header)}" if row.number else path.stem  # number: 1-based
        reason = f"expected {row.expected_columns} {source.format} columns, got {row.actual_columns}"
        bad.append(BadLine(where, row.text.encode(), reason))
        return "skip"

    reader = pcsv.open_csv(
        _open(path),
        read_options=pcsv.ReadOptions(
            column_names=names, skip_rows=int(source.header), block_size=BLOCK_BYTES, use_threads=False
        ),
        parse_options=pcsv.ParseOptions(
            delimiter=source.delimiter,
            quote_char=False if source.format == "tsv" else '"',
            invalid_row_handler=malformed,
        ),
        convert_options=pcsv.ConvertOptions(
            column_types=dict.fromkeys(names, pa.string()),
            strings_can_be_null=True,
            null_values=[""],
            check_utf8=False,
        ),
    )
    for batch in reader:
        yield pa.Table.from_batches([batch])


def _json_blocks(path: Path, bad: list[BadLine]) -> Iterator[pa.Table]:
    with _open(path) as fh:
        while True:
            chunk = fh.read(BLOCK_BYTES)
            if not chunk:
                return
            chunk += fh.readline()  # whole lines only
            try:
                yield pjson.read_json(io.BytesIO(chunk))
            except pa.ArrowInvalid:  # a bad line somewhere: parse the block line by line
                yield _json_lines(chunk, path, bad)


def _json_lines(chunk: bytes, path: Path, bad: list[BadLine]) -> pa.Table:
    rows = []
    for line in chunk.splitlines():
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            bad.append(BadLine(path.stem, line, f"record: not valid JSON ({exc})"))
            continue
        if not isinstance(row, dict):
            bad.append(BadLine(path.stem, line, f"record: expected a JSON object, got {type(row).__name__}"))
            continue
        rows.append(row)
    return pa.Table.from_pylist(rows)


def _as_int(column: pa.Array, scale: int = 1) -> tuple[pa.Array, np.ndarray, np.ndarray]:
    """Text (or numbers) -> (int64 with null where absent or unparsable, unparsable (n,), too long (n,))."""
    if pa.types.is_integer(column.type) or pa.types.is_null(column.type):
        values = column.cast(pa.int64())
        nothing = np.zeros(len(column), dtype=bool)
        return (pc.multiply(values, scale) if scale != 1 else values), nothing, nothing
    text = column.cast(pa.string())
    try:  # the usual case: every value parses
        values = pc.cast(text, pa.int64())
        nothing = np.zeros(len(column), dtype=bool)
        return (pc.multiply(values, scale) if scale != 1 else values), nothing, nothing
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        pass
    ok = pc.fill_null(pc.match_substring_regex(text, _INTEGER), True).to_numpy(zero_copy_only=False)
    long = pc.fill_null(pc.match_substring_regex(text, _LONG_INTEGER), False).to_numpy(zero_copy_only=False)
    values = pc.cast(pc.if_else(pa.array(ok), text, pa.scalar(None, pa.string())), pa.int64())
    return (pc.multiply(values, scale) if scale != 1 else values), ~ok & ~long, long


def _as_float(column: pa.Array) -> tuple[pa.Array, np.ndarray]:
    if pa.types.is_integer(column.type) or pa.types.is_floating(column.type) or pa.types.is_null(column.type):
        return column.cast(pa.float64()), np.zeros(len(column), dtype=bool)
    text = column.cast(pa.string())
    ok = pc.fill_null(pc.match_substring_regex(text, _FLOAT), True).to_numpy(zero_copy_only=False)
    return pc.cast(pc.if_else(pa.array(ok), text, pa.scalar(None, pa.string())), pa.float64()), ~ok


def _as_time(column: pa.Array, time_format: str) -> tuple[pa.Array, np.ndarray]:
    """The time column -> (epoch ms int64, unparsable (n,))."""
    if time_format in ("epoch_ms", "epoch_s"):
        values, bad, long = _as_int(column, 1000 if time_format == "epoch_s" else 1)
        return values, bad | long
    text = column.cast(pa.string())
    stamps = pc.strptime(text, format=time_format, unit="ms", error_is_null=True)
    bad = (stamps.is_null().to_numpy(zero_copy_only=False)) & ~(text.is_null().to_numpy(zero_copy_only=False))
    return stamps.cast(pa.int64()), bad


def to_bundle_layout(
    text: pa.Table, schema: Schema, stem: str, rows: np.ndarray, replay_base: int
) -> tuple[pa.Table, dict[str, tuple[np.ndarray, str]]]:
    """A block as read -> (the bundle-layout table, per field the rows whose text did not parse).
    rows int64 (n,): each row's data-line index in its file; replay_base: lines of earlier files."""
    source = schema.source
    missing = [c for c in (source.label, source.event_id, source.time) if c and c not in text.column_names]
    missing += [
        f for f in (*schema.dense_fields, *schema.categorical_fields, *schema.list_fields) if f not in text.column_names
    ]
    if missing:
        raise StreamError(
            f"replay {stem}: no column(s) {missing} in the log (it has {text.column_names[:8]}...); "
            f"fix the schema's [source] table or its field names"
        )

    def column(name: str) -> pa.Array:
        return text.column(name).combine_chunks()

    unparsed: dict[str, tuple[np.ndarray, str]] = {}
    columns: dict[str, pa.Array] = {}
    if source.event_id:
        columns[schema.event_id] = column(source.event_id).cast(pa.string())
    else:
        columns[schema.event_id] = pc.binary_join_element_wise(f"{stem}:", pa.array(rows).cast(pa.string()), "")
    if source.time:
        ts, bad = _as_time(column(source.time), source.time_format)
        text_rule = rules.TIMESTAMP_TEXT.format(column=source.time, fmt=source.time_format)
        columns[schema.timestamp], unparsed[schema.timestamp] = ts, (bad, text_rule)
    else:
        columns[schema.timestamp] = pa.array(BASE_TS_MS + replay_base + rows, pa.int64())
    label, bad, long = _as_int(column(source.label))
    columns[schema.label], unparsed[schema.label] = label, (bad | long, rules.LABEL)
    for name in schema.integer_fields:
        values, bad, long = _as_int(column(name))
        columns[name] = values
        # digits beyond int64 are out of range, as the same number in JSON would be
        unparsed[name] = (bad, rules.INTEGER) if bad.any() or not long.any() else (long, rules.INTEGER_RANGE)
    for name in schema.float_fields:
        values, bad = _as_float(column(name))
        columns[name], unparsed[name] = values, (bad, rules.FLOAT)
    for name in schema.categorical_fields:
        values = column(name)
        columns[name] = values if pa.types.is_string(values.type) else values.cast(pa.string())
    for name in schema.list_fields:  # a cell "a|b|c" (tsv/csv), or a JSON array (jsonl)
        values = column(name)
        if pa.types.is_list(values.type) or pa.types.is_null(values.type):
            columns[name] = values.cast(pa.list_(pa.string()))
        else:
            columns[name] = pc.split_pattern(values.cast(pa.string()), source.list_separator)
    return pa.table(columns, schema=bundle_schema(schema)), unparsed


def read_log(paths: Iterable[str | Path], schema: Schema, loop: bool = False) -> Iterator[LogBlock]:
    """LogBlocks over the files in order (forever with loop; later rounds' ids get "#<round>")."""
    rounds = replay_base = 0
    while True:
        for path in map(Path, paths):
            stem = path.stem if not rounds else f"{path.stem}#{rounds}"
            next_row = 0  # data lines of this file seen so far, malformed ones included
            bad: list[BadLine] = []
            for text in _text_blocks(path, schema, bad):
                # the block's rows are its span of lines less the malformed ones found while reading it
                skipped = [int(b.where.rsplit(":", 1)[1]) for b in bad if ":" in b.where]
                span = np.arange(next_row, next_row + text.num_rows + len(bad))
                rows = np.setdiff1d(span, skipped)[: text.num_rows] if skipped else span[: text.num_rows]
                table, unparsed = to_bundle_layout(text, schema, stem, rows, replay_base)
                checked = check_table(table, schema, unparsed, values_too=False)
                if isinstance(checked, str):
                    raise StreamError(f"replay {path}: {checked}")
                bad = [replace(b, where=b.where.replace(path.stem, stem, 1)) for b in bad]
                ok = checked.good()
                if not ok.all():
                    lines = text.to_pylist()
                    for i in np.nonzero(~ok)[0]:
                        bad.append(BadLine(f"{stem}:{rows[i]}", orjson.dumps(lines[i]), str(checked.reasons[i])))
                    table = table.filter(pa.array(ok))
                yield LogBlock(table, tuple(bad))
                next_row = int(span[-1]) + 1 if len(span) else next_row
                bad = []
            if bad:  # a file of malformed lines only
                yield LogBlock(pa.table({}), tuple(bad))
                next_row += len(bad)
            replay_base += next_row
        rounds += 1
        if not loop:
            return
