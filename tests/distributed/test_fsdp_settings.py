"""FSDP2 settings users write, with the plugin, on 2 gloo ranks — each cell compared with a single-process
load of the checkpoint (bitwise) and with accelerate's own path (``MemSafePlugin(stages=[])``) in the
same run. Where stock accelerate runs, the plugin must give the same result; where it does not, the
plugin may do better but never worse.

Before this round every wrap policy crashed the plugin's ``prepare`` ("Could not find the transformer
layer class LlamaDecoderLayer"), ``cpu_offload=True`` crashed both paths on a machine without an
accelerator ("Cannot access accelerator device"), and a BERT masked LM (tied decoder bias) or T5
(shared embedding) was refused on rank 0 only ("rank 0 has no weights to distribute ... missing
['cls.predictions.decoder.bias']") while rank 1 waited.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests import releases
from tests.distributed import workers_fsdp_settings as w
from tests.spawn import run_on_ranks

TBW = {"auto_wrap_policy": "transformer_based_wrap"}
FAMILIES = {
    "llama_tied": [
        {"id": "transformer_based_wrap", "fsdp": TBW},
        {"id": "transformer_cls_names_to_wrap", "fsdp": {**TBW, "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]}},
        {"id": "size_based_wrap", "fsdp": {"auto_wrap_policy": "size_based_wrap", "min_num_params": 500}},
        {"id": "no_wrap", "fsdp": {}},
        {"id": "activation_checkpointing", "fsdp": {**TBW, "activation_checkpointing": True}},
        *([{"id": "activation_checkpointing_offload", "fsdp": {**TBW, "activation_checkpointing": True,
                                                                "activation_checkpointing_offload": True}}]
          if releases.accelerate_offloads_checkpointed_activations() else []),
        {"id": "cpu_offload", "fsdp": {**TBW, "cpu_offload": True}},
        # transformers' own checkpointing (the Trainer's `gradient_checkpointing=True`), not accelerate's
        {"id": "gradient_checkpointing", "fsdp": TBW, "gradient_checkpointing": {"use_reentrant": False}},
        {"id": "bf16", "fsdp": TBW, "mixed_precision": "bf16"},
        {"id": "fp16", "fsdp": TBW, "mixed_precision": "fp16"},
        # a frozen layer, the optimizer over the trainable rest in two groups (no weight decay on norms, another lr);
        # accelerate upcasts only what trains
        {"id": "frozen_layer_param_groups_bf16", "fsdp": TBW, "freeze": ["model.layers.0."], "param_groups": True,
         "mixed_precision": "bf16"},
        {"id": "bf16_weights", "fsdp": TBW, "load": {"dtype": torch.bfloat16}},  # pure bf16 training: no upcast
        {"id": "mixed_precision_policy", "fsdp": {**TBW, "mixed_precision_policy": MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}},
        # accelerate resolves a pattern by moving each matched module to the device, which raised on the plugin's meta
        # weights; stock's own cpu_ram_efficient_loading before 1.16 shards them anyway (model.to("meta") replaced the
        # parameters it was told to ignore; 1.16 collects them after), the plugin leaves them whole as fully_shard is told
        {"id": "ignored_modules", "fsdp": {**TBW, "ignored_modules": r"model\.layers\.0\.mlp|model\.norm"},
         "whole": ["model.layers.0.mlp.", "model.norm."]},
        # the same under activation checkpointing and bf16, against a stock that keeps the setting (no
        # cpu_ram_efficient_loading): the ignored norm stays fp32 outside FSDP's mixed precision, bitwise stock's
        {"id": "ignored_modules_ac_bf16", "fsdp": {**TBW, "ignored_modules": r"model\.norm", "activation_checkpointing": True,
                                                    "cpu_ram_efficient_loading": False},
         "mixed_precision": "bf16", "whole": ["model.norm."]},
        # the modules themselves, as a script that loads the model first passes them: accelerate 1.16 moves each listed
        # module to the device, which raised on the weights the plugin leaves on meta for rank0_distribute
        {"id": "ignored_modules_as_modules", "fsdp": TBW, "ignored_module_names": ["model.layers.0.mlp", "model.norm"],
         "whole": ["model.layers.0.mlp.", "model.norm."]},
        {"id": "reshard_after_forward_false", "fsdp": {**TBW, "reshard_after_forward": False}},
        # torch.compile (dynamo's `eager` backend: no C++ toolchain needed): accelerate compiles after `shard` wrapped
        # the model (stock compiles before fully_shard); the same weights, losses and checkpoints
        {"id": "compile", "fsdp": TBW, "dynamo": {"backend": "eager"}},
        {"id": "compile_regional", "fsdp": TBW, "dynamo": {"backend": "eager", "use_regional_compilation": True}},
    ],
    "bert_mlm": [
        {"id": "no_wrap", "fsdp": {}},
        {"id": "transformer_based_wrap", "fsdp": TBW},
        {"id": "size_based_wrap", "fsdp": {"auto_wrap_policy": "size_based_wrap", "min_num_params": 500}},
    ],
    "t5": [
        {"id": "no_wrap", "fsdp": {}},
        {"id": "transformer_based_wrap", "fsdp": TBW},
        {"id": "size_based_wrap", "fsdp": {"auto_wrap_policy": "size_based_wrap", "min_num_params": 500}},
    ],
    "whisper": [
        {"id": "transformer_based_wrap", "fsdp": TBW},
        {"id": "size_based_wrap", "fsdp": {"auto_wrap_policy": "size_based_wrap", "min_num_params": 500}},
    ],
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: (str(root / f), w.save_family(str(root / f), f)) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_setting_matches_a_single_process_load_and_never_does_worse_than_stock(family, checkpoints):
    model_dir, auto = checkpoints[family]
    summaries = run_on_ranks(w.run_cells, 2, timeout=420, init_process_group=False,
                             model_dir=model_dir, auto_name=auto, cells=FAMILIES[family])[0]
    failures = []
    cell_of = {c["id"]: c for c in FAMILIES[family]}
    for s in summaries:
        cell = f"{family}/{s['cell']}"
        if s["plugin_error"]:
            failures.append(f"{cell}: plugin raised {s['plugin_error']} (stock: {s['stock_error'] or 'ran'})\n{s['plugin_trace']}")
            continue
        if s["differ"]:
            failures.append(f"{cell}: {len(s['differ'])} tensor(s) differ from the reference: {s['differ'][:5]}")
        if s["ties"] != s["ref_ties"]:
            failures.append(f"{cell}: ties {s['ties']} != reference {s['ref_ties']}")
        if not s["ranks_agree"]:
            failures.append(f"{cell}: the ranks hold different full tensors")
        prefixes = tuple(cell_of[s["cell"]].get("whole", ()))  # the parameters fully_shard must leave whole
        if not all(n.startswith(prefixes) for n in s["whole"]) or not all(any(n.startswith(p) for n in s["whole"])
                                                                          for p in prefixes):
            failures.append(f"{cell}: parameters left whole (not DTensors) {s['whole']}, expected those under {prefixes}")
        if not s["finite"]:
            failures.append(f"{cell}: a training step made the weights non-finite")
        exact = cell_of[s["cell"]].get("mixed_precision", "no") == "no" and "load" not in cell_of[s["cell"]] \
            and "mixed_precision_policy" not in cell_of[s["cell"]]["fsdp"]
        if exact and abs(s["loss"] - s["ref_loss"]) > 1e-4 * max(1.0, abs(s["ref_loss"])):
            failures.append(f"{cell}: loss {s['loss']} vs reference {s['ref_loss']}")
        # the script's hooks fire as under stock, or (where stock fails) as in one process without FSDP
        if s["hooks"] != (s["stock_hooks"] or s["ref_hooks"]) or not any(s["hooks"].values()):
            failures.append(f"{cell}: the script's hooks fired {s['hooks']} (stock: {s['stock_hooks']}, one process: "
                            f"{s['ref_hooks']})")
        if s["tree_differs"]:
            failures.append(f"{cell}: the prepared module tree differs from stock's")
        if s["trained_differ"]:
            failures.append(f"{cell}: after a step, {len(s['trained_differ'])} weight(s) differ from stock's: "
                            f"{s['trained_differ'][:5]}")
        if s["stock_loss"] is not None and s["loss"] != s["stock_loss"]:
            failures.append(f"{cell}: loss {s['loss']} vs stock accelerate {s['stock_loss']} (must be equal)")
    assert not failures, "\n".join(failures)
    if family == "llama_tied":  # the common case: stock accelerate runs every cell but size_based_wrap
        failed = {s["cell"]: s["stock_error"] for s in summaries if s["stock_error"]}
        if releases.accelerate_groups_a_tied_head_with_its_embedding():
            assert set(failed) == {"size_based_wrap"}, summaries
        else:  # accelerate 1.14 groups the tied head apart from the embedding, which torch >= 2.13 refuses
            assert "size_based_wrap" in failed, summaries
            assert all("already managed by another FSDP group" in e for c, e in failed.items() if c != "size_based_wrap"), failed


def test_tensor_subclass_parameters_are_refused_on_every_rank_before_anything_moves(checkpoints):
    model_dir, _ = checkpoints["llama_tied"]
    out = run_on_ranks(w.prepare_with_tensor_subclass, 2, timeout=180, init_process_group=False, model_dir=model_dir)
    for rank, r in enumerate(out):
        assert r["error"] and r["error"].startswith("CheckpointError"), (rank, r)
        assert "tensor subclass" in r["error"] and "QuantizedParam" in r["error"] and "model.layers.0.mlp.up_proj.weight" in r["error"]
        assert r["unchanged"], f"rank {rank} modified the model before refusing"


def test_a_channels_last_model_prepares_and_trains_where_stock_fully_shard_refuses_it():
    # `fully_shard` refuses non-contiguous parameters (a convolution kept channels_last), so stock accelerate cannot
    # prepare the model; the plugin's `shard` wraps it on meta and `rank0_distribute` fills contiguous shards: every
    # rank holds rank 0's weights and a step gives, bitwise, the weights of the same step in one process without FSDP
    results = run_on_ranks(w.prepare_channels_last, 2, timeout=180, init_process_group=False)
    for rank, res in enumerate(results):
        assert res["stock"]["error"] and "non-contiguous parameters" in res["stock"]["error"], (rank, res["stock"]["error"])
        assert res["plugin"]["error"] is None, (rank, res["plugin"]["error"])
        for name, want in res["before"].items():
            assert torch.equal(res["plugin"]["prepared"][name], want), (rank, name)
            assert torch.equal(res["plugin"]["after"][name], res["ref_after"][name]), (rank, name)
