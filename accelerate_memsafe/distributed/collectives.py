"""Collectives that cannot hang: every op runs async and is waited on with a deadline.

A rank that died or never reached a collective makes the others fail with
:class:`~accelerate_memsafe.errors.CollectiveTimeoutError` within ``timeout_s``, naming the stage, the
operation and the rank(s) that did not arrive. To name them, a rank still waiting in a collective after
:data:`PEER_CHECK_INTERVAL_S` marks its arrival in the process group's key-value store (one small ``set``;
an op that completes sooner costs no store traffic); on failure the waiting rank looks up which marks are
missing.

A rank that *raised* does not make the others wait that long: inside a hook call (:func:`hook_scope`,
opened by the pipeline) the failing rank publishes its error in the store, and a rank waiting in a
collective looks for it every :data:`PEER_CHECK_INTERVAL_S` seconds (one store round trip, only while an
op is still pending) and raises :class:`~accelerate_memsafe.errors.PeerStageError` naming the stage, the
rank and its message. :meth:`HookScope.agree` is the same check at a point where no collective is posted.

Any stage can use it::

    coll = Collectives("rank0_distribute", timeout_s=options.collective_timeout_s)
    coll.broadcast(tensor, src=0)
"""

from __future__ import annotations

import contextlib
import datetime
import gc
from dataclasses import dataclass
import json
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .. import _compat
from ..errors import CollectiveTimeoutError, ConfigError, PeerStageError, StageError

# Per-process count of Collectives objects created per stage outside a hook call: every rank creates them in
# the same order, so the count is a key prefix that all ranks agree on without communicating.
_GENERATIONS: dict[str, int] = {}

#: Seconds between two looks at the failure board while a collective or an agreement is pending.
PEER_CHECK_INTERVAL_S = 0.25
# A pending op is polled: briefly without sleeping (small ops finish in tens of microseconds), then with
# sleeps doubling up to _SHORT_MAX_SLEEP_S for the first _SHORT_WAIT_S (a metadata exchange between ranks that
# arrive together takes about a millisecond on gloo: a longer sleep would add up to its own length to it), then up
# to _MAX_SLEEP_S, which bounds the latency added to a long transfer.
_SPIN_S = 50e-6
_FIRST_SLEEP_S = 20e-6
_SHORT_WAIT_S = 10e-3
_SHORT_MAX_SLEEP_S = 0.1e-3
_MAX_SLEEP_S = 0.5e-3
# Longest message of a failed rank kept in the store (the rank's own log has the rest).
_MAX_MESSAGE_CHARS = 4000

# Per-process count of hook calls in a multi-process run (same order on every rank, like _GENERATIONS),
# the open hook calls (nested ones on top), and process groups where this rank gave up on a pending op.
_HOOK_CALLS = 0
_SCOPES: list[HookScope] = []
_ABANDONED: list[tuple[weakref.ref, str]] = []


