"""Moving the planned buckets. Rank 0 prepares buckets ahead in a bounded background thread and posts bucket
``k + 1`` before waiting for bucket ``k``.

* On gloo (:func:`_send_p2p`, the CPU path) every piece is one message: sent from rank 0's own tensor as it
  is where no cast is needed (rank 0 copies nothing), received straight into the receiving rank's shard
  where its bytes are contiguous there.
* On other backends (:func:`_send_flat`) each bucket is one ``dist.scatter`` from reusable buffers; a rank
  whose part of a bucket is one contiguous piece of its shard receives it in place.

Memory bound on rank 0: a semaphore keeps at most ``prefetch_buckets + 1`` buckets alive, each of at most
``bucket_bytes // (prefetch_buckets + 2)`` bytes, plus one unit-sized conversion temporary: the cast copies
alive at once never exceed ``bucket_bytes``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import _compat
from ..errors import CheckpointError
from ..memory.progress import byte_progress
from .collectives import Collectives, Pending
from .plan import _Bucket, _Piece, _align, plan_buckets
from .source import Rank0Source

class BoundedPrefetcher:
    """Runs ``produce(bucket)`` for each bucket in a background thread, keeping at most ``max_alive``
    results alive (produced and not yet released by the consumer): a hard bound, unlike a queue size.

    The thread re-enters the caller's dispatch modes so that a live-tensor tracker sees its allocations. A
    ``chore`` handed over with :meth:`release` (e.g. dropping the pages of what was just sent) runs on the thread
    before it produces the next result, off the consumer's critical path; :meth:`close` runs what is left.

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
        self._chores: queue.SimpleQueue = queue.SimpleQueue()
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
                        self._run_chores()
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

    def _run_chores(self) -> None:
        while True:
            try:
                chore = self._chores.get_nowait()
            except queue.Empty:
                return
            chore()

    def release(self, chore: Callable[[], None] | None = None) -> None:
        """Says the consumer dropped the last result it got (lets the thread produce the next one); ``chore``
        runs on the thread first."""
        if chore is not None:
            self._chores.put(chore)
        self._sem.release()

    def close(self) -> None:
        """Stops the thread and runs the chores it did not get to, here."""
        self._stop.set()
        self._thread.join(timeout=30)
        self._run_chores()


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


def _install(mod: nn.Module, local: str, old: torch.Tensor, t: torch.Tensor, is_param: bool) -> None:
    """Puts ``t`` in place of the replicated parameter or buffer ``old`` (a parameter keeps its identity)."""
    if is_param:
        torch.utils.swap_tensors(old, nn.Parameter(t, requires_grad=old.requires_grad))
    else:
        mod._buffers[local] = t


def fill_slots(bucket: _Bucket, slot_of: Any, source: Rank0Source, *, ranks: Any = None, check_finite: bool = False,
               release: bool = True, pieces: list[_Piece] | None = None) -> None:
    """Reads each piece of ``bucket`` (for the ranks in ``ranks``, default all; or the given ``pieces``) from
    ``source`` into the buffer ``slot_of(rank)``, cast to the parameter's dtype; releases the tensors whose
    last rows it read (``release=False``: the caller does, once the bucket is sent).

    Raises:
        CheckpointError: If ``check_finite`` and a piece holds NaN or Inf.
    """
    if pieces is None:
        pieces = bucket.pieces if ranks is None else bucket.pieces_of(ranks)
    for piece in pieces:
        item = piece.item
        out = slot_of(piece.rank)[piece.offset : piece.offset + piece.nbytes]
        out = out.view(item.dtype).view(piece.block_shape())
        source.read_rows(item.name, piece.start, piece.stop, out, piece.cols())
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
    for piece in bucket.pieces_of(rank):
        src = buf[piece.offset : piece.offset + piece.nbytes].view(piece.item.dtype).view(piece.block_shape())
        _region(piece, locals_).copy_(src)


def _region(piece: _Piece, locals_: dict[str, torch.Tensor]) -> torch.Tensor:
    """Where ``piece`` goes in its rank's local shard (rows, and the dim-1 range of a cut row)."""
    a = piece.item.ranges[piece.rank][0]
    dst = locals_[piece.item.name][piece.start - a : piece.stop - a]
    return dst if piece.sub is None else dst[:, piece.sub[0] : piece.sub[1]]


