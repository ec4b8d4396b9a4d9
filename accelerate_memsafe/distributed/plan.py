"""The bucket plan of the rank-0 distribution: every rank computes the same one from the same inputs.

A tensor is cut into *units*: unit ``k`` holds, for every rank, up to ``s`` rows of that rank's block, so a
unit never exceeds the bucket budget even when one tensor is larger than it. Units are packed into buckets
while ``world_size`` slots of the largest rank's bytes fit the budget (``dist.scatter`` sends equal sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..io.blocks import Box, block_cols

_ALIGN = 16  # byte alignment of each piece inside a bucket buffer (so that `.view(dtype)` is legal)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class _Sharded:
    name: str
    param: Any  # DTensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    boxes: list[Box] = field(default_factory=list)  # each rank's block

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Rows (dim 0) of each rank's block."""
        return [(o[0], o[0] + z[0]) for o, z in self.boxes]

    def row_bytes(self, rank: int) -> int:
        """Bytes of one row of ``rank``'s block."""
        n = self.dtype.itemsize
        for z in self.boxes[rank][1][1:]:
            n *= z
        return n

    def cols(self, rank: int) -> tuple[slice, ...] | None:
        """``rank``'s slices of dimensions 1.. (``None``: whole rows, as under FSDP alone)."""
        return block_cols(self.boxes[rank], self.shape)


@dataclass
class _Piece:
    item: _Sharded
    rank: int
    start: int  # global rows [start, stop)
    stop: int
    offset: int  # byte offset in that rank's buffer


@dataclass
class _Bucket:
    index: int
    pieces: list[_Piece] = field(default_factory=list)
    slot_bytes: int = 0
    last_of: list[str] = field(default_factory=list)  # tensors whose last rows are in this bucket


def shard_rows(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows of a ``Shard(0)`` tensor with ``n`` rows that ``rank`` owns (``torch.chunk`` semantics).

    Example:
        >>> [shard_rows(5, 2, r) for r in range(2)], shard_rows(1, 2, 1)
        ([(0, 3), (3, 5)], (1, 1))
    """
    c = -(-n // world_size) if n else 0
    return min(rank * c, n), min((rank + 1) * c, n)


def row_boxes(shape: tuple[int, ...], world_size: int) -> list[Box]:
    """Each rank's block of a tensor sharded ``Shard(0)`` over a 1-D mesh of ``world_size`` ranks.

    Example:
        >>> row_boxes((5, 2), 2)
        [((0, 0), (3, 2)), ((3, 0), (2, 2))]
    """
    out = []
    for r in range(world_size):
        a, b = shard_rows(shape[0], world_size, r)
        out.append(((a, *(0 for _ in shape[1:])), (b - a, *shape[1:])))
    return out


def plan_buckets(items: list[_Sharded], world_size: int, bucket_budget: int) -> list[_Bucket]:
    """Cuts tensors into units and packs units into buckets.

    A bucket costs ``world_size`` buffers of its largest per-rank size (``dist.scatter`` sends equal
    sizes); units are added while that cost stays within ``bucket_budget``. A unit holds at most
    ``bucket_budget / world_size`` bytes per rank, so only a single row larger than that can exceed it.
    """
    buckets: list[_Bucket] = []
    cur = _Bucket(0)
    used = [0] * world_size
    top = 0  # max(used)

    def close() -> None:
        nonlocal cur, used, top
        if cur.pieces or cur.last_of:
            cur.slot_bytes = top
            buckets.append(cur)
            cur = _Bucket(len(buckets))
        used = [0] * world_size
        top = 0

    per_rank = bucket_budget // world_size
    for item in items:
        ranges = item.ranges
        longest = max(b - a for a, b in ranges)
        rows = max(1, (per_rank - _ALIGN) // max(1, max(item.row_bytes(r) for r in range(world_size))))
        k = 0
        while True:
            unit = []
            for r, (a, b) in enumerate(ranges):
                s, e = min(a + k * rows, b), min(a + (k + 1) * rows, b)
                if e > s:
                    unit.append((r, s, e, _align((e - s) * item.row_bytes(r))))
            # the bucket's cost with the unit: world_size slots of the largest rank's bytes (O(world) per unit)
            if top and world_size * max(top, max((used[r] + n for r, _, _, n in unit), default=0)) > bucket_budget:
                close()
            for r, s, e, n in unit:
                cur.pieces.append(_Piece(item, r, s, e, used[r]))
                used[r] += n
                top = max(top, used[r])
            k += 1
            if k * rows >= longest:
                break
        cur.last_of.append(item.name)
    close()
    return buckets