class HookScope:
    """The failure board of one hook call, in the process group's store under ``accelerate_memsafe/hook/<k>``.

    Every rank counts its hook calls in the same order, so ``k`` names the same call on every rank without
    communicating, and a failure the user caught in an earlier call never affects a later one. A rank that
    fails calls :meth:`publish` with ``(rank, stage, hook, message)``; ranks waiting in a :class:`Collectives` op or
    at :meth:`agree` read the board and raise :class:`~accelerate_memsafe.errors.PeerStageError`.

    Args:
        hook: The hook point (``prepare`` ...).
        index: This call's number ``k``.
        store: The process group's key-value store.
        rank: This rank.
        world_size: Number of ranks.
    """

    def __init__(self, hook: str, index: int, *, store: Any, rank: int, world_size: int) -> None:
        self.hook = hook
        self.index = index
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = f"accelerate_memsafe/hook/{index}"
        self.generations: dict[str, int] = {}
        self._failures_key = f"{self.prefix}/failures"
        self._agreements = 0
        self._store_error: str | None = None
        self._drop_after_next: str | None = None

    def publish(self, stage: str, exc: BaseException) -> None:
        """Records on the board that this rank failed in ``stage`` with ``exc``, and wakes the peers waiting at an
        agreement (a few store round trips; never raises: the caller re-raises its own error right after).

        A peer can only be waiting at the agreement this rank would have entered next, or at the one it entered
        last (it may have failed inside it): their ``done`` marks say that it failed, with its record, unless the
        agreement already completed (every rank arrived): a peer then leaves it as it would have, and meets this
        failure at its next agreement or collective."""
        message = f"{type(exc).__name__}: {exc}"
        if len(message) > _MAX_MESSAGE_CHARS:
            message = message[:_MAX_MESSAGE_CHARS] + " [...]"
        record = json.dumps({"rank": self.rank, "stage": stage, "hook": self.hook, "message": message})
        try:
            # one atomic append: a reader that sees the key sees whole records
            self.store.append(self._failures_key, (record + "\n").encode())
            for index in range(max(self._agreements - 1, 0), self._agreements + 1):
                self.store.compare_set(f"{self._agreement_key(index)}/done", b"", _FAILED + record.encode())
        except Exception:
            pass

    def peer_failures(self) -> list[dict[str, Any]]:
        """The failures other ranks published during this hook call, first first (one store round trip
        when there is none; ``[]`` once the store is unreachable, e.g. its host exited)."""
        if self._store_error is not None:
            return []
        try:
            if not self.store.check([self._failures_key]):
                return []
            raw = bytes(self.store.get(self._failures_key)).decode()
        except Exception as exc:  # the collective itself, or the agreement, reports the lost peer
            self._store_error = f"{type(exc).__name__}: {exc}"
            return []
        records = [json.loads(line) for line in raw.splitlines() if line.strip()]
        return [r for r in records if r.get("rank") != self.rank]

    def peer_error(self, failures: list[dict[str, Any]], *, stopped: str, abandoned: bool) -> PeerStageError:
        """The error this rank raises because of ``failures`` (from :meth:`peer_failures`).

        Args:
            failures: The published failures, first first.
            stopped: Where this rank stopped (``"in stage `buffer_init` (broadcast of ...) after 0.3s"``).
            abandoned: Whether this rank left a collective pending.
        """
        first = failures[0]
        others = sorted({f["rank"] for f in failures} - {first["rank"]})
        also = f" (rank(s) {others} failed too)" if others else ""
        if abandoned:
            tail = (
                "This rank left that collective pending, so the ranks' next collectives would pair up wrongly: "
                "do not use this process group again; restart every process (torchrun restarts the whole worker group)."
            )
        else:
            tail = "No collective was left pending: the process group is still usable."
        return PeerStageError(
            f"stage `{first['stage']}` at hook `{first['hook']}` failed on rank {first['rank']}: {first['message']}"
            f"{also}; this rank ({self.rank}) stopped {stopped} instead of waiting for it. "
            f"See rank {first['rank']}'s log for its traceback. {tail}",
            failed_rank=first["rank"], stage=first["stage"], hook=first["hook"], peer_message=first["message"],
            collective_abandoned=abandoned,
        )

    def raise_if_peer_failed(self, *, stopped: str) -> None:
        """Raises :class:`~accelerate_memsafe.errors.PeerStageError` if another rank failed during this call.

        Raises:
            PeerStageError: Naming the first failure (no collective is pending on this rank).
        """
        failures = self.peer_failures()
        if failures:
            raise self.peer_error(failures, stopped=stopped, abandoned=False)

    def agree(self, what: str, *, timeout_s: float) -> None:
        """Waits until every rank has reached this point of the hook call, through the store only (no
        collective is posted, so a rank stopped here by a peer's failure leaves the process group usable).

        Each rank adds one to a counter (and, unless it is the last, marks its arrival); the last to arrive sets the
        agreement's ``done``
        key, which wakes the others at once (the store pushes it to a waiting client: no polling, no backoff
        whose latency would add up over the hook's agreements). A rank that fails sets the ``done`` key of the
        agreement its peers can be waiting at (:meth:`publish`), so they raise at once too. The wait runs in a
        helper thread on a clone of the store (:func:`_wait_for_keys`); this thread stays responsive to
        ``Ctrl-C`` and looks at the failure board every :data:`PEER_CHECK_INTERVAL_S` seconds besides. The ranks
        must call it the same number of times in a hook call.

        Args:
            what: Where in the hook (``"before `accelerate.prepare`"``), for messages.
            timeout_s: Seconds to wait for the other ranks (``collective_timeout_s``).

        Raises:
            PeerStageError: If another rank failed during this hook call.
            CollectiveTimeoutError: If a rank did not arrive within ``timeout_s`` (naming it), or the store
                became unreachable.

        Example:
            >>> # with hook_scope("prepare", rank=rank, world_size=2) as scope:
            >>> #     scope.agree("before `accelerate.prepare`", timeout_s=600)
        """
        self._agree(what, timeout_s=timeout_s)

    def exchange(self, obj: Any, *, what: str, timeout_s: float) -> list[Any]:
        """Every rank's ``obj`` (picklable, small), in rank order, through the store: an agreement whose arrival
        marks carry the objects, then one read of them all. Three store round trips on the rank that arrives last,
        against an all-gather's two collectives on gloo (about twice the time on one node), and a peer that fails
        before it wakes the waiting ranks at once, as at any agreement. Its store traffic grows with the square of
        the ranks: :func:`exchange_objects` takes it up to :data:`STORE_EXCHANGE_MAX_RANKS` ranks only. The ranks
        must call it where they would call :meth:`agree` (it is one).

        Raises:
            PeerStageError: If another rank failed during this hook call.
            CollectiveTimeoutError: If a rank did not arrive within ``timeout_s`` (naming it), or the store
                became unreachable.
        """
        key = self._agree(what, timeout_s=timeout_s, mark=pickle.dumps(obj))
        try:
            keys = [f"{key}/{r}" for r in range(self.world_size)]
            raw = self.store.multi_get(keys)
        except Exception as exc:
            raise CollectiveTimeoutError(
                f"hook `{self.hook}`: the exchange {what} on rank {self.rank} failed: the process group's store is "
                f"unreachable ({type(exc).__name__}: {exc}); the process hosting it (rank 0, or the torchrun agent) "
                "has probably exited. Check its log."
            ) from exc
        # every rank read the others' objects before its next agreement: this rank's is dropped once that completes
        self._drop_after_next = f"{key}/{self.rank}"
        return [pickle.loads(bytes(b)) for b in raw]

    def _agree(self, what: str, *, timeout_s: float, mark: bytes | None = None) -> str:
        """:meth:`agree`; ``mark``: what this rank's arrival mark holds (set before it counts itself in, so every
        rank's is there once the agreement completes), else ``b"1"``, set by the ranks that wait only. Returns the
        agreement's key."""
        key = self._agreement_key(self._agreements)
        self._agreements += 1
        stopped = f"at the agreement {what} (its own stages had finished)"
        started = time.monotonic()
        try:
            if mark is not None:
                self.store.set(f"{key}/{self.rank}", mark)
            if self.store.add(key, 1) >= self.world_size:
                # every rank arrived, so none failed before this point (a rank that failed never arrives)
                self.store.set(f"{key}/done", _ALL_ARRIVED)
                self._drop_exchanged()
                return key
            # the mark names this rank as arrived should the agreement time out; the last rank to arrive, which ends
            # it, needs none: one store round trip fewer where it counts
            if mark is None:
                self.store.set(f"{key}/{self.rank}", b"1")
            waiting = _wait_for_keys(self.store, [f"{key}/done"], timeout_s)
            deadline = started + timeout_s
            while not waiting.finished.wait(max(min(PEER_CHECK_INTERVAL_S, deadline - time.monotonic()), 0.0)):
                now = time.monotonic()
                self.raise_if_peer_failed(stopped=f"{stopped} after {now - started:.1f}s")
                if now >= deadline:
                    raise self._agreement_timeout(key, what, timeout_s)
            if waiting.error is not None:
                if time.monotonic() - started >= timeout_s:
                    raise self._agreement_timeout(key, what, timeout_s)
                raise waiting.error
            done = bytes(self.store.get(f"{key}/done"))
            if done != _ALL_ARRIVED:  # a peer failed: its record is on the board, and in the mark itself
                failures = self.peer_failures() or [json.loads(done[len(_FAILED):].decode())]
                raise self.peer_error(failures, stopped=f"{stopped} after {time.monotonic() - started:.1f}s",
                                      abandoned=False)
            self._drop_exchanged()
            return key
        except (PeerStageError, CollectiveTimeoutError, ConfigError):
            raise
        except Exception as exc:
            raise CollectiveTimeoutError(
                f"hook `{self.hook}`: the agreement {what} on rank {self.rank} failed: the process group's store is "
                f"unreachable ({type(exc).__name__}: {exc}); the process hosting it (rank 0, or the torchrun agent) "
                "has probably exited. Check its log."
            ) from exc

    def _drop_exchanged(self) -> None:
        """Deletes this rank's object of the last :meth:`exchange` once a later agreement completed (every rank had
        read it by then), so that a long run's hooks leave no objects in the store."""
        key, self._drop_after_next = self._drop_after_next, None
        if key is not None:
            with contextlib.suppress(Exception):
                self.store.delete_key(key)

    def _agreement_key(self, index: int) -> str:
        return f"{self.prefix}/agree/{index}"

    def _agreement_timeout(self, key: str, what: str, timeout_s: float) -> CollectiveTimeoutError:
        missing = [r for r in range(self.world_size) if not self.store.check([f"{key}/{r}"])]
        return CollectiveTimeoutError(
            f"hook `{self.hook}`: the agreement {what} on rank {self.rank} did not complete within "
            f"collective_timeout_s={timeout_s:g}s: rank(s) {missing} never reached it. Check the log of "
            "the missing rank (it may have crashed, run out of memory or be stuck in a stage); raise "
            "`MemSafePlugin(collective_timeout_s=...)` if the ranks are merely slow."
        )


