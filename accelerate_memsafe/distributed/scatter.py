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

Memory bound on rank 0: a background thread prepares buckets ahead of the one being sent; a semaphore
keeps at most ``prefetch_buckets + 1`` buckets alive, each of at most
``bucket_bytes // (prefetch_buckets + 2)`` bytes, plus one unit-sized conversion temporary: the cast
copies alive at once never exceed ``bucket_bytes``.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _compat
from ..memory.progress import byte_progress
from ..errors import CheckpointError, StageError
from ..io.blocks import Box, block_cols, local_block
from ..io.mapped_pages import CleanFilePages
from ..io.safetensors_source import SafetensorsSource
from .collectives import Collectives
from .meta import difference_from_rank0
from .sharding import canonical_name

_ALIGN = 16  # byte alignment of each piece inside a bucket buffer (so that `.view(dtype)` is legal)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


# ---------------------------------------------------------------------------------------------------
# Sources (rank 0 only)
# ---------------------------------------------------------------------------------------------------
class Rank0Source:
    """Where rank 0 reads the weights from: the model's original tensors (possibly mmap-backed), or, per
    tensor, a safetensors checkpoint read with ``pread``.

    Args:
        tensors: Canonical name -> the original tensor (kept alive only until it has been sent).
        checkpoint: Optional lazily read checkpoint.
        from_checkpoint: Names to read from ``checkpoint`` instead of ``tensors``.

    Example:
        >>> src = Rank0Source({"w": torch.arange(6.).view(3, 2)})
        >>> out = torch.empty(2, 2, dtype=torch.float64); src.read_rows("w", 1, 3, out); out[0].tolist()
        [2.0, 3.0]
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        checkpoint: SafetensorsSource | None = None,
        from_checkpoint: set[str] | None = None,
    ) -> None:
        self.tensors = dict(tensors)
        self._aliases: dict[int, list[str]] = {}
        for name, t in self.tensors.items():
            self._aliases.setdefault(id(t), []).append(name)
        self.checkpoint = checkpoint
        self.from_checkpoint = set(from_checkpoint or ())
        self._pages = CleanFilePages({id(t): t for t in self.tensors.values()}.values())
        self._mapped: set[str] = set()  # checkpoint names that were read through the mapping after all
        self.released_bytes = 0

    def is_meta(self, name: str) -> bool:
        return name not in self.from_checkpoint and self.tensors[name].is_meta

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor, cols: tuple[slice, ...] | None = None) -> None:
        """Copies rows ``[start, stop)`` of ``name`` into ``out``, casting to ``out.dtype`` on the way
        (a 0-d tensor, e.g. a learned activation scalar, is its own single row). ``cols``: the slices of
        the other dimensions to copy (a TP block), ``None`` for whole rows."""
        if out.dim() == 0:
            out = out.view(1)
        if name in self.from_checkpoint:  # one read: the piece is already bounded by the bucket
            self.checkpoint.read_block(name, (start, stop), cols, out, chunk_bytes=(stop - start) * self.checkpoint.entries[name].row_bytes)
            return
        t = self.tensors[name]
        src = t[start:stop] if t.dim() else t
        out.copy_(src if cols is None else src[(slice(None), *cols)])

    def rows_view(self, name: str, start: int, stop: int, dtype: torch.dtype, cols: tuple[slice, ...] | None) -> torch.Tensor | None:
        """Rows ``[start, stop)`` of ``name`` as the bytes of rank 0's own tensor, when they can be sent as
        they are (same dtype, whole rows, contiguous): no copy. ``None`` otherwise.

        Example:
            >>> src = Rank0Source({"w": torch.arange(6.).view(3, 2)})
            >>> src.rows_view("w", 1, 2, torch.float32, None).numel(), src.rows_view("w", 1, 2, torch.float64, None)
            (8, None)
        """
        t = self.tensors.get(name)
        if t is None or t.is_meta or t.dtype != dtype or cols is not None or t.dim() == 0 or not t.is_contiguous():
            return None
        if t.device.type != "cpu":
            return None
        self._mapped.add(name)
        return t[start:stop].reshape(-1).view(torch.uint8)

    def release(self, name: str) -> None:
        """Drops the source of ``name`` once it has been sent; returns file-backed pages to the kernel."""
        t = self.tensors.pop(name, None)
        for alias in self._aliases.pop(id(t), ()) if t is not None else ():
            self.tensors.pop(alias, None)  # the other names of a tie: the tensor has been sent
        if t is None or (name in self.from_checkpoint and name not in self._mapped):
            return
        self.released_bytes += self._pages.drop(t)

    def close(self) -> None:
        self.tensors.clear()
        if self.checkpoint is not None:
            self.checkpoint.close()


# ---------------------------------------------------------------------------------------------------
# The plan (every rank computes the same one)
# ---------------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------------
# Bounded prefetch (rank 0)
# ---------------------------------------------------------------------------------------------------
class BoundedPrefetcher:
    """Runs ``produce(bucket)`` for each bucket in a background thread, keeping at most ``max_alive``
    results alive (produced and not yet released by the consumer): a hard bound, unlike a queue size.

    The thread re-enters the caller's dispatch modes so that a live-tensor tracker sees its allocations.

    Example:
        >>> pf = BoundedPrefetcher(lambda b: b * 2, [1, 2, 3], max_alive=2)
        >>> out = []
        >>> for x in pf:
        ...     out.append(x); pf.release()
        >>> out
        [2, 4, 6]
    """

    def __init__(self, produce: Any, items: list[Any], *, max_alive: int) -> None:
        self._produce = produce
        self._items = items
        self._sem = threading.Semaphore(max_alive)
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._modes = _compat.current_dispatch_modes()
        self._thread = threading.Thread(target=self._run, name="memsafe-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.ExitStack() as stack:
            try:
                for mode in self._modes:
                    stack.enter_context(mode)
            except Exception:
                pass
            try:
                with torch.no_grad():
                    for item in self._items:
                        while not self._sem.acquire(timeout=0.1):
                            if self._stop.is_set():
                                return
                        if self._stop.is_set():
                            return
                        self._queue.put(("ok", self._produce(item)))
            except BaseException as exc:
                self._queue.put(("error", exc))

    def __iter__(self) -> Iterator[Any]:
        for _ in self._items:
            status, value = self._queue.get()
            if status == "error":
                raise value
            yield value
            value = None

    def release(self) -> None:
        """Says the consumer dropped the last result it got (lets the thread produce the next one)."""
        self._sem.release()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# ---------------------------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------------------------
@dataclass
class DistributeStats:
    """Figures for the stage report."""

    buckets: int = 0
    sharded_tensors: int = 0
    replicated_tensors: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    bucket_budget: int = 0
    madvised_bytes: int = 0
    from_checkpoint: int = 0
    local_tensors: int = 0
    """Weights every rank read from the checkpoint itself (``load_source``), not sent by rank 0."""
    bytes_read_locally: int = 0
    bytes_sent_per_node: list[int] = field(default_factory=list)
    """``node`` source, on rank 0: the bytes it sent to each node's ranks (its own node first)."""


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


