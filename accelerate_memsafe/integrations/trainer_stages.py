"""The plugin's checkpoint stages for the ``transformers.Trainer``'s own save and load paths.

The Trainer never calls ``accelerator.save_state`` / ``load_state``: it writes and reads its checkpoints
itself (``Trainer._save_checkpoint``, ``_load_from_checkpoint``, ``_load_best_model``,
``_load_optimizer_and_scheduler``). The stages below give those paths what the plugin's stages of the same
name give accelerate's, and run through the same :class:`~accelerate_memsafe.pipeline.Pipeline` (memory
probe, one record per stage and rank, errors on one rank reaching the others):

- ``atomic_checkpoint`` (``save_state``): the checkpoint is written into a temporary directory and renamed
  into place once every rank is done; ``save_total_limit`` rotation runs after that
  (:mod:`~accelerate_memsafe.integrations.trainer_checkpoints`).
- ``optimizer_cpu_reload`` (``load_state``): the optimizer state is checked, then read in place straight into
  CPU (or the parameters') tensors; stale device memory is reclaimed.
- ``peft_cpu_reload`` (``load_state``): PEFT adapters are reloaded CPU-first and in place (only each rank's
  shard under FSDP2), for resume and for ``load_best_model_at_end``.

A stage runs only where the plugin enables the stage of the same name (``MemSafePlugin(stages=[])`` gives
the stock Trainer). The Trainer's own method is the pipeline's upstream call; its record is named after it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..distributed.collectives import Collectives
from ..distributed.optimizer_offload import reclaim_device_memory
from ..io.optimizer_state import execute_optimizer_load, optimizer_source, plan_optimizer_load
from ..memory.report import MemoryReport
from ..pipeline import HookContext, Pipeline, Stage, StageOutcome, ran, skipped
from . import trainer_checkpoints

#: The Trainer's optimizer file when it saves without FSDP/DeepSpeed (``transformers.trainer.OPTIMIZER_NAME``).
TRAINER_OPTIMIZER_NAME = "optimizer.pt"
#: The Trainer's scheduler file (``transformers.trainer.SCHEDULER_NAME``).
TRAINER_SCHEDULER_NAME = "scheduler.pt"


def _collectives(stage: str, ctx: HookContext) -> Collectives | None:
    import torch.distributed as dist

    if ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
        return Collectives(stage, timeout_s=ctx.options.collective_timeout_s)
    return None


class TrainerCheckpointStage(Stage):
    """``Trainer._save_checkpoint`` made atomic: rank 0 links ``checkpoint-<step>`` to a temporary directory
    (:func:`~accelerate_memsafe.integrations.trainer_checkpoints.begin`), every rank writes through it, then
    rank 0 commits it and only then rotates older checkpoints out (``save_total_limit``). Barriers before the
    writes, after them and after the commit, under ``collective_timeout_s``.

    ``ctx.directory`` is the final checkpoint directory; ``ctx.scratch["trainer_rotation"]`` holds
    ``(save_total_limit, best_model_checkpoint getter)``.
    """

    name = "atomic_checkpoint"
    hooks = ("save_state",)
    summary = "Trainer checkpoints: written under a temporary name, fsynced, renamed into place; rotation after"

    def skip_reason(self, ctx: HookContext) -> str | None:
        return ctx.scratch.get("trainer_skip_atomic")  # decided by the Trainer's arguments: the same on every rank

    def run(self, ctx: HookContext) -> StageOutcome:
        final = Path(ctx.directory)
        temp = trainer_checkpoints.begin(final) if ctx.rank == 0 else None
        coll = _collectives(self.name, ctx)
        if coll is not None:
            coll.barrier(what=f"barrier before writing {final}")
        ctx.scratch["trainer_checkpoint"] = (final, temp, coll)
        return ran(final=str(final), temp=str(temp) if temp else None)

    def after(self, ctx: HookContext) -> StageOutcome:
        final, temp, coll = ctx.scratch.pop("trainer_checkpoint")
        if coll is not None:
            coll.barrier(what=f"barrier after every rank wrote its files into {final}")
        details: dict[str, Any] = {}
        if ctx.rank == 0:
            marker = trainer_checkpoints.commit(final, temp, world_size=ctx.world_size)
            limit, best = ctx.scratch.get("trainer_rotation", (None, lambda: None))
            deleted = trainer_checkpoints.rotate(final.parent, limit, keep=final, best=best())
            details = {"files": len(marker["files"]), "bytes": sum(marker["files"].values()),
                       "deleted": [str(p) for p in deleted]}
        if coll is not None:
            coll.barrier(what=f"barrier after {final} was put in place")
        return ran(**details)


class TrainerOptimizerReloadStage(Stage):
    """``Trainer._load_optimizer_and_scheduler`` with the optimizer read in place, CPU-first: ``run`` checks
    the file against the optimizer (nothing changes if it does not match); the Trainer's call then loads only
    the scheduler; ``after`` reads each state tensor into its destination and reclaims device memory.

    ``ctx.scratch["trainer_optimizer"]`` is the (unwrapped) torch optimizer, ``ctx.model`` the prepared model.
    """

    name = "optimizer_cpu_reload"
    hooks = ("load_state",)
    summary = "Trainer resume: optimizer state read in place / straight to CPU, device memory reclaimed"

    def skip_reason(self, ctx: HookContext) -> str | None:
        return ctx.scratch.get("trainer_skip_optimizer")

    def run(self, ctx: HookContext) -> StageOutcome:
        optimizer = ctx.scratch["trainer_optimizer"]
        directory = Path(ctx.directory)
        if ctx.is_fsdp2:
            source = optimizer_source(directory, 0)
        else:
            file = directory / TRAINER_OPTIMIZER_NAME
            source = ("torch_file", file) if file.is_file() else None
        if source is None:
            return skipped(f"no optimizer file in {directory} that this stage reads; the Trainer loads it")
        if not (directory / TRAINER_SCHEDULER_NAME).is_file():
            return skipped(f"no {TRAINER_SCHEDULER_NAME} in {directory}: the Trainer loads neither")
        plan = plan_optimizer_load(optimizer, source, model=ctx.model if ctx.is_fsdp2 else None,
                                   offload=ctx.options.optimizer_offload)
        ctx.scratch["trainer_optimizer_plan"] = plan
        return ran(file=str(source[1]), format=plan.kind, state_bytes=plan.bytes, largest_state_tensor_bytes=plan.largest)

    def after(self, ctx: HookContext) -> StageOutcome:
        plan = ctx.scratch.pop("trainer_optimizer_plan")
        totals = execute_optimizer_load(plan, progress=self.options.progress, rank=ctx.rank)
        del plan
        reclaimed = reclaim_device_memory(ctx.device)
        return ran(**totals, reclaimed_device_bytes=reclaimed["reclaimed_bytes"])


class TrainerAdapterReloadStage(Stage):
    """``Trainer._load_from_checkpoint`` / ``_load_best_model`` for PEFT adapters: every adapter saved in the
    checkpoint is reloaded CPU-first, tensor by tensor, in place (only this rank's shard under FSDP2), and
    the Trainer's own load is skipped. ``ctx.scratch["trainer_adapter_reload"]`` is a function doing the
    reload and returning the stats, or the reason it does not apply."""

    name = "peft_cpu_reload"
    hooks = ("load_state",)
    summary = "Trainer resume / best model: PEFT adapters reloaded CPU-first, in place"

    def run(self, ctx: HookContext) -> StageOutcome:
        outcome = ctx.scratch["trainer_adapter_reload"]()
        if isinstance(outcome, str):
            return skipped(outcome)
        ctx.skip_upstream = "adapters reloaded CPU-first"
        return ran(
            files=[s.file for s in outcome],
            tensors=sum(s.tensors for s in outcome), bytes=sum(s.bytes for s in outcome),
            largest_tensor_bytes=max(s.largest_tensor_bytes for s in outcome), device=outcome[0].device,
        )


#: The Trainer stages by hook, in run order; each runs where the plugin enables the stage of its name.
TRAINER_STAGES: dict[str, tuple[type[Stage], ...]] = {
    "save_state": (TrainerCheckpointStage,),
    "load_state": (TrainerAdapterReloadStage, TrainerOptimizerReloadStage),
}


def trainer_pipeline(plugin: Any, hook: str, names: tuple[str, ...] | None = None) -> Pipeline:
    """The Trainer stages of ``hook`` that ``plugin`` enables (optionally only those in ``names``), writing into
    the plugin's report.

    Example:
        >>> from accelerate_memsafe import MemSafePlugin
        >>> trainer_pipeline(MemSafePlugin(), "save_state").names("save_state")
        ('atomic_checkpoint',)
        >>> trainer_pipeline(MemSafePlugin(stages=[]), "save_state").names("save_state")
        ()
    """
    enabled = set(plugin.stage_names(hook))
    stages = tuple(cls(plugin) for cls in TRAINER_STAGES.get(hook, ())
                   if cls.name in enabled and (names is None or cls.name in names))
    pipeline = Pipeline({hook: stages}, plugin.report, track_tensors=plugin.track_live_tensors,
                        sample_interval_s=plugin.memory_sample_interval_s, trim_heap=plugin.memory_trim_heap,
                        probe_hooks_without_stages=plugin.probe_hooks_without_stages)
    pipeline.origin = plugin.pipeline.origin  # one time axis for the whole report (start_s, timelines)
    return pipeline


def run_trainer_hook(pipeline: Pipeline, ctx: HookContext, upstream: Callable[[HookContext], Any], upstream_name: str) -> Any:
    """Runs ``pipeline`` at ``ctx.hook`` around the Trainer's own method ``upstream`` and names its record
    ``upstream_name`` (the pipeline calls every upstream ``accelerate.<hook>``).

    Returns:
        What ``upstream`` returned.
    """
    report: MemoryReport = pipeline.report
    first = len(report.records)
    try:
        return pipeline.run(ctx, upstream)
    finally:
        for record in report.records[first:]:
            if record.stage == f"accelerate.{ctx.hook}":
                record.stage = upstream_name
