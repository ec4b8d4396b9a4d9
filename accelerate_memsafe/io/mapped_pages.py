"""Pages of memory-mapped weights: which still hold the file's bytes, and giving resident ones back.

transformers 5.x loads cpu-resident weights as views of a memory-mapped checkpoint file: reading them to
save them faults their pages in, and they stay in the process's RSS (file-backed, not private) for as long
as the model lives. After a shard is written we ask the kernel to reclaim exactly those pages with
``madvise(MADV_PAGEOUT)``. That is only a hint and never loses data: clean file pages are dropped and
re-read from the file on the next access, and pages a process modified are private memory the kernel
keeps (or swaps). Memory that is not file-backed (tensors in ordinary allocations) is never advised, so a
model trained in memory is not pushed to swap.

A weight loaded that way keeps its address when written in place (the mapping is copy-on-write), so an
address inside the file mapping does not prove the bytes are the file's: :func:`unmodified_file_pages`
asks ``/proc/self/pagemap`` which pages are still the file's own; where they all are, the tensor's bytes
can be taken from the file itself (:func:`file_extents`: the offloaded save reads them from there, so
they never fault into this process). This module is the package's one place that inspects pages
(``/proc/self/maps``, ``/proc/self/pagemap``, ``madvise``).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

_MADV_PAGEOUT = 21
_MADV_DONTNEED = 4
_MAPS = "/proc/self/maps"
_PAGEMAP = "/proc/self/pagemap"
# /proc/self/pagemap: one little-endian u64 per virtual page (Documentation/admin-guide/mm/pagemap.rst)
_PM_PRESENT = 1 << 63
_PM_SWAP = 1 << 62
_PM_FILE = 1 << 61  # file page or shared anonymous page; clear on a private copy-on-write copy
#: Spans closer than this many pages are scanned as one range (holes between them read as zeros).
_MERGE_GAP_PAGES = 1 << 14
#: Pages whose pagemap entries are read and reduced at once (64 MiB of mapping: about 1 MiB of arrays).
SCAN_WINDOW_PAGES = 1 << 14


def _regular_file(path: str, real: dict[str, str | None], *, resolve: bool) -> str | None:
    """The path of a mapping's file as callers get it (through ``os.path.realpath`` with ``resolve``), or ``None``
    for what is not a regular file that exists: ``[heap]``, anonymous or deleted files, device files. ``real``
    caches the answer per path (one stat per file, not per mapping: a ``.so`` has several)."""
    if not path.startswith("/") or path.endswith("(deleted)"):
        return None
    if path not in real:
        real[path] = (os.path.realpath(path) if resolve else path) if os.path.isfile(path) else None
    return real[path]


def _parse_maps(path_suffix: str = "", *, resolve: bool = True) -> list[tuple[int, int, int, str, int]]:
    """``(start, end, file_offset, path, inode)`` of the regular-file mappings (see :func:`file_mappings`)."""
    out = []
    real: dict[str, str | None] = {}  # one stat per file, not per mapping (a .so has several)
    suffix = path_suffix.encode()
    try:
        with open(_MAPS, "rb") as f:  # one read: the kernel writes the whole table (a few ms with ~1000 mappings)
            lines = f.read().split(b"\n")
        for raw in lines:
            raw = raw.rstrip()
            if not raw.endswith(suffix):  # before splitting: most lines are other files
                continue
            parts = raw.decode("utf-8", "replace").split(maxsplit=5)
            if len(parts) < 6:
                continue  # anonymous mapping
            path = _regular_file(parts[5], real, resolve=resolve)
            if path is None:
                continue
            start, _, end = parts[0].partition("-")
            out.append((int(start, 16), int(end, 16), int(parts[2], 16), path, int(parts[4])))
    except (OSError, ValueError):
        return []
    out.sort()
    return out


def file_mappings(path_suffix: str = "", *, resolve: bool = True) -> list[tuple[int, int, int, str]]:
    """The mappings of regular files in this process whose path ends with ``path_suffix``.

    Never ``[heap]``, ``[stack]``, anonymous memory, memfd, device files or deleted files: anonymous
    memory is where ``MADV_DONTNEED`` would zero data instead of dropping clean file pages.

    Args:
        path_suffix: Keep only paths ending with it (``""``: every regular file).
        resolve: Give each path through ``os.path.realpath`` (a few ``lstat`` per file; off where
            only the address ranges matter).

    Returns:
        ``(start, end, file_offset, path)`` per mapping, in address order; empty where ``/proc`` is
        unavailable.

    Example:
        >>> all(lo < hi for lo, hi, _, _ in file_mappings(".so"))
        True
    """
    return [m[:4] for m in _parse_maps(path_suffix, resolve=resolve)]


class _ProcmapQuery(ctypes.Structure):
    """``struct procmap_query`` of ``linux/fs.h`` (Linux >= 6.11)."""

    _fields_ = [("size", ctypes.c_uint64), ("query_flags", ctypes.c_uint64), ("query_addr", ctypes.c_uint64),
                ("vma_start", ctypes.c_uint64), ("vma_end", ctypes.c_uint64), ("vma_flags", ctypes.c_uint64),
                ("vma_page_size", ctypes.c_uint64), ("vma_offset", ctypes.c_uint64), ("inode", ctypes.c_uint64),
                ("dev_major", ctypes.c_uint32), ("dev_minor", ctypes.c_uint32), ("vma_name_size", ctypes.c_uint32),
                ("build_id_size", ctypes.c_uint32), ("vma_name_addr", ctypes.c_uint64),
                ("build_id_addr", ctypes.c_uint64)]


#: ``_IOWR('f', 17, struct procmap_query)``; the query accepts only a VMA that is file-backed and covers the address.
_PROCMAP_QUERY = (3 << 30) | (ctypes.sizeof(_ProcmapQuery) << 16) | (ord("f") << 8) | 17
_PROCMAP_QUERY_FILE_BACKED_VMA = 0x20
_MAPS_FD: dict[int, int | None] = {}  # pid -> the open /proc/self/maps for the query, None where it is refused
_PAGEMAP_FD: dict[int, int | None] = {}  # pid -> the open /proc/self/pagemap for PAGEMAP_SCAN, None where refused


def _query_mapping(fd: int, addr: int, name: ctypes.Array) -> tuple[int, int, int, str] | None | bool:
    """``(start, end, offset, name)`` of the file-backed mapping covering ``addr``; ``None`` when no
    file-backed mapping covers it; ``False`` when the kernel has no ``PROCMAP_QUERY``."""
    import errno
    import fcntl

    q = _ProcmapQuery(size=ctypes.sizeof(_ProcmapQuery), query_flags=_PROCMAP_QUERY_FILE_BACKED_VMA, query_addr=addr,
                      vma_name_size=len(name), vma_name_addr=ctypes.addressof(name))
    try:
        fcntl.ioctl(fd, _PROCMAP_QUERY, q)
    except OSError as exc:
        return None if exc.errno == errno.ENOENT else False
    return q.vma_start, q.vma_end, q.vma_offset, name.value.decode("utf-8", "replace")


def file_mappings_at(addresses: Iterable[int], path_suffix: str = "", *, resolve: bool = True
                     ) -> list[tuple[int, int, int, str]]:
    """The mappings of :func:`file_mappings` (regular files whose path ends with ``path_suffix``) that contain
    at least one of ``addresses``, in the same form and order.

    Asks the kernel for each mapping with one ``PROCMAP_QUERY`` ioctl (Linux >= 6.11: the addresses of a model's
    weights mostly share a few mappings, so a few queries) instead of reading the whole ``/proc/self/maps``,
    which the kernel writes out as text for every mapping of the process (about a millisecond for the thousand
    mappings of a process with torch loaded). Where the ioctl is not available, it is :func:`file_mappings`
    (every matching mapping: a superset that callers look addresses up in the same way).

    Example:
        >>> file_mappings_at([torch.ones(4).data_ptr()])  # anonymous memory maps no file
        []
    """
    pid = os.getpid()
    fd = _maps_fd()
    if fd is None:
        return file_mappings(path_suffix, resolve=resolve)
    name = ctypes.create_string_buffer(4096)
    out: dict[int, tuple[int, int, int, str]] = {}
    real: dict[str, str | None] = {}
    lo = hi = 0  # the last mapping seen (matching or not): addresses inside it need no query
    for addr in sorted(set(addresses)):
        if lo <= addr < hi:
            continue
        got = _query_mapping(fd, addr, name)
        if got is False:
            _MAPS_FD[pid] = None
            return file_mappings(path_suffix, resolve=resolve)
        if got is None:
            lo, hi = addr, addr + 1
            continue
        lo, hi, offset, path = got
        path = _regular_file(path, real, resolve=resolve) if path.endswith(path_suffix) else None
        if path is not None:
            out[lo] = (lo, hi, offset, path)
    return [out[k] for k in sorted(out)]


def file_backed_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process that map regular files (from ``/proc/self/maps``), sorted.

    Returns:
        ``[(start, end), ...]``; empty where ``/proc`` is not available.
    """
    return [(lo, hi) for lo, hi, _, _ in file_mappings(resolve=False)]


