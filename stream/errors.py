"""The one error base class of stream/, and its kinds."""

from __future__ import annotations

from common.errors import AdstreamError


class StreamError(AdstreamError):
    """Base class of every error raised by stream/."""


class SchemaError(StreamError):
    """A schema file is unreadable or inconsistent."""


class DecodeError(StreamError):
    """One event failed validation. `field` names the offending field ("" for the record)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field or 'record'}: {reason}")
        self.field = field
        self.reason = reason


class BatchCodecError(StreamError):
    """An Arrow batch on the wire does not match what this version writes."""