def follow_rank0_layout(
    sharded: list[_Sharded],
    replicated: list[tuple[str, nn.Module, str, torch.Tensor, bool]],
    coll: Collectives,
    *,
    rank0_problem: str | None = None,
) -> tuple[list[_Sharded], list[tuple[str, nn.Module, str, torch.Tensor, bool]]]:
    """One plan for all ranks: rank 0's list of tensors (names, order, shapes, dtypes) is broadcast, and
    every rank orders its own tensors by it. The bucket plan is then computed from identical inputs on
    every rank, so no collective can ever see the ranks disagree on sizes. A rank whose tensors differ
    from rank 0's makes every rank raise (one all-gather of a flag) before any byte moves.

    Args:
        rank0_problem: Why rank 0 cannot send (e.g. weights missing from its source): shared in the same
            broadcast, so that every rank raises it.

    Returns:
        ``(sharded, replicated)`` in rank 0's order.

    Raises:
        CheckpointError: On every rank, with rank 0's problem.
        StageError: On every rank, naming the ranks and their first differences.
    """
    layout = [("s", i.name, i.shape, str(i.dtype)) for i in sharded]
    layout += [("r", name, tuple(t.shape), str(t.dtype)) for name, _, _, t, _ in replicated]
    ref, problem0 = coll.broadcast_object((layout, rank0_problem), src=0, what="broadcast of rank 0's distribution layout")
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


def _install(mod: nn.Module, local: str, old: torch.Tensor, t: torch.Tensor, is_param: bool) -> None:
    """Puts ``t`` in place of the replicated parameter or buffer ``old`` (a parameter keeps its identity)."""
    if is_param:
        torch.utils.swap_tensors(old, nn.Parameter(t, requires_grad=old.requires_grad))
    else:
        mod._buffers[local] = t