# The `done` mark of an agreement: every rank arrived, or a rank failed (followed by its record, as JSON).
_ALL_ARRIVED = b"all"
_FAILED = b"failed:"


class _KeyWait:
    """One request to :class:`_StoreWaiter`: ``finished`` is set when the keys are there or the wait failed
    (``error``)."""

    def __init__(self, keys: list[str], timeout_s: float) -> None:
        self.keys = keys
        self.timeout_s = timeout_s
        self.finished = threading.Event()
        self.error: BaseException | None = None


class _StoreWaiter:
    """A daemon thread that waits for store keys on request, on its own clone of the store: a ``TCPStore`` client
    holds its lock for the whole of a blocking ``wait``, which on the shared client would block every other use
    of the store (the failure board included). The store pushes the keys to the waiting client, so a request ends
    as soon as they are set. One per process, made before the first hook when possible (:func:`ready_to_agree`):
    a clone is a new connection and a thread start a scheduler round trip, neither on a hook's path."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._clone = _compat.store_clone(store)
        self._requests: queue.SimpleQueue[_KeyWait] = queue.SimpleQueue()
        self.busy = False
        self.broken = False
        threading.Thread(target=self._run, name="memsafe-agree", daemon=True).start()

    def submit(self, keys: list[str], timeout_s: float) -> _KeyWait:
        request = _KeyWait(keys, timeout_s)
        self.busy = True
        self._requests.put(request)
        return request

    def _run(self) -> None:
        while True:
            request = self._requests.get()
            try:
                self._clone.wait(request.keys, datetime.timedelta(seconds=request.timeout_s))
            except BaseException as exc:  # a timed-out or broken client is not used again
                request.error = exc
                self.broken = True
            finally:
                self.busy = False
                request.finished.set()
            if self.broken:
                return


_WAITER: list[_StoreWaiter | None] = [None]
_WAITER_LOCK = threading.Lock()


def _waiter(store: Any) -> _StoreWaiter:
    """The process's waiter for ``store``: a new one when there is none for this store, or when the last one is still
    blocked (its rank gave up on a wait: interrupted) or broken."""
    with _WAITER_LOCK:
        current = _WAITER[0]
        if current is None or current.store is not store or current.busy or current.broken:
            current = _WAITER[0] = _StoreWaiter(store)
        return current


def ready_to_agree() -> None:
    """Makes the agreements' waiter of the default process group's store now, off any hook's path (called when a
    memsafe accelerator is built). Does nothing in a single process or without a store."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    store = _compat.default_store()
    if store is not None:
        try:
            _waiter(store)
        except ConfigError:  # a torch without `Store.clone`: said here, when the accelerator is built
            raise
        except Exception:  # the first agreement makes its own
            pass


