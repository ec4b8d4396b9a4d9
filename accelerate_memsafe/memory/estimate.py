"""Predict each stage's peak memory per rank from a checkpoint's headers and config (no tensor data is read).

Every figure is the peak of private memory (RssAnon) over the stage's start, what the plugin's report
records (``cpu_anon_peak_bytes - cpu_anon_start_bytes``). Each term follows what the code does; none is
fitted to a benchmark. ``benchmarks/estimate.py`` measures them on models the terms were not derived from
(docs/benchmarks.md, "Estimate vs measured").

The tensors are the model's, not the file's: the model is built on ``meta`` from ``config.json`` (nothing is
allocated), so transformers' conversions are seen (a Qwen3-MoE checkpoint stores one tensor per expert, the
model one fused 3-D tensor per layer). A parameter stored under its own name and shape in the load dtype
is mapped zero-copy by transformers (rank 0's copy is the file's bytes: ``every_rank`` can read it); any
other is built in private memory at load and travels through rank 0's scatter. Without a usable config
the checkpoint's tensors are taken as the parameters.

With N ranks, B = ``bucket_bytes``, k = ``prefetch_buckets``, b = max(16·N, B // (k + 2)) (one bucket's
budget), every size in the training dtype (fp32 under mixed precision):

* shard: each parameter's dim-0 chunk padded to ceil(rows / S) rows, as FSDP2 stores it on every rank
  (10 experts on 4 ranks: 3 rows on each), plus the replicated tensors (persistent buffers); S, the distinct
  blocks of a weight, is N but on a 2-D mesh (:func:`mesh_blocks`): ``dp_shard_size`` under HSDP and under
  FSDP × TP with the plan declined, each block held by ``dp_replicate_size`` (``tp_size``) ranks;
* P: every tensor; T: the largest; C: what the load built in private memory (in the load dtype).

Per stage, rank 0 / the other ranks:

* ``meta_placement``: rank 0 reads the pagemap of the weights it maps (one int64 per 4 KiB page, with a mask
  and its prefix sum: ``PAGEMAP_BYTES_PER_PAGE``), one window of pages at a time; 0 elsewhere.
* ``shard``: ``FULLY_SHARD_OVERHEAD`` (``fully_shard`` on ``meta`` allocates no weight).
* ``rank0_distribute``: shard + max(chunk, ring + piece) / shard + max(chunk, receive), plus one group of
  replicated tensors (at most b) and ``DISTRIBUTE_OVERHEAD``, where

  - chunk (``every_rank``: each rank reads the mapped weights itself): one read of file rows, at most b, when
    the dtype must change (or the shard is on a device); 0 when the rows go straight into the shard;
  - ring (rank 0 sends the rest): at most k + 1 reused buffers of b, in which rank 0 writes the other ranks'
    pieces ((N - 1) / N; its own piece goes straight into its shard): (N - 1) / N · min((k + 1)·b, S), S the
    bytes copied: on gloo only the pieces that need a cast (the others are sent from rank 0's own tensor),
    with other backends all of them (one scatter per bucket);
  - piece: when rank 0 re-reads a mapped weight from the file and casts it, one slot's rows (b / N) in the
    file dtype;
  - receive: on gloo, pieces land in the shard itself (a dim-1 range of one row too: it is contiguous there),
    except those rank 0 sends in a narrower dtype (bf16 rows of fp32 shards), which arrive in one of two
    alternating staging buffers to be widened: the pages of those buffers this rank's pieces write, from the
    distribution's own plan (:func:`staging_touched`: about half of a rank's slot b / N in each); with other
    backends one buffer of b / N.

  On rank 0 (CPU shards) the shard and ring terms are not summed whole: :func:`rank0_send_peak` walks the
  buckets, counting the shard pages written so far, the ring buffers touched, and the private copies already
  freed (e.g. the fused experts transformers built: freed, and trimmed back to the kernel, as soon as their
  last piece is copied, or by the chore that follows the send of its last bucket when a piece went out as its own
  bytes). It assumes the prefetch thread runs k buckets ahead of the sends, the most it may; when the sends keep
  up, fewer ring buffers are touched and copies are freed sooner, so rank 0 may measure lower
  (``benchmarks/estimate.py`` labels a rank-0 row ``released`` when it is below the estimate by more than 25% but
  by no more than the private copies rank 0 frees, :func:`released_by_rank0`).

Each figure is what the stage takes from the kernel. A process whose heap holds memory freed before the stage
(glibc keeps it) measures less where the stage reuses it; ``MemSafePlugin(memory_trim_heap=True)`` hands it back
before each stage, and ``benchmarks/estimate.py`` measures with it.

* ``buffer_init``, ``accelerate.prepare`` after the plugin's stages: 0 (the model is sharded and filled).
* stock ``accelerate.prepare``: shard + U + ``FULLY_SHARD_OVERHEAD``, ranks > 0 + 2T. U = P - C when mixed
  precision upcasts a lower-precision load (fp32 copies of every weight on every rank, kept until the end of
  accelerate's prepare; the private low-precision copies they replace are freed); ranks > 0 receive each whole
  tensor (T) and ``distribute_tensor`` splits it (up to another T of chunks and output).
* ``load_state`` (a resume: the optimizer has no state yet): AdamW state S = two fp32 moments of every element of
  the rows a rank holds (unpadded: the last ranks of a tensor whose rows do not divide evenly hold fewer); stock holds
  the loaded state and the optimizer's copy of it (2·S), the plugin S + its largest state tensor.

``node``: any rank may lead its node and stage its node's buckets, so every rank gets rank 0's figure. On
CUDA (without CPU offload) the shard, ring and receive buffer are device memory; the CPU keeps the chunks.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch

from ..errors import message_line

#: Bytes per element of the training dtypes the CLI accepts.
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}

MIB = 2**20
#: ``fully_shard``'s own bookkeeping (FSDP states, hooks, DTensor specs), per rank: the ``shard`` stage measured
#: 1.6-1.7 MiB on a trivial model (the ``tiny`` Llama, 107 k parameters, 2 and 4 ranks:
#: ``python benchmarks/estimate.py --cases trivial-fp32-2,trivial-bf16-4``), and stock accelerate's prepare,
#: which makes the same calls, 2.0-2.7 MiB with its 0.2-0.4 MiB of weights. Measured once, not per model.
FULLY_SHARD_OVERHEAD = int(1.7 * MIB)
#: ``rank0_distribute``'s bookkeeping (all-gathered layouts and blocks, the bucket plan, the collectives'
#: objects): 0.4-0.6 MiB above the weights on the same trivial model, 2 and 4 ranks.
DISTRIBUTE_OVERHEAD = int(0.5 * MIB)
#: ``meta_placement`` on rank 0 checks that the weights it maps still hold the file's bytes, one window of
#: ``io.mapped_pages.SCAN_WINDOW_PAGES`` pages at a time: per page, the 8-byte ``/proc/self/pagemap`` entry, the
#: swap test (an int64 temporary and its mask: 9), the present test (1), the file-page test (9), the two
#: combining masks (2), the prefix sum (8) and ``cumsum``'s int64 copy of the mask and result (16). Each
#: temporary gets its own heap chunk in the first window and glibc keeps them for the next: their sum, 53.
PAGEMAP_BYTES_PER_PAGE = 53
_PAGE = 4096
#: Byte alignment of the bucket budget per rank (``distributed/plan.py``).
_ALIGN = 16


@dataclass(frozen=True)
class TensorSpec:
    """One tensor that ``prepare`` places on every rank.

    Args:
        name: Its name in the model.
        shape: Its shape.
        file_itemsize: Bytes per element in the checkpoint when the checkpoint stores it under this name and
            shape (transformers can map it as it is); ``None`` when the model builds it (fused, renamed).
        floating: Whether mixed precision makes it an fp32 master weight.
        sharded: A parameter (FSDP2 shards dim 0); ``False`` for a persistent buffer (replicated).
    """

    name: str
    shape: tuple[int, ...]
    file_itemsize: int | None
    floating: bool = True
    sharded: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    def padded_rows(self, world_size: int) -> int:
        """Rows of one rank's shard as FSDP2 stores it: ``torch.chunk``'s chunk, padded on every rank."""
        return -(-self.rows // max(1, world_size))


@dataclass(frozen=True)
class CheckpointSummary:
    """What the safetensors headers (and the config, when the model can be built on ``meta``) say."""

    path: str
    num_tensors: int
    numel: int
    checkpoint_bytes: int
    largest_name: str
    largest_numel: int
    dtypes: dict[str, int] = field(default_factory=dict)
    tensors: tuple[TensorSpec, ...] = ()
    """The model's tensors (empty: the checkpoint's tensors, as if they were the parameters)."""
    layout_from: str = "headers"
    """Where ``tensors`` come from: ``"<Architecture> on meta"`` or ``"headers"`` (with the reason)."""

    def to_dict(self) -> dict:
        """JSON-ready, without the per-tensor list."""
        return {k: v for k, v in asdict(self).items() if k != "tensors"} | {"model_tensors": len(self.tensors)}


def summarize_checkpoint(path: str | os.PathLike) -> CheckpointSummary:
    """Reads the safetensors headers (or index + headers) of a checkpoint, and the model's tensor layout
    from its ``config.json`` (built on ``meta``: no memory, no tensor data read).

    Raises:
        CheckpointError: If no safetensors checkpoint is found or an index names a missing file.

    Example:
        >>> # summarize_checkpoint("ckpt/").numel
    """
    from ..io.safetensors_source import SafetensorsSource

    src = SafetensorsSource(path)
    try:
        entries = dict(src.entries)
    finally:
        src.close()
    numel = nbytes = 0
    largest = ("", 0)
    dtypes: dict[str, int] = {}
    for name, e in entries.items():
        n = math.prod(e.shape)
        numel += n
        nbytes += n * e.dtype.itemsize
        key = str(e.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + n
        if n > largest[1]:
            largest = (name, n)
    tensors, layout_from = model_tensors(path, entries)
    return CheckpointSummary(str(path), len(entries), numel, nbytes, largest[0], largest[1], dtypes, tensors, layout_from)


def model_tensors(path: str | os.PathLike, entries: dict) -> tuple[tuple[TensorSpec, ...], str]:
    """The model's parameters and persistent buffers, matched with the checkpoint's ``entries``; the
    checkpoint's own tensors when the model cannot be built from ``path``'s config (said in the second item)."""
    model, why = _model_on_meta(path)
    if model is None:
        return tuple(TensorSpec(n, tuple(e.shape), e.dtype.itemsize, e.dtype.is_floating_point) for n, e in entries.items()), \
            f"headers ({why})"
    out = []
    seen: set[int] = set()

    def spec(name: str, t: torch.Tensor, sharded: bool) -> TensorSpec:
        e = entries.get(name)
        same = e is not None and tuple(e.shape) == tuple(t.shape)
        return TensorSpec(name, tuple(t.shape), e.dtype.itemsize if same else None, t.is_floating_point(), sharded)

    for name, p in model.named_parameters():
        seen.add(id(p))
        out.append(spec(name, p, True))
    for mod_name, mod in model.named_modules():
        for local, b in mod._buffers.items():
            if b is None or id(b) in seen or local in mod._non_persistent_buffers_set:
                continue
            seen.add(id(b))
            out.append(spec(f"{mod_name}.{local}" if mod_name else local, b, False))
    return tuple(out), f"{type(model).__name__} on meta"


def _model_on_meta(path: str | os.PathLike):
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None, "no config.json"
    try:
        import transformers
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        with torch.device("meta"):
            if cls is not None:
                return cls._from_config(config), None
            return transformers.AutoModelForCausalLM.from_config(config), None
    except Exception as exc:  # any model transformers cannot build here: fall back to the headers
        return None, f"{type(exc).__name__}: {message_line(exc)[:200]}"


def tp_plan_declined(path: str | os.PathLike, tp: int) -> str | None:
    """Why the ``shard`` stage would decline the TP plan of the model of checkpoint ``path`` over ``tp`` ranks
    (``None``: it applies it): the stage's own check (:func:`~accelerate_memsafe.distributed.tensor_parallel.tp_plan_problem`)
    on the model built on ``meta`` from ``config.json``.

    Example:
        >>> tp_plan_declined("/nonexistent", 2)
        'the model cannot be built from the checkpoint (no config.json)'
    """
    model, why = _model_on_meta(path)
    if model is None:
        return f"the model cannot be built from the checkpoint ({why})"
    from ..distributed.tensor_parallel import tp_plan_problem

    return tp_plan_problem(model, tp)


def tensors_of_model(model: torch.nn.Module, whole: Iterable[torch.nn.Parameter] = ()) -> tuple[TensorSpec, ...]:
    """The :class:`TensorSpec`\\ s of a model in memory (the preflight check), in the dtype it holds now; the parameters
    in ``whole`` (those FSDP ignores) are held whole on every rank, as persistent buffers are.

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
        >>> [t.sharded for t in tensors_of_model(m, whole=m[1].parameters())]
        [True, True, False, False]
    """
    out = []
    seen: set[int] = set()
    kept = {id(p) for p in whole}
    for _, p in model.named_parameters():
        seen.add(id(p))
        out.append(TensorSpec("", tuple(p.shape), p.element_size(), p.is_floating_point(), id(p) not in kept))
    for mod in model.modules():
        for local, b in mod._buffers.items():
            if b is not None and id(b) not in seen and local not in mod._non_persistent_buffers_set:
                seen.add(id(b))
                out.append(TensorSpec("", tuple(b.shape), b.element_size(), b.is_floating_point(), False))
    return tuple(out)


@dataclass(frozen=True)
class Blocks:
    """How the ranks split every sharded weight: into ``count`` distinct blocks of dim-0 rows (FSDP's shard degree), rank
    ``r`` holding block ``(r // stride) % count``. Plain FSDP: one block per rank. HSDP: ``dp_shard_size`` blocks,
    each held by ``dp_replicate_size`` ranks. FSDP × TP with the plan declined: ``dp_shard_size`` blocks, each held by
    the ``tp_size`` consecutive ranks of a TP group (accelerate's mesh order: ``dp_replicate``, ``dp_shard``, ``cp``,
    ``tp``, the last varying fastest). See :func:`mesh_blocks`."""

    count: int
    stride: int = 1

    def of(self, rank: int) -> int:
        """The block ``rank`` holds."""
        return (rank // self.stride) % self.count


def mesh_blocks(world_size: int, *, dp_replicate: int = 1, tp: int = 1, tp_applied: bool = True) -> Blocks:
    """The :class:`Blocks` of a run on ``world_size`` ranks with accelerate's ``ParallelismConfig`` sizes. With an
    applied TP plan each rank's block is taken as 1/(``world_size`` / ``dp_replicate``) of every weight: the plan's
    weights are split over ``dp_shard`` × ``tp`` (FSDP's dim 0 within TP's split); the few weights the plan leaves
    whole (norms) are held 1/``dp_shard``, which this takes as ``tp`` times smaller than they are.

    Raises:
        ValueError: If ``world_size`` is not a multiple of ``dp_replicate × tp``.

    Example:
        >>> mesh_blocks(4, dp_replicate=2)  # HSDP 2 x 2: ranks 0 and 2 hold block 0, ranks 1 and 3 block 1
        Blocks(count=2, stride=1)
        >>> mesh_blocks(4, tp=2, tp_applied=False)  # FSDP 2 x TP 2, plan declined: ranks 0 and 1 hold block 0
        Blocks(count=2, stride=2)
        >>> mesh_blocks(4, tp=2).count  # the plan applied
        4
    """
    n, dp_replicate, tp = max(1, world_size), max(1, dp_replicate), max(1, tp)
    if n % (dp_replicate * tp):
        raise ValueError(f"{n} processes do not divide into dp_replicate_size={dp_replicate} x tp_size={tp} groups: "
                         "the number of processes must be a multiple of their product.")
    if tp > 1 and not tp_applied:
        return Blocks(n // (dp_replicate * tp), tp)
    return Blocks(n // dp_replicate)


@dataclass(frozen=True)
class Layout:
    """The tensors of one ``prepare`` on ``world_size`` ranks and the byte counts every term is made of; ``blocks``:
    how the ranks split each sharded weight (``None``: one block per rank)."""

    tensors: tuple[TensorSpec, ...]
    world_size: int
    load_bytes: int
    """Bytes per element of the floating tensors as loaded (``--dtype``)."""
    mixed_precision: str
    shard: int = 0
    """Bytes one rank holds after the load: its padded shards plus the replicated tensors."""
    full: int = 0
    """P: every tensor in the training dtype."""
    largest: int = 0
    """T: the largest tensor in the training dtype."""
    mapped: int = 0
    """File bytes transformers maps zero-copy (stored under the tensor's name and shape in the load dtype)."""
    converted: int = 0
    """C: bytes of the load built in private memory, in the load dtype."""
    blocks: Blocks | None = None

    @property
    def shards(self) -> int:
        """Distinct blocks of a sharded weight (FSDP's shard degree): ``world_size`` unless :attr:`blocks` says."""
        return self.blocks.count if self.blocks is not None else self.world_size

    def block_of(self, rank: int) -> int:
        """The block ``rank`` holds."""
        return self.blocks.of(rank) if self.blocks is not None else rank

    def itemsize(self, t: TensorSpec) -> int:
        """Bytes per element of ``t`` in training: fp32 master weights under mixed precision."""
        if not t.floating:
            return t.file_itemsize or 8
        return 4 if self.mixed_precision != "no" else self.load_bytes

    def is_mapped(self, t: TensorSpec) -> bool:
        """Whether rank 0's copy of ``t`` is the file's bytes (every rank can then read it itself)."""
        return t.file_itemsize is not None and t.file_itemsize == (self.load_bytes if t.floating else t.file_itemsize)

    def source_itemsize(self, t: TensorSpec) -> int:
        """Bytes per element of rank 0's copy of ``t`` (the load dtype)."""
        return self.load_bytes if t.floating else (t.file_itemsize or 8)

    def held_numel(self, t: TensorSpec, rank: int) -> int:
        """Elements of ``t`` that ``rank`` holds, unpadded (its block's rows, ``torch.chunk``'s: the last blocks hold
        fewer, or none); the whole of a replicated tensor. What an optimizer's state of the sharded parameter holds.

        Example:
            >>> lay = layout([TensorSpec("experts", (10, 4, 4), 2)], world_size=4, load_bytes=2, mixed_precision="bf16")
            >>> [lay.held_numel(lay.tensors[0], r) // 16 for r in range(4)]  # 10 rows over 4 ranks
            [3, 3, 3, 1]
        """
        if not t.sharded:
            return t.numel
        c = -(-t.rows // self.shards)
        b = self.block_of(rank)
        return max(0, min((b + 1) * c, t.rows) - min(b * c, t.rows)) * t.row_numel

    def block_bytes(self, t: TensorSpec, itemsize: int | None = None) -> int:
        """One rank's padded block of ``t`` (its whole size when replicated)."""
        size = self.itemsize(t) if itemsize is None else itemsize
        return (t.padded_rows(self.shards) * t.row_numel if t.sharded else t.numel) * size


def layout(tensors: Iterable[TensorSpec], *, world_size: int, load_bytes: int, mixed_precision: str,
           blocks: Blocks | None = None) -> Layout:
    """Sums the tensors' bytes for ``world_size`` ranks, loaded with ``load_bytes`` per element and trained in
    fp32 under mixed precision; ``blocks``: how the ranks split each weight (:func:`mesh_blocks`; ``None``: one
    block per rank).

    Example:
        >>> lay = layout([TensorSpec("experts", (10, 4, 4), 2)], world_size=4, load_bytes=2, mixed_precision="bf16")
        >>> lay.shard, lay.full  # 3 padded rows of 16 fp32 on each rank; 160 fp32 in all
        (192, 640)
        >>> layout(lay.tensors, world_size=4, load_bytes=2, mixed_precision="bf16", blocks=mesh_blocks(4, dp_replicate=2)).shard
        320
    """
    base = Layout(tuple(tensors), max(1, world_size), load_bytes, mixed_precision, blocks=blocks)
    shard = full = largest = mapped = converted = 0
    for t in base.tensors:
        nbytes = t.numel * base.itemsize(t)
        full += nbytes
        largest = max(largest, nbytes)
        shard += base.block_bytes(t)
        loaded = t.numel * (load_bytes if t.floating else (t.file_itemsize or 8))
        if base.is_mapped(t):
            mapped += loaded
        else:
            converted += loaded
    return Layout(base.tensors, base.world_size, load_bytes, mixed_precision, shard, full, largest, mapped, converted,
                  blocks)


@dataclass(frozen=True)
class StagePeak:
    """Predicted peak extra memory of one stage on one rank: CPU private bytes and device bytes."""

    cpu: int
    device: int = 0


def distribute_peak(lay: Layout, *, rank: int, bucket_bytes: int, prefetch_buckets: int, load_source: str,
                    on_device: bool = False, transport: str = "p2p") -> StagePeak:
    """``rank0_distribute`` on one rank (see the module docstring for each term).

    Args:
        lay: From :func:`layout`.
        rank: The rank.
        bucket_bytes: The plugin's ``bucket_bytes``.
        prefetch_buckets: The plugin's ``prefetch_buckets``.
        load_source: ``"every_rank"`` (what ``auto`` does when every rank sees the checkpoint: each rank reads
            the mapped tensors itself, rank 0 scatters the others), ``"rank0"`` or ``"node"``.
        on_device: The shards live on the accelerator (CUDA without CPU offload).
        transport: ``"p2p"`` (gloo, the collectives on the CPU: one message per piece, sent from rank 0's own
            tensor where no cast is needed and received straight into the shard where contiguous) or
            ``"scatter"`` (other backends: one scatter per bucket from reusable buffers).

    Example:
        >>> lay = layout([TensorSpec("w", (1024, 1024), 4)], world_size=2, load_bytes=2, mixed_precision="bf16")
        >>> kw = dict(bucket_bytes=4 << 20, prefetch_buckets=2, load_source="rank0")
        >>> (distribute_peak(lay, rank=0, transport="scatter", **kw).cpu - DISTRIBUTE_OVERHEAD) >> 10
        3584
        >>> [(distribute_peak(lay, rank=r, **kw).cpu - DISTRIBUTE_OVERHEAD) >> 10 for r in (0, 1)]
        [2048, 2560]

        With a scatter, rank 0 holds its 2 MiB fp32 shard and casts the other rank's half of a 3 x 1 MiB ring;
        on gloo (``p2p``) it sends the bf16 rows as they are, and rank 1 widens them into its shard through two
        staging buffers, each written up to its 256 KiB of bf16 rows per bucket.
    """
    n = lay.world_size
    budget = max(_ALIGN * n, bucket_bytes // (prefetch_buckets + 2))
    local = [t for t in lay.tensors if load_source == "every_rank" and lay.is_mapped(t)]
    chunk = 0
    for t in local:  # read in chunks of at most the budget when it must cast (or the shard is on a device)
        if t.file_itemsize != lay.itemsize(t) or on_device:
            chunk = max(chunk, min(budget, lay.block_bytes(t, t.file_itemsize)))
    ids = {id(t) for t in local}
    scattered = [t for t in lay.tensors if id(t) not in ids and t.sharded]
    whole = [t.numel * lay.itemsize(t) for t in lay.tensors if id(t) not in ids and not t.sharded]
    replicated = sum(whole)
    p2p = transport == "p2p" and load_source != "node"

    def cut(t: TensorSpec) -> bool:  # a row larger than a rank's share is cut along dim 1 (not a view)
        return t.row_numel * lay.itemsize(t) > budget // n

    def narrow(t: TensorSpec) -> bool:  # p2p sends a bf16 / fp16 source as it is, widened by the receiver
        return p2p and t.floating and lay.source_itemsize(t) == 2 and lay.itemsize(t) >= 4

    # p2p sends rank 0's own tensor (or the file's mapping) where it needs no cast or only a widening; the rest,
    # and every row cut along dim 1 whatever its dtype (a dim-1 range is not contiguous: `rows_view` declines it), is
    # copied into the ring (in the narrower dtype when it is widened later)
    copied = [t for t in scattered if not p2p or cut(t) or (lay.source_itemsize(t) != lay.itemsize(t) and not narrow(t))]
    wire = {id(t): lay.source_itemsize(t) / lay.itemsize(t) for t in copied if narrow(t)}
    sent = n * sum(int(lay.block_bytes(t) * wire.get(id(t), 1)) for t in copied)
    buffers = piece = 0  # the ring or the receive buffers (on the collectives' device); the cast read (CPU)
    if rank == 0 or load_source == "node":
        # the other ranks' slots of at most k + 1 buckets (rank 0 reads its own piece into its shard), and
        # one slot's file rows when it re-reads a mapped weight from the file and casts it
        buffers = min((prefetch_buckets + 1) * budget, sent) * (n - 1) // n
        piece = max((min(budget // n, lay.block_bytes(t)) * t.file_itemsize // lay.itemsize(t)
                     for t in scattered if lay.is_mapped(t) and t.file_itemsize != lay.itemsize(t)
                     and not narrow(t)), default=0)
    elif transport != "p2p":
        buffers = min(budget // n, sent // n)  # one receive buffer of a rank's slot
    elif any(narrow(t) for t in scattered):
        # a narrower dtype is widened on arrival: received into one of two staging buffers (one receiving while
        # the other is copied into place), whose pages this rank's narrow pieces touch
        buffers = staging_touched(lay, scattered, budget=budget, narrow=narrow, rank=rank)
    # replicated tensors travel in groups of at most the budget, a larger one alone (`transport.replicated_groups`)
    group = min(max([budget, *whole]), replicated)
    if on_device:
        return StagePeak(max(chunk, piece) + DISTRIBUTE_OVERHEAD, lay.shard + buffers + group)
    if rank == 0 and load_source != "node":
        sent = rank0_send_peak(lay, local, scattered, copied=[id(t) for t in copied], budget=budget,
                               prefetch_buckets=prefetch_buckets, wire=wire)
        # the replicated tensors come last, each group received into one buffer and installed as new tensors, beside
        # what the scatter left
        return StagePeak(max(lay.shard - sum(lay.block_bytes(t) for t in scattered) + chunk, sent + piece + replicated)
                         + group + DISTRIBUTE_OVERHEAD)
    return StagePeak(lay.shard + max(chunk, buffers + piece) + group + DISTRIBUTE_OVERHEAD)


def staging_touched(lay: Layout, scattered: list[TensorSpec], *, budget: int, narrow, rank: int) -> int:
    """Bytes of the two staging buffers ``rank`` touches on gloo, from the distribution's own plan
    (:func:`~accelerate_memsafe.distributed.plan.plan_buckets` of ``scattered``): in bucket j a rank writes each piece
    rank 0 sends in a narrower dtype (``narrow(t)``: bf16 rows widened into fp32 shards) at its offset in buffer
    j % 2, in that dtype (half its bytes); the other pieces land in the shard itself. A buffer's pages count once
    however many buckets write them (the union of what its buckets wrote, by page).

    Example:
        >>> lay = layout([TensorSpec("w", (1024, 1024), 2)], world_size=2, load_bytes=2, mixed_precision="bf16")
        >>> staging_touched(lay, list(lay.tensors), budget=1 << 20, narrow=lambda t: True, rank=1) >> 10
        512
    """
    from ..distributed.plan import _Sharded, plan_buckets, row_boxes

    n = lay.world_size
    items, wire = [], {}
    for i, t in enumerate(scattered):
        shape = t.shape or (1,)
        blocks = row_boxes(shape, lay.shards)
        item = _Sharded(f"{i}:{t.name}", None, _DTYPE_OF_SIZE.get(lay.itemsize(t), torch.float64), shape,
                        [blocks[lay.block_of(r)] for r in range(n)])
        items.append(item)
        if narrow(t):
            wire[id(item)] = lay.source_itemsize(t)
    spans: tuple[set, set] = (set(), set())  # the page ranges written in each buffer
    for bucket in plan_buckets(items, n, budget):
        for piece in bucket.pieces_of(rank):
            w = wire.get(id(piece.item))
            if w is not None:
                nbytes = piece.nbytes * w // piece.item.dtype.itemsize
                spans[bucket.index % 2].add((piece.offset // _PAGE, -(-(piece.offset + nbytes) // _PAGE)))
    return (_union_length(spans[0]) + _union_length(spans[1])) * _PAGE


def _union_length(spans: Iterable[tuple[int, int]]) -> int:
    """Length of the union of half-open ranges ``[a, b)``.

    Example:
        >>> _union_length([(0, 2), (1, 3), (5, 6)])
        4
    """
    total, end = 0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


#: A torch dtype of each element size the estimate meets (the plan reads only the size).
_DTYPE_OF_SIZE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64, 16: torch.complex128}


def rank0_send_peak(lay: Layout, local: list[TensorSpec], scattered: list[TensorSpec], *, copied: list[int],
                    budget: int, prefetch_buckets: int, wire: dict[int, float] | None = None) -> int:
    """Rank 0's highest (shard pages written + ring buffers touched - private copies handed back) while it sends
    ``scattered``, bucket by bucket, on the CPU.

    The shards are allocated untouched (``torch.empty``: a page counts once written). The blocks rank 0 read
    itself (``local``) are written first. Bucket j carries each rank's next b / N bytes of its rows, in model
    order; preparing it writes rank 0's slot into its shard and, for the tensors in ``copied`` (by ``id``: a
    cast, or every tensor with a scatter), the other ranks' slots into one of the k + 1 reused ring buffers
    ((N - 1) / N of it; ``wire``: by ``id``, the fraction of a copied piece's bytes it takes in the ring when it
    travels in a narrower dtype). A tensor built in private memory (not mapped: e.g. fused experts) is freed, and the
    memory trimmed back to the kernel, as soon as its last bucket is prepared when all its pieces were copied,
    or once that bucket is sent (before bucket j + k + 1 is prepared) when a piece went out as its own bytes.

    Example:
        >>> experts = [TensorSpec(f"e{i}", (4, 4 << 20), None) for i in range(4)]  # 32 MiB bf16 each, built in memory
        >>> lay = layout(experts, world_size=4, load_bytes=2, mixed_precision="bf16")
        >>> ids = [id(t) for t in lay.tensors]
        >>> lay.shard >> 20, rank0_send_peak(lay, [], list(lay.tensors), copied=ids, budget=16 << 20, prefetch_buckets=2) >> 20
        (64, 52)
    """
    n, k = lay.world_size, prefetch_buckets
    slot = max(1, budget // n)
    copied_ids = set(copied)
    own = [lay.block_bytes(t) for t in scattered]
    total = sum(own)
    buckets = max(1, -(-total // slot))
    freed_at = [0] * (buckets + k + 2)  # private bytes back with the kernel before bucket j is prepared
    ringed = [0] * buckets  # bytes of copied pieces in bucket j (all ranks' slots)
    end = 0
    for t, b in zip(scattered, own):
        first, end = end // slot, end + b
        last = max(first, (end - 1) // slot)
        if id(t) in copied_ids:
            share = (wire or {}).get(id(t), 1)
            for j in range(first, last + 1):
                ringed[j] += int((min(end, (j + 1) * slot) - max(end - b, j * slot)) * n * share)
        if not lay.is_mapped(t):
            freed_at[last + 1 if id(t) in copied_ids else last + k + 1] += t.numel * lay.source_itemsize(t)
    local_bytes = sum(lay.block_bytes(t) for t in local)
    peak = freed = 0
    hosted: list[int] = []  # the k + 1 largest buckets copied so far: the ring bytes touched (buffers are reused)
    for j in range(buckets):
        freed += freed_at[j]
        hosted = sorted(hosted + [ringed[j]], reverse=True)[: k + 1]
        peak = max(peak, local_bytes + min(total, (j + 1) * slot) + sum(hosted) * (n - 1) // n - freed)
    return peak


def released_by_rank0(lay: Layout) -> int:
    """Bytes of private (converted) copies rank 0 frees while it scatters them: how far below its estimate rank 0's
    ``rank0_distribute`` can measure, depending on how much of that memory the allocator hands back to the kernel.

    Example:
        >>> lay = layout([TensorSpec("fused", (8, 4), None)], world_size=2, load_bytes=2, mixed_precision="bf16")
        >>> released_by_rank0(lay)
        64
    """
    return sum(t.numel * lay.source_itemsize(t) for t in lay.tensors if t.sharded and not lay.is_mapped(t))


def pagemap_scan_bytes(mapped_bytes: int) -> int:
    """Rank 0's scan of the pagemap of ``mapped_bytes`` of mapped weights (whether they still hold the file's
    bytes), a window at a time.

    Example:
        >>> pagemap_scan_bytes(4096 * 1000), pagemap_scan_bytes(2**40) >> 10  # 1 TiB: one window, under 1 MiB
        (53000, 848)
    """
    from ..io.mapped_pages import SCAN_WINDOW_PAGES

    return PAGEMAP_BYTES_PER_PAGE * min(-(-mapped_bytes // _PAGE), SCAN_WINDOW_PAGES)


def meta_placement_peak(lay: Layout, *, rank: int) -> int:
    """``meta_placement`` on one rank: rank 0's pagemap scans of the weights transformers mapped."""
    return pagemap_scan_bytes(lay.mapped) if rank == 0 else 0


def stock_prepare_peak(lay: Layout, *, rank: int) -> int:
    """Stock accelerate's FSDP2 ``prepare`` (``cpu_ram_efficient_loading``) on one rank, CPU private bytes."""
    upcast = lay.mixed_precision != "no" and lay.load_bytes != 4
    up = max(0, lay.full - lay.converted) if upcast else 0
    receive = 2 * lay.largest if rank > 0 else 0
    return lay.shard + up + receive + FULLY_SHARD_OVERHEAD


@dataclass(frozen=True)
class Prediction:
    """Predicted peak extra memory of one stage on one rank, in bytes, for one path."""

    hook: str
    stage: str
    rank: int
    path: str
    cpu_anon_bytes: int
    cpu_rss_bytes: int
    device_bytes: int


def _tensors(summary: CheckpointSummary) -> tuple[TensorSpec, ...]:
    if summary.tensors:
        return summary.tensors
    # totals only (a summary built by hand): the largest tensor and the rest as one block of whole rows
    rest = summary.numel - summary.largest_numel
    out = [TensorSpec(summary.largest_name or "largest", (summary.largest_numel,), None)]
    if rest > 0:
        out.append(TensorSpec("rest", (rest,), None))
    return tuple(out)


def predict(
    summary: CheckpointSummary,
    *,
    num_processes: int,
    dtype: str = "fp32",
    mixed_precision: str = "no",
    offload_optimizer: bool = False,
    bucket_bytes: int = 64 * 2**20,
    prefetch_buckets: int = 2,
    device: str = "cpu",
    load_source: str = "auto",
    cpu_offload: bool = False,
    dp_replicate_size: int = 1,
    tp_size: int = 1,
    tp_applied: bool = True,
) -> list[Prediction]:
    """Per-stage, per-rank predictions for the stock path and for the plugin.

    Args:
        summary: From :func:`summarize_checkpoint`.
        num_processes: N, the number of ranks.
        dtype: The dtype the model is loaded in (``fp32``, ``bf16``, ``fp16``).
        mixed_precision: ``"no"`` or ``"bf16"``/``"fp16"`` (trainable weights become fp32 master weights).
        offload_optimizer: Whether optimizer state lives on CPU (``optimizer_offload=True``).
        bucket_bytes: The plugin's ``bucket_bytes``.
        prefetch_buckets: The plugin's ``prefetch_buckets``.
        device: ``"cpu"`` or ``"cuda"``: on CUDA the shards and optimizer state are device memory.
        load_source: The plugin's ``load_source``; ``"auto"`` is predicted as ``"every_rank"`` (what it
            chooses when every rank sees the checkpoint: one node, or a shared filesystem).
        cpu_offload: FSDP2 CPU offload: the shards stay in CPU memory on CUDA too.
        dp_replicate_size, tp_size: accelerate's ``ParallelismConfig`` sizes (HSDP: ``dp_replicate_size`` > 1);
            ``dp_shard_size`` is what the processes leave.
        tp_applied: With ``tp_size`` > 1, whether the model's TP plan is applied (else FSDP shards over ``dp_shard``
            only, and each rank holds ``tp_size`` times more): see :func:`mesh_blocks`.

    Returns:
        One :class:`Prediction` per (hook, stage, rank, path).

    Raises:
        ValueError: For an unknown ``dtype``, or processes that do not divide into the parallelism sizes.

    Example:
        >>> s = CheckpointSummary("x", 2, 2_000_000, 8_000_000, "w", 1_000_000)
        >>> [p.cpu_anon_bytes >> 20 for p in predict(s, num_processes=2, load_source="rank0") if p.stage == "rank0_distribute"]
        [4, 4]
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}.")
    n = max(1, num_processes)
    blocks = mesh_blocks(n, dp_replicate=dp_replicate_size, tp=tp_size, tp_applied=tp_applied)
    lay = layout(_tensors(summary), world_size=n, load_bytes=DTYPE_BYTES[dtype], mixed_precision=mixed_precision,
                 blocks=blocks)
    on_device = device != "cpu" and not cpu_offload
    source = "every_rank" if load_source == "auto" else load_source
    upcast = mixed_precision != "no" and DTYPE_BYTES[dtype] != 4
    cpu_state = offload_optimizer or device == "cpu"
    # the per-rank profiles: rank 0 and the others differ; the others differ only in their rows (the last ranks hold
    # fewer of a tensor whose rows do not divide evenly), so up to 16 ranks each gets its own, beyond that the last
    # rank its own and the others rank 1's
    profiles = {}
    kinds = list(range(n)) if n <= 16 else sorted({0, 1, n - 1})
    for kind in kinds:
        stock_cpu = stock_prepare_peak(lay, rank=min(kind, 1))
        dist = distribute_peak(lay, rank=kind, bucket_bytes=bucket_bytes, prefetch_buckets=prefetch_buckets,
                               load_source=source, on_device=on_device, transport="p2p" if device == "cpu" else "scatter")
        profiles[kind] = (stock_cpu, dist, meta_placement_peak(lay, rank=kind))
    out: list[Prediction] = []
    for rank in range(n):
        # beyond 16 ranks: the last rank's profile for the ranks that hold the last block (the fewest rows), else rank 1's
        kind = rank if rank in profiles else (n - 1 if lay.block_of(rank) == lay.block_of(n - 1) else 1)
        stock_cpu, dist, meta = profiles[kind]
        mapped_read = lay.mapped if (rank == 0 or upcast) else 0  # file pages stock reads through its mapping
        if on_device:
            cpu = stock_cpu - lay.shard
            out.append(Prediction("prepare", "accelerate.prepare", rank, "stock", cpu, cpu + mapped_read, lay.shard + lay.largest))
        else:
            out.append(Prediction("prepare", "accelerate.prepare", rank, "stock", stock_cpu, stock_cpu + mapped_read, 0))
        out.append(Prediction("prepare", "meta_placement", rank, "memsafe", meta, meta, 0))
        out.append(Prediction("prepare", "shard", rank, "memsafe", FULLY_SHARD_OVERHEAD, FULLY_SHARD_OVERHEAD, 0))
        out.append(Prediction("prepare", "rank0_distribute", rank, "memsafe", dist.cpu, dist.cpu, dist.device))
        out.append(Prediction("prepare", "buffer_init", rank, "memsafe", 0, 0, 0))
        out.append(Prediction("prepare", "accelerate.prepare", rank, "memsafe", 0, 0, 0))
        # optimizer state (AdamW: two fp32 moments per trainable element)
        # the AdamW state of this rank's rows (two fp32 moments per element; unpadded: the last ranks hold fewer rows)
        held = [lay.held_numel(t, rank) for t in lay.tensors if t.sharded]
        state, largest_state = 2 * 4 * sum(held), 4 * max(held, default=0)
        for path, peak in (("stock", 2 * state), ("memsafe", state + largest_state)):
            stage = "accelerate.load_state" if path == "stock" else "optimizer_cpu_reload"
            if path == "stock" and offload_optimizer and device != "cpu":
                # stock loads onto the device first and moves afterwards
                out.append(Prediction("load_state", stage, rank, path, peak, peak, peak))
            elif cpu_state:
                out.append(Prediction("load_state", stage, rank, path, peak, peak, 0))
            else:
                out.append(Prediction("load_state", stage, rank, path, 0, 0, peak))
    return out


def node_totals(preds: list[Prediction], path: str) -> dict[tuple[str, str], tuple[int, int]]:
    """Sum over the ranks of one node of (CPU anon, device) per (hook, stage) for ``path``."""
    totals: dict[tuple[str, str], tuple[int, int]] = {}
    for p in preds:
        if p.path != path:
            continue
        cpu, dev = totals.get((p.hook, p.stage), (0, 0))
        totals[(p.hook, p.stage)] = (cpu + p.cpu_anon_bytes, max(dev, p.device_bytes))
    return totals


def to_dicts(preds: list[Prediction]) -> list[dict]:
    """JSON-ready form."""
    return [asdict(p) for p in preds]
