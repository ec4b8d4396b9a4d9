"""HookScope.agree: the ranks of a hook call meet through the store; the last to arrive wakes the others at once,
a rank that fails wakes them with its error, and a rank that never arrives is named after the timeout.

The ranks are threads here, each with its own HookScope over one store (a HashStore in this process, or a real
TCPStore with one client per rank, as torchrun gives them)."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch.distributed as dist

from accelerate_memsafe.distributed import collectives
from accelerate_memsafe.distributed.collectives import HookScope
from accelerate_memsafe.errors import CollectiveTimeoutError, PeerStageError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stores(kind: str, world: int):
    if kind == "hash":
        store = dist.HashStore()
        return [store] * world
    port = _free_port()
    timeout = datetime.timedelta(seconds=30)
    master = dist.TCPStore("127.0.0.1", port, world, True, timeout, wait_for_workers=False)
    return [master] + [dist.TCPStore("127.0.0.1", port, world, False, timeout) for _ in range(world - 1)]


def _on_ranks(stores, fn, *, join_s: float = 20.0):
    """Runs ``fn(scope)`` for each rank in its own thread; returns what each returned or raised."""
    world = len(stores)
    out: list = [None] * world

    def body(rank):
        scope = HookScope("prepare", 0, store=stores[rank], rank=rank, world_size=world)
        try:
            out[rank] = fn(scope)
        except BaseException as exc:  # handed to the test
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    assert not any(t.is_alive() for t in threads), f"a rank is still waiting after {join_s}s: {out}"
    return out


@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_every_rank_passes_every_agreement_and_a_late_rank_releases_the_others(kind, monkeypatch):
    # with the board looked at every 1000 s, only the last rank's `done` mark can release the early ones
    monkeypatch.setattr(collectives, "PEER_CHECK_INTERVAL_S", 1000.0)
    stores = _stores(kind, 3)

    def fn(scope):
        times = []
        for k in range(3):
            if scope.rank == k:
                time.sleep(0.2)  # this rank is the late one at agreement k
            arrived = time.monotonic()
            scope.agree(f"number {k}", timeout_s=60)
            times.append((arrived, time.monotonic()))
        return times

    out = _on_ranks(stores, fn)
    assert all(isinstance(o, list) and len(o) == 3 for o in out), out
    for k in range(3):
        late_arrival = out[k][k][0]
        # nobody passes agreement k before the late rank reached it (and, with the board never looked at, the
        # early ranks left only because its arrival woke them)
        assert all(o[k][1] >= late_arrival for o in out), (k, out)


@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_a_rank_that_fails_wakes_the_ranks_waiting_at_the_agreement(kind, monkeypatch):
    monkeypatch.setattr(collectives, "PEER_CHECK_INTERVAL_S", 1000.0)  # no board poll: the wake alone must do it
    stores = _stores(kind, 3)

    def fn(scope):
        scope.agree("before the stages", timeout_s=60)
        if scope.rank == 2:
            time.sleep(0.2)
            error = OSError("disk full")
            scope.publish("offloaded_save", error)
            return error
        scope.agree("before `accelerate.save_state`", timeout_s=60)
        return "passed"

    out = _on_ranks(stores, fn)
    assert isinstance(out[2], OSError), out
    for rank in (0, 1):
        err = out[rank]
        assert isinstance(err, PeerStageError), out
        assert err.failed_rank == 2 and err.stage == "offloaded_save" and not err.collective_abandoned
        assert "OSError: disk full" in str(err) and "before `accelerate.save_state`" in str(err), err


def test_a_rank_that_failed_before_its_peer_arrived_is_reported_at_once(monkeypatch):
    monkeypatch.setattr(collectives, "PEER_CHECK_INTERVAL_S", 1000.0)
    stores = _stores("tcp", 2)

    def fn(scope):
        if scope.rank == 1:
            scope.publish("shard", RuntimeError("boom"))
            return "published"
        time.sleep(0.2)
        scope.agree("before `accelerate.prepare`", timeout_s=60)

    out = _on_ranks(stores, fn)
    assert isinstance(out[0], PeerStageError) and out[0].failed_rank == 1 and "RuntimeError: boom" in str(out[0])


@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_a_rank_that_never_arrives_is_named_after_the_timeout(kind):
    stores = _stores(kind, 3)

    def fn(scope):
        if scope.rank == 1:
            return "stuck elsewhere"
        start = time.monotonic()
        try:
            scope.agree("at the end of hook `prepare`", timeout_s=1.0)
        except CollectiveTimeoutError as exc:
            return exc, time.monotonic() - start

    out = _on_ranks(stores, fn)
    for rank in (0, 2):
        err, waited = out[rank]
        assert "rank(s) [1] never reached it" in str(err) and "collective_timeout_s=1s" in str(err), err
        assert waited >= 1.0


def test_the_waiting_rank_leaves_the_store_usable(monkeypatch):
    """A TCPStore client holds its lock for the whole of a blocking wait: the agreement waits on a clone, so this
    rank's other store traffic (the failure board, a stage's arrival marks) is not blocked meanwhile."""
    stores = _stores("tcp", 2)
    timings = {}

    def fn(scope):
        if scope.rank == 0:
            scope.agree("before `accelerate.prepare`", timeout_s=60)
            return "passed"
        time.sleep(0.3)  # rank 0 is waiting now; its client must still answer at once
        start = time.monotonic()
        stores[0].set("probe", b"1")
        timings["set"] = time.monotonic() - start
        scope.agree("before `accelerate.prepare`", timeout_s=60)
        return "passed"

    out = _on_ranks(stores, fn)
    assert out == ["passed", "passed"], out
    assert timings["set"] < 5.0, timings


class _Counting:
    """A store client that counts the calls made through it (each a round trip to a TCPStore)."""

    def __init__(self, store) -> None:
        self._store = store
        self.calls: list[str] = []

    def __getattr__(self, name):
        method = getattr(self._store, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


def test_the_last_rank_to_arrive_ends_the_agreement_in_two_store_round_trips(monkeypatch):
    # the rank that arrives last is the one every other rank waits for: it only counts itself in and sets `done`
    monkeypatch.setattr(collectives, "PEER_CHECK_INTERVAL_S", 1000.0)
    stores = _stores("tcp", 2)
    counting = _Counting(stores[1])

    def fn(scope):
        if scope.rank == 1:
            time.sleep(0.2)
            scope.store = counting
        scope.agree("before `accelerate.prepare`", timeout_s=60)
        return "passed"

    assert _on_ranks(stores, fn) == ["passed", "passed"]
    assert counting.calls == ["add", "set"]


@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_an_exchange_gives_every_rank_every_object_and_leaves_none_in_the_store(kind, monkeypatch):
    # the preflight's exchange up to STORE_EXCHANGE_MAX_RANKS ranks: an agreement whose arrival marks carry the
    # objects; each rank's object is deleted once a later agreement completed (every rank had read it by then)
    monkeypatch.setattr(collectives, "PEER_CHECK_INTERVAL_S", 1000.0)
    stores = _stores(kind, 3)

    def fn(scope):
        if scope.rank == 1:
            time.sleep(0.2)  # the late one: nobody reads before its object is there
        got = scope.exchange({"rank": scope.rank, "claim": "x" * 100 * scope.rank}, what="of the test", timeout_s=60)
        key = f"{scope._agreement_key(0)}/{scope.rank}"
        held = stores[scope.rank].check([key])
        scope.agree("before `accelerate.prepare`", timeout_s=60)
        return got, held, key

    out = _on_ranks(stores, fn)
    for rank in range(3):
        got, held, _ = out[rank]
        assert got == [{"rank": r, "claim": "x" * 100 * r} for r in range(3)], out[rank]
        assert held, "this rank's object stays until a later agreement"
    time.sleep(0.1)
    assert not any(stores[0].check([key]) for *_, key in out), "every rank deleted its object after the agreement"


def test_a_rank_failing_before_the_exchange_wakes_the_ranks_waiting_in_it_and_a_missing_one_is_named(monkeypatch):
    monkeypatch.setattr(collectives, "PEER_CHECK_INTERVAL_S", 1000.0)
    stores = _stores("tcp", 3)

    def fn(scope):
        if scope.rank == 2:
            time.sleep(0.2)
            scope.publish("preflight", MemoryError("in_place_claim"))
            return "published"
        return scope.exchange(scope.rank, what="of the preflight", timeout_s=60)

    out = _on_ranks(stores, fn)
    for rank in (0, 1):
        assert isinstance(out[rank], PeerStageError) and out[rank].failed_rank == 2, out
        assert "MemoryError: in_place_claim" in str(out[rank])
    stores = _stores("tcp", 2)

    def late(scope):
        if scope.rank == 1:
            return "never came"
        return scope.exchange(scope.rank, what="of the preflight", timeout_s=0.5)

    out = _on_ranks(stores, late)
    assert isinstance(out[0], CollectiveTimeoutError) and "rank(s) [1] never reached it" in str(out[0]), out


@pytest.mark.parametrize(("backend", "accelerator", "available", "expected"), [
    ("gloo", "cuda", True, "cpu"),
    ("cpu:gloo,cuda:nccl", "cuda", True, "cpu"),
    # a group with a backend per device type reports "undefined": a CUDA build of torch on a machine without a GPU
    # names CUDA its accelerator, and the collectives must stay on the CPU (torch 2.11's CUDA wheel on a CPU host)
    ("undefined", "cuda", False, "cpu"),
    ("undefined", None, False, "cpu"),
    ("undefined", "cuda", True, "cuda"),
])
def test_collectives_run_on_the_accelerator_only_where_one_is_usable(monkeypatch, backend, accelerator, available,
                                                                    expected):
    import torch

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: torch.device(accelerator) if accelerator else None)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: available)
    assert collectives._comm_device(None).type == expected
