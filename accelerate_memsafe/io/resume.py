"""What an exact resume of a shuffled ``StatefulDataLoader`` needs and accelerate does not save.

With ``use_stateful_dataloader=True`` on several processes, accelerate wraps the batch sampler in a
``BatchSamplerShard``, which has no ``state_dict``; torchdata then records only how many batches were
yielded and, on resume, replays the sampler and skips them. A shuffling sampler draws its permutation
from a generator that accelerate seeded from the global RNG at ``prepare`` time, and that has already
moved on by the time of the save, so the replayed permutation differs: a different data order after the
resume. We record the generator state *at the start of each epoch* (a thin sampler wrapper) and restore it
on load, so the replay draws the same permutation; and the generator as it was at the save, set back once
the epoch has been replayed (torchdata's own restore of a ``RandomSampler`` rewinds the generator to the
epoch start but not past the draws that followed it), so the epochs after the resume match too. Each process writes its own file, so nothing is lost
to the single ``dl_state_dict.bin`` that every process of accelerate writes to.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from .. import _compat
from ..errors import CheckpointError


def state_file(directory: str | os.PathLike, rank: int) -> Path:
    """Where rank ``rank`` keeps its dataloader resume state in a checkpoint directory."""
    return Path(directory) / f"memsafe_dataloader_state_{rank}.pt"


def _as_bytes(state: torch.Tensor) -> bytes:
    # Held until the dataloader is next iterated: as bytes, not as a tensor that `load_state` left alive.
    return state.numpy().tobytes()


def _as_tensor(state: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


class EpochStartRecorder(torch.utils.data.Sampler):
    """Wraps a shuffling sampler; remembers the state of its generator when each epoch begins.

    Every other attribute and method (``set_epoch``, ``state_dict``, ``load_state_dict``, ``epoch``,
    ``generator`` ...) is the wrapped sampler's: reads, writes and calls go through to it, so code that
    drives the sampler (accelerate's ``set_epoch``, torchdata's state) behaves as without the wrapper.

    Args:
        sampler: A sampler with a ``generator`` attribute (``torch.utils.data.RandomSampler``).

    Example:
        >>> s = torch.utils.data.RandomSampler(range(4), generator=torch.Generator().manual_seed(0))
        >>> r = EpochStartRecorder(s); _ = list(r); r.epoch_start_state is not None
        True
    """

    _OWN = frozenset({"sampler", "epoch_start_state", "epoch_seed", "_after_replay", "_replay_from", "_replay_seed"})

    def __init__(self, sampler: Any) -> None:
        object.__setattr__(self, "sampler", sampler)
        object.__setattr__(self, "epoch_start_state", None)
        # A `RandomSampler` without a generator draws each epoch's seed from the global RNG: the seed it
        # drew for the current epoch, and the one to use instead of drawing when the epoch is replayed.
        object.__setattr__(self, "epoch_seed", None)
        object.__setattr__(self, "_replay_seed", None)
        # The generator states to set when the replayed epoch begins and once it ends: see `replay_from`.
        object.__setattr__(self, "_replay_from", None)
        object.__setattr__(self, "_after_replay", None)

    def replay_from(self, generator_state: torch.Tensor) -> None:
        """Sets the generator to ``generator_state`` when the next epoch begins, right before the sampler
        draws (a dataloader may draw from the same generator before that, e.g. its base seed)."""
        self._replay_from = _as_bytes(generator_state)

    def replay_seed(self, seed: int, rng_state: torch.Tensor | None = None) -> None:
        """Makes the next epoch of a generator-less ``RandomSampler`` use ``seed`` (the seed the interrupted
        epoch drew) instead of drawing one from the global RNG, which ``load_state`` restored to where it was
        *after* that draw.

        ``rng_state`` is the global RNG as ``load_state`` left it. The replayed epoch's ``DataLoader``
        iterator draws its base seed from the global RNG once more (the uninterrupted run drew it before
        the save); when that one draw is all that happened since, the RNG is set back to ``rng_state``, so
        the following epochs and the training draw what they drew in the uninterrupted run.
        """
        self._replay_seed = (int(seed), None if rng_state is None else rng_state.clone())

    def resume_after(self, generator_state: torch.Tensor) -> None:
        """Sets the generator to ``generator_state`` once an epoch has been iterated to its end (the replay
        of the interrupted epoch, however the dataloader replays it), before the next epoch draws."""
        self._after_replay = _as_bytes(generator_state)

    def __getattr__(self, name: str) -> Any:
        # Only called for names not found on the wrapper; `sampler` missing means a half-built object
        # (unpickling), where delegating would recurse.
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.sampler, name, value)

    def __len__(self) -> int:  # dunders are looked up on the type, so `__getattr__` does not forward them
        return len(self.sampler)

    def __iter__(self):
        generator = getattr(self.sampler, "generator", None)
        if generator is None and isinstance(self.sampler, torch.utils.data.RandomSampler):
            return self._iter_seeded()
        if self._replay_from is not None and generator is not None:
            generator.set_state(_as_tensor(self._replay_from))
        self._replay_from = None
        if generator is not None:
            self.epoch_start_state = generator.get_state()
        if self._after_replay is None or generator is None:
            return iter(self.sampler)
        return _OnExhausted(iter(self.sampler), self._replayed)

    def _iter_seeded(self):
        """What ``RandomSampler.__iter__`` does without a generator (at the first ``next``: draw a seed from
        the global RNG, seed a new generator with it), with the seed recorded, or replayed without a draw."""
        replay, self._replay_seed = self._replay_seed, None
        if replay is None:
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
        else:
            seed, loaded = replay
            if loaded is not None and _one_draw_after(loaded, torch.get_rng_state()):
                torch.set_rng_state(loaded)
        self.epoch_seed = seed
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.sampler.generator = generator
        try:
            inner = iter(self.sampler)
            first = next(inner, _END)  # RandomSampler reads its generator here
        finally:
            self.sampler.generator = None
        if first is _END:
            return
        yield first
        yield from inner

    def _replayed(self) -> None:
        if self._after_replay is not None:
            self.sampler.generator.set_state(_as_tensor(self._after_replay))
            self._after_replay = None


_END = object()


def _one_draw_after(before: torch.Tensor, now: torch.Tensor) -> bool:
    """Whether the CPU RNG state ``now`` is ``before`` advanced by exactly one ``int64`` ``random_()`` draw
    (what a ``DataLoader`` iterator takes for its base seed)."""
    probe = torch.Generator()
    probe.set_state(before)
    torch.empty((), dtype=torch.int64).random_(generator=probe)
    return torch.equal(probe.get_state(), now)


class _OnExhausted:
    """A sampler iterator that calls ``callback`` when it runs out; everything else (torchdata's
    ``state_dict`` / ``load_state_dict``) is the wrapped iterator's."""

    def __init__(self, iterator: Any, callback: Any) -> None:
        self._iterator, self._callback = iterator, callback

    def __getattr__(self, name: str) -> Any:
        if name == "_iterator":
            raise AttributeError(name)
        return getattr(self._iterator, name)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        except StopIteration:
            self._callback()
            raise

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
            if type(child) is torch.utils.data.RandomSampler and child.generator is None:
                return obj, attr  # draws its seed from the global RNG each epoch
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


