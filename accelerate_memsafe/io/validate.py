"""Checks that every loader runs on its inputs before it modifies anything.

Plain functions, each raising :class:`~accelerate_memsafe.errors.CheckpointError` with a message that names
the file, the tensor, the rank and the sizes, and says how to fix it. They read headers and metadata only
(never tensor data, except :func:`check_cast` / :func:`check_finite`, which look at a tensor the caller
already holds), so they cost nothing next to the load they guard:

- :func:`contained_path`: an ``index.json`` entry must name a file *inside* the checkpoint directory
  (transformers 5.23 follows ``../x.safetensors`` and absolute paths without complaint).
- :func:`check_safetensors_file`: the header must fit in the file and every tensor's bytes must lie inside
  it with the size its dtype and shape need (safetensors refuses a truncated file without naming it).
- :func:`check_safetensors_checkpoint`: a directory, index or single file, all of the above, plus missing
  shard files and tensors stored twice.
- :func:`check_keys`: missing and unexpected tensors, listed by name.
- :func:`cast_loss` / :func:`check_cast`: a dtype conversion that would lose data (overflow to inf,
  fractional values into an integer type, integers beyond the target's range or exact precision).
- :func:`check_finite`: NaN / Inf in a tensor.
- :func:`load_rng_states`: accelerate's ``random_states_<rank>.pkl`` read with ``weights_only=True`` and an
  allow-list of exactly the numpy types those files need; a file that asks for anything else is refused
  (its code never runs).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, message_line
from .safetensors_source import read_raw_header

#: safetensors dtype name -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4,
    "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "C64": 8,
}
#: Largest header a real safetensors file has (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 * 2**20
INDEX_SUFFIX = ".index.json"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, from its header: file, dtype name, shape, data byte range."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def contained_path(root: str | os.PathLike, entry: str, *, what: str) -> Path:
    """Resolves ``entry`` (a file name read from a checkpoint) inside ``root``, refusing anything else.

    Args:
        root: The checkpoint directory.
        entry: The name as written in the checkpoint (e.g. an ``index.json`` ``weight_map`` value).
        what: Where the name was read, for the message (``"the index model.safetensors.index.json"``).

    Returns:
        The path inside ``root``.

    Raises:
        CheckpointError: For an absolute path or one that leaves ``root`` (``../``, or a symlink pointing out).

    Example:
        >>> contained_path("/ckpt", "model-00001-of-00002.safetensors", what="index").as_posix()
        '/ckpt/model-00001-of-00002.safetensors'
    """
    root = Path(root)
    if not isinstance(entry, str) or not entry:
        raise CheckpointError(f"{what} names an invalid file {entry!r}; expected a file name inside {root}.")
    if os.path.isabs(entry) or entry.startswith("\\") or (len(entry) > 1 and entry[1] == ":"):
        raise CheckpointError(
            f"{what} names the absolute path {entry!r}; a checkpoint may only name files inside its own "
            f"directory {root}. Refusing to read it: fix the index (file names only, no directories)."
        )
    candidate = root / entry
    real_root = os.path.realpath(root)
    real = os.path.realpath(candidate)
    if os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointError(
            f"{what} names {entry!r}, which resolves to {real}, outside the checkpoint directory {real_root}. "
            "Refusing to read it: a checkpoint may only name files inside its own directory; fix the index."
        )
    return candidate


def check_safetensors_file(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Checks a safetensors file's header against the file's size without reading tensor data.

    Checks: the 8-byte length and the header fit in the file; the header is JSON; every dtype is known;
    every tensor's byte range has the size its dtype and shape need and lies inside the file; the data
    section is fully covered (as safetensors itself requires).

    Args:
        path: The ``.safetensors`` file.

    Returns:
        Tensor name -> :class:`TensorInfo`.

    Raises:
        CheckpointError: Naming the file, the tensor and the byte counts.

    Example:
        >>> # infos = check_safetensors_file("ckpt/model.safetensors"); infos["lm_head.weight"].shape
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"safetensors file {path} does not exist.")
    size = path.stat().st_size
    header, base = read_raw_header(path)
    n = base - 8
    data = size - 8 - n
    out: dict[str, TensorInfo] = {}
    covered = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"safetensors file {path}: the header entry of `{name}` is malformed: {info!r}.") from None
        width = DTYPE_BYTES.get(dtype)
        if width is None:
            raise CheckpointError(f"safetensors file {path}: tensor `{name}` has unknown dtype {dtype!r}.")
        need = math.prod(shape) * width
        if end - begin != need or begin < 0:
            raise CheckpointError(
                f"safetensors file {path}: tensor `{name}` spans bytes [{begin}, {end}) = {end - begin} bytes, but "
                f"dtype {dtype} and shape {list(shape)} need {need} bytes; the file is corrupt."
            )
        if end > data:
            raise CheckpointError(
                f"safetensors file {path} is truncated: tensor `{name}` ({dtype}{list(shape)}) ends at data byte "
                f"{end}, but the file holds only {data} data bytes ({size} bytes in all). Re-save the checkpoint "
                "or restore the file (the save was probably interrupted)."
            )
        covered = max(covered, end)
        out[name] = TensorInfo(str(path), dtype, shape, begin, end)
    if covered != data:
        raise CheckpointError(
            f"safetensors file {path} has {data} data bytes but its header describes {covered}: the file was "
            "modified or is corrupt. Re-save the checkpoint or restore the file."
        )
    return out


def index_files(index_path: str | os.PathLike) -> dict[str, Path]:
    """The ``weight_map`` of a ``*.safetensors.index.json``, each file resolved inside its directory.

    Returns:
        Tensor name -> shard path.

    Raises:
        CheckpointError: For an unreadable index, an entry outside the directory (:func:`contained_path`),
            or a shard file that does not exist (all missing shards are listed).

    Example:
        >>> # index_files("ckpt/model.safetensors.index.json")["lm_head.weight"]
    """
    index_path = Path(index_path)
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"the index {index_path} is unreadable or has no `weight_map` ({exc}).") from None
    root = index_path.parent
    out: dict[str, Path] = {}
    for name, entry in weight_map.items():
        out[name] = contained_path(root, entry, what=f"the index {index_path} (tensor `{name}`)")
    missing = sorted({p.name for p in out.values() if not p.is_file()})
    if missing:
        raise CheckpointError(
            f"the index {index_path} names {len(missing)} shard file(s) that do not exist in {root}: {missing}. "
            "Copy the missing shards, or re-save the checkpoint."
        )
    return out


def checkpoint_files(path: str | os.PathLike) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files of a checkpoint: a directory (``model.safetensors`` or
    ``model.safetensors.index.json``), an index, or one file.

    Returns:
        ``(files, weight_map or None)``.

    Raises:
        CheckpointError: As :func:`index_files`, or when nothing is found.
    """
    path = Path(path)
    if path.is_dir():
        for name in ("model.safetensors.index.json", "model.safetensors"):
            if (path / name).exists():
                return checkpoint_files(path / name)
        found = sorted(path.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"no safetensors checkpoint in {path}: expected model.safetensors or an index.json.")
        return found, None
    if path.name.endswith(".json"):
        weight_map = index_files(path)
        return sorted(set(weight_map.values())), weight_map
    if not path.is_file():
        raise CheckpointError(f"safetensors checkpoint {path} does not exist.")
    return [path], None


