"""Where rank 0 reads the weights it distributes from: its own tensors (often mmap views of the checkpoint)
or, per tensor, the safetensors file read with ``pread``."""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from ..io.mapped_pages import CleanFilePages, drop_pages
from ..io.safetensors_source import SafetensorsSource

#: Private bytes released between two ``malloc_trim`` calls on rank 0. A trim costs 15-35 us when there is little
#: to hand back (a transformers-loaded Qwen3-MoE in bf16), plus the kernel's work on the pages it returns, which
#: is due anyway; trimming often makes rank 0's memory fall as soon as a private copy is sent, whatever glibc's
#: dynamic mmap threshold did with that copy (a chunk below it stays in the heap until trimmed).
TRIM_EVERY_BYTES = 1 << 20


class Rank0Source:
    """Where rank 0 reads the weights from: the model's original tensors (possibly mmap-backed), or, per
    tensor, a safetensors checkpoint read with ``pread``.

    Args:
        tensors: Canonical name -> the original tensor (kept alive only until it has been sent).
        checkpoint: Optional lazily read checkpoint.
        from_checkpoint: Names to read from ``checkpoint`` instead of ``tensors``.

    Example:
        >>> src = Rank0Source({"w": torch.arange(6.).view(3, 2)})
        >>> out = torch.empty(2, 2, dtype=torch.float64); src.read_rows("w", 1, 3, out); out[0].tolist()
        [2.0, 3.0]
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        checkpoint: SafetensorsSource | None = None,
        from_checkpoint: set[str] | None = None,
    ) -> None:
        self.tensors = dict(tensors)
        self._aliases: dict[int, list[str]] = {}
        for name, t in self.tensors.items():
            self._aliases.setdefault(id(t), []).append(name)
        self.checkpoint = checkpoint
        self.from_checkpoint = set(from_checkpoint or ())
        self._pages = CleanFilePages({id(t): t for t in self.tensors.values()}.values())
        self._mapped: set[str] = set()  # checkpoint names that were read through the mapping after all
        self.released_bytes = 0
        self._freed = 0  # private bytes released since the last trim
        self._lock = threading.Lock()

    def is_meta(self, name: str) -> bool:
        return name not in self.from_checkpoint and self.tensors[name].is_meta

    def read_rows(self, name: str, start: int, stop: int, out: torch.Tensor, cols: tuple[slice, ...] | None = None) -> None:
        """Copies rows ``[start, stop)`` of ``name`` into ``out``, casting to ``out.dtype`` on the way
        (a 0-d tensor, e.g. a learned activation scalar, is its own single row). ``cols``: the slices of
        the other dimensions to copy (a TP block), ``None`` for whole rows."""
        if out.dim() == 0:
            out = out.view(1)
        if name in self.from_checkpoint:  # one read: the piece is already bounded by the bucket
            self.checkpoint.read_block(name, (start, stop), cols, out, chunk_bytes=(stop - start) * self.checkpoint.entries[name].row_bytes)
            return
        t = self.tensors[name]
        src = t[start:stop] if t.dim() else t
        out.copy_(src if cols is None else src[(slice(None), *cols)])

    def rows_view(self, name: str, start: int, stop: int, dtype: torch.dtype, cols: tuple[slice, ...] | None) -> torch.Tensor | None:
        """Rows ``[start, stop)`` of ``name`` as the bytes of rank 0's own tensor, when they can be sent as
        they are (same dtype, whole rows, contiguous): no copy. ``None`` otherwise.

        Example:
            >>> src = Rank0Source({"w": torch.arange(6.).view(3, 2)})
            >>> src.rows_view("w", 1, 2, torch.float32, None).numel(), src.rows_view("w", 1, 2, torch.float64, None)
            (8, None)
        """
        if name in self.from_checkpoint:  # the file's bytes, through a mapping of it (dropped once sent)
            entry = self.checkpoint.entries[name]
            if entry.dtype != dtype or cols is not None:
                return None
            return self.checkpoint.map_rows(name, start, stop)
        t = self.tensors.get(name)
        if t is None or t.is_meta or t.dtype != dtype or cols is not None or t.dim() == 0 or not t.is_contiguous():
            return None
        if t.device.type != "cpu":
            return None
        self._mapped.add(name)
        return t[start:stop].reshape(-1).view(torch.uint8)

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype rank 0 holds ``name`` in (the checkpoint's for a name read from it)."""
        if name in self.from_checkpoint:
            return self.checkpoint.entries[name].dtype
        return self.tensors[name].dtype

    def sent(self, views: list[torch.Tensor]) -> None:
        """Drops from this process's RSS the pages of the checkpoint's mapping that ``views`` (from
        :meth:`rows_view`, now sent) faulted in; views of the model's own tensors are left to :meth:`release`."""
        if self.checkpoint is None:
            return
        dropped = sum(drop_pages(v) for v in views if self.checkpoint.is_mapped_here(v))
        with self._lock:
            self.released_bytes += dropped

    def release(self, name: str) -> None:
        """Drops the source of ``name`` once it has been sent; returns file-backed pages to the kernel, and
        private memory freed since the last time (e.g. fused MoE experts, built in memory by transformers) to
        it every :data:`TRIM_EVERY_BYTES` (glibc keeps freed heap below its dynamic mmap threshold)."""
        with self._lock:  # the prefetch thread; at its close, the sending thread
            t = self.tensors.pop(name, None)
            for alias in self._aliases.pop(id(t), ()) if t is not None else ():
                self.tensors.pop(alias, None)  # the other names of a tie: the tensor has been sent
            if t is None or (name in self.from_checkpoint and name not in self._mapped):
                return
            dropped = self._pages.drop(t)
            self.released_bytes += dropped
            if not dropped and t.device.type == "cpu" and not t.is_meta:
                self._freed += t.numel() * t.element_size()
                del t
                if self._freed >= TRIM_EVERY_BYTES:
                    from ..memory.procfs import malloc_trim

                    malloc_trim()
                    self._freed = 0

    def close(self) -> None:
        self.tensors.clear()
        if self.checkpoint is not None:
            self.checkpoint.close()


