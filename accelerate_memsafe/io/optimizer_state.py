"""Read a saved optimizer state into a live optimizer in place, one tensor at a time, straight to CPU.

Two formats, both as accelerate writes them:

- a ``torch.save`` file (``optimizer.bin``: single process / DDP, and FSDP2 with ``FULL_STATE_DICT``).
  It is opened with ``torch.load(map_location="meta", weights_only=True)``, which reads only the pickled
  structure (never executing pickled code) and records where each tensor's bytes lie in the file; each
  tensor is then read with one ``readinto`` into its destination (for an FSDP2 parameter only the rows of
  this rank's shard are read). No second copy of the state is ever built. A tensor saved with other strides
  than a contiguous one's (a ``channels_last`` convolution's state) is read as the span of the file its
  elements lie in, then copied through its strides; its new destination has its strides, as torch's own load
  leaves it. A torch that records no offsets on ``meta`` storages (``_compat.checkpoint_file_offset``) gets
  the file mapped instead (``torch.load(mmap=True, weights_only=True)``): each tensor is copied from the
  mapping, whose pages are the file's, not the process's own memory.
- a ``torch.distributed.checkpoint`` folder (``optimizer_<i>/``: FSDP2 with ``SHARDED_STATE_DICT``), read
  with ``dcp.load`` into templates that *are* the destination tensors (DCP reads in place); pickled
  non-tensor entries (hyper-parameters) are read with ``weights_only=True``.

The destination of each state tensor is the optimizer's existing state tensor when it has the right shape,
dtype and device (read in place: an optimizer that already has state costs no new memory), else a new
tensor on CPU (``offload=True``, pinned when CUDA is present) or on the parameter's device. Nothing is
modified before every file and shape has been checked (:func:`plan_optimizer_load`).

Tensor-valued hyper-parameters (``lr=torch.tensor(1e-3)``, ``betas`` of tensors) are read from the file as
well and put on the device of the optimizer's current value (CPU where it has none), as saved.

The loaded state is installed the way ``torch.optim.Optimizer.load_state_dict`` installs it, minus its
cast to the parameter's device, unless the optimizer customises loading (a subclass overriding
``load_state_dict``, or ``register_load_state_dict_pre_hook`` / ``post_hook`` hooks, see
:func:`custom_load_reasons`): then its own ``load_state_dict`` is called with a state dict whose tensors
are the already-read ones, so the hooks and the override run as they would with a stock load.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _compat
from ..memory.progress import byte_progress
from ..memory.tracker import tensors_in
from ..errors import CheckpointError, message_line
from .blocks import block_cols, local_block

#: accelerate's optimizer file / folder names (``accelerate.utils.constants.OPTIMIZER_NAME``).
OPTIMIZER_NAME = "optimizer"
_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def optimizer_source(directory: str | os.PathLike, index: int) -> tuple[str, Path] | None:
    """Where accelerate saved optimizer ``index`` in a checkpoint directory.

    Returns:
        ``("torch_file", path)``, ``("dcp", folder)``, or ``None`` if neither exists.

    Example:
        >>> optimizer_source("/nonexistent", 0) is None
        True
    """
    d = Path(directory)
    folder = d / f"{OPTIMIZER_NAME}_{index}"
    if (folder / ".metadata").exists():
        return "dcp", folder
    file = d / (f"{OPTIMIZER_NAME}.bin" if index == 0 else f"{OPTIMIZER_NAME}_{index}.bin")
    if file.exists():
        return "torch_file", file
    return None


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(parameter) -> FQN`` as ``torch.distributed.checkpoint.state_dict`` names it (wrapper parts of
    activation checkpointing / ``torch.compile`` removed)."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        parts = [x for x in name.split(".") if x not in _WRAPPER_PARTS]
        out.setdefault(id(p), ".".join(parts))
    return out


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


Block = tuple[tuple[int, int], tuple[slice, ...] | None]
"""A rank's block of a full tensor: its rows ``[start, stop)`` and the slices of the other dimensions
(``None``: whole rows)."""


def _shard_block(param: torch.Tensor) -> Block | None:
    """The block of the full tensor this rank holds for a DTensor parameter, from its placements (FSDP,
    HSDP, TP: DTensor reports it without data, as DCP saves by); ``None`` for a replicated one."""
    from torch.distributed.tensor import Replicate

    if all(isinstance(p, Replicate) for p in param.placements):
        return None
    box = local_block(param)
    if isinstance(box, str):
        raise CheckpointError(
            f"cannot read a full optimizer state into a parameter with placements {tuple(param.placements)}: {box}. "
            "HINT: save with `SHARDED_STATE_DICT` (read through torch.distributed.checkpoint) for this layout."
        )
    (offsets, sizes) = box
    return (offsets[0], offsets[0] + sizes[0]), block_cols(box, tuple(param.shape))


@dataclass
class _Item:
    param: torch.Tensor
    key: str
    saved: Any  # meta tensor (torch file) or TensorStorageMetadata (dcp)
    dtype: torch.dtype
    device: torch.device
    existing: torch.Tensor | None
    block: Block | None = None


@dataclass
class OptimizerLoadPlan:
    """What :func:`execute_optimizer_load` will do; built (and fully checked) by :func:`plan_optimizer_load`."""

    optimizer: torch.optim.Optimizer
    kind: str
    source: Path
    items: list[_Item] = field(default_factory=list)
    saved_groups: list[dict[str, Any]] = field(default_factory=list)
    names: dict[int, str] = field(default_factory=dict)
    structure: Any = None
    pin: bool = False
    #: ``False``: the user passed ``load_state(load_kwargs={"weights_only": False})`` (trusts the file's pickles)
    weights_only: bool = True
    #: ``(group index, key, position in a tuple/list or None, saved meta tensor, destination device)``
    group_tensors: list[tuple[int, str, int | None, torch.Tensor, torch.device]] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        """Bytes of optimizer state the plan reads."""
        return sum(_numel(i) * i.dtype.itemsize for i in self.items)

    @property
    def largest(self) -> int:
        """Bytes of the largest single state tensor."""
        return max((_numel(i) * i.dtype.itemsize for i in self.items), default=0)


def _numel(item: _Item) -> int:
    if item.block is not None or _is_dtensor(item.param):
        if len(_shape(item.saved)) == 0:
            return 1
        return _local(item.param).numel()
    n = 1
    for s in _shape(item.saved):
        n *= s
    return n


def _shape(saved: Any) -> tuple[int, ...]:
    return tuple(saved.shape if isinstance(saved, torch.Tensor) else saved.size)


def _saved_dtype(saved: Any) -> torch.dtype:
    return saved.dtype if isinstance(saved, torch.Tensor) else saved.properties.dtype


def _target_spec(optimizer, group, param, key, saved, *, offload: bool) -> tuple[torch.dtype, torch.device]:
    saved_dtype = _saved_dtype(saved)
    scalar = len(_shape(saved)) == 0
    # torch's Optimizer.load_state_dict casts state to the parameter's dtype, except `step`.
    dtype = param.dtype if (key != "step" and saved_dtype.is_floating_point and param.is_floating_point()) else saved_dtype
    on_device_kernel = group.get("capturable") or group.get("fused")
    if key == "step" and scalar and on_device_kernel:
        # capturable / fused kernels read `step` on the parameter's device, offloaded or not (torch's
        # `_process_value_according_to_param_policy` puts it there too)
        return dtype, _local(param).device
    if offload or (scalar and not on_device_kernel):
        return dtype, torch.device("cpu")
    return dtype, _local(param).device


def custom_load_reasons(optimizer: torch.optim.Optimizer) -> list[str]:
    """Why ``optimizer``'s own ``load_state_dict`` must run for a load to be faithful (empty: it need not).

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2)); opt = torch.optim.SGD([p], lr=0.1)
        >>> custom_load_reasons(opt)
        []
        >>> _ = opt.register_load_state_dict_post_hook(lambda o: None)
        >>> custom_load_reasons(opt)
        ['1 `register_load_state_dict_post_hook` hook(s)']
    """
    reasons = []
    if "load_state_dict" in vars(optimizer):
        reasons.append("`load_state_dict` replaced on the instance")
    elif type(optimizer).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        reasons.append(f"`{type(optimizer).__qualname__}.load_state_dict` overrides torch's")
    for kind in ("pre", "post"):
        hooks = getattr(optimizer, f"_optimizer_load_state_dict_{kind}_hooks", None) or {}
        if hooks:
            reasons.append(f"{len(hooks)} `register_load_state_dict_{kind}_hook` hook(s)")
    return reasons


def _hyper_tensors(value: Any) -> list[tuple[int | None, torch.Tensor]]:
    """The tensors of a param-group entry: the value itself, or the items of a tuple/list (``betas``)."""
    if isinstance(value, torch.Tensor):
        return [(None, value)]
    if isinstance(value, (tuple, list)):
        return [(i, v) for i, v in enumerate(value) if isinstance(v, torch.Tensor)]
    return []


def _check_in_file(path: Path, size: int, what: str, saved: torch.Tensor) -> None:
    offset = _compat.checkpoint_file_offset(saved)  # None for a mapped load: torch checked its records
    if offset is not None:
        end = offset + saved.untyped_storage().nbytes()
        if end > size:
            raise CheckpointError(
                f"optimizer file {path} is truncated: `{what}` ends at byte {end}, the file has {size} bytes. "
                "Nothing was loaded."
            )


def _plan_group_tensors(plan: OptimizerLoadPlan, size: int) -> None:
    """Records every tensor hyper-parameter of the saved groups (read in :func:`execute_optimizer_load`).

    Its destination is the device of the optimizer's current value of that entry (for a tensor ``lr`` or
    ``betas`` that is where the user, and torch's fused/capturable checks, put it), else CPU, which is
    where accelerate's own load (``map_location="cpu"``) leaves it.
    """
    for gi, (live, saved) in enumerate(zip(plan.optimizer.param_groups, plan.saved_groups)):
        for key, value in saved.items():
            if key in ("params", "param_names"):
                continue
            current = live.get(key)
            for pos, t in _hyper_tensors(value):
                _check_in_file(plan.source, size, f"param_groups.{gi}.{key}", t)
                now = current if pos is None else (
                    current[pos] if isinstance(current, (tuple, list)) and pos < len(current) else None)
                device = now.device if isinstance(now, torch.Tensor) and now.device.type != "meta" else torch.device("cpu")
                plan.group_tensors.append((gi, key, pos, t, device))


def _check_shape(source: Path, fqn: str, key: str, saved_shape: tuple[int, ...], param: torch.Tensor) -> None:
    if not saved_shape or not _is_dtensor(param):
        return
    if tuple(saved_shape) != tuple(param.shape):
        raise CheckpointError(
            f"{source}: optimizer state `{fqn}.{key}` has shape {tuple(saved_shape)}, the parameter has "
            f"{tuple(param.shape)}. The checkpoint belongs to another model."
        )


def _load_structure(path: Path, weights_only: bool = True) -> Any:
    """The saved state dict with its tensors on ``meta`` (their file offsets recorded), or, where torch records no
    offsets, with its tensors on the file's mapping (nothing read until a tensor is copied)."""
    structure = _torch_load(path, weights_only, map_location="meta")
    if any(t.untyped_storage().nbytes() and _compat.checkpoint_file_offset(t) is None for t in tensors_in(structure)):
        structure = _torch_load(path, weights_only, map_location="cpu", mmap=True)
    return structure


