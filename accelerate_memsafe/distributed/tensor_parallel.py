"""Tensor parallelism in the plugin's FSDP2 prepare: the model's own TP plan (transformers' ``_tp_plan``,
from ``config.base_model_tp_plan``), applied with torch's ``parallelize_module`` over the ``tp`` mesh
dimension while the weights are on ``meta``, before activation checkpointing and ``fully_shard`` (torchtitan's
order). ``rank0_distribute`` then sends each rank the block its 2-D placements give it.

Styles are mapped to torch's: ``colwise`` -> ``ColwiseParallel()``, ``rowwise`` -> ``RowwiseParallel()``,
``colwise_gather_output`` -> ``ColwiseParallel(output_layouts=Replicate())``, ``embedding_rowwise`` ->
``RowwiseParallel(input_layouts=Replicate())``. A plan with any other style (packed, MoE experts, sequence
parallel) is declined with its reason, and so is a module whose parameter is tied to another module's
(``parallelize_module`` would give the two modules different parameters): those stay replicated over ``tp``.
"""

from __future__ import annotations

import re
from typing import Any

import torch


def _torch_styles() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }


def model_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's TP plan as transformers builds it (module pattern -> style; ``*`` is one name part).

    Example:
        >>> model_tp_plan(torch.nn.Linear(2, 2))
        {}
    """
    plan = getattr(model, "_tp_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def resolve_tp_plan(model: torch.nn.Module) -> tuple[dict[str, Any], list[str], str | None]:
    """Matches the model's TP plan against its modules.

    Returns:
        ``(plan, kept_replicated, problem)``: module name -> torch ``ParallelStyle``; the modules the plan
        names but which stay replicated over ``tp`` (tied parameters); why the plan cannot be applied
        (``None`` when it can).

    Example:
        >>> resolve_tp_plan(torch.nn.Linear(2, 2))[2]
        "the model has no tensor-parallel plan (transformers' `_tp_plan`, from `config.base_model_tp_plan`)"
    """
    plan = model_tp_plan(model)
    if not plan:
        return {}, [], "the model has no tensor-parallel plan (transformers' `_tp_plan`, from `config.base_model_tp_plan`)"
    styles = _torch_styles()
    unknown = sorted({s for s in plan.values() if s not in styles})
    if unknown:
        return {}, [], (f"the model's TP plan uses style(s) {unknown}, which the plugin does not map to torch's "
                        f"(it maps {sorted(styles)})")
    owners: dict[int, int] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    patterns = [(re.compile(k.replace(".", r"\.").replace("*", r"[^.]+")), v) for k, v in plan.items()]
    out: dict[str, Any] = {}
    tied: list[str] = []
    for name, mod in model.named_modules():
        style = next((v for rx, v in patterns if rx.fullmatch(name)), None)
        if style is None:
            continue
        if any(owners[id(p)] > 1 for p in mod._parameters.values() if p is not None):
            tied.append(name)
            continue
        out[name] = styles[style]()
    if not out:
        return {}, tied, "the model's TP plan matches none of its (untied) modules"
    return out, tied, None


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, plan: dict[str, Any]) -> None:
    """``parallelize_module(model, tp_mesh, plan)``: on ``meta`` weights this allocates nothing."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, plan)
