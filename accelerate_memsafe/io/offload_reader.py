"""Reads the values of a dispatched model's tensors one at a time, wherever they live.

A model dispatched by accelerate (``dispatch_model``, ``load_checkpoint_and_dispatch``) or by
``from_pretrained(device_map=..., offload_folder=...)`` keeps offloaded parameters as ``meta`` tensors; an
offload hook on the owning module holds a ``weights_map`` that loads them from the cpu state dict or the
disk offload index. Tensors placed on ``cpu`` (or an accelerator) are real and are read as they are.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from .. import _compat
from ..errors import CheckpointError
from .mapped_pages import FileExtent, file_extents


def _offload_maps(model: torch.nn.Module) -> dict[str, Mapping]:
    return {name: wm for name, module in model.named_modules() if (wm := _compat.hook_weights_map(module)) is not None}


def _owner(name: str, maps: Mapping[str, Mapping]) -> tuple[Mapping, str] | None:
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:i])
        if prefix in maps:
            return maps[prefix], name[len(prefix) + 1 :] if prefix else name
    return None


def offloaded_names(model: torch.nn.Module) -> list[str]:
    """Names of the state-dict tensors whose values live in an offload hook (cpu or disk), not in the module.

    Example:
        >>> import torch
        >>> offloaded_names(torch.nn.Linear(2, 2))
        []
    """
    maps = _offload_maps(model)
    if not maps:
        return []
    return [n for n, t in model.state_dict().items() if t.device.type == "meta" and _owner(n, maps) is not None]


def is_offloaded(model: torch.nn.Module) -> bool:
    """Whether some of ``model``'s tensors are offloaded (their values are not in the module)."""
    return bool(offloaded_names(model))


class OffloadedTensorReader:
    """Loads one state-dict tensor at a time to CPU.

    Args:
        model: The dispatched model.
        state_dict: Its tensors (``meta`` for offloaded ones), e.g. ``model.state_dict()``.

    Raises:
        CheckpointError: At construction, naming every ``meta`` tensor that no offload hook can load
            (nothing has been written yet).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> OffloadedTensorReader(m, m.state_dict()).read("weight").shape
        torch.Size([2, 2])
    """

    def __init__(self, model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]):
        self._tensors = dict(state_dict)
        self._resident_extents: dict[str, FileExtent | None] | None = None
        self._headers: dict[str, dict] = {}
        maps = _offload_maps(model)
        self._sources: dict[str, tuple[Mapping, str]] = {}
        orphans = []
        for name, tensor in self._tensors.items():
            if tensor.device.type != "meta":
                continue
            found = _owner(name, maps)
            if found is None:
                orphans.append(name)
            else:
                self._sources[name] = found
        if orphans:
            raise CheckpointError(
                f"{len(orphans)} tensor(s) are on the `meta` device and no accelerate offload hook on their module "
                f"or a parent holds their values, e.g. {orphans[:3]}. The model was not dispatched with a "
                "device_map, its hooks were removed, or the device_map splits a module's own tensors across "
                "devices (keep `_no_split_modules` whole); nothing was written. HINT: load the model with "
                "`device_map=` and `offload_folder=`, or materialize it before saving."
            )

    @property
    def offloaded(self) -> list[str]:
        """Names read from an offload hook."""
        return list(self._sources)

    def is_resident(self, name: str) -> bool:
        """Whether ``name``'s value lives in the module itself (read without a copy), not in an offload hook."""
        return name not in self._sources

    def read(self, name: str) -> torch.Tensor:
        """The value of ``name`` on CPU. Offloaded tensors are loaded (a new tensor); CPU-resident ones are
        returned as they are (no copy)."""
        if name in self._sources:
            weights_map, key = self._sources[name]
            tensor = weights_map[key]
        else:
            tensor = self._tensors[name]
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")
        return tensor

    def extent(self, name: str) -> FileExtent | None:
        """Where in a file the bytes :meth:`read` would return for ``name`` lie, or ``None`` where they must be
        read into memory.

        A cpu-resident tensor qualifies when it is a contiguous view of a memory-mapped file whose pages
        still hold the file's bytes (:func:`~accelerate_memsafe.io.mapped_pages.file_extents`; decided once,
        for every resident tensor, at the first call). An offloaded one qualifies when accelerate's loader
        reads it, unconverted, from a safetensors file or its raw ``.dat`` file
        (:func:`accelerate_memsafe._compat.offload_file_entry`) with the dtype and shape the model has.

        Example:
            >>> import torch
            >>> m = torch.nn.Linear(2, 2)
            >>> OffloadedTensorReader(m, m.state_dict()).extent("weight") is None  # anonymous memory
            True
        """
        if name not in self._sources:
            if self._resident_extents is None:
                names = [n for n, t in self._tensors.items() if n not in self._sources and t.device.type == "cpu"]
                found = file_extents([self._tensors[n] for n in names])
                self._resident_extents = dict(zip(names, found))
            return self._resident_extents.get(name)
        entry = _compat.offload_file_entry(*self._sources[name])
        if entry is None:
            return None
        want = self._tensors[name]
        nbytes = want.numel() * want.element_size()
        if entry["format"] == "dat":
            # offload_weight stores the raw bytes, bfloat16 / float8 reinterpreted as int16 / int8
            dtype = getattr(torch, entry["dtype"], None)
            if dtype != want.dtype or tuple(entry["shape"]) != tuple(want.shape):
                return None
            return _existing_extent(entry["file"], 0, nbytes)
        source = self._safetensors_entries(entry["file"]).get(entry["name"])
        cast = entry["dtype"]
        if source is None or source.dtype != want.dtype or (cast is not None and getattr(torch, cast, None) != want.dtype):
            return None
        if tuple(source.shape) != tuple(want.shape) or source.nbytes != nbytes:
            return None
        return _existing_extent(entry["file"], source.offset, nbytes)

    def _safetensors_entries(self, file: str) -> dict:
        if file not in self._headers:
            from .safetensors_source import SafetensorsSource

            try:
                self._headers[file] = SafetensorsSource(file).entries
            except (CheckpointError, OSError):
                self._headers[file] = {}  # read through the offload loader instead
        return self._headers[file]


