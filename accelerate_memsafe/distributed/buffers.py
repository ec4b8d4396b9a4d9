"""Making every non-persistent buffer correct and identical on every rank, then proving it.

Non-persistent buffers (rotary ``inv_freq``, causal masks ...) are not in any state dict, so no load
fills them: on a rank that built the model on ``meta`` they are missing, and on a rank that built it with
uninitialised memory they are garbage. Rank 0's value is the truth, even where the user changed it on
purpose (a rescaled rotary ``inv_freq``).

0. *Check first*: every rank's buffers (shapes, dtypes, checksums) are compared with rank 0's in one
   all-gather of a fixed-size row; where every rank already holds rank 0's values, all finite (a model every
   rank built or loaded the same way), there is nothing to do. The rows may instead travel earlier, in the
   pipeline's preflight exchange (:func:`buffer_claim`): where the caller proves that nothing touched any rank's
   buffers since, the check needs no collective of its own.

Otherwise rank 0 makes one plan and broadcasts it; for each buffer:

1. *Recompute* it on the other ranks from the module's own recipe, but only where rank 0 proved that the
   recipe reproduces rank 0's current value bit for bit (rank 0 runs it on a scratch copy and compares;
   its own buffer is never replaced). A recipe exists when the module owns no weights that it could
   overwrite: the transformers model's ``_init_weights(module)`` (rotary embeddings), then
   ``module.reset_parameters()``; it counts only if it overwrote every element of a NaN-filled tensor.
2. Otherwise *broadcast* rank 0's value.
3. *Verify*: every buffer is finite and its checksum is the same on every rank (one all-gather). A
   buffer that differs from rank 0's somewhere (a recipe that depends on the rank or the device) is
   broadcast from rank 0 and verified again; one that is not finite on rank 0 is an error.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import walk
from ..errors import StageError
from .collectives import Collectives


@dataclass
class BufferStats:
    """Figures for the stage report."""

    recomputed: int = 0
    broadcast: int = 0
    verified: int = 0
    resent: int = 0
    already_equal: int = 0
    checked_in_preflight: bool = False
    """Whether the check used the rows every rank sent in the preflight exchange, without a collective of its own."""

    def details(self) -> dict[str, int | bool]:
        """The report's details; ``resent`` appears only when a buffer had to be sent again, ``already_equal``
        only when every rank held rank 0's values from the start, ``checked_in_preflight`` only when the check
        needed no collective."""
        out: dict[str, int | bool] = {"recomputed": self.recomputed, "broadcast": self.broadcast, "verified": self.verified}
        if self.resent:
            out["resent"] = self.resent
        if self.already_equal:
            out["already_equal"] = self.already_equal
        if self.checked_in_preflight:
            out["checked_in_preflight"] = True
        return out


def _non_persistent(model: nn.Module, *, names: bool = True) -> list[tuple[str | None, nn.Module, str, torch.Tensor]]:
    """``(name, module, local name, tensor)`` of every non-persistent buffer, each tensor once, in module order.
    ``names=False``: ``None`` for the name, from a walk that builds no module path (enough to see that the buffers are
    still the tensors a claim fingerprinted, :func:`_unchanged`)."""
    out, seen = [], set()
    for mod_name, mod in walk.named_modules(model) if names else ((None, m) for m in walk.modules(model)):
        for local, b in mod._buffers.items():
            if b is None or local not in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append(((f"{mod_name}.{local}" if mod_name else local) if names else None, mod, local, b))
    return out


def _owns_weights(mod: nn.Module) -> bool:
    return any(p is not None for p in mod._parameters.values()) or any(
        b is not None and n not in mod._non_persistent_buffers_set for n, b in mod._buffers.items()
    )


def _run_recipe(root: nn.Module, mod: nn.Module, locals_: list[str], specs: dict[str, tuple], device: torch.device) -> dict[str, torch.Tensor]:
    """Runs the module's recipe on fresh NaN buffers; returns the ones it fully wrote.

    The module's own buffers are put back afterwards: the caller decides what to install.
    """
    if _owns_weights(mod):
        return {}
    floats = [n for n in locals_ if specs[n][1].is_floating_point]
    if not floats:
        return {}
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
    done: dict[str, torch.Tensor] = {}
    try:
        with torch.no_grad():
            for recipe in recipes:
                try:
                    recipe()
                except Exception:
                    continue
                done = {
                    n: mod._buffers[n] for n in floats
                    if mod._buffers[n] is not None and not torch.isnan(mod._buffers[n]).any()
                }
                if done:
                    break
    finally:
        for n in floats:
            mod._buffers[n] = old[n]
    return done


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (``-0.0`` is not ``0.0``; a NaN equals the same NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.numel():
        return True
    a = a.detach().contiguous().reshape(-1).view(torch.uint8)
    b = b.detach().to(a.device).contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a, b)


def _plan_on_rank0(model: nn.Module, buffers: list, groups: list[list[int]], device: torch.device) -> list[str]:
    """Rank 0's decision per buffer: ``"recipe"`` where the recipe reproduces rank 0's value bit for bit
    (or fills a buffer rank 0 holds on ``meta``), else ``"broadcast"``."""
    plan = ["broadcast"] * len(buffers)
    for idxs in groups:
        mod = buffers[idxs[0]][1]
        spec = {buffers[i][2]: (tuple(buffers[i][3].shape), buffers[i][3].dtype) for i in idxs}
        made = _run_recipe(model, mod, [buffers[i][2] for i in idxs], spec, device)
        for i in idxs:
            value, mine = made.get(buffers[i][2]), buffers[i][3]
            if value is not None and (mine.is_meta or _same_bits(value, mine)):
                plan[i] = "recipe"
    return plan


def _send_from_rank0(buffers: list, idxs: list[int], specs: list[tuple], coll: Collectives, device: torch.device) -> None:
    """Broadcasts rank 0's value of each listed buffer; rank 0 keeps its own tensor where it can."""
    with torch.no_grad():
        for i in idxs:
            fqn, mod, local, _ = buffers[i]
            shape, dtype, _ = specs[i]
            if coll.rank == 0:
                b = mod._buffers[local]
                t = b if b.device == device and b.is_contiguous() else b.detach().to(device=device).contiguous().clone()
            else:
                t = torch.empty(shape, dtype=dtype, device=device)
            coll.broadcast(t, src=0, what=f"broadcast of non-persistent buffer `{fqn}`")
            mod._buffers[local] = t


