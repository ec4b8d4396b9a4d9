"""How much CPU memory this process may still use: the host's ``MemAvailable`` or, tighter, a control
group's limit (a container's ``memory.max``), whichever leaves less.

A pod is OOM-killed at its cgroup limit, whatever the host has free; a rank is killed when the ranks of
its node *together* pass the limit. The preflight check therefore compares the sum of the estimates of
the ranks that share a limit with :func:`cpu_memory_limit`, and names the limit it compared against.

Both cgroup versions are read: v2 (``memory.max``, ``memory.current``, ``inactive_file`` of
``memory.stat``) and v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``total_inactive_file``).
Every level from the process's own group up to the root is checked (a parent's limit binds its
children). Inactive file pages count as free: the kernel reclaims them before it OOM-kills.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: cgroup v1 writes this (or a value near it) for "no limit"; anything above it is treated as none.
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class CpuLimit:
    """The CPU memory this process can still use, and which limit that is."""

    available: int
    """Bytes."""
    source: str
    """``"MemAvailable of the host"`` or ``"cgroup memory.max of <dir> (limit X GiB)"``."""
    key: str
    """Identifies the limit: processes with the same key share it (the host name, plus the cgroup)."""


def _read_int(path: Path) -> int | None:
    try:
        with open(path, "rb") as f:
            text = f.read().decode("ascii", "replace").strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat_value(path: Path, keys: tuple[str, ...]) -> int:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    values = dict(line.split()[:2] for line in lines if len(line.split()) >= 2)
    for key in keys:
        if key in values:
            return int(values[key])
    return 0


def _levels(leaf: Path, mount: Path) -> list[Path]:
    """``leaf`` and each of its parents up to ``mount`` (inclusive)."""
    out, d = [], leaf
    while True:
        out.append(d)
        if d == mount or mount not in d.parents:
            return out
        d = d.parent


def _group_dirs(proc_cgroup: Path, root: Path) -> list[tuple[str, Path]]:
    """The (version, directory) of this process's memory cgroup, for each version mounted under ``root``."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "" and (root / "cgroup.controllers").exists():  # the unified (v2) hierarchy
            found.append(("v2", root / rel if (root / rel).is_dir() else root))
        elif "memory" in controllers.split(","):
            mount = root / "memory"
            found.append(("v1", mount / rel if (mount / rel).is_dir() else mount))  # a container sees its group as the mount
    return found


@dataclass(frozen=True)
class _Level:
    """One cgroup directory that may hold a memory limit binding this process, and the files to read there."""

    directory: Path
    limit: Path
    usage: Path
    stat: Path
    keys: tuple[str, ...]


def _discover(proc_cgroup: Path, root: Path) -> list[_Level]:
    out = []
    for version, leaf in _group_dirs(proc_cgroup, root):
        mount = root if version == "v2" else root / "memory"
        for d in _levels(leaf, mount):
            if version == "v2":
                out.append(_Level(d, d / "memory.max", d / "memory.current", d / "memory.stat", ("inactive_file",)))
            else:
                out.append(_Level(d, d / "memory.limit_in_bytes", d / "memory.usage_in_bytes", d / "memory.stat",
                                  ("total_inactive_file", "inactive_file")))
    return out


# the directories of this process's own groups (by pid: a forked child may be moved): where the limits are is found
# once, what they are is read at every call
_OWN_LEVELS: dict[int, list[_Level]] = {}
_OWN = (Path("/proc/self/cgroup"), Path("/sys/fs/cgroup"))


def find_own_groups() -> None:
    """Looks up, once per process, where this process's cgroups and their parents are (:func:`cgroup_limits` reads
    their limits at every call): called when a memsafe accelerator is built, so that the first hook does not pay
    for it. Never raises."""
    try:
        cgroup_limits()
    except Exception:
        pass


def cgroup_limits(proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                  root: str | os.PathLike = "/sys/fs/cgroup") -> list[tuple[Path, int, int]]:
    """Every memory limit that binds this process: ``(directory, limit, usage)`` in bytes, where usage
    leaves out the inactive file pages the kernel would reclaim first.

    The groups of this process and their parents are looked up once per process; their limits and usage are read
    at every call (the preflight asks at every hook), the usage and the long ``memory.stat`` only under a limit.

    Example:
        >>> cgroup_limits("/nonexistent")
        []
    """
    key = (Path(proc_cgroup), Path(root))
    if key == _OWN:
        levels = _OWN_LEVELS.get(os.getpid())
        if levels is None:
            _OWN_LEVELS.clear()
            levels = _OWN_LEVELS[os.getpid()] = _discover(*key)
    else:
        levels = _discover(*key)
    out = []
    for level in levels:
        limit = _read_int(level.limit)
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = _read_int(level.usage)
        if usage is not None:
            out.append((level.directory, limit, max(0, usage - _stat_value(level.stat, level.keys))))
    return out


def _mem_available() -> int:
    """The host's ``MemAvailable`` (one line of ``/proc/meminfo``; ``psutil`` where there is none)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    return psutil.virtual_memory().available


def cpu_memory_limit(host_available: int | None = None, *, proc_cgroup: str | os.PathLike = "/proc/self/cgroup",
                     root: str | os.PathLike = "/sys/fs/cgroup", hostname: str | None = None) -> CpuLimit:
    """The tightest of the host's ``MemAvailable`` and every cgroup limit of this process.

    Args:
        host_available: The host's available bytes (``None``: read with ``psutil``).
        proc_cgroup, root: Where to read the process's groups and the cgroup file system (tests).
        hostname: The node's name (``None``: this host's).

    Example:
        >>> cpu_memory_limit(8 << 30, proc_cgroup="/nonexistent").source
        'MemAvailable of the host'
    """
    import socket

    if host_available is None:
        host_available = _mem_available()
    node = hostname or socket.gethostname()
    best = CpuLimit(host_available, "MemAvailable of the host", node)
    for d, limit, usage in cgroup_limits(proc_cgroup, root):
        free = max(0, limit - usage)
        if free < best.available:
            name = "memory.max" if (d / "memory.max").exists() else "memory.limit_in_bytes"
            best = CpuLimit(free, f"cgroup {name} of {d} (limit {limit / 2**30:.2f} GiB, "
                                  f"{usage / 2**30:.2f} GiB in use)", f"{node}:{d}")
    return best
