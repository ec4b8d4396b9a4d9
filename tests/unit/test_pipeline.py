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


@pytest.mark.parametrize("trim", [False, True])
def test_memory_trim_heap_hands_the_freed_heap_back_before_each_probed_part(monkeypatch, trim):
    # `MemSafePlugin(memory_trim_heap=True)` (what benchmarks/estimate.py measures with): malloc_trim before every
    # probed part (each stage's run and after, accelerate's call), never by default
    import accelerate_memsafe.memory.probe as probe_mod
    from accelerate_memsafe import MemSafePlugin

    calls = []
    monkeypatch.setattr(probe_mod, "malloc_trim", lambda: calls.append(1))
    assert MemSafePlugin(memory_trim_heap=trim).pipeline.trim_heap is trim
    log: list[str] = []
    pipe = Pipeline({"save_state": (_Log("a", log),)}, MemoryReport(), trim_heap=trim)
    pipe.run(_ctx(), lambda ctx: None)
    assert log == ["run:a", "after:a"]
    assert len(calls) == (3 if trim else 0), "the stage's run, accelerate's call, the stage's after"


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
    # glibc's freed heap handed back by a free inside the stage would offset the allocation (an earlier test in
    # the same process leaves hundreds of MB free in the heap): the heap is trimmed before the probe reads
    Pipeline({"save_state": (_Log("alloc", [], alloc=size),)}, report, trim_heap=True).run(_ctx(), lambda c: None)
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


@pytest.mark.parametrize("needed", [True, False])
def test_an_estimate_that_waits_for_the_announcements_is_asked_only_where_they_call_for_it(needed):
    # one process: the stage's `needs_estimate` reads this rank's own announcement, then the estimate is checked
    from accelerate_memsafe import MemoryBudgetError, MemSafePlugin
    from accelerate_memsafe.pipeline import ANNOUNCED_KEY, MemoryEstimate

    log: list[str] = []

    class Deferred(_Log):
        def announce(self, ctx):
            return {"will_run": needed}

        def needs_estimate(self, ctx):
            log.append("needs_estimate")
            return ctx.scratch[ANNOUNCED_KEY]["deferred"][0]["will_run"]

        def estimate(self, ctx):
            log.append("estimate")
            return MemoryEstimate(cpu_bytes=1 << 60, what="a 1 EiB tensor")

    ctx = _ctx()
    ctx.options = MemSafePlugin(stages=["shard"])
    pipe = Pipeline({"save_state": (Deferred("deferred", log),)}, MemoryReport())
    if needed:
        with pytest.raises(MemoryBudgetError, match=r"stage `deferred` at hook `save_state` on rank 0 would not fit"):
            pipe.run(ctx, lambda c: log.append("upstream"))
        assert log == ["needs_estimate", "estimate"]
    else:
        pipe.run(ctx, lambda c: log.append("upstream"))
        assert log == ["needs_estimate", "run:deferred", "upstream", "after:deferred"]


class _CountingProbe:
    """Stands in for ``MemoryProbe`` and counts the regions probed."""

    made: list[str] = []

    def __init__(self, *args, **kwargs):
        from accelerate_memsafe.memory.probe import MemoryProbe

        self._probe = MemoryProbe(*args, **kwargs)
        _CountingProbe.made.append("probe")

    def __enter__(self):
        self._probe.__enter__()
        return self

    def __exit__(self, *exc):
        return self._probe.__exit__(*exc)

    @property
    def result(self):
        return self._probe.result


