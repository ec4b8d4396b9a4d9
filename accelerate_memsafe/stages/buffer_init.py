"""``buffer_init``: every non-persistent buffer recomputed or broadcast, then verified across ranks."""

from __future__ import annotations

from ..distributed.buffers import buffer_claim, init_non_persistent_buffers
from ..distributed.collectives import Collectives
from ..pipeline import ANNOUNCED_KEY, HookContext, Stage, StageOutcome, ran
from .meta_placement import IN_PLACE_KEY

# ctx.scratch key of this rank's buffer claim (model, BufferClaim), from `announce` to `run`
_CLAIM_KEY = "buffer_init_claim"
_NOT_FSDP2 = "not an FSDP2 run with a model"


class BufferInitStage(Stage):
    """Makes each non-persistent buffer (rotary ``inv_freq``, masks ...) equal to rank 0's on every rank:
    recomputed from the module's own recipe (transformers' ``_init_weights``, ``reset_parameters``) where
    rank 0 proved that the recipe reproduces its value bit for bit, else broadcast from rank 0 (a buffer
    rank 0 changed on purpose keeps rank 0's value); then checks that each is finite and bitwise identical
    on every rank, sending rank 0's value again where a rank differs (``resent`` in the report).

    The check's rows travel in the preflight exchange (:meth:`announce`). Where every rank kept its model in place
    (``meta_placement``'s in-place decision, the same on every rank: no stage moved a weight or a buffer on any rank)
    and every rank claimed rank 0's row, the stage needs no collective: each rank confirms that its buffers are still
    the tensors it claimed, or that their row is unchanged."""

    name = "buffer_init"
    hooks = ("prepare",)
    requires = ("shard",)
    summary = "recompute/broadcast non-persistent buffers; verify finite + identical"

    def fixed_skip_reason(self, ctx: HookContext) -> str | None:
        return None if ctx.is_fsdp2 else _NOT_FSDP2

    def skip_reason(self, ctx: HookContext) -> str | None:
        if not ctx.is_fsdp2 or ctx.model is None:
            return _NOT_FSDP2
        if ctx.world_size < 2:
            return "single process: nothing to synchronise"
        return None

    def announce(self, ctx: HookContext):
        """This rank's buffer row (three integers, :func:`~accelerate_memsafe.distributed.buffers.buffer_claim`)."""
        if self.skip_reason(ctx) is not None:
            return None
        claim = buffer_claim(ctx.model)
        ctx.scratch[_CLAIM_KEY] = (ctx.model, claim)
        return claim.row

    def run(self, ctx: HookContext) -> StageOutcome:
        coll = Collectives(self.name, timeout_s=self.options.collective_timeout_s)
        model, mine = ctx.scratch.pop(_CLAIM_KEY, (None, None))
        claims = ctx.scratch.get(ANNOUNCED_KEY, {}).get(self.name) if model is ctx.model else None
        stats = init_non_persistent_buffers(ctx.model, coll=coll, device=ctx.device, claims=claims,
                                            mine=mine if claims is not None else None,
                                            untouched_everywhere=bool(ctx.scratch.get(IN_PLACE_KEY)))
        return ran(**stats.details())
