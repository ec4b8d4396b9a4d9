"""Atomic checkpoint directories: write under a temporary name, fsync, then swap into place.

A checkpoint directory ``<parent>/<name>`` is written as ``<parent>/.memsafe-tmp-<name>`` (holding an
``.memsafe_incomplete`` sentinel while it is written). When every rank is done, the writer fsyncs every
file, writes the completeness marker ``.memsafe_complete.json`` (world size, every file with its size),
removes the sentinel, and swaps the directory into place with one ``renameat2(RENAME_EXCHANGE)`` (Linux),
so the final path always holds a complete checkpoint: the previous one until the swap, the new one after.
Where the exchange is not supported, the old directory is first renamed to ``.memsafe-old-<name>`` and
:func:`recover` puts it back if a kill lands between the two renames.

Readers never see a temporary directory: :func:`check_loadable` refuses any directory that carries the
sentinel, has a temporary name, or whose files do not match its marker.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

#: Written last into a finished checkpoint directory, before it is renamed into place.
MARKER = ".memsafe_complete.json"
#: Present while a checkpoint directory is being written.
SENTINEL = ".memsafe_incomplete"
TEMP_PREFIX = ".memsafe-tmp-"
OLD_PREFIX = ".memsafe-old-"
FORMAT_VERSION = 1

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def temp_dir_for(final: str | os.PathLike, *, parent: str | os.PathLike | None = None) -> Path:
    """The temporary directory a checkpoint destined for ``final`` is written to.

    Args:
        final: Where the finished checkpoint will live.
        parent: Folder for the temporary directory (default: the parent of ``final``; it must be on the same
            file system). accelerate's automatic checkpoint naming lists every entry of its ``checkpoints``
            folder, so the stage puts temporary directories next to that folder instead.

    Example:
        >>> temp_dir_for("/ckpt/step_10").name
        '.memsafe-tmp-step_10'
    """
    final = Path(final)
    return Path(parent if parent is not None else final.parent) / f"{TEMP_PREFIX}{final.name}"


def is_temp_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a temporary (unfinished) checkpoint directory of ours."""
    name = Path(path).name
    return name.startswith(TEMP_PREFIX) or name.startswith(OLD_PREFIX) or (Path(path) / SENTINEL).exists()


def begin(temp: Path) -> None:
    """Creates ``temp`` empty (removing what a killed save left there) with the incomplete sentinel.

    Nothing here is fsynced: until :func:`finalize`, the directory is refused by its name alone (and the
    sentinel), and the previous checkpoint is untouched, so a crash that loses the new directory loses nothing;
    :func:`finalize` makes the files, the directory and the rename durable. (An fsync of the parent here cost
    2-30 ms on the critical path of every save, a journal commit on a busy disk.)

    Example:
        >>> # begin(temp_dir_for("/ckpt/step_10"))
    """
    if temp.exists():
        shutil.rmtree(temp)
    temp.mkdir(parents=True)
    (temp / SENTINEL).write_text("this checkpoint directory is being written; it is not loadable\n")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is still atomic
    finally:
        os.close(fd)