def _gather_checks(buffers: list, coll: Collectives) -> list[torch.Tensor]:
    """Per rank, per buffer: ``[finite, checksum]`` (a buffer still on ``meta`` is ``[0, -1]``)."""
    rows = [_check(mod._buffers[local]) for _, mod, local, _ in buffers]
    return coll.all_gather(torch.tensor(rows, dtype=torch.int64).view(-1, 2), what="checksum all-gather of non-persistent buffers")


def _check(t: torch.Tensor) -> list[int]:
    """``[finite, checksum]`` of one buffer (``[0, -1]`` for a buffer still on ``meta``). A contiguous CPU buffer of the
    usual float formats is read once, as bytes through numpy, for both (:func:`_all_finite`, :func:`_checksum`): each
    torch op a process calls first costs tens of microseconds of dispatch set-up, and this check runs in the
    preflight of a process's first ``prepare``."""
    if t.is_meta:
        return [0, -1]
    if t.dtype in _EXPONENT_BITS and t.device.type == "cpu" and t.is_contiguous() and t.numel():
        raw = t.detach().reshape(-1).view(torch.uint8).numpy()
        return [1 if _finite_bytes(raw, t.dtype) else 0, _digest(memoryview(raw))]
    return [1 if _all_finite(t) else 0, _checksum(t)]


