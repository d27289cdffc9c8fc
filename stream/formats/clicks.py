"""Click records, the format: `{"impression_id": ..., "ts": ...}` as JSON, keyed by the impression
id. What an ad server (or serving's POST /click, or `replay --clicks`) sends and the joiner reads."""

from __future__ import annotations

import orjson


def click_record(impression_id: str, ts: int, id_field: str = "impression_id", time_field: str = "ts") -> bytes:
    """A click as the joiner reads it (read_clicks' inverse): `{id_field: impression_id, time_field: ts}`."""
    return orjson.dumps({id_field: impression_id, time_field: ts})
