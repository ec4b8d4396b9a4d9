"""The bucket plan of the rank-0 distribution: every rank computes the same one from the same inputs.

A tensor is cut into *units*: unit ``k`` holds, for every rank, up to ``s`` rows of that rank's block, so a
unit never exceeds the bucket budget even when one tensor is larger than it. Units are packed into buckets
while ``world_size`` slots of the largest rank's bytes fit the budget (``dist.scatter`` sends equal sizes).

The plan is compact: a bucket stores runs of units (a tensor and a range of unit indices), not one piece
per rank, so planning takes O(units) vectors of ``world_size`` integers (a 70B model for 512 ranks in well
under a second) and memory proportional to the number of buckets. Pieces are derived when a bucket is
moved: a rank other than 0 derives only its own (:meth:`_Bucket.pieces_of`), rank 0 every rank's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..io.blocks import Box, block_cols

_ALIGN = 16  # byte alignment of each piece inside a bucket buffer (so that `.view(dtype)` is legal)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def bucket_budget(bucket_bytes: int, prefetch_buckets: int, world_size: int) -> int:
    """Bytes of one bucket: ``bucket_bytes // (prefetch_buckets + 2)``, at least ``_ALIGN`` bytes per rank.

    Rank 0 keeps at most ``prefetch_buckets + 1`` buckets alive plus one conversion temporary no larger than a
    bucket, so its cast copies in flight stay within ``bucket_bytes`` (what ``MemSafePlugin.bucket_bytes``
    promises); every other rank receives its slot of a bucket (at most this size / ``world_size``) in place or
    into one of two alternating staging buffers.

    Example:
        >>> bucket_budget(64 * 2**20, 2, world_size=8) == 16 * 2**20
        True
    """
    return max(_ALIGN * world_size, bucket_bytes // (prefetch_buckets + 2))


@dataclass
class _Cut:
    """How a tensor is cut into units (the same on every rank)."""

    rows: int
    """Rows of each rank's block per unit (1 when ``split``)."""
    split: bool
    """One row per unit is still larger than a rank's share of the budget: each row is cut along dim 1."""
    cols: int
    """Indices of dim 1 per unit when ``split``."""
    per_row: int
    """Units per row when ``split``."""
    steps: int
    """Number of units (at least 1, so that every tensor ends in some bucket)."""


@dataclass(eq=False)
class _Sharded:
    name: str
    param: Any  # DTensor
    dtype: torch.dtype
    shape: tuple[int, ...]
    boxes: list[Box] = field(default_factory=list)  # each rank's block
    cut: _Cut | None = None  # set by plan_buckets
    wire: torch.dtype | None = None
    """The narrower float dtype rank 0 sends it in, widened by each receiver (``None``: ``dtype``); rank 0's
    choice, broadcast with the layout (:func:`~accelerate_memsafe.distributed.scatter.follow_rank0_layout`)."""
    _geometry: tuple[Any, ...] | None = field(default=None, repr=False)

    def _geo(self) -> tuple[Any, ...]:
        """``(boxes, first row, rows, bytes of one row, width of dim 1, ranges)`` of every rank's block, as
        int64 tensors over the ranks (and ``ranges`` as a list), computed once per ``boxes``: the plan reads
        them for every rank and unit."""
        if self._geometry is None or self._geometry[0] is not self.boxes:
            t = torch.tensor(self.boxes, dtype=torch.int64).view(len(self.boxes), 2, -1)
            first, size = t[:, 0, 0], t[:, 1]
            rows = size[:, 0]
            row = size[:, 1:].prod(dim=1) * self.dtype.itemsize
            width = size[:, 1] if size.shape[1] > 1 else torch.ones_like(rows)
            ranges = list(zip(first.tolist(), (first + rows).tolist()))
            self._geometry = (self.boxes, first, rows, row, width, ranges, row.tolist(), width.tolist())
        return self._geometry

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """Rows (dim 0) of each rank's block."""
        return self._geo()[5]

    def row_bytes(self, rank: int) -> int:
        """Bytes of one row of ``rank``'s block."""
        return self._geo()[6][rank]

    def cols(self, rank: int) -> tuple[slice, ...] | None:
        """``rank``'s slices of dimensions 1.. (``None``: whole rows, as under FSDP alone)."""
        return block_cols(self.boxes[rank], self.shape)

    def slice_bytes(self, rank: int) -> int:
        """Bytes of one index of dim 1 within one row of ``rank``'s block (tensors of 2+ dims)."""
        width = self.width(rank)
        return self.row_bytes(rank) // width if width else 0

    def width(self, rank: int) -> int:
        """Indices of dim 1 in ``rank``'s block (1 for a 1-D tensor)."""
        return self._geo()[7][rank]


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


