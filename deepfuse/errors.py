"""User-facing errors: one line that names the problem and the fix.

The CLI prints `error: <message>` and exits 2 for these; anything else is a bug.
"""


class DeepfuseError(ValueError):
    """Bad input from a person: missing file, unknown target, prompt too long, ...
    A ValueError, so callers that catch ValueError for bad arguments catch it too."""
