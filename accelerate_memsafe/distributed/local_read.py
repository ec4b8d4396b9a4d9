"""``every_rank`` loading: each rank reads only its own block of each weight straight from the safetensors
files, when every rank sees the same checkpoint and rank 0's weights are that checkpoint's bytes.

Rank 0's model is the truth. A weight qualifies only when rank 0 proved it is an unmodified view of the
mapped checkpoint (:func:`~accelerate_memsafe.distributed.meta.checkpoint_source_names`: the address *and*
the kernel's record that no page was written), so a file read gives exactly the bytes rank 0 holds; every
other weight (edited in place, created, cast) goes through rank 0's scatter. Every rank must see the same
files: rank 0 offers its checkpoint's identity (per file: size, modification time and a hash of the
header), every rank compares it with what it sees at the same path, and one all-gather decides for all
(a shared filesystem passes; a copy on a node's local disk, with another modification time, does not).

The weights read this way move through no collective: what a rank reads is its own block's rows, with
``pread`` straight into its local shard when the dtype matches, otherwise in chunks of at most the bucket
budget.

``in place`` (what ``auto`` tries first): when every rank already holds the whole model as unmodified views of
the same checkpoint's mapping (transformers' zero-copy load on every rank), every rank's bytes are rank 0's,
and ``fully_shard`` keeps each rank's own rows as stock accelerate does: no weight goes to ``meta``, none is
read again or sent (:func:`agree_on_in_place`, one all-gather of a small token per rank).

``node``: only each node's leader (its local rank 0) must see the files; it reads for its node's ranks and
scatters within the node (:mod:`~accelerate_memsafe.distributed.node_scatter`), and rank 0 sends each
leader what it cannot read.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import walk
from ..errors import CheckpointError
from ..io.safetensors_source import SafetensorsSource
from .collectives import Collectives
from .topology import Nodes

#: ``load_source`` values: ``auto`` reads locally where every rank can, else through the node leaders where
#: they can, else from rank 0.
LOAD_SOURCES = ("auto", "rank0", "node", "every_rank")


def checkpoint_identity(source: SafetensorsSource | list[str]) -> list[tuple[str, int, int, str]]:
    """Per file of the checkpoint (a source, or its files): ``(name, size, mtime_ns, sha256 of its header)``.

    Example:
        >>> # checkpoint_identity(SafetensorsSource("ckpt/"))[0][0]
        >>> # 'model.safetensors'
    """
    out = []
    for file in source.files if isinstance(source, SafetensorsSource) else source:
        st = os.stat(file)
        with open(file, "rb") as f:
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (0,)
            digest = hashlib.sha256(raw + f.read(min(n, 100 * 2**20))).hexdigest()
        out.append((os.path.basename(file), st.st_size, st.st_mtime_ns, digest))
    return out


@dataclass
class LocalReads:
    """What :func:`agree_on_local_reads` decided, the same on every rank."""

    source: SafetensorsSource | None
    """This rank's open checkpoint when it reads weights itself (``None`` otherwise)."""
    names: set[str]
    """The weights read from the checkpoint (by every rank, or by each node's leader)."""
    load_source: str
    """``"every_rank"``, ``"node"`` or ``"rank0"``."""
    why: str | None = None
    """Why the weights do not come from every rank's own read (``None`` when they do)."""


