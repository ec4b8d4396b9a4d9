"""Runs cells in spawned 2-rank workers, classifies them, and renders the compatibility table.

A spawn that hangs or dies loses only the path (plugin or stock) it was in: that path counts as a crash
and everything after it runs in a fresh spawn.
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
from .settings import BY_NAME, EXTRA_SETTINGS, SETTINGS

#: Seconds a spawn gets to start (two ranks importing torch + transformers on 2 shared cores) ...
STARTUP_S = 180.0
#: ... plus this much per cell it runs (a cell is two prepares, a gather, a forward and a step).
CELL_S = 90.0

PASS, REFUSED, FAIL = "pass", "refused (stock fails too)", "FAIL"
#: ``cp`` only: ``prepare`` conformed (weights bitwise, ties), and the model's forward then fails under the hooks
#: accelerate's ``prepare`` attaches for context parallelism, as it does in one process with the same hooks.
NOT_RUN = "n/a (the forward fails under cp's hooks, in one process too)"
CRASH = "hang or crash"


@dataclass
class Cell:
    """The result of one (family, setting) cell."""

    family: str
    setting: str
    outcome: str
    reason: str
    stock: str
    """The stock path's outcome in a word: ``ok``, ``wrong``, ``error: <type>``, ``hang or crash``."""
    stock_reason: str = ""
    facts: dict[str, Any] = field(default_factory=dict)


def classify(family: str, setting: str, facts: dict[str, Any]) -> Cell:
    """``pass`` when the plugin's path conforms; ``refused`` when it raised a ``MemSafeError`` before
    anything moved and stock failed too; ``FAIL`` otherwise."""
    plugin, stock = facts["plugin"], facts["stock"]
    error = plugin["error"]
    if error is None and not plugin["problems"] and plugin.get("forward_fails_under_cp"):
        outcome, reason = NOT_RUN, plugin["forward_fails_under_cp"]
    elif error is None and not plugin["problems"]:
        outcome, reason = PASS, ""
    elif error and error.get("memsafe") and not error.get("moved") and _describe(stock) != "ok":
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
    if path["problems"]:
        return "wrong"
    return "n/a" if path.get("forward_fails_under_cp") else "ok"


def _error_text(error: dict[str, Any]) -> str:
    if error["type"] == CRASH:
        return error["message"]
    where = "every rank" if error["all_ranks"] else f"rank {error['rank']}"
    moved = ", after parameters were sharded" if error["moved"] else ""
    return f"{error['type']} on {where}{moved}: {error['message']}"


def run(jobs: list[tuple[Family, list[str]]], workdir: Path, *, pack: bool = False, startup_s: float = STARTUP_S,
        cell_s: float = CELL_S, on_cell: Callable[[Cell], None] | None = None) -> tuple[list[Cell], dict[str, float]]:
    """Runs the cells of ``jobs``: one spawn per family, or (``pack``) one spawn for all of them.

    A spawn gets ``startup_s + cell_s * cells`` seconds; past that it is killed (a hang). What a spawn
    did not finish runs in a new spawn: the path it died in counts as a crash of that path.

    Returns:
        The cells in order, and the wall seconds of each spawn (keyed by its first family).
    """
    from tests.spawn import RankFailure, run_on_ranks

    tasks = [worker.Task(f, s) for f, settings in jobs for s in settings]
    groups = [tasks] if pack else [[t for t in tasks if t.family.name == f.name] for f, _ in jobs]
    # a spawn runs on one number of ranks: a group's settings on other numbers get spawns of their own
    groups = [[t for t in g if BY_NAME[t.setting].world_size == w] for g in groups
              for w in sorted({BY_NAME[t.setting].world_size for t in g})]
    facts: dict[tuple[str, str], dict[str, Any]] = {}
    cells: list[Cell] = []
    emitted: set[tuple[str, str]] = set()
    spawns: dict[str, float] = {}
    for group in groups:
        pending = group
        while pending:
            progress = workdir / f"spawn-{len(spawns)}.jsonl"
            progress.touch()
            start, failure = time.monotonic(), None
            try:
                run_on_ranks(worker.run_cells, BY_NAME[pending[0].setting].world_size, init_process_group=False,
                             timeout=startup_s + cell_s * len(pending),
                             tasks=pending, progress=str(progress))
            except RankFailure as exc:
                failure = _first_line(str(exc))
            spawns[f"{pending[0].family.name}#{len(spawns)}"] = time.monotonic() - start
            events = [json.loads(line) for line in progress.read_text().splitlines()]
            pending = _settle(pending, events, failure, facts)
            for task in group:
                key = (task.family.name, task.setting)
                if len(facts.get(key, {})) == len(worker.PATHS) and key not in emitted:
                    emitted.add(key)
                    cells.append(classify(*key, facts[key]))
                    if on_cell:
                        on_cell(cells[-1])
    return cells, spawns


