"""Atomic ``transformers.Trainer`` checkpoints, as plain functions (rank 0 calls them; see
:mod:`accelerate_memsafe.integrations.trainer_stages` for the barriers around them).

The Trainer writes a checkpoint into ``<run_dir>/checkpoint-<step>`` from many places (``save_model``, its
FSDP helpers, the optimizer / scheduler / RNG / state files, and whatever a subclass such as TRL's adds).
Rather than redirecting each of them, the final name is made a symbolic link to the temporary directory of
:mod:`accelerate_memsafe.io.atomic` while the checkpoint is written, so every writer lands in the temporary
directory without knowing it. Then the link is removed and :func:`~accelerate_memsafe.io.atomic.finalize`
fsyncs the files, writes the completeness marker and renames the directory into place:

- ``begin``: ``.memsafe-tmp-checkpoint-<step>`` is created with the incomplete sentinel; a complete
  ``checkpoint-<step>`` already there (the same step saved again) is renamed to ``.memsafe-old-checkpoint-<step>``;
  ``checkpoint-<step>`` becomes a link to the temporary directory;
- ``commit``: the link is removed, the temporary directory is finalized into ``checkpoint-<step>``, the old
  one is deleted; only then are older checkpoints rotated out (:func:`rotate`, complete ones only).

A kill at any point leaves every earlier complete checkpoint in place: a link to an unfinished directory is
refused by :func:`~accelerate_memsafe.io.atomic.check_loadable` (it carries the sentinel) and skipped by
:func:`newest_complete`; :func:`repair` removes it and puts a renamed previous checkpoint back.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from ..errors import CheckpointError
from ..io import atomic

#: transformers' checkpoint folder names (``PREFIX_CHECKPOINT_DIR`` + ``-<step>``, as ``get_last_checkpoint`` reads them).
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def _old_dir(final: Path) -> Path:
    return final.parent / f"{atomic.OLD_PREFIX}{final.name}"


def begin(final: str | os.PathLike) -> Path:
    """Prepares ``final`` to receive a checkpoint atomically and returns the directory the files really go to.

    Args:
        final: The checkpoint directory the Trainer will write (``<run_dir>/checkpoint-<step>``).

    Returns:
        The temporary directory (``final`` now links to it).

    Example:
        >>> # temp = begin("out/checkpoint-10"); ...Trainer writes out/checkpoint-10/...; commit("out/checkpoint-10", temp, world_size=2)
    """
    final = Path(final)
    repair(final)
    temp = atomic.temp_dir_for(final)
    atomic.begin(temp)
    if final.exists():
        # the same step saved again: keep the complete one under the name `atomic.recover` restores from
        old = _old_dir(final)
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.symlink(temp.name, final, target_is_directory=True)
    atomic._fsync_dir(final.parent)
    return temp


def commit(final: str | os.PathLike, temp: Path, *, world_size: int) -> dict:
    """Finalizes a checkpoint written through the link made by :func:`begin`.

    Returns:
        The completeness marker written (files and sizes).
    """
    final = Path(final)
    if final.is_symlink():
        os.unlink(final)
    marker = atomic.finalize(temp, final, world_size=world_size)
    old = _old_dir(final)
    if old.exists():
        shutil.rmtree(old)
    return marker


def _is_link_to_unfinished(path: Path) -> bool:
    return path.is_symlink() and (not path.exists() or atomic.is_temp_dir(path.resolve()))


def repair(final: str | os.PathLike) -> bool:
    """Undoes what a killed save of ``final`` left: a link to an unfinished directory and that directory
    are removed, a previous checkpoint renamed away by :func:`begin` is put back (or deleted when ``final``
    is complete).

    Returns:
        Whether anything was changed.
    """
    final = Path(final)
    changed = False
    if _is_link_to_unfinished(final):
        os.unlink(final)
        changed = True
    temp = atomic.temp_dir_for(final)
    if temp.is_dir() and not final.is_symlink():
        shutil.rmtree(temp)
        changed = True
    old = _old_dir(final)
    if old.is_dir():
        if final.is_dir():
            shutil.rmtree(old)  # the new one was put in place: the kill came after the commit's rename
        else:
            os.rename(old, final)  # what was there before the save began, finished or not, as it was
        changed = True
    if changed:
        atomic._fsync_dir(final.parent)
    return changed


def repair_all(run_dir: str | os.PathLike) -> list[str]:
    """:func:`repair` for every checkpoint name in ``run_dir`` (finished, linked, temporary or renamed away).

    Returns:
        The names repaired.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    names = set()
    for entry in run_dir.iterdir():
        name = entry.name.removeprefix(atomic.TEMP_PREFIX).removeprefix(atomic.OLD_PREFIX)
        if CHECKPOINT_NAME.match(name):
            names.add(name)
    return sorted(n for n in names if repair(run_dir / n))