def list_files(root: Path) -> dict[str, int]:
    """Every regular file under ``root`` (relative POSIX path -> size), markers excluded."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            rel = p.relative_to(root).as_posix()
            if rel in (MARKER, SENTINEL):
                continue
            out[rel] = p.stat().st_size
    return dict(sorted(out.items()))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swaps two paths (Linux ``renameat2``). Returns False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE) failed: {os.strerror(err)}")


def finalize(temp: Path, final: Path, *, world_size: int, extra: dict[str, Any] | None = None,
             carry_over: bool = False) -> dict[str, Any]:
    """Marks ``temp`` complete and swaps it into ``final``; the previous ``final`` is removed afterwards.

    Args:
        temp: The directory that was written (see :func:`begin`).
        final: Destination.
        world_size: Number of processes that wrote the checkpoint (checked by :func:`check_loadable`).
        extra: More fields for the marker.
        carry_over: Hard-link files of the previous ``final`` that the new one does not have (used by
            ``save_model``, whose directory also holds configs and tokenizers written by other code).

    Returns:
        The marker that was written.

    Example:
        >>> # finalize(temp, Path("/ckpt/step_10"), world_size=2)
    """
    final = Path(final)
    if carry_over and final.is_dir():
        _carry_over(final, temp)
    files = list_files(temp)
    for rel in files:
        _fsync_file(temp / rel)
    marker = {"format": FORMAT_VERSION, "complete": True, "world_size": int(world_size), "files": files, **(extra or {})}
    marker_path = temp / MARKER
    with open(marker_path, "w", encoding="utf-8") as f:
        json.dump(marker, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    (temp / SENTINEL).unlink(missing_ok=True)
    for dirpath, _, _ in os.walk(temp):
        _fsync_dir(Path(dirpath))
    if final.exists():
        if _exchange(temp, final):
            _fsync_dir(final.parent)
            _fsync_dir(temp.parent)
            shutil.rmtree(temp)  # now holds the previous checkpoint
        else:
            old = final.parent / f"{OLD_PREFIX}{final.name}"
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)  # a kill here is repaired by `recover`
            os.rename(temp, final)
            _fsync_dir(final.parent)
            shutil.rmtree(old)
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(temp, final)
        _fsync_dir(final.parent)
    return marker


_WEIGHT_FILE = re.compile(r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$")


def _carry_over(old: Path, new: Path) -> None:
    for entry in old.iterdir():
        if entry.name in (MARKER, SENTINEL) or (new / entry.name).exists() or _WEIGHT_FILE.match(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, new / entry.name, copy_function=os.link)
        else:
            os.link(entry, new / entry.name)


def recover(final: str | os.PathLike) -> bool:
    """Repairs the one window of the non-``renameat2`` swap: a kill after the previous checkpoint was
    renamed away and before the new one was renamed in. Puts the previous one back.

    Returns:
        Whether something was repaired.
    """
    final = Path(final)
    old = final.parent / f"{OLD_PREFIX}{final.name}"
    if not final.exists() and old.is_dir() and (old / MARKER).exists():
        os.rename(old, final)
        _fsync_dir(final.parent)
        return True
    return False


def read_marker(path: str | os.PathLike) -> dict[str, Any] | None:
    """The completeness marker of a checkpoint directory, or ``None`` for a directory written without
    the plugin (stock accelerate)."""
    p = Path(path) / MARKER
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint marker {p} is unreadable ({exc}); the checkpoint is incomplete.") from None


def saved_world_size(path: str | os.PathLike, marker: dict[str, Any] | None = None) -> int | None:
    """The number of processes that wrote a checkpoint: from the marker, else from accelerate's
    per-process ``random_states_<rank>.pkl`` files (``None`` if neither says)."""
    if marker and "world_size" in marker:
        return int(marker["world_size"])
    ranks = [int(m.group(1)) for f in os.listdir(path) if (m := re.fullmatch(r"random_states_(\d+)\.pkl", f))]
    return max(ranks) + 1 if ranks else None


def check_loadable(path: str | os.PathLike, *, world_size: int | None = None) -> dict[str, Any] | None:
    """Refuses a checkpoint directory that is temporary, incomplete or truncated, or that holds per-rank
    files (:func:`per_rank_files`) and was written by another world size.

    Args:
        path: The checkpoint directory.
        world_size: The current number of processes (``None``: not checked).

    Returns:
        The marker (``None`` for a checkpoint written by stock accelerate, which is accepted).

    Raises:
        CheckpointError: Naming the directory or file and what is wrong, before anything is loaded.

    Example:
        >>> # check_loadable("/ckpt/step_10", world_size=2)
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist.")
    if path.name.startswith((TEMP_PREFIX, OLD_PREFIX)) or (path / SENTINEL).exists():
        raise CheckpointError(
            f"{path} is an incomplete checkpoint: it is the temporary directory of a save that did not finish "
            f"(it carries `{SENTINEL}` or a `{TEMP_PREFIX}` name). Load the finished checkpoint "
            f"{path.parent / path.name.removeprefix(TEMP_PREFIX).removeprefix(OLD_PREFIX)} instead."
        )
    marker = read_marker(path)
    if marker is not None:
        if not marker.get("complete"):
            raise CheckpointError(f"checkpoint {path} is incomplete: its marker {MARKER} does not say complete.")
        for rel, size in marker.get("files", {}).items():
            f = path / rel
            if not f.exists():
                raise CheckpointError(
                    f"checkpoint {path} is incomplete: file {f} listed in {MARKER} is missing."
                )
            actual = f.stat().st_size
            if actual != size:
                raise CheckpointError(
                    f"checkpoint file {f} is truncated or was modified: {actual} bytes, the checkpoint was "
                    f"written with {size} bytes. Restore the file or load an earlier checkpoint."
                )
    if world_size is not None:
        saved = saved_world_size(path, marker)
        if saved is not None and saved != world_size:
            unreshardable = per_rank_files(path)
            if unreshardable:
                name, why = unreshardable[0]
                raise CheckpointError(
                    f"checkpoint {path} was written by {saved} process(es), but this run has {world_size}, and "
                    f"{path / name} cannot be resharded: {why}. Resume with {saved} processes "
                    f"(`--num_processes {saved}`), or re-save it with `SHARDED_STATE_DICT` (a DCP checkpoint, "
                    "which loads on any number of processes)."
                )
    return marker


