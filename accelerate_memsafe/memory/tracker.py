"""A dispatch-level tracker of live tensor bytes.

Every tensor produced by an ATen op while the tracker is active is keyed by its storage; the storage
counts as alive while any tensor that the tracker saw on it is alive. This sees what ``psutil`` cannot
(which allocation made the peak, whether a full-size tensor ever existed) and works on CPU, where there
is no allocator with statistics.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten


def _storage_key_and_bytes(t: torch.Tensor) -> tuple[int, int] | None:
    if t.device.type == "meta":
        return None
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return None  # wrapper subclasses (DTensor ...) own no storage; their local tensors are seen directly
    try:
        storage = t.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        return storage.data_ptr(), nbytes
    except (RuntimeError, NotImplementedError):
        return None


class LiveTensorTracker(TorchDispatchMode):
    """Counts bytes of tensors allocated while active and still alive; keeps the peak.

    Args:
        on_alloc: Optional callback ``(func_name, tensor)`` invoked for every new storage, used by the
            structural tests ("no full-size tensor is ever allocated on rank 1").

    Example:
        >>> with LiveTensorTracker() as tracker:
        ...     x = torch.ones(1024)
        >>> tracker.peak_bytes >= 4096
        True
    """

    def __init__(self, on_alloc: Callable[[str, torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self._on_alloc = on_alloc
        self._lock = threading.Lock()
        self._storages: dict[int, tuple[Any, int]] = {}  # data_ptr -> (StorageWeakRef, nbytes)
        self._live_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0

    @property
    def live_bytes(self) -> int:
        """Bytes of tracked storages still alive now."""
        with self._lock:
            self._sweep()
            return self._live_bytes

    def _sweep(self) -> None:
        # Liveness is read from the storage itself (a C++ weak reference), not from the Python wrapper
        # seen in dispatch: tensors built inside C++ composite ops (safetensors' get_tensor/load_file go
        # through set_ -> lift_fresh -> view) reach dispatch as temporary wrappers that die at once.
        dead = [k for k, (ref, _) in self._storages.items() if ref.expired()]
        for k in dead:
            self._live_bytes -= self._storages.pop(k)[1]

    def _track(self, func: Any, t: torch.Tensor, key: int, nbytes: int) -> None:
        with self._lock:
            if key in self._storages and not self._storages[key][0].expired():
                return
            if self._live_bytes + nbytes > self.peak_bytes:
                self._sweep()  # only a new peak needs exact liveness; keeps tracking O(1) otherwise
            if key in self._storages:
                self._live_bytes -= self._storages.pop(key)[1]  # a dead storage's address was reused
            self._storages[key] = (StorageWeakRef(t.untyped_storage()), nbytes)
            self._live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self._live_bytes)
            self.allocations += 1
        if self._on_alloc is not None:
            self._on_alloc(str(func), t)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "is_view", False):  # a view's output lies in its input's storage: nothing new
            return func(*args, **kwargs)
        # the inputs' storages are read before the call: an in-place op (`set_`) may point an input at a new one
        inputs = tensors_in(args) + tensors_in(kwargs) if kwargs else tensors_in(args)
        known = {found[0] for x in inputs if (found := _storage_key_and_bytes(x))}
        out = func(*args, **kwargs)
        for o in tensors_in(out):
            found = _storage_key_and_bytes(o)
            if found is not None and found[0] not in known:
                self._track(func, o, *found)
        return out


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors of a tree of tuples, lists and dicts: an op's arguments or outputs (one level is the common case),
    a loaded state dict."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (tuple, list)) else ()
    if all(not isinstance(x, (tuple, list, dict)) for x in items):
        return [x for x in items if isinstance(x, torch.Tensor)]
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]
