"""Runs cells in spawned 2-rank workers, classifies them, and renders the compatibility table.

A spawn that hangs or dies loses only the cell it was in: that cell is a ``FAIL`` and the cells after it
run in a fresh spawn.
"""

from __future__ import annotations

import json
import platform
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import worker
from .families import Family
from .settings import SETTINGS

#: Seconds a spawn gets to start (two ranks importing torch + transformers on 2 shared cores) ...
STARTUP_S = 180.0
#: ... plus this much per cell it runs (a cell is two prepares, a gather, a forward and a step).
CELL_S = 90.0

PASS, REFUSED, FAIL = "pass", "refused (stock fails too)", "FAIL"
CRASH = "hang or crash"


@dataclass
class Cell:
    """The result of one (family, setting) cell."""

    family: str
    setting: str
    outcome: str
    reason: str
    stock: str
    """The stock path's outcome in a word: ``ok``, ``wrong``, ``error: <type>``, ``hang or crash``, ``not run``."""
    stock_reason: str = ""
    facts: dict[str, Any] = field(default_factory=dict)


def classify(family: str, setting: str, facts: dict[str, Any]) -> Cell:
    """``pass`` when the plugin's path conforms; ``refused`` when it raised a ``MemSafeError`` before
    anything moved and stock failed too; ``FAIL`` otherwise."""
    plugin, stock = facts["plugin"], facts["stock"]
    error = plugin["error"]
    if error is None and not plugin["problems"]:
        outcome, reason = PASS, ""
    elif error and error["memsafe"] and not error["moved"] and _describe(stock) != "ok":
        outcome, reason = REFUSED, _error_text(error)
    else:
        outcome, reason = FAIL, _error_text(error) if error else "; ".join(plugin["problems"])
    stock_reason = _error_text(stock["error"]) if stock["error"] else "; ".join(stock["problems"])
    return Cell(family, setting, outcome, reason, _describe(stock), stock_reason, facts)


def _describe(path: dict[str, Any]) -> str:
    if path["error"] and path["error"]["type"] == CRASH:
        return CRASH
    if path["error"]:
        return f"error: {path['error']['type']}"
    return "wrong" if path["problems"] else "ok"


def _error_text(error: dict[str, Any]) -> str:
    if error["type"] == CRASH:
        return error["message"]
    where = "every rank" if error["all_ranks"] else f"rank {error['rank']}"
    moved = ", after parameters were sharded" if error["moved"] else ""
    return f"{error['type']} on {where}{moved}: {error['message']}"


def run(jobs: list[tuple[Family, list[str]]], workdir: Path, *, pack: bool = False, startup_s: float = STARTUP_S,
        cell_s: float = CELL_S, on_cell: Callable[[Cell], None] | None = None) -> tuple[list[Cell], dict[str, float]]:
    """Runs the cells of ``jobs``: one spawn per family, or (``pack``) one spawn for all of them.

    A spawn gets ``startup_s + cell_s * cells`` seconds; past that it is killed (a hang).

    Returns:
        The cells in order, and the wall seconds of each spawn (keyed by its first family).
    """
    from tests.spawn import RankFailure, run_on_ranks

    groups = [jobs] if pack else [[job] for job in jobs]
    cells: list[Cell] = []
    spawns: dict[str, float] = {}
    for group in groups:
        pending = [(family, list(settings)) for family, settings in group]
        while pending:
            progress = workdir / f"progress-{len(spawns)}-{time.monotonic_ns()}.jsonl"
            progress.touch()
            timeout = startup_s + cell_s * sum(len(s) for _, s in pending)
            start, failure = time.monotonic(), None
            try:
                run_on_ranks(worker.run_cells, 2, init_process_group=False, timeout=timeout, jobs=pending,
                             progress=str(progress))
            except RankFailure as exc:
                failure = exc
            spawns[f"{pending[0][0].name}#{len(spawns)}"] = time.monotonic() - start
            done, partial = _read(progress)
            new = [classify(*key, facts) for key, facts in done.items()]
            pending = [(f, [s for s in settings if (f.name, s) not in done]) for f, settings in pending]
            pending = [(f, settings) for f, settings in pending if settings]
            if failure is not None and pending:
                lost = _lost(pending, partial, _first_line(str(failure)), any_done=bool(done))
                new += lost
                gone = {(c.family, c.setting) for c in lost}
                pending = [(f, [s for s in settings if (f.name, s) not in gone]) for f, settings in pending]
                pending = [(f, settings) for f, settings in pending if settings]
            for cell in new:
                cells.append(cell)
                if on_cell:
                    on_cell(cell)
    return cells, spawns


def _read(progress: Path) -> tuple[dict[tuple[str, str], dict[str, Any]], dict[tuple[str, str], dict[str, Any] | None]]:
    """Finished cells with their facts, and unfinished ones with the plugin path's facts if it finished."""
    done, partial = {}, {}
    for line in progress.read_text().splitlines():
        record = json.loads(line)
        key, event = (record.pop("family"), record.pop("setting")), record.pop("event")
        if event == "start":
            partial[key] = None
        elif event == "plugin":
            partial[key] = record["plugin"]
        else:
            done[key] = record
            partial.pop(key, None)
    return done, partial


