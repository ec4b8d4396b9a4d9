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
