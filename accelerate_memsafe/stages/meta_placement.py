"""``meta_placement``: before ``shard``, every rank's weights go to ``meta``; rank 0 keeps the originals.

On ``meta``, accelerate's fp32 upcast (``mixed_precision != "no"``) and ``fully_shard`` cost nothing, so
no rank ever commits a full copy of the model. Rank 0's original tensors (often zero-copy views of the
mmap'ed checkpoint, or, for a model from :func:`accelerate_memsafe.from_pretrained`, the checkpoint file
itself) become the source that ``rank0_distribute`` reads from.

With ``load_source="auto"`` on the CPU, a model every rank already holds as unmodified views of one mapped
checkpoint (transformers' zero-copy load on every rank) is left in place: every rank's bytes are rank 0's, and
``fully_shard`` keeps each rank's own rows as stock accelerate does, with no weight read again or sent
(:func:`~accelerate_memsafe.distributed.local_read.agree_on_in_place`).

Runs whether or not ``fsdp_plugin.cpu_ram_efficient_loading`` is set: rank 0's weights are what every
rank ends up with, which is what data-parallel training needs in both cases (with the flag off, stock
accelerate keeps each rank's own copy, which only works if they are all equal anyway).
"""

from __future__ import annotations

from .. import walk
from ..distributed.sharding import fsdp2_prepare_skip_reason
from ..distributed.collectives import Collectives
from ..distributed.local_read import agree_on_in_place, decide_in_place, in_place_claim
from ..distributed.meta import (
    agree_on_structure,
    checkpoint_source_names,
    move_to_meta,
    parallelism_blocks_meta_placement,
    refuse_scalar_parameters,
)
from ..distributed.source import Rank0Source
from ..memory.estimate import pagemap_scan_bytes
from ..pipeline import ANNOUNCED_KEY, HookContext, MemoryEstimate, Stage, StageOutcome, ran

#: ``ctx.scratch`` key of rank 0's weight source (``Rank0Source``); ``None`` on other ranks.
SOURCE_KEY = "rank0_source"
#: ``ctx.scratch`` key set on every rank when the weights were moved to meta.
PLACED_KEY = "meta_placed"
#: ``ctx.scratch`` key set on every rank when every rank's weights were left in place (rank 0's bytes already).
IN_PLACE_KEY = "weights_in_place"
#: ``ctx.scratch`` key set on a rank that announced its in-place claim in the preflight exchange.
_CLAIM_KEY = "in_place_claim"
#: ``ctx.scratch`` key of ``(model, skip reason, its parameters or None)``: :meth:`MetaPlacementStage.skip_reason`
#: for that model, and the parameter list its check walked (the preflight's estimate and an in-place ``run`` count
#: them before any stage changed the model: no second walk).
_SKIP_KEY = "meta_placement_skip_reason"