#: How to load a file whose pickles need more than plain data, as accelerate's ``load_state`` takes it.
TRUST_HINT = ("If you trust the file's source, `load_state(..., load_kwargs={'weights_only': False})` loads it, as it "
              "does without the plugin")


def _unpickle(what: str, load: Any, *, weights_only: bool) -> Any:
    """``load(weights_only=...)``: with ``weights_only`` (the default), plain data and numpy scalars only
    (:func:`~accelerate_memsafe.io.validate.numpy_scalar_globals`), a refused global raising
    :class:`CheckpointError` naming ``what``; without it, as the user asked, anything."""
    import pickle

    from .validate import numpy_scalar_globals

    if not weights_only:
        return load(weights_only=False)
    try:
        with torch.serialization.safe_globals(numpy_scalar_globals()):
            return load(weights_only=True)
    except pickle.UnpicklingError as exc:
        # weights_only refused a global: the file asks to run code (or holds objects we never load)
        detail = message_line(exc, prefer=("GLOBAL", "global"))
        raise CheckpointError(
            f"{what} was refused: it is not a plain tensor checkpoint and loading it would need to import or run code "
            f"({detail}). Nothing was loaded and nothing was executed; load checkpoints only from sources you trust, or "
            f"restore the file from an earlier checkpoint. {TRUST_HINT}."
        ) from None