#: Files that hold one rank's piece of a tensor in a layout tied to the world size that wrote it.
_PER_RANK_FORMATS = (
    (re.compile(r".*_rank\d+\.bin"), "it is an FSDP `LOCAL_STATE_DICT` file, one rank's flat shard in a layout "
                                       "fixed by the world size that wrote it"),
)


def per_rank_files(path: str | os.PathLike) -> list[tuple[str, str]]:
    """The files of a checkpoint directory that only the world size that wrote them can load, with why.

    Everything else accelerate writes loads on any world size: full state dicts (``model.safetensors``,
    ``pytorch_model_fsdp_0.bin``, ``optimizer.bin``) are read whole; DCP folders (``SHARDED_STATE_DICT``)
    are resharded by ``torch.distributed.checkpoint``; ``random_states_<rank>.pkl`` is restored on the ranks
    that have one (the others keep their random state, as in stock accelerate); DeepSpeed folders follow
    DeepSpeed's own rules.

    Example:
        >>> per_rank_files("/nonexistent")
        []
    """
    path = Path(path)
    if not path.is_dir():
        return []
    return sorted((f.name, why) for f in path.iterdir() for pattern, why in _PER_RANK_FORMATS if pattern.fullmatch(f.name))


def _iteration(name: str) -> int | None:
    found = re.findall(r"([0-9]+)", name)
    return int(found[-1]) if found else None


def complete_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The finished checkpoint directories in ``folder`` (temporary ones excluded), oldest first by the
    number in their name, the way accelerate's automatic checkpoint naming orders them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [
        p for p in folder.iterdir()
        if p.is_dir() and not is_temp_dir(p) and _iteration(p.name) is not None
    ]
    return sorted(found, key=lambda p: _iteration(p.name))


def roll_total_limit(folder: str | os.PathLike, total_limit: int | None, *, keep: str | os.PathLike) -> list[Path]:
    """Deletes the oldest checkpoints of ``folder`` so that at most ``total_limit`` remain, never ``keep``
    (the one just written). Runs after the new checkpoint is complete, so a kill never leaves fewer than
    ``total_limit`` loadable checkpoints (accelerate deletes before it saves).

    Returns:
        The directories deleted.
    """
    if total_limit is None:
        return []
    keep = Path(keep).resolve()
    found = [p for p in complete_checkpoints(folder) if p.resolve() != keep]
    excess = len(found) + 1 - total_limit
    deleted = found[: max(excess, 0)]
    for p in deleted:
        shutil.rmtree(p)
    return deleted


def barrier(world_size: int) -> None:
    """``torch.distributed.barrier()`` when more than one process runs (a no-op otherwise)."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