def check_safetensors_checkpoint(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """Checks every file of a safetensors checkpoint (see :func:`check_safetensors_file`), that an index
    only names files inside the directory that exist, that no tensor is stored twice, and that every
    tensor the index names is in the file it says.

    Args:
        path: Directory, ``*.index.json`` or ``.safetensors`` file.

    Returns:
        Tensor name -> :class:`TensorInfo`.

    Raises:
        CheckpointError: Naming the file / tensor and what is wrong.

    Example:
        >>> # infos = check_safetensors_checkpoint("ckpt/")
    """
    files, weight_map = checkpoint_files(path)
    out: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in check_safetensors_file(file).items():
            if name in out:
                raise CheckpointError(f"tensor `{name}` is stored twice: in {out[name].file} and in {file}.")
            out[name] = info
    if weight_map is not None:
        wrong = [
            f"`{n}` (index: {p.name}, found in: {Path(out[n].file).name if n in out else 'no file'})"
            for n, p in weight_map.items()
            if n not in out or Path(out[n].file).name != p.name
        ]
        if wrong:
            raise CheckpointError(
                f"the index of {path} does not match its shard files for {len(wrong)} tensor(s): {wrong[:10]}. "
                "Re-save the checkpoint."
            )
    return out


def key_differences(expected: Iterable[str], found: Iterable[str]) -> tuple[list[str], list[str]]:
    """``(missing, unexpected)``: names expected but not found, and found but not expected, sorted.

    Example:
        >>> key_differences(["a", "b"], ["b", "c"])
        (['a'], ['c'])
    """
    expected, found = set(expected), set(found)
    return sorted(expected - found), sorted(found - expected)


def check_keys(expected: Iterable[str], found: Iterable[str], *, where: str, allow_unexpected: bool = False,
               limit: int = 20) -> None:
    """Raises if tensors are missing from (or unexpected in) a checkpoint, listing them by name.

    Args:
        expected: Names the model needs.
        found: Names the checkpoint holds.
        where: The checkpoint (file or directory) for the message.
        allow_unexpected: Accept extra tensors in the checkpoint.
        limit: How many names of each kind to show.

    Raises:
        CheckpointError: ``"... 2 missing: ['a', 'b']; 1 unexpected: ['c'] ..."``.

    Example:
        >>> check_keys(["a"], ["a"], where="ckpt")
    """
    missing, unexpected = key_differences(expected, found)
    raise_if_mismatched(where, missing=missing, unexpected=[] if allow_unexpected else unexpected, limit=limit)


def listing(names: list[str], limit: int = 20) -> str:
    """Up to ``limit`` names and how many more (``"['a', 'b'] and 3 more"``), for error messages.

    Example:
        >>> listing(["a", "b", "c"], 2)
        "['a', 'b'] and 1 more"
    """
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return f"{names[:limit]}{more}"


_SAME_MODEL_HINT = "Load a checkpoint saved from the same model (same config), or build the model it was saved from."


def raise_if_mismatched(where: str, *, missing: list[str] = (), unexpected: list[str] = (), wrong: list[str] = (),
                        limit: int = 20, hint: str = _SAME_MODEL_HINT) -> None:
    """The one "checkpoint does not match the model" error: missing, unexpected and differently shaped
    tensors, each listed by name (up to ``limit``).

    Raises:
        CheckpointError: If any list is non-empty.

    Example:
        >>> raise_if_mismatched("ckpt")  # nothing to report
    """
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing from the checkpoint: {listing(list(missing), limit)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (the model has no such tensor): {listing(list(unexpected), limit)}")
    if wrong:
        parts.append(f"{len(wrong)} with another shape or dtype: {listing(list(wrong), limit)}")
    if parts:
        raise CheckpointError(f"checkpoint {where} does not match the model: " + "; ".join(parts) + ". " + hint)


def _int_range(dtype: torch.dtype) -> tuple[int, int]:
    info = torch.iinfo(dtype)
    return int(info.min), int(info.max)


def _exact_int_bound(dtype: torch.dtype) -> int:
    """Largest integer every smaller one of which a float dtype represents exactly (2**(mantissa+1))."""
    mantissa = {torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}.get(dtype, 0)
    return 2 ** (mantissa + 1)


def cast_loss(tensor: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why converting ``tensor`` to ``dtype`` would lose data, or ``None`` when it would not.

    Rounding a float to a narrower float (fp32 -> bf16) is what a user asks for with ``dtype=``, so it is
    not a loss; losses are: a finite value that becomes ``inf`` (overflow), a fractional or non-finite
    value into an integer type, an integer outside the target's range, an integer above a float type's
    exact range, and a non-bool value into ``bool``.

    Example:
        >>> cast_loss(torch.tensor([1e6]), torch.float16)
        'finite value(s) up to 1e+06 overflow float16 (max 65504) and would become inf'
        >>> cast_loss(torch.tensor([1.5]), torch.float16) is None
        True
    """
    src = tensor.dtype
    if src == dtype or tensor.numel() == 0:
        return None
    t = tensor.detach()
    if dtype == torch.bool:
        if src != torch.bool and bool(((t != 0) & (t != 1)).any()):
            return "values other than 0 and 1 would become True"
        return None
    if dtype.is_floating_point:
        if src.is_floating_point:
            finite = torch.isfinite(t)
            if not bool(finite.any()):
                return None
            peak = float(t[finite].abs().max().to(torch.float64))
            limit = float(torch.finfo(dtype).max)
            if peak > limit:
                return f"finite value(s) up to {peak:g} overflow {str(dtype).removeprefix('torch.')} (max {limit:g}) and would become inf"
            return None
        if src == torch.bool:
            return None
        peak = int(t.abs().max())
        bound = _exact_int_bound(dtype)
        if peak > bound:
            return f"integer value(s) up to {peak} exceed {str(dtype).removeprefix('torch.')}'s exact range ({bound}) and would be rounded"
        return None
    # integer target
    if src.is_floating_point:
        if not bool(torch.isfinite(t).all()):
            return f"NaN/Inf value(s) cannot be represented in {str(dtype).removeprefix('torch.')}"
        if bool((t != t.trunc()).any()):
            return f"fractional value(s) would be truncated to {str(dtype).removeprefix('torch.')}"
    lo, hi = _int_range(dtype)
    tmin, tmax = float(t.min()), float(t.max())
    if tmin < lo or tmax > hi:
        return f"value(s) in [{tmin:g}, {tmax:g}] are outside {str(dtype).removeprefix('torch.')}'s range [{lo}, {hi}]"
    return None


def check_cast(name: str, tensor: torch.Tensor, dtype: torch.dtype, *, where: str) -> None:
    """Raises if converting ``tensor`` (tensor ``name`` read from ``where``) to ``dtype`` loses data.

    Raises:
        CheckpointError: ``"... `w` is float64 in ckpt/model.safetensors, the model wants float32: ..."``.

    Example:
        >>> check_cast("w", torch.tensor([1.0]), torch.float16, where="ckpt")
    """
    why = cast_loss(tensor, dtype)
    if why is not None:
        raise CheckpointError(
            f"tensor `{name}` is {str(tensor.dtype).removeprefix('torch.')} in {where}, the model wants "
            f"{str(dtype).removeprefix('torch.')}, and the cast would lose data: {why}. Load it into a model of "
            "the checkpoint's dtype, or fix the checkpoint."
        )


def check_finite(name: str, tensor: torch.Tensor, *, where: str) -> None:
    """Raises if a floating-point tensor holds NaN or Inf (counting them).

    Raises:
        CheckpointError: ``"tensor `w` from ckpt holds 3 NaN and 0 Inf value(s) of 64 ..."``.

    Example:
        >>> check_finite("w", torch.ones(2), where="ckpt")
    """
    if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0:
        return
    if bool(torch.isfinite(tensor).all()):
        return
    nans = int(torch.isnan(tensor).sum())
    infs = int(torch.isinf(tensor).sum())
    raise CheckpointError(
        f"tensor `{name}` from {where} holds {nans} NaN and {infs} Inf value(s) of {tensor.numel()}. Fix the "
        "checkpoint (or the code that computes it) before training on it."
    )


def rng_state_globals() -> list[Any]:
    """Exactly the non-torch types that accelerate's ``random_states_<rank>.pkl`` needs: numpy's RNG state
    is an ``ndarray`` (rebuilt with ``_reconstruct``) of a ``numpy.dtype`` (numpy >= 1.25 pickles its dtype
    class, ``UInt32DType``, too). ``_codecs.encode``, which accelerate also allows, is already in torch's
    own ``weights_only`` allow-list. Tested in ``tests/reliability/test_bad_input.py``: each of them is
    needed, and nothing more."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    out: list[Any] = [_reconstruct, np.ndarray, np.dtype]
    if hasattr(np, "dtypes") and hasattr(np.dtypes, "UInt32DType"):
        out.append(np.dtypes.UInt32DType)
    return out


def numpy_scalar_globals() -> list[Any]:
    """The globals a pickled numpy scalar needs (an optimizer's ``lr`` computed with numpy: ``np.float64(3e-4)``):
    ``scalar`` rebuilds it from its dtype and its bytes, data only; ``numpy.dtype`` and numpy's dtype classes.
    torch's ``weights_only`` load refuses them by default.

    Example:
        >>> import io, numpy as np
        >>> buf = io.BytesIO(); torch.save({"lr": np.float64(3e-4)}, buf); _ = buf.seek(0)
        >>> with torch.serialization.safe_globals(numpy_scalar_globals()):
        ...     float(torch.load(buf, weights_only=True)["lr"])
        0.0003
    """
    import numpy as np

    try:
        from numpy._core.multiarray import scalar
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import scalar  # type: ignore[no-redef]
    classes = [c for c in vars(getattr(np, "dtypes", object)).values() if isinstance(c, type) and issubclass(c, np.dtype)]
    return [scalar, np.dtype, *classes]


def load_rng_states(path: str | os.PathLike) -> dict[str, Any]:
    """Reads accelerate's ``random_states_<rank>.pkl`` without ever running code from it.

    ``torch.load(weights_only=True)`` with exactly :func:`rng_state_globals` allowed: a file that needs any
    other global (a pickled callable, e.g. ``os.system``) is refused.

    Args:
        path: The file.

    Returns:
        The states dict (``random_state``, ``numpy_random_seed``, ``torch_manual_seed`` ...).

    Raises:
        CheckpointError: Naming the file and what the unpickler refused.

    Example:
        >>> # states = load_rng_states("ckpt/random_states_0.pkl")
    """
    path = Path(path)
    try:
        with torch.serialization.safe_globals(rng_state_globals()):
            states = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        first = message_line(exc, prefer=("Unsupported global", "GLOBAL"))
        raise CheckpointError(
            f"RNG state file {path} was refused: it is not a plain accelerate RNG state ({type(exc).__name__}: "
            f"{first}). Nothing from it was executed or loaded; re-save the checkpoint or delete the file to "
            "resume without restoring the random states."
        ) from None
    if not isinstance(states, dict) or "torch_manual_seed" not in states:
        raise CheckpointError(f"RNG state file {path} does not hold accelerate's random states (keys: "
                              f"{sorted(states) if isinstance(states, dict) else type(states).__name__}).")
    return states


def check_world_size(saved: int | None, current: int, *, where: str) -> None:
    """Raises if a checkpoint written by ``saved`` processes is loaded by ``current`` processes.

    Example:
        >>> check_world_size(2, 2, where="ckpt")
    """
    if saved is not None and saved != current:
        raise CheckpointError(
            f"checkpoint {where} was written by {saved} process(es), but this run has {current}. Resume with "
            f"{saved} processes (`--num_processes {saved}`), or convert the checkpoint first."
        )


def check_against_model(infos: Mapping[str, TensorInfo], shapes: Mapping[str, tuple[int, ...]], *, where: str,
                        allow_unexpected: bool = False) -> None:
    """Checks tensor names and shapes of a checkpoint (from :func:`check_safetensors_checkpoint`) against a
    model's (``name -> shape``): lists missing, unexpected and wrongly shaped tensors.

    Raises:
        CheckpointError: Listing every problem by name.

    Example:
        >>> # check_against_model(check_safetensors_checkpoint(p), {n: tuple(t.shape) for n, t in sd.items()}, where=p)
    """
    check_keys(shapes, infos, where=where, allow_unexpected=allow_unexpected)
    check_shapes(infos, shapes, where=where)


#: safetensors dtype name -> torch dtype (for the cast check).
_TORCH_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP / ``torch.compile`` wrappers (whose state-dict names carry a prefix)."""
    for _ in range(4):
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def check_model_file(path: str | os.PathLike, model: torch.nn.Module, *, infos: Mapping[str, TensorInfo] | None = None,
                     strict: bool = True) -> None:
    """Checks a ``model.safetensors`` written by ``save_state`` against the model it will be loaded into:
    the file's integrity (:func:`check_safetensors_file`), missing / unexpected / wrongly shaped tensors
    (a tied alias saved once counts as present), and dtype casts that would lose data (only tensors whose
    saved dtype differs from the model's are read).

    Args:
        path: The file.
        model: The model (DDP / compiled wrappers are looked through; FSDP2 DTensors are compared by their
            global shape).
        infos: The file's header, if already read.
        strict: ``False``: missing and unexpected tensors are let through, as ``load_state(..., strict=False)``
            lets ``load_state_dict`` take them; shapes and casts are still checked (``load_state_dict`` refuses
            another shape also then).

    Raises:
        CheckpointError: Naming the file and every offending tensor.

    Example:
        >>> # check_model_file("ckpt/model.safetensors", model)
    """
    path = Path(path)
    infos = check_safetensors_file(path) if infos is None else infos
    model = _unwrap(model)
    state = model.state_dict()
    aliases: dict[int, list[str]] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if name in state:
            aliases.setdefault(id(t), []).append(name)
    grouped = {n for names in aliases.values() for n in names}
    groups = list(aliases.values()) + [[n] for n in state if n not in grouped]
    missing = sorted(g[0] for g in groups if not any(n in infos for n in g))
    unexpected = sorted(n for n in infos if n not in state)
    wrong = [
        f"`{n}`: file {list(info.shape)}, model {list(state[n].shape)}"
        for n, info in infos.items()
        if n in state and tuple(info.shape) != tuple(state[n].shape)
    ]
    if not strict:
        missing, unexpected = [], []
    raise_if_mismatched(f"file {path}", missing=missing, unexpected=unexpected, wrong=wrong,
                        hint="Nothing was loaded. " + _SAME_MODEL_HINT + (
                            " To load the tensors the model and the file share, pass `strict=False`, as to "
                            "accelerate's `load_state`." if strict and not wrong else ""))
    check_casts(infos, {n: state[n].dtype for n in infos if n in state})


def check_accelerate_checkpoint(directory: str | os.PathLike, models: Iterable[torch.nn.Module], *, rank: int,
                                strict: bool = True) -> None:
    """Everything ``load_state`` reads that can be checked before anything is modified: each
    ``model[_i].safetensors`` against its model (:func:`check_model_file`) and this rank's
    ``random_states_<rank>.pkl`` (:func:`load_rng_states`; accelerate itself would log a refused file at
    INFO level and go on without restoring the random states).

    Args:
        directory: The checkpoint directory.
        models: The prepared models, in ``prepare`` order.
        rank: This process's rank.
        strict: ``load_state``'s ``strict`` (passed on to ``load_state_dict``): ``False`` lets missing and
            unexpected tensors through.

    Raises:
        CheckpointError: As the checks above.

    Example:
        >>> # check_accelerate_checkpoint("ckpt/", accelerator._models, rank=0)
    """
    directory = Path(directory)
    for i, model in enumerate(models):
        path = directory / (f"model_{i}.safetensors" if i else "model.safetensors")
        if path.is_file():
            check_model_file(path, model, strict=strict)
    rng = directory / f"random_states_{rank}.pkl"
    if rng.is_file():
        load_rng_states(rng)


def cast_may_lose(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether converting ``src`` to ``dst`` *can* lose values (so that the data must be looked at), from
    the dtypes alone: float to int, a float of smaller range (fp32 -> fp16, not fp32 -> bf16, which keeps
    fp32's range), a narrower int, or an int wider than a float's exact range.

    Example:
        >>> cast_may_lose(torch.float32, torch.bfloat16), cast_may_lose(torch.float64, torch.float32)
        (False, True)
    """
    if src == dst or dst == torch.bool and src == torch.bool:
        return False
    if dst == torch.bool:
        return True
    if src.is_floating_point:
        if not dst.is_floating_point:
            return True
        return float(torch.finfo(dst).max) < 0.99 * float(torch.finfo(src).max)
    if src == torch.bool:
        return False
    if dst.is_floating_point:
        return int(torch.iinfo(src).max) > _exact_int_bound(dst)
    return torch.iinfo(dst).max < torch.iinfo(src).max or torch.iinfo(dst).min > torch.iinfo(src).min


def check_shapes(infos: Mapping[str, TensorInfo], shapes: Mapping[str, tuple[int, ...]], *, where: str,
                 hint: str = "Load a checkpoint saved from the same model (same config).") -> None:
    """Raises for every tensor present in both the checkpoint and the model with another shape (names in
    only one of them are not looked at: weight conversions may rename them).

    Example:
        >>> check_shapes({}, {"w": (2,)}, where="ckpt")
    """
    wrong = [
        f"`{n}`: checkpoint {list(infos[n].shape)}, model {list(s)}"
        for n, s in shapes.items()
        if n in infos and tuple(infos[n].shape) != tuple(s)
    ]
    if wrong:
        raise CheckpointError(
            f"checkpoint {where} does not match the model: {len(wrong)} tensor(s) have another shape: "
            f"{listing(wrong, 20)}. {hint}"
        )


def check_casts(infos: Mapping[str, TensorInfo], dtypes: Mapping[str, torch.dtype]) -> None:
    """Reads the tensors whose conversion to the model's dtype :func:`cast_may_lose` and refuses a lossy one
    (:func:`check_cast`). Tensors whose cast cannot lose values are not read.

    Example:
        >>> check_casts({}, {"w": torch.float32})
    """
    todo = [
        n for n, dt in dtypes.items()
        if n in infos and _TORCH_DTYPES.get(infos[n].dtype) is not None and cast_may_lose(_TORCH_DTYPES[infos[n].dtype], dt)
    ]
    if not todo:
        return
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for n in todo:
        by_file.setdefault(infos[n].file, []).append(n)
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device="cpu") as f:
            for n in names:
                check_cast(n, f.get_tensor(n), dtypes[n], where=file)
