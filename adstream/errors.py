"""The project's one error root, and the base of adstream/'s own errors.

Every package has one base class under AdstreamError (stream.errors.StreamError,
store.errors.StoreError, trainer.errors.TrainerError, serving.errors.ServingError, CliError
here), so the CLI catches one type. This module imports nothing: it is the one part of adstream/
the other packages may import (tests/test_layout.py).
"""


class AdstreamError(Exception):
    """Root of every error adstream raises on purpose: names the place, the value and the fix."""


class CliError(AdstreamError):
    """Raised by adstream/ itself: the CLI, the config file, the local stack, the demo."""
