"""Byte sizes as users write them (``"500MB"``, ``"64MiB"``, ``1024``): one parser for the whole package,
with no dependency on the configuration class (the I/O layer uses it too)."""

from __future__ import annotations

from .errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Parses a byte size: an int, or a string with transformers' meaning (``"500MB"`` = 500·10^6 bytes,
    ``"64MiB"`` = 64·2^20 bytes).

    Raises:
        ConfigError: If the value is not a positive size.

    Example:
        >>> parse_size("500MB"), parse_size("64MiB"), parse_size(1024)
        (500000000, 67108864, 1024)
    """
    if isinstance(value, bool):
        raise ConfigError(f"`{what}` must be a byte count or a string like '500MB', got {value!r}.")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        text = value.strip().upper().replace(" ", "")
        digits = text.rstrip("KMGTIB")
        unit = text[len(digits) :]
        try:
            number = float(digits)
        except ValueError:
            raise ConfigError(f"`{what}`={value!r} is not a size; use bytes (1048576) or a string like '500MB'.") from None
        if unit not in _UNITS:
            raise ConfigError(f"`{what}`={value!r} has unknown unit {unit!r}; use one of B, KB, MB, GB, KiB, MiB, GiB.")
        n = int(number * _UNITS[unit])
    else:
        raise ConfigError(f"`{what}` must be an int or a string like '500MB', got {type(value).__name__}.")
    if n <= 0:
        raise ConfigError(f"`{what}` must be positive, got {value!r}.")
    return n
