"""The worker: one spawn of 2 gloo ranks runs the cells (settings) of one family, or of a few.

Each cell runs the plugin's prepare (``MemSafePlugin()``) and then stock accelerate's
(``MemSafePlugin(stages=[])``), both through ``accelerate_memsafe.Accelerator`` on the same process group, which
the first Accelerator creates and every later one reuses (the accelerate state is reset in between).
Rank 0 gathers what every rank saw, compares it with the reference (or, under bf16, with stock), and
appends JSON lines to the progress file as it goes, so that a hang or a crash loses only the cell (and
the path) it happened in.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import time
import warnings
from typing import Any

import torch

from .families import Family, full_state, make_batch, tie_groups
from .settings import BY_NAME, Setting

#: Tolerance of the loss against the reference (fp32) or against stock: float reassociation only.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
#: Tolerance of a bf16 loss against the fp32 reference (used only when stock did not run).
BF16_LOSS_TOL = {"rtol": 2e-2, "atol": 2e-2}
#: How long a rank waits for the other at the end of a path before the ranks are declared out of step.
SYNC_TIMEOUT = datetime.timedelta(seconds=60)
#: How many tensor names a problem lists.
MAX_NAMES = 4


def run_cells(rank: int, world_size: int, *, jobs: list[tuple[Family, list[str]]], progress: str) -> None:
    """Runs each job's cells (family, setting names) in order; rank 0 appends each cell's facts to ``progress``."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for family, settings in jobs:
        reference = torch.load(family.reference, weights_only=False) if rank == 0 else None
        for name in settings:
            setting = BY_NAME[name]
            cell = {"family": family.name, "setting": name}
            _log(rank, progress, {"event": "start", **cell})
            plugin = _gather(_run_path(family, setting, stages=None))
            if rank == 0:  # judged again below against stock; this record survives a crash in the stock path
                _log(rank, progress, {"event": "plugin", **cell, "plugin": _judge(plugin, reference, setting, baseline=None)})
            stock = _gather(_run_path(family, setting, stages=[]))
            if rank == 0:
                facts = {"plugin": _judge(plugin, reference, setting, baseline=stock),
                         "stock": _judge(stock, reference, setting, baseline=None)}
                _log(rank, progress, {"event": "done", **cell, **facts})


def _log(rank: int, path: str, record: dict[str, Any]) -> None:
    if rank == 0:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _load(family: Family, loader: str) -> torch.nn.Module:
    import transformers

    import accelerate_memsafe

    auto_cls = getattr(transformers, family.auto_class)
    if loader == "memsafe":
        return accelerate_memsafe.from_pretrained(auto_cls, family.checkpoint)
    return auto_cls.from_pretrained(family.checkpoint)


def _run_path(family: Family, setting: Setting, *, stages: list[str] | None) -> dict[str, Any]:
    """Prepare, gather, forward, one step, on this rank. Never raises: an error is recorded with whether
    any parameter had already become a DTensor (something moved)."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_memsafe import Accelerator, MemSafeError, MemSafePlugin

    start = time.monotonic()
    out: dict[str, Any] = {"error": None}
    model = None
    try:
        fsdp_plugin = FullyShardedDataParallelPlugin(**setting.fsdp_kwargs())
        accelerator = Accelerator(plugins=[MemSafePlugin(stages=stages)], fsdp_plugin=fsdp_plugin,
                                  mixed_precision=setting.mixed_precision)
        model = _load(family, setting.loader)
        ties_before = tie_groups(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        out["prepare_s"] = time.monotonic() - start
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

        lines = str(exc).strip().splitlines()
        out["error"] = {
            "type": type(exc).__name__,
            "message": lines[0] if lines else "",
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


def _gather(out: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Every rank's result on rank 0 (``None`` elsewhere), after checking that every rank got here."""
    import torch.distributed as dist

    if not dist.is_initialized():  # the first Accelerator failed before creating the process group
        return [out]
    dist.monitored_barrier(timeout=SYNC_TIMEOUT)
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(out, gathered, dst=0)
    return gathered


def _judge(per_rank: list[dict[str, Any]], reference: dict[str, Any], setting: Setting,
           baseline: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The facts of one path on rank 0: its error, or the problems found (empty when it conforms).

    Tensors are compared with the reference; under bf16 mixed precision with the stock path's result
    (``baseline``) when stock ran, since that is what the same settings give without the plugin.
    """
    first = per_rank[0]
    facts: dict[str, Any] = {"elapsed": max(r["elapsed"] for r in per_rank), "error": None, "problems": []}
    errors = [(rank, r["error"]) for rank, r in enumerate(per_rank) if r["error"]]
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
    differ = _differ(first["state"], expected_state)
    if differ:
        problems.append(f"{len(differ)} tensor(s) differ from the {facts['compared_to']}: {_names(differ)}")
    tol = BF16_LOSS_TOL if bf16 and not stock else LOSS_TOL
    facts["loss"], facts["loss_diff"] = first["loss"], abs(first["loss"] - expected_loss)
    if not math.isclose(first["loss"], expected_loss, rel_tol=tol["rtol"], abs_tol=tol["atol"]):
        problems.append(f"loss {first['loss']:.7g} vs {facts['compared_to']} {expected_loss:.7g} (diff {facts['loss_diff']:.3g})")
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