def direct_region(bucket: _Bucket, rank: int, locals_: dict[str, torch.Tensor], device: torch.device,
                  mine: list[_Piece] | None = None) -> torch.Tensor | None:
    """The bytes of this rank's local shard that ``bucket`` fills, when they can be the scatter's output
    itself (no staging copy): one piece, at offset 0, exactly a slot long, contiguous, on the
    collective's device. ``None`` otherwise. ``mine``: this rank's pieces, when already derived."""
    mine = bucket.pieces_of(rank) if mine is None else mine
    if len(mine) != 1 or mine[0].offset != 0 or mine[0].sub is not None:
        return None
    piece = mine[0]
    a = piece.item.ranges[rank][0]
    region = locals_[piece.item.name][piece.start - a : piece.stop - a]
    if region.dim() == 0 or region.device != device or not region.is_contiguous():
        return None
    if region.numel() * region.element_size() != bucket.slot_bytes:
        return None
    return region.reshape(-1).view(torch.uint8)


def _as_is(bucket: _Bucket, mine: list[_Piece], source: Rank0Source) -> torch.Tensor | None:
    """A rank's whole slot of ``bucket`` (``mine``: its pieces) as a view of rank 0's tensor (see
    :meth:`Rank0Source.rows_view`)."""
    if len(mine) != 1 or mine[0].offset != 0 or mine[0].sub is not None:
        return None
    p = mine[0]
    view = source.rows_view(p.item.name, p.start, p.stop, p.item.dtype, p.item.cols(p.rank))
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


def _after_send(source: Rank0Source, views: list[torch.Tensor], names: list[str]) -> Callable[[], None]:
    """What follows a bucket's send on rank 0: drop the checkpoint pages ``views`` mapped to send them, then
    release the sources of ``names`` (see :meth:`Rank0Source.sent` and :meth:`Rank0Source.release`).

    ``views`` must hold the last references to what was sent besides the source's own (the caller hands them over:
    :func:`_hand_over`): the chore drops them before releasing, so a private copy sent as it is (fused experts that
    transformers built in memory) is freed, and trimmed back to the kernel, by this chore, not by the next one."""
    def chore() -> None:
        source.sent(views)
        views.clear()
        for name in names:
            source.release(name)

    return chore


def _hand_over(sent: list, pending: Pending) -> list:
    """Empties ``sent`` (the tensors of a finished send, shared with the double buffer's entry) and drops the
    finished op's handles (a gloo send keeps its tensor while its work object lives), and returns the tensors in a
    new list, now their only reference: :func:`_after_send` frees them with the sources they view."""
    tensors = [t[1] if isinstance(t, tuple) else t for t in sent]
    sent.clear()
    pending.work = None
    return tensors


def double_buffered(coll: Collectives, items: Iterable[Any], post: Callable[[Any], tuple],
                    finish: Callable[[tuple], None]) -> None:
    """Posts the transfer of item ``k + 1`` before finishing item ``k``, so that one transfer is on the wire while
    the previous one completes (and its buffers are handed back).

    Args:
        coll: The stage's collectives.
        items: What to transfer, in order (consumed lazily: a prefetcher bounds what is prepared ahead).
        post: Issues one item's collective; returns what ``finish`` takes, the pending collective last.
        finish: Waits for one posted item and does what follows it.

    Raises:
        Whatever ``post`` or ``finish`` raise, after abandoning every collective still on the wire (the process
        group is marked out of step: :func:`~accelerate_memsafe.distributed.collectives.check_not_abandoned`).

    Example:
        >>> order = []
        >>> double_buffered(None, [1, 2, 3], lambda i: order.append(f"post {i}") or (i, None),
        ...                 lambda p: order.append(f"finish {p[0]}"))
        >>> order
        ['post 1', 'post 2', 'finish 1', 'post 3', 'finish 2', 'finish 3']
    """
    on_wire: list[tuple] = []
    try:
        for item in items:
            on_wire.append(post(item))
            del item
            if len(on_wire) == 2:
                finish(on_wire[0])
                del on_wire[0]
        while on_wire:
            finish(on_wire[0])
            del on_wire[0]
    except BaseException:
        for posted in on_wire:  # raising with transfers still on the wire
            coll.abandon(posted[-1])
        raise


