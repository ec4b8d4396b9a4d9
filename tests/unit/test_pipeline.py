"""The pipeline runner: order, skip records, after() in reverse, failures, probe figures."""

from __future__ import annotations

import pytest
import torch

from accelerate_memsafe.memory.report import RECORD_KEYS, MemoryReport
from accelerate_memsafe.pipeline import HookContext, Pipeline, Stage, ran, skipped


class _Log(Stage):
    hooks = ("save_state",)

    def __init__(self, name, log, *, skip=False, fail=False, alloc=0):
        self.name = name  # type: ignore[misc]
        self.log, self.skip, self.fail, self.alloc = log, skip, fail, alloc

    def run(self, ctx):
        self.log.append(f"run:{self.name}")
        if self.fail:
            raise RuntimeError("boom")
        if self.skip:
            return skipped("nothing to do here")
        if self.alloc:
            ctx.scratch[self.name] = torch.ones(self.alloc // 4)
        return ran(items=3)

    def after(self, ctx):
        self.log.append(f"after:{self.name}")


def _ctx():
    return HookContext(hook="save_state", rank=0, world_size=1, device=torch.device("cpu"), options=None)


def test_stages_run_in_order_then_upstream_then_after_in_reverse():
    log: list[str] = []
    report = MemoryReport()
    pipe = Pipeline({"save_state": (_Log("a", log), _Log("b", log), _Log("c", log, skip=True))}, report)

    def upstream(ctx):
        log.append("upstream")
        return "saved"

    assert pipe.run(_ctx(), upstream) == "saved"
    assert log == ["run:a", "run:b", "run:c", "upstream", "after:b", "after:a"]
    names = [(r.stage, r.status) for r in report.records]
    assert names == [("a", "ran"), ("b", "ran"), ("c", "skipped"), ("accelerate.save_state", "ran")]
    skipped_rec = report.find(stage="c")[0]
    assert skipped_rec.reason == "nothing to do here"
    assert report.find(stage="a")[0].details == {"items": 3}
    for rec in report.to_dict()["records"]:
        assert set(RECORD_KEYS) <= set(rec)


def test_skip_upstream_replaces_accelerates_call():
    class Replace(Stage):
        name = "replace"
        hooks = ("save_state",)

        def run(self, ctx):
            ctx.skip_upstream = "done by replace"
            ctx.result = 42
            return ran()

    report = MemoryReport()
    out = Pipeline({"save_state": (Replace(None),)}, report).run(_ctx(), lambda c: pytest.fail("upstream ran"))
    assert out == 42
    assert [r.stage for r in report.records] == ["replace"]


def test_a_failing_stage_is_recorded_and_the_error_names_stage_hook_rank():
    log: list[str] = []
    report = MemoryReport()
    pipe = Pipeline({"save_state": (_Log("ok", log), _Log("bad", log, fail=True))}, report)
    with pytest.raises(RuntimeError, match="boom") as info:
        pipe.run(_ctx(), lambda c: log.append("upstream"))
    assert "stage `bad` at hook `save_state` on rank 0" in "".join(info.value.__notes__)
    assert "upstream" not in log, "upstream must not run after a failed stage"
    assert [(r.stage, r.status) for r in report.records] == [("ok", "ran"), ("bad", "failed")]


def test_probe_sees_the_memory_a_stage_allocates():
    report = MemoryReport()
    size = 64 * 2**20
    Pipeline({"save_state": (_Log("alloc", [], alloc=size),)}, report).run(_ctx(), lambda c: None)
    rec = report.find(stage="alloc")[0]
    assert rec.live_tensor_peak_bytes >= size
    assert rec.cpu_anon_delta_bytes >= size * 0.9
    assert rec.cpu_rss_peak_bytes >= rec.cpu_rss_start_bytes + size * 0.9
    assert rec.wall_s > 0
    assert rec.device_peak_bytes is None  # no CUDA here


def test_preflight_refuses_a_stage_that_cannot_fit_before_it_starts():
    from accelerate_memsafe import MemoryBudgetError, MemSafePlugin
    from accelerate_memsafe.pipeline import MemoryEstimate

    log: list[str] = []

    class Huge(_Log):
        def estimate(self, ctx):
            return MemoryEstimate(cpu_bytes=1 << 60, what="a 1 EiB tensor")

    ctx = _ctx()
    ctx.options = MemSafePlugin(stages=["shard"])
    pipe = Pipeline({"save_state": (Huge("huge", log),)}, MemoryReport())
    with pytest.raises(MemoryBudgetError, match=r"stage `huge` at hook `save_state` on rank 0 would not fit \(CPU: needs"):
        pipe.run(ctx, lambda c: log.append("upstream"))
    assert log == [], "nothing may run after a failed preflight check"
    ctx.options = MemSafePlugin(stages=["shard"], preflight_memory_check=False)
    pipe.run(ctx, lambda c: log.append("upstream"))
    assert log == ["run:huge", "upstream", "after:huge"]
