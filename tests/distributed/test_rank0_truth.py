"""Rank 0's model is the truth (issue #11): what rank 0 changed in place after loading, weights and
non-persistent buffers alike, is what every rank holds after ``prepare``; unmodified weights are still
re-read from the checkpoint file. 2 gloo ranks, FSDP2, ``accelerate_memsafe.from_pretrained``."""

from __future__ import annotations

import pytest
import torch

from accelerate_memsafe import _compat
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


def _new_head_checkpoint(tmp_path, case):
    """A tiny checkpoint saved from another class than the one loaded, dropout off (so one step is deterministic)."""
    import transformers

    if case == "bert_masked_lm_to_classifier":  # four new tensors: the pooler and the classifier
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                         vocab_size=97, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        saved, loaded, kwargs = transformers.BertForMaskedLM, "BertForSequenceClassification", {"num_labels": 3}
    elif case == "llama_causal_lm_to_classifier":  # one new tensor: `score.weight`
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=97, pad_token_id=0)
        saved, loaded, kwargs = transformers.LlamaForCausalLM, "LlamaForSequenceClassification", {"num_labels": 3}
    else:  # another number of labels on a classifier's own checkpoint, as transformers allows when asked
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=97, pad_token_id=0, num_labels=5)
        saved, loaded = transformers.LlamaForSequenceClassification, "LlamaForSequenceClassification"
        kwargs = {"num_labels": 3, "ignore_mismatched_sizes": True}
    torch.manual_seed(0)
    saved(config).save_pretrained(tmp_path)
    return str(tmp_path), loaded, kwargs


