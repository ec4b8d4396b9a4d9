"""``atomic_checkpoint``: checkpoints appear complete or not at all; loads refuse incomplete ones."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path
from typing import Any

from ..distributed.collectives import Collectives
from ..errors import CheckpointError
from ..io import atomic, validate
from ..memory.report import StageRecord
from ..pipeline import HookContext, Stage, StageOutcome, ran, skipped


def commit(temp: Path, final: Path, *, world_size: int, carry_over: bool = False,
           rotate: tuple[Path, int | None] | None = None) -> dict[str, Any]:
    """Rank 0's commit of a written checkpoint: fsync, marker, swap into place
    (:func:`~accelerate_memsafe.io.atomic.finalize`), then the ``total_limit`` rotation of automatic naming.
    File work only (no collective), so it may run in a background thread.

    Args:
        temp: The directory every rank wrote into.
        final: Where the checkpoint goes.
        world_size: Number of processes that wrote it.
        carry_over: Keep the previous directory's other files (``save_model``).
        rotate: ``(folder, total_limit)`` of automatic checkpoint naming, or ``None``.

    Returns:
        The figures for the report: ``final``, ``files``, ``bytes`` and, with ``rotate``, the ``deleted`` directories.
    """
    marker = atomic.finalize(temp, final, world_size=world_size, carry_over=carry_over)
    details: dict[str, Any] = {"final": str(final), "files": len(marker["files"]), "bytes": sum(marker["files"].values())}
    if rotate is not None:
        deleted = atomic.roll_total_limit(rotate[0], rotate[1], keep=final)
        details["deleted"] = [str(p) for p in deleted]
    return details


class AtomicCheckpointStage(Stage):
    """On ``save_state`` / ``save_model``: accelerate writes into a temporary directory, which is fsynced,
    marked complete and swapped into place once every rank is done (the previous checkpoint of the same
    name survives until then). With accelerate's automatic checkpoint naming the name is resolved here, and
    the rolling ``total_limit`` deletion runs after the new checkpoint is complete.

    With ``async_checkpoint`` (the default) ``save_state`` returns once every rank has written its files (the
    barrier that says so stays on the critical path); rank 0 commits in a background thread, and the next
    hook, ``wait_for_everyone()`` or ``end_training()`` waits for it (see :mod:`accelerate_memsafe.background`).
    ``save_model`` commits before it returns.

    On ``load_state``: resolves the latest *complete* checkpoint when no directory is given, and refuses a
    temporary, incomplete or truncated directory, or one written by another number of processes that
    holds files only that number can load (:func:`~accelerate_memsafe.io.atomic.per_rank_files`), before
    anything is loaded. A checkpoint of another world size that can be resharded loads, with a warning
    naming what is not restored on this rank (its random states, when it has no ``random_states_<rank>.pkl``).
    """

    name = "atomic_checkpoint"
    hooks = ("save_state", "save_model", "load_state")
    run_before = ("optimizer_cpu_reload",)
    summary = "write checkpoints under a temp name, fsync, swap in; refuse incomplete ones on load"

    def skip_reason(self, ctx: HookContext) -> str | None:
        if ctx.directory is not None:
            return None
        config = ctx.scratch.get("project_configuration")
        if ctx.hook != "save_model" and config is not None and config.automatic_checkpoint_naming:
            return None  # the name is resolved from the project configuration
        return "no input directory given (accelerate raises)" if ctx.hook == "load_state" else "no output directory given"

    def run(self, ctx: HookContext) -> StageOutcome:
        if ctx.hook == "load_state":
            return self._check_load(ctx)
        config = ctx.scratch.get("project_configuration")
        auto = ctx.hook == "save_state" and config is not None and config.automatic_checkpoint_naming
        temp_parent = None
        if auto:
            folder = Path(config.project_dir) / "checkpoints"
            final = folder / f"checkpoint_{config.iteration}"
            if final.exists():
                raise CheckpointError(
                    f"Checkpoint directory {final} ({config.iteration}) already exists. Please manually override "
                    "`accelerator.project_configuration.iteration` with what iteration to start with."
                )
            # accelerate lists every entry of `checkpoints/`: keep temporary directories out of it.
            temp_parent = Path(config.project_dir)
            ctx.scratch["upstream_explicit_dir"] = True
        else:
            final = Path(ctx.directory).expanduser()
            if final.is_file():
                return skipped(f"{final} is a file (accelerate raises)")
        temp = atomic.temp_dir_for(final, parent=temp_parent)
        if ctx.rank == 0:
            atomic.recover(final)
            atomic.begin(temp)
        coll = self._collectives(ctx)
        if coll is not None:
            coll.barrier(what=f"barrier before writing {temp}")
        ctx.scratch["atomic"] = {"final": final, "temp": temp, "auto": auto, "coll": coll}
        ctx.directory = str(temp)
        return ran(final=str(final), temp=str(temp))

    def after(self, ctx: HookContext) -> StageOutcome | None:
        if ctx.hook == "load_state":
            return None
        info = ctx.scratch.pop("atomic")
        final, temp, coll = info["final"], info["temp"], info["coll"]
        if coll is not None:
            coll.barrier(what=f"barrier after every rank wrote its files into {temp}")
        rotate = (final.parent, ctx.scratch["project_configuration"].total_limit) if info["auto"] else None
        work = partial(commit, temp, final, world_size=ctx.world_size, carry_over=ctx.hook == "save_model", rotate=rotate)
        details: dict = {}
        if ctx.hook == "save_state" and self.options.async_checkpoint and ctx.background is not None:
            origin = self.options.pipeline.origin
            ctx.background.start(f"the commit of {final}", work if ctx.rank == 0 else None, rank=ctx.rank,
                                 world_size=ctx.world_size, on_done=partial(self._record_commit, ctx.hook, ctx.rank, origin))
            details = {"commit": "background"}
        else:
            if ctx.rank == 0:
                details = work()
            if coll is not None:
                coll.barrier(what=f"barrier after {final} was put in place")
        ctx.directory = str(final)
        if isinstance(ctx.result, (str, Path)) and Path(ctx.result) == temp:
            ctx.result = str(final)
        return ran(**details)

    def _record_commit(self, hook: str, rank: int, origin: float, task: Any) -> None:
        """Adds the background commit's record (its wall time; no memory figures: the thread is not probed)."""
        ok = task.error is None
        self.options.report.add(StageRecord(
            hook=hook, stage=f"{self.name}.commit", rank=rank, status="ran" if ok else "failed",
            reason=None if ok else f"{type(task.error).__name__}: {task.error}", wall_s=task.wall_s or 0.0,
            start_s=task.started_at - origin, segments=[[task.started_at - origin, task.wall_s or 0.0]],
            details={"background": True, **(task.result or {})},
        ))

    def _collectives(self, ctx: HookContext) -> Collectives | None:
        """Timeout-guarded collectives of this stage (``None`` in a single process)."""
        import torch.distributed as dist

        if ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
            return Collectives(self.name, timeout_s=self.options.collective_timeout_s)
        return None

    def _check_load(self, ctx: HookContext) -> StageOutcome:
        config = ctx.scratch.get("project_configuration")
        if ctx.directory is None:  # automatic naming (skip_reason)
            folder = Path(config.project_dir) / "checkpoints"
            found = atomic.complete_checkpoints(folder)
            if not found:
                raise CheckpointError(f"no complete checkpoint in {folder} to resume from.")
            ctx.directory = str(found[-1])
        path = Path(ctx.directory).expanduser()
        if ctx.rank == 0:
            atomic.recover(path)
        coll = self._collectives(ctx)
        if coll is not None:
            coll.barrier(what=f"barrier before loading {path}")
        marker = atomic.check_loadable(path, world_size=ctx.world_size)
        validate.check_accelerate_checkpoint(path, ctx.models, rank=ctx.rank, strict=ctx.kwargs.get("strict", True) is not False)
        ctx.directory = str(path)
        saved = atomic.saved_world_size(path, marker)
        if saved is None or saved == ctx.world_size:
            return ran(directory=str(path), marked_complete=marker is not None)
        rng = path / f"random_states_{ctx.rank}.pkl"
        warnings.warn(
            f"checkpoint {path} was written by {saved} process(es) and is loaded by {ctx.world_size}: model and "
            "optimizer state are resharded" + ("" if rng.is_file() else f"; rank {ctx.rank} has no {rng.name} and "
            "keeps its current random states (as stock accelerate does)") + "; dataloaders resume as stock "
            "accelerate resumes them (the data is split differently, so the batch order is not the old run's).",
            stacklevel=2,
        )
        return ran(directory=str(path), marked_complete=marker is not None, resharded_from=saved,
                   random_states=rng.is_file())