def check_kernel_support() -> None:
    """Runs, once per process, the checks of what this kernel's pagemap reports (:func:`unmodified_file_pages` asks
    them at its first call) and opens ``/proc/self/maps`` for :func:`file_mappings_at`: called when a multi-process
    memsafe accelerator is built, so that the first ``prepare`` does not pay for them (and opens ``/proc/self/pagemap``
    for :func:`unmodified_file_pages`' scans). Never raises."""
    _pagemap_reports_private_writes()
    _scan_reports_private_writes()
    libc()
    _maps_fd()
    _pagemap_fd()


def _pagemap_fd() -> int | None:
    """This process's open ``/proc/self/pagemap`` for the ``PAGEMAP_SCAN`` queries (``None`` where it cannot be
    opened), opened once per process."""
    return _open_once(_PAGEMAP, _PAGEMAP_FD)


def _maps_fd() -> int | None:
    """This process's open ``/proc/self/maps`` (``None`` where it cannot be opened), opened once per process."""
    return _open_once(_MAPS, _MAPS_FD)


def _open_once(path: str, cache: dict[int, int | None]) -> int | None:
    """``path`` opened read-only once per process (``cache`` is keyed by pid: a forked child opens its own, its
    ``/proc/self`` being another process's), or ``None`` where it cannot be opened."""
    pid = os.getpid()
    if pid not in cache:
        try:
            cache.clear()
            cache[pid] = os.open(path, os.O_RDONLY)
        except OSError:
            cache[pid] = None
    return cache[pid]


