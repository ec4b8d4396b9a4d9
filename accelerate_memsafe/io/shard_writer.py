"""Writes safetensors files from a stream of tensors, off the caller's thread.

The caller opens a file with its :class:`~.safetensors_layout.SafetensorsLayout` (created at its final size,
header first) and hands the tensors over one conversion group at a time (:class:`TensorWrite`: where they
go, and their bytes as a tensor and/or as a :class:`~.mapped_pages.FileExtent`). Writer threads put every
piece at its offset as it arrives, in any order:

- ``io_mode="buffered"`` (default): through the page cache; bytes that lie in a file (a memory-mapped
  checkpoint, a disk offload file) are copied by the kernel (``copy_file_range``: never faulted into this
  process's RSS), the others written from memory (``pwrite``).
- ``io_mode="direct"``: the part of a piece that covers whole 4 KiB blocks of the file is written with
  ``O_DIRECT`` from an aligned buffer, filled by ``pread`` from the file the bytes already lie in or copied
  from memory. The bytes go to the disk without a copy into the page cache (slower on the disks measured:
  every block is copied by this process, and each write waits for the device). The partial blocks at the
  edges go through the page cache (they share a block with a neighbour). Where the file system refuses
  ``O_DIRECT``, the piece is written as in ``"buffered"``.
- ``io_mode="memory"``: every tensor written from memory through the page cache (what ``save_file`` does).

Bytes written through the page cache are handed to the disk right away (``sync_file_range``). When a file is
closed and its last piece written, a syncer thread fsyncs it while the writers go on with the next file:
the flush is off the caller's path, and :meth:`ShardWriter.finish` returns once every file is on disk.

Memory: the caller reserves a group's bytes before reading it (:meth:`ShardWriter.reserve`); the writers
give them back once the group is written. At most ``budget`` bytes are reserved at once (a single group
larger than the budget goes alone), so with a budget of one shard the caller prepares at most one shard
ahead of what is being written. Each writer thread holds one aligned buffer of :data:`DIRECT_BUFFER_BYTES`.

Errors: the first error of any thread, naming the file, is raised in the caller by its next
:meth:`~ShardWriter.reserve` or by :meth:`~ShardWriter.finish`; after an error nothing more is written and
every file descriptor is closed (the caller removes the partial files).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..memory.procfs import malloc_trim
from .mapped_pages import CleanFilePages, FileExtent, file_backed_ranges, libc, release_mapped_pages
from .safetensors_layout import SafetensorsLayout

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Largest single read/write (Linux transfers at most 0x7ffff000 bytes per call).
_MAX_IO = 1 << 30
#: ``copy_file_range`` errors that mean "not between these files" (another file system, an old kernel, a
#: file system without it): the bytes are written from memory instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}
#: Writer threads: filling the buffers is CPU-bound; two keep a disk of about 1 GB/s busy on two cores.
WRITER_THREADS = 2
#: Largest piece of a tensor one writer thread copies at once (big tensors are shared between the threads).
CHUNK_BYTES = 32 * 2**20
_SYNC_FILE_RANGE_WRITE = 2
#: How tensors reach the files (see the module docstring).
IO_MODES = ("direct", "buffered", "memory")
#: The default ``io_mode``: the fastest on the disks measured (benchmarks/offloaded_save.py, docs/benchmarks.md).
DEFAULT_IO_MODE = "buffered"
#: ``O_DIRECT`` alignment of file offsets, lengths and buffers (the file system block; devices need 512 or 4096).
DIRECT_ALIGN = 4096
#: A piece's block-aligned part shorter than this goes through the page cache (one syscall beats three).
DIRECT_MIN_BYTES = 64 * 2**10
#: The aligned buffer of each writer thread.
DIRECT_BUFFER_BYTES = 8 * 2**20
#: What to do with the pages of memory-mapped weights the model holds, once their file is written.
RELEASE_MODES = ("unmap", "pageout", "off")


@dataclass
class TensorWrite:
    """One tensor's bytes and where they go.

    Attributes:
        offset: Absolute offset in the file.
        nbytes: Size.
        tensor: The bytes in memory (contiguous, on cpu), or ``None`` when ``load`` gives them.
        extent: Where the same bytes lie in a file (read from there), or ``None``.
        load: Reads the bytes when ``tensor`` is ``None`` and ``extent`` cannot be read.
    """

    offset: int
    nbytes: int
    tensor: torch.Tensor | None = None
    extent: FileExtent | None = None
    load: Callable[[], torch.Tensor] | None = None


@dataclass
class WriterStats:
    """What a :class:`ShardWriter` did."""

    files: int = 0
    copied_bytes: int = 0
    """Bytes read from the file they already lay in (never faulted into this process through a mapping)."""
    written_bytes: int = 0
    """Bytes written from memory."""
    direct_bytes: int = 0
    """Bytes written with ``O_DIRECT`` (not through the page cache)."""
    released_bytes: int = 0
    """Pages of memory-mapped weights handed back to the kernel."""
    budget_bytes: int = 0
    peak_reserved_bytes: int = 0
    """Most bytes reserved at once (read or being read, not yet written)."""


def sync_file(fd: int, path: Path) -> None:
    """Flushes the finished file ``path`` (open as ``fd``) to disk: the syncer thread's step, one function so
    that tests can inject a failure or a corruption after a file was written."""
    os.fsync(fd)


@functools.cache
def _sync_file_range():
    c = libc()
    fn = getattr(c, "sync_file_range", None) if c is not None else None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Asks the kernel to start writing ``[offset, offset + nbytes)`` to disk now, without waiting (Linux's
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``), so that the fsync of the finished file has little left to
    wait for. A hint: durability still comes from the fsync."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _MAX_IO], offset + done)


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous cpu tensor as a flat ``uint8`` tensor (a view, no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


@dataclass
class _File:
    path: Path
    fd: int
    direct: int | None
    """The same file opened with ``O_DIRECT`` (``None``: not supported here)."""
    pending: int = 0
    """Groups handed over and not written yet."""
    closed: bool = False
    resident: list = field(default_factory=list)
    released: bool = False
    """Its descriptor was closed."""


def _close(file: _File) -> None:
    file.released = True
    os.close(file.fd)
    if file.direct is not None:
        os.close(file.direct)


@dataclass
class _Group:
    file: _File
    remaining: int
    reserved: int
    nbytes: int
    resident: list
    from_memory: bool = False
    """A piece was written from memory (which faults the pages of a mapped tensor into RSS)."""


class ShardWriter:
    """A few writer threads, a syncer thread, and the byte budget between them and the caller.

    Each group's tensors are cut into pieces of at most :data:`CHUNK_BYTES` that the writer threads take from
    one queue, so that big tensors are written by both; a file goes to the syncer once it is closed and its
    last piece is written.

    Args:
        budget: Most bytes the caller may have reserved at once (see :meth:`reserve`).
        io_mode: ``"buffered"`` (default), ``"direct"`` or ``"memory"`` (see the module docstring).
        release_pages: After each file, what to do with the pages of the memory-mapped weights the model
            holds (passed as ``resident`` to :meth:`put`): ``"unmap"`` drops the pages that still hold their
            file's bytes from this process (``MADV_DONTNEED``: no I/O, they stay in the page cache),
            ``"pageout"`` asks the kernel to reclaim every page (``MADV_PAGEOUT``: synchronous, and the pages
            are read from disk again on the next use), ``"off"`` leaves them.
        threads: Writer threads (default :data:`WRITER_THREADS`).
        on_written: Called with the bytes of each group once written (a progress bar), from a writer thread.

    Example:
        >>> # with ShardWriter(10**8) as w:
        >>> #     w.open(path, layout); w.reserve(n); w.put(writes, reserved=n); w.close()
        >>> #     stats = w.finish()
    """

    def __init__(self, budget: int, *, io_mode: str = DEFAULT_IO_MODE, release_pages: str = "unmap",
                 threads: int | None = None, on_written: Callable[[int], None] | None = None) -> None:
        if release_pages not in RELEASE_MODES:
            raise ValueError(f"release_pages={release_pages!r}; choose one of {RELEASE_MODES}.")
        if io_mode not in IO_MODES:
            raise ValueError(f"io_mode={io_mode!r}; choose one of {IO_MODES}.")
        self.stats = WriterStats(budget_bytes=int(budget))
        self._from_files = io_mode != "memory"
        self._kernel_copy = io_mode != "memory" and hasattr(os, "copy_file_range")
        self._direct = io_mode == "direct" and hasattr(os, "O_DIRECT")
        self._release = release_pages
        self._on_written = on_written
        self._cond = threading.Condition()  # guards the budget, the counters of files and groups, the stats
        self._reserved = 0
        self._error: BaseException | None = None
        self._stopping = False
        self._file: _File | None = None
        self._files: list[_File] = []
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._syncs: queue.SimpleQueue = queue.SimpleQueue()
        self._sources: dict[str, int | None] = {}
        self._loading = threading.Lock()
        self._local = threading.local()
        self._ranges = file_backed_ranges() if release_pages == "pageout" else []
        self._workers = [threading.Thread(target=self._run_writer, name=f"memsafe-shard-writer-{i}", daemon=True)
                         for i in range(max(1, threads or WRITER_THREADS))]
        self._syncer = threading.Thread(target=self._run_syncer, name="memsafe-shard-syncer", daemon=True)
        self._started = False

    def __enter__(self) -> ShardWriter:
        for t in (*self._workers, self._syncer):
            t.start()
        self._started = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        for src in self._sources.values():
            if src is not None:
                os.close(src)
        self._sources.clear()

    # -- the caller's side --------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> None:
        """Blocks until ``nbytes`` more fit in the budget (or nothing else is reserved).

        Raises:
            BaseException: The error that stopped a writer or the syncer.
        """
        with self._cond:
            while self._error is None and self._reserved and self._reserved + nbytes > self.stats.budget_bytes:
                self._cond.wait()
            self._raise_if_failed()
            self._reserved += nbytes
            self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self._reserved)

    def open(self, path: str | os.PathLike, layout: SafetensorsLayout) -> None:
        """Creates the file ``path`` with its final size and writes its header; the next groups go there.

        Raises:
            OSError: If the file cannot be created (naming it).
        """
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _CLOEXEC, 0o666)
        try:
            os.ftruncate(fd, layout.size)
            _pwrite_all(fd, memoryview(layout.header), 0)
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        direct = None
        if self._direct:
            try:
                direct = os.open(path, os.O_WRONLY | os.O_DIRECT | _CLOEXEC)
            except OSError:
                self._direct = False  # e.g. tmpfs: through the page cache from now on
        self._file = _File(path, fd, direct)
        self._files.append(self._file)

    def put(self, writes: Sequence[TensorWrite], *, reserved: int, resident: Sequence[torch.Tensor] = (),
            nbytes: int = 0, held: int | None = None) -> None:
        """Hands over one group's tensors; the bytes they hold are given back once they are all written.

        Args:
            writes: Where each tensor goes in the open file.
            reserved: What :meth:`reserve` took for this group (its planned inputs and outputs).
            resident: Tensors the model holds that this group read; if a piece of the group is written from
                memory, their pages are released once the file is written (kernel copies fault none in).
            nbytes: Bytes of the group, for ``on_written``.
            held: The private memory the group really holds until it is written, once read (its new tensors:
                not the model's own, not views of a mapped file); the rest of ``reserved`` goes back to the
                budget now, so that the caller can read the next group while this one is written.
                ``None``: all of ``reserved``.
        """
        pieces = [(w, start) for w in writes for start in range(0, max(w.nbytes, 1), CHUNK_BYTES) if w.nbytes]
        file = self._file
        keep = int(reserved) if held is None else int(held)
        group = _Group(file, len(pieces), keep, int(nbytes), list(resident))
        with self._cond:
            file.pending += 1
            if keep != reserved:
                self._reserved += keep - int(reserved)
                self.stats.peak_reserved_bytes = max(self.stats.peak_reserved_bytes, self._reserved)
                self._cond.notify_all()
        if not pieces:
            self._done(group)
        for w, start in pieces:
            self._items.put((group, w, start))

    def close(self) -> None:
        """Ends the open file; it is fsynced in the background once its last piece is written."""
        file, self._file = self._file, None
        with self._cond:
            file.closed = True
            ready = not file.pending
        if ready:
            self._syncs.put(file)

    def finish(self) -> WriterStats:
        """Waits until every file is written and fsynced.

        Raises:
            BaseException: The first error of a writer or the syncer.
        """
        self._join()
        self._raise_if_failed()
        return self.stats

    def abort(self) -> None:
        """Stops every thread after its current piece and closes every file (nothing more is written)."""
        self._stopping = True
        with self._cond:
            self._cond.notify_all()
        self._join()

    def _join(self) -> None:
        """Ends the writers once the queue is drained, then the syncer once it has every file, then closes what
        is left open."""
        if self._started:
            for _ in self._workers:
                self._items.put(None)
            for t in self._workers:
                t.join()
            self._syncs.put(None)
            self._syncer.join()
            self._started = False
        self._close_leftovers()

    def _close_leftovers(self) -> None:
        """Closes the files no thread will close: after an error or an abort, their pieces were dropped."""
        for file in self._files:
            if not file.released:
                _close(file)
        self._files = []
        self._file = None

    # -- the threads ------------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _fail(self, exc: BaseException, path: Path | None) -> None:
        if isinstance(exc, OSError) and exc.filename is None and path is not None:
            exc = OSError(exc.errno, exc.strerror, str(path))
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _done(self, group: _Group) -> None:
        """One group is written: its bytes go back to the budget; its file may go to the syncer."""
        with self._cond:
            self._reserved -= group.reserved
            group.file.pending -= 1
            if group.from_memory:
                group.file.resident.extend(group.resident)
            group.resident = []
            ready = group.file.closed and not group.file.pending
            self._cond.notify_all()
        if self._on_written is not None:
            self._on_written(group.nbytes)
        if ready:
            self._syncs.put(group.file)

    def _run_writer(self) -> None:
        while (item := self._items.get()) is not None:
            group, w, start = item
            del item
            if self._stopping or self._error is not None:
                continue  # drain: nothing more is written
            try:
                if not self._write(group.file, w, start, min(CHUNK_BYTES, w.nbytes - start)):
                    group.from_memory = True
            except BaseException as exc:  # handed to the caller by reserve() / finish()
                self._fail(exc, group.file.path)
                continue
            del w
            with self._cond:
                group.remaining -= 1
                last = not group.remaining
            if last:
                self._done(group)

    def _run_syncer(self) -> None:
        while (file := self._syncs.get()) is not None:
            try:
                if self._error is None and not self._stopping:
                    self._release_resident(file.resident)
                    file.resident = []
                    sync_file(file.fd, file.path)
                    with self._cond:
                        self.stats.files += 1
                    malloc_trim()
            except BaseException as exc:  # handed to the caller by reserve() / finish()
                self._fail(exc, file.path)
            finally:
                _close(file)

    def _write(self, file: _File, w: TensorWrite, start: int, nbytes: int) -> bool:
        """Writes ``nbytes`` of ``w`` from ``start``; ``True`` if every byte was read from a file."""
        pos = w.offset + start
        lo = -(-pos // DIRECT_ALIGN) * DIRECT_ALIGN
        hi = (pos + nbytes) // DIRECT_ALIGN * DIRECT_ALIGN
        if not (self._direct and file.direct is not None and hi - lo >= DIRECT_MIN_BYTES):
            return self._write_buffered(file.fd, w, start, nbytes)
        # The partial blocks at both edges (shared with the neighbours) through the page cache, the rest direct.
        from_file = True
        for a, b in ((pos, lo), (hi, pos + nbytes)):
            if b > a:
                from_file &= self._write_buffered(file.fd, w, start + a - pos, b - a)
        return self._write_direct(file, w, start + lo - pos, hi - lo) and from_file

    def _write_buffered(self, fd: int, w: TensorWrite, start: int, nbytes: int) -> bool:
        pos = w.offset + start
        copied = (w.extent is not None and self._kernel_copy
                  and self._copy(w.extent.part(start, nbytes), fd, pos))
        if not copied:
            _pwrite_all(fd, memoryview(self._memory(w)[start : start + nbytes].numpy()), pos)
        _start_writeback(fd, pos, nbytes)
        with self._cond:
            if copied:
                self.stats.copied_bytes += nbytes
            else:
                self.stats.written_bytes += nbytes
        return copied

    def _write_direct(self, file: _File, w: TensorWrite, start: int, nbytes: int) -> bool:
        """Writes an aligned range with ``O_DIRECT`` through this thread's aligned buffer."""
        buf, view = self._buffer()
        src = self._source(w.extent) if w.extent is not None and self._from_files else None
        done, from_file = 0, src is not None
        while done < nbytes:
            k = min(len(buf), nbytes - done)
            got = self._read_extent(src, w.extent.offset + start + done, buf[:k]) if from_file else 0
            if got != k:
                from_file = False  # the file is shorter than the extent: from memory
                view[:k].copy_(self._memory(w)[start + done : start + done + k])
            pos = w.offset + start + done
            try:
                _pwrite_all(file.direct, buf[:k], pos)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._direct = False  # alignment this file system does not take: through the page cache
                _pwrite_all(file.fd, buf[:k], pos)
            done += k
        with self._cond:
            self.stats.direct_bytes += nbytes
            if from_file:
                self.stats.copied_bytes += nbytes
            else:
                self.stats.written_bytes += nbytes
        return from_file

    @staticmethod
    def _read_extent(src: int, offset: int, into: memoryview) -> int:
        got = 0
        while got < len(into):
            n = os.preadv(src, [into[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got

    def _memory(self, w: TensorWrite) -> torch.Tensor:
        """The bytes of ``w`` in memory as flat ``uint8`` (loaded once, for every piece, where only the extent
        was given)."""
        if w.tensor is None:
            with self._loading:
                if w.tensor is None:
                    w.tensor = w.load()
        data = _tensor_bytes(w.tensor)
        if len(data) != w.nbytes:
            raise RuntimeError(f"a tensor of {len(data)} bytes was handed over for a {w.nbytes}-byte slot")
        return data

    def _buffer(self) -> tuple[memoryview, torch.Tensor]:
        """This thread's page-aligned buffer (anonymous memory), as a memoryview and as a uint8 tensor."""
        local = self._local
        if getattr(local, "buf", None) is None:
            # private anonymous memory (counted in RssAnon), page-aligned as O_DIRECT needs
            local.map = mmap.mmap(-1, DIRECT_BUFFER_BYTES, flags=mmap.MAP_PRIVATE)
            local.buf = memoryview(local.map)
            local.view = torch.frombuffer(local.map, dtype=torch.uint8)
        return local.buf, local.view

    def _source(self, extent: FileExtent) -> int | None:
        """A descriptor of ``extent``'s file, if it still is the file the extent was taken from."""
        with self._loading:
            if extent.path not in self._sources:
                fd = None
                try:
                    fd = os.open(extent.path, os.O_RDONLY | _CLOEXEC)
                    if os.fstat(fd).st_ino != extent.ino:
                        os.close(fd)
                        fd = None
                except OSError:
                    fd = None
                self._sources[extent.path] = fd
            return self._sources[extent.path]

    def _copy(self, extent: FileExtent, fd: int, offset: int) -> bool:
        """Copies ``extent`` to ``offset`` in the kernel; ``False`` where it cannot (written from memory then)."""
        src = self._source(extent)
        if src is None:
            return False
        done = 0
        try:
            while done < extent.nbytes:
                n = os.copy_file_range(src, fd, min(extent.nbytes - done, _MAX_IO), extent.offset + done, offset + done)
                if n == 0:
                    return False  # the file is shorter than the extent: read from memory
                done += n
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            self._kernel_copy = False  # e.g. another file system: not tried again in this save
            return False
        return True

    def _release_resident(self, tensors: list[torch.Tensor]) -> None:
        if not tensors or self._release == "off":
            return
        if self._release == "pageout":
            released = release_mapped_pages(tensors, self._ranges)
        else:
            clean = CleanFilePages(tensors)
            released = sum(clean.drop(t) for t in tensors)
        with self._cond:
            self.stats.released_bytes += released
