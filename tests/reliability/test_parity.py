"""Parity: a 20-step FSDP2 run on 2 CPU ranks with the plugin has the loss trajectory of stock accelerate's
FSDP2 path on the same model and data, and resuming at step 10 continues it exactly."""

from __future__ import annotations

import pytest

from tests.reliability import workers_parity
from tests.spawn import run_on_ranks

STEPS = 20


@pytest.mark.slow  # the default suite has the differential resume matrix (plugin == stock, bitwise; exact resume)
def test_plugin_matches_stock_accelerate_and_resume_at_step_10(tiny_llama_dir, tmp_path):
    kw = dict(init_process_group=False, timeout=300, model_dir=str(tiny_llama_dir), steps=STEPS)
    stock = run_on_ranks(workers_parity.train, 2, mode="stock", **kw)[0]
    ours = run_on_ranks(workers_parity.train, 2, mode="memsafe", save_at=10, ckpt=str(tmp_path / "ckpt"), **kw)[0]
    assert stock["fsdp2"] and ours["fsdp2"]
    assert len(ours["losses"]) == len(stock["losses"]) == STEPS
    assert ours["losses"] == stock["losses"], "plugin and stock accelerate must train identically"
    assert ours["losses"][0] != ours["losses"][-1], "the run must actually train"
    resumed = run_on_ranks(workers_parity.train, 2, mode="memsafe", start=10, resume_from=str(tmp_path / "ckpt"), **kw)[0]
    assert resumed["losses"] == ours["losses"][10:], "resume at step 10 must continue the trajectory exactly"
