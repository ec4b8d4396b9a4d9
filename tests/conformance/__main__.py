"""``python -m tests.conformance [--families a,b] [--settings x,y] [--count N] [--out docs/compatibility.md] [--verbose]``

Runs the conformance matrix (one 2-rank spawn per family, families one after the other), prints each cell
as it finishes, writes the markdown page, and exits 1 if any cell is a ``FAIL``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

from . import families as fam
from . import matrix
from .settings import BY_NAME, SETTINGS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance", description=__doc__.splitlines()[2])
    parser.add_argument("--families", help="comma-separated family names (default: the first --count that pass)")
    parser.add_argument("--settings", help=f"comma-separated settings (default: all of {', '.join(BY_NAME)})")
    parser.add_argument("--count", type=int, default=30, help="how many families to keep when --families is not given")
    parser.add_argument("--out", help="write the markdown page here (e.g. docs/compatibility.md)")
    parser.add_argument("--verbose", action="store_true", help="print why each dropped candidate was dropped")
    args = parser.parse_args(argv)
    settings = args.settings.split(",") if args.settings else [s.name for s in SETTINGS]
    unknown = [s for s in settings if s not in BY_NAME]
    if unknown:
        parser.error(f"unknown settings {unknown}; choose from {', '.join(BY_NAME)}")
    names = args.families.split(",") if args.families else None
    command = shlex.join(["python", "-m", "tests.conformance", *(argv if argv is not None else sys.argv[1:])])

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="memsafe-conformance-") as tmp:
        root = Path(tmp)
        print(f"preparing families in {root} ...", flush=True)
        families, dropped = fam.select(root, names, count=args.count, verbose=args.verbose)
        prepared_s = time.monotonic() - start
        for f in families:
            print(f"  {f.name:16s} {f.auto_class:26s} {f.num_params:>9,}  {' '.join(f.kinds)}", flush=True)
        print(f"{len(families)} families ({len(dropped)} dropped) in {prepared_s:.0f}s; "
              f"{len(families) * len(settings)} cells", flush=True)
        missing = sorted(set(fam.REQUIRED_KINDS) - {k for f in families for k in f.kinds})
        if missing and names is None:
            print(f"warning: no family covers {missing}", flush=True)

        def report(cell: matrix.Cell) -> None:
            tail = f" — {cell.reason}" if cell.reason else ""
            print(f"  {cell.family:16s} {cell.setting:16s} {cell.outcome} (stock: {cell.stock}){tail}", flush=True)

        cells, spawns = matrix.run([(f, settings) for f in families], root, on_cell=report)
    total = time.monotonic() - start
    timings = {
        "preparing the families (build, check, save, reference)": f"{prepared_s:.0f} s",
        "spawns (one per family; a re-spawn after a crash, hang or divergent error is listed separately)":
            ", ".join(f"{k.split('#')[0]} {v:.0f} s" for k, v in spawns.items()),
        "mean spawn": f"{sum(spawns.values()) / max(len(spawns), 1):.0f} s",
        "total": f"{total:.0f} s",
    }
    print(f"done in {total:.0f}s", flush=True)
    if args.out:
        Path(args.out).write_text(matrix.render(cells, families, dropped, command=command, timings=timings))
        print(f"wrote {args.out}", flush=True)
    return 1 if any(c.outcome == matrix.FAIL for c in cells) else 0


if __name__ == "__main__":
    sys.exit(main())
