"""`accelerate-memsafe estimate` against what `benchmarks/estimate.py` measures, rank by rank and stage by stage.

The estimate's terms follow the code (accelerate_memsafe/memory/estimate.py); its only measured constants come
from the trivial `tiny` Llama, which none of these cases uses. Default suite: one spawn of 4 ranks preparing a
small Qwen3-MoE (fused experts padded by FSDP2, bf16 + mixed precision, `load_source="auto"`: every rank reads
the mapped weights, rank 0 scatters the fused experts), and the same model on the two 2-D meshes where a rank holds
a block per `dp_shard` rank, not per rank (HSDP 2 x 2; FSDP 2 x TP 2 with the plan declined), its resume
(`load_state` in fresh processes, with the plugin and stock), and a load back into the optimizer that holds the state,
which the estimate bounds from above. `-m slow`: the whole matrix of docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"meta_placement", "shard", "rank0_distribute", "buffer_init", "accelerate.prepare"}


def _run(cases: list[str], cache: Path, timeout: float) -> dict:
    """The benchmark's JSON for ``cases`` (``timeout``: seconds per case, building its checkpoint included)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "estimate.py"), "--cases", ",".join(cases), "--cache-dir", str(cache),
         "--timeout", str(timeout)],
        env=env, capture_output=True, text=True, timeout=timeout * len(cases) + 120,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(doc: dict, expected: dict[str, int]) -> None:
    rows = doc["rows"]
    for case, ranks in expected.items():
        got = {(r["rank"], r["stage"]) for r in rows if r["case"] == case}
        if "-resume" in case:  # the optimizer's reload (stock: accelerate's whole load_state)
            stages = {"accelerate.load_state"} if case.endswith("-stock") else {"optimizer_cpu_reload"}
        elif "-reload" in case:  # the same, and the whole hook
            stages = {"accelerate.load_state" if case.endswith("-stock") else "optimizer_cpu_reload", "whole hook"}
        else:
            stages = {"accelerate.prepare"} if case.endswith("-stock") else STAGES
        assert got == {(rank, s) for rank in range(ranks) for s in stages}, f"{case}: rows for {sorted(got)}"
    # the weight-moving stages are decided by the 25% rule, never by the few-MiB floor, on every rank: the benchmark
    # trims the heap before each stage (`memory_trim_heap`), so rank 0 no longer measures below its estimate where it
    # reuses memory freed before the stage (the `released` slack this test allowed rank 0 before)
    moving = [r for r in rows if (r["stage"] in ("rank0_distribute", "optimizer_cpu_reload") or r["path"] == "stock")
              and r["within"] != "bound"]
    off = [(r["case"], r["rank"], r["stage"], r["estimated_mib"], r["measured_mib"], r["within"]) for r in moving
           if r["within"] != "25%"]
    assert moving or all(r["within"] == "bound" for r in rows), "no weight-moving row to check"
    assert not off, f"weight-moving rows (estimated, measured MiB) outside 25%: {off}"
    wrong = [(r["case"], r["rank"], r["stage"], r["estimated_mib"], r["measured_mib"]) for r in rows
             if not r["agrees"]]
    assert not wrong, f"estimate vs measured (MiB) beyond 25% / the floor: {wrong}"


def test_estimate_predicts_a_4_rank_moe_prepare_rank_by_rank_and_stage_by_stage(tmp_path):
    doc = _run(["moe-small-bf16-4"], tmp_path, timeout=600)
    _check(doc, {"moe-small-bf16-4": 4})
    sources = {r["load_source"] for r in doc["rows"]}
    assert sources == {"auto (every_rank+rank0)"}, "every rank reads the mapped weights, rank 0 scatters the fused experts"


def test_estimate_predicts_hsdp_and_a_declined_tp_plan_from_the_blocks_a_rank_holds(tmp_path):
    """4 ranks, 2 distinct blocks of every weight: each rank holds half, where the estimate took a quarter before
    (it predicted 18-22 MiB for `rank0_distribute`, which measures 33-39 MiB here)."""
    doc = _run(["moe-small-bf16-hsdp4", "moe-small-bf16-tp4"], tmp_path, timeout=600)
    _check(doc, {"moe-small-bf16-hsdp4": 4, "moe-small-bf16-tp4": 4})
    meshes = {r["case"]: r["mesh"] for r in doc["rows"]}
    assert meshes == {"moe-small-bf16-hsdp4": "4 (dp_replicate 2 x dp_shard 2)", "moe-small-bf16-tp4": "4 (dp_shard 2 x tp 2)"}
    declined = {m["stages"]["shard"]["details"].get("tp_declined") is not None for m in doc["measured"]["moe-small-bf16-tp4"]}
    assert declined == {True}, "Qwen3-MoE's TP plan (styles torch has no counterpart of) is declined on every rank"


def test_estimate_predicts_a_resume_rank_by_rank(tmp_path):
    """A restarted job's `load_state` (fresh processes, an optimizer with no state yet), 4 ranks: the plugin reads the
    AdamW state of a rank's rows straight into new tensors (S plus its largest tensor), stock holds the loaded state
    and the optimizer's copy of it (2 S). The last rank holds 1 of the 10 expert rows the others hold 3 of: its
    state is smaller, and predicted so."""
    doc = _run(["moe-small-bf16-4-resume", "moe-small-bf16-4-resume-stock"], tmp_path, timeout=600)
    _check(doc, {"moe-small-bf16-4-resume": 4, "moe-small-bf16-4-resume-stock": 4})
    est = {(r["case"], r["rank"]): r["estimated_mib"] for r in doc["rows"]}
    for case in ("moe-small-bf16-4-resume", "moe-small-bf16-4-resume-stock"):
        assert est[(case, 3)] < est[(case, 0)] == est[(case, 1)] == est[(case, 2)]
    assert all(est[("moe-small-bf16-4-resume", r)] < est[("moe-small-bf16-4-resume-stock", r)] for r in range(4))


def test_estimate_bounds_a_load_into_held_state_which_reads_in_place(tmp_path):
    """A load back into the optimizer that holds the state (the launch trains a step, saves and loads it): the plugin
    reads every byte into the tensors already there (none new), and the estimate, a restarted job's, is an upper bound
    of each rank's stage and of its whole hook, with the plugin and with stock (whose own load is in place too)."""
    cases = ["moe-small-bf16-4-reload", "moe-small-bf16-4-reload-stock"]
    doc = _run(cases, tmp_path, timeout=600)
    _check(doc, {c: 4 for c in cases})
    assert {r["within"] for r in doc["rows"]} == {"bound"}
    for run in doc["measured"]["moe-small-bf16-4-reload"]:
        d = run["stages"]["optimizer_cpu_reload"]["details"]
        assert d["in_place_bytes"] == d["bytes_read"] == d["state_bytes"] > 0 and d["new_bytes"] == 0, (run["rank"], d)


@pytest.mark.slow
def test_estimate_predicts_the_whole_matrix(tmp_path):
    cases = {"moe-bf16-4": 4, "moe-bf16-4-rank0": 4, "moe-bf16-4-stock": 4, "llama-fp32-2": 2, "llama-fp32-2-rank0": 2,
             "llama-fp32-2-stock": 2, "moe-small-bf16-hsdp4-stock": 4, "llama-fp32-tp4": 4, "llama-fp32-2-resume": 2,
             "llama-fp32-2-resume-stock": 2, "moe-small-bf16-cp4": 4, "moe-small-bf16-cp4-stock": 4}
    _check(_run(list(cases), tmp_path, timeout=600), cases)