class MetaPlacementStage(Stage):
    """Moves parameters and persistent buffers to ``meta`` on every rank (ties and optimizer references
    kept); rank 0 keeps the originals as the distribution source. Checks first that every rank holds the
    same model as rank 0 (names and shapes) and that rank 0 holds real weights."""

    name = "meta_placement"
    hooks = ("prepare",)
    run_before = ("shard",)
    completed_by = ("shard", "rank0_distribute")
    summary = "weights to meta before any upcast/copy; rank 0 keeps the source"

    def fixed_skip_reason(self, ctx: HookContext) -> str | None:
        return None if ctx.is_fsdp2 else fsdp2_prepare_skip_reason(is_fsdp2=False, model=None)

    def skip_reason(self, ctx: HookContext) -> str | None:
        # asked up to three times before the stage runs (the accelerator's meta-weight check, `announce`, the
        # pipeline), each a walk over every parameter: the answer is kept for this model in this hook call
        memo = ctx.scratch.get(_SKIP_KEY)
        if memo is not None and memo[0] is ctx.model:
            return memo[1]
        reason = fsdp2_prepare_skip_reason(is_fsdp2=ctx.is_fsdp2, model=ctx.model,
                                           parallelism_config=ctx.scratch.get("parallelism_config"))
        if not reason and ctx.world_size < 2:
            reason = "single process: nothing to distribute"
        params = None
        if not reason:
            params = walk.parameters(ctx.model)
            reason = parallelism_blocks_meta_placement(ctx.model, ctx.scratch.get("parallelism_config"),
                                                       parameters=params)
        ctx.scratch[_SKIP_KEY] = (ctx.model, reason, None if reason else params)
        return reason

    def _kept_parameters(self, ctx: HookContext, *, release: bool = False) -> list | None:
        """The parameter list :meth:`skip_reason` walked for this model (``None``: none kept); ``release``: the hook's
        context lets go of it (the list holds every original weight)."""
        memo = ctx.scratch.get(_SKIP_KEY)
        if memo is None:
            return None
        if release:
            ctx.scratch[_SKIP_KEY] = (memo[0], memo[1], None)
        return memo[2] if memo[0] is ctx.model else None

    def _parameters(self, ctx: HookContext) -> list:
        """The model's parameters as :meth:`skip_reason` found them (asked before any stage ran, so the same list),
        else walked now."""
        kept = self._kept_parameters(ctx)
        return kept if kept is not None else walk.parameters(ctx.model)

    def estimate(self, ctx: HookContext) -> MemoryEstimate | None:
        # rank 0 scans the pagemap of the weights it holds on the CPU (whether they are the file's bytes); so does
        # every other rank when the ranks may keep their weights in place (`agree_on_in_place`)
        if not ctx.is_fsdp2 or ctx.model is None or ctx.world_size < 2:
            return None
        if ctx.rank != 0 and self.in_place_blocker(ctx) is not None:
            return None
        held = sum(p.numel() * p.element_size() for p in self._parameters(ctx) if p.device.type == "cpu")
        return MemoryEstimate(cpu_bytes=pagemap_scan_bytes(held), what="this rank's pagemap scan of the weights it maps")

    def in_place_blocker(self, ctx: HookContext) -> str | None:
        """Why the weights cannot stay in place whatever the ranks hold (the same on every rank: settings only),
        or ``None`` when the ranks decide it together (:func:`agree_on_in_place`)."""
        if self.options.load_source != "auto":
            return f"load_source={self.options.load_source!r}"
        if self.options.check_finite_weights:
            return "check_finite_weights: rank 0 checks every weight while sending it"
        if ctx.device.type != "cpu":
            return f"training on {ctx.device.type}: fully_shard would first move each whole weight to the device"
        if ctx.parallel_size("tp_size") > 1:
            return "tensor parallelism: its plan is applied on meta"
        return None

    def announce(self, ctx: HookContext):
        """This rank's in-place claim (:func:`~accelerate_memsafe.distributed.local_read.in_place_claim`), sent with
        the preflight exchange, so that deciding whether the weights stay in place costs no collective of its own;
        ``None`` when the stage will skip or the settings rule the in-place path out (the same on every rank)."""
        if self.skip_reason(ctx) is not None or self.in_place_blocker(ctx) is not None:
            return None
        ctx.scratch[_CLAIM_KEY] = True
        return in_place_claim(ctx.model, ctx.rank, mixed_precision=ctx.mixed_precision)

    def run(self, ctx: HookContext) -> StageOutcome:
        refuse_scalar_parameters(ctx.model, getattr(ctx.fsdp_plugin, "ignored_modules", None))
        # kept past this stage, the list would keep every original weight alive through `shard` (freed only when the
        # hook's context goes, not when fully_shard has replaced them): only its length stays
        counted = len(kept) if (kept := self._kept_parameters(ctx, release=True)) is not None else None
        del kept
        blocker = self.in_place_blocker(ctx)
        coll = None  # made when a collective runs: deciding from the preflight's claims needs none
        claims = ctx.scratch.get(ANNOUNCED_KEY, {}).get(self.name)
        if blocker:
            decision = None
        elif claims is not None and len(claims) == ctx.world_size and _CLAIM_KEY in ctx.scratch:
            ctx.scratch.pop(_CLAIM_KEY)
            decision = decide_in_place(claims)
        else:  # run outside a pipeline's preflight: the ranks exchange their claims here
            coll = Collectives(self.name, timeout_s=self.options.collective_timeout_s)
            decision = agree_on_in_place(coll, ctx.model, mixed_precision=ctx.mixed_precision)
        if decision is not None and decision.in_place:
            ctx.scratch[IN_PLACE_KEY] = True
            return ran(in_place=True, tensors=counted if counted is not None else len(walk.parameters(ctx.model)))
        coll = coll or Collectives(self.name, timeout_s=self.options.collective_timeout_s)
        reference = agree_on_structure(ctx.model, coll, check_finite=self.options.check_finite_weights)
        is_src = ctx.rank == 0
        originals = move_to_meta(ctx.model, ctx.optimizers, reference, keep=is_src)
        details = {"tensors": len(reference), "bytes": sum(_nbytes(m) for m in reference), "in_place": False,
                   "not_in_place_because": blocker or decision.why}
        if is_src:
            checkpoint, names = checkpoint_source_names(originals, getattr(ctx.model, "_memsafe_checkpoint", None))
            ctx.scratch[SOURCE_KEY] = Rank0Source(originals, checkpoint, names)
            details["from_checkpoint"] = len(names)
        ctx.scratch[PLACED_KEY] = True
        return ran(**details)


def _nbytes(m) -> int:
    n = m.dtype.itemsize
    for s in m.shape:
        n *= s
    return n
