"""Plain readers of the process's memory counters in ``/proc/self``.

RSS counts file-backed pages (mmap'ed checkpoints) as well as private memory; ``RssAnon`` counts only
private (anonymous) memory, which is what an out-of-memory kill is about. Both are reported because
transformers 5.x loads weights as zero-copy views of a memory-mapped file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

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
    name = ctypes.util.find_library("c")
    if not name or os.name != "posix":
        return
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return
