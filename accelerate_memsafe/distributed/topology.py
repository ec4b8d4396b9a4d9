"""Which ranks share a node, and the process groups of the ``node`` load source.

A node is named by the launcher's node index (torchrun's ``GROUP_RANK``, set by ``accelerate launch
--machine_rank``) and, when the launcher does not say, by the host name. One all-gather of these names
gives every rank the same list of nodes; each node's *leader* is its lowest rank (local rank 0), so rank 0
leads its own node.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..env import launch_env
from .collectives import Collectives


@dataclass(frozen=True)
class Nodes:
    """The ranks of each node, in the order of their lowest rank.

    Example:
        >>> n = Nodes(((0, 1), (2, 3)))
        >>> n.leaders, n.node_of(3), n.is_leader(2)
        ((0, 2), (2, 3), True)
    """

    ranks: tuple[tuple[int, ...], ...]

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(r[0] for r in self.ranks)

    def node_of(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s node."""
        return next(r for r in self.ranks if rank in r)

    def leader_of(self, rank: int) -> int:
        return self.node_of(rank)[0]

    def is_leader(self, rank: int) -> bool:
        return rank in self.leaders


def node_key() -> str:
    """This process's node name: the launcher's node index, else the host name."""
    group = launch_env().group_rank
    return f"node {group}" if group >= 0 else f"host {socket.gethostname()}"


def find_nodes(coll: Collectives) -> Nodes:
    """Every rank's node, agreed by one all-gather (same result on every rank).

    Example:
        >>> # find_nodes(Collectives("rank0_distribute", timeout_s=60)).ranks  ->  ((0, 1), (2, 3))
    """
    keys = coll.all_gather_object(node_key(), what="all_gather of every rank's node")
    by_key: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        by_key.setdefault(key, []).append(rank)
    return Nodes(tuple(sorted((tuple(r) for r in by_key.values()), key=lambda r: r[0])))


# Groups are made once per layout: every rank must create every group, in the same order.
_GROUPS: dict[tuple[tuple[int, ...], ...], tuple[Any, Any]] = {}


def node_groups(nodes: Nodes, rank: int) -> tuple[Any, Any]:
    """``(this rank's node group, the leaders' group)``; ``None`` for a group this rank is not in, or one
    of a single rank (nothing to send). Every rank must call it with the same ``nodes``."""
    if nodes.ranks not in _GROUPS:
        made = {r: dist.new_group(list(r)) if len(r) > 1 else None for r in nodes.ranks}
        leaders = dist.new_group(list(nodes.leaders)) if len(nodes.leaders) > 1 else None
        _GROUPS[nodes.ranks] = (made, leaders)
    made, leaders = _GROUPS[nodes.ranks]
    return made[nodes.node_of(rank)], leaders if nodes.is_leader(rank) else None
