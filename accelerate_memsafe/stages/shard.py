"""``shard``: apply FSDP2's ``fully_shard`` the way accelerate would, before accelerate's ``prepare``."""

from __future__ import annotations

from ..distributed.local_read import MappedParameterPages
from ..distributed.sharding import fsdp2_prepare_skip_reason, shard_model
from ..pipeline import HookContext, Stage, StageOutcome, ran
from .meta_placement import IN_PLACE_KEY


class ShardStage(Stage):
    """Wraps the model with ``fully_shard`` (accelerate's wrap policy, mixed precision and offload
    settings) and points the optimizers at the sharded parameters; accelerate's ``prepare`` then finds an
    already-sharded model and does the rest (optimizer wrapping, dataloaders, schedulers). With
    ``tp_size > 1`` the model's own TP plan is applied first, on ``meta``.
    """

    name = "shard"
    hooks = ("prepare",)
    summary = "apply fully_shard with accelerate's policy; remap optimizers"

    def skip_reason(self, ctx: HookContext) -> str | None:
        return fsdp2_prepare_skip_reason(is_fsdp2=ctx.is_fsdp2, model=ctx.model,
                                         parallelism_config=ctx.scratch.get("parallelism_config"))

    def run(self, ctx: HookContext) -> StageOutcome:
        tp = getattr(ctx.scratch.get("parallelism_config"), "tp_size", 1) or 1
        tp_details = {}
        if tp > 1:
            from ..distributed.tensor_parallel import resolve_tp_plan

            plan, tied, _ = resolve_tp_plan(ctx.model)
            tp_details = {"tp_size": tp, "tp_modules": len(plan), **({"tp_kept_replicated": tied} if tied else {})}
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
        )
        ctx.scratch["sharded"] = True
        dropped = {"file_pages_dropped_bytes": pages.bytes_dropped} if pages is not None else {}
        # the walls of accelerate's own wrapping and of freeing the unsharded weights (a stock `prepare` runs both too),
        # and the part of the wrapping spent in the plugin's callbacks: the rest of the stage is the plugin's own work
        return ran(**counts, world_size=ctx.world_size,
                   fsdp2_wrap_s=round(timings["fsdp2_wrap_s"], 6), own_in_wrap_s=round(timings["own_in_wrap_s"], 6),
                   unsharded_release_s=round(timings["unsharded_release_s"], 6), **tp_details, **dropped, **wrap)
