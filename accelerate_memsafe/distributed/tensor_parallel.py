"""Tensor parallelism in the plugin's FSDP2 prepare: the model's own TP plan (transformers' ``_tp_plan``,
from ``config.base_model_tp_plan``), applied with torch's ``parallelize_module`` over the ``tp`` mesh
dimension while the weights are on ``meta``, before activation checkpointing and ``fully_shard`` (torchtitan's
order). ``rank0_distribute`` then sends each rank the block its 2-D placements give it.

Styles are mapped to torch's: ``colwise`` -> ``ColwiseParallel()``, ``rowwise`` -> ``RowwiseParallel()``,
``colwise_gather_output`` -> ``ColwiseParallel(output_layouts=Replicate())``, ``embedding_rowwise`` ->
``RowwiseParallel(input_layouts=Replicate())``. A plan with any other style (packed, MoE experts, sequence
parallel) is declined with its reason, and so is a module whose parameter is tied to another module's
(``parallelize_module`` would give the two modules different parameters): those stay replicated over ``tp``.

A plan is only as good as the model's code: transformers' plan for Doge splits the attention's heads but not the
per-head parameter its forward multiplies them with, and NeoMME's adds full-width value embeddings to split values.
Before a plan is applied, :func:`tp_plan_problem` runs the model's forward once on ``meta`` (no memory, no compute)
with each planned module at the shape one rank holds, as ``parallelize_module`` leaves it (torch's styles hand the
module's neighbours plain local tensors); a plan the forward does not run with is declined with the error, and so
is one it cannot check (a forward that fails on ``meta`` without the split too). With a declined plan the ``shard``
stage shards over ``dp_shard`` only, as accelerate's own ``prepare`` does with a model no plan split.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


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
    named, tied, problem = _planned_styles(model)
    if problem:
        return {}, tied, problem
    styles = _torch_styles()
    return {name: styles[style]() for name, style in named.items()}, tied, None


def _planned_styles(model: torch.nn.Module) -> tuple[dict[str, str], list[str], str | None]:
    """:func:`resolve_tp_plan` with transformers' style names (module name -> ``"colwise"`` ...)."""
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
    out: dict[str, str] = {}
    tied: list[str] = []
    for name, mod in model.named_modules():
        style = next((v for rx, v in patterns if rx.fullmatch(name)), None)
        if style is None:
            continue
        if any(owners[id(p)] > 1 for p in mod._parameters.values() if p is not None):
            tied.append(name)
            continue
        out[name] = style
    if not out:
        return {}, tied, "the model's TP plan matches none of its (untied) modules"
    return out, tied, None


#: model -> ((tp, its planned modules), the verdict of :func:`tp_plan_problem`): the ``shard`` stage asks it in the
#: preflight (its announcement) and again when it shards; the forward on ``meta`` runs once.
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tp_plan_problem(model: torch.nn.Module, tp: int) -> str | None:
    """Why the model's TP plan cannot be applied over ``tp`` ranks (``None``: it can): :func:`resolve_tp_plan`'s
    problem, else what :func:`rehearse_tp_plan` found. A function of the model's structure and ``tp`` only (the
    ``shard`` stage still agrees on it: no rank applies a plan that another declined).

    Example:
        >>> tp_plan_problem(torch.nn.Linear(2, 2), 2)
        "the model has no tensor-parallel plan (transformers' `_tp_plan`, from `config.base_model_tp_plan`)"
    """
    named, _, problem = _planned_styles(model)
    if problem:
        return problem
    key = (tp, tuple(named.items()))
    try:
        seen = _VERDICTS.get(model)
    except TypeError:  # pragma: no cover - a module that cannot be weakly referenced
        seen = None
    if seen is not None and seen[0] == key:
        return seen[1]
    verdict = rehearse_tp_plan(model, named, tp)
    with contextlib.suppress(TypeError):
        _VERDICTS[model] = (key, verdict)
    return verdict