#: Per float format, the numpy integer of its width and its exponent bits: a value is finite unless they are all set
#: (an infinity or a NaN), whatever its sign and mantissa.
_EXPONENT_BITS = {torch.float16: ("i2", 0x7C00), torch.bfloat16: ("i2", 0x7F80),
                  torch.float32: ("i4", 0x7F800000), torch.float64: ("i8", 0x7FF0000000000000)}


def _finite_bytes(raw: Any, dtype: torch.dtype) -> bool:
    """Whether every value of ``dtype`` (one of :data:`_EXPONENT_BITS`) in the bytes ``raw`` (a uint8 numpy array) is
    finite, read from the exponent bits (below the sign bit of the signed integer of that width)."""
    width, mask = _EXPONENT_BITS[dtype]
    flat = raw.view(width)
    return not bool(((flat & mask) == mask).any())


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite. A CPU tensor of the usual float formats is read from the exponent bits
    of its bytes, through numpy: the first ``torch.isfinite`` of a process costs about 0.4 ms of dispatch set-up, more
    than the whole buffer check, and the preflight's buffer claim is often the process's first. Other dtypes and
    devices: ``torch.isfinite``.

    Example:
        >>> _all_finite(torch.tensor([1.0, -2.5])), _all_finite(torch.tensor([1.0, float("nan")]).bfloat16())
        (True, False)
    """
    if not (t.is_floating_point() or t.is_complex()):
        return True
    if t.dtype not in _EXPONENT_BITS or t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    return _finite_bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), t.dtype)


def _fingerprint(buffers: list) -> list[tuple[weakref.ref, int]]:
    """Which tensor objects the buffers are (weak references: an ``id`` could be a freed tensor's, reused), and their
    in-place write counters."""
    return [(weakref.ref(mod._buffers[local]), mod._buffers[local]._version) for _, mod, local, _ in buffers]


def _unchanged(fingerprint: list[tuple[weakref.ref, int]], buffers: list) -> bool:
    """Whether the buffers are still the very tensors of ``fingerprint``, none written since: the same values."""
    return len(fingerprint) == len(buffers) and all(
        ref() is mod._buffers[local] and mod._buffers[local]._version == version
        for (ref, version), (_, mod, local, _) in zip(fingerprint, buffers))


def _check_row(buffers: list) -> tuple[int, int, int]:
    """``(count, digest, usable)`` of this rank's buffers: the digest covers names (activation checkpointing's
    wrapper left out of them), shapes, dtypes, finiteness and checksums; ``usable`` is whether every one is finite
    and none on ``meta``."""
    rows = [(fqn.replace(_AC_WRAPPER, ""), tuple(t.shape), str(t.dtype), *_check(t))
            for fqn, mod, local, _ in buffers for t in (mod._buffers[local],)]
    usable = all(finite for *_, finite, _ in rows)  # a buffer on meta is not finite either
    digest = int.from_bytes(hashlib.sha256(repr(rows).encode()).digest()[:7], "little")
    return len(buffers), digest, int(usable)


# the module name torch's activation checkpointing inserts (``shard`` wraps blocks after the preflight's look)
_AC_WRAPPER = "_checkpoint_wrapped_module."


def _equal_everywhere(buffers: list, coll: Collectives, row: tuple[int, int, int] | None = None) -> bool:
    """Whether every rank already holds rank 0's buffers: the same names, shapes, dtypes and checksums, all
    finite and none on ``meta``. One all-gather of three integers per rank (a count, a digest, a flag), so
    ranks that hold different buffers never disagree on a collective's size. ``row``: this rank's
    :func:`_check_row`, when already known."""
    mine = torch.tensor(row if row is not None else _check_row(buffers), dtype=torch.int64)
    gathered = coll.all_gather(mine, what="check of the non-persistent buffers against rank 0's")
    return _every_rank_holds_rank0s([tuple(g.tolist()) for g in gathered])


def _every_rank_holds_rank0s(rows: list[tuple[int, int, int] | None]) -> bool:
    """Whether every rank's :func:`_check_row` (rank order) is rank 0's, and rank 0's buffers are usable."""
    return rows[0] is not None and bool(rows[0][2]) and all(r == rows[0] for r in rows)