def _wait_for_keys(store: Any, keys: list[str], timeout_s: float) -> _KeyWait:
    """Starts waiting for ``keys`` to be set in ``store`` (at most ``timeout_s``) without blocking the caller."""
    return _waiter(store).submit(keys, timeout_s)


@contextlib.contextmanager
def hook_scope(hook: str, *, rank: int, world_size: int) -> Iterator[HookScope | None]:
    """Opens the failure board of one hook call; :class:`Collectives` created inside use it.

    Yields ``None`` (and counts nothing) in a single process or without a process group store, where
    there is no peer to tell.

    Args:
        hook: The hook point.
        rank: This rank.
        world_size: Number of ranks (the same on every rank, so every rank counts the same calls).

    Example:
        >>> with hook_scope("prepare", rank=0, world_size=1) as scope:
        ...     scope is None
        True
    """
    global _HOOK_CALLS
    store = _compat.default_store() if world_size > 1 and dist.is_available() and dist.is_initialized() else None
    if store is None:
        yield None
        return
    scope = HookScope(hook, _HOOK_CALLS, store=store, rank=rank, world_size=world_size)
    _HOOK_CALLS += 1
    _SCOPES.append(scope)
    try:
        yield scope
    finally:
        _SCOPES.remove(scope)


#: The most ranks whose small objects :func:`exchange_objects` sends through the store (each rank reads every rank's:
#: the store's traffic grows with the square of the ranks); more take gloo's or NCCL's all-gather.
STORE_EXCHANGE_MAX_RANKS = 16


def exchange_objects(obj: Any, *, stage: str, what: str, timeout_s: float) -> list[Any]:
    """Every rank's small picklable ``obj``, in rank order, for a metadata exchange of the hook (the pipeline's
    preflight): through the hook's store (:meth:`HookScope.exchange`) up to :data:`STORE_EXCHANGE_MAX_RANKS` ranks,
    else :meth:`Collectives.all_gather_object` of the default group. Which way depends on the world size only, the
    same on every rank. Must be called inside :func:`hook_scope` on every rank, at the same point.

    Raises:
        PeerStageError: If another rank failed during this hook call.
        CollectiveTimeoutError: If a rank did not take part within ``timeout_s`` (naming it).
    """
    scope = _SCOPES[-1] if _SCOPES else None
    if scope is not None and scope.world_size <= STORE_EXCHANGE_MAX_RANKS:
        return scope.exchange(obj, what=f"of stage `{stage}` ({what})", timeout_s=timeout_s)
    return Collectives(stage, timeout_s=timeout_s).all_gather_object(obj, what=what)


def check_not_abandoned(group: Any = None) -> None:
    """Refuses a process group in which this rank gave up on a pending collective (a peer failed or
    timed out): the ranks' next collectives would pair up with the wrong ops, hanging or, with equal
    sizes, silently exchanging the wrong data.

    Raises:
        StageError: Naming the abandoned collective and how to recover.
    """
    pg = group if group is not None else dist.group.WORLD
    for ref, what in _ABANDONED:
        if pg is not None and ref() is pg:
            raise StageError(
                f"this rank gave up on a pending collective earlier ({what}) after another rank failed or stopped; "
                "its peers never joined it, so the ranks' collectives are out of step on this process group and "
                "cannot be used again. Restart every process (torchrun restarts the whole worker group), or "
                "destroy and re-create the process group."
            )


