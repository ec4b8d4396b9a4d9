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
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any

from ..errors import CheckpointError
from ..io.safetensors_source import SafetensorsSource
from .collectives import Collectives

#: ``load_source`` values: ``auto`` reads locally where every rank can, else from rank 0.
LOAD_SOURCES = ("auto", "rank0", "every_rank")


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


def agree_on_local_reads(
    coll: Collectives, rank0_checkpoint: SafetensorsSource | None, rank0_names: set[str], *, mode: str,
) -> tuple[SafetensorsSource | None, set[str], str | None]:
    """Decides, identically on every rank, which weights each rank reads from the checkpoint itself.

    Args:
        coll: The stage's collectives (one broadcast and one all-gather of small objects).
        rank0_checkpoint: On rank 0, its checkpoint source (``None`` elsewhere, or without one).
        rank0_names: On rank 0, the weights proved to be the checkpoint's unmodified bytes.
        mode: ``"auto"`` (fall back to rank 0 when a rank cannot read locally) or ``"every_rank"`` (raise).

    Returns:
        ``(source, names, why_not)``: this rank's open checkpoint and the agreed names, or ``(None,
        set(), reason)`` when the weights come from rank 0.

    Raises:
        CheckpointError: On every rank, with ``mode="every_rank"`` when some rank cannot read locally.
    """
    offer = None
    if coll.rank == 0 and rank0_checkpoint is not None and rank0_names:
        offer = (os.path.abspath(rank0_checkpoint.path), checkpoint_identity(rank0_checkpoint), sorted(rank0_names))
    offer = coll.broadcast_object(offer, src=0, what="broadcast of rank 0's checkpoint identity")
    if offer is None:
        why = "rank 0's weights are not unmodified views of a safetensors checkpoint (not loaded zero-copy, or edited)"
        if mode == "every_rank":
            raise CheckpointError(f"`load_source='every_rank'`: {why}. HINT: use load_source='auto' or 'rank0'.")
        return None, set(), why
    path, identity, names = offer
    source, problem = (rank0_checkpoint, None) if coll.rank == 0 else _open_same(path, identity)
    problems = coll.all_gather_object(problem, what="all_gather of whether every rank sees rank 0's checkpoint")
    bad = [(r, p) for r, p in enumerate(problems) if p]
    if bad:
        if source is not None and coll.rank != 0:
            source.close()
        why = "; ".join(f"rank {r}: {p}" for r, p in bad[:4])
        if mode == "every_rank":
            raise CheckpointError(
                f"`load_source='every_rank'` needs every rank to see rank 0's checkpoint {path}: {why}. HINT: put the "
                "checkpoint on a filesystem all nodes share, or use load_source='auto' (falls back to rank 0)."
            )
        return None, set(), why
    return source, set(names), None


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
