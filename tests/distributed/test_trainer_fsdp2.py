"""Issue 16: ``MemSafeTrainer`` and TRL's ``SFTTrainer`` through ``MemSafeTrainerMixin`` get the whole plugin with
FSDP2 from ``TrainingArguments`` on 2 CPU gloo processes, each next to the stock Trainer in the same processes
(one spawn for everything, see ``workers_trainer.trainer_suite``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("trl")

from tests import releases
from tests.distributed import workers_trainer as w
from tests.spawn import run_on_ranks

PREPARE_STAGES = ("meta_placement", "shard", "rank0_distribute", "buffer_init")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    from accelerate_memsafe.models import save_llama

    big = save_llama(tmp_path_factory.mktemp("llama-100m"), "100m")
    small = save_llama(tmp_path_factory.mktemp("llama-small"), "small")
    out = tmp_path_factory.mktemp("trainer-suite")
    return run_on_ranks(w.trainer_suite, 2, init_process_group=False, timeout=420, big_dir=str(big),
                        small_dir=str(small), out=str(out)), out


def test_rank1_load_and_setup_stay_within_the_prepare_bound_where_the_stock_trainer_exceeds_it(suite):
    results, _ = suite
    for rank, res in enumerate(results):
        mine, stock = res["memory"]["memsafe"], res["memory"]["stock"]
        assert mine["distributed_type"] == "DistributedType.FSDP" and mine["dtensor"], "FSDP2 from TrainingArguments on CPU"
        assert stock["distributed_type"] == "DistributedType.MULTI_CPU" and not stock["dtensor"], "stock runs DDP"
        ran = [stage for hook, stage, status in mine["prepare"] if status == "ran"]
        assert all(s in ran for s in PREPARE_STAGES), (rank, mine["prepare"])
    rank1 = results[1]["memory"]
    model_bytes, largest = rank1["memsafe"]["model_bytes"], rank1["memsafe"]["largest"]
    bound = model_bytes / 2 + largest + (64 << 20)
    assert rank1["memsafe"]["grown"] <= bound, (rank1["memsafe"]["grown"] / 2**20, bound / 2**20)
    assert rank1["stock"]["grown"] > bound, "control: the stock Trainer holds the whole model on rank 1"


@pytest.mark.parametrize("name", ["trainer", "sft"])
def test_training_checkpoints_best_model_and_resume_match_the_stock_trainer(suite, name):
    results, out = suite
    for rank, res in enumerate(results):
        stock, mine, resumed = res[name]["stock"], res[name]["memsafe"], res[name]["resumed"]
        # FSDP2 from TrainingArguments (Trainer) or from `accelerate launch`'s variables (SFTTrainer) trains sharded,
        # bitwise as the stock Trainer on the same FSDP2 state
        assert mine["distributed_type"] == "DistributedType.FSDP"
        assert mine["sharded"] and set(mine["trainable"]) <= set(mine["sharded"]), "every trainable parameter is a DTensor"
        assert mine["losses"] == stock["losses"] and len(mine["losses"]) == 4
        # load_best_model_at_end: the best checkpoint (step 2, not the last), reloaded CPU-first, as stock
        assert mine["best"] == str(out / f"{name}-memsafe" / "checkpoint-2") and stock["best"].endswith("checkpoint-2")
        # before accelerate 1.15 the stock Trainer cannot reload a FULL_STATE_DICT adapter (it raises on rank 1:
        # `releases.stock_reloads_a_full_state_dict_adapter`): its saved best adapter is the reference there
        reference = stock["adapter"] if name == "sft" or releases.stock_reloads_a_full_state_dict_adapter() else stock["saved"][2]
        assert mine["adapter"].keys() == reference.keys()
        assert all(torch.equal(mine["adapter"][k], v) for k, v in reference.items())
        assert all(torch.equal(mine["adapter"][k], v) for k, v in mine["saved"][2].items())
        assert any(not torch.equal(mine["adapter"][k], v) for k, v in mine["saved"][4].items()), "so the check can fail"
        if name == "trainer":  # FULL_STATE_DICT: peft's adapter files, reloaded CPU-first per shard
            assert mine["state_dict_type"] == "FULL_STATE_DICT"
            assert [s for s, _ in mine["reloads"]] == (["peft_cpu_reload"] if w.cpu_first_versions() else [])
        else:  # accelerate launch's SHARDED_STATE_DICT: DCP folders (no adapter file), loaded by the Trainer
            assert mine["state_dict_type"] == "SHARDED_STATE_DICT" and mine["reloads"] == []
        assert mine["recorded_best"] == mine["best"]  # written by the save of step 2 itself, through the link
        # atomic checkpoints; rotation (save_total_limit=2) kept the best and the last, like stock's
        assert mine["checkpoints"] == stock["checkpoints"] and mine["marked"] == ["checkpoint-2", "checkpoint-4"]
        assert stock["marked"] == []
        # one prepare pipeline (the train and eval dataloaders prepared alone add none), one save_state per checkpoint
        prepare = [s for h, s, st in mine["records"] if h == "prepare"]
        assert prepare.count("accelerate.prepare") == 1 and all(s in prepare for s in PREPARE_STAGES)
        saves = [(s, st) for h, s, st in mine["records"] if h == "save_state"]
        assert saves.count(("atomic_checkpoint", "ran")) == 4 and saves.count(("transformers.Trainer._save_checkpoint", "ran")) == 4
        assert f"(rank {rank}): prepare ran meta_placement, shard, rank0_distribute, buffer_init" in mine["summary"]
        assert "4 checkpoint(s) saved atomically" in mine["summary"]
        # resumed from checkpoint 2 after the run's folder moved: the same steps 3-4, the best found again
        assert resumed["losses"] == mine["losses"]
        assert resumed["best"] == str(out / f"{name}-moved" / "checkpoint-2")
        assert all(torch.equal(resumed["adapter"][k], v) for k, v in mine["adapter"].items())
        expected = ["optimizer_cpu_reload"]
        if name == "trainer" and w.cpu_first_versions():
            expected = ["peft_cpu_reload", "optimizer_cpu_reload", "peft_cpu_reload"]
        assert [s for s, _ in resumed["reloads"]] == expected
        optimizer = dict(resumed["reloads"])["optimizer_cpu_reload"]
        assert optimizer["format"] == ("torch_file" if name == "trainer" else "dcp")
        assert optimizer["bytes_read"] == optimizer["state_bytes"] > 0 and optimizer["reclaimed_device_bytes"] == 0


def test_trl_dpo_with_its_reference_model_trains_as_the_stock_trainer(tmp_path):
    # DPO's reference model is TRL's own: loaded from the policy's path on every rank and sharded with TRL's
    # `fully_shard`, outside `prepare`. With the plugin and the policy from `accelerate_memsafe.from_pretrained`
    # (rank 1 on meta), the losses and the trained weights are bitwise the stock Trainer's (transformers' load)
    from accelerate_memsafe.models import save_llama

    model_dir = str(save_llama(tmp_path / "llama-small", "small"))
    runs = {plugin: run_on_ranks(w.dpo_run, 2, init_process_group=False, timeout=300, model_dir=model_dir,
                                 out=str(tmp_path / f"out-{plugin}"), plugin=plugin)
            for plugin in (False, True)}
    stock = runs[False][0]
    assert stock["ref_sharded"] and len(stock["losses"]) == 3
    for rank, res in enumerate(runs[True]):
        assert res["ref_sharded"]
        assert res["losses"] == stock["losses"], rank
        assert [n for n, t in stock["params"].items() if not torch.equal(res["params"][n], t)] == [], rank
