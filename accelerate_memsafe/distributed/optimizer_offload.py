"""Optimizer state on CPU between steps, brought to the device only for ``step()``; device memory reclaim.

Design (documented in docs/checkpoints.md): the state lives in CPU tensors (pinned when CUDA is present,
so the copies are asynchronous DMA). A step pre-hook copies it to the device, the optimizer steps there
with its normal (foreach/fused) kernels, and a step post-hook copies it back into the *same* CPU tensors
and drops the device copies. Between steps - during forward and backward, where activations peak - the
device holds no optimizer state. The price is two host<->device copies of the state per step; stepping on
CPU instead would avoid them but run the update on slow CPU kernels and need the gradients and a CPU copy
of the parameters. With DTensor state (FSDP2) the local tensors move; the DTensor wrapper is rebuilt.
On a machine without an accelerator the parameters are on CPU and the hooks move nothing.

``step`` is the exception: it stays where torch's optimizers want it (see :func:`state_tensor_device`),
on the parameter's device for ``capturable=True`` / ``fused=True`` and on CPU otherwise, both between
steps and during them.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

_ATTR = "_memsafe_offload"


def _is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _moved(t: torch.Tensor, device: torch.device, *, pin: bool = False, into: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` on ``device``, copying into ``into`` (same layout) when given; DTensors keep their spec."""
    if _is_dtensor(t):
        from torch.distributed.tensor import DTensor

        local = t.to_local()
        dst_local = into.to_local() if into is not None else None
        new_local = _moved(local, device, pin=pin, into=dst_local)
        if dst_local is not None and new_local is dst_local:
            return into
        return DTensor.from_local(new_local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    if t.device == device and into is None:
        return t
    if into is not None:
        into.copy_(t, non_blocking=True)
        return into
    if device.type == "cpu" and pin:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out
    return t.to(device, non_blocking=True)


def step_device(group: dict[str, Any], param_device: torch.device) -> torch.device:
    """Where torch keeps ``state["step"]`` of a parameter in ``group``.

    torch's Adam/AdamW (``_init_group``) create it on the parameter's device when the group is
    ``capturable`` or ``fused`` (their kernels read it there, and check that they do) and on CPU otherwise
    (the Python loop reads it as a number); ``Optimizer.load_state_dict`` applies the same rule.

    Example:
        >>> step_device({"fused": True}, torch.device("cuda", 1))
        device(type='cuda', index=1)
        >>> step_device({"capturable": False, "fused": None}, torch.device("cuda", 1))
        device(type='cpu')
    """
    if group.get("capturable") or group.get("fused"):
        return torch.device(param_device)
    return torch.device("cpu")


def state_tensor_device(key: str, value: torch.Tensor, group: dict[str, Any], param_device: torch.device, *,
                        offloaded: bool) -> torch.device:
    """Where a state tensor of a parameter belongs: a scalar ``step`` where :func:`step_device` puts it,
    anything else on CPU while ``offloaded`` and on the parameter's device otherwise.

    Example:
        >>> g = {"capturable": True}; dev = torch.device("cuda")
        >>> state_tensor_device("step", torch.zeros(()), g, dev, offloaded=True)
        device(type='cuda')
        >>> state_tensor_device("exp_avg", torch.zeros(4), g, dev, offloaded=True)
        device(type='cpu')
    """
    if key == "step" and value.dim() == 0:
        return step_device(group, param_device)
    return torch.device("cpu") if offloaded else torch.device(param_device)


def _placements(optimizer: torch.optim.Optimizer):
    """``(parameter, its state dict, key, value, group, parameter's local device)`` for every state tensor."""
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for p, st in optimizer.state.items():
        group = groups.get(id(p), {})
        local = p.to_local() if _is_dtensor(p) else p
        for k, v in list(st.items()):
            if isinstance(v, torch.Tensor):
                yield p, st, k, v, group, local.device


def state_bytes(optimizer: torch.optim.Optimizer, device_type: str | None = None) -> int:
    """Bytes of the optimizer's state tensors (local shards for DTensors), optionally only on ``device_type``.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(4)); opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(4); opt.step(); state_bytes(opt)
        16
    """
    total = 0
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                loc = v.to_local() if _is_dtensor(v) else v
                if device_type is None or loc.device.type == device_type:
                    total += loc.numel() * loc.element_size()
    return total


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: str | torch.device, *, pin: bool = False) -> int:
    """Moves every state tensor (DTensor local tensors included) to ``device``, except scalar ``step``
    tensors, which go where :func:`step_device` puts them. Returns the bytes moved.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(4)); opt = torch.optim.Adam([p])
        >>> p.grad = torch.ones(4); opt.step(); move_optimizer_state(opt, "cpu")
        0
    """
    device = torch.device(device)
    moved = 0
    for _p, st, k, v, group, param_device in _placements(optimizer):
        target = step_device(group, param_device) if (k == "step" and v.dim() == 0) else device
        loc = v.to_local() if _is_dtensor(v) else v
        if loc.device != target:
            st[k] = _moved(v, target, pin=pin and target.type == "cpu")
            moved += loc.numel() * loc.element_size()
    return moved