def test_a_stage_that_does_not_apply_is_not_probed_and_reports_only_its_reason(monkeypatch):
    import accelerate_memsafe.pipeline as pipeline_mod

    class NotHere(_Log):
        def skip_reason(self, ctx):
            return "no PEFT model"

        def run(self, ctx):
            pytest.fail("run() of a stage whose skip_reason said it does not apply")

    monkeypatch.setattr(pipeline_mod, "MemoryProbe", _CountingProbe)
    _CountingProbe.made = []
    log: list[str] = []
    report = MemoryReport()
    Pipeline({"save_state": (NotHere("peft_cpu_reload", log), _Log("b", log))}, report).run(_ctx(), lambda c: None)
    assert log == ["run:b", "after:b"], "neither run() nor after() of a skipped stage may be called"
    # one probe for `b`'s run, one for accelerate's call, one for `b`'s after: none for the skipped stage
    assert len(_CountingProbe.made) == 3
    rec = report.find(stage="peft_cpu_reload")[0]
    assert (rec.status, rec.reason) == ("skipped", "no PEFT model")
    figures = [k for k in RECORD_KEYS if k.endswith("_bytes")]
    assert rec.wall_s == 0 and all(getattr(rec, k) is None for k in figures)
    assert rec.timeline == [] and rec.segments == [] and rec.details == {}
    row = next(line for line in report.to_markdown().splitlines() if "peft_cpu_reload" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:5] == ["skipped", "-"], f"a stage that did not run must not show a measured wall time: {row}"
    assert cells[-1] == "no PEFT model"
    ran_row = next(line for line in report.to_markdown().splitlines() if "| b |" in line)
    assert [c.strip() for c in ran_row.strip("|").split("|")][4] != "-"


_SUBPROCESS_SKIPS = r'''
import json, sys, tempfile
import torch
import accelerate_memsafe.pipeline as pipeline_mod
from accelerate_memsafe import Accelerator, MemSafePlugin
from accelerate_memsafe.models import build_llama

probed = []
real = pipeline_mod.MemoryProbe
class Counting(real):
    def __init__(self, *a, **k):
        probed.append(1)
        super().__init__(*a, **k)
pipeline_mod.MemoryProbe = Counting
acc = Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True)
model, opt = acc.prepare(build_llama("tiny"), torch.optim.AdamW(build_llama("tiny").parameters()))
with tempfile.TemporaryDirectory() as d:
    acc.save_state(d + "/ckpt")
    acc.load_state(d + "/ckpt")
recs = acc.memsafe_plugin.report.records
print(json.dumps({"peft_imported": "peft" in sys.modules, "probes": len(probed),
                  "measured": sum(len(r.segments) for r in recs
                                  if not r.details.get("background") and r.details.get("memory_measured", True)),
                  "timed_only": [(r.hook, r.stage, r.wall_s > 0, r.cpu_rss_peak_bytes, r.cpu_anon_peak_bytes)
                                 for r in recs if r.details.get("memory_measured") is False],
                  "skipped": [(r.hook, r.stage, r.reason, r.wall_s, r.cpu_anon_peak_bytes, r.live_tensor_peak_bytes)
                              for r in recs if r.status == "skipped"],
                  "live": sorted({str(r.live_tensor_peak_bytes) for r in recs}),
                  "anon_measured": all(r.cpu_anon_peak_bytes for r in recs if r.segments and not r.details.get("background")
                                       and r.details.get("memory_measured", True)),
                  "not_measured": acc.memsafe_plugin.report.to_dict().get("not_measured"),
                  "markdown_note": "Not measured: `live_tensor_peak_bytes`" in acc.memsafe_plugin.report.to_markdown()}))
'''


