"""A rank that stalls or dies during distribution, buffer verification or checkpoint I/O makes the other
rank fail within ``collective_timeout_s`` (plus a margin for process teardown), with an error naming the
stage and the missing rank. Two gloo ranks, FSDP2 on CPU."""

from __future__ import annotations

import re

import pytest

from tests.reliability import workers_faults
from tests.spawn import run_on_ranks

TIMEOUT_S = 4.0
#: The surviving rank must fail within the timeout plus this margin (gloo teardown, a loaded CI machine).
MARGIN_S = 15.0

CASES = [
    ("rank0_distribute", "stall"),
    ("rank0_distribute", "exit"),
    ("buffer_init", "stall"),
    ("buffer_init", "exit"),
    ("atomic_checkpoint", "stall"),
    ("atomic_checkpoint", "exit"),
]


@pytest.mark.parametrize("stage,kind", CASES, ids=[f"{s}-{k}" for s, k in CASES])
def test_surviving_rank_fails_naming_stage_and_missing_rank(stage, kind, tmp_path):
    results = run_on_ranks(
        workers_faults.faulty_rank, 2, timeout=TIMEOUT_S + workers_faults.STALL_EXTRA_S + 90,
        init_process_group=False, expect_failure=True,
        stage=stage, kind=kind, timeout_s=TIMEOUT_S, ckpt=str(tmp_path / "ckpt"),
    )
    status, out = results[0]
    assert status == "ok", f"rank 0 did not report: {out}"
    assert results[1][0] == "died", results[1]
    assert out["error"] is not None, "rank 0 finished although rank 1 never took part"
    assert out["error"] == "CollectiveTimeoutError", f"{out['error']}: {out['message'][:400]}"
    assert re.search(rf"stage `{stage}`", out["message"]), out["message"]
    assert re.search(r"rank\(s\) \[1\]", out["message"]), out["message"]
    assert out["elapsed"] < TIMEOUT_S + MARGIN_S, out


#: Where rank 0, which hosts the process group's store here (``MASTER_ADDR``/``MASTER_PORT``, a plain
#: ``torch.distributed`` launch), dies: before the preflight's exchange, which runs through the store only, and
#: inside a stage's collective on gloo.
STORE_HOST_CASES = [("preflight", r"store is unreachable"), ("rank0_distribute", r"stage `rank0_distribute`")]
#: Long enough that a rank which waited for it instead of noticing the lost peer would be caught.
STORE_HOST_TIMEOUT_S = 60.0


@pytest.mark.parametrize("stage,says", STORE_HOST_CASES, ids=[s for s, _ in STORE_HOST_CASES])
def test_the_other_ranks_fail_at_once_when_the_rank_hosting_the_store_dies(stage, says, tmp_path):
    results = run_on_ranks(
        workers_faults.faulty_rank, 2, timeout=STORE_HOST_TIMEOUT_S + 90, init_process_group=False,
        expect_failure=True, stage=stage, kind="exit", timeout_s=STORE_HOST_TIMEOUT_S, ckpt=str(tmp_path / "ckpt"),
        faulty=0,
    )
    assert results[0][0] == "died", results[0]
    status, out = results[1]
    assert status == "ok", f"rank 1 did not report: {out}"
    assert out["error"] == "CollectiveTimeoutError", f"{out['error']}: {out['message'][:400]}"
    assert out["is_memsafe"], out
    assert re.search(says, out["message"]), out["message"]
    # the lost peer is noticed, not waited out: far sooner than collective_timeout_s
    assert out["elapsed"] < STORE_HOST_TIMEOUT_S / 4, out
