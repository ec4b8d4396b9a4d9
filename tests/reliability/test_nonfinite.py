"""NaN/Inf: in a source weight with ``check_finite_weights=True`` (opt-in), and in a non-persistent buffer
(always): ``prepare`` refuses, naming the tensor and the rank(s); the checkpoint is not modified."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.reliability import corrupt, workers_faults
from tests.spawn import run_on_ranks

NAN_WEIGHT = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def nan_checkpoint(tmp_path):
    from accelerate_memsafe.models import build_llama

    model = build_llama("tiny", seed=0)
    with torch.no_grad():
        model.get_parameter(NAN_WEIGHT)[3, 5] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_nan_source_weight_is_refused_when_checked(nan_checkpoint, tmp_path):
    before = corrupt.tree_digest(tmp_path)
    results = run_on_ranks(workers_faults.nonfinite, 2, timeout=120, init_process_group=False, expect_failure=True,
                           where="weight", model_dir=str(nan_checkpoint), timeout_s=5.0)
    (s0, r0), (s1, r1) = results
    assert s0 == "ok" and s1 == "ok", results
    # checked before anything moves: every rank refuses together, naming rank 0 and (there) the tensor
    assert r0["error"] == r1["error"] == "CheckpointError", results
    assert f"['{NAN_WEIGHT}'] contain NaN or Inf" in r0["message"], r0["message"]
    assert "rank(s) [0] cannot take part" in r1["message"], r1["message"]
    assert r0["params_on_meta"] == 0, "rank 0's weights must not have been moved before the refusal"
    assert corrupt.tree_digest(tmp_path) == before


def test_nan_non_persistent_buffer_is_always_refused(tiny_llama_dir):
    results = run_on_ranks(workers_faults.nonfinite, 2, timeout=120, init_process_group=False, expect_failure=True,
                           where="buffer", model_dir=str(tiny_llama_dir), timeout_s=5.0)
    for status, out in results:
        assert status == "ok", results
        assert out["error"] == "StageError", out
        assert "`model.scale_table` is not finite on rank(s) [0, 1]" in out["message"], out["message"]
