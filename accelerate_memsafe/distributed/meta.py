"""Moving a model's weights to ``meta`` before sharding, keeping ties and optimizer references.

On ``meta`` a dtype change (accelerate's fp32 upcast under mixed precision) or ``fully_shard`` costs no
memory. Rank 0 keeps the original tensors (often zero-copy views of an mmap'ed checkpoint) as the source
that ``rank0_distribute`` reads from; the other ranks keep nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .collectives import Collectives
from .sharding import canonical_name


@dataclass(frozen=True)
class TensorMeta:
    """What every rank must agree on about one parameter or persistent buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    is_param: bool
    on_meta: bool


def weights_metadata(model: nn.Module) -> list[TensorMeta]:
    """Parameters, then persistent buffers, each once (tied tensors under their first name).

    Example:
        >>> [m.name for m in weights_metadata(torch.nn.Linear(2, 3))]
        ['weight', 'bias']
    """
    out: list[TensorMeta] = []
    seen: set[int] = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out.append(TensorMeta(canonical_name(name), tuple(p.shape), p.dtype, True, p.is_meta))
    for mod_name, mod in model.named_modules():
        for local, b in mod._buffers.items():
            if b is None or local in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            name = canonical_name(f"{mod_name}.{local}" if mod_name else local)
            out.append(TensorMeta(name, tuple(b.shape), b.dtype, False, b.is_meta))
    return out


def nonfinite_weights(model: nn.Module, *, chunk_elems: int = 1 << 24) -> list[str]:
    """Names of the real (non-meta) floating-point parameters and persistent buffers holding NaN or Inf.

    Checked in chunks so the temporary mask stays below ``chunk_elems`` bytes.

    Example:
        >>> m = nn.Linear(2, 2); _ = m.weight.data.fill_(float("nan"))
        >>> nonfinite_weights(m)
        ['weight']
    """
    bad = []
    persistent = set(model.state_dict(keep_vars=True))
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
    for name, t in tensors:
        if t.device.type == "meta" or not t.is_floating_point():
            continue
        flat = t.detach().reshape(-1)
        if any(not torch.isfinite(flat[i : i + chunk_elems]).all() for i in range(0, flat.numel(), chunk_elems)):
            bad.append(name)
    return bad


def agree_on_structure(model: nn.Module, coll: Collectives, *, check_finite: bool = False) -> list[TensorMeta]:
    """Checks that every rank holds the same model as rank 0 before anything is modified.

    Rank 0 broadcasts its names, shapes and dtypes. A rank whose names or shapes differ, or a rank 0
    whose own weights are on ``meta`` (nothing to distribute) or, with ``check_finite``, hold NaN/Inf,
    makes *every* rank raise. Dtypes may
    differ (a rank built on meta with another default dtype): the other ranks adopt rank 0's.

    Returns:
        Rank 0's metadata.

    Raises:
        CheckpointError: On every rank, naming the rank(s) and the first differing tensors.
    """
    mine = weights_metadata(model)
    theirs = coll.broadcast_object(mine, src=0, what="broadcast of rank 0's parameter names and shapes")
    problems: list[str] = []
    if coll.rank == 0:
        on_meta = [m.name for m in mine if m.on_meta]
        if on_meta:
            problems.append(
                f"rank 0 holds {len(on_meta)} weight(s) on `meta` ({on_meta[:5]}); rank 0 must hold the real "
                "weights that it distributes. Load them on rank 0 (e.g. `accelerate_memsafe.from_pretrained`)."
            )
        nonfinite = nonfinite_weights(model) if check_finite else []
        if nonfinite:
            problems.append(
                f"rank 0's weight(s) {nonfinite[:10]} contain NaN or Inf ({len(nonfinite)} tensor(s)); fix the "
                "checkpoint or turn off `check_finite_weights`."
            )
    else:
        ref = {m.name: m for m in theirs}
        own = {m.name: m for m in mine}
        missing = [n for n in ref if n not in own]
        extra = [n for n in own if n not in ref]
        shapes = [f"`{n}` {own[n].shape} vs rank 0 {ref[n].shape}" for n in own if n in ref and own[n].shape != ref[n].shape]
        if missing or extra or shapes:
            problems.append(
                f"rank {coll.rank}'s model differs from rank 0's: missing {missing[:5]}, extra {extra[:5]}, "
                f"shapes {shapes[:5]}. Build the same model (same config) on every rank."
            )
    flags = coll.all_gather(torch.tensor([1 if problems else 0], dtype=torch.int64), what="agreement on the model structure")
    bad = [r for r, f in enumerate(flags) if int(f.item())]
    if bad:
        own = " ".join(problems) if problems else "see the error on those ranks."
        raise CheckpointError(f"`meta_placement`: rank(s) {bad} cannot take part in the rank-0 load: {own}")
    return theirs


