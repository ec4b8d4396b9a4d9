"""What an exact resume of a shuffled ``StatefulDataLoader`` needs and accelerate does not save.

With ``use_stateful_dataloader=True`` on several processes, accelerate wraps the batch sampler in a
``BatchSamplerShard``, which has no ``state_dict``; torchdata then records only how many batches were
yielded and, on resume, replays the sampler and skips them. A shuffling sampler draws its permutation
from a generator that accelerate seeded from the global RNG at ``prepare`` time, and that has already
moved on by the time of the save, so the replayed permutation differs: a different data order after the
resume. We record the generator state *at the start of each epoch* (a thin sampler wrapper) and restore it
on load, so the replay draws the same permutation. Each process writes its own file, so nothing is lost
to the single ``dl_state_dict.bin`` that every process of accelerate writes to.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError


def state_file(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its dataloader resume state in a checkpoint directory."""
    return Path(directory) / f"memsafe_dataloader_state_{rank}.pt"


class EpochStartRecorder(torch.utils.data.Sampler):
    """Wraps a shuffling sampler; remembers the state of its generator when each epoch begins.

    Args:
        sampler: A sampler with a ``generator`` attribute (``torch.utils.data.RandomSampler``).

    Example:
        >>> s = torch.utils.data.RandomSampler(range(4), generator=torch.Generator().manual_seed(0))
        >>> r = EpochStartRecorder(s); _ = list(r); r.epoch_start_state is not None
        True
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.epoch_start_state: torch.Tensor | None = None

    @property
    def generator(self) -> torch.Generator | None:
        return getattr(self.sampler, "generator", None)

    def __iter__(self):
        if self.generator is not None:
            self.epoch_start_state = self.generator.get_state()
        return iter(self.sampler)

    def __len__(self) -> int:
        return len(self.sampler)


def _sampler_parent(dataloader: Any) -> tuple[Any, str] | None:
    """The object holding the shuffling sampler (and the attribute name), walking
    ``DataLoaderShard -> StatefulDataLoader -> BatchSamplerShard -> BatchSampler -> sampler``."""
    obj = getattr(dataloader, "base_dataloader", dataloader)
    for _ in range(6):
        for attr in ("batch_sampler", "sampler"):
            child = getattr(obj, attr, None)
            if child is None or child is obj:
                continue
            if isinstance(child, EpochStartRecorder) or isinstance(getattr(child, "generator", None), torch.Generator):
                return obj, attr
        nxt = getattr(obj, "batch_sampler", None)
        if nxt is None or nxt is obj:
            return None
        obj = nxt
    return None


def track_epoch_start(dataloader: Any) -> EpochStartRecorder | None:
    """Installs an :class:`EpochStartRecorder` around the dataloader's shuffling sampler (idempotent).

    Returns:
        The recorder, or ``None`` when the dataloader does not shuffle with a generator.
    """
    found = _sampler_parent(dataloader)
    if found is None:
        return None
    parent, attr = found
    current = getattr(parent, attr)
    if isinstance(current, EpochStartRecorder):
        return current
    recorder = EpochStartRecorder(current)
    setattr(parent, attr, recorder)
    return recorder


def dataloader_resume_state(dataloader: Any) -> dict[str, Any]:
    """The per-process state that makes the next ``iter(dataloader)`` replay the current epoch's order.

    Example:
        >>> # torch.save([dataloader_resume_state(dl) for dl in dls], state_file(ckpt, rank))
    """
    found = _sampler_parent(dataloader)
    recorder = getattr(*found) if found else None
    out: dict[str, Any] = {"iteration": int(getattr(dataloader, "iteration", 0))}
    if isinstance(recorder, EpochStartRecorder) and recorder.generator is not None:
        finished = bool(getattr(dataloader, "end_of_dataloader", False)) or recorder.epoch_start_state is None
        # At an epoch boundary the next epoch draws from the generator as it is now.
        state = recorder.generator.get_state() if finished else recorder.epoch_start_state
        out["generator_state"] = state.clone()
    return out


def restore_dataloader_resume_state(dataloader: Any, state: dict[str, Any]) -> None:
    """Applies :func:`dataloader_resume_state` output (after accelerate restored the dataloader's own state)."""
    if "iteration" in state and hasattr(dataloader, "iteration"):
        dataloader.iteration = int(state["iteration"])
    if "generator_state" in state:
        recorder = track_epoch_start(dataloader)
        if recorder is None or recorder.generator is None:
            raise CheckpointError(
                "the checkpoint recorded a shuffling generator for a dataloader that no longer shuffles; "
                "prepare the same dataloaders (same `shuffle`) as the run that saved it."
            )
        recorder.generator.set_state(state["generator_state"])


def save_states(directory: str | os.PathLike, rank: int, dataloaders: list[Any]) -> Path:
    """Writes this rank's dataloader resume states."""
    path = state_file(directory, rank)
    torch.save([dataloader_resume_state(dl) for dl in dataloaders], path)
    return path


def load_states(directory: str | os.PathLike, rank: int, dataloaders: list[Any]) -> int:
    """Reads this rank's dataloader resume states (``weights_only``) and applies them.

    Returns:
        How many dataloaders were restored (0 when the checkpoint has no file for this rank).

    Raises:
        CheckpointError: If the file is unreadable or holds a different number of dataloaders.
    """
    path = state_file(directory, rank)
    if not path.exists():
        return 0
    try:
        states = torch.load(path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"dataloader state file {path} is truncated or corrupt ({type(exc).__name__}).") from None
    if len(states) != len(dataloaders):
        raise CheckpointError(
            f"{path} holds the state of {len(states)} dataloader(s), this run prepared {len(dataloaders)}."
        )
    for dl, st in zip(dataloaders, states):
        restore_dataloader_resume_state(dl, st)
    return len(states)
