"""``accelerate-memsafe``: one sub-command per file in this package, registered in ``COMMANDS``.

Errors end here: :func:`main` turns every exception into one message naming the input and the fix
(:func:`error_message`), exit code 2 for a bad command line or input and 1 for a check that failed; the
traceback is shown with ``--debug`` only.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ..errors import CheckpointError, ConfigError, MemoryBudgetError, MemSafeError, PipelineError
from .errors import CHECK_FAILED, USAGE, CliError

PROG = "accelerate-memsafe"

#: sub-command -> module in accelerate_memsafe.cli with ``add_parser(subparsers)`` and ``run(args) -> int``.
COMMANDS = {
    "demo": "demo",
    "config": "config",
    "launch": "launch",
    "env": "env_cmd",
    "report": "report",
    "estimate": "estimate",
}

#: Exit code after the reader of our output went away (``accelerate-memsafe estimate ... | head -1``), as
#: a process killed by SIGPIPE.
BROKEN_PIPE = 141


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error that points to ``--help`` instead of the whole usage block."""

    def error(self, message: str):
        self.exit(USAGE, f"{self.prog}: error: {message}\n  see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Memory-safe prepare / load_state / save_state / save_model for Hugging Face Accelerate.",
    )
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(f"accelerate_memsafe.cli.{module}").add_parser(sub)
    for name, command in sub.choices.items():
        if name != "launch":  # launch passes what follows the script to the script (its own --debug too)
            command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                 help="show the full traceback of an error")
    return parser


def error_message(exc: BaseException) -> tuple[str, int]:
    """The message and exit code of an error that reached the command line (the one place that decides).

    Example:
        >>> error_message(FileNotFoundError(2, "No such file or directory", "run.json"))
        ('run.json does not exist; check the path.', 2)
    """
    if isinstance(exc, CliError):
        return str(exc), exc.code
    if isinstance(exc, (ConfigError, PipelineError, CheckpointError)):  # what the user gave is wrong
        return str(exc), USAGE
    if isinstance(exc, MemoryBudgetError):
        return str(exc), CHECK_FAILED
    if isinstance(exc, MemSafeError):
        return str(exc), 1
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename} does not exist; check the path.", USAGE
    if isinstance(exc, OSError) and exc.filename:
        return f"{exc.filename}: {exc.strerror}.", USAGE
    if isinstance(exc, ImportError):
        return f"{exc}. A dependency is missing: reinstall with `pip install -e .` (or `pip install accelerate-memsafe`).", 1
    return (f"unexpected {type(exc).__name__}: {exc}. This is a bug: run again with `{PROG} --debug ...` and "
            "report the traceback."), 1


def _quiet_stdout() -> None:
    """Points stdout at /dev/null, so that the interpreter's final flush does not fail on the closed pipe again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (captured in a test)
        pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # a closed pipe fails here, where it is handled, not in the interpreter's last flush
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug:
            raise
        message, code = error_message(exc)
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