def _generator(dataloader: Any) -> torch.Generator | None:
    found = _sampler_parent(dataloader)
    recorder = getattr(*found) if found else None
    if not isinstance(recorder, EpochStartRecorder):
        return None
    return getattr(recorder, "generator", None)


def _iterating(dataloader: Any) -> bool:
    """Whether ``dataloader`` is being iterated (between accelerate's ``begin()`` and ``end()``)."""
    from accelerate.state import GradientState

    return any(ref is dataloader for ref in getattr(GradientState(), "dataloader_references", ()))


def _sampler_position_in_state(dataloader: Any) -> bool:
    """Whether accelerate's saved state of a torchdata dataloader restores the sampler's position itself
    (a stateful sampler under torchdata's ``BatchSampler``) rather than by replaying the epoch and skipping."""
    state = getattr(dataloader, "dl_state_dict", None)
    iter_state = state.get("_sampler_iter_state") if isinstance(state, dict) else None
    return isinstance(iter_state, dict) and iter_state.get("sampler_iter_state") is not None and state.get("_num_yielded", 0) > 0


def dataloader_resume_state(dataloader: Any) -> dict[str, Any]:
    """The per-process state that makes the next ``iter(dataloader)`` replay the current epoch's order.

    ``generator_state`` is the generator at the start of the current epoch (what a replay of the epoch
    draws from); ``generator_state_after_epoch`` (when torchdata restores the sampler's position from its
    own state) is the generator as it is now, what the epochs after the current one draw from.

    Example:
        >>> # torch.save([dataloader_resume_state(dl) for dl in dls], state_file(ckpt, rank))
    """
    found = _sampler_parent(dataloader)
    recorder = getattr(*found) if found else None
    generator = _generator(dataloader)
    epoch_end = bool(getattr(dataloader, "end_of_dataloader", False))
    iteration = int(getattr(dataloader, "iteration", 0))
    if epoch_end and _iterating(dataloader):
        iteration += 1  # saved at the last batch: the loop counts the epoch once it has yielded it
    out: dict[str, Any] = {"iteration": iteration}
    if epoch_end:
        # The next `iter()` begins a new epoch (see `restore_dataloader_resume_state`).
        out["epoch_end"] = True
    if generator is None and isinstance(recorder, EpochStartRecorder) and recorder.epoch_seed is not None:
        if not epoch_end:  # mid-epoch: the replay needs its seed
            out["epoch_seed"] = recorder.epoch_seed
        return out
    if generator is not None:
        finished = epoch_end or recorder.epoch_start_state is None
        # At an epoch boundary the next epoch draws from the generator as it is now.
        state = generator.get_state() if finished else recorder.epoch_start_state
        out["generator_state"] = state.clone()
        if _sampler_position_in_state(dataloader) and not epoch_end:
            # torchdata restores the sampler mid-epoch from its own state, rewinding the generator only to
            # the epoch start: the draws that followed (DataLoader's base seed) are not replayed.
            out["generator_state_after_epoch"] = generator.get_state().clone()
    return out


