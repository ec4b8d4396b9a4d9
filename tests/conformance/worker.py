"""The worker: one spawn of 2 gloo ranks runs a list of tasks (a family's setting: the plugin path, the
stock path, or both).

The plugin path is ``accelerate_memsafe.Accelerator(plugins=[MemSafePlugin()])``; the stock path is the
same class with ``MemSafePlugin(stages=[])`` (exactly accelerate's own prepare), loading the model as a user of
stock accelerate does (:data:`STOCK_LOADER`: transformers' ``from_pretrained`` where the plugin's path uses
``accelerate_memsafe.from_pretrained``, whose meta weights only the plugin's stages fill). Both run on the process
group the first Accelerator creates; the accelerate state is reset in between. After each path the ranks
swap what they saw through files (:class:`_Exchange`), not through gloo, because after an error one rank
may be left inside a collective: when the ranks' errors differ the spawn ends (the rest, starting with
that cell's other path, runs in the next one). A path that hangs is cut by a watchdog that kills the
spawn's ranks, so a hang costs :data:`PATH_TIMEOUT`, not the whole spawn's timeout.
Rank 0 judges each path against the reference (bf16: against stock; under cp, the loss against the reference's with
the hooks accelerate attaches there) and appends JSON lines to the progress file as it goes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from accelerate_memsafe.errors import message_line

from .families import Family, full_state, make_batch, tie_groups
from .settings import BY_NAME, Setting

#: Tolerance of the loss against the reference (fp32) or against stock: float reassociation only.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
#: Tolerance of a bf16 loss against the fp32 reference (used only when stock did not run).
BF16_LOSS_TOL = {"rtol": 2e-2, "atol": 2e-2}
#: Seconds one path (load, prepare, gather, forward, step, and waiting for the other rank) may take; the
#: first path of a spawn also imports transformers' model code, on 2 shared cores.
PATH_TIMEOUT = 240.0
#: How many tensor names a problem lists.
MAX_NAMES = 4
PATHS = ("plugin", "stock")
#: How the stock path loads every cell's model: transformers' ``from_pretrained`` on every rank, as a script without
#: the plugin does. Where the plugin's path uses ``accelerate_memsafe.from_pretrained`` (rank 1 on meta), that model
#: under ``MemSafePlugin(stages=[])`` is refused (no stage fills the meta weights: ``refuse_unfilled_meta_weights``),
#: which would say nothing about stock accelerate.
STOCK_LOADER = "hf"


@dataclass(frozen=True)
class Task:
    """Paths of one cell to run."""

    family: Family
    setting: str
    paths: tuple[str, ...] = PATHS


class _Exchange:
    """Per-rank results swapped through files after each path (works when the process group does not)."""

    def __init__(self, directory: Path, rank: int, world_size: int) -> None:
        self.dir, self.rank, self.world_size, self.step = directory, rank, world_size, 0
        directory.mkdir(exist_ok=True)
        (directory / f"pid.{rank}").write_text(str(os.getpid()))

    def share(self, out: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``out``, in rank order, once all have written theirs (the watchdog bounds the wait)."""
        self.step += 1
        files = [self.dir / f"{self.step}.{r}.pt" for r in range(self.world_size)]
        tmp = self.dir / f"tmp.{self.rank}"
        torch.save(out, tmp)
        os.replace(tmp, files[self.rank])
        while not all(f.exists() for f in files):
            time.sleep(0.05)
        return [torch.load(f, weights_only=False) for f in files]

    @contextlib.contextmanager
    def watchdog(self, progress: str, record: dict[str, Any]) -> Iterator[None]:
        """Past :data:`PATH_TIMEOUT`, logs ``record`` (an ``abort``) and kills every rank of this spawn:
        a rank that hangs leaves its peer waiting inside a collective, where no other timeout reaches."""

        def expire() -> None:
            _log(progress, record)
            for r in range(self.world_size):
                if r != self.rank:
                    with contextlib.suppress(OSError):
                        os.kill(int((self.dir / f"pid.{r}").read_text()), signal.SIGKILL)
            os._exit(124)

        timer = threading.Timer(PATH_TIMEOUT, expire)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


