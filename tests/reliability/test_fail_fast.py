"""An error on one rank, in any stage, becomes an error on every rank within seconds, naming the stage, the
rank that failed and its message, at the DEFAULT ``collective_timeout_s`` (600 s): the other rank does not
sit in its collective until the timeout. Two gloo ranks, FSDP2 on CPU; the failing rank stays alive after
its error (see ``workers_fail_fast._linger``).

Before this was built, the other rank waited the whole 600 s in its collective: each test's own spawn
timeout (far below 600 s) then fails it."""

from __future__ import annotations

import re

import pytest

from tests.reliability import workers_fail_fast
from tests.reliability.workers_fail_fast import INJECTED
from tests.spawn import run_on_ranks

#: Seconds for every rank to have raised, from the start of the hook (the peer check runs every 0.25 s;
#: the rest is margin for a loaded CI machine).
WITHIN_S = 20.0
#: The spawn timeout: process start, imports and model building, plus WITHIN_S; far below 600 s.
SPAWN_TIMEOUT_S = 120.0
#: How long a failing rank stays alive at most waiting for its peers to report: past the spawn timeout.
LINGER_S = SPAWN_TIMEOUT_S + 60


def _run(**kwargs):
    results = run_on_ranks(
        workers_fail_fast.fail_in_prepare, 2, timeout=SPAWN_TIMEOUT_S, init_process_group=False,
        expect_failure=True, linger_s=LINGER_S, **kwargs,
    )
    for status, out in results:
        assert status == "ok", f"a rank did not report: {out}"
    return [out for _, out in results]


@pytest.mark.parametrize("when", ["before", "while"])
def test_rank0_error_in_rank0_distribute_reaches_rank1_within_seconds(when):
    # `while`: small buckets, rank 0 fails reading a weight after some buckets went out
    r0, r1 = _run(failing_rank=0, stage="rank0_distribute", when=when, bucket_bytes=256 << 10, load_source="rank0")
    assert r0["error"] == "CheckpointError" and INJECTED in r0["message"], r0
    assert r1["error"] == "PeerStageError", r1
    msg = r1["message"]
    assert "stage `rank0_distribute` at hook `prepare` failed on rank 0" in msg, msg
    assert f"CheckpointError: {INJECTED}" in msg, msg
    assert re.search(r"this rank \(1\) stopped in stage `rank0_distribute` \(.+\) after", msg), msg
    assert (r1["failed_rank"], r1["stage"], r1["hook"]) == (0, "rank0_distribute", "prepare"), r1
    assert r1["collective_abandoned"] is True, r1
    if when == "while":
        bucket = int(re.search(r"(?:scatter|receive) of bucket (\d+)/", msg).group(1))
        assert bucket > 1, f"rank 0 failed before the scatter began: {msg}"
    for out in (r0, r1):
        assert out["elapsed"] < WITHIN_S, out


def test_rank1_error_in_buffer_init_reaches_rank0_within_seconds():
    r0, r1 = _run(failing_rank=1, stage="buffer_init")
    assert r1["error"] == "RuntimeError" and INJECTED in r1["message"], r1
    assert r0["error"] == "PeerStageError", r0
    msg = r0["message"]
    assert "stage `buffer_init` at hook `prepare` failed on rank 1" in msg, msg
    assert f"RuntimeError: {INJECTED}" in msg, msg
    assert "this rank (0) stopped in stage `buffer_init`" in msg, msg
    for out in (r0, r1):
        assert out["elapsed"] < WITHIN_S, out


def test_rank1_error_after_the_last_collective_of_prepare_stops_rank0_before_accelerates_call():
    """Rank 1 fails after every collective of the stages: rank 0, its stages done, is held at the agreement before
    accelerate's own prepare and raises there, within seconds, with no collective pending."""
    r0, r1 = _run(failing_rank=1, stage="buffer_init", when="after")
    assert r1["error"] == "RuntimeError" and INJECTED in r1["message"], r1
    assert r0["error"] == "PeerStageError", r0
    msg = r0["message"]
    assert "stage `buffer_init` at hook `prepare` failed on rank 1" in msg, msg
    assert "at the agreement before `accelerate.prepare`" in msg, msg
    assert r0["collective_abandoned"] is False, r0
    for out in (r0, r1):
        assert out["elapsed"] < WITHIN_S, out


def test_next_hook_after_an_abandoned_collective_is_refused_on_every_rank(tmp_path):
    """Rank 1 gave up on a scatter rank 0 never joined: the ranks' next collectives would pair up wrongly,
    so the next hook fails on every rank at once, saying why, instead of exchanging the wrong data."""
    r0, r1 = _run(failing_rank=0, stage="rank0_distribute", when="before", then_save=str(tmp_path / "ckpt"))
    assert r1["collective_abandoned"] is True, r1
    n0, n1 = r0["next"], r1["next"]
    assert n1["error"] == "StageError" and "gave up on a pending collective" in n1["message"], n1
    assert n0["error"] == "PeerStageError" and "failed on rank 1" in n0["message"], n0
    for out in (n0, n1):
        assert out["elapsed"] < WITHIN_S, out


def test_a_caught_failure_does_not_poison_the_next_hooks(tmp_path):
    """Rank 0 fails after the stage's collectives: rank 1 stops at the agreement before accelerate's save,
    with no collective pending; both catch their errors, and the next save_state and load_state work."""
    ckpt = tmp_path / "ckpt"
    results = run_on_ranks(
        workers_fail_fast.caught_failure_then_next_hooks, 2, timeout=SPAWN_TIMEOUT_S, init_process_group=False,
        ckpt=str(ckpt), linger_s=LINGER_S,
    )
    r0, r1 = results
    assert r0["failed_hook"]["error"] == "OSError", r0
    f1 = r1["failed_hook"]
    assert f1["error"] == "PeerStageError", f1
    assert "stage `dataloader_resume` at hook `save_state` failed on rank 0" in f1["message"], f1
    assert "at the agreement before `accelerate.save_state`" in f1["message"], f1
    assert f1["collective_abandoned"] is False, f1
    for out in (r0, r1):
        assert out["failed_hook"]["elapsed"] < WITHIN_S, out
        assert out["next_hooks"]["error"] is None, out["next_hooks"]
        assert out["saved"], out
