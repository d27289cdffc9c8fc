"""JSON lines, the format: each row of a bundle-layout table (stream/formats/arrow.py) as one JSON
object, built column-wise in Arrow. Replay writes events this way; the joiner reads JSON-lines
impressions and splices labels into them."""

from __future__ import annotations

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

_ESCAPED = np.zeros(256, dtype=bool)  # bytes JSON needs escaped inside a string: '"', '\\', controls
_ESCAPED[[ord('"'), ord("\\"), *range(0x20)]] = True


def _string_buffers(strings: pa.Array) -> tuple[np.ndarray, bytes | pa.Buffer]:
    """A (32-bit offset) string array's value offsets (n + 1,) and its data buffer, the array
    unsliced first so the offsets index the buffer from its start."""
    if strings.offset:
        strings = pa.concat_arrays([strings])
    offsets = np.frombuffer(strings.buffers()[1], dtype=np.int32, count=len(strings) + 1)
    return offsets, strings.buffers()[2] if strings.buffers()[2] is not None else b""


def _needs_escape(column: pa.Array) -> bool:
    offsets, data = _string_buffers(column)
    return bool(_ESCAPED[np.frombuffer(data, dtype=np.uint8)[offsets[0] : offsets[-1]]].any())


def json_lines(table: pa.Table) -> list[bytes]:
    """Each row of a bundle-layout table as one JSON object, built column-wise in Arrow (no Python
    per value): {"<column>": value, ...}, null for a missing value."""
    if not table.num_rows or not table.num_columns:
        return []
    pieces: list[object] = []  # '{"a":', values of a, ',"b":', values of b, ..., '}' joined with ""
    for i, name in enumerate(table.column_names):
        column = table.column(name).combine_chunks()
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            if _needs_escape(column):  # rare: let orjson quote these columns value by value
                text = pa.array([None if v is None else orjson.dumps(v).decode() for v in column.to_pylist()])
            else:
                text = pc.binary_join_element_wise('"', column, '"', "")
        elif pa.types.is_list(column.type):  # list fields: JSON arrays, value by value
            text = pa.array([None if v is None else orjson.dumps(v).decode() for v in column.to_pylist()], pa.string())
        else:
            text = column.cast(pa.string())
        pieces += [("{" if i == 0 else ",") + orjson.dumps(name).decode() + ":", pc.fill_null(text, "null")]
    return utf8_values(pc.binary_join_element_wise(*pieces, "}", ""))


def utf8_values(strings: pa.Array) -> list[bytes]:
    """A string array without nulls -> its values as bytes, cut from the one data buffer."""
    offsets, buffer = _string_buffers(strings)
    data, bounds = bytes(buffer), offsets.tolist()
    return [data[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
