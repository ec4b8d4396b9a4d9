"""``accelerate-memsafe report RUN.json [--plot out.png]``: the per-stage table of every rank, and a plot."""

from __future__ import annotations

import argparse

from .errors import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="print the per-stage memory table of a report JSON (and plot it)")
    p.add_argument("path", help="a report written by MemoryReport.to_json (e.g. by the demo)")
    p.add_argument("--plot", help="write the memory timeline per rank to this PNG")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from ..memory.report import MemoryReport

    how = ("write one with `accelerate-memsafe demo` (memsafe-demo/report.json) or `report.gather().to_json(path)` "
           "in your script (examples/fsdp2_train.py --report run.json)")
    if not Path(args.path).is_file():
        raise CliError(f"report {args.path} does not exist; {how}.")
    try:
        report = MemoryReport.from_json(args.path)
    except json.JSONDecodeError as exc:
        raise CliError(f"report {args.path} is not JSON ({exc}); {how}.") from None
    except ValueError as exc:
        raise CliError(f"{exc} {how[0].upper()}{how[1:]}.") from None
    print(report.to_markdown())
    if args.plot:
        from ..memory.plot import plot_report

        print(f"\nwrote {plot_report(report, args.plot)}")
    return 0
