"""``accelerate-memsafe``: one sub-command per file in this package, registered in ``COMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import sys

#: sub-command -> module in accelerate_memsafe.cli with ``add_parser(subparsers)`` and ``run(args) -> int``.
COMMANDS = {
    "demo": "demo",
    "config": "config",
    "launch": "launch",
    "env": "env_cmd",
    "report": "report",
    "estimate": "estimate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accelerate-memsafe",
        description="Memory-safe prepare / load_state / save_state / save_model for Hugging Face Accelerate.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(f"accelerate_memsafe.cli.{module}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
