"""meta_placement + shard + rank0_distribute + buffer_init on 2 gloo ranks: results equal an unsharded
reference load bit for bit, with every way of loading, with mixed precision, CPU offload and ties."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import workers_prepare as w
from tests.spawn import run_on_ranks


def _reference(model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)


def _ref_loss(ref) -> float:
    ids = w.batch(ref.config.vocab_size)
    with torch.no_grad():
        return ref(input_ids=ids, labels=ids).loss.float().item()


def _assert_shards_equal(results, ref_sd, *, cast=None):
    world = len(results)
    for name in results[0]["params"]:
        full = ref_sd[name] if cast is None else ref_sd[name].to(cast)
        rows = -(-full.shape[0] // world)
        for rank, res in enumerate(results):
            local = res["params"][name]["local"]
            expect = full[rank * rows : (rank + 1) * rows]
            assert local.dtype == expect.dtype, f"{name} on rank {rank}: {local.dtype} != {expect.dtype}"
            assert torch.equal(local, expect), f"rank {rank}'s shard of {name} differs from the reference"


def _assert_buffers(results, ref):
    ref_buffers = dict(ref.named_buffers())
    names = [n for n, b in results[0]["buffers"].items() if not b["persistent"]]
    assert names, "the model has non-persistent buffers"
    for name in names:
        for rank, res in enumerate(results):
            value = res["buffers"][name]["value"]
            assert torch.isfinite(value).all(), f"{name} on rank {rank}"
            assert torch.equal(value, results[0]["buffers"][name]["value"]), f"{name}: rank {rank} != rank 0"
            assert torch.equal(value, ref_buffers[name]), f"{name} on rank {rank} != reference"


def _stage_status(res, rank):
    return {r["stage"]: r["status"] for r in res["report"]["records"] if r["rank"] == rank and r["hook"] == "prepare"}


@pytest.mark.parametrize("loader,source", [("memsafe", "auto"), ("hf", "auto"), ("meta_rank1", "auto"), ("hf", "rank0")])
def test_prepare_matches_unsharded_reference(tiny_llama_dir, loader, source):
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(tiny_llama_dir),
                           loader=loader, plugin_kwargs={"load_source": source})
    ref = _reference(tiny_llama_dir)
    _assert_shards_equal(results, ref.state_dict())
    _assert_buffers(results, ref)
    ref_loss = _ref_loss(ref)
    for rank, res in enumerate(results):
        assert abs(res["loss"] - ref_loss) <= 1e-6, f"rank {rank}: loss {res['loss']} vs reference {ref_loss}"
        assert res["opt_ok"], "optimizer must hold the sharded parameters"
        status = _stage_status(res, rank)
        # every rank maps the same unmodified checkpoint
        in_place = loader == "hf" and source == "auto"
        for stage in ("meta_placement", "shard", "rank0_distribute", "buffer_init"):
            want = "skipped" if in_place and stage == "rank0_distribute" else "ran"
            assert status[stage] == want, (stage, status)
    if in_place:  # fully_shard kept each rank's own rows of the mapped checkpoint
        for rank, res in enumerate(results):
            placement = next(r for r in res["report"]["records"] if r["stage"] == "meta_placement" and r["rank"] == rank)
            assert placement["details"]["in_place"] is True
        return
    rank0 = [r for r in results[0]["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == 0][0]
    # unmodified zero-copy weights are re-read from the file with pread, not through the mmap: the checkpoint is
    # the one given to accelerate_memsafe.from_pretrained, or the directory transformers' own load mapped
    assert rank0["details"]["from_checkpoint"] == len(results[0]["params"])
    rank1 = [r for r in results[1]["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == 1][0]
    if source == "auto":  # every rank reads its shard from the file it sees too
        assert rank1["details"]["load_source"] == "every_rank" and rank1["details"]["bytes_received"] == 0
        return
    shard_bytes = sum(p["local"].numel() * p["local"].element_size() for p in results[1]["params"].values())
    padding = 16 * len(results[1]["params"])  # each piece starts 16-byte aligned in the bucket buffer
    assert shard_bytes <= rank1["details"]["bytes_received"] <= shard_bytes + padding, "rank 1 receives only its shard"
    for res in results:  # the cyclic collector is paused while the ranks distribute, and restored after
        assert res["gc_enabled_during_distribution"] == [False] and res["gc_enabled_after"] is True


def test_bf16_checkpoint_with_mixed_precision_and_small_buckets(tmp_path):
    # also with cpu_ram_efficient_loading off: the stages run regardless of the flag (docs/prepare.md)
    from accelerate_memsafe.models import save_llama

    path = save_llama(tmp_path / "bf16", "tiny", dtype=torch.bfloat16)
    results = run_on_ranks(
        w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(path), dtype="bfloat16",
        mixed_precision="bf16", plugin_kwargs={"bucket_bytes": 8 * 1024, "prefetch_buckets": 1, "load_source": "rank0"},
        efficient=False,
    )
    ref = _reference(path, torch.bfloat16)
    # accelerate upcasts trainable params to fp32 master weights; we cast per tensor on the way
    _assert_shards_equal(results, ref.state_dict(), cast=torch.float32)
    for res in results:
        assert all(p["dtype"] == "torch.float32" for p in res["params"].values())
    rec = [r for r in results[0]["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == 0][0]
    assert rec["details"]["buckets"] > 5, "small buckets: many round trips, large tensors cut into units"
    # the rows travel in the checkpoint's bf16 (half the bytes of the fp32 shard) and rank 1 widens them
    rank1 = [r for r in results[1]["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == 1][0]
    shard_bytes = sum(p["local"].numel() * p["local"].element_size() for p in results[1]["params"].values())
    assert rank1["details"]["bytes_received"] == shard_bytes // 2 == rec["details"]["bytes_sent"]


@pytest.mark.parametrize("dtype,mixed_precision", [("float32", "no"), ("bfloat16", "bf16")])
def test_scatter_transport_of_the_other_backends_over_gloo(tmp_path, dtype, mixed_precision):
    # the transport NCCL and the other backends take (one scatter per bucket from a ring of reused buffers, rank 0's
    # rows sent as they are where a whole slot is rows of its own tensor), run here over gloo: the same bits
    from accelerate_memsafe.models import save_llama

    path = save_llama(tmp_path / dtype, "tiny", dtype=getattr(torch, dtype))
    results = run_on_ranks(
        w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(path), dtype=dtype, transport="scatter",
        mixed_precision=mixed_precision, plugin_kwargs={"bucket_bytes": 8 * 1024, "prefetch_buckets": 1, "load_source": "rank0"},
    )
    _assert_shards_equal(results, _reference(path, getattr(torch, dtype)).state_dict(), cast=torch.float32)
    rec = [r for r in results[0]["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == 0][0]
    assert rec["details"]["buckets"] > 5
    rank1 = [r for r in results[1]["report"]["records"] if r["stage"] == "rank0_distribute" and r["rank"] == 1][0]
    shard_bytes = sum(p["local"].numel() * p["local"].element_size() for p in results[1]["params"].values())
    # every slot arrives whole, in the shard's dtype (a scatter does not narrow): the shard, plus alignment padding
    assert shard_bytes <= rank1["details"]["bytes_received"] <= shard_bytes + 16 * len(results[1]["params"]) * rec["details"]["buckets"]
    for res in results:
        assert abs(res["loss"] - results[0]["loss"]) == 0


def test_tied_embeddings_stay_tied_with_cpu_offload(tmp_path):
    from accelerate_memsafe.models import save_llama

    path = save_llama(tmp_path / "tied", "tiny", tie_word_embeddings=True)
    results = run_on_ranks(w.prepare_llama, 2, init_process_group=False, timeout=170, model_dir=str(path), cpu_offload=True)
    ref = _reference(path)
    assert ref.lm_head.weight is ref.model.embed_tokens.weight
    _assert_shards_equal(results, ref.state_dict())
    ref_loss = _ref_loss(ref)
    for res in results:
        assert res["tied"], "lm_head.weight must still be embed_tokens.weight after prepare"
        assert abs(res["loss"] - ref_loss) <= 1e-6


def test_custom_model_persistent_and_recipe_less_buffers():
    results = run_on_ranks(w.prepare_custom, 2, init_process_group=False, timeout=170)
    ref = w.CustomModel(seed=0)
    ref_sd = ref.state_dict()
    _assert_shards_equal([{"params": r["params"]} for r in results], ref_sd)
    for rank, res in enumerate(results):
        b = res["buffers"]
        assert b["scale.scale"]["persistent"] and torch.equal(b["scale.scale"]["value"], ref.scale.scale)
        # no recipe: rank 1 built its own (different) table; rank 0's value was broadcast
        assert torch.equal(b["table.table"]["value"], ref.table.table), f"rank {rank}"
        assert torch.equal(b["freq.freq"]["value"], ref.freq.freq), f"rank {rank}"
        with torch.no_grad():
            assert abs(res["loss"] - ref(w.batch(w.VOCAB)).item()) <= 1e-6
    details = [r for r in results[1]["report"]["records"] if r["stage"] == "buffer_init" and r["rank"] == 1][0]["details"]
    assert details == {"recomputed": 1, "broadcast": 1, "verified": 2}


def test_rank1_dying_mid_distribution_fails_rank0_within_timeout(tiny_llama_dir):
    results = run_on_ranks(
        w.prepare_killed, 2, init_process_group=False, timeout=120, expect_failure=True,
        model_dir=str(tiny_llama_dir), timeout_s=5.0,
    )
    status0, out0 = results[0]
    assert results[1][0] == "died"
    assert status0 == "ok" and out0["error"] == "CollectiveTimeoutError", out0
    assert "rank0_distribute" in out0["message"] and "rank(s) [1] never reached it" in out0["message"], out0["message"]
    assert out0["elapsed"] < 5.0 + 10.0


def test_rank1_stalling_mid_distribution_times_out_rank0(tiny_llama_dir):
    results = run_on_ranks(
        w.prepare_killed, 2, init_process_group=False, timeout=120, expect_failure=True,
        model_dir=str(tiny_llama_dir), timeout_s=3.0, hang=True,
    )
    status0, out0 = results[0]
    assert status0 == "ok" and out0["error"] == "CollectiveTimeoutError", out0
    assert "did not complete within collective_timeout_s=3s" in out0["message"], out0["message"]
    assert "rank(s) [1] never reached it" in out0["message"]
    assert 3.0 <= out0["elapsed"] < 3.0 + 10.0


def test_from_pretrained_before_process_group_raises(tiny_llama_dir):
    messages = run_on_ranks(w.from_pretrained_before_accelerator, 2, init_process_group=False, timeout=60, model_dir=str(tiny_llama_dir))
    for rank, msg in enumerate(messages):
        assert f"rank {rank} of a 2-process launch" in msg and "build the `Accelerator(...)` first" in msg


def test_meta_weights_without_a_filling_stage_are_refused_on_every_rank_before_anything_moves(tiny_llama_dir):
    # issue 15: without the prepare stages, stock accelerate before 1.16 trained on rank 1's meta weights (its
    # optimizer re-pointed by data pointer) until DCP refused the first save_state; from 1.16 it re-points them by
    # identity, and its own broadcast under `cpu_ram_efficient_loading` is let through (bitwise the plugin's result:
    # `test_a_head_the_checkpoint_lacks_is_rank0s_on_every_rank_and_trains`). Without that setting nothing fills them.
    from accelerate_memsafe import _compat

    by_identity = _compat.optimizer_remapped_by_identity_on_meta()
    results = run_on_ranks(w.prepare_meta_without_filling_stages, 2, init_process_group=False, timeout=180,
                           model_dir=str(tiny_llama_dir))
    for rank, runs in enumerate(results):
        for run in runs:
            if by_identity and run["efficient"]:
                assert run["error"] is None and run["sharded"], (rank, run)
                continue
            assert run["error"] == "ConfigError", (rank, run)
            msg = run["message"]
            assert "on `meta` (no data) on rank(s) [1]" in msg and "e.g. `model.embed_tokens.weight`" in msg, msg
            assert "Nothing was moved" in msg and "HINT: keep the stages `meta_placement`, `shard` and `rank0_distribute`" in msg
            assert run["unchanged"] and run["records"] == 0, (rank, run)
        assert "`meta_placement` is not among the enabled prepare stages (none)" in runs[2]["message"]
        assert "(without `cpu_ram_efficient_loading` it broadcasts nothing, and the first forward fails)" in runs[2]["message"]
        if not by_identity:
            assert "(it re-points the optimizer by data pointer, 0 for every meta tensor)" in runs[0]["message"]
        if not by_identity:
            assert "`meta_placement` is not among the enabled prepare stages (`dataloader_resume`)" in runs[1]["message"]
