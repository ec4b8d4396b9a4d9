"""Making every non-persistent buffer correct and identical on every rank, then proving it.

Non-persistent buffers (rotary ``inv_freq``, causal masks ...) are not in any state dict, so no load
fills them: on a rank that built the model on ``meta`` they are missing, and on a rank that built it with
uninitialised memory they are garbage. For each one:

1. *Recompute* it from the module's own recipe when the module has one and owns no weights that the
   recipe could overwrite: the transformers model's ``_init_weights(module)`` (rotary embeddings), then
   ``module.reset_parameters()``. A recipe is tried on a fresh NaN-filled tensor; it counts only if it
   overwrote every element.
2. Otherwise *broadcast* rank 0's value.
3. *Verify*: every buffer is finite and its checksum is the same on every rank (one all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import StageError
from .collectives import Collectives


@dataclass
class BufferStats:
    """Figures for the stage report."""

    recomputed: int = 0
    broadcast: int = 0
    verified: int = 0


def _non_persistent(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    out, seen = [], set()
    for mod_name, mod in model.named_modules():
        for local, b in mod._buffers.items():
            if b is None or local not in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mod_name}.{local}" if mod_name else local, mod, local, b))
    return out


def _owns_weights(mod: nn.Module) -> bool:
    return any(p is not None for p in mod._parameters.values()) or any(
        b is not None and n not in mod._non_persistent_buffers_set for n, b in mod._buffers.items()
    )


def _try_recipe(root: nn.Module, mod: nn.Module, locals_: list[str], specs: dict[str, tuple], device: torch.device) -> set[str]:
    """Runs the module's recipe on fresh NaN buffers; returns the names it fully wrote."""
    if _owns_weights(mod):
        return set()
    floats = [n for n in locals_ if specs[n][1].is_floating_point]
    if not floats:
        return set()
    old = {n: mod._buffers[n] for n in floats}
    for n in floats:
        mod._buffers[n] = torch.full(specs[n][0], float("nan"), dtype=specs[n][1], device=device)
    recipes = []
    init_weights = getattr(root, "_init_weights", None)
    if callable(init_weights):
        recipes.append(lambda: init_weights(mod))
    reset = getattr(mod, "reset_parameters", None)
    if callable(reset):
        recipes.append(reset)
    done: set[str] = set()
    with torch.no_grad():
        for recipe in recipes:
            try:
                recipe()
            except Exception:
                continue
            done = {n for n in floats if mod._buffers[n] is not None and not torch.isnan(mod._buffers[n]).any()}
            if done:
                break
    for n in floats:
        if n not in done:
            mod._buffers[n] = old[n]
    return done


def _checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of the tensor's bytes (int64, wrapping): equal bytes give equal sums."""
    data = t.detach().cpu().contiguous().view(-1).view(torch.uint8) if t.numel() else torch.zeros(0, dtype=torch.uint8)
    total = data.numel()
    step = 1 << 20
    for i in range(0, data.numel(), step):
        chunk = data[i : i + step].to(torch.int64)
        weights = torch.arange(i + 1, i + 1 + chunk.numel(), dtype=torch.int64) % 1_000_003 + 1
        total += int((chunk * weights).sum())
    return total & ((1 << 62) - 1)


def init_non_persistent_buffers(model: nn.Module, *, coll: Collectives, device: torch.device) -> BufferStats:
    """Recomputes or broadcasts every non-persistent buffer, then verifies them across ranks.

    Args:
        model: The prepared (sharded) model; the same structure on every rank.
        coll: Timeout-guarded collectives of the calling stage.
        device: Where the buffers live.

    Returns:
        How many buffers were recomputed, broadcast and verified.

    Raises:
        StageError: Naming every buffer that is not finite or differs between ranks (and the ranks),
            or that rank 0 cannot provide (on ``meta``).
        CollectiveTimeoutError: If a rank stops participating.

    Example:
        >>> # on every rank, after rank0_distribute:
        >>> # init_non_persistent_buffers(model, coll=Collectives("buffer_init", timeout_s=60), device=cpu)
    """
    stats = BufferStats()
    buffers = _non_persistent(model)
    if not buffers:
        return stats
    # rank 0's shapes and dtypes are the reference; rank 0 also says which buffers it cannot provide
    specs0 = [(tuple(b.shape), b.dtype, b.is_meta) for _, _, _, b in buffers]
    specs = coll.broadcast_object(specs0, src=0, what="broadcast of non-persistent buffer shapes")
    if len(specs) != len(buffers):
        raise StageError(
            f"rank {coll.rank} has {len(buffers)} non-persistent buffers, rank 0 has {len(specs)}: the models differ."
        )
    by_module: dict[int, list[int]] = {}
    for i, (_, mod, _, _) in enumerate(buffers):
        by_module.setdefault(id(mod), []).append(i)
    method: list[str] = ["broadcast"] * len(buffers)
    for idxs in by_module.values():
        mod = buffers[idxs[0]][1]
        locals_ = [buffers[i][2] for i in idxs]
        spec = {buffers[i][2]: specs[i] for i in idxs}
        done = _try_recipe(model, mod, locals_, spec, device)
        for i in idxs:
            if buffers[i][2] in done:
                method[i] = "recipe"
    to_send = [i for i, m in enumerate(method) if m == "broadcast"]
    unprovidable = [buffers[i][0] for i in to_send if specs[i][2]]
    if unprovidable:
        raise StageError(
            f"non-persistent buffer(s) {unprovidable[:10]} have no init recipe and are on `meta` on rank 0, so "
            "no rank has a value for them. Give the module a `reset_parameters()` that fills them, or build "
            "the model on rank 0 with real buffers (e.g. `accelerate_memsafe.from_pretrained`)."
        )
    with torch.no_grad():
        for i in to_send:
            fqn, mod, local, b = buffers[i]
            shape, dtype, _ = specs[i]
            if coll.rank == 0:
                t = b.detach().to(device=device).contiguous().clone()
            else:
                t = torch.empty(shape, dtype=dtype, device=device)
            coll.broadcast(t, src=0, what=f"broadcast of non-persistent buffer `{fqn}`")
            mod._buffers[local] = t
    stats.recomputed = method.count("recipe")
    stats.broadcast = len(to_send)

    # verify: finite and bitwise identical everywhere
    rows = []
    for _, mod, local, _ in _non_persistent(model):
        t = mod._buffers[local]
        finite = bool(torch.isfinite(t).all()) if t.is_floating_point() or t.is_complex() else True
        rows.append([1 if finite else 0, _checksum(t)])
    gathered = coll.all_gather(torch.tensor(rows, dtype=torch.int64).view(-1, 2), what="checksum all-gather of non-persistent buffers")
    problems = []
    names = [fqn for fqn, *_ in buffers]
    for i, name in enumerate(names):
        bad = [r for r, g in enumerate(gathered) if int(g[i, 0]) == 0]
        if bad:
            problems.append(f"`{name}` is not finite on rank(s) {bad}")
        sums = [int(g[i, 1]) for g in gathered]
        if len(set(sums)) > 1:
            differ = [r for r, s in enumerate(sums) if s != sums[0]]
            problems.append(f"`{name}` differs from rank 0's on rank(s) {differ} ({method[i]})")
    if problems:
        raise StageError(
            f"`buffer_init`: {len(problems)} non-persistent buffer problem(s): {problems[:10]}. A module's "
            "recipe may depend on rank-local state; remove its `reset_parameters` to have rank 0's value broadcast."
        )
    stats.verified = len(names)
    return stats