def _torch_load(path: Path, weights_only: bool = True, **kwargs: Any) -> Any:
    try:
        return _unpickle(f"optimizer file {path}", lambda **w: torch.load(path, **w, **kwargs), weights_only=weights_only)
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"optimizer file {path} is truncated or corrupt and cannot be read ({type(exc).__name__}: "
            f"{message_line(exc)}). Nothing was loaded; restore the file or load an "
            "earlier checkpoint."
        ) from None


def _iter_groups(optimizer, saved_groups, source):
    if not isinstance(saved_groups, list) or len(saved_groups) != len(optimizer.param_groups):
        n = len(saved_groups) if isinstance(saved_groups, list) else "no"
        raise CheckpointError(
            f"{source}: the checkpoint has {n} parameter group(s), the optimizer has "
            f"{len(optimizer.param_groups)}. The checkpoint belongs to another optimizer setup."
        )
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        ids = saved.get("params", []) if isinstance(saved, Mapping) else []
        if len(ids) != len(group["params"]):
            raise CheckpointError(
                f"{source}: parameter group {gi} has {len(ids)} parameter(s) in the checkpoint, "
                f"{len(group['params'])} in the optimizer. The checkpoint belongs to another model."
            )
        yield group, saved, ids


def plan_optimizer_load(
    optimizer: torch.optim.Optimizer,
    source: tuple[str, Path],
    *,
    model: torch.nn.Module | None = None,
    offload: bool = False,
    weights_only: bool = True,
) -> OptimizerLoadPlan:
    """Checks a saved optimizer state against ``optimizer`` and plans reading it in place. Modifies nothing.

    Args:
        optimizer: The (unwrapped) torch optimizer to load into.
        source: From :func:`optimizer_source`.
        model: The model of the optimizer (needed for FSDP2 checkpoints, which name parameters by FQN).
        offload: Put state tensors on CPU (pinned when CUDA is present) instead of the parameter's device.
        weights_only: ``False`` where the user passed ``load_kwargs={"weights_only": False}`` to ``load_state``:
            pickled entries may then hold any object, as accelerate loads them. Otherwise plain data and numpy
            scalars only.

    Returns:
        The plan for :func:`execute_optimizer_load`.

    Raises:
        CheckpointError: For a truncated or corrupt file, or a state that does not match the optimizer
            (group/parameter counts, shapes), naming the file.

    Example:
        >>> # plan = plan_optimizer_load(opt, optimizer_source(ckpt, 0), offload=True)
    """
    kind, path = source
    names = parameter_names(model) if model is not None else {}
    pin = offload and torch.cuda.is_available()
    plan = OptimizerLoadPlan(optimizer=optimizer, kind=kind, source=path, names=names, pin=pin, weights_only=weights_only)
    if kind == "torch_file":
        structure = _load_structure(path, weights_only)
        if not isinstance(structure, Mapping) or "state" not in structure or "param_groups" not in structure:
            raise CheckpointError(f"{path} is not an optimizer state dict (expected keys `state` and `param_groups`).")
        groups = structure["param_groups"]
        plan.saved_groups = [dict(g) for g in groups] if isinstance(groups, list) and all(isinstance(g, Mapping) for g in groups) else groups
        size = path.stat().st_size
        for group, _saved_group, ids in _iter_groups(optimizer, plan.saved_groups, path):
            for pid, param in zip(ids, group["params"]):
                saved_state = structure["state"].get(pid)
                if saved_state is None:
                    continue
                for key, saved in saved_state.items():
                    if not isinstance(saved, torch.Tensor):
                        continue  # non-tensor state is kept from the structure (see execute)
                    _check_shape(path, str(pid), key, tuple(saved.shape), param)
                    _check_in_file(path, size, f"state.{pid}.{key}", saved)
                    block = _shard_block(param) if _is_dtensor(param) and saved.dim() else None
                    dtype, device = _target_spec(optimizer, group, param, key, saved, offload=offload)
                    existing = optimizer.state.get(param, {}).get(key)
                    plan.items.append(_Item(param, key, saved, dtype, device, _reusable(existing, param, saved, dtype, device), block))
        _plan_group_tensors(plan, size)
        plan.structure = structure
    elif kind == "dcp":
        plan_dcp(plan, offload=offload)
    else:
        raise ValueError(f"unknown optimizer source kind {kind!r}")
    return plan