def _unit_piece(item: _Sharded, k: int, rank: int) -> tuple[int, int, tuple[int, int] | None, int] | None:
    """``rank``'s part of unit ``k`` of ``item``: ``(start, stop, sub, aligned bytes)``, or ``None``."""
    cut = item.cut
    a, b = item.ranges[rank]
    if cut.split:
        row, j = divmod(k, cut.per_row)
        c0, c1 = j * cut.cols, min((j + 1) * cut.cols, item.width(rank))
        if a + row >= b or c1 <= c0:
            return None
        return a + row, a + row + 1, (c0, c1), _align((c1 - c0) * item.slice_bytes(rank))
    s, e = min(a + k * cut.rows, b), min(a + (k + 1) * cut.rows, b)
    if e <= s:
        return None
    return s, e, None, _align((e - s) * item.row_bytes(rank))


@dataclass
class _Bucket:
    index: int
    units: list[tuple[_Sharded, int, int]] = field(default_factory=list)
    """Runs of units: ``(tensor, first, end)`` holds units ``first .. end - 1`` of that tensor, in order."""
    slot_bytes: int = 0
    last_of: list[str] = field(default_factory=list)  # tensors whose last rows are in this bucket

    def pieces_of(self, ranks: int | Iterable[int]) -> list[_Piece]:
        """The pieces of ``ranks`` (one rank or several), unit by unit and, within a unit, by rank, each at
        its byte offset in its rank's slot."""
        ranks = [ranks] if isinstance(ranks, int) else sorted(set(ranks))
        used = dict.fromkeys(ranks, 0)
        out = []
        for item, first, end in self.units:
            for k in range(first, end):
                for r in ranks:
                    part = _unit_piece(item, k, r)
                    if part is not None:
                        s, e, sub, n = part
                        out.append(_Piece(item, r, s, e, used[r], sub))
                        used[r] += n
        return out

    @property
    def pieces(self) -> list[_Piece]:
        """Every rank's pieces (rank 0 fills every slot)."""
        if not self.units:
            return []
        return self.pieces_of(range(len(self.units[0][0].boxes)))


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


def cut_tensor(item: _Sharded, world_size: int, per_rank: int) -> _Cut:
    """How ``item`` is cut into units of at most ``per_rank`` bytes per rank (``per_rank`` a multiple of
    the alignment). A tensor of 2+ dims whose single row exceeds it (a fused MoE expert) is cut along dim 1
    as well, so only a single dim-1 slice of a row larger than ``per_rank`` can exceed it."""
    _, _, length, row, width = item._geo()[:5]
    longest, widest = int(length.max()), int(row.max())
    if widest > per_rank and len(item.shape) >= 2:
        cols = max(1, per_rank // max(1, int((row // width.clamp(min=1)).max())))
        per_row = max(1, -(-int(width.max()) // cols))
        return _Cut(1, True, cols, per_row, max(1, longest * per_row))
    rows = max(1, per_rank // max(1, widest))
    return _Cut(rows, False, 0, 0, max(1, -(-longest // rows)))


def _unit_bytes(item: _Sharded, world_size: int) -> torch.Tensor:
    """Aligned bytes of every rank in every unit of ``item``: an int64 tensor ``(units, world_size)``."""
    cut = item.cut
    _, _, length, per, width = item._geo()[:5]
    k = torch.arange(cut.steps, dtype=torch.int64)[:, None]
    if cut.split:
        per = per // width.clamp(min=1)
        c0 = (k % cut.per_row) * cut.cols
        n = (torch.minimum(c0 + cut.cols, width) - c0).clamp(min=0) * ((k // cut.per_row) < length)
    else:
        n = (length - k * cut.rows).clamp(min=0, max=cut.rows)
    return (n * per + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_buckets(items: list[_Sharded], world_size: int, bucket_budget: int) -> list[_Bucket]:
    """Cuts tensors into units and packs units into buckets.

    A bucket costs ``world_size`` buffers of its largest per-rank size (``dist.scatter`` sends equal
    sizes); units are added while that cost stays within ``bucket_budget``. A unit holds at most
    ``bucket_budget / world_size`` bytes per rank (see :func:`cut_tensor`). The cost of a bucket with one
    more unit is ``world_size x max(top, used[r] + n[r])``: one vector operation over the ranks per unit.
    """
    per_rank = max(_ALIGN, bucket_budget // world_size // _ALIGN * _ALIGN)
    buckets: list[_Bucket] = []
    cur = _Bucket(0)
    used = torch.zeros(world_size, dtype=torch.int64)
    top = 0

    def close() -> None:
        nonlocal cur, used, top
        if cur.units or cur.last_of:
            cur.slot_bytes = top
            buckets.append(cur)
            cur = _Bucket(len(buckets))
        used = torch.zeros(world_size, dtype=torch.int64)
        top = 0

    for item in items:
        item.cut = cut_tensor(item, world_size, per_rank)
        sizes = _unit_bytes(item, world_size)
        first = 0
        for k in range(item.cut.steps):
            n = sizes[k]
            after = used + n
            m = int(after.max())
            if top and world_size * max(top, m) > bucket_budget:
                if k > first:
                    cur.units.append((item, first, k))
                close()
                first, after, m = k, n.clone(), int(n.max())
            used = after
            top = max(top, m)
        cur.units.append((item, first, item.cut.steps))
        cur.last_of.append(item.name)
    close()
    return buckets
