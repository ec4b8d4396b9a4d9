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

from .. import walk
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
    requires_grad: bool = False


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
            out.append(TensorMeta(canonical_name(name), tuple(p.shape), p.dtype, True, p.is_meta, p.requires_grad))
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


def difference_from_rank0(own: dict[Any, Any], ref: dict[Any, Any], *, what: str) -> str | None:
    """What differs between this rank's ``{name: property}`` and rank 0's (``None``: nothing).

    Example:
        >>> difference_from_rank0({"a": (2,), "c": (1,)}, {"a": (3,), "b": (1,)}, what="shapes")
        "missing ['b'], extra ['c'], shapes ['`a` (2,) vs rank 0 (3,)']"
    """
    missing = [str(n) for n in ref if n not in own]
    extra = [str(n) for n in own if n not in ref]
    differ = [f"`{n}` {own[n]} vs rank 0 {ref[n]}" for n in ref if n in own and own[n] != ref[n]]
    if not (missing or extra or differ):
        return None
    return f"missing {missing[:5]}, extra {extra[:5]}, {what} {differ[:5]}"


def tensor_subclass_parameters(model: nn.Module) -> list[str]:
    """Names (with their types) of parameters that are tensor subclasses: quantized weights such as
    bitsandbytes' ``Params4bit`` or torchao tensors. Their bytes are not what a plain copy sees.

    Example:
        >>> tensor_subclass_parameters(torch.nn.Linear(2, 2))
        []
    """
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            continue
        if type(p) not in (nn.Parameter, torch.Tensor) or type(p.detach()) is not torch.Tensor:
            out.append(f"{canonical_name(name)} ({type(p).__name__})")
    return out


def refuse_scalar_parameters(model: nn.Module, ignored_modules: Any = None) -> None:
    """Refuses, before anything moves, a model with a parameter of no dimension (``shape == ()``: CLIP's
    ``logit_scale``) that ``fully_shard`` would manage: torch refuses it in ``fully_shard`` ("doesn't support scalar
    parameters"), which runs after ``meta_placement`` has put the weights on ``meta``. The answer depends on the
    model's structure only, the same on every rank. Parameters of ``ignored_modules`` (as the plugin gives them,
    modules or a pattern) stay whole on every rank, and may be scalars.

    Raises:
        ConfigError: Naming the parameters, with the fixes.

    Example:
        >>> refuse_scalar_parameters(torch.nn.Linear(2, 2))
    """
    if not any(p.ndim == 0 for p in walk.parameters(model)):
        return  # the usual answer, one look at each parameter
    from .._compat import ignored_modules as resolve
    from ..errors import ConfigError

    kept = {id(p) for m in resolve(ignored_modules, model) or () for p in m.parameters()}
    scalars = [canonical_name(n) for n, p in walk.named_parameters(model) if p.ndim == 0 and id(p) not in kept]
    if scalars:
        raise ConfigError(
            f"`prepare`: FSDP2's `fully_shard` cannot shard a parameter of no dimension (shape []): "
            f"{', '.join(f'`{n}`' for n in scalars[:5])}; torch refuses it (\"fully_shard doesn't support scalar "
            "parameters\"), as it does without the plugin. Raised on every rank before `prepare` changed anything. "
            "HINT: make it 1-D before `prepare` (`model.logit_scale = torch.nn.Parameter(model.logit_scale.detach()"
            ".reshape(1))`; the checkpoints then hold shape [1]), keep the module that holds it whole on every rank "
            "with `FullyShardedDataParallelPlugin(ignored_modules=...)` (not the root), or train with DDP."
        )


