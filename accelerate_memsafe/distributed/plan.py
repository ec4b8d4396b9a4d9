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

    def slice_bytes(self, rank: int) -> int:
        """Bytes of one index of dim 1 within one row of ``rank``'s block (tensors of 2+ dims)."""
        width = self.boxes[rank][1][1]
        return self.row_bytes(rank) // width if width else 0


@dataclass
class _Piece:
    item: _Sharded
    rank: int
    start: int  # global rows [start, stop)
    stop: int
    offset: int  # byte offset in that rank's buffer
    sub: tuple[int, int] | None = None
    """A range of dim 1 within the rank's block, when one row is larger than the budget (fused MoE experts):
    the piece is rows ``[start, stop)`` x that range."""

    @property
    def nbytes(self) -> int:
        if self.sub is None:
            return (self.stop - self.start) * self.item.row_bytes(self.rank)
        return (self.stop - self.start) * (self.sub[1] - self.sub[0]) * self.item.slice_bytes(self.rank)

    def block_shape(self) -> tuple[int, ...]:
        """The piece's shape: rows x the rank's block (dim 1 narrowed to ``sub``)."""
        block = self.item.boxes[self.rank][1]
        if self.sub is None:
            return (self.stop - self.start, *block[1:])
        return (self.stop - self.start, self.sub[1] - self.sub[0], *block[2:])

    def cols(self) -> tuple[slice, ...] | None:
        """The global slices of dims 1.. to read (``None``: whole rows)."""
        cols = self.item.cols(self.rank)
        if self.sub is None:
            return cols
        if cols is None:
            return (slice(self.sub[0], self.sub[1]),) + tuple(slice(None) for _ in self.item.shape[2:])
        first = cols[0].start or 0
        return (slice(first + self.sub[0], first + self.sub[1]), *cols[1:])


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
    ``bucket_budget / world_size`` bytes per rank; a tensor (of 2+ dims) whose single row is larger than
    that (a fused MoE expert) is cut along dim 1 as well, so only a single dim-1 slice of a row larger than
    the per-rank budget can exceed it.
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
        widest = max(item.row_bytes(r) for r in range(world_size))
        rows = max(1, (per_rank - _ALIGN) // max(1, widest))
        split = widest > per_rank - _ALIGN and len(item.shape) >= 2
        if split:  # one row per unit, cut into ranges of dim 1
            cols = max(1, (per_rank - _ALIGN) // max(1, max(item.slice_bytes(r) for r in range(world_size))))
            width = max(item.boxes[r][1][1] for r in range(world_size))
            per_row = max(1, -(-width // cols))
            steps = longest * per_row
        k = 0
        while True:
            unit = []
            for r, (a, b) in enumerate(ranges):
                if split:
                    row, j = divmod(k, per_row)
                    c0, c1 = j * cols, min((j + 1) * cols, item.boxes[r][1][1])
                    if a + row < b and c1 > c0:
                        unit.append((r, a + row, a + row + 1, _align((c1 - c0) * item.slice_bytes(r)), (c0, c1)))
                    continue
                s, e = min(a + k * rows, b), min(a + (k + 1) * rows, b)
                if e > s:
                    unit.append((r, s, e, _align((e - s) * item.row_bytes(r)), None))
            # the bucket's cost with the unit: world_size slots of the largest rank's bytes (O(world) per unit)
            if top and world_size * max(top, max((used[r] + n for r, _, _, n, _ in unit), default=0)) > bucket_budget:
                close()
            for r, s, e, n, sub in unit:
                cur.pieces.append(_Piece(item, r, s, e, used[r], sub))
                used[r] += n
                top = max(top, used[r])
            k += 1
            if (k >= steps) if split else (k * rows >= longest):
                break
        cur.last_of.append(item.name)
    close()
    return buckets


