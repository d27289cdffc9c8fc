"""The project's one error root.

Every package has one base class under AdstreamError (stream.errors.StreamError,
store.errors.StoreError, trainer.errors.TrainerError, serving.errors.ServingError,
adstream.errors.CliError), so the CLI catches one type. Like everything in common/, this module
imports nothing of the project (tests/test_layout.py), so any package may import it.
"""


class AdstreamError(Exception):
    """Root of every error adstream raises on purpose: names the place, the value and the fix."""
