"""The background commit of ``save_state`` on 2 gloo ranks (FSDP2): ``save_state`` returns before rank 0's commit,
no collective ever runs outside the main thread, ``wait_for_everyone()`` lets every rank see the committed
checkpoint, a failed commit is raised on every rank (and the hooks work again afterwards), and ``save_state``
then ``load_state`` at once loads the new checkpoint bitwise. One spawn runs every check."""

from __future__ import annotations

import threading
from typing import Any

from accelerate_memsafe.io import atomic
from tests.spawn import run_on_ranks

COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_gather_object", "broadcast_object_list", "gather", "scatter", "reduce", "monitored_barrier")


def _record_collective_threads() -> list[str]:
    """Wraps torch.distributed's collectives to record the thread that calls each."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    seen: list[str] = []
    for name in COLLECTIVES:
        original = getattr(c10d, name)

        def wrapped(*args: Any, _original=original, **kwargs: Any) -> Any:
            seen.append(threading.current_thread().name)
            return _original(*args, **kwargs)

        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    return seen


def worker(rank: int, world_size: int, *, root: str) -> dict[str, Any]:
    import errno
    import os
    import time

    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_memsafe import Accelerator, CheckpointError, MemSafePlugin
    from accelerate_memsafe.io import atomic
    from accelerate_memsafe.models import build_llama

    threads = _record_collective_threads()
    acc = Accelerator(plugins=[MemSafePlugin(progress=False)], fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = build_llama("tiny", seed=0)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    def step(i: int) -> None:
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(10 * i + rank))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()

    real_fsync = atomic._fsync_file
    mode = {"fsync": "slow"}

    def fsync(path: Any) -> None:
        if mode["fsync"] == "full":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        time.sleep(0.03)  # a slow disk: the commit is still running when save_state returns
        real_fsync(path)

    atomic._fsync_file = fsync
    out: dict[str, Any] = {}
    step(0)
    first = os.path.join(root, "first")
    acc.save_state(first)
    out["committed_when_save_returned"] = os.path.exists(os.path.join(first, atomic.MARKER))
    step(1)  # trains while rank 0 commits
    acc.wait_for_everyone()
    out["committed_after_wait_for_everyone"] = os.path.exists(os.path.join(first, atomic.MARKER))
    mode["fsync"] = "full"
    acc.save_state(os.path.join(root, "second"))
    try:
        acc.wait_for_everyone()
        out["failed_commit"] = None
    except CheckpointError as exc:
        out["failed_commit"] = str(exc)
    out["second_in_place"] = os.path.exists(os.path.join(root, "second"))
    mode["fsync"] = "slow"
    step(2)
    third = os.path.join(root, "third")
    acc.save_state(third)
    saved = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    step(3)
    acc.load_state(third)  # at once: the load waits for the commit
    out["loaded_equal"] = all(torch.equal(saved[n], p.to_local()) for n, p in model.named_parameters())
    acc.save_state(os.path.join(root, "fourth"))
    acc.end_training()  # commits the last save, then destroys the process group
    out["fourth_committed"] = os.path.exists(os.path.join(root, "fourth", atomic.MARKER))
    out["collective_threads"] = sorted(set(threads))
    return out


def test_background_commit_on_two_ranks(tmp_path):
    r0, r1 = run_on_ranks(worker, 2, init_process_group=False, timeout=300, root=str(tmp_path))
    assert r0["committed_when_save_returned"] is False, "save_state waited for rank 0's commit"
    for rank, r in enumerate((r0, r1)):
        assert r["committed_after_wait_for_everyone"], f"rank {rank} does not see the checkpoint after wait_for_everyone"
        assert r["failed_commit"] and "failed in the background on rank 0: OSError: [Errno 28] No space left" in \
            r["failed_commit"], (rank, r["failed_commit"])
        assert not r["second_in_place"]
        assert r["loaded_equal"], f"rank {rank}: load_state right after save_state did not load the new checkpoint"
        assert r["fourth_committed"]
        assert r["collective_threads"] == ["MainThread"], f"rank {rank}: collectives ran from {r['collective_threads']}"
    atomic.check_loadable(tmp_path / "third", world_size=2)
