"""The one place that reads environment variables.

``ACCELERATE_MEMSAFE_<OPTION>`` carries each plugin option (written by ``accelerate-memsafe launch``);
the launcher variables (``WORLD_SIZE``, ``LOCAL_RANK``, ``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``) say how
the process was started.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "ACCELERATE_MEMSAFE_"


def memsafe_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Returns the ``ACCELERATE_MEMSAFE_*`` variables, keyed by lower-case option name.

    Example:
        >>> memsafe_variables({"ACCELERATE_MEMSAFE_BUCKET_BYTES": "1024"})
        {'bucket_bytes': '1024'}
    """
    environ = os.environ if environ is None else environ
    return {k[len(PREFIX) :].lower(): v for k, v in environ.items() if k.startswith(PREFIX)}


@dataclass(frozen=True)
class LaunchEnv:
    """How this process was launched, as the launcher's environment variables say."""

    world_size: int
    rank: int
    local_rank: int
    local_world_size: int
    """Processes on this node (``LOCAL_WORLD_SIZE``; 1 when the launcher does not say)."""
    use_fsdp: bool
    fsdp_version: int
    use_cpu: bool
    use_parallelism_config: bool = False
    """``accelerate launch --use_parallelism_config`` (sizes in ``PARALLELISM_CONFIG_*``)."""
    group_rank: int = -1
    """This node's index (torchrun's ``GROUP_RANK``, which ``accelerate launch --machine_rank`` sets); -1 when
    the launcher does not say."""


def launched_world_size(environ: Mapping[str, str] | None = None) -> int | None:
    """``WORLD_SIZE`` as the launcher set it, ``None`` when it is not set (not launched by a launcher).

    Example:
        >>> launched_world_size({"WORLD_SIZE": "4"}), launched_world_size({})
        (4, None)
    """
    environ = os.environ if environ is None else environ
    raw = environ.get("WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() else None


def launched_mesh(environ: Mapping[str, str] | None = None) -> dict[str, int] | None:
    """The ``ParallelismConfig`` sizes ``accelerate launch --use_parallelism_config`` set
    (``PARALLELISM_CONFIG_DP_REPLICATE_SIZE``, ``..._TP_SIZE``), ``None`` when it did not.

    Example:
        >>> launched_mesh({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2"})
        {'dp_replicate_size': 2, 'tp_size': 1}
        >>> launched_mesh({}) is None
        True
    """
    environ = os.environ if environ is None else environ
    if not _flag(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG")):
        return None
    out = {}
    for key in ("dp_replicate_size", "tp_size"):
        raw = environ.get(f"PARALLELISM_CONFIG_{key.upper()}", "").strip()
        out[key] = int(raw) if raw.isdigit() and int(raw) > 0 else 1
    return out


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Reads the launcher variables set by ``torchrun`` / ``accelerate launch``.

    Example:
        >>> launch_env({"WORLD_SIZE": "2", "RANK": "1", "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}).world_size
        2
    """
    environ = os.environ if environ is None else environ
    return LaunchEnv(
        world_size=int(environ.get("WORLD_SIZE", "1")),
        rank=int(environ.get("RANK", "0")),
        local_rank=int(environ.get("LOCAL_RANK", "-1")),
        local_world_size=int(environ.get("LOCAL_WORLD_SIZE", "1") or "1"),
        use_fsdp=_flag(environ.get("ACCELERATE_USE_FSDP")),
        fsdp_version=int(environ.get("FSDP_VERSION", "1") or "1"),
        use_cpu=_flag(environ.get("ACCELERATE_USE_CPU")),
        use_parallelism_config=_flag(environ.get("ACCELERATE_USE_PARALLELISM_CONFIG")),
        group_rank=int(environ.get("GROUP_RANK", "-1") or "-1"),
    )