class OptimizerOffload:
    """Keeps an optimizer's state on CPU between steps (see the module docstring).

    Args:
        optimizer: The torch optimizer (not accelerate's wrapper).
        device: The device the parameters live on (where the step runs).

    Example:
        >>> # OptimizerOffload.install(optimizer, torch.device("cuda"))
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device):
        self.optimizer = optimizer
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self._cpu: dict[tuple[int, str], torch.Tensor] = {}
        self._handles = []
        self.steps = 0

    @classmethod
    def install(cls, optimizer: torch.optim.Optimizer, device: torch.device) -> OptimizerOffload:
        """Registers the step hooks (once per optimizer) and moves any existing state to CPU."""
        found = getattr(optimizer, _ATTR, None)
        if found is not None:
            return found
        self = cls(optimizer, device)
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]
        setattr(optimizer, _ATTR, self)
        self.offload()
        return self

    @staticmethod
    def installed(optimizer: torch.optim.Optimizer) -> OptimizerOffload | None:
        """The offload installed on ``optimizer`` by :meth:`install`, if any."""
        return getattr(optimizer, _ATTR, None)

    def remove(self) -> None:
        """Removes the hooks (the state stays where it is)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if getattr(self.optimizer, _ATTR, None) is self:
            delattr(self.optimizer, _ATTR)

    @property
    def active(self) -> bool:
        """Whether there is anything to move (the parameters are not on CPU)."""
        return self.device.type != "cpu"

    def offload(self) -> int:
        """Copies the state to its CPU tensors (reused from step to step) and drops the device copies."""
        if not self.active:
            return move_optimizer_state(self.optimizer, "cpu")
        moved = 0
        for p, st, k, v, group, param_device in _placements(self.optimizer):
            loc = v.to_local() if _is_dtensor(v) else v
            target = state_tensor_device(k, v, group, param_device, offloaded=True)
            if loc.device == target:
                continue
            if target.type != "cpu":  # a capturable/fused `step` that an earlier load put on CPU
                st[k] = _moved(v, target)
                continue
            key = (id(p), k)
            buf = self._cpu.get(key)
            if buf is not None and (buf.to_local() if _is_dtensor(buf) else buf).shape != loc.shape:
                buf = None
            st[k] = _moved(v, torch.device("cpu"), pin=self.pin, into=buf)
            self._cpu[key] = st[k]
            moved += loc.numel() * loc.element_size()
        if self.pin and moved:
            torch.cuda.current_stream(self.device).synchronize()  # the CPU copies must be complete
        return moved

    def _before_step(self, optimizer, args, kwargs) -> None:
        if self.active:
            move_optimizer_state(optimizer, self.device)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.steps += 1
        self.offload()


def reclaim_device_memory(device: torch.device | str) -> dict[str, int]:
    """Runs ``gc.collect()`` and empties the device's caching allocator. On the CPU there is no cache to
    empty and freed tensors go back at once (reference counting), so nothing runs: a full collection costs
    0.2–0.6 s in a process with a model loaded.

    Returns:
        ``{"reclaimed_bytes": reserved before - reserved after, "reserved_bytes", "allocated_bytes"}``
        (zeros on CPU).

    Example:
        >>> reclaim_device_memory("cpu")["reclaimed_bytes"]
        0
    """
    device = torch.device(device)
    if device.type == "cpu":
        return {"reclaimed_bytes": 0, "reserved_bytes": 0, "allocated_bytes": 0}
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        before = torch.cuda.memory_reserved(device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        after = torch.cuda.memory_reserved(device)
        return {"reclaimed_bytes": before - after, "reserved_bytes": after, "allocated_bytes": torch.cuda.memory_allocated(device)}
    mod = getattr(torch, device.type, None)
    if device.type != "cpu" and mod is not None and hasattr(mod, "empty_cache"):
        mod.empty_cache()
    return {"reclaimed_bytes": 0, "reserved_bytes": 0, "allocated_bytes": 0}
