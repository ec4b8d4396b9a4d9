"""``benchmarks/overhead.py``'s statistics: the interval of the ratio of median ``prepare`` walls, and the plugin's
own time per launch (the slowest rank's wall less the most stock-equivalent work any rank did)."""

from __future__ import annotations

from .bench import load_benchmark

overhead = load_benchmark("overhead")


def test_the_interval_holds_the_ratio_of_medians_and_narrows_with_steadier_walls():
    stock = [1.00, 1.02, 0.98, 1.01, 0.99, 1.03, 0.97, 1.00, 1.02, 0.98]
    plugin = [w * 1.04 for w in stock]
    lo, hi = overhead.median_ratio_interval(plugin, stock)
    assert lo <= 1.04 <= hi
    assert overhead.median_ratio_interval(plugin, stock) == (lo, hi)  # a fixed seed: the same walls, the same interval
    noisy = [w * f for w, f in zip(plugin, [0.8, 1.3, 0.9, 1.2, 1.0, 0.85, 1.25, 1.1, 0.95, 1.15])]
    nlo, nhi = overhead.median_ratio_interval(noisy, stock)
    assert nhi - nlo > hi - lo


def test_the_own_time_is_the_slowest_wall_less_the_most_stock_work(monkeypatch):
    # rank 1's wall is the slowest (it waited for rank 0 at the last agreement), rank 0 did the most stock work
    ranks = [{"rank": 0, "prepare_s": 0.150, "prepare_stock_work_s": 0.140, "save_state_s": [1.0], "commit_tail_s": [0.0],
              "load_state_s": [0.5], "cpu": {h: [0.1] for h in overhead.HOOKS}},
             {"rank": 1, "prepare_s": 0.151, "prepare_stock_work_s": 0.120, "save_state_s": [1.1], "commit_tail_s": [0.0],
              "load_state_s": [0.4], "cpu": {h: [0.1] for h in overhead.HOOKS}}]
    monkeypatch.setattr(overhead, "spawn", lambda *a, **k: ranks)
    got = overhead._launch(2, "default", "100m", 1, None)
    assert got["prepare_s"] == 0.151
    assert abs(got["prepare_own_s"] - 0.011) < 1e-12
    for r in ranks:
        r["prepare_stock_work_s"] = None  # stock's launches have no report
    assert "prepare_own_s" not in overhead._launch(2, "stock", "100m", 1, None)


def test_prepares_wall_runs_from_the_last_ranks_call_to_the_last_ranks_return_on_both_paths(monkeypatch):
    # rank 1 left the barrier 2 ms late: with the plugin, rank 0 waited for it at the preflight's exchange (its wall
    # 0.152 s holds the 2 ms); stock's rank 0 never waits (no collective in its prepare). The span from the last call
    # to the last return leaves the late start out of both alike
    common = {"save_state_s": [1.0], "commit_tail_s": [0.0], "load_state_s": [0.5],
              "cpu": {h: [0.1] for h in overhead.HOOKS}}
    plugin = [dict(common, rank=0, prepare_s=0.152, prepare_span=[10.000, 10.152], prepare_stock_work_s=0.140),
              dict(common, rank=1, prepare_s=0.150, prepare_span=[10.002, 10.152], prepare_stock_work_s=0.120)]
    stock = [dict(common, rank=0, prepare_s=0.140, prepare_span=[20.000, 20.140], prepare_stock_work_s=None),
             dict(common, rank=1, prepare_s=0.141, prepare_span=[20.002, 20.143], prepare_stock_work_s=None)]
    monkeypatch.setattr(overhead, "spawn", lambda fn, world, args, *a: plugin if args[1] == "default" else stock)
    got = overhead._launch(2, "default", "100m", 1, None)
    assert abs(got["prepare_s"] - 0.150) < 1e-9  # not rank 0's 0.152
    assert abs(got["prepare_own_s"] - 0.010) < 1e-9
    assert abs(overhead._launch(2, "stock", "100m", 1, None)["prepare_s"] - 0.141) < 1e-9


def test_the_stock_work_leaves_out_the_plugins_callbacks_inside_accelerates_wrapping():
    from types import SimpleNamespace

    from accelerate_memsafe.memory.report import MemoryReport, StageRecord

    report = MemoryReport()
    report.add(StageRecord(hook="prepare", stage="shard", rank=0, status="ran", reason=None, wall_s=0.120,
                           details={"fsdp2_wrap_s": 0.100, "own_in_wrap_s": 0.003, "unsharded_release_s": 0.004}))
    report.add(StageRecord(hook="prepare", stage="accelerate.prepare", rank=0, status="ran", reason=None,
                           wall_s=0.002))
    report.add(StageRecord(hook="prepare", stage="accelerate.prepare", rank=1, status="ran", reason=None,
                           wall_s=0.5))
    acc = SimpleNamespace(memsafe_plugin=SimpleNamespace(report=report))
    # accelerate's call, its wrapping less the group filter's callbacks, freeing the weights; rank 1's records apart
    assert abs(overhead._stock_work(acc, 0) - (0.002 + 0.100 - 0.003 + 0.004)) < 1e-12
    assert overhead._stock_work(SimpleNamespace(), 0) is None  # stock: no report


