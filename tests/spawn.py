"""Run a function on N gloo ranks in fresh processes, with a timeout (a deadlock fails, never hangs).

    results = run_on_ranks(worker_fn, world_size=2, timeout=120, model_dir=str(path))

``worker_fn(rank, world_size, **kwargs)`` must be a module-level function (it is pickled by name). Each
rank gets the launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR/PORT``) and,
unless ``init_process_group=False``, an initialised gloo process group that is destroyed afterwards.
What each rank returns comes back in rank order; an exception on any rank fails the call with that
rank's traceback.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, rank, world_size, port, env, init_pg, kwargs, queue):
    os.environ.update(env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
    )
    import torch
    import torch.distributed as dist

    try:
        if init_pg:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = fn(rank, world_size, **kwargs)
        buf = io.BytesIO()
        torch.save(out, buf)  # tensors travel as bytes, not as shared-memory handles of a dying process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        # every rank finishes its communication before any rank tears gloo down
        from accelerate_memsafe.distributed.collectives import end_process_group

        end_process_group()


#: Imported once by the fork server: every rank then starts as a fork of a process that already paid for them
#: (about 5 s of CPU per rank otherwise, most of a small test's time). Importing these starts no thread and
#: reads no per-test setting (each rank's environment is set after the fork, before any process group).
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "accelerate",
           "transformers", "transformers.models.llama.modeling_llama", "accelerate_memsafe", "tests.spawn")

_CTX = None


def _context():
    """The ``forkserver`` context with :data:`PRELOAD` (``MEMSAFE_TEST_SPAWN=spawn``: plain spawn, each rank a
    fresh interpreter)."""
    global _CTX
    if _CTX is None:
        if os.environ.get("MEMSAFE_TEST_SPAWN") == "spawn":
            _CTX = mp.get_context("spawn")
        else:
            _CTX = mp.get_context("forkserver")
            _CTX.set_forkserver_preload(list(PRELOAD))
    return _CTX


class RankFailure(AssertionError):
    """A rank raised, died, or did not finish in time."""


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    timeout: float = 180.0,
    env: dict[str, str] | None = None,
    init_process_group: bool = True,
    expect_failure: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(rank, world_size, **kwargs)`` on ``world_size`` spawned processes.

    Args:
        fn: Module-level worker.
        world_size: Number of ranks.
        timeout: Seconds for the whole run; then every rank is killed and the call fails.
        env: Extra environment variables for every rank.
        init_process_group: Initialise gloo before calling ``fn`` (off when ``fn`` builds an Accelerator).
        expect_failure: Return ``[(status, payload), ...]`` per rank instead of raising on errors.

    Returns:
        What each rank returned, in rank order.

    Raises:
        RankFailure: If a rank raised, exited without reporting, or the timeout passed.
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, dict(env or {}), init_process_group, kwargs, queue))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise RankFailure(f"rank(s) {missing} did not finish within {timeout:.0f}s (deadlock?)")
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 1.0))
                results[rank] = (status, payload)
            except Exception:  # queue.Empty: check for dead ranks
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead and all(not procs[r].is_alive() for r in dead):
                    time.sleep(0.5)  # give the queue a moment to deliver
                    while not queue.empty():
                        rank, status, payload = queue.get()
                        results[rank] = (status, payload)
                    dead = [r for r in dead if r not in results]
                    if dead:
                        codes = {r: procs[r].exitcode for r in dead}
                        if expect_failure:
                            for r in dead:
                                results[r] = ("died", codes[r])
                            continue
                        raise RankFailure(f"rank(s) {dead} died without reporting (exit codes {codes})") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if expect_failure:
        import torch

        return [
            (st, torch.load(io.BytesIO(pl), weights_only=False) if st == "ok" else pl)
            for st, pl in (results[r] for r in range(world_size))
        ]
    errors = {r: payload for r, (status, payload) in results.items() if status != "ok"}
    if errors:
        raise RankFailure("\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items())))
    import torch

    return [torch.load(io.BytesIO(results[r][1]), weights_only=False) for r in range(world_size)]
