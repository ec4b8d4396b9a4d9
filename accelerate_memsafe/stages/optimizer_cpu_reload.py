"""``optimizer_cpu_reload``: read the optimizer state in place, straight into CPU tensors; reclaim."""

from __future__ import annotations

from ..distributed.optimizer_offload import OptimizerOffload, move_optimizer_state, reclaim_device_memory
from ..io.optimizer_state import custom_load_reasons, execute_optimizer_load, optimizer_source, plan_optimizer_load
from ..pipeline import HookContext, Stage, StageOutcome, ran, skipped


def _distributed_type() -> str:
    from accelerate.state import AcceleratorState

    return str(getattr(AcceleratorState(), "distributed_type", ""))


class OptimizerCpuReloadStage(Stage):
    """Replaces accelerate's optimizer load. Before accelerate runs, every optimizer file is checked
    (truncated or mismatched files are refused while nothing has changed) and a read plan is made; once
    accelerate has loaded the rest (model, schedulers, dataloaders, RNG), each state tensor is read into
    the optimizer's existing state tensor in place, or into a new CPU tensor (``optimizer_offload``) or
    device tensor; nothing else holds the loaded data, so ``gc.collect()`` plus emptying the device cache
    reclaim everything a stock load would leave behind.

    An optimizer that customises loading (its class overrides ``load_state_dict``, or load-state-dict
    pre/post hooks are registered) gets its own ``load_state_dict`` called with the tensors already read,
    so the override and hooks run as with a stock load; the report's ``custom_load_state_dict`` says which
    optimizers and why. torch then puts the state on the parameters' device; with ``optimizer_offload``
    it is moved back to CPU right after.
    """

    name = "optimizer_cpu_reload"
    hooks = ("load_state",)
    summary = "read optimizer state in place / straight to CPU, drop the loaded dicts, reclaim device memory"

    def skip_reason(self, ctx: HookContext) -> str | None:
        if ctx.directory is None:
            return "no input directory given"
        if not ctx.optimizers:
            return "no prepared optimizer"
        dtype = _distributed_type()
        if "DEEPSPEED" in dtype or "MEGATRON" in dtype:
            return f"{dtype} saves the optimizer itself"
        if "FSDP" in dtype and not ctx.is_fsdp2:
            return "FSDP1 optimizer state is flattened; accelerate loads it"
        return None

    def run(self, ctx: HookContext) -> StageOutcome:
        plans = []
        for i, optimizer in enumerate(ctx.optimizers):
            source = optimizer_source(ctx.directory, i)
            if source is None:
                return skipped(f"no accelerate optimizer file for optimizer {i} in {ctx.directory}; accelerate loads it")
            model = ctx.models[i] if i < len(ctx.models) else None
            plans.append(plan_optimizer_load(optimizer, source, model=model, offload=ctx.options.optimizer_offload,
                                             weights_only=ctx.scratch.get("load_kwargs", {}).get("weights_only") is not False))
        ctx.scratch["optimizer_plans"] = plans
        ctx.scratch["upstream_skips_optimizers"] = True
        return ran(
            optimizers=len(plans),
            formats=sorted({p.kind for p in plans}),
            state_bytes=sum(p.bytes for p in plans),
            largest_state_tensor_bytes=max(p.largest for p in plans),
        )

    def after(self, ctx: HookContext) -> StageOutcome:
        plans = ctx.scratch.pop("optimizer_plans")
        totals = {"bytes_read": 0, "in_place_bytes": 0, "new_bytes": 0, "tensors": 0, "load_state_dict_calls": 0,
                  "dcp_loads": 0, "dcp_metadata_reads": 0}
        custom = {}
        for i, plan in enumerate(plans):
            optimizer = plan.optimizer
            reasons = custom_load_reasons(optimizer)
            if reasons:
                custom[f"optimizer {i} ({type(optimizer).__name__})"] = "; ".join(reasons)
            for k, v in execute_optimizer_load(plan, progress=self.options.progress, rank=ctx.rank).items():
                totals[k] += v
            if reasons and ctx.options.optimizer_offload:
                offload = OptimizerOffload.installed(optimizer)
                if offload is not None:
                    offload.offload()
                else:
                    move_optimizer_state(optimizer, "cpu")
        del plans
        reclaimed = reclaim_device_memory(ctx.device)
        extra = {"custom_load_state_dict": custom} if custom else {}
        return ran(**totals, reclaimed_device_bytes=reclaimed["reclaimed_bytes"], **extra)