def _send_flat(sharded, replicated, *, source, coll: Collectives, locals_, budget: int, prefetch_buckets: int,
               replicated_device: torch.device, check_finite: bool, progress: bool, stats: DistributeStats) -> None:
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
            by_rank: list[list[_Piece]] = [[] for _ in range(world)]
            for piece in bucket.pieces:
                by_rank[piece.rank].append(piece)
            own = direct_region(bucket, 0, locals_, coll.device, by_rank[0])
            if own is not None:
                slots[0] = own
            # a rank's whole slot that is rows of rank 0's tensor as they are: sent from there, not copied
            if not check_finite and coll.device.type == "cpu":
                for r in range(1, world):
                    view = _as_is(bucket, by_rank[r], source)
                    if view is not None:
                        slots[r] = view
                        by_rank[r] = []
            fill_slots(bucket, slots.__getitem__, source, pieces=[p for mine in by_rank for p in mine],
                       check_finite=check_finite, release=False)
            return flat, slots, own is not None

        prefetcher = BoundedPrefetcher(produce, buckets, max_alive=prefetch_buckets + 1)
        total = sum(b.slot_bytes for b in buckets) * world
        bar = byte_progress(total, "rank0_distribute: scatter", enabled=progress, rank=rank)
        def finish(sent: tuple) -> None:
            bucket, flat, slots, in_place, pending = sent
            coll.finish(pending)
            if not in_place:
                unpack_slot(bucket, slots[0], rank, locals_)
            stats.bytes_sent += bucket.slot_bytes * (world - 1)
            bar.update(bucket.slot_bytes * world)
            ring.give(flat)
            # after the send, on the prefetch thread: the checkpoint's pages mapped to send them (_as_is), and
            # the sources whose last piece this was (a piece may have been sent from the tensor itself)
            prefetcher.release(chore=_after_send(source, _hand_over(slots, pending)[1:], bucket.last_of))

        def post(produced: tuple) -> tuple:
            bucket, (flat, slots, in_place) = produced
            pending = coll.scatter_async(slots[0], slots, src=0, what=f"scatter of bucket {bucket.index + 1}/{len(buckets)}")
            return bucket, flat, slots, in_place, pending

        try:
            double_buffered(coll, zip(buckets, prefetcher), post, finish)
        finally:
            bar.close()
            prefetcher.close()
    else:
        staging: list[torch.Tensor | None] = [None, None]  # two: one receiving while the other is unpacked

        def receive(bucket: _Bucket) -> tuple:
            region = direct_region(bucket, rank, locals_, coll.device)
            buf = None
            if region is None:
                k = bucket.index % 2
                if staging[k] is None:
                    staging[k] = torch.empty(largest, dtype=torch.uint8, device=coll.device)
                buf = staging[k][: bucket.slot_bytes]
            what = f"scatter of bucket {bucket.index + 1}/{len(buckets)}"
            return bucket, buf, coll.scatter_async(region if buf is None else buf, None, src=0, what=what)

        double_buffered(coll, buckets, receive, lambda r: _received(coll, rank, locals_, stats, *r))
        del staging

    _send_replicated(replicated, source=source, coll=coll, budget=budget, device=replicated_device, stats=stats)


def _send_replicated(replicated, *, source, coll: Collectives, budget: int, device: torch.device,
                     stats: DistributeStats) -> None:
    """Rank 0 broadcasts the replicated tensors, packed: one collective per group of at most ``budget`` bytes."""
    rank, world = coll.rank, coll.world_size
    groups = replicated_groups(replicated, budget)
    for i, group in enumerate(groups):
        flat = torch.empty(group[-1][1] + group[-1][2], dtype=torch.uint8, device=coll.device)
        if rank == 0:
            for (name, _, _, old, _), at, n in group:
                source.read_rows(name, 0, old.shape[0] if old.dim() else 1, _typed(flat, at, n, old))
                source.release(name)
        coll.broadcast(flat, src=0, what=f"broadcast of replicated tensors {i + 1}/{len(groups)} ({group[0][0][0]} ...)")
        if rank == 0:
            stats.bytes_sent += flat.numel() * (world - 1)
        else:
            stats.bytes_received += flat.numel()
        install_from(group, flat, device)
        del flat


#: Source dtypes that widen exactly into the shard dtypes of :data:`_WIDE` (every value representable):
#: sent as they are and cast by the receiver, with the same bits as a cast on rank 0.
_NARROW = (torch.float16, torch.bfloat16)
_WIDE = (torch.float32, torch.float64)


