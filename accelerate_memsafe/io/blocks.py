"""Where a rank's local tensor of a DTensor lies in the full tensor: one block (an offset and a size per
dimension), as DTensor reports it from its placements without data (``__create_chunk_list__``, the
protocol DCP saves by). Right for ``Shard(d)`` on any dim, ``Replicate`` and FSDP2's ``_StridedShard``
under TP, on any mesh."""

from __future__ import annotations

from typing import Any

from .. import _compat

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A rank's block of a tensor: the offset and the size in each dimension."""


def local_block(param: Any) -> Box | str:
    """This rank's block of the DTensor ``param``, or why its local tensor is not one block.

    Example:
        >>> # local_block(model.lm_head.weight)  # on rank 1 of 2, FSDP2: ((rows of rank 0, 0), (rows, hidden))
    """
    chunks = _compat.dtensor_chunks(param)
    if len(chunks) != 1:
        return f"its local tensor is {len(chunks)} blocks of the global one ({param.placements})"
    offsets, sizes = chunks[0]
    local = tuple(param.to_local().shape)
    if local != sizes:
        return f"its local tensor has shape {local}, its placements say {sizes}"
    return offsets, sizes


def block_cols(box: Box, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
    """The block's slices of dimensions 1.. (``None``: whole rows, as under FSDP alone).

    Example:
        >>> block_cols(((2, 0), (3, 4)), (8, 4)), block_cols(((2, 4), (3, 4)), (8, 8))
        (None, (slice(4, 8, None),))
    """
    offsets, sizes = box
    if all(o == 0 and z == n for o, z, n in zip(offsets[1:], sizes[1:], shape[1:])):
        return None
    return tuple(slice(o, o + z) for o, z in zip(offsets[1:], sizes[1:]))