def run_cells(rank: int, world_size: int, *, tasks: list[Task], progress: str) -> None:
    """Runs ``tasks`` in order. Returns early (after a ``restart`` record) when the ranks' errors differ."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    exchange = _Exchange(Path(progress).with_suffix(".exchange"), rank, world_size)
    references: dict[str, Any] = {}
    for task in tasks:
        family, setting = task.family, BY_NAME[task.setting]
        cell = {"family": family.name, "setting": task.setting}
        if rank == 0 and family.name not in references:
            references = {family.name: torch.load(family.reference, weights_only=False)}
        results = {}
        for path in task.paths:
            if rank == 0:
                _log(progress, {"event": "start", **cell, "path": path})
            hang = f"the {path} path did not finish within {PATH_TIMEOUT:.0f} s on rank {rank} (a hang)"
            with exchange.watchdog(progress, {"event": "abort", **cell, "path": path, "message": hang}):
                results[path] = exchange.share(_run_path(family, setting, stages=None if path == "plugin" else [],
                                                         loader=setting.loader if path == "plugin" else STOCK_LOADER))
            if rank == 0:
                _log(progress, {"event": path, **cell, path: _judge(results[path], references[family.name], setting)})
            if _diverged(results[path]):
                if rank == 0:
                    _log(progress, {"event": "restart", **cell})
                return
        if rank == 0 and len(results) == 2 and setting.mixed_precision != "no":
            plugin = _judge(results["plugin"], references[family.name], setting, baseline=results["stock"])
            _log(progress, {"event": "plugin", **cell, "plugin": plugin})


def _diverged(per_rank: list[dict[str, Any]]) -> bool:
    """Whether the ranks ended a path differently (one may be left with a collective pending)."""
    return len({(r["error"]["type"], r["error"]["message"]) if r["error"] else None for r in per_rank}) > 1


def _log(path: str, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _load(family: Family, loader: str) -> torch.nn.Module:
    import transformers

    import accelerate_memsafe

    auto_cls = getattr(transformers, family.auto_class)
    if loader == "memsafe":
        return accelerate_memsafe.from_pretrained(auto_cls, family.checkpoint)
    return auto_cls.from_pretrained(family.checkpoint)


def _run_path(family: Family, setting: Setting, *, stages: list[str] | None, loader: str) -> dict[str, Any]:
    """Prepare, gather, forward, one step, on this rank. Never raises: an error is recorded with whether
    any parameter had already become a DTensor (something moved)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_memsafe import Accelerator, MemSafeError, MemSafePlugin

    start = time.monotonic()
    out: dict[str, Any] = {"error": None}
    model = None
    try:
        fsdp_plugin = FullyShardedDataParallelPlugin(**setting.fsdp_kwargs())
        extra = {"parallelism_config": setting.parallelism_config()} if setting.parallelism else {}
        accelerator = Accelerator(plugins=[MemSafePlugin(stages=stages)], fsdp_plugin=fsdp_plugin,
                                  mixed_precision=setting.mixed_precision, **extra)
        model = _load(family, loader)
        ties_before = tie_groups(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        out["prepare_s"] = time.monotonic() - start
        out["phase"] = "after prepare"
        if dict(setting.parallelism).get("tp_size", 1) > 1 and stages is None:  # what the plugin did with the TP plan
            shard = [r for r in accelerator.memsafe_plugin.report.records if r.stage == "shard" and r.status == "ran"]
            details = shard[-1].details if shard else {}
            out["tp"] = {k: details[k] for k in ("tp_modules", "tp_declined") if k in details}
        out["ties_before"], out["ties_after"] = ties_before, tie_groups(model)
        out["state"] = full_state(model)
        batch = make_batch(family)
        model.eval()
        with torch.no_grad():
            out["loss"] = model(**batch).loss.float().item()
        model.train()
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
        out["step_finite"] = math.isfinite(loss.item()) and all(bool(torch.isfinite(t).all()) for t in local)
    except Exception as exc:
        from torch.distributed.tensor import DTensor

        out["error"] = {
            "type": type(exc).__name__,
            "message": message_line(exc),
            "memsafe": isinstance(exc, MemSafeError),
            "moved": model is not None and any(isinstance(p, DTensor) for p in model.parameters()),
        }
    out["elapsed"] = time.monotonic() - start
    del model
    _reset_accelerate()
    return out


def _reset_accelerate() -> None:
    """Lets the next ``Accelerator`` start afresh on the same process group."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    gc.collect()


def _judge(per_rank: list[dict[str, Any]], reference: dict[str, Any], setting: Setting,
           baseline: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The facts of one path on rank 0: its error, or the problems found (empty when it conforms).

    Tensors are compared with the reference; under bf16 mixed precision with the stock path's result
    (``baseline``) when stock ran, since that is what the same settings give without the plugin.
    """
    first = per_rank[0]
    facts: dict[str, Any] = {"elapsed": max(r["elapsed"] for r in per_rank), "error": None, "problems": []}
    if "tp" in first:
        facts["tp"] = first["tp"]
    errors = [(rank, r["error"]) for rank, r in enumerate(per_rank) if r["error"]]
    fails = reference.get("loss_cp") if setting.context_parallel else None
    if isinstance(fails, dict) and len(errors) == len(per_rank) and all(
            r.get("phase") == "after prepare" and "state" in r and (r["error"]["type"], r["error"]["message"])
            == (fails["type"], fails["message"]) for r in per_rank):
        # the forward fails under cp's hooks in one process too: prepare is judged (weights, ties), the forward not
        facts["forward_fails_under_cp"] = f"{fails['type']}: {fails['message']}"
        facts["prepare_s"] = max(r["prepare_s"] for r in per_rank)
        for rank, r in enumerate(per_rank):
            differ = _differ(r["state"], reference["state"])
            if differ:
                facts["problems"].append(f"rank {rank}: {len(differ)} tensor(s) differ from the reference: {_names(differ)}")
            if r["ties_after"] != reference["ties"]:
                facts["problems"].append(f"ties on rank {rank} {r['ties_after']} differ from the reference's {reference['ties']}")
        return facts
    if errors:
        rank, error = errors[0]
        facts["error"] = {**error, "rank": rank, "all_ranks": len(errors) == len(per_rank)}
        return facts
    facts["prepare_s"] = max(r["prepare_s"] for r in per_rank)
    problems = facts["problems"]
    for rank, r in enumerate(per_rank[1:], start=1):
        differ = _differ(r["state"], first["state"])
        if differ:
            problems.append(f"rank {rank} disagrees with rank 0 on {_names(differ)}")
        if r["loss"] != first["loss"]:
            problems.append(f"rank {rank} loss {r['loss']!r} != rank 0 loss {first['loss']!r}")
    bf16 = setting.mixed_precision != "no"
    stock = baseline[0] if bf16 and baseline and not any(r["error"] for r in baseline) else None
    expected_state, expected_loss = (stock["state"], stock["loss"]) if stock else (reference["state"], reference["loss"])
    facts["compared_to"] = "stock" if stock else "reference"
    if setting.context_parallel and not stock:  # the reference's loss with the hooks accelerate attaches under cp
        expected_loss = reference["loss_cp"]
        facts["compared_to"] = "reference under cp's hooks"
    differ = _differ(first["state"], expected_state)
    if differ:
        problems.append(f"{len(differ)} tensor(s) differ from the {facts['compared_to']}: {_names(differ)}")
    tol = BF16_LOSS_TOL if bf16 and not stock else LOSS_TOL
    if expected_loss is None:  # accelerate refuses this model under cp, yet this path prepared it
        problems.append("prepared a model accelerate's context parallelism refuses")
    else:
        facts["loss"], facts["loss_diff"] = first["loss"], abs(first["loss"] - expected_loss)
        if not math.isclose(first["loss"], expected_loss, rel_tol=tol["rtol"], abs_tol=tol["atol"]):
            problems.append(f"loss {first['loss']:.7g} vs {facts['compared_to']} {expected_loss:.7g} "
                            f"(diff {facts['loss_diff']:.3g})")
    for rank, r in enumerate(per_rank):
        if r["ties_after"] != r["ties_before"]:
            problems.append(f"ties not kept on rank {rank}: {r['ties_before']} -> {r['ties_after']}")
        elif r["ties_after"] != reference["ties"]:
            problems.append(f"ties on rank {rank} {r['ties_after']} differ from the reference's {reference['ties']}")
        if not r["step_finite"]:
            problems.append(f"backward + AdamW step not finite on rank {rank}")
    return facts


def _differ(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names missing on either side, or whose dtype, shape or bytes differ."""
    names = sorted(set(state) | set(expected))
    return [n for n in names if n not in state or n not in expected or state[n].dtype != expected[n].dtype
            or state[n].shape != expected[n].shape or not torch.equal(state[n], expected[n])]


def _names(names: list[str]) -> str:
    more = f" (+{len(names) - MAX_NAMES} more)" if len(names) > MAX_NAMES else ""
    return ", ".join(names[:MAX_NAMES]) + more
