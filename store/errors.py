"""The one error base class of store/."""

from common.errors import AdstreamError


class StoreError(AdstreamError):
    """Base class of every error raised by store/: names the tier, the value and the fix."""