def end_process_group(timeout_s: float = 5.0) -> None:
    """Destroys the default process group once every rank got here (a no-op without one): what a spawned rank
    (the tests' and the benchmarks' launchers) does before it exits. A rank that exits first closes the connections
    under its peers, and a gloo group left to the interpreter's exit can end the process in ``std::terminate``
    ("terminate called without an active exception", pytorch#190489). A peer already gone makes the barrier fail
    within ``timeout_s``, and the group is destroyed anyway."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception:
        pass
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class gc_paused:  # noqa: N801 (used as a function: ``with gc_paused():``)
    """Python's cyclic garbage collector paused for a run of collectives, restored after (reference counting
    still frees every tensor at once). A full collection walks every object of the process (a third of a second
    for a transformers model's 400 000 on a busy 2-core machine) and stalls every rank waiting on this one; it
    happens where the allocation counts say, not where it costs least. torchtitan pauses it for its training
    loop likewise. The pipeline runs its stages under it (:meth:`~accelerate_memsafe.pipeline.Pipeline.run`):
    a collection that falls due runs in the caller's code after the hook.

    Example:
        >>> import gc
        >>> with gc_paused():
        ...     paused = not gc.isenabled()
        >>> paused, gc.isenabled()
        (True, True)

    A class rather than a generator-based context manager: the pipeline enters it twice in every hook call, also in a
    one-process ``prepare`` of a few milliseconds, where each frame of a generator's protocol counts.
    """

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was:
            gc.enable()


def _abandon(work: Any, group: Any, what: str) -> None:
    """Gives up on a pending op: lets the backend run its own timeout path (NCCL aborts its communicator,
    gloo only raises) and remembers that this process group is out of step."""
    try:
        work.wait(timeout=datetime.timedelta(milliseconds=1))
    except Exception:
        pass
    pg = group if group is not None else dist.group.WORLD
    if pg is not None:
        try:
            _ABANDONED.append((weakref.ref(pg), what))
        except TypeError:
            pass


#: Tag of the plugin's point-to-point messages (apart from any tag a user's code sends with).
_P2P_TAG = 0x6D73


class _Waiter:
    """One daemon thread that waits for point-to-point ops, in the order they were issued, without the GIL
    (gloo's send/recv works report completion only once ``wait()`` was called on them): a transfer costs no
    thread start (a scheduler round trip, a millisecond on a busy machine, on every bucket)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="memsafe-p2p-wait", daemon=True)
        self._thread.start()

    def submit(self, works: _Works) -> None:
        self._queue.put(works)

    def close(self) -> None:
        """Lets the thread end once what was submitted is waited for."""
        self._queue.put(None)

    def _run(self) -> None:
        while (works := self._queue.get()) is not None:
            works._wait_all()


class _Works:
    """Several pending point-to-point ops waited for as one (the interface :meth:`Collectives.finish` polls):
    a :class:`_Waiter` thread waits for them, and the caller polls its flag under the deadline and the peer
    watch. Ops are waited for in issue order, which is the order the transports finish them in."""

    def __init__(self, works: list[Any], waiter: _Waiter) -> None:
        self.works = works
        self._error: BaseException | None = None
        self._done = threading.Event()
        waiter.submit(self)

    def _wait_all(self) -> None:
        try:
            for w in self.works:
                w.wait()
            # done: a send's work object holds its tensor, and this object may outlive the transfer (the waiter's
            # last request, the caller's handle), so the tensors are let go now (a pending op's are kept)
            self.works = []
        except BaseException as exc:
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise TimeoutError(f"point-to-point transfer still pending after {timeout}")
        if self._error is not None:
            raise self._error
        return True


@dataclass
class Pending:
    """A collective issued by :meth:`Collectives.start` and not yet waited for."""

    index: int
    what: str
    started: float
    work: Any


class Collectives:
    """Timeout-guarded collectives for one stage run.

    Args:
        stage: Stage name, used in error messages and store keys.
        timeout_s: Seconds each collective may take.
        group: Process group (default: the world).

    Example:
        >>> # coll = Collectives("buffer_init", timeout_s=60)
        >>> # coll.all_reduce(checksums)  # raises CollectiveTimeoutError naming a missing rank
    """

    def __init__(self, stage: str, *, timeout_s: float, group: Any = None) -> None:
        self.stage = stage
        self.timeout_s = float(timeout_s)
        self.group = group
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(group)
        self.ranks = list(range(self.world_size)) if group is None else dist.get_process_group_ranks(group)
        self.device = _comm_device(group)
        check_not_abandoned(group)
        self._scope = _SCOPES[-1] if _SCOPES else None
        if self._scope is not None:
            # numbered within the hook call, so that a rank that failed earlier cannot shift the keys
            generation = self._scope.generations.get(stage, 0)
            self._scope.generations[stage] = generation + 1
            self._prefix = f"{self._scope.prefix}/{stage}/{generation}"
        else:
            generation = _GENERATIONS.get(stage, 0)
            _GENERATIONS[stage] = generation + 1
            self._prefix = f"accelerate_memsafe/{stage}/{generation}"
        self._store = _compat.default_store()
        self._count = 0
        self._waiter: _Waiter | None = None

    def __del__(self) -> None:
        if getattr(self, "_waiter", None) is not None:
            self._waiter.close()

    # -- plumbing ---------------------------------------------------------------------------------
    def _arrive(self, op_index: int) -> None:
        if self._store is not None:
            try:
                self._store.set(f"{self._prefix}/{op_index}/{self.rank}", b"1")
            except Exception:  # the store lives on rank 0; if it is gone the collective will say so
                pass

    def _missing(self, op_index: int) -> list[int]:
        if self._store is None:
            return []
        missing = []
        for r in self.ranks:
            try:
                if not self._store.check([f"{self._prefix}/{op_index}/{r}"]):
                    missing.append(r)
            except Exception:
                return []
        return missing

    def _wait(self, work: Any, what: str, started: float, index: int | None = None) -> None:
        """Waits for ``work`` until it completes, looking at the hook's failure board every
        :data:`PEER_CHECK_INTERVAL_S` while it is pending; gives up at ``started + timeout_s``.

        The point-to-point ops (:class:`_Works`, a thread's event) are waited for in slices of
        :data:`PEER_CHECK_INTERVAL_S` (:meth:`_wait_in_slices`): the wait wakes when the ops end. A backend's work is
        polled, and only the overall deadline goes through its ``wait``: on NCCL (and its relatives) a ``wait`` that
        times out aborts the communicator, and on gloo, waited for in slices of ``wait(timeout)``, the demo's rank 1
        ended in ``std::terminate`` at exit in a CI run ("terminate called without an active exception").
        """
        deadline = started + self.timeout_s
        index = self._count - 1 if index is None else index
        if isinstance(work, _Works):
            self._wait_in_slices(work, what, started, index)
            return
        try:
            done = work.is_completed()
        except Exception:  # a backend without is_completed(): block up to the deadline, as before
            self._arrive(index)
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            return
        spin_until = time.monotonic() + _SPIN_S
        next_check = started + PEER_CHECK_INTERVAL_S
        marked = False
        sleep = _FIRST_SLEEP_S
        while not done:
            now = time.monotonic()
            checking = now >= next_check
            if checking and not marked:
                self._arrive(index)  # only a slow op leaves a mark: the fast path has no store traffic
                marked = True
            self._stop_if_due(work, what, started, now, look_at_board=checking)
            if checking:
                next_check = now + PEER_CHECK_INTERVAL_S
            if now >= spin_until:
                time.sleep(min(sleep, deadline - now))
                sleep = min(sleep * 2, _SHORT_MAX_SLEEP_S if now - started < _SHORT_WAIT_S else _MAX_SLEEP_S)
            done = work.is_completed()
        work.wait()  # returns at once or raises the op's error; on NCCL orders the current stream after it

    def _wait_in_slices(self, work: Any, what: str, started: float, index: int) -> None:
        """:meth:`_wait` for works whose ``wait(timeout)`` only raises when the timeout runs out, with no other effect
        (:class:`_Works`: a thread's event): blocks up to :data:`PEER_CHECK_INTERVAL_S` at a time, so the ops' end
        wakes it at once, and between two slices leaves the slow op's mark and looks at the failure board. A ``wait`` that
        raises on a completed work raised the op's own error, which goes to the caller."""
        deadline = started + self.timeout_s
        marked = False
        while True:
            now = time.monotonic()
            self._stop_if_due(work, what, started, now, look_at_board=marked)
            try:
                work.wait(timeout=datetime.timedelta(seconds=min(PEER_CHECK_INTERVAL_S, deadline - now)))
                return
            except Exception:
                if work.is_completed():
                    work.wait()  # the op failed: raises its error (or returns, had it just completed)
                    return
            if not marked:
                self._arrive(index)  # only a slow op leaves a mark: the fast path has no store traffic
                marked = True

    def _stop_if_due(self, work: Any, what: str, started: float, now: float, *, look_at_board: bool) -> None:
        """Gives up on the pending ``work`` (the process group is then out of step, :func:`_abandon`) past the
        deadline, or, with ``look_at_board``, when a peer published a failure.

        Raises:
            TimeoutError: Past ``started + timeout_s`` (the caller turns it into a ``CollectiveTimeoutError``).
            PeerStageError: If another rank failed during this hook call.
        """
        if now >= started + self.timeout_s:
            _abandon(work, self.group, f"{what} in stage `{self.stage}`")
            raise TimeoutError(f"still pending after {now - started:.1f}s")
        if look_at_board and self._scope is not None:
            failures = self._scope.peer_failures()
            if failures:
                _abandon(work, self.group, f"{what} in stage `{self.stage}`")
                raise self._scope.peer_error(
                    failures, stopped=f"in stage `{self.stage}` ({what}) after {now - started:.1f}s", abandoned=True)

    def run(self, what: str, start: Callable[[], Any]) -> None:
        """Starts an async collective with ``start()`` and waits for it with the deadline.

        Args:
            what: Description for errors (``"scatter of bucket 3/40"``).
            start: Issues the collective with ``async_op=True`` and returns its work handle.

        Raises:
            PeerStageError: If another rank failed during the same hook call (seen within about
                :data:`PEER_CHECK_INTERVAL_S` of the failure).
            CollectiveTimeoutError: If the op failed or did not finish within ``timeout_s``.
        """
        self.finish(self.start(what, start))

    def start(self, what: str, start: Callable[[], Any]) -> Pending:
        """Issues an async collective with ``start()`` and returns at once; :meth:`finish` waits for it.
        Several may be pending (the backend runs them in issue order): a transfer is posted while the
        previous one is still on the wire.

        Raises:
            CollectiveTimeoutError: If the op could not be issued.
        """
        index = self._count
        self._count += 1
        started = time.monotonic()
        try:
            return Pending(index, what, started, start())
        except PeerStageError:
            raise
        except Exception as exc:
            raise self._failure(index, what, started, exc) from exc

    def finish(self, pending: Pending) -> None:
        """Waits for a collective issued by :meth:`start`, under the deadline and the peer-failure watch.

        Raises:
            PeerStageError: If another rank failed during the same hook call.
            CollectiveTimeoutError: If the op failed or did not finish within ``timeout_s`` of its start.
        """
        try:
            if pending.work is not None:
                self._wait(pending.work, pending.what, pending.started, pending.index)
        except PeerStageError:
            raise
        except Exception as exc:
            raise self._failure(pending.index, pending.what, pending.started, exc) from exc

    def abandon(self, pending: Pending) -> None:
        """Gives up on a collective issued by :meth:`start` that will not be waited for (this rank is raising):
        the process group is marked out of step (:func:`check_not_abandoned`)."""
        if pending.work is not None:
            _abandon(pending.work, self.group, f"{pending.what} in stage `{self.stage}`")

    def _failure(self, index: int, what: str, started: float, exc: BaseException) -> CollectiveTimeoutError:
        self._arrive(index)
        missing = self._missing(index)
        who = (
            f"rank(s) {missing} never reached it"
            if missing
            else "every rank reached it, so a peer failed or stalled during the transfer"
        )
        elapsed = time.monotonic() - started
        how = (
            f"did not complete within collective_timeout_s={self.timeout_s:g}s"
            if elapsed >= self.timeout_s
            else f"failed after {elapsed:.1f}s (collective_timeout_s={self.timeout_s:g}s)"
        )
        return CollectiveTimeoutError(
            f"stage `{self.stage}`: {what} on rank {self.rank} {how}: {who} ({type(exc).__name__}: {exc}). "
            "Check the log of the missing rank (it may have crashed or run out of memory); raise "
            "`MemSafePlugin(collective_timeout_s=...)` if the ranks are merely slow."
        )

    # -- ops ------------------------------------------------------------------------------------------
    def scatter(self, output: torch.Tensor, chunks: list[torch.Tensor] | None, *, src: int = 0, what: str = "scatter") -> None:
        """``dist.scatter`` under the deadline (``chunks`` only on ``src``); tensors must be on :attr:`device`."""
        self.finish(self.scatter_async(output, chunks, src=src, what=what))

    def scatter_async(self, output: torch.Tensor, chunks: list[torch.Tensor] | None, *, src: int = 0,
                      what: str = "scatter") -> Pending:
        """Issues :meth:`scatter` without waiting (see :meth:`start`); the buffers must stay untouched until
        :meth:`finish` returns."""
        return self.start(what, lambda: dist.scatter(output, chunks if self.rank == src else None, src=src,
                                                     group=self.group, async_op=True))

    def exchange_async(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], *,
                       what: str = "point-to-point transfer") -> Pending:
        """Issues one ``isend`` per ``(peer, tensor)`` of ``sends`` and one ``irecv`` per ``(peer, tensor)`` of
        ``recvs`` (peers are ranks of this group, tensors contiguous on :attr:`device`) and returns at once;
        :meth:`finish` waits for all of them. Messages between two ranks are matched in the order they are
        issued, so both sides must issue them in the same order (one plan)."""
        def start() -> _Works:
            works = [dist.isend(t, dst=self.ranks[peer], group=self.group, tag=_P2P_TAG) for peer, t in sends]
            works += [dist.irecv(t, src=self.ranks[peer], group=self.group, tag=_P2P_TAG) for peer, t in recvs]
            if self._waiter is None:
                self._waiter = _Waiter()
            return _Works(works, self._waiter)

        return self.start(what, start)

    def broadcast(self, tensor: torch.Tensor, *, src: int = 0, what: str = "broadcast") -> None:
        """``dist.broadcast`` under the deadline (a tensor off :attr:`device` travels through a copy)."""
        if tensor.device == self.device:
            self.run(what, lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True))
            return
        tmp = tensor.to(self.device)
        self.run(what, lambda: dist.broadcast(tmp, src=src, group=self.group, async_op=True))
        tensor.copy_(tmp)

    def all_reduce(self, tensor: torch.Tensor, op: Any = None, *, what: str = "all_reduce") -> None:
        """``dist.all_reduce`` under the deadline (default op: sum)."""
        op = dist.ReduceOp.SUM if op is None else op
        tmp = tensor if tensor.device == self.device else tensor.to(self.device)
        self.run(what, lambda: dist.all_reduce(tmp, op=op, group=self.group, async_op=True))
        if tmp is not tensor:
            tensor.copy_(tmp)

    def all_gather(self, tensor: torch.Tensor, *, what: str = "all_gather") -> list[torch.Tensor]:
        """``dist.all_gather`` of equally shaped tensors under the deadline; returns one CPU tensor per rank."""
        # on CPU (gloo) no copy to and from the device: each is a dispatch, and the first of a process costs tens of µs
        on_device = tensor.device != self.device
        if on_device:
            tensor = tensor.to(self.device)
        out = [torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device) for _ in range(self.world_size)]
        self.run(what, lambda: dist.all_gather(out, tensor, group=self.group, async_op=True))
        return [t.cpu() for t in out] if on_device else out

    def ranks_flagging(self, flag: bool, *, what: str = "agreement") -> list[int]:
        """The ranks whose ``flag`` is set (one all-gather): lets every rank raise together."""
        flags = self.all_gather(torch.tensor([1 if flag else 0], dtype=torch.int64), what=what)
        return [r for r, f in enumerate(flags) if int(f.item())]

    def barrier(self, *, what: str = "barrier") -> None:
        """A barrier under the deadline (an all-reduce of one element)."""
        self.all_reduce(torch.zeros(1), what=what)

    def all_gather_object(self, obj: Any, *, what: str = "all_gather of metadata") -> list[Any]:
        """Gathers a picklable object from every rank: one all-gather of :data:`OBJECT_FIRST_BYTES` (with each
        object's size), and a second one only for what exceeds it on some rank.

        Returns:
            Every rank's object, in rank order.
        """
        data = pickle.dumps(obj)
        first = self.all_gather(_first_part(data), what=what)
        sizes = [_size_of(t) for t in first]
        rest = max(sizes) - OBJECT_FIRST_BYTES
        tails = [b""] * self.world_size
        if rest > 0:  # every rank sees the same sizes, so every rank takes part
            padded = torch.zeros(rest, dtype=torch.uint8)
            mine = data[OBJECT_FIRST_BYTES:]
            if mine:
                padded[: len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            tails = [t.numpy().tobytes() for t in self.all_gather(padded, what=f"{what} (rest)")]
        return [pickle.loads((t.numpy()[8 : 8 + OBJECT_FIRST_BYTES].tobytes() + tail)[:n])
                for t, tail, n in zip(first, tails, sizes)]

    def broadcast_object(self, obj: Any, *, src: int = 0, what: str = "broadcast of metadata") -> Any:
        """Broadcasts a picklable object from ``src``: one broadcast of :data:`OBJECT_FIRST_BYTES` (with the
        object's size), and a second one only for what exceeds it.

        Returns:
            The object of ``src`` on every rank.
        """
        data = pickle.dumps(obj) if self.rank == src else b""
        first = _first_part(data if self.rank == src else None)
        self.broadcast(first, src=src, what=what)
        size = _size_of(first)
        if size > OBJECT_FIRST_BYTES:
            if self.rank == src:
                rest = torch.frombuffer(bytearray(data[OBJECT_FIRST_BYTES:]), dtype=torch.uint8)
            else:
                rest = torch.empty(size - OBJECT_FIRST_BYTES, dtype=torch.uint8)
            self.broadcast(rest, src=src, what=f"{what} (rest)")
        if self.rank == src:
            return obj
        tail = rest.numpy().tobytes() if size > OBJECT_FIRST_BYTES else b""
        return pickle.loads((first.numpy()[8 : 8 + OBJECT_FIRST_BYTES].tobytes() + tail)[:size])


#: Bytes of a pickled object that travel with the first collective of :meth:`Collectives.all_gather_object` and
#: :meth:`Collectives.broadcast_object`: the metadata the stages exchange fits, so one round trip suffices.
OBJECT_FIRST_BYTES = 16 * 1024


def _first_part(data: bytes | None) -> torch.Tensor:
    """The first collective's buffer: the object's size (8 bytes, little-endian), then its first bytes (zeros for
    ``None``: a receiver's buffer). Built in Python and handed to torch as one tensor: a process's first ``zeros``, slice
    and copy cost about half a millisecond of dispatch set-up, more than the exchange's own transfer."""
    raw = bytearray(8 + OBJECT_FIRST_BYTES)
    if data is not None:
        head = len(data).to_bytes(8, "little") + data[:OBJECT_FIRST_BYTES]
        raw[: len(head)] = head
    return torch.frombuffer(raw, dtype=torch.uint8)


def _size_of(first: torch.Tensor) -> int:
    return int.from_bytes(first.numpy()[:8].tobytes(), "little")


def _comm_device(group: Any) -> torch.device:
    """The device a collective's tensors must be on: the CPU when the group has gloo, else the accelerator
    (NCCL and friends take device tensors only) where one is usable, else the CPU.

    A group made without naming its backend has one per device type, and ``get_backend`` reports it as
    ``"undefined"``; torch built with CUDA names CUDA its accelerator also on a machine without a GPU or driver,
    where the group's collectives run on the CPU (gloo), as accelerate's own do.

    Example:
        >>> import unittest.mock as mock
        >>> with mock.patch.object(dist, "get_backend", return_value="undefined"), \\
        ...         mock.patch.object(torch.accelerator, "current_accelerator", return_value=torch.device("cuda")), \\
        ...         mock.patch.object(torch.accelerator, "is_available", return_value=False):
        ...     _comm_device(None)
        device(type='cpu')
    """
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    accelerator = getattr(torch, "accelerator", None)
    current = accelerator.current_accelerator() if accelerator is not None else None
    if current is None or not accelerator.is_available():
        return torch.device("cpu")
    return current
