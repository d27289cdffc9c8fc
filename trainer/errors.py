"""The one error base class of trainer/."""

from common.errors import AdstreamError


class TrainerError(AdstreamError):
    """Base class of every error raised by trainer/: names the place, the value and the fix."""


class SnapshotError(TrainerError):
    """A snapshot is incomplete, of another format, or does not match the model."""