def plan_dcp(plan: OptimizerLoadPlan, *, offload: bool) -> None:
    """Fills ``plan`` from the metadata of a ``torch.distributed.checkpoint`` folder (see :func:`plan_optimizer_load`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    optimizer, path = plan.optimizer, plan.source
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:
        raise CheckpointError(f"optimizer checkpoint {path}/.metadata is truncated or corrupt ({type(exc).__name__}: {exc}).") from None
    md = metadata.state_dict_metadata
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    for rel, end in sorted(sizes.items()):
        f = path / rel
        actual = f.stat().st_size if f.exists() else None
        if actual is None or actual < end:
            raise CheckpointError(
                f"optimizer checkpoint file {f} is truncated or missing: {actual} bytes, its metadata needs "
                f"{end}. Nothing was loaded; restore the file or load an earlier checkpoint."
            )
    n_groups = len({k.split(".")[2] for k in md if k.startswith("optimizer.param_groups.")})
    if n_groups != len(optimizer.param_groups):
        raise CheckpointError(
            f"{path}: the checkpoint has {n_groups} parameter group(s), the optimizer has {len(optimizer.param_groups)}."
        )
    if not plan.names:
        raise CheckpointError(f"{path} is a sharded (DCP) optimizer checkpoint; loading it needs the model (FQNs).")
    by_fqn: dict[str, list[tuple[str, Any]]] = defaultdict(list)
    for k, v in md.items():
        if k.startswith("optimizer.state.") and isinstance(v, TensorStorageMetadata):
            fqn, _, key = k[len("optimizer.state."):].rpartition(".")
            by_fqn[fqn].append((key, v))
    known = set()
    for gi, group in enumerate(optimizer.param_groups):
        if f"optimizer.param_groups.{gi}.params" not in md:
            raise CheckpointError(f"{path}: parameter group {gi} is missing from the checkpoint.")
        plan.saved_groups.append({k.split(".", 3)[3]: group.get(k.split(".", 3)[3]) for k in md
                                  if k.startswith(f"optimizer.param_groups.{gi}.")})
        for param in group["params"]:
            fqn = plan.names.get(id(param))
            if fqn is None:
                raise CheckpointError(f"{path}: an optimizer parameter is not a parameter of the model passed with it.")
            known.add(fqn)
            for key, saved in by_fqn.get(fqn, []):
                _check_shape(path, fqn, key, tuple(saved.size), param)
                dtype, device = _target_spec(optimizer, group, param, key, saved, offload=offload)
                existing = optimizer.state.get(param, {}).get(key)
                plan.items.append(_Item(param, key, saved, dtype, device, _reusable(existing, param, saved, dtype, device)))
    unknown = sorted(set(by_fqn) - known)
    if unknown:
        raise CheckpointError(f"{path}: optimizer state for parameter(s) {unknown[:5]} that the model does not have.")


def _reusable(existing, param, saved, dtype, device) -> torch.Tensor | None:
    if not isinstance(existing, torch.Tensor):
        return None
    local = _local(existing)
    want = (tuple(_local(param).shape) if (_is_dtensor(param) and len(_shape(saved))) else _shape(saved))
    if tuple(local.shape) != tuple(want) or local.dtype != dtype or local.device != device:
        return None
    if _is_dtensor(param) and len(_shape(saved)) and not _is_dtensor(existing):
        return None
    return existing


def _new_tensor(item: _Item, pin: bool) -> torch.Tensor:
    shape = _shape(item.saved)
    if _is_dtensor(item.param) and shape:
        from torch.distributed.tensor import DTensor

        p = item.param
        local = torch.empty(_local(p).shape, dtype=item.dtype, device=item.device, pin_memory=pin and item.device.type == "cpu")
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    pin = pin and item.device.type == "cpu" and bool(shape)
    if isinstance(item.saved, torch.Tensor):  # a torch file's: its strides where they are dense (a channels_last
        # state stays channels_last, as torch's own load keeps it); a DCP entry's metadata has none
        return torch.empty_like(item.saved, dtype=item.dtype, device=item.device, pin_memory=pin)
    return torch.empty(shape, dtype=item.dtype, device=item.device, pin_memory=pin)


class _FileReader:
    """Reads tensors of a ``torch.save`` file by byte offset (or, loaded without offsets, from the file's mapping)."""

    def __init__(self, path: Path):
        self.path = path
        self.f = open(path, "rb")  # noqa: SIM115 - held open across reads, closed by close()

    def close(self) -> None:
        self.f.close()

    def read_into(self, saved: torch.Tensor, dst: torch.Tensor, block: Block | None) -> int:
        """Reads ``saved`` (this rank's block of it, if given) into ``dst``; returns bytes read. A block
        that is not whole rows (TP) is read as its whole rows, then sliced."""
        rows, cols = block if block is not None else (None, None)
        if saved.device.type != "meta":  # loaded from the file's mapping (:func:`_load_structure`)
            return _copy_block(saved, dst, rows, cols)
        offset = _compat.checkpoint_file_offset(saved)
        if offset is None:
            raise CheckpointError(f"optimizer file {self.path}: a tensor of {tuple(saved.shape)} has no recorded offset "
                                  "in the file. Nothing was loaded; disable the `optimizer_cpu_reload` stage to load "
                                  "it with accelerate's own reader, and report the torch version.")
        if not saved.is_contiguous():
            return self._read_strided(saved, dst, rows, cols, offset)
        itemsize = saved.dtype.itemsize
        start = saved.storage_offset() + (rows[0] * saved.stride(0) if rows else 0)
        numel = dst.numel() if cols is None else (rows[1] - rows[0]) * saved[0].numel()
        direct = cols is None and dst.device.type == "cpu" and dst.is_contiguous() and dst.dtype == saved.dtype
        buf = dst if direct else torch.empty(numel, dtype=saved.dtype)
        self.f.seek(offset + start * itemsize)
        view = buf.reshape(-1).view(torch.uint8).numpy()
        n = self.f.readinto(view)
        if n != numel * itemsize:
            raise CheckpointError(f"optimizer file {self.path} is truncated: short read ({n} of {numel * itemsize} bytes).")
        if not direct:
            _copy_block(buf if cols is None else buf.view(rows[1] - rows[0], *saved.shape[1:]), dst, None, cols)
        return n

    def _read_strided(self, saved: torch.Tensor, dst: torch.Tensor, rows: Any, cols: Any, offset: int) -> int:
        """Reads a tensor saved with other strides than a contiguous one's: the span of its storage that its
        elements lie in (its whole span: a rank's rows of it are not one run of bytes), then copies its block
        through its strides. Memory: one tensor's span, as the copy of a block that is not whole rows."""
        itemsize = saved.dtype.itemsize
        span = 1 + sum((n - 1) * s for n, s in zip(saved.shape, saved.stride())) if saved.numel() else 0
        buf = torch.empty(span, dtype=saved.dtype)
        self.f.seek(offset + saved.storage_offset() * itemsize)
        n = self.f.readinto(buf.view(torch.uint8).numpy())
        if n != span * itemsize:
            raise CheckpointError(f"optimizer file {self.path} is truncated: short read ({n} of {span * itemsize} bytes).")
        _copy_block(buf.as_strided(saved.shape, saved.stride()), dst, rows, cols)
        return n


def _copy_block(src: torch.Tensor, dst: torch.Tensor, rows: Any, cols: Any) -> int:
    """Copies ``src`` (its ``rows`` and, of those, its ``cols`` slices, where given) into ``dst``; returns the bytes of
    the rows it read."""
    if rows is not None:
        src = src[rows[0]:rows[1]]
    nbytes = src.numel() * src.element_size()
    if cols is not None:
        src = src[(slice(None), *cols)]
    dst.copy_(src.reshape(dst.shape))
    return nbytes


def execute_optimizer_load(plan: OptimizerLoadPlan, *, progress: bool = False, rank: int = 0) -> dict[str, int]:
    """Reads the planned state into the optimizer (in place where possible) and installs it.

    Args:
        plan: From :func:`plan_optimizer_load`.
        progress: Show a byte progress bar on rank 0 (only when hundreds of MB are read).
        rank: This process's rank (bars are shown on rank 0 only).

    Returns:
        ``{"bytes_read", "in_place_bytes", "new_bytes", "tensors", "load_state_dict_calls", "dcp_loads",
        "dcp_metadata_reads"}`` (the last two: the ``dcp.load`` calls of a DCP checkpoint and how many times its
        ``.metadata`` was read for them, once); ``load_state_dict_calls`` is 1
        when the optimizer's own ``load_state_dict`` was called (:func:`custom_load_reasons`).

    Example:
        >>> # execute_optimizer_load(plan_optimizer_load(opt, source))
    """
    optimizer = plan.optimizer
    figures = {"bytes_read": 0, "in_place_bytes": 0, "new_bytes": 0, "tensors": len(plan.items), "load_state_dict_calls": 0,
               "dcp_loads": 0, "dcp_metadata_reads": 0}
    targets: list[torch.Tensor] = []
    for item in plan.items:
        t = item.existing if item.existing is not None else _new_tensor(item, plan.pin)
        targets.append(t)
        nbytes = _local(t).numel() * _local(t).element_size()
        figures["in_place_bytes" if item.existing is not None else "new_bytes"] += nbytes
    if plan.kind == "torch_file":
        reader = _FileReader(plan.source)
        total = sum(_local(t).numel() * _local(t).element_size() for t in targets)
        bar = byte_progress(total, "optimizer_cpu_reload: read", enabled=progress, rank=rank)
        try:
            for item, t in zip(plan.items, targets):
                n = reader.read_into(item.saved, _local(t), item.block)
                figures["bytes_read"] += n
                bar.update(n)
            for gi, key, pos, saved, device in plan.group_tensors:
                value = torch.empty(saved.shape, dtype=saved.dtype)
                figures["bytes_read"] += reader.read_into(saved, value, None)
                _set_group_value(plan.saved_groups[gi], key, pos, value.to(device))
        finally:
            bar.close()
            reader.close()
        saved_state = plan.structure["state"]
        ids_by_param = {id(p): pid for g, sg in zip(optimizer.param_groups, plan.saved_groups)
                        for pid, p in zip(sg["params"], g["params"])}
    else:
        figures["dcp_loads"], figures["dcp_metadata_reads"] = _dcp_read(plan, targets)
        figures["bytes_read"] = sum(_local(t).numel() * _local(t).element_size() for t in targets)
        saved_state, ids_by_param = {}, {}
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    for item, t in zip(plan.items, targets):
        state[item.param][item.key] = t
    for group in optimizer.param_groups:  # non-tensor state entries travel in the pickled structure
        for p in group["params"]:
            for key, value in saved_state.get(ids_by_param.get(id(p)), {}).items():
                if not isinstance(value, torch.Tensor):
                    state[p][key] = value
    if custom_load_reasons(optimizer):
        _load_through_optimizer(plan, state, ids_by_param)
        figures["load_state_dict_calls"] = 1
    else:
        groups = []
        for group, saved in zip(optimizer.param_groups, plan.saved_groups):
            new = {**saved, "params": group["params"]}
            if "param_names" in group and "param_names" not in new:
                new["param_names"] = group["param_names"]
            groups.append(new)
        # What torch's load_state_dict does after casting; we skip its cast, which would copy every state
        # tensor to the parameter's device (the stale-device-copy bug this stage exists to avoid).
        optimizer.__setstate__({"state": state, "param_groups": groups})
    plan.items.clear()
    plan.group_tensors.clear()
    plan.structure = None
    return figures


def _set_group_value(group: dict[str, Any], key: str, pos: int | None, value: torch.Tensor) -> None:
    if pos is None:
        group[key] = value
    else:
        seq = list(group[key])
        seq[pos] = value
        group[key] = type(group[key])(seq)


def _load_through_optimizer(plan: OptimizerLoadPlan, state: Mapping[torch.Tensor, dict[str, Any]],
                            ids_by_param: Mapping[int, Any]) -> None:
    """Calls the optimizer's own ``load_state_dict`` (its override and load hooks run) with a state dict
    whose tensors are the ones already read. torch's cast keeps a tensor that already has the parameter's
    dtype and device, so on the parameters' device nothing is copied; state read to CPU for an accelerator
    parameter is copied there by torch, as a stock load would (the caller re-offloads it)."""
    optimizer = plan.optimizer
    sd_state: dict[Any, dict[str, Any]] = {}
    sd_groups = []
    n = 0
    for group, saved in zip(optimizer.param_groups, plan.saved_groups):
        ids = []
        for p in group["params"]:
            pid = ids_by_param.get(id(p), n)  # saved ids for a torch file; torch's numbering otherwise
            n += 1
            ids.append(pid)
            if p in state:
                sd_state[pid] = state[p]
        sd_groups.append({**saved, "params": ids})
    optimizer.load_state_dict({"state": sd_state, "param_groups": sd_groups})


def _set_nested(root: Any, path: tuple, value: Any) -> None:
    """``root[path[0]][path[1]]... = value`` for the dicts and lists of a DCP template (``path`` as DCP's
    ``flatten_state_dict`` maps a flat key)."""
    for key in path[:-1]:
        root = root[key]
    root[path[-1]] = value


def _dcp_read(plan: OptimizerLoadPlan, targets: list[torch.Tensor]) -> tuple[int, int]:
    """Reads the DCP optimizer state into ``targets`` in batches; returns (``dcp.load`` calls, metadata reads)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP reads pickled (non-tensor) entries with ``weights_only=False``; we run no pickled code unless the
        user said they trust the file (``plan.weights_only``)."""

        def load_bytes(self, read_item, value):
            value.seek(0)
            fqn = read_item.dest_index.fqn
            loaded = _unpickle(f"optimizer checkpoint {plan.source} (entry `{fqn}`)",
                               lambda **w: torch.load(value, **w), weights_only=plan.weights_only)
            if self.flatten_state_dict and fqn in getattr(self, "mappings", {}):
                # into the nested template, as DCP's own load_bytes does (the flat copy is not read back): the
                # groups' hyper-parameters (a scheduled `lr`) must come from the checkpoint
                _set_nested(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    # DCP's reader keeps the previous item's temporary tensor alive while it reads the next one, so two
    # large items in one `dcp.load` would cost twice the largest tensor. Large items (more than half the
    # largest) are read one per call, the rest together; the batches are the same on every rank because
    # they are computed from global sizes.
    def global_bytes(item: _Item) -> int:
        n = 1
        for d in _shape(item.saved):
            n *= d
        return n * _saved_dtype(item.saved).itemsize

    largest = max((global_bytes(i) for i in plan.items), default=0)
    small = [k for k, i in enumerate(plan.items) if 2 * global_bytes(i) <= largest]
    batches = [small] + [[k] for k, i in enumerate(plan.items) if 2 * global_bytes(i) > largest]
    groups = [{**g, "params": None} for g in plan.saved_groups]

    class _Reader(dcp.FileSystemReader):
        """Reads the checkpoint's ``.metadata`` once for all the batches (each ``dcp.load`` asks for it again)."""

        _metadata = None
        reads = 0

        def read_metadata(self, *args, **kwargs):
            if self._metadata is None:
                self._metadata = super().read_metadata(*args, **kwargs)
                self.reads += 1
            return self._metadata

    reader = _Reader(str(plan.source))
    for b, batch in enumerate(batches):
        state: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        for k in batch:
            state[plan.names[id(plan.items[k].param)]][plan.items[k].key] = targets[k]
        body: dict[str, Any] = {"state": dict(state)}
        if b == 0:
            body["param_groups"] = groups
        template = {"optimizer": body}
        # every rank reads only its own chunks, planned locally from the same metadata: no collective per batch
        dcp.load(template, storage_reader=reader, planner=_WeightsOnlyLoadPlanner(), no_dist=True)
        for k in batch:  # DCP may replace a non-DTensor template (e.g. `step`) instead of filling it
            item = plan.items[k]
            got = template["optimizer"]["state"][plan.names[id(item.param)]][item.key]
            if got is not targets[k]:
                _local(targets[k]).copy_(_local(got))
        if b == 0:
            plan.saved_groups = [dict(g) for g in template["optimizer"]["param_groups"]]
        del template, state, body
    return len(batches), reader.reads