@dataclass(frozen=True)
class BufferClaim:
    """What a rank tells the others about its non-persistent buffers before a hook's stages run
    (:func:`buffer_claim`): ``row`` travels (three integers), ``fingerprint`` stays on the rank."""

    row: tuple[int, int, int] | None
    fingerprint: list[tuple[weakref.ref, int]]


def buffer_claim(model: nn.Module) -> BufferClaim:
    """This rank's buffers as :func:`init_non_persistent_buffers` checks them, taken early (the pipeline's
    preflight exchange carries ``row``), so that the check can do without a collective of its own.

    Example:
        >>> buffer_claim(nn.Linear(2, 2)).row is None  # no non-persistent buffer
        True
    """
    buffers = _non_persistent(model)
    return BufferClaim(_check_row(buffers) if buffers else None, _fingerprint(buffers))


def _differing(gathered: list[torch.Tensor], i: int) -> list[int]:
    """Ranks whose buffer ``i`` is not finite or whose checksum differs from rank 0's."""
    return [r for r, g in enumerate(gathered) if int(g[i, 0]) == 0 or int(g[i, 1]) != int(gathered[0][i, 1])]


def _checksum(t: torch.Tensor) -> int:
    """A digest of the tensor's bytes (62 bits of BLAKE2b, read in place from a contiguous CPU tensor): equal bytes
    give equal digests, and a differing byte anywhere a different one but for a 2**-62 chance."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return _digest(memoryview(data.numpy()) if data.numel() else b"")


def _digest(data: Any) -> int:
    """:func:`_checksum`'s digest of a buffer of bytes."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 62) - 1)


