"""``buffer_init``: every non-persistent buffer recomputed or broadcast, then verified across ranks."""

from __future__ import annotations

from ..distributed.buffers import init_non_persistent_buffers
from ..distributed.collectives import Collectives
from ..pipeline import HookContext, Stage, StageOutcome, ran


class BufferInitStage(Stage):
    """Makes each non-persistent buffer (rotary ``inv_freq``, masks ...) equal to rank 0's on every rank:
    recomputed from the module's own recipe (transformers' ``_init_weights``, ``reset_parameters``) where
    rank 0 proved that the recipe reproduces its value bit for bit, else broadcast from rank 0 (a buffer
    rank 0 changed on purpose keeps rank 0's value); then checks that each is finite and bitwise identical
    on every rank, sending rank 0's value again where a rank differs (``resent`` in the report)."""

    name = "buffer_init"
    hooks = ("prepare",)
    requires = ("shard",)
    summary = "recompute/broadcast non-persistent buffers; verify finite + identical"

    def skip_reason(self, ctx: HookContext) -> str | None:
        if not ctx.is_fsdp2 or ctx.model is None:
            return "not an FSDP2 run with a model"
        if ctx.world_size < 2:
            return "single process: nothing to synchronise"
        return None

    def run(self, ctx: HookContext) -> StageOutcome:
        coll = Collectives(self.name, timeout_s=self.options.collective_timeout_s)
        stats = init_non_persistent_buffers(ctx.model, coll=coll, device=ctx.device)
        return ran(**stats.details())
