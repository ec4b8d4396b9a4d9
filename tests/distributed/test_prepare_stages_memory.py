"""Structural memory bounds of the rank-0 load, counted with the dispatch-level LiveTensorTracker: they
hold by construction, not by luck of timing. The stock path runs as a control (the checks can fail)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import workers_prepare as w
from tests.spawn import run_on_ranks

BUCKET = 256 * 1024
#: tiny collective scratch tensors (metadata sizes, flags, checksums) that are not weight copies
SLACK = 4096


@pytest.fixture(scope="module")
def small_llama_dir(tmp_path_factory):
    from accelerate_memsafe.models import save_llama

    return save_llama(tmp_path_factory.mktemp("small-llama"), "small")


def _full_size_allocs(res):
    full = {shape for shape in res["full_shapes"].values() if shape[0] >= 2}
    return [a for a in res["allocs"] if a[1] in full]


@pytest.mark.parametrize("loader,setting", [("memsafe", "fp32"), ("hf", "fp32"), ("memsafe", "bf16")])
def test_rank1_never_allocates_a_full_parameter_and_rank0_stays_within_the_bucket(small_llama_dir, tmp_path, loader, setting):
    model_dir, extra = small_llama_dir, {}
    if setting == "bf16":  # fp32 master weights: rank 0 sends the bf16 rows as they are, rank 1 widens them
        from accelerate_memsafe.models import save_llama

        model_dir = save_llama(tmp_path / "bf16", "small", dtype=torch.bfloat16)
        extra = {"dtype": "bfloat16", "mixed_precision": "bf16"}
    results = run_on_ranks(
        w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(model_dir), loader=loader,
        track=True, plugin_kwargs={"bucket_bytes": BUCKET, "prefetch_buckets": 2, "load_source": "rank0"},
        **extra,
    )
    rank0, rank1 = results
    assert rank1["allocs"] or setting == "fp32", "the tracker must see rank 1's staging buffers"
    assert _full_size_allocs(rank1) == [], "rank 1 allocated a full-size copy of a sharded parameter"
    largest_full = max(4 * n0 * (n1 if len(s) > 1 else 1) for s in rank1["full_shapes"].values() for n0, n1 in [(s[0], s[-1])])
    assert max((a[2] for a in rank1["allocs"]), default=0) < largest_full
    # rank 0: bucket buffers + conversion temporaries alive at once (its shards are allocated by DTensor's
    # own dispatch, below the tracker) never exceed bucket_bytes
    assert rank0["tracker_peak"] <= BUCKET + SLACK, rank0["tracker_peak"]
    threads = {t for _, t in rank0["releases"]}
    assert len(rank0["releases"]) >= len(rank0["full_shapes"]) and rank1["releases"] == []
    rec1 = [r for r in rank1["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == 1][0]
    shard1 = sum(p["local"].numel() * p["local"].element_size() for p in rank1["params"].values())
    # pieces are sent from rank 0's tensors or the file as they are (in bf16 too: rank 1 widens them): no bucket
    # buffer; a tensor sent as its own bytes is released once its last bucket has been sent: by the prefetch thread
    # before it prepares the next bucket, the last bucket's by the sending thread as the prefetcher closes
    bucket_sized = [a for a in rank0["allocs"] if len(a[1]) == 1 and a[2] >= BUCKET // 8 and "empty" in a[0]]
    assert bucket_sized == [], bucket_sized
    assert threads == {"memsafe-prefetch", "MainThread"}, threads
    # in bf16, half the bytes of rank 1's fp32 shard travel
    assert rec1["details"]["bytes_received"] * (1 if setting == "fp32" else 2) == shard1
    rec = [r for r in rank0["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == 0][0]
    assert rec["details"]["buckets"] >= 10


def test_control_stock_accelerate_path_breaks_both_bounds(small_llama_dir):
    # stages=[]: accelerate's own fsdp2_prepare_model with cpu_ram_efficient_loading=True (broadcast)
    results = run_on_ranks(
        w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir), loader="hf",
        track=True, plugin_kwargs={"stages": [], "bucket_bytes": BUCKET},
    )
    rank0, rank1 = results
    assert _full_size_allocs(rank1), "stock accelerate receives every full tensor on rank 1"
    assert rank0["tracker_peak"] > 4 * BUCKET