@functools.cache
def _pagemap_reports_private_writes() -> bool:
    """Whether this kernel's pagemap shows a page this process wrote as present and not a file page.

    Checked once on a page of our own: a kernel or sandbox without a working pagemap (entries all zero,
    file missing, permission refused) must never make a written page look unmodified.
    """
    page = mmap.PAGESIZE
    probe = bytearray(2 * page)
    base = ctypes.addressof((ctypes.c_char * len(probe)).from_buffer(probe))
    addr = (base + page - 1) // page * page  # the page-aligned page inside the probe
    probe[addr - base] = 1
    entries = _pagemap_entries(addr // page, addr // page + 1)
    if entries is None:
        return False
    e = int(entries[0]) & (2**64 - 1)
    return bool(e & _PM_PRESENT) and not e & _PM_FILE


def _pagemap_entries(first: int, last: int) -> torch.Tensor | None:
    """The pagemap entries of virtual pages ``[first, last)`` (int64; bit 63 is the sign), or ``None``."""
    want = 8 * (last - first)
    buf = bytearray(want)
    view = memoryview(buf)
    try:
        fd = os.open(_PAGEMAP, os.O_RDONLY)
    except OSError:
        return None
    try:
        got = 0
        while got < want:
            n = os.preadv(fd, [view[got:]], 8 * first + got)
            if n <= 0:
                return None
            got += n
    except OSError:
        return None
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.int64) if want else torch.zeros(0, dtype=torch.int64)