def agree_on_structure(model: nn.Module, coll: Collectives, *, check_finite: bool = False) -> list[TensorMeta]:
    """Checks that every rank holds the same model as rank 0 before anything is modified.

    Rank 0 broadcasts its names, shapes, dtypes and ``requires_grad`` flags. A rank whose names or shapes differ, or a rank 0
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
    subclassed = tensor_subclass_parameters(model)
    if subclassed:
        problems.append(
            f"rank {coll.rank} holds {len(subclassed)} parameter(s) of a tensor subclass (quantized or wrapped "
            f"weights: {subclassed[:5]}); the rank-0 load would flatten them into plain tensors. Remove "
            "`meta_placement` and `rank0_distribute` from `MemSafePlugin(stages=...)` for this model, or load "
            "it unquantized."
        )
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
        diff = difference_from_rank0({m.name: m.shape for m in mine}, {m.name: m.shape for m in theirs}, what="shapes")
        if diff:
            problems.append(f"rank {coll.rank}'s model differs from rank 0's: {diff}. Build the same model (same config) on every rank.")
    bad = coll.ranks_flagging(bool(problems), what="agreement on the model structure")
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
        Canonical name -> original tensor when ``keep`` (every name of a tied tensor), else an empty dict.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> src = move_to_meta(lin, [], weights_metadata(lin), keep=True)
        >>> lin.weight.is_meta, src["weight"].is_meta
        (True, False)
    """
    dtypes = {m.name: m.dtype for m in reference}
    # rank 0's `requires_grad` too: FSDP2 reduce-scatters the gradients of trainable parameters only, so
    # ranks that disagree (transformers' from_pretrained unfreezes what the model's __init__ froze, e.g.
    # Whisper's sinusoidal positions) would send different sizes in the first backward
    trainable = {m.name: m.requires_grad for m in reference if m.is_param}
    new_by_id: dict[int, torch.Tensor] = {}
    detached: dict[int, torch.Tensor] = {}
    originals: dict[str, torch.Tensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for local, p in list(mod._parameters.items()):
            if p is None:
                continue
            name = canonical_name(f"{mod_name}.{local}" if mod_name else local)
            if id(p) not in new_by_id:
                dtype = dtypes.get(name, p.dtype)
                grad = trainable.get(name, p.requires_grad)
                new_by_id[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=grad)
                if keep:
                    detached[id(p)] = p.detach()
            if keep:
                originals.setdefault(name, detached[id(p)])  # every alias of a tie names the same tensor
            mod._parameters[local] = new_by_id[id(p)]
        for local, b in list(mod._buffers.items()):
            if b is None or local in mod._non_persistent_buffers_set:
                continue
            name = canonical_name(f"{mod_name}.{local}" if mod_name else local)
            if id(b) not in new_by_id:
                new_by_id[id(b)] = torch.empty(b.shape, dtype=dtypes.get(name, b.dtype), device="meta")
                if keep:
                    detached[id(b)] = b.detach()
            if keep:
                originals.setdefault(name, detached[id(b)])
            mod._buffers[local] = new_by_id[id(b)]
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [new_by_id.get(id(p), p) for p in group["params"]]
    return originals


def parallelism_blocks_meta_placement(model: Any, parallelism_config: Any, *,
                                      parameters: list[nn.Parameter] | None = None) -> str | None:
    """Why the rank-0 load does not apply to this model and parallelism layout, or ``None`` when it does.

    Any FSDP2 mesh applies (FSDP, HSDP, FSDP × TP, CP): ``rank0_distribute`` sends each rank the block its
    placements give it. Declined: a model whose parameters are already DTensors (parallelised while
    loading, e.g. transformers' ``tp_plan``: every rank already holds its own part), and DeepSpeed
    sequence parallelism (not an FSDP2 layout). ``parameters``: the model's parameters
    (:func:`~accelerate_memsafe.walk.parameters`), when the caller walked it already.
    """
    from torch.distributed.tensor import DTensor

    already = None
    if model is not None and parameters is None:
        parameters = walk.parameters(model)
    # a plain `nn.Parameter` is no DTensor (a parameter of a tensor subclass has the subclass's type): the
    # isinstance check, slow on DTensor's class, runs only for the others
    if model is not None and any(type(p) is not nn.Parameter and isinstance(p, DTensor)
                                 for p in parameters):  # names built only then
        already = next(n for n, p in walk.named_parameters(model) if isinstance(p, DTensor))
    if already is not None:
        return (f"the model is already distributed (`{already}` is a DTensor, e.g. loaded with `tp_plan`): each rank "
                "holds its own part, there is nothing for rank 0 to send")
    if parallelism_config is not None and getattr(parallelism_config, "sp_size", 1) not in (None, 1):
        return f"parallelism_config.sp_size={parallelism_config.sp_size} (DeepSpeed sequence parallelism) is not an FSDP2 layout"
    return None


def checkpoint_source_names(originals: dict[str, torch.Tensor], checkpoint_path: str | None) -> tuple[Any, set[str]]:
    """Which of rank 0's tensors can be re-read from the checkpoint file instead of its mmap.

    A tensor qualifies when it is a view of the mapped bytes of the same-named checkpoint tensor (a
    zero-copy load that nothing replaced) *and* the kernel shows that none of the pages it touches was
    written since (:func:`~accelerate_memsafe.io.mapped_pages.unmodified_file_pages`): an in-place edit
    on rank 0 (a merged LoRA, new token embeddings, any weight surgery) keeps the address, and rank 0's
    model, not the file, is what every rank must get. Reading the qualifying tensors with ``pread``
    keeps the file's pages out of rank 0's RSS; every other tensor is read from memory.

    Without ``checkpoint_path`` (a model loaded by transformers' own ``from_pretrained``), the checkpoint is
    the directory of the safetensors files rank 0's weights are mapped from, when there is exactly one.

    Returns:
        ``(SafetensorsSource or None, names)``.
    """
    from ..io.mapped_pages import file_mappings_at, unmodified_file_pages
    from ..io.safetensors_source import SafetensorsSource, is_view_of_entry, mapped_checkpoint_dir

    # the checkpoint mappings that hold these tensors (a few kernel queries, not the whole /proc/self/maps)
    maps = file_mappings_at((t.data_ptr() for t in originals.values() if t.device.type == "cpu"), ".safetensors")
    if not checkpoint_path:  # a model transformers loaded zero-copy on this rank: its weights map the files
        checkpoint_path = mapped_checkpoint_dir(originals.values(), maps)
    if not checkpoint_path:
        return None, set()
    try:
        source = SafetensorsSource(checkpoint_path)
    except CheckpointError:
        return None, set()
    real: dict[str, str] = {}
    views = [(n, t) for n, t in originals.items() if n in source.entries and is_view_of_entry(t, source.entries[n], maps, real)]
    # every view lies inside one of `maps` (the checkpoint's mappings): no second read of /proc/self/maps
    clean = unmodified_file_pages([(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for _, t in views], maps)
    names = {n for (n, _), ok in zip(views, clean) if ok}
    if not names:
        source.close()
        return None, set()
    return source, names


def _any_on_meta(model: nn.Module) -> bool:
    """Whether a parameter or buffer of ``model`` is on ``meta``: one walk of the tree (no generators of ``nn.Module``;
    asked on every ``prepare``, a single process's included)."""
    for mod in walk.modules(model):
        for tensors in (mod._parameters, mod._buffers):
            if tensors:
                for t in tensors.values():
                    if t is not None and t.is_meta:
                        return True
    return False


def meta_weight_names(model: nn.Module) -> list[str]:
    """Parameters and persistent buffers of ``model`` that are on ``meta`` (no data), each once.

    Example:
        >>> with torch.device("meta"):
        ...     m = torch.nn.Linear(2, 3)
        >>> meta_weight_names(m)
        ['weight', 'bias']
    """
    if not _any_on_meta(model):
        return []  # the usual answer, without naming every tensor
    return [m.name for m in weights_metadata(model) if m.on_meta]


def meta_weights_failure(model: nn.Module, gap: str, exc: Exception) -> Exception | None:
    """What to raise where accelerate's own ``prepare`` failed (``exc``) on one process without FSDP: there the plugin
    does not walk the model for weights on ``meta`` before the call (the walk would cost a ``prepare`` of a few
    milliseconds a tenth of its wall), since accelerate's own ``model.to(device)`` refuses such a model, as stock does;
    this names them once it did. ``None``: the model holds none (``exc`` is not about them).

    Args:
        model: The model passed to ``prepare``.
        gap: Why no enabled stage fills weights on ``meta`` here.
        exc: accelerate's error.

    Example:
        >>> with torch.device("meta"):
        ...     m = torch.nn.Linear(2, 3)
        >>> str(meta_weights_failure(m, "one process", NotImplementedError("Cannot copy out of meta tensor"))).split(":")[1]
        ' the model holds weights on `meta` (no data)'
    """
    from ..errors import ConfigError, message_line

    names = meta_weight_names(model)
    if not names:
        return None
    return ConfigError(
        f"`prepare`: the model holds weights on `meta` (no data): {len(names)} tensor(s), e.g. "
        f"{', '.join(f'`{x}`' for x in names[:3])}; accelerate's own `prepare` failed on them ({message_line(exc)}), "
        f"as it does without the plugin, and no enabled stage fills them: {gap}. HINT: give `prepare` a model with "
        "real weights (`from_pretrained`, or `model.to_empty(device=...)` and your initialisation), or run FSDP2 with "
        "the default stages, which fill the other ranks' weights from rank 0's."
    )


def refuse_unfilled_meta_weights(model: nn.Module, gap: str | None, *, rank: int, world_size: int,
                                 timeout_s: float, broadcast_by_accelerate: bool = False) -> None:
    """Refuses, on every rank and before anything moves, a model that holds weights on ``meta`` on some rank
    when no enabled stage will fill them (``gap`` says why; ``None``: the stages will, nothing to check).

    Without the filling stages accelerate's own FSDP2 ``prepare`` cannot use such a model: with
    ``cpu_ram_efficient_loading`` it broadcasts rank 0's weights but re-points the optimizer by data pointer,
    which is 0 for every meta tensor (training runs on the wrong tensors until DCP refuses the first
    ``save_state``); without it the first forward fails ("FSDP parameters should be materialized from meta").
    The one such model it does take right is let through: ``cpu_ram_efficient_loading`` on, nothing on ``meta`` on
    rank 0, at most one tensor on ``meta`` on every other rank (one data pointer 0 is unambiguous; any number from
    accelerate 1.16, which tells them apart by identity): what transformers gives a rank other than 0 under that
    setting for a checkpoint that lacks tensors (a new classification head).

    Args:
        model: The model passed to ``prepare``.
        gap: Why the enabled stages will not fill meta weights here, or ``None``.
        rank, world_size: This process and the job (one ``all_gather_object`` when ``world_size > 1`` and
            ``gap`` is set: the same on every rank, since it depends on the configuration only).
        timeout_s: Deadline of that collective.
        broadcast_by_accelerate: Whether accelerate's own ``prepare`` broadcasts rank 0's weights
            (``cpu_ram_efficient_loading``).

    Raises:
        ConfigError: Naming the ranks, an example tensor, why nothing fills them, and the fixes.
    """
    if gap is None:
        return
    import torch.distributed as dist

    from ..errors import ConfigError

    local = meta_weight_names(model)
    mine = (rank, len(local), local[:3])
    everyone = [mine]
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        coll = Collectives("prepare_check", timeout_s=timeout_s)
        everyone = coll.all_gather_object(mine, what="exchange of which ranks hold weights on meta")
    bad = [(r, n, names) for r, n, names in everyone if n]
    if not bad:
        return
    ranks = [r for r, _, _ in bad]
    if not broadcast_by_accelerate:
        why = "without `cpu_ram_efficient_loading` it broadcasts nothing, and the first forward fails"
    elif 0 in ranks:
        why = "it broadcasts rank 0's weights, and rank 0 holds some on `meta`"
    else:
        from .._compat import optimizer_remapped_by_identity_on_meta

        if all(n == 1 for _, n, _ in bad) or optimizer_remapped_by_identity_on_meta():
            return
        why = "it re-points the optimizer by data pointer, 0 for every meta tensor"
    r, n, names = bad[0]
    raise ConfigError(
        f"`prepare`: the model holds weights on `meta` (no data) on rank(s) {ranks} ({n} tensor(s) on rank {r}, e.g. "
        f"{', '.join(f'`{x}`' for x in names)}), and no enabled stage will fill them: {gap}. Nothing was moved. "
        f"accelerate's own prepare cannot fill them correctly ({why}). "
        "HINT: keep the stages `meta_placement`, `shard` and `rank0_distribute` enabled "
        "(the default `MemSafePlugin()`), or load real weights on every rank (transformers' `from_pretrained` "
        "instead of `accelerate_memsafe.from_pretrained`)."
    )
