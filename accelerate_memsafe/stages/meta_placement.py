"""``meta_placement``: before ``shard``, every rank's weights go to ``meta``; rank 0 keeps the originals.

On ``meta``, accelerate's fp32 upcast (``mixed_precision != "no"``) and ``fully_shard`` cost nothing, so
no rank ever commits a full copy of the model. Rank 0's original tensors (often zero-copy views of the
mmap'ed checkpoint, or, for a model from :func:`accelerate_memsafe.from_pretrained`, the checkpoint file
itself) become the source that ``rank0_distribute`` reads from.

Runs whether or not ``fsdp_plugin.cpu_ram_efficient_loading`` is set: rank 0's weights are what every
rank ends up with, which is what data-parallel training needs in both cases (with the flag off, stock
accelerate keeps each rank's own copy, which only works if they are all equal anyway).
"""

from __future__ import annotations

from ..distributed.sharding import fsdp2_prepare_skip_reason
from ..distributed.collectives import Collectives
from ..distributed.meta import (
    agree_on_structure,
    checkpoint_source_names,
    move_to_meta,
    parallelism_blocks_meta_placement,
)
from ..distributed.source import Rank0Source
from ..pipeline import HookContext, MemoryEstimate, Stage, StageOutcome, ran

#: ``ctx.scratch`` key of rank 0's weight source (``Rank0Source``); ``None`` on other ranks.
SOURCE_KEY = "rank0_source"
#: ``ctx.scratch`` key set on every rank when the weights were moved to meta.
PLACED_KEY = "meta_placed"


class MetaPlacementStage(Stage):
    """Moves parameters and persistent buffers to ``meta`` on every rank (ties and optimizer references
    kept); rank 0 keeps the originals as the distribution source. Checks first that every rank holds the
    same model as rank 0 (names and shapes) and that rank 0 holds real weights."""

    name = "meta_placement"
    hooks = ("prepare",)
    run_before = ("shard",)
    completed_by = ("shard", "rank0_distribute")
    summary = "weights to meta before any upcast/copy; rank 0 keeps the source"

    def skip_reason(self, ctx: HookContext) -> str | None:
        reason = fsdp2_prepare_skip_reason(is_fsdp2=ctx.is_fsdp2, model=ctx.model,
                                           parallelism_config=ctx.scratch.get("parallelism_config"))
        if reason:
            return reason
        if ctx.world_size < 2:
            return "single process: nothing to distribute"
        return parallelism_blocks_meta_placement(ctx.model, ctx.scratch.get("parallelism_config"))

    def estimate(self, ctx: HookContext) -> MemoryEstimate | None:
        # rank 0 scans the pagemap of the weights it holds on the CPU (whether they are the file's bytes)
        if ctx.rank != 0 or not ctx.is_fsdp2 or ctx.model is None or ctx.world_size < 2:
            return None
        from ..memory.estimate import pagemap_scan_bytes

        held = sum(p.numel() * p.element_size() for p in ctx.model.parameters() if p.device.type == "cpu")
        return MemoryEstimate(cpu_bytes=pagemap_scan_bytes(held), what="rank 0's pagemap scan of the weights it maps")

    def run(self, ctx: HookContext) -> StageOutcome:
        coll = Collectives(self.name, timeout_s=self.options.collective_timeout_s)
        reference = agree_on_structure(ctx.model, coll, check_finite=self.options.check_finite_weights)
        is_src = ctx.rank == 0
        originals = move_to_meta(ctx.model, ctx.optimizers, reference, keep=is_src)
        details = {"tensors": len(reference), "bytes": sum(_nbytes(m) for m in reference)}
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
