"""Plain readers of the process's memory counters in ``/proc/self``.

RSS counts file-backed pages (mmap'ed checkpoints) as well as private memory; ``RssAnon`` counts only
private (anonymous) memory, which is what an out-of-memory kill is about. Both are reported because
transformers 5.x loads weights as zero-copy views of a memory-mapped file.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

from ..io.mapped_pages import libc as _c_library

_STATUS = "/proc/self/status"


@dataclass(frozen=True)
class ProcMemory:
    """One reading of the process memory counters, in bytes."""

    rss: int
    anon: int
    hwm: int


def read_proc_memory() -> ProcMemory | None:
    """Reads VmRSS, RssAnon and VmHWM of this process.

    Returns:
        The counters in bytes, or ``None`` where ``/proc`` is not available (macOS, Windows).

    Example:
        >>> mem = read_proc_memory()
        >>> mem is None or mem.rss > 0
        True
    """
    try:
        with open(_STATUS, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    if "VmRSS" not in values:
        return None
    return ProcMemory(rss=values["VmRSS"], anon=values.get("RssAnon", values["VmRSS"]), hwm=values.get("VmHWM", 0))


_STATM: dict[str, int] = {}  # the open /proc/self/statm of this process (by pid: a forked child reopens it)


def read_rss_anon() -> tuple[int, int] | None:
    """``(VmRSS, RssAnon)`` in bytes from ``/proc/self/statm`` (resident and shared pages: RssAnon is their
    difference), with one ``pread`` of a file kept open: about 2 µs against 30 µs for :func:`read_proc_memory`,
    which is what a 2 ms sampling thread pays on every sample.

    Returns:
        The two counters, or ``None`` where ``/proc`` is not available.

    Example:
        >>> got = read_rss_anon()
        >>> got is None or got[0] >= got[1] > 0
        True
    """
    pid = str(os.getpid())
    try:
        fd = _STATM.get(pid)
        if fd is None:
            _STATM.clear()
            fd = _STATM[pid] = os.open("/proc/self/statm", os.O_RDONLY)
        fields = os.pread(fd, 256, 0).split()
        resident, shared = int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None
    return resident * _PAGE, (resident - shared) * _PAGE


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def read_probe_memory() -> ProcMemory | None:
    """VmRSS and RssAnon as :func:`read_rss_anon` reads them, and the process's peak RSS from ``getrusage``
    (``ru_maxrss``): two system calls, not a read of the whole ``/proc/self/status``, which the kernel formats
    line by line (about 30 µs, at both ends of every probe).

    ``ru_maxrss`` is ``VmHWM`` as long as nothing resets the mark (the plugin never does): after a
    :func:`reset_peak_rss` it may stay at an earlier peak, so it only ever *rises* when a new high-water mark is
    set, which is all a probe asks of it (whether the region set a new peak, and how high). Benchmarks that reset
    the mark read :func:`read_proc_memory`.

    Example:
        >>> mem = read_probe_memory()
        >>> mem is None or min(mem.hwm, mem.rss, mem.anon) > 0
        True
    """
    counters = read_rss_anon()
    if counters is None:
        return None
    return ProcMemory(rss=counters[0], anon=counters[1], hwm=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``).

    Returns:
        Whether the kernel accepted the reset.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def malloc_trim() -> None:
    """Returns glibc's freed heap to the kernel so that RSS reflects what is really alive.

    A no-op where glibc is not the allocator.
    """
    libc = _c_library()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