def _written_before(lo: int, hi: int, points: set[int]) -> dict[int, int] | None:
    """For each page number in ``points`` (within ``[lo, hi]``), how many pages of ``[lo, point)`` were written
    (present without the file bit, or swapped out); ``None`` when the pagemap cannot be read.

    The pagemap is read ``SCAN_WINDOW_PAGES`` at a time, so the arrays it takes are bounded (the entries, the
    masks, the prefix sum: about 54 bytes per page of one window) whatever the mapping's size.
    """
    todo = sorted(points)
    out: dict[int, int] = {}
    carry, k = 0, 0
    for w0 in range(lo, hi, SCAN_WINDOW_PAGES):
        w1 = min(hi, w0 + SCAN_WINDOW_PAGES)
        entries = _pagemap_entries(w0, w1)
        if entries is None:
            return None
        written = ((entries & _PM_SWAP) != 0) | ((entries < 0) & ((entries & _PM_FILE) == 0))
        seen = torch.zeros(len(written) + 1, dtype=torch.int64)
        seen[1:] = torch.cumsum(written, 0)
        while k < len(todo) and todo[k] <= w1:
            out[todo[k]] = carry + int(seen[todo[k] - w0])
            k += 1
        carry += int(seen[-1])
        del entries, written, seen
    return out


class _PageRegion(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _PmScanArg(ctypes.Structure):
    """``struct pm_scan_arg`` of ``linux/fs.h`` (``PAGEMAP_SCAN``, Linux >= 6.7)."""

    _fields_ = [(n, ctypes.c_uint64) for n in ("size", "flags", "start", "end", "walk_end", "vec", "vec_len",
                                               "max_pages", "category_inverted", "category_mask",
                                               "category_anyof_mask", "return_mask")]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_PmScanArg) << 16) | (ord("f") << 8) | 16
_PAGE_IS_FILE, _PAGE_IS_PRESENT, _PAGE_IS_SWAPPED = 1 << 2, 1 << 3, 1 << 4
#: The two kinds of written page, as ``(category_inverted, category_mask)``: present and not a file page (a
#: private copy-on-write copy), and swapped out (only private memory is swapped).
_WRITTEN_KINDS = ((_PAGE_IS_FILE, _PAGE_IS_PRESENT | _PAGE_IS_FILE), (0, _PAGE_IS_SWAPPED))