def init_non_persistent_buffers(model: nn.Module, *, coll: Collectives, device: torch.device,
                                claims: list[tuple[int, int, int] | None] | None = None, mine: BufferClaim | None = None,
                                untouched_everywhere: bool = False) -> BufferStats:
    """Recomputes or broadcasts every non-persistent buffer, then verifies them across ranks.

    Args:
        model: The prepared (sharded) model; the same structure on every rank.
        coll: Timeout-guarded collectives of the calling stage.
        device: Where the buffers live.
        claims: Every rank's :attr:`BufferClaim.row` (rank order), exchanged before the hook's stages ran.
        mine: This rank's :func:`buffer_claim` of that moment (its row is reused while its buffers are the same
            tensors, unwritten).
        untouched_everywhere: The caller proves, identically on every rank, that no rank's buffers changed since
            the claims (every rank kept its model in place). Then, when every rank claimed rank 0's row, the
            check needs no collective: each rank only confirms that its row is still the one it claimed.

    Returns:
        How many buffers were recomputed (on the ranks other than 0), broadcast, verified and re-sent.

    Raises:
        StageError: Naming every buffer that is not finite on rank 0 or still differs between ranks after
            being re-sent (and the ranks), or that rank 0 cannot provide (on ``meta``, no recipe); or, with
            ``untouched_everywhere``, a rank whose buffers are no longer what it claimed.
        CollectiveTimeoutError: If a rank stops participating.

    Example:
        >>> # on every rank, after rank0_distribute:
        >>> # init_non_persistent_buffers(model, coll=Collectives("buffer_init", timeout_s=60), device=cpu)
    """
    stats = BufferStats()
    row = None
    if mine is not None:  # most often the claimed buffers are still in place, unwritten: no names needed to see it
        held = _non_persistent(model, names=False)
        if held and _unchanged(mine.fingerprint, held):
            row = mine.row
    buffers = _non_persistent(model) if row is None else held
    if not buffers:
        return stats
    if untouched_everywhere and claims is not None and len(claims) == coll.world_size and _every_rank_holds_rank0s(claims):
        now = row if row is not None else _check_row(buffers)
        if now != claims[0]:
            raise StageError(
                f"rank {coll.rank}: the non-persistent buffers changed between the preflight exchange and "
                "`buffer_init` although no stage moved them (every rank kept its model in place): this is a bug of "
                "accelerate_memsafe, please report it. Work around it with `MemSafePlugin(load_source='rank0')`."
            )
        stats.verified = stats.already_equal = len(buffers)
        stats.checked_in_preflight = True
        return stats
    if _equal_everywhere(buffers, coll, row):
        stats.verified = stats.already_equal = len(buffers)
        return stats
    if row is not None:
        buffers = _non_persistent(model)  # what follows names them
    by_module: dict[int, list[int]] = {}
    for i, (_, mod, _, _) in enumerate(buffers):
        by_module.setdefault(id(mod), []).append(i)
    groups = list(by_module.values())
    # rank 0's shapes and dtypes are the reference, and rank 0 alone decides what is recomputed: the
    # other ranks cannot know whether rank 0's value is still what the recipe makes
    mine = None
    if coll.rank == 0:
        mine = ([(tuple(b.shape), b.dtype, b.is_meta) for _, _, _, b in buffers], _plan_on_rank0(model, buffers, groups, device))
    specs, plan = coll.broadcast_object(mine, src=0, what="broadcast of non-persistent buffer shapes and plan")
    if len(specs) != len(buffers):
        raise StageError(
            f"rank {coll.rank} has {len(buffers)} non-persistent buffers, rank 0 has {len(specs)}: the models differ."
        )
    to_send = [i for i, m in enumerate(plan) if m == "broadcast"]
    unprovidable = [buffers[i][0] for i in to_send if specs[i][2]]
    if unprovidable:
        raise StageError(
            f"non-persistent buffer(s) {unprovidable[:10]} have no init recipe and are on `meta` on rank 0, so "
            "no rank has a value for them. Give the module a `reset_parameters()` that fills them, or build "
            "the model on rank 0 with real buffers (e.g. `accelerate_memsafe.from_pretrained`)."
        )
    for idxs in groups:
        # rank 0 keeps its own value (proven equal to the recipe's) unless it has none (on meta)
        todo = [i for i in idxs if plan[i] == "recipe" and (coll.rank != 0 or specs[i][2])]
        if not todo:
            continue
        mod = buffers[idxs[0]][1]
        made = _run_recipe(model, mod, [buffers[i][2] for i in idxs], {buffers[i][2]: specs[i] for i in idxs}, device)
        for i in todo:
            if buffers[i][2] in made:  # else verification finds it differs, and rank 0's value is re-sent
                mod._buffers[buffers[i][2]] = made[buffers[i][2]]
    _send_from_rank0(buffers, to_send, specs, coll, device)
    stats.recomputed = plan.count("recipe")
    stats.broadcast = len(to_send)

    # verify: finite and bitwise identical everywhere; rank 0's value wins where a rank differs
    names = [fqn for fqn, *_ in buffers]
    gathered = _gather_checks(buffers, coll)
    nonfinite0 = [i for i in range(len(buffers)) if int(gathered[0][i, 0]) == 0]
    resend = [] if nonfinite0 else [i for i in range(len(buffers)) if _differing(gathered, i)]
    if resend:
        _send_from_rank0(buffers, resend, specs, coll, device)
        gathered = _gather_checks(buffers, coll)
        stats.resent = len(resend)
    problems = []
    for i, name in enumerate(names):
        bad = [r for r, g in enumerate(gathered) if int(g[i, 0]) == 0]
        if bad:
            problems.append(f"`{name}` is not finite on rank(s) {bad}")
        differ = [r for r in _differing(gathered, i) if r not in bad]
        if differ:
            problems.append(f"`{name}` differs from rank 0's on rank(s) {differ} ({plan[i]})")
    if problems:
        raise StageError(
            f"`buffer_init`: {len(problems)} non-persistent buffer problem(s): {problems[:10]}. A buffer that is "
            "not finite on rank 0 must be fixed on rank 0; one that differs after being re-sent from rank 0 "
            "points at a broken process group."
        )
    stats.verified = len(names)
    return stats