def fill_slots(bucket: _Bucket, slot_of: Any, source: Rank0Source, *, ranks: Any = None, check_finite: bool = False,
               release: bool = True) -> None:
    """Reads each piece of ``bucket`` (for the ranks in ``ranks``, default all) from ``source`` into the
    buffer ``slot_of(rank)``, cast to the parameter's dtype; releases the tensors whose last rows it read
    (``release=False``: the caller does, once the bucket is sent).

    Raises:
        CheckpointError: If ``check_finite`` and a piece holds NaN or Inf.
    """
    for piece in bucket.pieces:
        if ranks is not None and piece.rank not in ranks:
            continue
        item = piece.item
        n = piece.stop - piece.start
        out = slot_of(piece.rank)[piece.offset : piece.offset + n * item.row_bytes(piece.rank)]
        out = out.view(item.dtype).view(n, *item.boxes[piece.rank][1][1:])
        source.read_rows(item.name, piece.start, piece.stop, out, item.cols(piece.rank))
        if check_finite and item.dtype.is_floating_point and not torch.isfinite(out).all():
            raise CheckpointError(
                f"weight `{item.name}` (rows {piece.start}..{piece.stop}) on rank 0 contains NaN or Inf; "
                "fix the checkpoint or turn off `check_finite_weights`."
            )
    if release:
        for name in bucket.last_of:
            source.release(name)


def unpack_slot(bucket: _Bucket, buf: torch.Tensor, rank: int, locals_: dict[str, torch.Tensor]) -> None:
    """Copies this rank's pieces of ``bucket`` from the received ``buf`` into its local shards."""
    for piece in bucket.pieces:
        if piece.rank != rank:
            continue
        item = piece.item
        n = piece.stop - piece.start
        a = item.ranges[rank][0]
        src = buf[piece.offset : piece.offset + n * item.row_bytes(rank)].view(item.dtype).view(n, *item.boxes[rank][1][1:])
        locals_[item.name][piece.start - a : piece.stop - a].copy_(src)


