"""The one error base class of serving/."""


class ServingError(Exception):
    """Base class of every error raised by serving/: names the place, the value and the fix."""