def _existing_extent(path: str, offset: int, nbytes: int) -> FileExtent | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileExtent(path, offset, nbytes, st.st_ino) if offset + nbytes <= st.st_size else None


def cpu_disk_device_map(model: torch.nn.Module, cpu_fraction: float = 0.5) -> dict[str, str]:
    """A ``device_map`` that keeps the first ``cpu_fraction`` of the model's blocks on ``cpu`` and puts the
    rest on ``disk``, never splitting a block (``model._no_split_modules``, e.g. decoder layers). Used by
    the tests and the benchmark to build an offloaded model of any architecture.

    Args:
        model: A transformers model (on ``meta`` or real tensors).
        cpu_fraction: Share of the parameter bytes, in module order, that stays on cpu.

    Returns:
        Module name -> ``"cpu"`` or ``"disk"``, covering every parameter and buffer.

    Example:
        >>> # dm = cpu_disk_device_map(model); AutoModel.from_pretrained(p, device_map=dm, offload_folder=o)
    """
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__ in no_split and not any(name.startswith(b + ".") for b in blocks):
            blocks.append(name)
    units: dict[str, int] = {}
    tied_to: dict[str, str] = {}  # owner of a tied alias -> owner of the first occurrence (same device)
    first_owner: dict[int, str] = {}
    tensors = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for name, tensor in tensors:
        owner = next((b for b in blocks if name.startswith(b + ".")), None)
        if owner is None:
            module = name.rpartition(".")[0]
            # A tensor held directly by a module that also has children is mapped by its own name, so
            # that the entry does not cover (and contradict) the children's entries.
            has_children = next(iter(model.get_submodule(module).children()), None) is not None
            owner = name if has_children else module
        if id(tensor) in first_owner and first_owner[id(tensor)] != owner:
            tied_to.setdefault(owner, first_owner[id(tensor)])
            units.setdefault(owner, 0)
            continue
        first_owner.setdefault(id(tensor), owner)
        units[owner] = units.get(owner, 0) + tensor.numel() * tensor.element_size()
    total = sum(units.values()) or 1
    device_map, done = {}, 0
    for owner, nbytes in units.items():
        if owner not in tied_to:
            device_map[owner] = "cpu" if done < cpu_fraction * total else "disk"
            done += nbytes
    for owner, target in tied_to.items():
        device_map[owner] = device_map[target]
    return {owner: device_map[owner] for owner in units}
