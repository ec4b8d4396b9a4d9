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

``node``: only each node's leader (its local rank 0) must see the files; it reads for its node's ranks and
scatters within the node (:mod:`~accelerate_memsafe.distributed.node_scatter`), and rank 0 sends each
leader what it cannot read.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..io.safetensors_source import SafetensorsSource
from .collectives import Collectives
from .topology import Nodes

#: ``load_source`` values: ``auto`` reads locally where every rank can, else through the node leaders where
#: they can, else from rank 0.
LOAD_SOURCES = ("auto", "rank0", "node", "every_rank")


def checkpoint_identity(source: SafetensorsSource) -> list[tuple[str, int, int, str]]:
    """Per file of the checkpoint: ``(name, size, mtime_ns, sha256 of its header)``.

    Example:
        >>> # checkpoint_identity(SafetensorsSource("ckpt/"))[0][0]
        >>> # 'model.safetensors'
    """
    out = []
    for file in source.files:
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
