"""What makes an event valid, in one place.

Every path an event can take checks it with these rules: a JSON event (featurizer/decode.py, one value at a
time), an Arrow bundle (featurizer/bundle.py, a column at a time) and a raw log line (produce/logs.py). So a bad
event gets the same reason, "<field>: <rule>", whichever way it came; the dead-letter topic keeps
the offending bytes beside the reason. Reasons do not quote the value (a column check finds many
at once; the record itself is in the DLQ).
"""

from __future__ import annotations

import math
import re

import numpy as np

INT_BOUND = 1 << 62  # integer features: |v| < 2^62, so they survive int64 math and JSON exactly
MAX_CATEGORY_CHARS = 256  # longest category string
MAX_EVENT_ID_CHARS = 256  # longest event id: ids travel in batch keys, DLQ copies and responses
HEX32 = "[0-9a-fA-F]{1,8}"  # a hex32 category: up to 8 hex digits (Criteo's are 8)
HEX32_RE = re.compile(HEX32)

# the rules' texts: the reason is f"{field}: {rule}"
MISSING_FIELD = "missing field"
EVENT_ID = "must be a non-empty string or an integer"
EVENT_ID_LONG = f"longer than {MAX_EVENT_ID_CHARS} characters"
TIMESTAMP = "must be a non-negative integer (ms) below 2^62"
TIMESTAMP_TEXT = "the log's column {column!r} does not parse as its [source] time_format {fmt!r}"  # replay
LABEL_MISSING = "missing; a training event needs a 0/1 label"
LABEL = "must be 0 or 1"  # 0.0, 1.0 and -0.0 are 0 and 1 too, on every path (JSON and Arrow)
INTEGER = "must be an integer or null"
INTEGER_RANGE = "integer out of range (|v| < 2^62)"
FLOAT = "must be a finite number or null"
CATEGORY = "must be a string or null (an integer too, under a schema whose categories are not hex32)"
CATEGORY_HEX = "must be up to 8 hex digits"
CATEGORY_LONG = f"longer than {MAX_CATEGORY_CHARS} characters"
MAX_LIST_VALUES = 1024  # most values in one list field of one event
LIST = "must be an array of strings or null"
LIST_LONG = f"more than {MAX_LIST_VALUES} values"


def reason(field: str, rule: str) -> str:
    return f"{field or 'record'}: {rule}"


# --- one value (JSON events, log lines): the rule broken, or None ---------------------------
def check_event_id(value: object) -> str | None:
    ok = (isinstance(value, str) and value != "") or (isinstance(value, int) and not isinstance(value, bool))
    if not ok:
        return EVENT_ID
    return EVENT_ID_LONG if isinstance(value, str) and len(value) > MAX_EVENT_ID_CHARS else None


def check_timestamp(value: object) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < INT_BOUND
    return None if ok else TIMESTAMP


def check_label(value: object, required: bool) -> str | None:
    if value is None:
        return LABEL_MISSING if required else None
    return None if not isinstance(value, bool) and value in (0, 1) else LABEL


def check_integer(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        return INTEGER
    return None if -INT_BOUND < value < INT_BOUND else INTEGER_RANGE


def check_float(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return FLOAT
    return None if math.isfinite(value) else FLOAT


def check_category(value: object, hex32: bool) -> str | None:
    """A present category (None and "" are missing values, checked by the caller)."""
    if not isinstance(value, str):
        return CATEGORY
    if len(value) > MAX_CATEGORY_CHARS:
        return CATEGORY_LONG
    if hex32 and not HEX32_RE.fullmatch(value):
        return CATEGORY_HEX
    return None


def check_list(value: object, hex32: bool) -> str | None:
    """A list field: null, or an array of strings each a valid category ("" values are skipped)."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return LIST
    if len(value) > MAX_LIST_VALUES:
        return LIST_LONG
    return next((broken for v in value if v and (broken := check_category(v, hex32))), None)


# --- whole columns (Arrow bundles): a bool mask (n,) of the values breaking the rule ----------
def bad_timestamps(ts: np.ndarray, null: np.ndarray) -> np.ndarray:
    return null | (ts < 0) | (ts >= INT_BOUND)


def bad_labels(labels: np.ndarray) -> np.ndarray:
    """int64 or float64 (n,) -> bool (n,): neither 0 nor 1 (NaN is bad; -0.0 == 0)."""
    return (labels != 0) & (labels != 1)


def long_event_ids(lengths: np.ndarray) -> np.ndarray:
    """Characters per event id (n,) -> bool (n,): over MAX_EVENT_ID_CHARS."""
    return lengths > MAX_EVENT_ID_CHARS


def integers_out_of_range(values: np.ndarray) -> np.ndarray:
    return (values <= -INT_BOUND) | (values >= INT_BOUND)


def bad_floats(values: np.ndarray, null: np.ndarray) -> np.ndarray:
    return ~null & ~np.isfinite(values)