def test_default_pipeline_skips_cost_no_probe_and_no_import():
    """One process, no PEFT model, no dataloader: every stage that does not apply is decided before it is probed,
    so the hooks create one probe per region that ran, and `peft` is never imported."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _SUBPROCESS_SKIPS], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not out["peft_imported"], "a load_state of a model that is not a PeftModel imported peft"
    assert out["probes"] == out["measured"], out  # one probe per measured part (run, accelerate's call, after)
    # the one hook call where every stage skipped (prepare: one process, no FSDP) times accelerate's call only
    assert out["timed_only"] == [["prepare", "accelerate.prepare", True, None, None]], out
    assert "probe_hooks_without_stages=True" in out["not_measured"]["hooks_without_stages"]
    skipped = {(hook, stage): rest for hook, stage, *rest in out["skipped"]}
    assert skipped[("load_state", "peft_cpu_reload")] == ["no PEFT model", 0, None, None]
    for stage in ("meta_placement", "shard", "buffer_init", "optimizer_offload", "dataloader_resume"):
        assert skipped[("prepare", stage)][1:] == [0, None, None], (stage, skipped)
    # the live-tensor tracker is off by default: no record claims a tensor peak, and the report says why
    assert out["live"] == ["None"] and out["anon_measured"]
    assert "tracker is off" in out["not_measured"]["live_tensor_peak_bytes"] and out["markdown_note"]


@pytest.mark.parametrize("probe_them", [False, True])
def test_accelerates_call_in_a_hook_where_no_stage_ran_is_timed_only_unless_asked(monkeypatch, probe_them):
    """Where every stage skipped, the hook is accelerate's call alone: by default it is timed, not probed (the memory
    readings and the sampling thread's wake-up would cost a call of a few milliseconds a tenth of its wall); with
    ``probe_hooks_without_stages=True`` it is probed like any other part. A hook where a stage ran probes it always."""
    import accelerate_memsafe.pipeline as pipeline_mod
    from accelerate_memsafe import MemSafePlugin

    monkeypatch.setattr(pipeline_mod, "MemoryProbe", _CountingProbe)
    _CountingProbe.made = []
    plugin = MemSafePlugin(probe_hooks_without_stages=probe_them)
    assert ("hooks_without_stages" in plugin.report.not_measured) is not probe_them
    log: list[str] = []

    class NotHere(_Log):
        def skip_reason(self, ctx):
            return "not here"

    report = MemoryReport()
    pipe = Pipeline({"save_state": (NotHere("a", log),)}, report, probe_hooks_without_stages=probe_them)
    size = 64 << 20

    def upstream(ctx):
        held = torch.ones(size // 4)
        return int(held[0].item())

    assert pipe.run(_ctx(), upstream) == 1 and log == []
    rec = report.find(stage="accelerate.save_state")[0]
    assert rec.status == "ran" and rec.wall_s > 0 and len(rec.segments) == 1
    assert len(_CountingProbe.made) == int(probe_them)
    if probe_them:
        # the call's 64 MiB seen (half of it: inside the whole suite another thread of the process may free memory
        # meanwhile; once ~6 MiB did, and a 0.9 bound failed)
        assert rec.cpu_anon_peak_bytes >= rec.cpu_anon_start_bytes + size // 2 and "memory_measured" not in rec.details
    else:
        assert rec.details == {"memory_measured": False} and rec.timeline == []
        assert all(getattr(rec, k) is None for k in RECORD_KEYS if k.endswith("_bytes"))
    # a stage that runs: accelerate's call is probed, whatever the option
    _CountingProbe.made = []
    report = MemoryReport()
    Pipeline({"save_state": (_Log("b", log),)}, report, probe_hooks_without_stages=probe_them).run(_ctx(), upstream)
    assert len(_CountingProbe.made) == 3 and report.find(stage="accelerate.save_state")[0].cpu_anon_peak_bytes


@pytest.mark.parametrize("runs", [False, True])
def test_one_process_preflight_waits_for_the_first_stage_that_runs(runs):
    """In one process the preflight (announcements, estimates, the memory check) comes right before the first stage
    that runs, and not at all where every stage skips; its check still refuses before that stage starts."""
    from accelerate_memsafe import MemoryBudgetError, MemSafePlugin
    from accelerate_memsafe.pipeline import MemoryEstimate

    log: list[str] = []

    class Announcing(_Log):
        def skip_reason(self, ctx):
            log.append(f"skip_reason:{self.name}")
            return None if runs else "not here"

        def announce(self, ctx):
            log.append(f"announce:{self.name}")

        def estimate(self, ctx):
            log.append(f"estimate:{self.name}")
            return MemoryEstimate(cpu_bytes=1 << 60, what="a 1 EiB tensor")

    class Skipping(_Log):
        def skip_reason(self, ctx):
            log.append(f"skip_reason:{self.name}")
            return "never here"

    ctx = _ctx()
    ctx.options = MemSafePlugin(stages=["shard"])
    pipe = Pipeline({"save_state": (Skipping("first", log), Announcing("second", log))}, MemoryReport())
    if runs:
        with pytest.raises(MemoryBudgetError, match=r"stage `second` at hook `save_state` on rank 0 would not fit"):
            pipe.run(ctx, lambda c: log.append("upstream"))
        assert log == ["skip_reason:first", "skip_reason:second", "announce:second", "estimate:second"]
    else:
        pipe.run(ctx, lambda c: log.append("upstream"))
        assert log == ["skip_reason:first", "skip_reason:second", "upstream"]


def _contexts(hook, world_size, is_fsdp2, options):
    """Hook contexts of every shape a call can have with these fixed facts: with or without a model, optimizers, a
    dataloader among the arguments, a checkpoint directory."""
    from torch.utils.data import DataLoader

    from accelerate_memsafe.models import build_llama

    model = build_llama("tiny")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(list(range(4)), batch_size=2)
    for with_model in (False, True):
        for with_opt in (False, True):
            for with_loader in (False, True):
                for directory in (None, "/nonexistent/memsafe-ckpt"):
                    args = tuple(x for x, keep in ((model, with_model), (opt, with_opt), (loader, with_loader)) if keep)
                    yield HookContext(hook=hook, rank=0, world_size=world_size, device=torch.device("cpu"),
                                      options=options, args=args, model=model if with_model else None,
                                      models=[model] if with_model else [], optimizers=[opt] if with_opt else [],
                                      is_fsdp2=is_fsdp2, directory=directory)


def test_a_stages_fixed_skip_reason_is_the_one_its_skip_reason_gives_on_every_call():
    """The pipeline asks ``fixed_skip_reason`` once per hook, world size and FSDP2-or-not, and then records it on every
    such call without asking ``skip_reason``: where a stage gives one, its ``skip_reason`` must give the same on every
    call those facts allow, else the one-process fast path would report (or skip) what the stage would not."""
    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.stages import DEFAULT_STAGES, STAGE_REGISTRY

    fixed_seen = set()
    for options in (MemSafePlugin(progress=False), MemSafePlugin(progress=False, optimizer_offload=True)):
        for name, cls in STAGE_REGISTRY.items():
            stage = cls(options)
            for hook in cls.hooks:
                for world_size in (1, 2):
                    for is_fsdp2 in (False, True):
                        facts = HookContext(hook=hook, rank=0, world_size=world_size, device=torch.device("cpu"),
                                            options=options, is_fsdp2=is_fsdp2)
                        fixed = stage.fixed_skip_reason(facts)
                        if fixed is None:
                            continue
                        fixed_seen.add((name, hook, world_size, is_fsdp2, options.optimizer_offload))
                        for ctx in _contexts(hook, world_size, is_fsdp2, options):
                            assert stage.skip_reason(ctx) == fixed, (name, hook, world_size, is_fsdp2, ctx.args)
    # not vacuous: in one process without FSDP2, every default prepare stage but dataloader_resume (which looks for a
    # dataloader among the arguments) is skipped on facts alone
    one_process = {n for n, hook, w, f, off in fixed_seen if hook == "prepare" and w == 1 and not f and not off}
    assert one_process == {n for n in DEFAULT_STAGES if "prepare" in STAGE_REGISTRY[n].hooks} - {"dataloader_resume"}
    assert ("optimizer_offload", "prepare", 2, True, False) in fixed_seen
    assert ("optimizer_offload", "prepare", 2, True, True) not in fixed_seen


class _FixedSkip(_Log):
    def fixed_skip_reason(self, ctx):
        return "fixed: one process" if ctx.world_size < 2 else None

    skip_reason = fixed_skip_reason


class _CallSkip(_Log):
    asked = 0

    def skip_reason(self, ctx):
        type(self).asked += 1
        return "not this call"


@pytest.mark.parametrize("fails", [False, True])
def test_a_one_process_hook_where_every_stage_skips_records_what_the_general_path_records(monkeypatch, fails):
    """One process, every stage skipped (some on fixed facts, some call by call): the pipeline's short path (no hook
    scope, no collector pause, records made when the report is read) adds the same records, in the same order, as the
    general path, and raises the same error, with the same note, when accelerate's call fails."""
    log: list[str] = []

    def upstream(ctx):
        log.append("upstream")
        if fails:
            raise ValueError("accelerate refused")
        return "prepared"

    def run(general):
        report = MemoryReport()
        pipe = Pipeline({"save_state": (_FixedSkip("a", log), _CallSkip("b", log), _FixedSkip("c", log))}, report,
                        probe_hooks_without_stages=False)  # the plugin's default
        if general:
            monkeypatch.setattr(pipe, "_every_stage_skips", lambda ctx: None)
        short_calls = []
        real = pipe._run_upstream_alone
        monkeypatch.setattr(pipe, "_run_upstream_alone", lambda *a: short_calls.append(1) or real(*a))
        if fails:
            with pytest.raises(ValueError, match="accelerate refused") as info:
                pipe.run(_ctx(), upstream)
            assert "raised in stage `accelerate.save_state` at hook `save_state` on rank 0" in info.value.__notes__[0]
        else:
            assert pipe.run(_ctx(), upstream) == "prepared"
        pipe.run(_ctx(), lambda ctx: "again")  # a second call: the fixed reasons are kept, the records follow in order
        assert len(short_calls) == (0 if general else 2)
        return report.to_dict()["records"]

    _CallSkip.asked = 0
    short = run(general=False)
    assert _CallSkip.asked == 2, "a stage without a fixed reason is asked at every call"
    general = run(general=True)
    assert log == ["upstream", "upstream"], "no stage ran on either path"

    def shape(records):
        # the times differ between two runs; whether each is a measured one, and its span, must not
        return [{**r, "wall_s": r["wall_s"] > 0, "start_s": None,
                 "segments": [len(s) for s in r["segments"]]} for r in records]

    assert shape(short) == shape(general)
    assert [(r["stage"], r["status"]) for r in short] == [
        ("a", "skipped"), ("b", "skipped"), ("c", "skipped"), ("accelerate.save_state", "failed" if fails else "ran"),
        ("a", "skipped"), ("b", "skipped"), ("c", "skipped"), ("accelerate.save_state", "ran")]
    assert short[1]["reason"] == "not this call" and short[0]["reason"] == "fixed: one process"
    assert [r["start_s"] for r in short] == sorted(r["start_s"] for r in short)
    assert short[3]["details"] == ({} if fails else {"memory_measured": False})


def test_the_short_path_settles_the_previous_hooks_background_work_first():
    """A one-process hook where every stage skips still ends the work the previous hook left in the background (rank
    0's checkpoint commit) before accelerate's call, and raises its error there, as every hook does."""
    from accelerate_memsafe.errors import CheckpointError

    log: list[str] = []
    pipe = Pipeline({"save_state": (_FixedSkip("a", log),)}, MemoryReport(), probe_hooks_without_stages=False)

    def commit():
        raise OSError("disk full")

    pipe.background.start("the commit of /ckpt/step_1", commit, rank=0)
    with pytest.raises(CheckpointError, match="disk full"):
        pipe.run(_ctx(), lambda ctx: log.append("upstream"))
    assert log == [] and pipe.background.pending is None
    assert pipe.run(_ctx(), lambda ctx: "next") == "next"
