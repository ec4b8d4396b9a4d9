"""``optimizer_offload``: keep optimizer state on CPU between steps (``MemSafePlugin(optimizer_offload=True)``)."""

from __future__ import annotations

import torch

from ..distributed.optimizer_offload import OptimizerOffload, state_bytes
from ..pipeline import HookContext, Stage, StageOutcome, ran

_OFF = "`optimizer_offload` is off"


class OptimizerOffloadStage(Stage):
    """Once accelerate's ``prepare`` returned, installs step hooks on each prepared optimizer that bring its
    state to the device for ``step()`` and back to (pinned) CPU tensors after it."""

    name = "optimizer_offload"
    hooks = ("prepare",)
    summary = "optimizer state on CPU between steps (optimizer_offload=True)"

    def fixed_skip_reason(self, ctx: HookContext) -> str | None:
        return None if ctx.options.optimizer_offload else _OFF

    def skip_reason(self, ctx: HookContext) -> str | None:
        if not ctx.options.optimizer_offload:
            return _OFF
        if not ctx.optimizers:
            return "no optimizer passed to prepare"
        return None

    def run(self, ctx: HookContext) -> StageOutcome:
        return ran()

    def after(self, ctx: HookContext) -> StageOutcome:
        installed = []
        for optimizer in ctx.optimizers:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            local = params[0].to_local() if params and hasattr(params[0], "to_local") else (params[0] if params else None)
            device = local.device if local is not None else torch.device("cpu")
            installed.append(OptimizerOffload.install(optimizer, device))
        return ran(
            optimizers=len(installed),
            step_device=str(installed[0].device) if installed else None,
            moves_state=any(o.active for o in installed),
            cpu_state_bytes=sum(state_bytes(o, "cpu") for o in ctx.optimizers),
        )
