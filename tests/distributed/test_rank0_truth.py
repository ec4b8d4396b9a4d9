"""Rank 0's model is the truth (issue #11): what rank 0 changed in place after loading, weights and
non-persistent buffers alike, is what every rank holds after ``prepare``; unmodified weights are still
re-read from the checkpoint file. 2 gloo ranks, FSDP2, ``accelerate_memsafe.from_pretrained``."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import workers_rank0_truth as w
from tests.spawn import run_on_ranks


def _details(res, rank, stage):
    return [r for r in res["report"]["records"] if r["stage"] == stage and r["rank"] == rank][0]["details"]


@pytest.fixture(scope="module")
def edited_run(tmp_path_factory):
    """One ``prepare`` after rank 0 edited three weights in place (see ``workers_rank0_truth.EDITS``)."""
    from accelerate_memsafe.models import save_llama

    path = save_llama(tmp_path_factory.mktemp("tiny-llama-edited"), "tiny")
    return run_on_ranks(w.prepare_edited, 2, init_process_group=False, timeout=170, model_dir=str(path),
                        edits=("whole", "middle", "unaligned"))


def test_rank0_in_place_weight_edits_survive_prepare(edited_run):
    results = edited_run
    expected = results[0]["expected"]
    assert torch.equal(expected[w.EDITS["whole"]], torch.ones_like(expected[w.EDITS["whole"]]))
    assert results[0]["page_offsets"][w.EDITS["unaligned"]] != 0, "the test needs a tensor off a page boundary"
    for rank, res in enumerate(results):
        for name, want in expected.items():
            assert torch.equal(res["full"][name], want), f"rank {rank}: `{name}` is not rank 0's edited value"


def test_unmodified_weights_are_still_read_from_the_file(edited_run):
    # exactly the tensors whose pages hold no written byte come from the file (pread), the edited ones
    # and their page neighbours from rank 0's memory
    results = edited_run
    from_file = results[0]["expected_from_file"]
    n_params = len(results[0]["expected"])
    assert set(w.EDITS.values()).isdisjoint(from_file)
    assert n_params // 2 <= len(from_file) <= n_params - 3, from_file
    meta = _details(results[0], 0, "meta_placement")
    dist = _details(results[0], 0, "rank0_distribute")
    assert meta["from_checkpoint"] == dist["from_checkpoint"] == len(from_file)
    # only the tensors read from memory are handed back to the kernel (the file-read ones never paged in)
    read_from_memory = sum(v.numel() * v.element_size() for n, v in results[0]["expected"].items() if n not in from_file)
    assert dist["madvised_bytes"] <= read_from_memory


def test_rank0_in_place_buffer_edit_survives_prepare(tiny_llama_dir):
    results = run_on_ranks(w.prepare_edited, 2, init_process_group=False, timeout=170, model_dir=str(tiny_llama_dir),
                           inv_freq_scale=0.5)
    expected = results[0]["expected_buffers"]
    name = "model.rotary_emb.inv_freq"
    assert torch.equal(expected[name], 0.5 * expected["model.rotary_emb.original_inv_freq"])
    for rank, res in enumerate(results):
        for buf, want in expected.items():
            assert torch.equal(res["buffers"][buf]["value"], want), f"rank {rank}: `{buf}` is not rank 0's value"
        # inv_freq is broadcast (its recipe no longer reproduces rank 0's value); original_inv_freq is
        # still recomputed (rank 0 proved the recipe gives its value bit for bit); one plan on every rank
        assert _details(res, rank, "buffer_init") == {"recomputed": 1, "broadcast": 1, "verified": 2}
        # no weight was touched: all of them still come from the file
        if rank == 0:
            dist = _details(res, 0, "rank0_distribute")
            assert dist["from_checkpoint"] == len(results[0]["expected"]) and dist["madvised_bytes"] == 0


def test_recipe_that_differs_on_another_rank_is_resent_from_rank0():
    results = run_on_ranks(w.prepare_rank_dependent, 2, init_process_group=False, timeout=170)
    want = torch.arange(16, dtype=torch.float32)  # rank 0's value
    for rank, res in enumerate(results):
        assert torch.equal(res["freq"], want), f"rank {rank}"
        assert _details(res, rank, "buffer_init") == {"recomputed": 1, "broadcast": 0, "verified": 1, "resent": 1}


def test_embeddings_resized_before_prepare_are_rank0s_on_every_rank(tiny_llama_dir):
    # `resize_token_embeddings` draws the new rows at random: each process its own. Stock FSDP2 keeps each rank's own
    # rows of its own draw (a mix of the ranks' draws, rank 0's model on no rank); with the plugin every rank holds
    # rank 0's resized embedding, bitwise, whichever loader built it
    results = run_on_ranks(w.prepare_resized, 2, init_process_group=False, timeout=240, model_dir=str(tiny_llama_dir))
    for run in ("plugin", "plugin_memsafe_loader"):
        want = results[0][run]["before"]
        assert want.shape[0] == results[0][run]["after"].shape[0]
        for rank, res in enumerate(results):
            assert torch.equal(res[run]["after"], want), f"{run}, rank {rank}: not rank 0's resized embedding"
    stock, want = results[0]["stock"]["after"], results[0]["stock"]["before"]
    assert not torch.equal(stock, want), "stock kept rank 0's draw: the ranks no longer draw differently here"
    half = stock.shape[0] // 2
    assert torch.equal(stock[:half], want[:half]) and not torch.equal(stock[half:], want[half:])