def test_the_collector_counts_alike_on_both_sides(monkeypatch):
    # the plugin's launch: rank 0 collected 1 ms in all (0.2 ms of it inside accelerate's call), rank 1 1.2 ms
    # (0.3 ms inside); stock's launch: rank 0 1.6 ms, rank 1 1.9 ms
    plugin = [{"rank": 0, "prepare_s": 0.150, "prepare_stock_work_s": 0.140, "prepare_gc_s": 0.0010,
               "prepare_gc_upstream_s": 0.0002, "save_state_s": [1.0], "commit_tail_s": [0.0], "load_state_s": [0.5],
               "cpu": {h: [0.1] for h in overhead.HOOKS}},
              {"rank": 1, "prepare_s": 0.151, "prepare_stock_work_s": 0.120, "prepare_gc_s": 0.0012,
               "prepare_gc_upstream_s": 0.0003, "save_state_s": [1.1], "commit_tail_s": [0.0], "load_state_s": [0.4],
               "cpu": {h: [0.1] for h in overhead.HOOKS}}]
    stock = [dict(r, prepare_stock_work_s=None, prepare_gc_upstream_s=None, prepare_gc_s=gc)
             for r, gc in zip(plugin, (0.0016, 0.0019))]
    monkeypatch.setattr(overhead, "spawn", lambda fn, world, args, *a: plugin if args[1] == "default" else stock)
    got = overhead._launch(2, "default", "100m", 1, None)
    assert abs(got["prepare_gc_s"] - 0.0010) < 1e-12  # the least of any rank
    assert abs(got["prepare_gc_upstream_s"] - 0.0003) < 1e-12  # the most inside accelerate's call
    assert "prepare_gc_upstream_s" not in overhead._launch(2, "stock", "100m", 1, None)
    doc = overhead.measure("100m", ["stock", "default"], ["fsdp2_2ranks"], 1, 1, log=lambda m: None, load="config")
    run = doc["runs"]["fsdp2_2ranks"]
    assert abs(run["stock"]["prepare_gc_median_s"] - 0.0016) < 1e-12
    # own 0.011 + 0.0003 inside accelerate's call - stock's 0.0016
    assert abs(run["default"]["prepare_own_gc_both_sides_median_s"] - 0.0097) < 1e-12
    row = next(line for line in overhead.markdown(doc).splitlines() if line.startswith("| fsdp2_2ranks | default |"))
    assert row.split(" | ")[-3:] == ["1.00", "0.0097", f"{100 * 0.0097 / 0.151:.1f} |"]


def test_collections_count_only_inside_the_span():
    c = overhead.Collections()
    c.spans = [(1.0, 1.5), (2.0, 3.0)]
    assert c.seconds(1.25, 2.5) == 0.25 + 0.5
    assert c.seconds(4.0, 5.0) == 0.0


def test_a_paired_rounds_prepare_runs_from_the_last_call_to_the_last_return_and_the_other_hooks_take_the_slowest():
    ranks = [{"default": {"prepare_s": [0.052], "prepare_span": [[5.000, 5.052]], "save_state_s": [0.9]}},
             {"default": {"prepare_s": [0.050], "prepare_span": [[5.002, 5.052]], "save_state_s": [1.1]}}]
    assert abs(overhead._round_wall(ranks, "default", "prepare_s", 0) - 0.050) < 1e-9  # rank 1 called 2 ms late
    assert overhead._round_wall(ranks, "default", "save_state_s", 0) == 1.1


