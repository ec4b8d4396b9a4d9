"""What a sub-command raises to stop with a message: :func:`accelerate_memsafe.cli.main.main` prints it as
``accelerate-memsafe COMMAND: error: MESSAGE`` (no traceback unless ``--debug``) and exits with its code."""

from __future__ import annotations

#: Exit code of a bad command line or input (a missing file, a value that does not parse).
USAGE = 2
#: Exit code of a check that ran and failed (``estimate``: the plugin's worst stage does not fit the budget).
CHECK_FAILED = 1


class CliError(Exception):
    """A message for the user (what was wrong with which input, and the fix) and the exit code.

    Example:
        >>> CliError("report run.json does not exist").code
        2
    """

    def __init__(self, message: str, *, code: int = USAGE) -> None:
        super().__init__(message)
        self.code = code
