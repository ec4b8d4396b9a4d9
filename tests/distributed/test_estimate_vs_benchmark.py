"""`accelerate-memsafe estimate` against what `benchmarks/prepare.py` measures at 2 ranks: within 25%.

Runs the prepare benchmark (stock accelerate and the plugin, fp32 and bf16 + mixed precision) on a ~290 MB
Llama and compares each rank's measured peak private memory (RssAnon over baseline) with the prediction
made from the checkpoint's safetensors headers alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accelerate_memsafe.memory.estimate import predict, summarize_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


@pytest.fixture(scope="module")
def prepare_benchmark(tmp_path_factory):
    cache = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "prepare.py"), "--model-size", "100m", "--world-size", "2",
         "--paths", "memsafe,stock", "--dtype", "fp32,bf16", "--cache-dir", str(cache)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return cache, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("setting", ["fp32", "bf16"])
def test_prepare_predictions_within_25_percent_of_the_benchmark(prepare_benchmark, setting):
    cache, result = prepare_benchmark
    measured = next(s for s in result["settings"] if s["setting"] == setting)
    dtype, mp = ("fp32", "no") if setting == "fp32" else ("bf16", "bf16")
    summary = summarize_checkpoint(cache / f"llama-100m-{setting}")
    preds = predict(summary, num_processes=2, dtype=dtype, mixed_precision=mp, bucket_bytes=int(result["bucket_mib"] * MIB))
    stage_of = {"memsafe": "rank0_distribute", "stock": "accelerate.prepare"}
    rows = []
    for path, stage in stage_of.items():
        for run in measured["runs"][path]:
            pred = next(p for p in preds if p.path == path and p.stage == stage and p.rank == run["rank"])
            got = run["anon_peak_mib"]
            want = pred.cpu_anon_bytes / MIB
            rows.append((path, run["rank"], round(want, 1), round(got, 1)))
            assert abs(want - got) <= 0.25 * got, f"{setting} {path} rank {run['rank']}: predicted {want:.1f} MiB, measured {got:.1f} MiB"
    print(rows)