def _settle(pending: list[worker.Task], events: list[dict[str, Any]], failure: str | None,
            facts: dict[tuple[str, str], dict[str, Any]]) -> list[worker.Task]:
    """Records the facts of the paths a spawn finished (in ``facts``) and returns the tasks left.

    When the spawn failed, the path it was in is a crash (with a rank's own account of it when one wrote
    one); if it failed between cells, the next path is; if it never reached a cell, every pending path is.
    """
    starts, aborts, restart = [], {}, False
    for e in events:
        key = (e["family"], e["setting"])
        if e["event"] == "start":
            starts.append((key, e["path"]))
        elif e["event"] == "abort":
            aborts[(key, e["path"])] = e["message"]
        elif e["event"] == "restart":
            restart = True  # ended on purpose; a failure in the teardown that follows says nothing more
        else:
            facts.setdefault(key, {})[e["event"]] = e[e["event"]]

    def todo(task: worker.Task) -> tuple[str, ...]:
        return tuple(p for p in task.paths if p not in facts.get((task.family.name, task.setting), {}))

    remaining = [t for t in pending if todo(t)]
    if failure is not None and not restart and remaining:
        lost = [s for s in starts[-1:] if s[1] not in facts.get(s[0], {})]
        if not starts:
            lost = [((t.family.name, t.setting), p) for t in remaining for p in todo(t)]
            failure = f"the spawn failed before any cell started: {failure}"
        elif not lost:
            lost = [((remaining[0].family.name, remaining[0].setting), todo(remaining[0])[0])]
            failure = f"the spawn failed between cells: {failure}"
        for key, path in lost:
            message = aborts.get((key, path)) or f"the {path} path hung or crashed the process: {failure}"
            facts.setdefault(key, {})[path] = {"error": {"type": CRASH, "message": message}, "problems": []}
    return [worker.Task(t.family, t.setting, todo(t)) for t in remaining if todo(t)]


def _first_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and not ln.startswith("---")]
    return lines[0][:300] if lines else "no message"


def _reason_kind(why: str) -> tuple[str, str]:
    """A declined TP plan's reason as (kind, what is particular to the model: the forward's error, or ``""``).

    Example:
        >>> _reason_kind("the model's TP plan uses style(s) ['packed_colwise'], which the plugin does not map to ...")
        ("the model's TP plan uses style(s) ['packed_colwise']", '')
    """
    if "does not run with its TP plan" in why:
        return "the model's forward does not run with its plan", why.split("`meta`): ", 1)[-1][:90]
    if "matches none of its" in why:
        return "the plan matches none of the model's (untied) modules", ""
    return why.split(", which")[0].split(" (")[0], ""