def step_of(path: str | os.PathLike) -> int | None:
    """The step in a checkpoint folder name (``checkpoint-12`` -> 12), ``None`` for other names.

    Example:
        >>> step_of("out/checkpoint-12"), step_of("out/.memsafe-tmp-checkpoint-12")
        (12, None)
    """
    found = CHECKPOINT_NAME.match(Path(path).name)
    return int(found.group(1)) if found else None


def complete_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """The finished ``checkpoint-<step>`` directories of ``run_dir``, oldest step first. A link to an
    unfinished directory, a temporary directory and a directory carrying the incomplete sentinel are left out;
    a directory written by the stock Trainer (no marker) counts as finished."""
    return [p for p in atomic.complete_checkpoints(run_dir) if step_of(p) is not None and not p.is_symlink()]


def newest_complete(run_dir: str | os.PathLike, *, world_size: int | None = None) -> Path | None:
    """The newest finished checkpoint of ``run_dir``, checked with
    :func:`~accelerate_memsafe.io.atomic.check_loadable` (``None`` when there is none).

    Raises:
        CheckpointError: If the newest finished checkpoint's files do not match its completeness marker
            (truncated or modified after it was written), naming the file.
    """
    found = complete_checkpoints(run_dir)
    if not found:
        return None
    atomic.check_loadable(found[-1], world_size=world_size)
    return found[-1]


def rotate(run_dir: str | os.PathLike, save_total_limit: int | None, *, keep: str | os.PathLike,
           best: str | os.PathLike | None = None) -> list[Path]:
    """Deletes the oldest finished checkpoints so that at most ``save_total_limit`` remain, never ``keep``
    (the one just committed) nor ``best`` (the Trainer's ``best_model_checkpoint``), as the Trainer's own
    rotation does; unfinished ones are neither counted nor deleted (:func:`repair` handles them). Runs after
    ``keep`` was committed, so a kill never leaves fewer finished checkpoints than before the save.

    Returns:
        The directories deleted.
    """
    if save_total_limit is None or save_total_limit <= 0:
        return []
    found = complete_checkpoints(run_dir)
    protected = {Path(keep).resolve()}
    if best is not None:
        protected.add(Path(best).resolve())
    keep_count = max(save_total_limit, len([p for p in found if p.resolve() in protected]))
    deleted = []
    remaining = len(found)
    for path in found:
        if remaining <= keep_count:
            break
        if path.resolve() not in protected:
            shutil.rmtree(path)
            deleted.append(path)
            remaining -= 1
    return deleted


def locate_best(recorded: str | None, best_step: int | None, *, search: list[str | os.PathLike],
                world_size: int | None = None) -> str | None:
    """Finds the best checkpoint again after a resume: ``recorded`` (the Trainer state's
    ``best_model_checkpoint``) when it is a finished checkpoint, else ``checkpoint-<best_step>`` in the first
    of ``search`` (the resumed checkpoint's folder, the new output directory) that holds a finished one.

    Returns:
        The path, or ``None`` when no finished copy exists.
    """
    candidates = [Path(recorded)] if recorded else []
    if best_step is not None:
        candidates += [Path(folder) / f"checkpoint-{best_step}" for folder in search]
    for path in candidates:
        if not path.is_dir() or path.is_symlink() or atomic.is_temp_dir(path):
            continue
        try:
            atomic.check_loadable(path, world_size=world_size)
        except CheckpointError:
            continue
        return str(path)
    return None