def resume_state_mismatch(dataloader: Any, state: dict[str, Any]) -> str | None:
    """Why ``state`` cannot be applied to ``dataloader`` (``None`` when it can)."""
    if "generator_state" in state and (track_epoch_start(dataloader) is None or _generator(dataloader) is None):
        return "the checkpoint recorded a shuffling generator for it and this dataloader does not shuffle"
    if "epoch_seed" in state and (track_epoch_start(dataloader) is None or _generator(dataloader) is not None):
        return "the checkpoint recorded the seed of a shuffling sampler without a generator, and this dataloader has none"
    return None


def restore_dataloader_resume_state(dataloader: Any, state: dict[str, Any]) -> None:
    """Applies :func:`dataloader_resume_state` output (after accelerate restored the dataloader's own state).

    Once the interrupted epoch has been replayed (torchdata's restore, or accelerate's replay of the
    epoch), the generator is set to where it was at the save, so the following epochs draw the same
    permutations as the uninterrupted run.

    Raises:
        CheckpointError: If the state records a shuffling generator and the dataloader does not shuffle.
    """
    reason = resume_state_mismatch(dataloader, state)
    if reason is not None:
        raise CheckpointError(f"{reason}; prepare the same dataloaders (same `shuffle`) as the run that saved it.")
    if "iteration" in state and hasattr(dataloader, "iteration"):
        dataloader.iteration = int(state["iteration"])
    if state.get("epoch_end"):
        # Saved once the epoch had been yielded: the next `iter()` is a new epoch, drawing (base seed, then
        # permutation) from the generators as they were at the save, so torchdata must not replay the old one.
        _compat.start_next_epoch_fresh(getattr(dataloader, "base_dataloader", dataloader))
    if "epoch_seed" in state:
        track_epoch_start(dataloader).replay_seed(int(state["epoch_seed"]), torch.get_rng_state())
    if "generator_state" not in state:
        return
    generator = _generator(dataloader)
    generator.set_state(state["generator_state"])
    if not state.get("epoch_end"):
        # The epoch-start state was recorded when the sampler began, after the iterator's own draws.
        track_epoch_start(dataloader).replay_from(state["generator_state"])
    if "generator_state_after_epoch" in state:
        track_epoch_start(dataloader).resume_after(state["generator_state_after_epoch"])


def save_states(directory: str | os.PathLike, rank: int, dataloaders: list[Any]) -> Path:
    """Writes this rank's dataloader resume states."""
    path = state_file(directory, rank)
    torch.save([dataloader_resume_state(dl) for dl in dataloaders], path)
    return path


def read_states(directory: str | os.PathLike, rank: int) -> list[dict[str, Any]] | None:
    """This rank's dataloader resume states (``weights_only``), or ``None`` when the checkpoint has none.

    Raises:
        CheckpointError: If the file is truncated or corrupt.
    """
    path = state_file(directory, rank)
    if not path.exists():
        return None
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"dataloader state file {path} is truncated or corrupt ({type(exc).__name__}).") from None


def apply_states(states: dict[int, dict[str, Any]], dataloaders: dict[int, Any], *, source: str) -> list[int]:
    """Applies ``states[i]`` to ``dataloaders[i]`` for every index both hold (by position in ``prepare``
    order, as accelerate pairs its own ``dl_state_dict_<i>.bin``). A state that does not fit its
    dataloader is skipped with a warning.

    Returns:
        The indices restored.
    """
    restored = []
    for i in sorted(states.keys() & dataloaders.keys()):
        reason = resume_state_mismatch(dataloaders[i], states[i])
        if reason is not None:
            warnings.warn(
                f"dataloader {i}: not restoring its resume state from {source}: {reason}. Prepare the "
                "dataloaders in the same order (and with the same `shuffle`) as the run that saved it.",
                stacklevel=3,
            )
            continue
        restore_dataloader_resume_state(dataloaders[i], states[i])
        restored.append(i)
    return restored


def read_upstream_dataloader_state(directory: str | os.PathLike, index: int) -> dict[str, Any] | None:
    """accelerate's own state of dataloader ``index`` in a checkpoint (``dl_state_dict[_<index>].bin``),
    read as accelerate reads it, or ``None`` when there is none (not a ``StatefulDataLoader``)."""
    path = Path(directory) / ("dl_state_dict.bin" if index == 0 else f"dl_state_dict_{index}.bin")
    if not path.is_file():
        return None
    from accelerate.utils import load

    return load(path)