def move_to_meta(
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    reference: list[TensorMeta],
    *,
    keep: bool,
) -> dict[str, torch.Tensor]:
    """Replaces every parameter and persistent buffer by a ``meta`` tensor of rank 0's dtype.

    Tied parameters get one shared new parameter (ties survive); optimizers are pointed at the new
    parameters. Non-persistent buffers are left alone (``buffer_init`` takes care of them).

    Args:
        model: The unsharded model.
        optimizers: Optimizers built on ``model``'s parameters.
        reference: Rank 0's metadata (from :func:`agree_on_structure`).
        keep: Return the original tensors (rank 0, the distribution source).

    Returns:
        Canonical name -> original tensor when ``keep``, else an empty dict.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> src = move_to_meta(lin, [], weights_metadata(lin), keep=True)
        >>> lin.weight.is_meta, src["weight"].is_meta
        (True, False)
    """
    dtypes = {m.name: m.dtype for m in reference}
    new_by_id: dict[int, torch.Tensor] = {}
    originals: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for local, p in list(mod._parameters.items()):
            if p is None:
                continue
            name = canonical_name(f"{mod_name}.{local}" if mod_name else local)
            if id(p) not in new_by_id:
                dtype = dtypes.get(name, p.dtype)
                new_by_id[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad)
                if keep:
                    originals[name] = p.detach()
            mod._parameters[local] = new_by_id[id(p)]
        for local, b in list(mod._buffers.items()):
            if b is None or local in mod._non_persistent_buffers_set:
                continue
            name = canonical_name(f"{mod_name}.{local}" if mod_name else local)
            if id(b) not in new_by_id:
                new_by_id[id(b)] = torch.empty(b.shape, dtype=dtypes.get(name, b.dtype), device="meta")
                if keep:
                    originals[name] = b.detach()
            mod._buffers[local] = new_by_id[id(b)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new_by_id.get(id(p), p) for p in group["params"]]
    return originals


def parallelism_blocks_meta_placement(mesh: Any, parallelism_config: Any) -> str | None:
    """Why the rank-0 load does not apply (HSDP / TP / CP meshes), or ``None`` when it does."""
    if mesh is not None and getattr(mesh, "ndim", 1) > 1:
        return f"the device mesh has {mesh.ndim} dimensions (HSDP/TP); rank-0 distribution supports 1-D FSDP"
    if parallelism_config is not None:
        for attr in ("tp_size", "cp_size", "sp_size", "dp_replicate_size"):
            if getattr(parallelism_config, attr, 1) not in (None, 1):
                return f"parallelism_config.{attr}={getattr(parallelism_config, attr)}; rank-0 distribution supports 1-D FSDP"
    return None


def checkpoint_source_names(originals: dict[str, torch.Tensor], checkpoint_path: str | None) -> tuple[Any, set[str]]:
    """Which of rank 0's tensors can be re-read from the checkpoint file instead of its mmap.

    A tensor qualifies when its bytes are exactly the mapped bytes of the same-named checkpoint tensor
    (a zero-copy load that nothing replaced). Reading those with ``pread`` keeps the file's pages out of
    rank 0's RSS.

    Returns:
        ``(SafetensorsSource or None, names)``.
    """
    if not checkpoint_path:
        return None, set()
    from ..io.safetensors_source import SafetensorsSource, file_backed_ranges, is_view_of_entry

    try:
        source = SafetensorsSource(checkpoint_path)
    except CheckpointError:
        return None, set()
    maps = file_backed_ranges(".safetensors")
    names = {
        n for n, t in originals.items() if n in source.entries and is_view_of_entry(t, source.entries[n], maps)
    }
    if not names:
        source.close()
        return None, set()
    return source, names
