"""Work a hook leaves running after it returns, and how the next hook settles it.

``save_state`` returns once every rank has written its files; rank 0 then commits the checkpoint (fsync of
every file, completeness marker, swap into place, ``total_limit`` rotation) in a thread of its own while the
training loop goes on, as torch DCP's ``async_save`` and Orbax do. The thread touches files only: a
collective issued from it would interleave with the training loop's own (gloo and NCCL pair ops up by
order), so every collective about the commit runs on the main thread, in :meth:`BackgroundWork.settle`.

Every rank records that a commit is pending (the rank that runs nothing still takes part in the settle), in
one :class:`BackgroundWork` per process (:func:`process_work`). Every later hook (``prepare``, ``load_state``,
``save_state``, ``save_model``) of any accelerator of the process (a script that builds a new ``Accelerator``
to resume in the same process sees the checkpoint in place) and ``Accelerator.wait_for_everyone()`` /
``end_training()`` settle it first: rank 0 waits for its thread and broadcasts the outcome, and an error of the
commit is raised on every rank, never swallowed. The thread is not a daemon: the interpreter waits for it
before exiting, and an error that nothing waited for is printed at exit.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .errors import CheckpointError


#: The name of the thread that runs a hook's background work.
THREAD_NAME = "memsafe-background"


class BackgroundTask:
    """Runs ``fn()`` in a non-daemon thread and keeps its result or exception.

    Args:
        fn: The work; it must not issue collectives.
        name: The thread's name.

    Example:
        >>> task = BackgroundTask(lambda: 42, name="demo")
        >>> task.wait()
        42
    """

    def __init__(self, fn: Callable[[], Any], *, name: str) -> None:
        self._fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.started_at = time.perf_counter()
        self.wall_s: float | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.result = self._fn()
        except BaseException as exc:  # kept for the main thread, which raises it
            self.error = exc
        finally:
            self.wall_s = time.perf_counter() - self.started_at

    def done(self) -> bool:
        """Whether the work has finished (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> Any:
        """Waits for the work and returns its result.

        Raises:
            BaseException: The exception the work raised.
        """
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.result


class BackgroundWork:
    """The work this process's last hook left pending (at most one item: the next hook settles it first).

    Example:
        >>> work = BackgroundWork()
        >>> work.start("the commit of /ckpt/step_10", lambda: {"files": 3}, rank=0)
        >>> work.wait()
        {'files': 3}
        >>> work.pending is None
        True
    """

    def __init__(self) -> None:
        self._world_size = 1
        self.pending: str | None = None
        """What is pending (on every rank), e.g. ``"the commit of /ckpt/step_10"``; ``None``: nothing."""
        self.task: BackgroundTask | None = None
        """The thread doing it, on the rank that runs it (rank 0); ``None`` elsewhere."""
        self._reported = True
        self._on_done: Callable[[BackgroundTask], None] | None = None
        _LIVE.add(self)

    def start(self, what: str, fn: Callable[[], Any] | None, *, rank: int, world_size: int = 1,
              on_done: Callable[[BackgroundTask], None] | None = None) -> None:
        """Records pending work on every rank and starts ``fn`` where it is given (rank 0).

        Args:
            what: What the work is, for error messages.
            fn: The work on this rank (``None`` on ranks that only wait for it).
            rank: This rank (named in messages).
            world_size: Number of ranks that recorded the work (``1``: :meth:`wait` settles it).
            on_done: Called once with the finished task on the rank that ran it, when it is settled (e.g.
                to add its record to the report).

        Raises:
            RuntimeError: If work is still pending (a hook must settle it before starting more).
        """
        if self.pending is not None:
            raise RuntimeError(f"rank {rank}: {self.pending} is still pending; settle it before starting {what}.")
        self.pending = what
        self._world_size = world_size
        self._on_done = on_done
        self._reported = fn is None
        self.task = BackgroundTask(fn, name=THREAD_NAME) if fn is not None else None

    def _finish(self) -> BaseException | None:
        """Waits for this rank's thread (if any); returns its error, calls ``on_done`` once."""
        task = self.task
        if task is None:
            return None
        try:
            task.wait()
        except BaseException as exc:
            error: BaseException | None = exc
        else:
            error = None
        if self._on_done is not None:
            self._on_done(task)
            self._on_done = None
        return error

    def _error(self, what: str, message: str, *, rank: int) -> CheckpointError:
        return CheckpointError(
            f"{what} failed in the background on rank 0: {message}. The previous checkpoint of that name (if any) is "
            f"still in place and loadable; the new one was not put in place. Raised on rank {rank} at the first hook, "
            "`wait_for_everyone()` or `wait_for_checkpoint()` after the save. Fix the cause (disk space, permissions) "
            "and save again."
        )

    def wait(self) -> Any:
        """Waits for this process's own pending work, without any collective (rank 0 waits for its commit, other
        ranks return at once). In a single process the work is then settled; with several processes it stays
        pending until :meth:`settle`, which tells every rank how it ended.

        Returns:
            The result of this rank's work, or ``None`` where it ran nothing.

        Raises:
            CheckpointError: If the work failed (with several processes, raised again by :meth:`settle`).
        """
        if self.pending is None:
            return None
        what, task = self.pending, self.task
        error = self._finish()
        self._reported = True
        if self._world_size == 1:
            self.pending, self.task = None, None
        if error is not None:
            raise self._error(what, f"{type(error).__name__}: {error}", rank=0) from error
        return task.result if task is not None else None

    def settle(self, *, rank: int, world_size: int, timeout_s: float) -> None:
        """Ends the pending work on every rank (a collective when ``world_size > 1``; call it on every rank at the
        same point, from the main thread). A no-op when nothing is pending.

        Raises:
            CheckpointError: On every rank, if the work failed on the rank that ran it.
        """
        if self.pending is None:
            return
        what = self.pending
        error = self._finish()
        message = None if error is None else f"{type(error).__name__}: {error}"
        if world_size > 1:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                from .distributed.collectives import Collectives

                coll = Collectives("background_commit", timeout_s=timeout_s)
                message = coll.broadcast_object(message, src=0, what=f"outcome of {what}")
        self.pending, self.task, self._reported = None, None, True
        if message is not None:
            raise self._error(what, message, rank=rank) from error

    def report_unobserved(self) -> None:
        """At exit: prints an error of the pending work that nothing waited for (the thread has ended by then:
        it is not a daemon, so the interpreter joined it)."""
        task = self.task
        if task is None or self._reported or not task.done() or task.error is None:
            return
        self._reported = True
        print(f"accelerate_memsafe: {self.pending} failed in the background ({type(task.error).__name__}: "
              f"{task.error}); the previous checkpoint is still in place. Call `accelerator.wait_for_everyone()` "
              "or `end_training()` after the last save to get this error as an exception.", file=sys.stderr)


_LIVE: weakref.WeakSet[BackgroundWork] = weakref.WeakSet()
_PROCESS: BackgroundWork | None = None


def process_work() -> BackgroundWork:
    """The :class:`BackgroundWork` of this process, shared by every pipeline (created on first use)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = BackgroundWork()
    return _PROCESS


@atexit.register
def _report_at_exit() -> None:
    for work in list(_LIVE):
        work.report_unobserved()