def agree_on_local_reads(
    coll: Collectives, rank0_checkpoint: SafetensorsSource | None, rank0_names: set[str], *, mode: str,
    nodes: Nodes | None = None,
) -> LocalReads:
    """Decides, identically on every rank, where each weight comes from.

    Args:
        coll: The stage's collectives (one broadcast and one all-gather of small objects).
        rank0_checkpoint: On rank 0, its checkpoint source (``None`` elsewhere, or without one).
        rank0_names: On rank 0, the weights proved to be the checkpoint's unmodified bytes.
        mode: ``"auto"`` (every rank reads if every rank can; else each node's leader if the leaders can and
            some node has several ranks; else rank 0), ``"every_rank"`` (raise when a rank cannot read),
            ``"node"`` (leaders read what they can, rank 0 sends them the rest).
        nodes: Every rank's node (needed for ``"auto"`` and ``"node"``).

    Raises:
        CheckpointError: On every rank, with ``mode="every_rank"`` when some rank cannot read locally.
    """
    offer = None
    if coll.rank == 0 and rank0_checkpoint is not None and rank0_names:
        offer = (os.path.abspath(rank0_checkpoint.path), checkpoint_identity(rank0_checkpoint), sorted(rank0_names))
    offer = coll.broadcast_object(offer, src=0, what="broadcast of rank 0's checkpoint identity")
    fallback = "node" if mode == "node" else "rank0"
    if offer is None:
        why = "rank 0's weights are not unmodified views of a safetensors checkpoint (not loaded zero-copy, or edited)"
        if mode == "every_rank":
            raise CheckpointError(f"`load_source='every_rank'`: {why}. HINT: use load_source='auto' or 'rank0'.")
        return LocalReads(None, set(), fallback, why)
    path, identity, names = offer
    readers = set(nodes.leaders) if mode == "node" and nodes is not None else set(range(coll.world_size))
    source, problem = (rank0_checkpoint, None) if coll.rank == 0 else (
        _open_same(path, identity) if coll.rank in readers else (None, None))
    problems = coll.all_gather_object(problem, what="all_gather of whether every rank sees rank 0's checkpoint")
    bad = [(r, p) for r, p in enumerate(problems) if p]
    if not bad:
        return LocalReads(source, set(names), "node" if mode == "node" else "every_rank")
    why = "; ".join(f"rank {r}: {p}" for r, p in bad[:4])
    if mode == "every_rank":
        close_unless(source, rank0_checkpoint)
        raise CheckpointError(
            f"`load_source='every_rank'` needs every rank to see rank 0's checkpoint {path}: {why}. HINT: put the "
            "checkpoint on a filesystem all nodes share, or use load_source='auto' (falls back to rank 0)."
        )
    if mode == "auto" and nodes is not None and len(nodes.leaders) > 1 and not {r for r, _ in bad} & set(nodes.leaders):
        # every node's leader sees the checkpoint: it reads for its node
        if coll.rank not in nodes.leaders:
            close_unless(source, rank0_checkpoint)
            source = None
        return LocalReads(source, set(names), "node", f"not every rank sees rank 0's checkpoint ({why}); the node leaders do")
    close_unless(source, rank0_checkpoint)
    return LocalReads(None, set(), fallback, why)


def _open_same(path: str, identity: list[tuple[str, int, int, str]]) -> tuple[SafetensorsSource | None, str | None]:
    try:
        source = SafetensorsSource(path)
        mine = checkpoint_identity(source)
    except (CheckpointError, OSError) as exc:
        return None, f"cannot read {path} ({type(exc).__name__}: {exc})"
    if mine != identity:
        differs = [f"{a[0]} (size {a[1]} vs {b[1]}, mtime {a[2]} vs {b[2]}, header {'same' if a[3] == b[3] else 'differs'})"
                   for a, b in zip(mine, identity) if a != b] or [f"{len(mine)} files vs rank 0's {len(identity)}"]
        source.close()
        return None, f"sees another checkpoint at {path}: {', '.join(differs[:3])}"
    return source, None


def close_unless(source: SafetensorsSource | None, keep: Any) -> None:
    """Closes a source opened for local reads (not rank 0's own, ``keep``)."""
    if source is not None and source is not keep:
        source.close()


@dataclass
class InPlace:
    """What :func:`agree_on_in_place` decided, the same on every rank."""

    in_place: bool
    why: str | None = None
    """Why not (``None`` when in place)."""


def named_weights(model: nn.Module, layout: list | None = None, *, detach: bool = True) -> dict[str, torch.Tensor]:
    """Canonical name -> detached tensor of every parameter and persistent buffer, every name of a tie
    included (the aliases map to one tensor object), as :func:`~accelerate_memsafe.distributed.meta.move_to_meta`
    names rank 0's originals. ``layout``: a list that receives ``(name, shape, dtype, is_param,
    requires_grad)`` of each name, in order (what every rank must agree on). ``detach=False``: the tensors
    themselves (for a caller that only reads where their bytes lie).

    Example:
        >>> a = nn.Linear(2, 2); m = nn.Sequential(a, nn.Linear(2, 2)); m[1].weight = a.weight
        >>> w = named_weights(m); sorted(w), w["0.weight"] is w["1.weight"]
        (['0.bias', '0.weight', '1.bias', '1.weight'], True)
    """
    from .sharding import canonical_name

    detached: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}

    def add(prefix: str, local: str, t: torch.Tensor, is_param: bool) -> None:
        seen = detached.get(id(t))
        if seen is None:
            seen = detached[id(t)] = t.detach() if detach else t
        name = canonical_name(prefix + local)
        if name not in out:
            out[name] = seen
            if layout is not None:
                layout.append((name, tuple(t.shape), str(t.dtype), is_param, t.requires_grad))

    for mod_name, mod in walk.named_modules(model, remove_duplicate=False):
        params, buffers = mod._parameters, mod._buffers
        if not params and not buffers:  # most modules of a transformer hold no tensor of their own
            continue
        prefix = f"{mod_name}." if mod_name else ""
        for local, p in params.items():
            if p is not None:
                add(prefix, local, p, True)
        if buffers:
            skip = mod._non_persistent_buffers_set
            for local, b in buffers.items():
                if b is not None and local not in skip:
                    add(prefix, local, b, False)
    return out


