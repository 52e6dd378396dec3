"""User errors. Anything the user can get wrong (a path, a file, a recipe field, a sampler option, a flag) raises a
`DlmError` whose message names the file, line or field and says what to do; the CLI prints it as one line and exits
with status 2. Every other exception is a bug and keeps its traceback."""

from __future__ import annotations


class DlmError(Exception):
    """Bad input from the user: the message alone says what and where."""


class ModelNotFoundError(DlmError, FileNotFoundError):
    """A path that does not exist or holds no model."""


class OptionsError(DlmError, ValueError):
    """An invalid sampling option (name or value)."""
