"""The one error base class of store/."""


class StoreError(Exception):
    """Base class of every error raised by store/: names the tier, the value and the fix."""