def rehearse_tp_plan(model: torch.nn.Module, planned: dict[str, str], tp: int) -> str | None:
    """Runs ``model``'s forward on ``meta`` with each module of ``planned`` (name -> transformers style) at the
    shape one of ``tp`` ranks holds once ``parallelize_module`` applied torch's style: ``colwise`` keeps
    ``out_features / tp`` rows of a linear (``embedding_dim / tp`` columns of an embedding) and hands on its part of
    the output, ``rowwise`` takes ``in_features / tp`` inputs and hands on the whole output (its all-reduce), the
    others hand on whole outputs. Every distinct set of rank shapes is run (uneven splits give two). The model is
    not touched: the forward runs on a copy whose tensors are all on ``meta``, fed ``model.dummy_inputs``.

    Returns:
        Why the plan cannot be applied (the forward fails with the split, or cannot be checked: no
        ``dummy_inputs``, or a forward that fails on ``meta`` without the split too), or ``None``.

    Example:
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.up = torch.nn.Linear(4, 8); self.scale = torch.nn.Parameter(torch.ones(8))
        ...     dummy_inputs = property(lambda self: {"x": torch.ones(2, 4)})
        ...     def forward(self, x):
        ...         return self.up(x) * self.scale  # the scale is not split with `up`'s outputs
        >>> rehearse_tp_plan(Net(), {"up": "colwise"}, 2).split(":")[0]
        "the model's forward does not run with its TP plan split over tp=2 (rank 0's shapes, on `meta`)"
    """
    for name in planned:
        mod = model.get_submodule(name)
        if not isinstance(mod, (nn.Linear, nn.Embedding)):
            return (f"the TP plan names `{name}`, a {type(mod).__name__}: torch's styles apply to `nn.Linear` and "
                    "`nn.Embedding` only")
    inputs = getattr(model, "dummy_inputs", None)
    if not isinstance(inputs, dict) or not inputs or not all(isinstance(v, torch.Tensor) for v in inputs.values()):
        return "the plugin could not check the TP plan against the model's forward: the model has no `dummy_inputs`"
    inputs = {k: torch.empty_like(v, device="meta") for k, v in inputs.items()}
    layouts: dict[tuple, int] = {}
    for rank in range(tp):
        layouts.setdefault(tuple(_local_shape(model.get_submodule(n), s, tp, rank) for n, s in planned.items()), rank)
    unchecked = None
    # fp32 first (the model's own dtypes), then bf16: torch's grouped matmul (transformers' MoE experts) runs on
    # `meta` with bf16 inputs only, and a dtype changes no shape
    for dtype in (None, torch.bfloat16):
        failed = next(((rank, why) for shapes, rank in layouts.items()
                       if (why := _meta_forward(model, inputs, dtype, dict(zip(planned, shapes)))) is not None), None)
        if failed is None:
            return None
        whole = _meta_forward(model, inputs, dtype, {})  # the plan, or the forward on `meta`? The whole model tells
        if whole is None:
            return (f"the model's forward does not run with its TP plan split over tp={tp} (rank {failed[0]}'s shapes, "
                    f"on `meta`): {failed[1]}")
        unchecked = unchecked or whole
    return (f"the plugin could not check the TP plan against the model's forward: it fails on `meta` without the "
            f"split too ({unchecked})")


def _meta_forward(model: nn.Module, inputs: dict[str, torch.Tensor], dtype: torch.dtype | None,
                  shapes: dict[str, tuple]) -> str | None:
    """Why ``model``'s forward fails on a ``meta`` copy (floating tensors as ``dtype``, or their own) whose modules
    named in ``shapes`` hold those (weight, bias) shapes; ``None`` when it runs."""
    try:  # the copy too: a model holding what cannot be copied (a lock, a process group) cannot be checked
        skeleton = _meta_copy(model, dtype)
        for name, shape in shapes.items():
            _hold(skeleton.get_submodule(name), shape)
        if dtype is not None:
            inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        with _quiet():
            skeleton(**inputs)
    except Exception as exc:
        return _first_line(exc)
    return None


def _local_shape(mod: nn.Module, style: str, tp: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The (weight, bias) shapes ``rank`` holds of ``mod`` under ``style`` (torch's ``Shard``: the first
    ``n % tp`` ranks hold one row more)."""

    def part(n: int) -> int:
        return n // tp + (1 if rank < n % tp else 0)

    weight = tuple(mod.weight.shape)
    bias = tuple(mod.bias.shape) if getattr(mod, "bias", None) is not None else None
    if isinstance(mod, nn.Linear) and style == "colwise":
        return (part(weight[0]), weight[1]), (None if bias is None else (part(bias[0]),))
    if isinstance(mod, nn.Linear) and style == "rowwise":
        return (weight[0], part(weight[1])), bias
    if isinstance(mod, nn.Embedding) and style == "colwise":
        return (weight[0], part(weight[1])), bias
    return weight, bias  # embedding_rowwise, colwise_gather_output: the module hands on whole outputs


def _hold(mod: nn.Module, shapes: tuple[tuple[int, ...], tuple[int, ...] | None]) -> None:
    weight, bias = shapes
    mod.weight = nn.Parameter(torch.empty(weight, dtype=mod.weight.dtype, device="meta"), requires_grad=False)
    if bias is not None:
        mod.bias = nn.Parameter(torch.empty(bias, dtype=mod.bias.dtype, device="meta"), requires_grad=False)


def _meta_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on ``meta`` (the model's own tensors are not copied),
    the floating ones as ``dtype`` where one is given."""
    memo: dict[int, Any] = {}
    for mod in model.modules():
        for tensors in (mod._parameters, mod._buffers):
            for t in tensors.values():
                if t is not None and id(t) not in memo:
                    cast = dtype if dtype is not None and t.is_floating_point() else t.dtype
                    meta = torch.empty_like(t, device="meta", dtype=cast)
                    memo[id(t)] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No gradients, and none of the warnings the rehearsal's forward gives (transformers' logger included)."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:300]}"


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh: Any, plan: dict[str, Any]) -> None:
    """``parallelize_module(model, tp_mesh, plan)``: on ``meta`` weights this allocates nothing."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, plan)