def _would_upcast(model: nn.Module, mixed_precision: str) -> list[str]:
    """The trainable parameters accelerate's FSDP2 ``prepare`` casts to fp32 master weights (a full private copy)."""
    if mixed_precision == "no":
        return []
    return [n for n, p in model.named_parameters() if p.requires_grad and p.dtype != torch.float32]


def in_place_claim(model: nn.Module, rank: int, *, mixed_precision: str) -> tuple[Any, str | None]:
    """This rank's side of :func:`agree_on_in_place`, before any exchange: the small ``(token, why not)`` every rank
    sends. The token is set when every weight this rank holds is an unmodified view of a mapped ``.safetensors``
    file (else ``None``, and why not).

    The token is what makes two ranks' bytes provably equal without sending them: the files' real paths and
    identities (:func:`checkpoint_identity`: size, modification time, a hash of the header), and a digest of every
    weight's name, shape, dtype and ``requires_grad`` *and of where its bytes lie in those files* (file, offset).
    Ranks with equal tokens hold, under every name, the same unmodified range of the same file (the kernel's page
    record, :func:`~accelerate_memsafe.io.mapped_pages.unmodified_file_pages`: an in-place edit keeps the address),
    so the same bytes. A weight swapped for another one of the same shape still maps the file, at another offset:
    the digests differ. No header is parsed: where the bytes lie is all the proof needs."""
    from ..io.mapped_pages import file_mappings_at, unmodified_file_pages

    upcast = _would_upcast(model, mixed_precision)
    if upcast:
        return None, (f"rank {rank}: mixed precision makes accelerate cast {len(upcast)} weight(s) to fp32 (e.g. "
                      f"`{upcast[0]}`), a private copy of each")
    layout: list = []
    tensors = named_weights(model, layout, detach=False)  # only where their bytes lie is read
    off = next((n for n, t in tensors.items() if t.device.type != "cpu"), None)
    if off is not None:
        return None, f"rank {rank}: `{off}` is on {tensors[off].device}, not mapped from a file"
    by_tensor: dict[int, list[str]] = {}
    for n, t in tensors.items():
        by_tensor.setdefault(id(t), []).append(n)
    maps = file_mappings_at((t.data_ptr() for t in tensors.values()), ".safetensors")
    starts = [lo for lo, _, _, _ in maps]
    where: dict[int, tuple[str, int]] = {}  # tensor -> (file, offset of its first byte)
    spans: list[tuple[int, int]] = []
    unproved: list[str] = []
    for key, aliases in by_tensor.items():
        t = tensors[aliases[0]]
        ptr, nbytes = t.data_ptr(), t.numel() * t.element_size()
        k = bisect.bisect_right(starts, ptr) - 1
        if not nbytes or not t.is_contiguous() or k < 0 or ptr + nbytes > maps[k][1]:
            unproved.append(aliases[0])  # not a view of one mapping of a checkpoint file
            continue
        lo, _, offset, path = maps[k]
        where[key] = (path, ptr - lo + offset)
        spans.append((ptr, ptr + nbytes))
    written = [key for key, ok in zip(where, unmodified_file_pages(spans, maps)) if not ok]
    unproved += [by_tensor[key][0] for key in written]
    if unproved or not by_tensor:
        first = unproved[0] if unproved else "?"
        return None, (f"rank {rank}: {len(unproved) or len(by_tensor)} weight(s) are not unmodified views of a mapped "
                      f"safetensors checkpoint (e.g. `{first}`: loaded another way, cast, or written in place)")
    files = sorted({path for path, _ in where.values()})
    index = {path: i for i, path in enumerate(files)}
    places = [(n, index[where[id(t)][0]], where[id(t)][1]) for n, t in tensors.items()]
    digest = hashlib.sha256(repr((layout, places)).encode()).hexdigest()
    return (tuple(files), checkpoint_identity(files), digest), None


