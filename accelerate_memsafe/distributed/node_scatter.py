"""The ``node`` load source: each node's leader (its local rank 0) is the source for its node.

Per bucket of the one plan every rank computes (:func:`~accelerate_memsafe.distributed.scatter.plan_buckets`):

* a weight the leaders may read themselves (rank 0 proved it holds the checkpoint's unmodified bytes, and
  every leader sees the same files) is read by each leader for its own node's ranks only;
* any other weight is read by rank 0, which sends each other leader exactly its node's rows (one
  scatter over the leaders per bucket): rank 0's egress is at most one copy of the model per node, and
  no byte crosses between nodes twice;

then each leader scatters the bucket within its node. Replicated tensors go to the leaders (from rank 0 or
their own read), then are broadcast within each node.

Memory: rank 0 holds its buckets for every rank (as with ``rank0``), another leader the buckets of its own
node, any other rank one receive buffer: the bounds of ``rank0`` hold.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..memory.progress import byte_progress
from .collectives import Collectives
from .plan import _Bucket, plan_buckets
from .source import Rank0Source
from .transport import BoundedPrefetcher, DistributeStats, _typed, fill_slots, install_from, replicated_groups, unpack_slot
from .topology import Nodes, node_groups


def send_by_node(sharded, replicated, nodes: Nodes, *, source: Rank0Source | None, reader: Any, local_names: set[str],
                 locals_: dict[str, torch.Tensor], budget: int, prefetch_buckets: int,
                 replicated_device: torch.device, check_finite: bool, progress: bool, timeout_s: float,
                 stats: DistributeStats) -> None:
    """Fills every rank's shards through its node's leader (see the module docstring).

    Args:
        sharded, replicated: The agreed tensors (rank 0's order), local shards materialised.
        nodes: Every rank's node, the same on every rank.
        source: Rank 0's weights (``None`` elsewhere).
        reader: On a leader other than rank 0, its open checkpoint when ``local_names`` is not empty.
        local_names: The weights the leaders read themselves (agreed on every rank).
        locals_: This rank's local shard of each sharded parameter.
        replicated_device: Where the replicated tensors are installed.
    """
    rank = dist.get_rank()
    world = dist.get_world_size()
    node = nodes.node_of(rank)
    leader = node[0]
    node_group, leaders_group = node_groups(nodes, rank)
    # the Collectives of one group are created on its ranks in the same order (store keys are numbered per stage)
    in_node = Collectives("rank0_distribute.in_node", timeout_s=timeout_s, group=node_group) if node_group else None
    leaders = Collectives("rank0_distribute.leaders", timeout_s=timeout_s, group=leaders_group) if leaders_group else None
    width = max(len(n) for n in nodes.ranks)
    where = {r: (k, i) for k, n in enumerate(nodes.ranks) for i, r in enumerate(n)}  # rank -> (node, position)
    if rank != 0 and reader is not None and local_names:
        reader = Rank0Source({}, checkpoint=reader, from_checkpoint=local_names)
    elif rank == 0:
        reader = source

    own = [i for i in sharded if i.name in local_names]
    sent = [i for i in sharded if i.name not in local_names]
    plan = [(b, True) for b in plan_buckets(own, world, budget)] + [(b, False) for b in plan_buckets(sent, world, budget)]
    stats.buckets = len(plan)
    device_comm = (in_node or leaders).device if (in_node or leaders) else torch.device("cpu")
    if rank == 0:
        stats.bytes_sent_per_node = [0] * len(nodes.ranks)

    if rank == leader:

        def produce(entry: tuple[_Bucket, bool]) -> torch.Tensor:
            bucket, from_file = entry
            slot = bucket.slot_bytes
            if rank == 0 and not from_file:  # every node's rows, node k at [k * width * slot, ...)
                flat = torch.empty(len(nodes.ranks) * width * slot, dtype=torch.uint8, device=device_comm)
                at = {r: (k * width + i) * slot for r, (k, i) in where.items()}
                fill_slots(bucket, lambda r: flat[at[r] : at[r] + slot], source, check_finite=check_finite)
                return flat
            flat = torch.empty(width * slot, dtype=torch.uint8, device=device_comm)
            if from_file:
                fill_slots(bucket, lambda r: flat[where[r][1] * slot : (where[r][1] + 1) * slot], reader, ranks=set(node))
            return flat

        prefetcher = BoundedPrefetcher(produce, plan, max_alive=prefetch_buckets + 1)
        bar = byte_progress(sum(b.slot_bytes for b, _ in plan) * world, "rank0_distribute: node scatter",
                            enabled=progress and rank == 0, rank=rank)
        try:
            for (bucket, from_file), flat in zip(plan, prefetcher):
                slot = bucket.slot_bytes
                what = f"bucket {bucket.index + 1}/{len(plan)}"
                if not from_file and leaders is not None:  # rank 0 -> each leader: its node's rows
                    chunks = [flat[k * width * slot : (k + 1) * width * slot] for k in range(len(nodes.ranks))]
                    leaders.scatter(chunks[0] if rank == 0 else flat, chunks if rank == 0 else None, src=0,
                                    what=f"scatter of {what} to the node leaders")
                    if rank == 0:
                        for k in range(1, len(nodes.ranks)):
                            stats.bytes_sent += width * slot
                            stats.bytes_sent_per_node[k] += width * slot
                    else:
                        stats.bytes_received += flat.numel()
                slots = [flat[i * slot : (i + 1) * slot] for i in range(len(node))]
                if in_node is not None:
                    in_node.scatter(slots[0], slots, src=leader, what=f"scatter of {what} within the node")
                    stats.bytes_sent += slot * (len(node) - 1)
                    if rank == 0:
                        stats.bytes_sent_per_node[0] += slot * (len(node) - 1)
                unpack_slot(bucket, slots[0], rank, locals_)
                bar.update(slot * world)
                del flat, slots
                prefetcher.release()
        finally:
            bar.close()
            prefetcher.close()
    else:
        for bucket, _ in plan:
            buf = torch.empty(bucket.slot_bytes, dtype=torch.uint8, device=device_comm)
            in_node.scatter(buf, None, src=leader, what=f"scatter of bucket {bucket.index + 1}/{len(plan)} within the node")
            stats.bytes_received += buf.numel()
            unpack_slot(bucket, buf, rank, locals_)
            del buf

    for from_file, group in ([(True, g) for g in replicated_groups([r for r in replicated if r[0] in local_names], budget)]
                             + [(False, g) for g in replicated_groups([r for r in replicated if r[0] not in local_names], budget)]):
        flat = torch.empty(group[-1][1] + group[-1][2], dtype=torch.uint8, device=device_comm)
        nbytes = flat.numel()
        what = f"replicated tensors ({group[0][0][0]} ...)"
        if from_file:
            if rank == leader:
                for (name, _, _, old, _), at, n in group:
                    reader.read_rows(name, 0, old.shape[0] if old.dim() else 1, _typed(flat, at, n, old))
                    stats.bytes_read_locally += n
        else:
            if rank == 0:
                for (name, _, _, old, _), at, n in group:
                    source.read_rows(name, 0, old.shape[0] if old.dim() else 1, _typed(flat, at, n, old))
            if leaders is not None:
                leaders.broadcast(flat, src=0, what=f"broadcast of {what} to the node leaders")
                if rank == 0:
                    stats.bytes_sent += nbytes * (len(nodes.leaders) - 1)
                    for k in range(1, len(nodes.ranks)):
                        stats.bytes_sent_per_node[k] += nbytes
                else:
                    stats.bytes_received += nbytes
        if rank == 0:
            for (name, *_), _, _ in group:
                source.release(name)
        if in_node is not None:
            in_node.broadcast(flat, src=leader, what=f"broadcast of {what} within the node")
            if rank == leader:
                stats.bytes_sent += nbytes * (len(node) - 1)
                if rank == 0:
                    stats.bytes_sent_per_node[0] += nbytes * (len(node) - 1)
            else:
                stats.bytes_received += nbytes
        install_from(group, flat, replicated_device)
        del flat
    stats.local_tensors = len(own) + sum(1 for r in replicated if r[0] in local_names) if rank == leader else 0
    if rank == leader:
        stats.bytes_read_locally += sum(
            (b - a) * i.row_bytes(r) for i in own for r in node for a, b in [i.ranges[r]]
        )
