"""Give back the resident pages of memory-mapped weights once they have been written.

transformers 5.x loads cpu-resident weights as views of a memory-mapped checkpoint file: reading them to
save them faults their pages in, and they stay in the process's RSS (file-backed, not private) for as long
as the model lives. After a shard is written we ask the kernel to reclaim exactly those pages with
``madvise(MADV_PAGEOUT)``. That is only a hint and never loses data: clean file pages are dropped and
re-read from the file on the next access, and pages a process modified are private memory the kernel
keeps (or swaps). Memory that is not file-backed (tensors in ordinary allocations) is never advised, so a
model trained in memory is not pushed to swap.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable

import torch

_MADV_PAGEOUT = 21
_MAPS = "/proc/self/maps"


def file_backed_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process that map regular files (from ``/proc/self/maps``), sorted.

    Returns:
        ``[(start, end), ...]``; empty where ``/proc`` is not available.
    """
    ranges = []
    try:
        with open(_MAPS, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                if not path.startswith("/") or path.endswith(" (deleted)"):
                    continue
                start, _, end = parts[0].partition("-")
                ranges.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    ranges.sort()
    return ranges


def _libc():
    name = ctypes.util.find_library("c")
    if not name or os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


def release_mapped_pages(tensors: Iterable[torch.Tensor], ranges: list[tuple[int, int]] | None = None) -> int:
    """Advises the kernel to reclaim the resident pages of the file-backed tensors among ``tensors``.

    Args:
        tensors: CPU tensors that were just read (e.g. written to a shard).
        ranges: File-backed address ranges (default: read from ``/proc/self/maps`` now).

    Returns:
        Bytes advised (0 where unsupported or where no tensor is file-backed).

    Example:
        >>> release_mapped_pages([torch.zeros(4)])  # an ordinary allocation is never advised
        0
    """
    libc = _libc()
    if libc is None:
        return 0
    ranges = file_backed_ranges() if ranges is None else ranges
    if not ranges:
        return 0
    starts = [r[0] for r in ranges]
    page = mmap.PAGESIZE
    advised = 0
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        begin = t.data_ptr()
        end = begin + t.numel() * t.element_size()
        i = bisect.bisect_right(starts, begin) - 1
        if i < 0 or end > ranges[i][1]:
            continue  # not (entirely) inside one file mapping
        # Whole pages inside the tensor only, so that neighbours keep theirs.
        lo = (begin + page - 1) // page * page
        hi = end // page * page
        if hi <= lo:
            continue
        if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_PAGEOUT) == 0:
            advised += hi - lo
    return advised
