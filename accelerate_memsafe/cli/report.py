"""``accelerate-memsafe report RUN.json [--plot out.png]``: the per-stage table of every rank, and a plot."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="print the per-stage memory table of a report JSON (and plot it)")
    p.add_argument("path", help="a report written by MemoryReport.to_json (e.g. by the demo)")
    p.add_argument("--plot", help="write the memory timeline per rank to this PNG")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..memory.report import MemoryReport

    report = MemoryReport.from_json(args.path)
    print(report.to_markdown())
    if args.plot:
        from ..memory.plot import plot_report

        print(f"\nwrote {plot_report(report, args.plot)}")
    return 0
