"""Workers of the fail-fast tests: FSDP2 on 2 gloo ranks with the plugin at its DEFAULT
``collective_timeout_s`` (600 s), one rank made to raise inside a chosen stage. Module level so that spawn
can pickle them."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

#: The message of every injected error, so that the tests can find it on the other rank.
INJECTED = "injected failure: weights of `model.layers.0.mlp.up_proj.weight` unreadable"


def _accelerator(**options: Any):
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_memsafe import Accelerator, MemSafePlugin

    plugin = MemSafePlugin(progress=False, **options)
    return Accelerator(plugins=[plugin], fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))


def _inject(stage: str, when: str) -> None:
    """Makes this rank raise in ``stage``: ``when="before"`` its first collective, ``"while"`` in the
    middle of the scatter (rank 0 reading a weight after some buckets went out), ``"after"`` its last one
    (``buffer_init``)."""
    from accelerate_memsafe.errors import CheckpointError

    if stage == "rank0_distribute":
        import accelerate_memsafe.stages.rank0_distribute as mod

        original = mod.distribute_from_rank0

        def distribute(model, source, **kwargs):
            if when == "before":
                raise CheckpointError(INJECTED)
            calls = itertools.count()
            read_rows = source.read_rows

            def failing_read_rows(name, start, stop, out, cols=None):
                if next(calls) == 12:
                    raise CheckpointError(INJECTED)
                return read_rows(name, start, stop, out, cols)

            source.read_rows = failing_read_rows
            return original(model, source, **kwargs)

        mod.distribute_from_rank0 = distribute
    elif stage == "buffer_init":
        import accelerate_memsafe.stages.buffer_init as mod

        original_init = mod.init_non_persistent_buffers

        def init_buffers(*args: Any, **kwargs: Any) -> Any:
            if when == "after":  # its collectives done: the last of the stages' before accelerate's call
                original_init(*args, **kwargs)
            raise RuntimeError(INJECTED)

        mod.init_non_persistent_buffers = init_buffers
    else:
        raise ValueError(stage)


def _linger(rank: int, world_size: int, key: str, linger_s: float) -> None:
    """Every rank reports that its hook ended, and waits (up to ``linger_s``) until all did: the failing
    rank stays alive with its process group open, as a process that catches its error or is slow to exit
    does. (A failing rank that exits closes its connections, which ends its peers' waits for another
    reason: gloo sees the lost connection.)"""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    deadline = time.monotonic() + linger_s
    while store.add(key, 0) < world_size and time.monotonic() < deadline:
        time.sleep(0.05)


def _outcome(call: Callable[[], Any]) -> dict[str, Any]:
    """How ``call()`` ended: its wall time, and the error's type, message and memsafe fields if it raised."""
    started, exc = time.monotonic(), None
    try:
        call()
    except Exception as error:
        exc = error
    out: dict[str, Any] = {"elapsed": time.monotonic() - started, "error": None}
    if exc is not None:
        out.update(error=type(exc).__name__, message=str(exc))
        for attr in ("failed_rank", "stage", "hook", "peer_message", "collective_abandoned"):
            if hasattr(exc, attr):
                out[attr] = getattr(exc, attr)
    return out


def fail_in_prepare(rank: int, world_size: int, *, failing_rank: int, stage: str, linger_s: float,
                    when: str = "before", then_save: str | None = None, **options: Any) -> dict[str, Any]:
    """``failing_rank`` raises in ``stage`` of ``prepare``; every rank reports how its ``prepare`` ended and
    how long it took, the failing rank staying alive until the others have (at most ``linger_s``). With
    ``then_save``, every rank then calls ``save_state(then_save)`` and reports that too (under ``"next"``)."""
    import torch

    from accelerate_memsafe.models import build_llama

    acc = _accelerator(**options)
    if rank == failing_rank:
        _inject(stage, when)
    model = build_llama("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = _outcome(lambda: acc.prepare(model, opt))
    _linger(rank, world_size, "tests/prepare_ended", linger_s)
    if then_save is not None:
        out["next"] = _outcome(lambda: acc.save_state(then_save))
    return out


def caught_failure_then_next_hooks(rank: int, world_size: int, *, ckpt: str, linger_s: float) -> dict[str, Any]:
    """``prepare``; then a ``save_state`` in which rank 0 raises in ``dataloader_resume`` (after the
    stage's collectives: rank 1 learns of it at the agreement before accelerate's save) and every rank
    catches its error; then ``save_state`` and ``load_state`` again, which must work."""
    import os

    import torch

    from accelerate_memsafe.models import build_llama
    from accelerate_memsafe.stages.dataloader_resume import DataLoaderResumeStage

    acc = _accelerator()
    model = build_llama("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    if rank == 0:
        original = DataLoaderResumeStage.run
        calls = itertools.count()

        def run_once_failing(self, ctx):
            if next(calls) == 0:
                raise OSError(INJECTED)
            return original(self, ctx)

        DataLoaderResumeStage.run = run_once_failing
        DataLoaderResumeStage.skip_reason = lambda self, ctx: None  # no dataloader here: make the stage run
    out: dict[str, Any] = {}
    out["failed_hook"] = _outcome(lambda: acc.save_state(ckpt))
    _linger(rank, world_size, "tests/failed_hook_ended", linger_s)
    out["next_hooks"] = _outcome(lambda: (acc.save_state(ckpt), acc.load_state(ckpt)))
    out["saved"] = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else None
    return out
