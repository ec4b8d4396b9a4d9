"""CPU-first, in-place reloading of PEFT adapter weights.

``PeftModel.load_adapter`` (peft 0.21) reads the whole adapter state dict onto the *load device* (``cuda``
when no ``torch_device`` is given) and only then copies it into the parameters: one extra adapter's worth
of device memory at the end of training, when free memory is lowest. The functions here read the
safetensors file **tensor by tensor on CPU** and copy each tensor into the existing parameter in place
(non-blocking from pinned memory on CUDA), so the extra memory is at most one tensor.

Everything is validated before the first parameter changes: the file exists, its header is complete, the
data is not truncated, every expected tensor is present, no unknown tensor is present, and every shape
matches. A failed check raises :class:`~accelerate_memsafe.errors.CheckpointError` naming the file and the
tensor.

Key mapping. peft's ``save_pretrained`` writes the keys returned by ``get_peft_model_state_dict`` (adapter
name removed, ``modules_to_save.<name>.`` collapsed). Rather than re-implementing peft's per-method
renaming, we call ``get_peft_model_state_dict`` with ``model.state_dict(keep_vars=True)`` (a ``meta`` stand-in for
each DTensor, which peft 0.22 would gather): the values it returns *are* those objects, so the result maps each saved
key to the parameter it came from.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, MemoryBudgetError
from ..io.validate import TensorInfo, check_casts, check_safetensors_file

#: File names of peft's ``save_pretrained`` layout.
ADAPTER_SAFE_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_WEIGHTS_NAME = "adapter_model.bin"

_GIB = 2**30


@dataclass(frozen=True)
class ReloadStats:
    """What one in-place reload copied.

    Attributes:
        file: The safetensors file read.
        tensors: Number of tensors copied.
        bytes: Bytes copied into the parameters (local shards for DTensors).
        largest_tensor_bytes: The largest single tensor storage read or mapped (the bound on extra memory;
            for a DTensor, ``get_slice`` maps the whole tensor's bytes and reads only the local slice).
        device: The device of the parameters written.
    """

    file: str
    tensors: int
    bytes: int
    largest_tensor_bytes: int
    device: str


# -- finding the PeftModel ---------------------------------------------------------------------------


def find_peft_model(model: Any) -> Any | None:
    """Returns the ``PeftModel`` that ``model`` is or wraps (DDP ``.module``, ``torch.compile``'s
    ``_orig_mod``, FSDP2's class swap keeps ``isinstance``), or ``None``.

    Example:
        >>> find_peft_model(torch.nn.Linear(2, 2)) is None
        True
    """
    # a PeftModel exists only once peft is imported: no import (0.6 s) to find out that there is none
    PeftModel = getattr(sys.modules.get("peft"), "PeftModel", None)
    if PeftModel is None:
        return None
    seen = 0
    while model is not None and seen < 8:
        if isinstance(model, PeftModel):
            return model
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        seen += 1
    return None


def adapter_file(checkpoint_dir: str | os.PathLike, adapter_name: str = "default") -> Path:
    """The safetensors file peft's ``save_pretrained`` writes for ``adapter_name``: the directory itself
    for ``"default"``, a subfolder named after the adapter otherwise.

    Example:
        >>> str(adapter_file("/ckpt", "other"))
        '/ckpt/other/adapter_model.safetensors'
    """
    root = Path(checkpoint_dir)
    folder = root if adapter_name == "default" else root / adapter_name
    return folder / ADAPTER_SAFE_WEIGHTS_NAME


def adapter_parameter_map(peft_model: Any, adapter_name: str = "default") -> dict[str, tuple[str, torch.Tensor]]:
    """Maps each key peft's ``save_pretrained`` writes for ``adapter_name`` to ``(parameter name,
    parameter)`` of ``peft_model``.

    Args:
        peft_model: A ``PeftModel`` (possibly FSDP2-sharded: the values are then DTensors).
        adapter_name: The adapter.

    Returns:
        Saved key -> (name in ``peft_model.state_dict()``, the live parameter or buffer).

    Raises:
        CheckpointError: If the model has no adapter of that name.
    """
    if adapter_name not in peft_model.peft_config:
        raise CheckpointError(
            f"the model has no adapter named {adapter_name!r}; its adapters are {list(peft_model.peft_config)}. "
            "HINT: add it first (`model.add_adapter(name, config)` or `load_adapter`), then reload its weights."
        )
    return _saved_keys(peft_model, adapter_name, save_embedding_layers=False)


def _saved_keys(peft_model: Any, adapter_name: str, *, save_embedding_layers: bool) -> dict[str, tuple[str, torch.Tensor]]:
    """peft's saved key -> (state-dict name, live tensor), asked of ``get_peft_model_state_dict`` without moving a byte.

    peft 0.22 gathers every DTensor it selects into a full CPU copy (a collective, and the whole adapter in memory on
    every rank); it is handed a ``meta`` stand-in of each DTensor's global shape instead, and the answer is mapped back
    to the live tensor by identity.
    """
    from peft.utils import get_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    live = peft_model.state_dict(keep_vars=True)
    asked = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, DTensor) else t for k, t in live.items()}
    names = {id(t): k for k, t in asked.items()}
    saved = get_peft_model_state_dict(peft_model, state_dict=asked, adapter_name=adapter_name,
                                      save_embedding_layers=save_embedding_layers)
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for key, tensor in saved.items():
        if isinstance(tensor, torch.Tensor) and id(tensor) in names:
            out[key] = (names[id(tensor)], live[names[id(tensor)]])
    return out


# -- validation --------------------------------------------------------------------------------------


def read_safetensors_header(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Reads and checks a safetensors header without touching the data
    (:func:`accelerate_memsafe.io.validate.check_safetensors_file`: complete header, every tensor's byte
    range matches its dtype and shape, the file holds every tensor — a truncated file names the first
    tensor cut off).

    Args:
        path: The file.

    Returns:
        Tensor name -> dtype, shape and byte range.

    Raises:
        CheckpointError: If the file is missing, truncated or corrupt.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"adapter file {str(path)!r} does not exist.")
    return check_safetensors_file(path)


def _check_against(
    path: Path, entries: Mapping[str, TensorInfo], targets: Mapping[str, torch.Tensor], *, required: Iterable[str]
) -> None:
    missing = [k for k in required if k not in entries]
    if missing:
        raise CheckpointError(
            f"{str(path)!r} lacks {len(missing)} tensor(s) the model's adapter has, e.g. `{missing[0]}`"
            f"{' (also: ' + ', '.join(missing[1:4]) + ')' if len(missing) > 1 else ''}. "
            "The file belongs to a different adapter configuration (rank, target modules): load it into a "
            "model built with that adapter's `adapter_config.json`."
        )
    unknown = [k for k in entries if k not in targets]
    if unknown:
        raise CheckpointError(
            f"{str(path)!r} holds {len(unknown)} tensor(s) the model has no parameter for, e.g. `{unknown[0]}`. "
            "The adapter was saved from a different model or adapter configuration; if it needs transformers' "
            "weight conversion, load it with peft's `load_adapter(..., torch_device='cpu')` instead."
        )
    for key, entry in entries.items():
        target = targets[key]
        shape = tuple(target.shape)
        if entry.shape != shape:
            raise CheckpointError(
                f"{str(path)!r}: tensor `{key}` has shape {list(entry.shape)} in the file but {list(shape)} in the "
                "model. The adapter was saved with a different configuration (e.g. another LoRA rank); build the "
                "model with the saved `adapter_config.json`."
            )
        if target.device.type == "meta":
            raise CheckpointError(
                f"{str(path)!r}: the model's tensor for `{key}` is on the meta device; materialize the model first."
            )
        _local_index(target)  # an unsupported DTensor placement fails here, before any copy
    _check_casts(path, entries, targets)


def _check_casts(path: Path, entries: Mapping[str, TensorInfo], targets: Mapping[str, torch.Tensor]) -> None:
    """Refuses a dtype conversion that would lose data (e.g. float64 values beyond float32's range),
    before any copy; only tensors whose cast may lose values are read (usually none)."""
    check_casts(entries, {k: targets[k].dtype for k in entries})


# -- memory pre-check ---------------------------------------------------------------------------------


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """Free and total bytes of an accelerator device, or ``None`` for CPU / unknown devices."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)
    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and mod is not None and hasattr(mod, "mem_get_info"):
        try:
            return mod.mem_get_info(device)
        except (RuntimeError, TypeError):
            return None
    return None


def check_device_memory(
    device: torch.device, *, required_bytes: int, adapter_bytes: int, what: str, file: str | os.PathLike | None = None
) -> None:
    """Raises before any copy when ``required_bytes`` do not fit the free memory of ``device``.

    Args:
        device: Where the parameters live.
        required_bytes: Extra device bytes the reload needs.
        adapter_bytes: Size of the whole adapter (shown for comparison).
        what: How the reload runs (shown in the message).
        file: The adapter file (shown in the message).

    Raises:
        MemoryBudgetError: With the sizes in GiB and what to do.

    Example:
        >>> check_device_memory(torch.device("cpu"), required_bytes=1, adapter_bytes=1, what="x")  # CPU: no check
    """
    found = device_memory(device)
    if found is None:
        return
    free, total = found
    if required_bytes <= free:
        return
    where = f" from {str(file)!r}" if file else ""
    raise MemoryBudgetError(
        f"Reloading the adapter{where} {what} needs {required_bytes / _GIB:.3f} GiB of free memory on {device}, "
        f"but only {free / _GIB:.3f} GiB of {total / _GIB:.3f} GiB are free (whole adapter: "
        f"{adapter_bytes / _GIB:.3f} GiB). Nothing was copied. Free device memory first (drop the optimizer and "
        "gradients: `del optimizer; model.zero_grad(set_to_none=True); gc.collect(); torch.cuda.empty_cache()`), "
        "or load on CPU: `reload_adapter(model.cpu(), ...)`."
    )


def empty_device_caches() -> None:
    """Collects garbage and returns cached blocks of the accelerator's allocator to the driver (nothing on a
    machine without an accelerator: no cache to empty, and a full collection costs a quarter of a second)."""
    accelerator = torch.cuda.is_available() or (hasattr(torch, "accelerator") and torch.accelerator.is_available())
    if not accelerator:
        return
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    elif hasattr(torch, "accelerator") and torch.accelerator.is_available() and hasattr(torch.accelerator, "empty_cache"):
        torch.accelerator.empty_cache()


# -- the copy -----------------------------------------------------------------------------------------


def _local_index(t: torch.Tensor) -> tuple[slice, ...] | None:
    """The slice of the global tensor that a DTensor's local shard holds (``None`` for plain tensors).

    Follows DTensor's even-chunk rule (``torch.chunk``: ceil-sized chunks, the last ones shorter or empty),
    mesh dimension by mesh dimension, using only public DTensor attributes.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    bounds = [[0, s] for s in t.shape]
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            raise CheckpointError(
                f"cannot compute the local shard of a DTensor with placement {placement!r}; only Shard(dim) and "
                "Replicate are supported. Reload before applying that parallelism, or use DCP."
            )
        d, n = placement.dim, mesh.size(mesh_dim)
        start, length = bounds[d]
        chunk = -(-length // n)
        lo = min(coord[mesh_dim] * chunk, length)
        hi = min(lo + chunk, length)
        bounds[d] = [start + lo, hi - lo]
    index = tuple(slice(s, s + n) for s, n in bounds)
    local = tuple(t.to_local().shape)
    if tuple(n for _, n in bounds) != local:
        raise CheckpointError(
            f"computed local shard {[n for _, n in bounds]} does not match the DTensor's local shape {list(local)} "
            f"(placements {t.placements})."
        )
    return index


def _device_of(targets: Iterable[torch.Tensor]) -> torch.device:
    for t in targets:
        dev = t.device
        if dev.type != "meta":
            return dev
    return torch.device("cpu")


def copy_file_into(path: str | os.PathLike, plan: Sequence[tuple[str, torch.Tensor]]) -> ReloadStats:
    """Copies tensors of a safetensors file into existing tensors, one at a time, CPU-first.

    Each tensor is read on CPU (only the local slice for a DTensor target, via ``get_slice``), cast to the
    target dtype on CPU, and copied in place; on CUDA from pinned memory with ``non_blocking=True``, keeping
    at most one transfer in flight. Validate first: this function assumes keys and shapes match.

    Args:
        path: The safetensors file.
        plan: ``(key in the file, target tensor)`` pairs (parameters, buffers or DTensors).

    Returns:
        What was copied.
    """
    from safetensors import safe_open

    path = Path(path)
    copied = largest = count = 0
    device = _device_of(t for _, t in plan)
    pending: tuple[Any, torch.Tensor] | None = None  # (event, pinned source kept alive until it fires)
    with torch.no_grad(), safe_open(str(path), framework="pt", device="cpu") as f:
        for key, target in plan:
            index = _local_index(target)
            dest = target.to_local() if index is not None else target
            src = f.get_slice(key)[index] if index is not None else f.get_tensor(key)
            # get_slice maps the whole tensor's bytes (only the slice's pages are read): count the mapping.
            largest = max(largest, src.untyped_storage().nbytes())
            if src.dtype != dest.dtype:
                src = src.to(dest.dtype)
                largest = max(largest, src.numel() * src.element_size())
            if dest.device.type == "cuda":
                src = src.pin_memory()
                if pending is not None:
                    pending[0].synchronize()
                dest.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                pending = (event, src)
            else:
                dest.copy_(src)
            copied += dest.numel() * dest.element_size()
            count += 1
            del src
        if pending is not None:
            pending[0].synchronize()
    return ReloadStats(str(path), count, copied, largest, str(device))


def _plan_adapter(
    peft_model: Any, checkpoint_dir: str | os.PathLike, adapter_name: str
) -> tuple[Path, list[tuple[str, torch.Tensor]], dict[str, TensorInfo]]:
    mapping = adapter_parameter_map(peft_model, adapter_name)
    path = adapter_file(checkpoint_dir, adapter_name)
    if not path.is_file():
        legacy = path.with_name(ADAPTER_WEIGHTS_NAME)
        hint = (
            f" Found {str(legacy)!r} (pickle); re-save with `save_pretrained(..., safe_serialization=True)`."
            if legacy.is_file()
            else " peft's `save_pretrained` writes the default adapter in the directory itself and every other "
            "adapter in a subfolder named after it."
        )
        raise CheckpointError(f"adapter file {str(path)!r} for adapter {adapter_name!r} does not exist.{hint}")
    entries = read_safetensors_header(path)
    targets = {k: t for k, (_, t) in mapping.items()}
    extra = {}
    if any(k not in targets for k in entries):
        # Embedding layers are saved only in some configurations; accept them when the model has them.
        with_emb = _saved_keys(peft_model, adapter_name, save_embedding_layers=True)
        extra = {k: t for k, (_, t) in with_emb.items() if k in entries and k not in targets}
    _check_against(path, entries, {**targets, **extra}, required=targets)
    plan = [(k, targets.get(k, extra.get(k))) for k in entries]
    return path, plan, entries


def reload_adapters(
    peft_model: Any,
    checkpoint_dir: str | os.PathLike,
    adapter_names: Sequence[str] | None = None,
    *,
    check_memory: bool = True,
) -> list[ReloadStats]:
    """Reloads several adapters CPU-first and in place; every file is validated before any copy.

    Args:
        peft_model: The ``PeftModel`` (or a wrapper of it) whose adapters receive the weights.
        checkpoint_dir: A directory in peft's ``save_pretrained`` layout.
        adapter_names: Adapters to reload; ``None``: every adapter of the model whose file exists in
            ``checkpoint_dir`` (at least one must).
        check_memory: Compare the extra device memory needed with the free memory first.

    Returns:
        One :class:`ReloadStats` per adapter, in order.

    Raises:
        CheckpointError: A file is missing, truncated, or does not match the model (nothing modified).
        MemoryBudgetError: The device cannot hold the staging tensor (nothing modified).

    Example:
        >>> # model.save_pretrained("best"); ...train...; reload_adapters(model, "best")
    """
    model = find_peft_model(peft_model)
    if model is None:
        raise CheckpointError(f"expected a peft `PeftModel` (or a wrapper of one), got {type(peft_model).__name__}.")
    if adapter_names is None:
        adapter_names = [n for n in model.peft_config if adapter_file(checkpoint_dir, n).is_file()]
        if not adapter_names:
            raise CheckpointError(
                f"no adapter file of {list(model.peft_config)} in {str(checkpoint_dir)!r} (looked for "
                f"{str(adapter_file(checkpoint_dir, 'default'))!r} and <adapter name>/{ADAPTER_SAFE_WEIGHTS_NAME})."
            )
    plans = [_plan_adapter(model, checkpoint_dir, name) for name in adapter_names]
    if check_memory:
        all_targets = [t for _, plan, _ in plans for _, t in plan]
        device = _device_of(all_targets)
        largest = max((e.nbytes for _, _, entries in plans for e in entries.values()), default=0)
        whole = sum(e.nbytes for _, _, entries in plans for e in entries.values())
        check_device_memory(
            device, required_bytes=largest, adapter_bytes=whole,
            what="CPU-first (one tensor at a time)", file=plans[0][0] if len(plans) == 1 else checkpoint_dir,
        )
    return [copy_file_into(path, plan) for path, plan, _ in plans]


def reload_adapter(
    peft_model: Any, checkpoint_dir: str | os.PathLike, adapter_name: str = "default", *, check_memory: bool = True
) -> ReloadStats:
    """Reloads one adapter's weights from peft's ``save_pretrained`` layout, CPU-first and in place.

    The adapter's safetensors file (``checkpoint_dir/adapter_model.safetensors`` for ``"default"``,
    ``checkpoint_dir/<adapter_name>/adapter_model.safetensors`` otherwise) is validated, then read tensor
    by tensor on CPU and copied into the existing parameters, including ``modules_to_save`` copies. For an
    FSDP2-sharded model only the local shard of each tensor is read and copied. The extra memory is at
    most one tensor; training mode and ``requires_grad`` are left as they are.

    Args:
        peft_model: The ``PeftModel`` (or a wrapper of it).
        checkpoint_dir: The directory ``save_pretrained`` wrote.
        adapter_name: The adapter to reload (it must already exist in the model).
        check_memory: Compare the extra device memory needed with the free memory first.

    Returns:
        What was copied.

    Raises:
        CheckpointError: The file is missing, truncated, or does not match the model; raised before any
            parameter is modified.
        MemoryBudgetError: The device cannot hold one staging tensor (nothing modified).

    Example:
        >>> # model.save_pretrained("ckpt")
        >>> # stats = reload_adapter(model, "ckpt")            # the "default" adapter
        >>> # reload_adapter(model, "ckpt", adapter_name="other")  # reads ckpt/other/
    """
    return reload_adapters(peft_model, checkpoint_dir, [adapter_name], check_memory=check_memory)[0]


def plan_state_dict_file(
    model: torch.nn.Module, path: str | os.PathLike, *, check_memory: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """Validates a safetensors file keyed like ``model.state_dict()`` (accelerate's ``model.safetensors``)
    against the model and returns the copy plan for :func:`copy_file_into`. Nothing is modified.

    Raises:
        CheckpointError: Missing, truncated or mismatching file, naming the file and the tensor.
        MemoryBudgetError: The device cannot hold one staging tensor.
    """
    path = Path(path)
    live = model.state_dict(keep_vars=True)
    entries = read_safetensors_header(path)
    # Tied weights are saved once (under either name): require one name per distinct tensor.
    groups: dict[int, list[str]] = {}
    for key, t in live.items():
        if isinstance(t, torch.Tensor):
            groups.setdefault(id(t), []).append(key)
    required = [keys[0] for keys in groups.values() if not any(k in entries for k in keys)]
    _check_against(path, entries, live, required=required)
    plan = [(k, live[k]) for k in entries]
    if check_memory:
        check_device_memory(
            _device_of(t for _, t in plan),
            required_bytes=max((e.nbytes for e in entries.values()), default=0),
            adapter_bytes=sum(e.nbytes for e in entries.values()),
            what="CPU-first (one tensor at a time)", file=path,
        )
    return plan


def reload_state_dict_file(model: torch.nn.Module, path: str | os.PathLike, *, check_memory: bool = True) -> ReloadStats:
    """Reloads every tensor of a safetensors file keyed like ``model.state_dict()`` (accelerate's
    ``model.safetensors``) into the model, CPU-first and in place; validated first like :func:`reload_adapter`.

    Raises:
        CheckpointError: Missing, truncated or mismatching file (nothing modified).
        MemoryBudgetError: The device cannot hold one staging tensor (nothing modified).

    Example:
        >>> # accelerator.save_state("ckpt"); ...; reload_state_dict_file(model, "ckpt/model.safetensors")
    """
    return copy_file_into(path, plan_state_dict_file(model, path, check_memory=check_memory))