def render(cells: list[Cell], families: list[Family], dropped: dict[str, str], *, command: str,
           timings: dict[str, Any]) -> str:
    """The compatibility page: command, versions, table, counts, failures, families, timings."""
    import accelerate
    import torch
    import transformers

    settings = [s.name for s in SETTINGS + EXTRA_SETTINGS if any(c.setting == s.name for c in cells)]
    by_key = {(c.family, c.setting): c for c in cells}
    lines = [
        "# Compatibility matrix",
        "",
        "FSDP2 `prepare` on 2 CPU gloo ranks (4 for `tp`, `hsdp` and `cp`: FSDP 2 x TP 2, HSDP 2 x 2 and FSDP 2 x CP 2",
        "through accelerate's `ParallelismConfig`), with the plugin (`MemSafePlugin()`) and with stock accelerate's path",
        "(`MemSafePlugin(stages=[])`, the same Accelerator class), for tiny random models of each architecture family.",
        "The stock path loads the model with transformers' `from_pretrained` on every rank (what a script without the",
        "plugin does; the `memsafe` loader's meta weights are filled by the plugin's stages only).",
        "A cell **passes** when every parameter and buffer gathered after `prepare` is bitwise equal to a plain",
        "single-process `from_pretrained` of the same checkpoint (bf16: to the stock result when stock runs), the loss",
        "matches, ties are kept, one backward + AdamW step is finite, and every rank agrees with rank 0.",
        "",
        *(["Under `tp`, stock accelerate splits nothing of a model loaded without `tp_plan` (it warns, then shards with",
           "FSDP over `dp_shard` only); the plugin applies the model's own TP plan where the model's forward runs with",
           "it (see the section on tensor parallelism below), else shards as stock does.", ""] if "tp" in settings else []),
        *(["Under `cp`, both paths shard with FSDP over accelerate's flattened `dp_shard_cp` dimension (4-way); the",
           "sequence split itself is the training loop's (`accelerator.maybe_context_parallel`), after `prepare`.", ""]
          if "cp" in settings else []),
        f"Produced by `{command}` (see Timings; `--families llama,t5` runs a subset). The default test suite",
        "runs a reduced set that covers every setting and every family kind (`tests/conformance/test_conformance.py`).",
        "Models outside the language-model classes drawn from here (a vision classifier, a CTC speech encoder with a",
        "weight-norm parametrization, two-tower contrastive models, an encoder with tied embeddings) are checked against",
        "a one-process step under `transformer_based_wrap` in `tests/distributed/test_architectures.py`.",
        "",
        f"torch {torch.__version__}, accelerate {accelerate.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        "",
        "## Settings",
        "",
        "| setting | FullyShardedDataParallelPlugin(...) | mixed_precision | loader | ranks | ParallelismConfig(...) |",
        "|---|---|---|---|---|---|",
    ]
    for s in SETTINGS + EXTRA_SETTINGS:
        if s.name in settings:
            kwargs = ", ".join(f"{k}={v!r}" for k, v in s.fsdp_kwargs().items())
            mesh = f"`{', '.join(f'{k}={v}' for k, v in s.parallelism)}`" if s.parallelism else "-"
            lines.append(f"| `{s.name}` | `{kwargs}` | {s.mixed_precision} | {s.loader} | {s.world_size} | {mesh} |")
    lines += ["", "## Results", "", "Each cell: plugin outcome / stock outcome.", "",
              "| family | " + " | ".join(settings) + " |", "|---" * (len(settings) + 1) + "|"]
    for f in families:
        row = []
        for s in settings:
            c = by_key.get((f.name, s))
            row.append("" if c is None else f"{'**FAIL**' if c.outcome == FAIL else c.outcome.split(' ')[0]} / {c.stock}")
        lines.append(f"| {f.name} | " + " | ".join(row) + " |")
    counts = Counter(c.outcome for c in cells)
    kinds = (PASS, REFUSED, FAIL) + ((NOT_RUN,) if counts[NOT_RUN] else ())
    lines += ["", f"**{len(cells)} cells**: " + ", ".join(f"{counts[o]} {o}" for o in kinds), ""]
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
    tp = [c for c in cells if dict(BY_NAME[c.setting].parallelism).get("tp_size", 1) > 1
          and c.facts.get("plugin", {}).get("tp") is not None]
    if tp:
        applied = [c for c in tp if not c.facts["plugin"]["tp"].get("tp_declined")]
        lines += ["## Tensor parallelism: the plan applied or declined", "",
                  f"Of the {len(tp)} `tp` cells the plugin ran, the model's TP plan was applied in {len(applied)} and "
                  f"declined in {len(tp) - len(applied)} (FSDP over `dp_shard` only, as stock does), by reason:", ""]
        lines.append("- applied (modules split over `tp`): " + ", ".join(
            f"`{c.family}` ({c.facts['plugin']['tp'].get('tp_modules')})" for c in applied))
        declined: dict[str, list[str]] = {}
        for c in tp:
            why = c.facts["plugin"]["tp"].get("tp_declined")
            if why:
                kind, detail = _reason_kind(why)
                declined.setdefault(kind, []).append(f"`{c.family}`" + (f" ({detail})" if detail else ""))
        lines += [f"- declined, {kind}: " + ", ".join(names) for kind, names in sorted(declined.items())]
        lines.append("")
    lines += ["## Families", "", "| family | auto class | parameters | kinds |", "|---|---|---|---|"]
    lines += [f"| {f.name} | {f.auto_class} | {f.num_params:,} | {', '.join(f.kinds)} |" for f in families]
    if dropped:
        lines += ["", "Candidates tried and dropped:", ""]
        lines += [f"- `{name}`: {why}" for name, why in dropped.items()]
    lines += ["", "## Timings", ""]
    lines += [f"- {k}: {v}" for k, v in timings.items()]
    return "\n".join(lines) + "\n"
