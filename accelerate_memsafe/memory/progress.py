"""Byte progress bars for stages that move a lot of data (rank 0 only, bytes and bytes/s)."""

from __future__ import annotations

from typing import Any

#: Stages moving less than this show no bar (a bar for 20 MB is noise).
PROGRESS_MIN_BYTES = 256 * 2**20


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def byte_progress(total: int, desc: str, *, enabled: bool = True, rank: int = 0, min_bytes: int = PROGRESS_MIN_BYTES):
    """A tqdm bar counting bytes (with bytes/s), or a no-op bar.

    The bar is shown only on rank 0, when ``enabled`` (the plugin's ``progress`` option) and when
    ``total`` is at least ``min_bytes``.

    Example:
        >>> with byte_progress(10, "copy", min_bytes=1 << 40) as bar:
        ...     bar.update(10)
    """
    if not enabled or rank != 0 or total < min_bytes:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True, leave=False)