def narrow_sources(sharded, source: Rank0Source) -> dict[str, str]:
    """Rank 0's tensors to send in its source's narrower float dtype (a bf16 checkpoint into fp32 shards, as
    under ``mixed_precision``): half the bytes on the wire, no cast on rank 0, a view of the file where the
    rows are whole; each receiver widens its rows as it copies them into its shard (the same bits). Only
    rank 0 knows its source: the choice travels with its layout (:func:`follow_rank0_layout`).

    Example:
        >>> # narrow_sources(sharded, source) -> {"model.embed_tokens.weight": "bfloat16", ...}
    """
    out = {}
    for item in sharded:
        have = source.dtype_of(item.name) if item.name in source.tensors else None
        if have in _NARROW and item.dtype in _WIDE:
            out[item.name] = str(have).removeprefix("torch.")
    return out


def _wire_bytes(piece: _Piece) -> tuple[torch.dtype, int]:
    """The dtype and bytes of ``piece`` on the wire."""
    dtype = piece.item.wire or piece.item.dtype
    return dtype, piece.nbytes // piece.item.dtype.itemsize * dtype.itemsize


def _send_p2p(sharded, replicated, *, source, coll: Collectives, locals_, budget: int, prefetch_buckets: int,
              replicated_device: torch.device, check_finite: bool, progress: bool, stats: DistributeStats) -> None:
    """The CPU (gloo) transport: every piece of the plan is one message, sent from rank 0's tensor as it is
    where it needs no cast (no copy, no bucket buffer: rank 0's private memory stays at its shard) and received
    straight into the receiving rank's shard where its bytes are contiguous there (no staging copy).

    A tensor rank 0 holds in a narrower float dtype than its shards (:func:`narrow_sources`) travels in that
    dtype and is widened by the receiver. Pieces that need a copy on rank 0 (a cast, a TP block's columns,
    ``check_finite``) are read into a reusable :class:`BufferRing` buffer at their planned offsets, so the bound
    on rank 0's copies in flight is that of :func:`_send_flat`. Bucket ``k + 1`` is posted before bucket ``k``
    is waited for; rank 0 prepares buckets ahead in the bounded prefetch thread. Replicated tensors follow, one
    broadcast per group.
    """
    rank, world = coll.rank, coll.world_size
    buckets = plan_buckets(sharded, world, budget)
    stats.buckets = len(buckets)
    largest = max((b.slot_bytes for b in buckets), default=0)
    if rank == 0:
        ring = BufferRing(world * largest, coll.device)
        viewed: set[str] = set()  # tensors a piece of which is sent as rank 0's own bytes (kept until sent)

        def produce(bucket: _Bucket) -> tuple[torch.Tensor | None, list[tuple[int, torch.Tensor]]]:
            flat, sends = None, []
            n = bucket.slot_bytes
            for piece in bucket.pieces:
                item = piece.item
                if piece.rank == 0:
                    source.read_rows(item.name, piece.start, piece.stop, _region(piece, locals_), piece.cols())
                    out = _region(piece, locals_)
                else:
                    dtype, nbytes = _wire_bytes(piece)
                    view = None
                    if not check_finite:
                        view = source.rows_view(item.name, piece.start, piece.stop, dtype, piece.cols())
                    if view is not None and view.numel() == nbytes:
                        sends.append((piece.rank, view))
                        viewed.add(item.name)
                        continue
                    if flat is None:
                        flat = ring.take()
                    at = piece.rank * n + piece.offset
                    raw = flat[at : at + nbytes]
                    out = raw.view(dtype).view(piece.block_shape())
                    source.read_rows(item.name, piece.start, piece.stop, out, piece.cols())
                    sends.append((piece.rank, raw))
                if check_finite and item.dtype.is_floating_point and not torch.isfinite(out).all():
                    raise CheckpointError(
                        f"weight `{item.name}` (rows {piece.start}..{piece.stop}) on rank 0 contains NaN or Inf; "
                        "fix the checkpoint or turn off `check_finite_weights`."
                    )
            # a tensor whose every piece was copied (cast into the ring, or into rank 0's shard) is not needed
            # any more: freed now, before the next bucket is prepared, not once this one is on the wire
            for name in bucket.last_of:
                if name not in viewed:
                    source.release(name)
            return flat, sends

        prefetcher = BoundedPrefetcher(produce, buckets, max_alive=prefetch_buckets + 1)
        total = sum(b.slot_bytes for b in buckets) * world
        bar = byte_progress(total, "rank0_distribute: send", enabled=progress, rank=rank)

        def finish(sent: tuple) -> None:
            bucket, flat, sends, pending = sent
            coll.finish(pending)
            stats.bytes_sent += sum(t.numel() for _, t in sends)
            bar.update(bucket.slot_bytes * world)
            if flat is not None:
                ring.give(flat)
            # after the send, on the prefetch thread: the checkpoint's pages it mapped to send them, and the
            # tensors a piece of which was sent as it is (the others were released once copied)
            views = _hand_over(sends, pending)
            prefetcher.release(chore=_after_send(source, views, [n for n in bucket.last_of if n in viewed]))

        def post(produced: tuple) -> tuple:
            bucket, (flat, sends) = produced
            return bucket, flat, sends, coll.exchange_async(sends, [], what=f"send of bucket {bucket.index + 1}/{len(buckets)}")

        try:
            double_buffered(coll, zip(buckets, prefetcher), post, finish)
        finally:
            bar.close()
            prefetcher.close()
    else:
        staging: list[torch.Tensor | None] = [None, None]  # two: one receiving while the other is unpacked

        def receive(bucket: _Bucket) -> tuple:
            recvs, staged = [], []
            for piece in bucket.pieces_of(rank):
                region = _region(piece, locals_)
                dtype, nbytes = _wire_bytes(piece)
                if dtype == piece.item.dtype and region.is_contiguous() and region.device == coll.device:
                    recvs.append((0, region.reshape(-1).view(torch.uint8)))
                    continue
                k = bucket.index % 2
                if staging[k] is None:
                    staging[k] = torch.empty(largest, dtype=torch.uint8, device=coll.device)
                raw = staging[k][piece.offset : piece.offset + nbytes]
                recvs.append((0, raw))
                staged.append((region, raw.view(dtype).view(piece.block_shape())))  # widened by the copy
            return recvs, staged, coll.exchange_async([], recvs, what=f"receive of bucket {bucket.index + 1}/{len(buckets)}")

        double_buffered(coll, buckets, receive, lambda r: _landed(coll, stats, *r))
        del staging
    _send_replicated(replicated, source=source, coll=coll, budget=budget, device=replicated_device, stats=stats)