def in_place_verdict(everyone: list[tuple[Any, str | None] | None]) -> str | None:
    """Why the weights cannot stay in place, from every rank's claim (:func:`in_place_claim`, in rank order;
    ``None`` for a rank that made none), or ``None`` when they can: a function of the claims alone, so the same on
    every rank (``rank0_distribute`` asks it before its estimate: in place, it does not run).

    Example:
        >>> token = ("/ckpt", ("id",), "digest")
        >>> in_place_verdict([(token, None), (token, None)]) is None
        True
        >>> in_place_verdict([(token, None), None])
        "rank 1 made no claim (other settings than rank 0's?)"
    """
    everyone = [c if c is not None else (None, f"rank {r} made no claim (other settings than rank 0's?)")
                for r, c in enumerate(everyone)]
    ref = everyone[0][0]
    whys = [w for _, w in everyone if w]
    if ref is not None:
        whys += [f"rank {r} maps another checkpoint or model than rank 0" for r, (t, w) in enumerate(everyone) if not w and t != ref]
    return "; ".join(whys[:3]) if whys else None


def decide_in_place(everyone: list[tuple[Any, str | None] | None]) -> InPlace:
    """The decision of :func:`agree_on_in_place` from every rank's claim (in rank order), the same on every rank
    (:func:`in_place_verdict`)."""
    why = in_place_verdict(everyone)
    return InPlace(why is None, why)


def agree_on_in_place(coll: Collectives, model: nn.Module, *, mixed_precision: str) -> InPlace:
    """Decides, identically on every rank, whether ``fully_shard`` may keep each rank's own rows of the model it
    holds (no weight to ``meta``, none read again or sent).

    It may when every rank holds every weight as an unmodified view of the same files (the address *and* the
    kernel's page record on each rank: an edit on any rank disqualifies), every rank sees the same files
    (:func:`checkpoint_identity`), the same names, shapes, dtypes and ``requires_grad`` flags, each name at the same
    place of the same file, and no weight is cast to fp32 under mixed precision: then every rank's bytes are rank
    0's. One all-gather of a small claim per rank (:func:`in_place_claim`, decided by
    :func:`decide_in_place`; ``meta_placement`` sends its claim with the pipeline's preflight exchange instead).

    Args:
        coll: The stage's collectives.
        model: The unsharded model.
        mixed_precision: accelerate's setting (``"no"``, ``"bf16"``, ``"fp16"``).

    Returns:
        The decision.
    """
    claim = in_place_claim(model, coll.rank, mixed_precision=mixed_precision)
    everyone = coll.all_gather_object(claim, what="all_gather of whether every rank holds rank 0's mapped bytes")
    return decide_in_place(everyone)


class MappedParameterPages:
    """On a rank whose weights stayed in place (:func:`agree_on_in_place`: every one proved an unmodified view of
    the mapped checkpoint), drops from its RSS the file pages of each group's original parameters once
    ``fully_shard`` has copied this rank's rows out of them (``madvise(MADV_DONTNEED)`` on a clean private file
    mapping: the next access reads the file again, the same bytes). Stock accelerate keeps them resident until the
    whole mapping is released at the end of ``prepare``; here the pages of at most one group's rows are resident
    at a time beside the shards.

    Example:
        >>> pages = MappedParameterPages(nn.Linear(2, 2))  # anonymous memory: only called on proved mappings
        >>> pages.bytes_dropped
        0
    """

    def __init__(self, model: nn.Module) -> None:
        self._by_module: dict[int, list[tuple[int, torch.Tensor]]] = {
            id(mod): [(id(p), p.detach()) for p in mod._parameters.values() if p is not None] for mod in model.modules()
        }
        self._done: set[int] = set()
        self.bytes_dropped = 0

    def formed(self, modules: list[nn.Module]) -> None:
        """``modules`` form an FSDP group now sharded: drop the pages of the parameters they held."""
        from ..io.mapped_pages import drop_pages

        for m in modules:
            for sub in m.modules():
                for key, t in self._by_module.pop(id(sub), ()):
                    if key not in self._done:
                        self._done.add(key)
                        self.bytes_dropped += drop_pages(t)