def direct_region(bucket: _Bucket, rank: int, locals_: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The bytes of this rank's local shard that ``bucket`` fills, when they can be the scatter's output
    itself (no staging copy): one piece, at offset 0, exactly a slot long, contiguous, on the
    collective's device. ``None`` otherwise."""
    mine = [p for p in bucket.pieces if p.rank == rank]
    if len(mine) != 1 or mine[0].offset != 0:
        return None
    piece = mine[0]
    a = piece.item.ranges[rank][0]
    region = locals_[piece.item.name][piece.start - a : piece.stop - a]
    if region.dim() == 0 or region.device != device or not region.is_contiguous():
        return None
    if region.numel() * region.element_size() != bucket.slot_bytes:
        return None
    return region.reshape(-1).view(torch.uint8)


def _as_is(bucket: _Bucket, rank: int, source: Rank0Source) -> torch.Tensor | None:
    """Rank ``rank``'s whole slot of ``bucket`` as a view of rank 0's tensor (see :meth:`Rank0Source.rows_view`)."""
    mine = [p for p in bucket.pieces if p.rank == rank]
    if len(mine) != 1 or mine[0].offset != 0:
        return None
    p = mine[0]
    view = source.rows_view(p.item.name, p.start, p.stop, p.item.dtype, p.item.cols(rank))
    return view if view is not None and view.numel() == bucket.slot_bytes else None


class BufferRing:
    """Reusable byte buffers (at most as many as the prefetch keeps alive): no fresh allocation, and no
    page faults on fresh pages, per bucket. Thread-safe: the prefetch thread takes, the sender gives back.

    Example:
        >>> ring = BufferRing(8, torch.device("cpu"))
        >>> a = ring.take(); ring.give(a); ring.take() is a
        True
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self) -> torch.Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
        return torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)


def _send_flat(sharded, replicated, *, source, coll: Collectives, locals_, budget: int, prefetch_buckets: int,
               device: torch.device, check_finite: bool, progress: bool, stats: DistributeStats) -> None:
    """Rank 0 scatters every bucket to all ranks, and broadcasts the replicated tensors.

    Buffers are reused (:class:`BufferRing` on rank 0, one staging buffer elsewhere), and a rank whose part
    of a bucket is one contiguous piece of its shard receives it in place (:func:`direct_region`); rank 0
    reads its own piece straight into its shard.
    """
    rank, world = coll.rank, coll.world_size
    buckets = plan_buckets(sharded, world, budget)
    stats.buckets = len(buckets)
    largest = max((b.slot_bytes for b in buckets), default=0)
    if rank == 0:
        ring = BufferRing(world * largest, coll.device)

        def produce(bucket: _Bucket) -> tuple[torch.Tensor, list[torch.Tensor], bool]:
            flat = ring.take()
            n = bucket.slot_bytes
            slots = [flat[r * n : (r + 1) * n] for r in range(world)]
            own = direct_region(bucket, 0, locals_, coll.device)
            if own is not None:
                slots[0] = own
            # a rank's whole slot that is rows of rank 0's tensor as they are: sent from there, not copied
            fill = set(range(world))
            if not check_finite and coll.device.type == "cpu":
                for r in range(1, world):
                    view = _as_is(bucket, r, source)
                    if view is not None:
                        slots[r] = view
                        fill.discard(r)
            fill_slots(bucket, slots.__getitem__, source, ranks=fill, check_finite=check_finite, release=False)
            return flat, slots, own is not None

        prefetcher = BoundedPrefetcher(produce, buckets, max_alive=prefetch_buckets + 1)
        total = sum(b.slot_bytes for b in buckets) * world
        bar = byte_progress(total, "rank0_distribute: scatter", enabled=progress, rank=rank)
        try:
            for bucket, (flat, slots, in_place) in zip(buckets, prefetcher):
                coll.scatter(slots[0], slots, src=0, what=f"scatter of bucket {bucket.index + 1}/{len(buckets)}")
                if not in_place:
                    unpack_slot(bucket, slots[0], rank, locals_)
                for name in bucket.last_of:  # after the send: a piece may have been sent from the tensor itself
                    source.release(name)
                stats.bytes_sent += bucket.slot_bytes * (world - 1)
                bar.update(bucket.slot_bytes * world)
                del slots
                ring.give(flat)
                prefetcher.release()
        finally:
            bar.close()
            prefetcher.close()
    else:
        staging = None
        for bucket in buckets:
            what = f"scatter of bucket {bucket.index + 1}/{len(buckets)}"
            region = direct_region(bucket, rank, locals_, coll.device)
            if region is not None:
                coll.scatter(region, None, src=0, what=what)
            else:
                if staging is None:
                    staging = torch.empty(largest, dtype=torch.uint8, device=coll.device)
                buf = staging[: bucket.slot_bytes]
                coll.scatter(buf, None, src=0, what=what)
                unpack_slot(bucket, buf, rank, locals_)
            stats.bytes_received += bucket.slot_bytes
        del staging

    for name, mod, local, old, is_param in replicated:
        t = torch.empty(old.shape, dtype=old.dtype, device=device)
        if rank == 0:
            source.read_rows(name, 0, old.shape[0] if old.dim() else 1, t)
            source.release(name)
        coll.broadcast(t, src=0, what=f"broadcast of `{name}`")
        if rank == 0:
            stats.bytes_sent += t.numel() * t.element_size() * (world - 1)
        else:
            stats.bytes_received += t.numel() * t.element_size()
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
    sharded, replicated = follow_rank0_layout(sharded, replicated, coll, rank0_problem=problem)
    gather_boxes(sharded, coll)
    budget = max(_ALIGN * world, bucket_bytes // (prefetch_buckets + 2))
    stats = DistributeStats(sharded_tensors=len(sharded), replicated_tensors=len(replicated), bucket_budget=budget)
    if rank == 0:
        stats.from_checkpoint = len(source.from_checkpoint)
    materialize_meta_shards(model, device)
    local_names = set(local_names or ())
    if nodes is None and local_source is None:
        local_names = set()
    if nodes is None and local_names:
        _read_local(sharded, replicated, local_names, local_source, rank=rank, budget=budget, stats=stats,
                    release=source.release if rank == 0 else None, device=device)
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
                         locals_=locals_, budget=budget, prefetch_buckets=prefetch_buckets, device=device,
                         check_finite=check_finite, progress=progress, timeout_s=coll.timeout_s, stats=stats)
        else:
            _send_flat(sharded, replicated, source=source, coll=coll, locals_=locals_, budget=budget,
                       prefetch_buckets=prefetch_buckets, device=device, check_finite=check_finite,
                       progress=progress, stats=stats)
    if rank == 0:
        stats.madvised_bytes = source.released_bytes
        source.close()
    return stats
