"""``shard``: apply FSDP2's ``fully_shard`` the way accelerate would, before accelerate's ``prepare``."""

from __future__ import annotations

import warnings
from typing import Any

from ..distributed.local_read import MappedParameterPages
from ..distributed.sharding import fsdp2_prepare_skip_reason, shard_model
from ..pipeline import ANNOUNCED_KEY, HookContext, Stage, StageOutcome, ran
from .meta_placement import IN_PLACE_KEY


def announced_tp_problem(ctx: HookContext) -> tuple[bool, str | None]:
    """``(complete, problem)`` from every rank's verdict on the TP plan in the preflight's announcements: whether
    every rank announced one, and why the plan is declined (``None``: every rank applies it), the same on every rank."""
    verdicts = ctx.scratch.get(ANNOUNCED_KEY, {}).get(ShardStage.name)
    if verdicts is None or len(verdicts) != ctx.world_size or any(v is None for v in verdicts):
        return False, None
    return True, _declined(verdicts)


def _declined(verdicts: list) -> str | None:
    """Why the TP plan is declined from every rank's ``("tp", problem)`` verdict (``None``: no rank declined it)."""
    problems = [(r, v[1]) for r, v in enumerate(verdicts) if v[1]]
    if not problems:
        return None
    rank, problem = problems[0]
    return problem if len(problems) == len(verdicts) else f"rank {rank}: {problem}"


class ShardStage(Stage):
    """Wraps the model with ``fully_shard`` (accelerate's wrap policy, mixed precision and offload
    settings) and points the optimizers at the sharded parameters; accelerate's ``prepare`` then finds an
    already-sharded model and does the rest (optimizer wrapping, dataloaders, schedulers). With
    ``tp_size > 1`` the model's own TP plan is applied first, on ``meta``; a plan that cannot be applied (none, a
    style torch has no counterpart of, or one the model's forward does not run with) is declined with a warning,
    and FSDP shards over ``dp_shard`` only, as accelerate's own ``prepare`` does then.
    """

    name = "shard"
    hooks = ("prepare",)
    summary = "apply fully_shard with accelerate's policy; remap optimizers"

    def fixed_skip_reason(self, ctx: HookContext) -> str | None:
        return None if ctx.is_fsdp2 else fsdp2_prepare_skip_reason(is_fsdp2=False, model=None)

    def skip_reason(self, ctx: HookContext) -> str | None:
        return fsdp2_prepare_skip_reason(is_fsdp2=ctx.is_fsdp2, model=ctx.model,
                                         parallelism_config=ctx.scratch.get("parallelism_config"))

    def announce(self, ctx: HookContext) -> Any:
        """With ``tp_size > 1``: this rank's verdict on the model's TP plan (``("tp", None)``: it applies; else why
        not, :func:`~accelerate_memsafe.distributed.tensor_parallel.tp_plan_problem`), sent with the preflight
        exchange so that every rank applies the plan or none does (:meth:`run` declines it if any rank did)."""
        tp = ctx.parallel_size("tp_size")
        if tp < 2 or self.skip_reason(ctx) is not None:
            return None
        from ..distributed.tensor_parallel import tp_plan_problem

        return ("tp", tp_plan_problem(ctx.model, tp))

    def _agreed_tp_problem(self, ctx: HookContext, tp: int) -> str | None:
        """Why the TP plan is declined, from every rank's verdict (the preflight's announcements, else one
        all-gather here): the same on every rank."""
        complete, problem = announced_tp_problem(ctx)
        if complete:
            return problem
        from ..distributed.collectives import Collectives
        from ..distributed.tensor_parallel import tp_plan_problem

        mine = ("tp", tp_plan_problem(ctx.model, tp))
        verdicts = [mine] if ctx.world_size < 2 else Collectives(
            self.name, timeout_s=self.options.collective_timeout_s).all_gather_object(
            mine, what="all_gather of each rank's verdict on the model's TP plan")
        return _declined(verdicts)

    def run(self, ctx: HookContext) -> StageOutcome:
        tp = ctx.parallel_size("tp_size")
        tp_details = {}
        problem = None
        if tp > 1:
            from ..distributed.tensor_parallel import resolve_tp_plan

            plan, tied, _ = resolve_tp_plan(ctx.model)
            problem = self._agreed_tp_problem(ctx, tp)
            if problem is None:
                tp_details = {"tp_size": tp, "tp_modules": len(plan), **({"tp_kept_replicated": tied} if tied else {})}
            else:  # sharded over `dp_shard` only, as accelerate's own prepare does then: said where the user looks
                tp_details = {"tp_size": tp, "tp_modules": 0, "tp_declined": problem}
                if ctx.rank == 0:
                    warnings.warn(
                        f"accelerate_memsafe: tensor parallelism (parallelism_config.tp_size={tp}) is not applied: "
                        f"{problem}. The model is sharded with FSDP over `dp_shard` only and each group of {tp} ranks "
                        "along `tp` holds the same shards, as accelerate's own `prepare` does with a model no TP plan "
                        "split.", stacklevel=2)
            # accelerate's own TP pass must not touch the sharded model (its `ReplicateParallel` is gone in
            # transformers 5.x): the plugin has sharded it, with or without the plan
            ctx.scratch["tensor_parallel"] = True
        # weights left in place (every one an unmodified view of the mapped checkpoint, on every rank): with
        # `drop_file_pages`, each group's file pages leave this rank's RSS once fully_shard has copied its rows
        in_place = bool(ctx.scratch.get(IN_PLACE_KEY))
        pages = MappedParameterPages(ctx.model) if in_place and self.options.drop_file_pages else None
        timings: dict[str, float] = {}
        counts: dict[str, int] = {}
        wrap: dict = {}
        ctx.model = shard_model(
            ctx.model,
            ctx.optimizers,
            fsdp_plugin=ctx.fsdp_plugin,
            mixed_precision=ctx.mixed_precision,
            mesh=ctx.mesh,
            parallelism_config=ctx.scratch.get("parallelism_config"),
            is_main_process=ctx.rank == 0,
            device=ctx.device,
            on_group=pages.formed if pages is not None else None,
            timings=timings,
            counts=counts,
            details=wrap,
            tp_declined=problem,
        )
        ctx.scratch["sharded"] = True
        dropped = {"file_pages_dropped_bytes": pages.bytes_dropped} if pages is not None else {}
        # the walls of accelerate's own wrapping and of freeing the unsharded weights (a stock `prepare` runs both too),
        # and the part of the wrapping spent in the plugin's callbacks: the rest of the stage is the plugin's own work
        return ran(**counts, world_size=ctx.world_size,
                   fsdp2_wrap_s=round(timings["fsdp2_wrap_s"], 6), own_in_wrap_s=round(timings["own_in_wrap_s"], 6),
                   unsharded_release_s=round(timings["unsharded_release_s"], 6), **tp_details, **dropped, **wrap)
