"""Collectives that cannot hang: every op runs async and is waited on with a deadline.

A rank that died or never reached a collective makes the others fail with
:class:`~accelerate_memsafe.errors.CollectiveTimeoutError` within ``timeout_s``, naming the stage, the
operation and the rank(s) that did not arrive. To name them, each rank marks its arrival at every
collective in the process group's key-value store (one small ``set`` per collective, no extra
round trip of tensors); on failure the waiting rank looks up which marks are missing.

Any stage can use it::

    coll = Collectives("rank0_distribute", timeout_s=options.collective_timeout_s)
    coll.broadcast(tensor, src=0)
"""

from __future__ import annotations

import datetime
import io
import pickle
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat
from ..errors import CollectiveTimeoutError

# Per-process count of Collectives objects created per stage: every rank creates them in the same order,
# so the count is a key prefix that all ranks agree on without communicating.
_GENERATIONS: dict[str, int] = {}


class Collectives:
    """Timeout-guarded collectives for one stage run.

    Args:
        stage: Stage name, used in error messages and store keys.
        timeout_s: Seconds each collective may take.
        group: Process group (default: the world).

    Example:
        >>> # coll = Collectives("buffer_init", timeout_s=60)
        >>> # coll.all_reduce(checksums)  # raises CollectiveTimeoutError naming a missing rank
    """

    def __init__(self, stage: str, *, timeout_s: float, group: Any = None) -> None:
        self.stage = stage
        self.timeout_s = float(timeout_s)
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(group)
        self.ranks = list(range(self.world_size)) if group is None else dist.get_process_group_ranks(group)
        self.device = _comm_device(group)
        generation = _GENERATIONS.get(stage, 0)
        _GENERATIONS[stage] = generation + 1
        self._prefix = f"accelerate_memsafe/{stage}/{generation}"
        self._store = _compat.default_store()
        self._count = 0

    # -- plumbing ---------------------------------------------------------------------------------
    def _arrive(self, op_index: int) -> None:
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/{op_index}/{self.rank}", b"1")
            except Exception:  # the store lives on rank 0; if it is gone the collective will say so
                pass

    def _missing(self, op_index: int) -> list[int]:
        if self._store is None:
            return []
        missing = []
        for r in self.ranks:
            try:
                if not self._store.check([f"{self._prefix}/{op_index}/{r}"]):
                    missing.append(r)
            except Exception:
                return []
        return missing

    def run(self, what: str, start: Callable[[], Any]) -> None:
        """Starts an async collective with ``start()`` and waits for it with the deadline.

        Args:
            what: Description for errors (``"scatter of bucket 3/40"``).
            start: Issues the collective with ``async_op=True`` and returns its work handle.

        Raises:
            CollectiveTimeoutError: If the op failed or did not finish within ``timeout_s``.
        """
        index = self._count
        self._count += 1
        self._arrive(index)
        started = time.monotonic()
        try:
            work = start()
            if work is not None:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except Exception as exc:
            missing = self._missing(index)
            who = (
                f"rank(s) {missing} never reached it"
                if missing
                else "every rank reached it, so a peer failed or stalled during the transfer"
            )
            elapsed = time.monotonic() - started
            how = (
                f"did not complete within collective_timeout_s={self.timeout_s:g}s"
                if elapsed >= self.timeout_s
                else f"failed after {elapsed:.1f}s (collective_timeout_s={self.timeout_s:g}s)"
            )
            raise CollectiveTimeoutError(
                f"stage `{self.stage}`: {what} on rank {self.rank} {how}: {who} ({type(exc).__name__}: {exc}). "
                "Check the log of the missing rank (it may have crashed or run out of memory); raise "
                "`MemSafePlugin(collective_timeout_s=...)` if the ranks are merely slow."
            ) from exc

    # -- ops ------------------------------------------------------------------------------------------
    def scatter(self, output: torch.Tensor, chunks: list[torch.Tensor] | None, *, src: int = 0, what: str = "scatter") -> None:
        """``dist.scatter`` under the deadline (``chunks`` only on ``src``); tensors must be on :attr:`device`."""
        self.run(what, lambda: dist.scatter(output, chunks if self.rank == src else None, src=src, group=self.group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, what: str = "broadcast") -> None:
        """``dist.broadcast`` under the deadline (a tensor off :attr:`device` travels through a copy)."""
        if tensor.device == self.device:
            self.run(what, lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True))
            return
        tmp = tensor.to(self.device)
        self.run(what, lambda: dist.broadcast(tmp, src=src, group=self.group, async_op=True))
        tensor.copy_(tmp)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, *, what: str = "all_reduce") -> None:
        """``dist.all_reduce`` under the deadline (default op: sum)."""
        op = dist.ReduceOp.SUM if op is None else op
        tmp = tensor if tensor.device == self.device else tensor.to(self.device)
        self.run(what, lambda: dist.all_reduce(tmp, op=op, group=self.group, async_op=True))
        if tmp is not tensor:
            tensor.copy_(tmp)

    def all_gather(self, tensor: torch.Tensor, *, what: str = "all_gather") -> list[torch.Tensor]:
        """``dist.all_gather`` of equally shaped tensors under the deadline; returns one CPU tensor per rank."""
        tensor = tensor.to(self.device)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.run(what, lambda: dist.all_gather(out, tensor, group=self.group, async_op=True))
        return [t.cpu() for t in out]

    def barrier(self, *, what: str = "barrier") -> None:
        """A barrier under the deadline (an all-reduce of one element)."""
        self.all_reduce(torch.zeros(1), what=what)

    def broadcast_object(self, obj: Any, *, src: int = 0, what: str = "broadcast of metadata") -> Any:
        """Broadcasts a picklable object from ``src`` (two broadcasts: size, then bytes).

        Returns:
            The object of ``src`` on every rank.
        """
        if self.rank == src:
            buf = io.BytesIO()
            pickle.dump(obj, buf)
            data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.broadcast(size, src=src, what=f"{what} (size)")
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.broadcast(data, src=src, what=what)
        if self.rank == src:
            return obj
        return pickle.loads(data.numpy().tobytes())


def _comm_device(group: Any) -> torch.device:
    """The device a collective's tensors must be on: the CPU when the group has gloo, else the accelerator
    (NCCL and friends take device tensors only)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    current = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return current or torch.device("cpu")
