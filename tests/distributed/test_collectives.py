"""The object collectives the stages exchange metadata with: one round trip for what fits the first buffer,
a second only for the bytes beyond it, the same objects back whatever their sizes."""

from __future__ import annotations

import pytest

from accelerate_memsafe.distributed.collectives import OBJECT_FIRST_BYTES, PEER_CHECK_INTERVAL_S
from tests.distributed import workers as w
from tests.spawn import run_on_ranks


def test_object_collectives_round_trip_objects_of_any_size():
    small, edge, large = 10, OBJECT_FIRST_BYTES - 40, 3 * OBJECT_FIRST_BYTES
    sizes = [small, edge, large]
    results = run_on_ranks(w.object_collectives, 2, timeout=120, sizes=sizes)
    for rank, res in enumerate(results):
        for k, n in enumerate(sizes):
            assert res["gathered"][k] == [bytes([r + 1]) * (n + 1000 * r) for r in range(2)], (rank, n)
            assert res["broadcast"][k] == bytes([1]) * n, (rank, n)
    # small: one all-gather + one broadcast; edge: rank 1's object (1000 bytes larger) no longer fits, so
    # the gather takes a second round while rank 0's broadcast does not; large: two rounds each
    assert results[0]["ops"] == results[1]["ops"] == [2, 3, 4]


def test_a_gloo_collective_is_polled_and_its_wait_never_times_out():
    # rank 1 arrives late: rank 0 polls the work (is_completed) and calls its wait only once it completed, without a
    # timeout (waiting in slices of wait(timeout) was tried: the demo's rank 1 then aborted at exit in a CI run)
    results = run_on_ranks(w.late_peer_collective, 2, timeout=120, delay_s=2.5 * PEER_CHECK_INTERVAL_S)
    for res in results:
        assert res["value"] == [3.0, 3.0, 3.0] and res["after"] == [2.0, 2.0]
        waits = [t for name, t in res["calls"] if name == "wait"]
        assert waits == [None], res["calls"]
    assert sum(name == "is_completed" for name, _ in results[0]["calls"]) > 1  # rank 0 waited for rank 1


def test_point_to_point_exchanges_are_waited_for_by_one_thread_in_order():
    rounds = 40
    results = run_on_ranks(w.exchanges_through_one_waiter, 2, timeout=120, rounds=rounds)
    for rank, res in enumerate(results):
        peer = 1 - rank
        assert res["got"] == [[float(k * 10 + peer)] for k in range(rounds)], rank
        # one waiter thread for the Collectives, not one started (and torn down) per exchange
        assert res["waiters"] == 1, res["waiters"]


def test_a_rank_ends_its_process_group_once_every_rank_got_there():
    # what the tests' and the benchmarks' launchers do before a rank exits (a gloo group left to the interpreter's
    # exit can end the process in std::terminate); a second call, with no group left, does nothing
    results = run_on_ranks(w.ended_process_group, 2, timeout=120)
    assert results == [{"sum": 2.0, "initialized": False}] * 2


@pytest.mark.parametrize("through_store", [True, False], ids=["store", "all_gather"])
@pytest.mark.parametrize("check", [True, False], ids=["preflight_check", "no_preflight_check"])
def test_what_stages_announce_travels_with_the_preflight_estimates_in_one_exchange(check, through_store):
    # a stage that needs every rank's view (meta_placement's in-place claim) gets it from the preflight's exchange,
    # not from a collective of its own; without the memory check, the exchange still carries the announcements.
    # Up to STORE_EXCHANGE_MAX_RANKS ranks the exchange goes through the store, beyond them through an all-gather
    results = run_on_ranks(w.announcements_in_one_exchange, 2, timeout=120, check=check, through_store=through_store)
    for res in results:
        assert res["announced"] == [{"value": 0}, {"value": 10}]
        assert len(res["collectives"]) == 1, res["collectives"]  # small objects: one all-gather, no second part
        kind, what = res["collectives"][0]
        assert kind == ("store" if through_store else "all_gather") and "announcements" in what
        assert res["estimates"] == (["announcing"] if check else [])


@pytest.mark.parametrize("needed", [True, False], ids=["needed", "ruled_out"])
def test_an_estimate_that_waits_for_the_announcements_takes_a_second_exchange_only_where_needed(needed):
    # `needs_estimate` decides from what every rank announced (rank 1's 10), the same on every rank: a stage it rules
    # out costs no estimate and no second exchange; one it needs has its figure asked after the exchange and sent
    # in a second one
    results = run_on_ranks(w.announcements_in_one_exchange, 2, timeout=120, check=True, later=10 if needed else 99)
    for rank, res in enumerate(results):
        assert res["announced"] == [{"value": 0}, {"value": 10}]
        assert len(res["collectives"]) == (2 if needed else 1), res["collectives"]
        assert res["estimates"] == (["announcing", "later"] if needed else ["announcing"])
        assert res["later_cpu"] == ((rank + 1) << 20 if needed else 0)
        if needed:
            assert res["collectives"][1][0] == "store" and "waited for the announcements" in res["collectives"][1][1]
