"""The one error base class of serving/."""

from common.errors import AdstreamError


class ServingError(AdstreamError):
    """Base class of every error raised by serving/: names the place, the value and the fix."""