def _one_process_step(cls_name, model_dir, kwargs, weights):
    """Rank 0's model (``weights``) stepped once in one process: what FSDP2 on 2 ranks with the same batch gives."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir, num_labels=kwargs["num_labels"])
    model = getattr(transformers, cls_name)(config)
    model.load_state_dict(weights, strict=False)  # the tied / shared names once each
    assert all(torch.equal(model.get_parameter(n), w) for n, w in weights.items())
    g = torch.Generator().manual_seed(7)
    batch = {"input_ids": torch.randint(4, 90, (2, 10), generator=g), "labels": torch.tensor([0, 2])}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    model(**batch).loss.backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["bert_masked_lm_to_classifier", "llama_causal_lm_to_classifier",
                                  "llama_classifier_to_another_label_count"])
def test_a_head_the_checkpoint_lacks_is_rank0s_on_every_rank_and_trains(case, tmp_path):
    # Fine-tuning a classifier from a base checkpoint: transformers initialises the head the checkpoint lacks at random,
    # each process its own draw. With the plugin every rank holds rank 0's head, with either loader, with or without
    # `cpu_ram_efficient_loading`, and one step gives the one-process step of rank 0's model bitwise. Stock without that
    # setting mixes the ranks' draws; with it, transformers leaves the new head on `meta` on rank 1 and accelerate
    # re-points the optimizer: before 1.16 by data pointer, 0 for each of them, so several new tensors leave rank 1's
    # optimizer holding one of them in place of the others, while a single one maps right; from 1.16 by identity,
    # right for any number. The plugin lets through without its stages (`MemSafePlugin(stages=[])`) what stock maps
    # right, and refuses, naming the tensors, where stock goes wrong.
    model_dir, cls_name, kwargs = _new_head_checkpoint(tmp_path, case)
    runs = ("plugin", "plugin_crel", "plugin_memsafe_loader", "stock", "stock_crel", "no_stages_crel",
            "no_stages_crel_memsafe_loader")
    results = run_on_ranks(w.prepare_new_head, 2, init_process_group=False, timeout=400, model_dir=model_dir,
                           cls_name=cls_name, load_kwargs=kwargs, runs=runs)
    new = "score.weight" if case.startswith("llama") else "classifier.weight"
    several = case.startswith("bert")
    for run in ("plugin", "plugin_crel", "plugin_memsafe_loader"):
        want = results[0][run]["before"]
        reference = _one_process_step(cls_name, model_dir, kwargs, want)
        for rank, res in enumerate(results):
            got = res[run]
            assert got["optimizer_exact"], f"{run}, rank {rank}: the optimizer does not hold the prepared parameters"
            assert got["after"].keys() == want.keys()
            assert [n for n in want if not torch.equal(got["after"][n], want[n])] == [], f"{run}, rank {rank}"
            assert [n for n in want if not torch.equal(got["stepped"][n], reference[n])] == [], f"{run}, rank {rank}"
    assert results[1]["plugin_crel"]["on_meta"] == (4 if several else 1)  # transformers' new head on rank 1
    stock = results[0]["stock"]
    assert not torch.equal(stock["after"][new], stock["before"][new]), "stock kept rank 0's draw: no longer a mix"
    crel = [results[r]["stock_crel"] for r in range(2)]
    assert all(torch.equal(crel[r]["after"][n], crel[0]["before"][n]) for r in range(2) for n in crel[0]["before"])
    by_identity = _compat.optimizer_remapped_by_identity_on_meta()  # accelerate 1.16 on
    stock_wrong = several and not by_identity
    assert crel[0]["optimizer_exact"] and crel[1]["optimizer_exact"] is not stock_wrong
    bare = [results[r]["no_stages_crel"] for r in range(2)]
    if stock_wrong:
        for res in bare:
            assert "`bert.pooler.dense.weight`" in res["error"] and "4 tensor(s) on rank 1" in res["error"], res
    else:
        for r in range(2):
            assert bare[r]["optimizer_exact"]
            assert all(torch.equal(bare[r][k][n], crel[r][k][n]) for k in ("after", "stepped") for n in bare[r][k])
    # the whole model on `meta` on rank 1 (`accelerate_memsafe.from_pretrained`) without the stages: stock's own
    # broadcast, where it maps every meta parameter right (1.16 on), is the plugin's result; before, refused by name
    bare = [results[r]["no_stages_crel_memsafe_loader"] for r in range(2)]
    ours = [results[r]["plugin_memsafe_loader"] for r in range(2)]
    for r in range(2):
        if by_identity:
            assert bare[r]["optimizer_exact"]
            assert all(torch.equal(bare[r][k][n], ours[r][k][n]) for k in ("after", "stepped") for n in bare[r][k])
        else:
            assert "tensor(s) on rank 1" in bare[r]["error"] and "no enabled stage will fill them" in bare[r]["error"]


def test_a_model_built_from_its_config_is_rank0s_initialisation_on_every_rank():
    # training from scratch: `accelerate_memsafe.from_config` initialises on rank 0 only (rank 1 builds on meta, no
    # memory), each rank seeded differently; every rank ends with rank 0's initialisation, and one step is the
    # one-process step of that model, bitwise
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe.models import llama_config

    results = run_on_ranks(w.prepare_from_config, 2, init_process_group=False, timeout=240)
    want = results[0]["before"]
    assert not any(results[0]["on_meta"]) and all(results[1]["on_meta"])
    assert results[0]["training"] and results[1]["training"]  # as transformers' from_config returns it
    torch.manual_seed(1000)  # rank 0's seed: its initialisation, rebuilt in one process
    model = AutoModelForCausalLM.from_config(llama_config("tiny"))
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    for rank, res in enumerate(results):
        assert [n for n in want if not torch.equal(res["after"][n], want[n])] == [], f"rank {rank}"
        assert [n for n, p in model.named_parameters() if not torch.equal(res["stepped"][n], p)] == [], f"rank {rank}"


@pytest.mark.parametrize("family", ["gpt2", "roberta", "deberta-v2", "qwen3_moe"])
def test_a_classifier_fine_tuned_from_a_language_model_checkpoint_trains_as_in_one_process(family, tmp_path):
    # the head each family puts on (GPT-2's `score`, RoBERTa's dense + out_proj, DeBERTa's pooler, a MoE's `score`)
    # is transformers' random draw on each rank; with the plugin every rank trains rank 0's, bitwise one process
    import transformers

    from tests.conformance import families as fam

    model_type, auto_class = fam.candidates()[family]
    config = fam.shrink(family, model_type)
    config.pad_token_id = 0  # the decoders' classifiers find each sequence's last token by it
    torch.manual_seed(0)
    getattr(transformers, auto_class).from_config(config).save_pretrained(tmp_path)
    cls_name = transformers.AutoModelForSequenceClassification._model_mapping[type(config)].__name__
    results = run_on_ranks(w.prepare_classifier_family, 2, init_process_group=False, timeout=240, model_dir=str(tmp_path),
                           cls_name=cls_name)
    for loader in ("transformers", "memsafe"):
        want = results[0][loader]["before"]
        reference = getattr(transformers, cls_name)(transformers.AutoConfig.from_pretrained(tmp_path, num_labels=3))
        reference.load_state_dict(want, strict=False)  # tied names once each
        assert all(torch.equal(p, want[n]) for n, p in reference.named_parameters())
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        reference.train()
        reference(**w.classifier_batch()).loss.backward()
        opt.step()
        for rank, res in enumerate(results):
            got = res[loader]
            assert [n for n in want if not torch.equal(got["after"][n], want[n])] == [], f"{loader}, rank {rank}"
            assert [n for n, p in reference.named_parameters() if not torch.equal(got["stepped"][n], p)] == [], \
                f"{loader}, rank {rank}"
