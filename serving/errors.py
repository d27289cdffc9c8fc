"""The one error base class of serving/."""

from adstream.errors import AdstreamError


class ServingError(AdstreamError):
    """Base class of every error raised by serving/: names the place, the value and the fix."""
