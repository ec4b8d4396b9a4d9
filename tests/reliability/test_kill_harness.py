"""The kill harness in CI: a few SIGKILLs across ``save_state`` and ``save_offloaded``, one of them inside the
background commit of ``save_state`` while the child trains on (the full run, 24 points, is
``python -m tests.reliability.kill_harness --points 24``; see docs/guarantees.md)."""

from __future__ import annotations

from tests.reliability import kill_harness


def test_sigkilled_saves_never_lose_or_expose_a_checkpoint(tmp_path):
    result = kill_harness.run(4, seed=1, workdir=str(tmp_path))
    assert result["points"] == 4
    assert result["killed"] >= 3, result  # the kill points are drawn inside the save
    assert result["background_commit"]["save_state"], "save_state's commit did not run in the background"
    assert result["phases"]["save_state"].get("background", 0) >= 1, result["phases"]  # point 3: in the commit thread
    assert result["lost"] == 0, result["lost_details"]
