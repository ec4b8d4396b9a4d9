"""``rank0_distribute``: after ``shard``, rank 0 scatters each rank's own shard, bucket by bucket."""

from __future__ import annotations

import torch

from .. import _compat
from ..distributed.collectives import Collectives
from ..distributed.local_read import LocalReads, agree_on_local_reads, close_unless, in_place_verdict
from ..distributed.scatter import distribute_from_rank0
from ..distributed.sharding import fsdp2_prepare_skip_reason
from ..distributed.topology import find_nodes
from ..memory.estimate import distribute_peak, layout, mesh_blocks, tensors_of_model
from ..pipeline import ANNOUNCED_KEY, HookContext, MemoryEstimate, Stage, StageOutcome, ran
from .meta_placement import IN_PLACE_KEY, PLACED_KEY, SOURCE_KEY, MetaPlacementStage
from .shard import announced_tp_problem

_NOT_PLACED = "`meta_placement` did not move the weights to meta: they are already in place"


class Rank0DistributeStage(Stage):
    """Fills the ``meta`` shards left by ``meta_placement`` + ``shard``: rank 0 reads each tensor (from
    the model it loaded or lazily from the checkpoint), casts it to the sharded parameter's dtype per
    row range, and ``scatter``\\s to each rank only its rows, in buckets bounded by ``bucket_bytes``
    with ``prefetch_buckets`` prepared ahead. Persistent buffers are broadcast. Works with FSDP2 CPU
    offload (shards stay on the CPU)."""

    name = "rank0_distribute"
    hooks = ("prepare",)
    requires = ("shard",)
    run_before = ("buffer_init",)
    summary = "rank 0 scatters each rank's shard in bounded buckets"

    def needs_estimate(self, ctx: HookContext) -> bool:
        # asked after the preflight exchange: where every rank claimed to hold rank 0's mapped bytes (`meta_placement`'s
        # announcements), the weights stay in place and this stage does not run, so its estimate (a walk over the
        # model's tensors and the bucket plan) would check a need that never comes
        claims = ctx.scratch.get(ANNOUNCED_KEY, {}).get(MetaPlacementStage.name)
        return not (claims is not None and len(claims) == ctx.world_size and in_place_verdict(claims) is None)

    def estimate(self, ctx: HookContext) -> MemoryEstimate | None:
        # called before any prepare stage ran: parameters still have their full shapes
        if not ctx.is_fsdp2 or ctx.model is None or ctx.world_size <= 1:
            return None
        if fsdp2_prepare_skip_reason(is_fsdp2=ctx.is_fsdp2, model=ctx.model,
                                     parallelism_config=ctx.scratch.get("parallelism_config")) is not None:
            return None  # `shard` and `meta_placement` skip (e.g. a model transformers parallelised): nothing is sent
        from torch.distributed.fsdp import CPUOffloadPolicy

        ignored = _compat.ignored_modules(getattr(ctx.fsdp_plugin, "ignored_modules", None), ctx.model) or ()
        tensors = tensors_of_model(ctx.model, whole=(p for m in ignored for p in m.parameters()))
        load_bytes = max((t.file_itemsize for t in tensors if t.floating), default=4)
        lay = layout(tensors, world_size=ctx.world_size, load_bytes=load_bytes, mixed_precision=ctx.mixed_precision,
                     blocks=self._blocks(ctx))
        on_device = ctx.device.type != "cpu" and not isinstance(getattr(ctx.fsdp_plugin, "cpu_offload", None), CPUOffloadPolicy)
        # `auto` picks its source only when it runs: the larger of what each choice would need
        sources = ("every_rank", "rank0") if self.options.load_source == "auto" else (self.options.load_source,)
        transport = "p2p" if ctx.device.type == "cpu" else "scatter"  # gloo sends piece by piece
        peaks = [distribute_peak(lay, rank=ctx.rank, bucket_bytes=self.options.bucket_bytes,
                                 prefetch_buckets=self.options.prefetch_buckets, load_source=s, on_device=on_device,
                                 transport=transport)
                 for s in sources]
        return MemoryEstimate(
            cpu_bytes=max(p.cpu for p in peaks),
            device_bytes=max(p.device for p in peaks),
            what=f"its shard of {lay.full / 2**30:.2f} GiB of weights plus the scatter buckets",
        )

    @staticmethod
    def _blocks(ctx: HookContext):
        """How the ranks will split each weight: HSDP holds ``dp_shard_size`` blocks, each ``dp_replicate_size``
        times; FSDP × TP with the plan declined, ``dp_shard_size`` blocks, each ``tp_size`` times (whether it is
        declined: ``shard``'s verdicts in the preflight exchange, else this rank's own check)."""
        replicate, tp = ctx.parallel_size("dp_replicate_size"), ctx.parallel_size("tp_size")
        applied = True
        if tp > 1:
            complete, problem = announced_tp_problem(ctx)
            if not complete:  # no collective in an estimate: this rank's own check
                from ..distributed.tensor_parallel import tp_plan_problem

                problem = tp_plan_problem(ctx.model, tp)
            applied = problem is None
        try:
            return mesh_blocks(ctx.world_size, dp_replicate=replicate, tp=tp, tp_applied=applied)
        except ValueError:  # a mesh that does not fit the processes: accelerate refuses it before any stage runs
            return None

    def fixed_skip_reason(self, ctx: HookContext) -> str | None:
        # `meta_placement`, the one stage that moves weights to meta, never runs in one process or without FSDP2
        return _NOT_PLACED if not ctx.is_fsdp2 or ctx.world_size < 2 else None

    def skip_reason(self, ctx: HookContext) -> str | None:
        if ctx.scratch.get(IN_PLACE_KEY):  # set on every rank or on none
            return ("every rank holds rank 0's bytes (unmodified views of one mapped checkpoint): `shard` kept each "
                    "rank's own rows, nothing to send or read")
        if not ctx.scratch.get(PLACED_KEY):  # set on every rank or on none
            return _NOT_PLACED
        return None

    def run(self, ctx: HookContext) -> StageOutcome:
        from torch.distributed.fsdp import CPUOffloadPolicy

        offload = isinstance(getattr(ctx.fsdp_plugin, "cpu_offload", None), CPUOffloadPolicy)
        device = torch.device("cpu") if offload else ctx.device
        coll = Collectives(self.name, timeout_s=self.options.collective_timeout_s)
        source = ctx.scratch.pop(SOURCE_KEY, None)
        rank0_checkpoint = source.checkpoint if source is not None else None  # rank 0 only
        mode = self.options.load_source
        nodes = find_nodes(coll) if mode in ("auto", "node") else None
        if mode == "rank0":
            reads = LocalReads(None, set(), "rank0", "load_source='rank0'")
        elif self.options.check_finite_weights:
            reads = LocalReads(None, set(), "node" if mode == "node" else "rank0",
                               "check_finite_weights: rank 0 checks every weight while sending it")
        else:
            reads = agree_on_local_reads(coll, rank0_checkpoint, source.from_checkpoint if source is not None else set(),
                                         mode=mode, nodes=nodes)
        try:
            stats = distribute_from_rank0(
                ctx.model,
                source,
                coll=coll,
                bucket_bytes=self.options.bucket_bytes,
                prefetch_buckets=self.options.prefetch_buckets,
                device=device,
                replicated_device=ctx.device,  # buffers and ignored parameters: where fully_shard leaves them
                check_finite=self.options.check_finite_weights,
                progress=self.options.progress,
                local_source=reads.source,
                local_names=reads.names,
                nodes=nodes if reads.load_source == "node" else None,
            )
        finally:
            close_unless(reads.source, rank0_checkpoint)
        source_used = reads.load_source
        if source_used == "every_rank" and (stats.bytes_sent or stats.bytes_received):
            source_used = "every_rank+rank0"
        where = {"nodes": [list(n) for n in nodes.ranks]} if source_used == "node" else {}
        return ran(load_source=source_used, **({"rank0_because": reads.why} if reads.why else {}), **where, **vars(stats))
