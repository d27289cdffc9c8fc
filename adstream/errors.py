"""adstream/'s own error: the CLI, the config file, the local stack, the demo (the root of every
package's errors, AdstreamError, is common/errors.py)."""

from common.errors import AdstreamError


class CliError(AdstreamError):
    """Raised by adstream/ itself: the CLI, the config file, the local stack, the demo."""