def test_a_paired_rounds_own_time_is_the_wall_less_the_stock_work_of_the_same_call(monkeypatch):
    # prepare: the round's span (rank 1 called 2 ms late: 0.050 s) less the most stock work of any rank (0.046 s);
    # save_state: the most any rank spent outside accelerate's call (rank 0: 0.900 - 0.890); load_state: none
    other = {"commit_tail_s": [0.0], "load_state_s": [0.3]}
    plugin = [{"prepare_s": [0.052], "prepare_span": [[5.000, 5.052]], "prepare_stock_work_s": [0.046],
               "save_state_s": [0.900], "save_state_upstream_s": [0.890], **other},
              {"prepare_s": [0.050], "prepare_span": [[5.002, 5.052]], "prepare_stock_work_s": [0.040],
               "save_state_s": [0.901], "save_state_upstream_s": [0.896], **other}]
    stock = [{"prepare_s": [0.047], "prepare_span": [[6.000, 6.047]], "save_state_s": [0.95], **other}] * 2
    ranks = [{"default": p, "stock": s} for p, s in zip(plugin, stock)]
    assert abs(overhead._round_own(ranks, "prepare_s", 0) - 0.004) < 1e-9
    assert abs(overhead._round_own(ranks, "save_state_s", 0) - 0.010) < 1e-9
    assert overhead._round_own(ranks, "load_state_s", 0) is None
    monkeypatch.setattr(overhead, "spawn", lambda *a, **k: ranks)
    doc = overhead.measure_paired("100m", ["fsdp2_2ranks"], 1, 1, log=lambda m: None, load="config")
    row = doc["settings"]["fsdp2_2ranks"]
    assert abs(row["default_prepare_s_own_median"] - 0.004) < 1e-9 and "default_load_state_s_own_median" not in row
    lines = {line.split(" | ")[1]: line for line in overhead.markdown_paired(doc).splitlines()
             if line.startswith("| fsdp2_2ranks |")}
    # the wall added: the plugin's round wall less stock's (prepare: 0.050 - 0.047; save_state: 0.901 - 0.95); for
    # prepare also the stock work inside the plugin's call (the most of any rank: 0.046) beside stock's 0.047
    assert abs(row["prepare_s_added_median"] - 0.003) < 1e-9 and abs(row["save_state_s_added_median"] + 0.049) < 1e-9
    assert abs(row["default_prepare_s_stock_work_median"] - 0.046) < 1e-9
    assert lines["prepare"].endswith(f"| 0.0040 | {100 * 0.004 / 0.047:.1f} | 0.0030 | {100 * 0.003 / 0.047:.1f} | 0.0460 |")
    assert lines["save_state"].endswith(f"| 0.0100 | {100 * 0.010 / 0.95:.1f} | -0.0490 | {100 * -0.049 / 0.95:.1f} | - |")
    assert lines["load_state"].endswith("| - | - | 0.0000 | 0.0 | - |")


def test_the_stock_work_of_one_call_counts_only_that_calls_records():
    from types import SimpleNamespace

    from accelerate_memsafe.memory.report import MemoryReport, StageRecord

    report = MemoryReport()
    for wall in (0.5, 0.002):  # an earlier call's record, then this call's
        report.add(StageRecord(hook="prepare", stage="accelerate.prepare", rank=0, status="ran", reason=None,
                               wall_s=wall))
    report.add(StageRecord(hook="save_state", stage="accelerate.save_state", rank=0, status="ran", reason=None,
                           wall_s=0.7))
    acc = SimpleNamespace(memsafe_plugin=SimpleNamespace(report=report))
    assert overhead._stock_work(acc, 0, since=1) == 0.002
    assert overhead._upstream_wall(acc, 0, "save_state", 0) == 0.7
    assert overhead._upstream_wall(acc, 0, "save_state", 1) is None


def test_the_device_option_refuses_what_it_cannot_measure_before_any_launch():
    # a GPU: one process on it; the FSDP2 settings are CPU gloo ranks, which the plugin sets up only without one
    assert overhead.device_problem("cuda", ["1proc"], cuda_available=True, accelerator_available=True) is None
    assert "drop fsdp2_2ranks, fsdp2_tw_2ranks" in overhead.device_problem(
        "cuda", ["1proc", "fsdp2_2ranks", "fsdp2_tw_2ranks"], cuda_available=True, accelerator_available=True)
    assert "no CUDA device" in overhead.device_problem("cuda", ["1proc"], cuda_available=False,
                                                       accelerator_available=False)
    assert "machine without an accelerator" in overhead.device_problem(
        "cpu", ["1proc", "fsdp2_2ranks"], cuda_available=True, accelerator_available=True)
    # the CPU everywhere where there is no GPU (this project's machines)
    assert overhead.device_problem("cpu", list(overhead.SETTINGS), cuda_available=False,
                                   accelerator_available=False) is None
    assert overhead.device_problem("cpu", ["1proc"], cuda_available=True, accelerator_available=True) is None


def test_a_cuda_run_writes_its_own_regions_beside_the_cpu_ones():
    doc = {"size": "100m", "device": "cuda", "launches": 1, "repeats": 1, "timestamp": "t", "settings": {}}
    assert "<!-- table: overhead-paired-100m-cuda -->" in overhead.markdown_paired(doc)
    assert "on `cuda`" in overhead.markdown_paired(doc)
    cpu = overhead.markdown_paired({**doc, "device": "cpu"})
    assert "<!-- table: overhead-paired-100m -->" in cpu and "cuda" not in cpu