def _lost(pending: list[tuple[Family, list[str]]], partial: dict[tuple[str, str], Any], reason: str, *,
          any_done: bool) -> list[Cell]:
    """The cells a failed spawn took down: the one it was in; else (it failed between cells) the next one;
    else (it never reached a cell) every pending one, since a re-spawn would fail the same way."""
    if not partial:
        keys = [(f.name, s) for f, settings in pending for s in settings]
        if any_done:
            return [Cell(*keys[0], FAIL, f"spawn failed before this cell started: {reason}", "not run")]
        return [Cell(*key, FAIL, f"spawn failed before any cell started: {reason}", "not run") for key in keys]
    cells = []
    for (family, setting), plugin in partial.items():
        if plugin is None:
            cells.append(Cell(family, setting, FAIL, f"plugin path hung or crashed the process: {reason}", "not run"))
        else:  # the stock path took the process down after the plugin's path finished
            stock = {"error": {"type": CRASH, "message": reason}, "problems": []}
            cells.append(classify(family, setting, {"plugin": plugin, "stock": stock}))
    return cells


def _first_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not ln.startswith("---")]
    return lines[0][:300] if lines else "no message"


def render(cells: list[Cell], families: list[Family], dropped: dict[str, str], *, command: str,
           timings: dict[str, Any]) -> str:
    """The compatibility page: command, versions, table, counts, failures, families, timings."""
    import accelerate
    import torch
    import transformers

    settings = [s.name for s in SETTINGS if any(c.setting == s.name for c in cells)]
    by_key = {(c.family, c.setting): c for c in cells}
    lines = [
        "# Compatibility matrix",
        "",
        "FSDP2 `prepare` on 2 CPU gloo ranks, with the plugin (`MemSafePlugin()`) and with stock accelerate's path",
        "(`MemSafePlugin(stages=[])`, the same Accelerator class), for tiny random models of each architecture family.",
        "A cell **passes** when every parameter and buffer gathered after `prepare` is bitwise equal to a plain",
        "single-process `from_pretrained` of the same checkpoint (bf16: to the stock result when stock runs), the loss",
        "matches, ties are kept, one backward + AdamW step is finite, and both ranks agree.",
        "",
        f"Produced by `{command}`",
        "",
        f"torch {torch.__version__}, accelerate {accelerate.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        "",
        "## Settings",
        "",
        "| setting | FullyShardedDataParallelPlugin(...) | mixed_precision | loader |",
        "|---|---|---|---|",
    ]
    for s in SETTINGS:
        if s.name in settings:
            kwargs = ", ".join(f"{k}={v!r}" for k, v in s.fsdp_kwargs().items())
            lines.append(f"| `{s.name}` | `{kwargs}` | {s.mixed_precision} | {s.loader} |")
    lines += ["", "## Results", "", "Each cell: plugin outcome / stock outcome.", "",
              "| family | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    for f in families:
        row = []
        for s in settings:
            c = by_key.get((f.name, s))
            row.append("" if c is None else f"{'**FAIL**' if c.outcome == FAIL else c.outcome.split(' ')[0]} / {c.stock}")
        lines.append(f"| {f.name} | " + " | ".join(row) + " |")
    counts = Counter(c.outcome for c in cells)
    lines += ["", f"**{len(cells)} cells**: " + ", ".join(f"{counts[o]} {o}" for o in (PASS, REFUSED, FAIL)), ""]
    failures = [c for c in cells if c.outcome != PASS]
    if failures:
        lines += ["## Failures and refusals", ""]
        lines += [f"- `{c.family}` × `{c.setting}` — {c.outcome}: {c.reason}" + (f" (stock: {c.stock_reason})" if c.stock_reason else "")
                  for c in failures]
        lines.append("")
    stock_only = [c for c in cells if c.outcome == PASS and c.stock != "ok"]
    if stock_only:
        lines += ["## Cells where the plugin passes and stock does not", ""]
        by_reason: dict[str, list[Cell]] = {}
        for c in stock_only:
            by_reason.setdefault(c.stock_reason, []).append(c)
        for reason, group in by_reason.items():
            lines.append(f"- stock: {reason} — " + ", ".join(f"`{c.family}` × `{c.setting}`" for c in group))
        lines.append("")
    lines += ["## Families", "", "| family | auto class | parameters | kinds |", "|---|---|---|---|"]
    lines += [f"| {f.name} | {f.auto_class} | {f.num_params:,} | {', '.join(f.kinds)} |" for f in families]
    if dropped:
        lines += ["", "Candidates tried and dropped:", ""]
        lines += [f"- `{name}`: {why}" for name, why in dropped.items()]
    lines += ["", "## Timings", ""]
    lines += [f"- {k}: {v}" for k, v in timings.items()]
    return "\n".join(lines) + "\n"