def _scan_written(lo: int, hi: int) -> list[tuple[int, int]] | None:
    """The page ranges ``[first, last)`` of ``[lo, hi)`` (page numbers) that were written, as
    :func:`_written_before` counts them, found by the kernel (``PAGEMAP_SCAN``: no entry of an unwritten page
    is copied out, where the pagemap file gives 8 bytes for every page); ``None`` where the ioctl is refused."""
    import fcntl

    page = mmap.PAGESIZE
    vec = (_PageRegion * 64)()
    out: list[tuple[int, int]] = []
    fd = _pagemap_fd()
    if fd is None:
        return None
    try:
        for inverted, mask in _WRITTEN_KINDS:
            start = lo * page
            while start < hi * page:
                arg = _PmScanArg(size=ctypes.sizeof(_PmScanArg), start=start, end=hi * page,
                                 vec=ctypes.addressof(vec), vec_len=len(vec), category_inverted=inverted,
                                 category_mask=mask, return_mask=mask)
                n = fcntl.ioctl(fd, _PAGEMAP_SCAN, arg)
                out += [(vec[i].start // page, vec[i].end // page) for i in range(n)]
                if arg.walk_end <= start:
                    return None  # no progress: do not trust it
                start = arg.walk_end
    except OSError:
        return None
    return sorted(out)


@functools.cache
def _scan_reports_private_writes() -> bool:
    """Whether ``PAGEMAP_SCAN`` works here and tells a written page of a private file mapping from a page that
    is still the file's: checked once on a mapping of our own (a kernel without the ioctl, or one that would
    report a written page as the file's, falls back to reading the pagemap)."""
    import tempfile

    page = mmap.PAGESIZE
    try:
        with tempfile.TemporaryFile() as f:
            f.write(b"\1" * (3 * page))
            f.flush()
            mm = mmap.mmap(f.fileno(), 3 * page, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            view = (ctypes.c_char * (3 * page)).from_buffer(mm)
            base = ctypes.addressof(view) // page
            _ = mm[0], mm[2 * page]  # pages 0 and 2 read (the file's), page 1 written (a private copy)
            mm[page] = 2
            got = _scan_written(base, base + 3)
            del view
        finally:
            mm.close()
    except (OSError, ValueError, BufferError):
        return False
    return got == [(base + 1, base + 2)]


def unmodified_file_pages(spans: Sequence[tuple[int, int]], maps: Sequence[tuple[int, int, int, str]] | None = None) -> list[bool]:
    """Whether each address range ``[begin, end)`` still holds exactly the bytes of the file it maps.

    An in-place write to a private (copy-on-write) file mapping keeps the address: the written page
    becomes a private anonymous copy. ``/proc/self/pagemap`` tells the two apart (one u64 per page: bit
    63 present, bit 62 swapped, bit 61 file page). A range qualifies only if every page it touches, the
    partial pages at its edges included, is either not present (the next access reads the file) or
    present as a file page. A written page (present without bit 61, or swapped out) disqualifies it, even
    when another tensor sharing the page was written; so does a range that is not inside one mapping of
    a regular file (anonymous memory holds no file's bytes, touched or not).

    Nothing qualifies where pagemap cannot be read or does not report a written page as such (not Linux,
    no permission, a sandbox kernel): callers then read from memory, which is always correct. Ranges
    that lie close together are scanned as one range, ``SCAN_WINDOW_PAGES`` at a time: the memory this takes
    is bounded (about 1 MiB), whatever the size of the mapping.

    Args:
        spans: Byte ranges of this process's memory, e.g. ``(t.data_ptr(), t.data_ptr() + t.nbytes)``.
        maps: The file mappings to accept spans in (:func:`file_mappings`, e.g. of the ``.safetensors`` files
            only, already read by the caller); ``None``: every regular file's, read here.

    Returns:
        One flag per span, in order (``False`` for an empty span).

    Example:
        >>> buf = torch.ones(4096)  # anonymous memory that was written: never unmodified file pages
        >>> unmodified_file_pages([(buf.data_ptr(), buf.data_ptr() + buf.nbytes)])
        [False]
    """
    out = [False] * len(spans)
    if not spans or not _pagemap_reports_private_writes():
        return out
    maps = file_mappings(resolve=False) if maps is None else maps
    starts = [lo for lo, _, _, _ in maps]

    def in_one_file_mapping(begin: int, end: int) -> bool:
        k = bisect.bisect_right(starts, begin) - 1
        return k >= 0 and end <= maps[k][1]

    page = mmap.PAGESIZE
    pages = [(b // page, (e + page - 1) // page, i) for i, (b, e) in enumerate(spans) if e > b and in_one_file_mapping(b, e)]
    pages.sort()
    run: list[tuple[int, int, int]] = []
    run_end = 0
    for k, item in enumerate(pages):
        run.append(item)
        run_end = max(run_end, item[1])
        nxt = pages[k + 1] if k + 1 < len(pages) else None
        if nxt is not None and nxt[0] <= run_end + _MERGE_GAP_PAGES:
            continue
        written = _scan_written(run[0][0], run_end) if _scan_reports_private_writes() else None
        if written is not None:  # the kernel's list of written page ranges (usually none)
            ends = [b for _, b in written]
            for f, last, i in run:  # the first written range ending after f must start at or after last
                k = bisect.bisect_right(ends, f)
                out[i] = k == len(written) or written[k][0] >= last
        else:
            seen = _written_before(run[0][0], run_end, {p for f, last, _ in run for p in (f, last)})
            if seen is not None:
                for f, last, i in run:
                    out[i] = seen[last] == seen[f]
        run, run_end = [], 0
    return out


@dataclass(frozen=True)
class FileExtent:
    """``nbytes`` bytes at ``offset`` of the regular file ``path`` (inode ``ino``): where a tensor's bytes can be
    read from the file instead of through a memory mapping of it."""

    path: str
    offset: int
    nbytes: int
    ino: int

    def part(self, start: int, nbytes: int) -> FileExtent:
        """The ``nbytes`` bytes from ``start`` (relative to this extent)."""
        if start < 0 or start + nbytes > self.nbytes:
            raise ValueError(f"[{start}, {start + nbytes}) is not inside an extent of {self.nbytes} bytes")
        return FileExtent(self.path, self.offset + start, nbytes, self.ino)


def file_extents(tensors: Sequence[torch.Tensor]) -> list[FileExtent | None]:
    """Where in a file each tensor's bytes lie, for CPU tensors that are contiguous views of a file mapping
    whose pages all still hold the file's bytes (:func:`unmodified_file_pages`).

    A tensor in anonymous memory, one with a written page, one whose file was deleted, or one whose path
    now names another file (another inode) gets ``None``: its bytes must be read from memory. One read of
    ``/proc/self/maps`` and of the pagemap for all tensors.

    Args:
        tensors: CPU tensors, e.g. the cpu-resident weights transformers maps from a checkpoint.

    Returns:
        One extent or ``None`` per tensor, in order.

    Example:
        >>> file_extents([torch.ones(4096)])  # anonymous memory
        [None]
    """
    spans, where = [], []
    for i, t in enumerate(tensors):
        if t.device.type == "cpu" and t.is_contiguous() and t.numel():
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
            where.append(i)
    out: list[FileExtent | None] = [None] * len(tensors)
    if not spans:
        return out
    clean = unmodified_file_pages(spans)
    maps = _parse_maps(resolve=False)
    starts = [m[0] for m in maps]
    inodes: dict[str, int | None] = {}
    for i, (begin, end), ok in zip(where, spans, clean):
        k = bisect.bisect_right(starts, begin) - 1
        if not ok or k < 0 or end > maps[k][1]:
            continue
        lo, _, offset, path, ino = maps[k]
        if path not in inodes:
            try:
                inodes[path] = os.stat(path).st_ino
            except OSError:
                inodes[path] = None
        if inodes[path] == ino:
            out[i] = FileExtent(path, offset + begin - lo, end - begin, ino)
    return out


@functools.cache
def libc():
    """The C library with ``madvise``'s argument types set (loaded once), or ``None`` where there is none: the
    symbols this process already has (``dlopen(NULL)``, no lookup), else what ``find_library`` names (which runs
    ``ldconfig -p`` in a subprocess, a millisecond or more). The package's one loader of it."""
    if os.name != "posix":
        return None
    for find in (lambda: None, lambda: ctypes.util.find_library("c")):
        try:
            name = find()
            c = ctypes.CDLL(name, use_errno=True)
            c.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            return c
        except (OSError, AttributeError, TypeError):
            continue
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
    c = libc()
    if c is None:
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
        if c.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_PAGEOUT) == 0:
            advised += hi - lo
    return advised


class CleanFilePages:
    r"""Drops tensors' whole pages from this process's RSS once they have been read, where that is safe.

    Built over the tensors that will be released; which of them still hold exactly their file's bytes
    (views of a file mapping with no written page, see :func:`unmodified_file_pages`) is decided once,
    here, with one pagemap read. :meth:`drop` then ``madvise(MADV_DONTNEED)``\ s the whole pages of a
    clean tensor (the next access re-reads the file) and leaves every other tensor alone: on a private
    mapping DONTNEED would silently revert a write, which must never happen to a user's edited weights.

    Example:
        >>> t = torch.ones(8192)  # anonymous memory: never dropped
        >>> CleanFilePages([t]).drop(t)
        0
    """

    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        spans, ids = [], []
        for t in tensors:
            if t.device.type == "cpu" and t.is_contiguous() and t.numel():
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
                ids.append(id(t))
        flags = unmodified_file_pages(spans) if spans else []
        self._clean = {i for i, ok in zip(ids, flags) if ok}

    def drop(self, t: torch.Tensor) -> int:
        """Drops ``t``'s whole pages if it was clean when this object was built; returns the bytes dropped."""
        if id(t) not in self._clean:
            return 0
        self._clean.discard(id(t))
        return drop_pages(t)


def drop_pages(t: torch.Tensor) -> int:
    """``madvise(MADV_DONTNEED)`` of the whole pages inside ``t`` (neighbours keep theirs): they leave this
    process's RSS, and the next access reads the file again. Only for a view of a file mapping that was never
    written (on a private mapping DONTNEED reverts a write); returns the bytes dropped.

    Example:
        >>> drop_pages(torch.empty(0))
        0
    """
    c = libc()
    page = mmap.PAGESIZE
    begin = t.data_ptr()
    lo, hi = (begin + page - 1) // page * page, (begin + t.numel() * t.element_size()) // page * page
    if c is None or hi <= lo:
        return 0
    return hi - lo if c.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED) == 0 else 0
