"""Structural memory bounds of the rank-0 load, counted with the dispatch-level LiveTensorTracker: they
hold by construction, not by luck of timing. The stock path runs as a control (the checks can fail)."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("loader", ["memsafe", "hf"])
def test_rank1_never_allocates_a_full_parameter_and_rank0_stays_within_the_bucket(small_llama_dir, loader):
    results = run_on_ranks(
        w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(small_llama_dir), loader=loader,
        track=True, plugin_kwargs={"bucket_bytes": BUCKET, "prefetch_buckets": 2, "load_source": "rank0"},
    )
    rank0, rank1 = results
    assert rank1["allocs"], "the tracker must see rank 1's receive buffers"
    assert _full_size_allocs(rank1) == [], "rank 1 allocated a full-size copy of a sharded parameter"
    largest_full = max(4 * n0 * (n1 if len(s) > 1 else 1) for s in rank1["full_shapes"].values() for n0, n1 in [(s[0], s[-1])])
    assert max(a[2] for a in rank1["allocs"]) < largest_full
    # rank 0: bucket buffers + conversion temporaries alive at once (its shards are allocated by DTensor's
    # own dispatch, below the tracker) never exceed bucket_bytes
    assert rank0["tracker_peak"] <= BUCKET + SLACK, rank0["tracker_peak"]
    assert rank0["tracker_peak"] >= BUCKET // 2, "several buckets in flight: the prefetch is in use"
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