def _landed(coll: Collectives, stats: DistributeStats, recvs: list, staged: list, pending: Any) -> None:
    """Waits for a bucket's messages (see :func:`_send_p2p`) and copies the staged ones into place."""
    coll.finish(pending)
    for region, src in staged:
        region.copy_(src)
    stats.bytes_received += sum(t.numel() for _, t in recvs)


def _received(coll: Collectives, rank: int, locals_: dict[str, torch.Tensor], stats: DistributeStats, bucket: _Bucket,
              buf: torch.Tensor | None, pending: Any) -> None:
    """Waits for a bucket posted with ``scatter_async`` and moves it into place (``buf``: a staging buffer to
    unpack; ``None``: it was received in place)."""
    coll.finish(pending)
    if buf is not None:
        unpack_slot(bucket, buf, rank, locals_)
    stats.bytes_received += bucket.slot_bytes


def replicated_groups(replicated: list[Any], budget: int) -> list[list[tuple[Any, int, int]]]:
    """Packs the replicated tensors into groups of at most ``budget`` bytes (a larger tensor alone), each sent
    with one collective: ``[(entry, byte offset, bytes), ...]`` per group, offsets aligned.

    Example:
        >>> m = torch.nn.Linear(2, 2)
        >>> entries = [("a", m, "weight", torch.empty(3, 3), True), ("b", m, "bias", torch.empty(5), True)]
        >>> [[(e[0], at, n) for e, at, n in g] for g in replicated_groups(entries, 68)]
        [[('a', 0, 36), ('b', 48, 20)]]
    """
    groups: list[list[tuple[Any, int, int]]] = []
    used = budget
    for entry in replicated:
        old = entry[3]
        n = old.numel() * old.element_size()
        at = _align(used)
        if not groups or at + n > budget:
            groups.append([])
            at = 0
        groups[-1].append((entry, at, n))
        used = at + n
    return groups


def _typed(flat: torch.Tensor, at: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """Bytes ``[at, at + n)`` of ``flat`` as a tensor of ``like``'s dtype and shape."""
    return flat[at : at + n].view(like.dtype).view(like.shape)


def install_from(group: list[tuple[Any, int, int]], flat: torch.Tensor, device: torch.device) -> None:
    """Installs each replicated tensor of ``group`` from its bytes in the received ``flat`` buffer (a copy
    of its own: a parameter never keeps the whole buffer alive)."""
    for (_, mod, local, old, is_param), at, n in group:
        _install(mod, local, old, _typed(flat, at, n, old).to(device, copy=True), is_param)
