"""The one error base class of adstream/ (CLI, config, local stack)."""


class AdstreamError(Exception):
    """Base class of every error raised by adstream/: names the place, the value and the fix."""
