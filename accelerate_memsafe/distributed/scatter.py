"""Rank 0 sends every rank only its own shard of each parameter, in buckets, with a bounded prefetch.

The model has been sharded with ``fully_shard`` (and possibly parallelised for TP) while its parameters
were on ``meta``. Whatever the mesh (FSDP, HSDP, FSDP × TP) and placements (``Shard(d)`` on any dim,
``_StridedShard``, ``Replicate``), each rank's local tensor is one block of the global tensor: an offset
and a size per dimension, which DTensor reports without data (``__create_chunk_list__``, what DCP saves
by). Every rank gathers every rank's blocks once, so every rank computes the same plan. Rank ``r`` owns
rows ``[a_r, b_r)`` of its block (for 1-D FSDP, ``torch.chunk`` of dim 0), and within each row the columns
of its block. A tensor is cut into *units*: unit ``k`` holds, for every rank, up to ``s`` rows of that
rank's block, so a unit never exceeds the bucket budget even when one tensor is larger than it. Units are packed into buckets; for
each bucket rank 0 reads the rows from the source, casts them to the parameter's dtype while copying
them into one flat byte buffer per rank, and ``dist.scatter``\\s the buffers: each rank receives only its
rows. Replicated tensors (persistent buffers, parameters FSDP ignores) are broadcast.

This module agrees on the layout and runs the load; the pieces live by responsibility:
:mod:`~accelerate_memsafe.distributed.source` (where rank 0 reads), :mod:`~accelerate_memsafe.distributed.plan`
(the buckets), :mod:`~accelerate_memsafe.distributed.transport` (moving them, with its memory bound),
:mod:`~accelerate_memsafe.distributed.node_scatter` (the ``node`` source).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, StageError
from ..io.blocks import local_block
from ..io.safetensors_source import SafetensorsSource
from .collectives import Collectives
from .meta import difference_from_rank0
from .sharding import canonical_name
from .plan import _Sharded, bucket_budget
from .source import Rank0Source
from .transport import DistributeStats, _install, _send_flat, _send_p2p, narrow_sources


# ---------------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------------
def _sharded_and_replicated(model: nn.Module) -> tuple[list[_Sharded], list[tuple[str, nn.Module, str, torch.Tensor, bool]]]:
    from torch.distributed.tensor import DTensor

    sharded: list[_Sharded] = []
    replicated: list[tuple[str, nn.Module, str, torch.Tensor, bool]] = []
    seen: set[int] = set()
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for local, p in list(mod._parameters.items()):
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            name = canonical_name(f"{mod_name}.{local}" if mod_name else local)
            if isinstance(p, DTensor):
                if p.dim() == 0:
                    raise StageError(f"`rank0_distribute`: 0-d parameter `{name}` is a DTensor ({p.placements}); "
                                     "only tensors with at least one dimension can be sharded.")
                sharded.append(_Sharded(name, p, p.dtype, tuple(p.shape)))
            elif p.is_meta:
                replicated.append((name, mod, local, p, True))
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for local, b in list(mod._buffers.items()):
            if b is None or id(b) in seen or local in mod._non_persistent_buffers_set:
                continue
            seen.add(id(b))
            if b.is_meta:
                name = canonical_name(f"{mod_name}.{local}" if mod_name else local)
                replicated.append((name, mod, local, b, False))
    return sharded, replicated


def p2p_transport(coll: Collectives, nodes: Any) -> bool:
    """Whether the weights travel as point-to-point messages, one per piece (gloo: the collectives run on the
    CPU), rather than one ``scatter`` per bucket (other backends); the ``node`` source has its own transport."""
    return coll.device.type == "cpu" and nodes is None


def follow_rank0_layout(
    sharded: list[_Sharded],
    replicated: list[tuple[str, nn.Module, str, torch.Tensor, bool]],
    coll: Collectives,
    *,
    rank0_problem: str | None = None,
    wire: dict[str, str] | None = None,
) -> tuple[list[_Sharded], list[tuple[str, nn.Module, str, torch.Tensor, bool]]]:
    """One plan for all ranks: rank 0's list of tensors (names, order, shapes, dtypes) is broadcast, and
    every rank orders its own tensors by it. The bucket plan is then computed from identical inputs on
    every rank, so no collective can ever see the ranks disagree on sizes. A rank whose tensors differ
    from rank 0's makes every rank raise (one all-gather of a flag) before any byte moves.

    Args:
        rank0_problem: Why rank 0 cannot send (e.g. weights missing from its source): shared in the same
            broadcast, so that every rank raises it.
        wire: Rank 0's tensors sent in a narrower dtype than their shards (name -> dtype name, see
            :func:`~accelerate_memsafe.distributed.transport.narrow_sources`): shared in the same broadcast
            and set as ``wire`` on every rank's items.

    Returns:
        ``(sharded, replicated)`` in rank 0's order.

    Raises:
        CheckpointError: On every rank, with rank 0's problem.
        StageError: On every rank, naming the ranks and their first differences.
    """
    layout = [("s", i.name, i.shape, str(i.dtype)) for i in sharded]
    layout += [("r", name, tuple(t.shape), str(t.dtype)) for name, _, _, t, _ in replicated]
    ref, problem0, wire = coll.broadcast_object((layout, rank0_problem, wire or {}), src=0,
                                                what="broadcast of rank 0's distribution layout")
    if problem0:
        raise CheckpointError(f"`rank0_distribute`: {problem0}")
    problems: list[str] = []
    if coll.rank != 0:
        diff = difference_from_rank0(
            {(k, n): (shape, dtype) for k, n, shape, dtype in layout}, {(k, n): (shape, dtype) for k, n, shape, dtype in ref},
            what="shape/dtype",
        )
        if diff:
            problems.append(f"rank {coll.rank}'s sharded model differs from rank 0's: {diff}")
    bad = coll.ranks_flagging(bool(problems), what="agreement on the distribution layout")
    if bad:
        raise StageError(
            f"`rank0_distribute`: rank(s) {bad} would receive other tensors than rank 0 sends: "
            f"{' '.join(problems) or 'see the error on those ranks'}. Build the same model with the same dtype on "
            "every rank (e.g. `accelerate_memsafe.from_pretrained`)."
        )
    by_name = {i.name: i for i in sharded}
    for name, dtype in wire.items():
        by_name[name].wire = getattr(torch, dtype)
    rep_by_name = {r[0]: r for r in replicated}
    return [by_name[n] for k, n, _, _ in ref if k == "s"], [rep_by_name[n] for k, n, _, _ in ref if k == "r"]


def gather_boxes(sharded: list[_Sharded], coll: Collectives) -> None:
    """Fills every item's ``boxes`` with every rank's block: one all-gather, so that every rank plans the
    same buckets. Checks that the blocks lie inside the tensor and cover it.

    Raises:
        StageError: On every rank, naming the tensor and the rank whose block is not usable.
    """
    own = [local_block(i.param) for i in sharded]
    everyone = coll.all_gather_object(own, what="all_gather of each rank's blocks of the sharded parameters")
    problems = []
    for k, item in enumerate(sharded):
        boxes = [everyone[r][k] for r in range(coll.world_size)]
        bad = [(r, b) for r, b in enumerate(boxes) if isinstance(b, str)]
        if bad:
            problems.append(f"`{item.name}` on rank {bad[0][0]}: {bad[0][1]}")
            continue
        outside = [r for r, (o, z) in enumerate(boxes) if len(o) != len(item.shape)
                   or any(a < 0 or a + n > d for a, n, d in zip(o, z, item.shape))]
        volume = sum(math.prod(z) for o, z in set(boxes))
        if outside or volume != math.prod(item.shape):
            problems.append(f"`{item.name}` {item.shape}: the ranks' blocks {sorted(set(boxes))} do not tile it")
            continue
        item.boxes = boxes
    if problems:
        raise StageError(
            f"`rank0_distribute` cannot place {len(problems)} parameter(s): {'; '.join(problems[:5])}. HINT: remove "
            "`meta_placement` and `rank0_distribute` from the stages for this parallelism layout, and report it."
        )


def _read_local(sharded, replicated, names: set[str], checkpoint: SafetensorsSource, *, rank: int, budget: int,
                stats: DistributeStats, release: Any, device: torch.device) -> None:
    """Every rank reads its own block of each weight in ``names`` from the checkpoint (no collective)."""
    with torch.no_grad():
        for item in sharded:
            if item.name in names:
                stats.bytes_read_locally += checkpoint.read_block(item.name, item.ranges[rank], item.cols(rank),
                                                                  item.param.to_local(), chunk_bytes=budget)
                stats.local_tensors += 1
                if release is not None:
                    release(item.name)
        for name, mod, local, old, is_param in replicated:
            if name not in names:
                continue
            t = torch.empty(old.shape, dtype=old.dtype, device=device)
            stats.bytes_read_locally += checkpoint.read_block(name, (0, old.shape[0] if old.dim() else 1), None, t,
                                                              chunk_bytes=budget)
            stats.local_tensors += 1
            if release is not None:
                release(name)
            _install(mod, local, old, t, is_param)



def materialize_meta_shards(model: nn.Module, device: torch.device) -> None:
    """Allocates (uninitialised) local storage for every sharded parameter still on ``meta``, keeping
    parameter identity (FSDP2's ``_apply`` re-pads the sharded parameters). Only local shards are
    allocated: on a rank, a sharded parameter never exists at full size."""
    from torch.distributed.tensor import DTensor

    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta and isinstance(t, DTensor) else t)


def distribute_from_rank0(
    model: nn.Module,
    source: Rank0Source | None,
    *,
    coll: Collectives,
    bucket_bytes: int,
    prefetch_buckets: int,
    device: torch.device,
    replicated_device: torch.device | None = None,
    check_finite: bool = False,
    progress: bool = False,
    local_source: SafetensorsSource | None = None,
    local_names: set[str] | None = None,
    nodes: Any = None,
) -> DistributeStats:
    """Fills the ``meta`` shards of an FSDP2 model with rank 0's weights: each rank receives only its rows.

    Args:
        model: The ``fully_shard``-ed model, parameters still on ``meta`` on every rank.
        source: Rank 0's weights (``None`` on the other ranks).
        coll: Timeout-guarded collectives of the calling stage.
        bucket_bytes: Bound on the cast copies rank 0 holds at once (see the module docstring).
        prefetch_buckets: Buckets rank 0 prepares ahead of the one being sent.
        device: Where the local shards live (the CPU under FSDP2 CPU offload).
        replicated_device: Where the replicated tensors go (``None``: ``device``): the training device, also under
            CPU offload, where ``fully_shard`` leaves buffers and the parameters it ignores on the device.
        check_finite: Rank 0 checks every weight for NaN/Inf while reading it.
        progress: Show a byte progress bar on rank 0 (only when hundreds of MB move).
        local_source: This rank's open checkpoint, when every rank reads the weights ``local_names`` (agreed
            by :func:`~accelerate_memsafe.distributed.local_read.agree_on_local_reads`) itself: those move
            through no collective.
        local_names: See ``local_source``.
        nodes: A :class:`~accelerate_memsafe.distributed.topology.Nodes` for the ``node`` load source: each
            node's leader reads ``local_names`` itself (``local_source`` on the leaders) and gets the other
            weights from rank 0 (at most one copy per node), then scatters within its node.

    Returns:
        Counts and bytes for the report.

    Raises:
        CheckpointError: On rank 0, if a weight is missing from the source, on meta, or not finite.
        CollectiveTimeoutError: If a rank stops participating.

    Example:
        >>> # after fully_shard on meta, on every rank:
        >>> # distribute_from_rank0(model, source if rank == 0 else None, coll=coll, bucket_bytes=64 << 20,
        >>> #                       prefetch_buckets=2, device=torch.device("cpu"))
    """
    rank, world = coll.rank, coll.world_size
    sharded, replicated = _sharded_and_replicated(model)
    problem = None
    if rank == 0:
        missing = [n for n, *_ in replicated if n not in source.tensors] + [i.name for i in sharded if i.name not in source.tensors]
        on_meta = [i.name for i in sharded if i.name in source.tensors and source.is_meta(i.name)]
        on_meta += [n for n, *_ in replicated if n in source.tensors and source.is_meta(n)]
        if missing or on_meta:
            problem = (
                f"rank 0 has no weights to distribute for {len(missing) + len(on_meta)} tensor(s): "
                f"missing {missing[:10]}, on meta {on_meta[:10]}. Rank 0 must hold the real weights "
                "(load them there, e.g. with `accelerate_memsafe.from_pretrained`)."
            )
    # gloo without nodes: one message per piece, narrower sources sent as they are (widened on receipt)
    p2p = p2p_transport(coll, nodes)
    wire = narrow_sources(sharded, source) if rank == 0 and p2p and problem is None else None
    sharded, replicated = follow_rank0_layout(sharded, replicated, coll, rank0_problem=problem, wire=wire)
    gather_boxes(sharded, coll)
    budget = bucket_budget(bucket_bytes, prefetch_buckets, world)
    stats = DistributeStats(sharded_tensors=len(sharded), replicated_tensors=len(replicated), bucket_budget=budget)
    if rank == 0:
        stats.from_checkpoint = len(source.from_checkpoint)
    materialize_meta_shards(model, device)
    rdev = device if replicated_device is None else replicated_device
    local_names = set(local_names or ())
    if nodes is None and local_source is None:
        local_names = set()
    if nodes is None and local_names:
        _read_local(sharded, replicated, local_names, local_source, rank=rank, budget=budget, stats=stats,
                    release=source.release if rank == 0 else None, device=rdev)
        local_source.drop_scratch()  # rank 0 keeps the checkpoint open to send the rest: not its cast buffer
        sharded = [i for i in sharded if i.name not in local_names]
        replicated = [r for r in replicated if r[0] not in local_names]
    with torch.no_grad():
        locals_ = {i.name: i.param.to_local() for i in sharded}
        for item in sharded:
            if tuple(locals_[item.name].shape) != item.boxes[rank][1]:
                raise StageError(
                    f"`{item.name}`: rank {rank}'s local shard has shape {tuple(locals_[item.name].shape)} after "
                    f"materialisation, its placements say {item.boxes[rank][1]}. Please report this."
                )
        if nodes is not None:
            from .node_scatter import send_by_node

            send_by_node(sharded, replicated, nodes, source=source, reader=local_source, local_names=local_names,
                         locals_=locals_, budget=budget, prefetch_buckets=prefetch_buckets, replicated_device=rdev,
                         check_finite=check_finite, progress=progress, timeout_s=coll.timeout_s, stats=stats)
        else:
            # gloo: one message per piece, zero-copy at both ends; other backends: a scatter per bucket
            send = _send_p2p if p2p else _send_flat
            send(sharded, replicated, source=source, coll=coll, locals_=locals_, budget=budget,
                 prefetch_buckets=prefetch_buckets, replicated_device=rdev, check_finite=check_finite,
                 progress=progress, stats=stats)
    if rank == 0:
        stats.madvised_bytes = source.released_bytes
        source.close()
    return stats
