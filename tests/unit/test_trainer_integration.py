"""The Trainer integration: load_best_model_at_end and resume reload the adapter CPU-first, in place."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from accelerate_memsafe import MemoryBudgetError, _compat
from accelerate_memsafe.integrations import MemSafeTrainer, MemSafeTrainerMixin
from accelerate_memsafe.integrations import peft as peft_helpers

#: The scripted eval metric (lower is better): the best checkpoint is step 2, not the last one.
SCRIPT = [3.0, 1.0, 2.0, 4.0]


def _peft_model():
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(build_llama("tiny"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, vocab: int = 256, seq: int = 8):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _scripted(base: type) -> type:
    class Scripted(base):
        def evaluate(self, *args, **kwargs):
            metrics = super().evaluate(*args, **kwargs)
            metrics["eval_scripted"] = SCRIPT[self._evals % len(SCRIPT)]
            self._evals += 1
            return metrics

    return Scripted


def _trainer(cls: type, out: Path, *, max_steps: int = 4, resume: bool = False):
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        learning_rate=5e-2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="scripted", greater_is_better=False,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0,
    )
    trainer = _scripted(cls)(model=_peft_model(), args=args, train_dataset=_Data(), eval_dataset=_Data(8))
    trainer._evals = 0
    return trainer


def _saved_adapter(model, checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    mapping = peft_helpers.adapter_parameter_map(model, "default")
    saved = load_file(checkpoint / "adapter_model.safetensors")
    return {mapping[k][0]: v for k, v in saved.items()}


def _current(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _forbid_peft_load(monkeypatch):
    from peft import PeftModel

    def boom(*args, **kwargs):
        raise AssertionError("peft's load_adapter must not be called: the CPU-first path should have run")

    monkeypatch.setattr(PeftModel, "load_adapter", boom)


def test_load_best_model_at_end_reloads_best_checkpoint_cpu_first(tmp_path, monkeypatch):
    _forbid_peft_load(monkeypatch)
    trainer = _trainer(MemSafeTrainer, tmp_path)
    trainer.model.train()
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    best = _saved_adapter(trainer.model, tmp_path / "checkpoint-2")
    last = _saved_adapter(trainer.model, tmp_path / "checkpoint-4")
    now = _current(trainer.model)
    assert all(torch.equal(now[k], v) for k, v in best.items())
    assert any(not torch.equal(now[k], v) for k, v in last.items())  # so the check above can fail
    assert any("modules_to_save" in k for k in best)
    assert [s.tensors for s in trainer.memsafe_last_reload] == [len(best)]


def test_resume_reloads_adapter_in_place(tmp_path, monkeypatch):
    first = _trainer(MemSafeTrainer, tmp_path, max_steps=2)
    first.train()
    _forbid_peft_load(monkeypatch)
    resumed = _trainer(MemSafeTrainer, tmp_path / "resumed", max_steps=2)
    resumed.args.load_best_model_at_end = False
    calls = []
    original = peft_helpers.copy_file_into

    def spy(path, plan):
        calls.append(Path(path))
        return original(path, plan)

    monkeypatch.setattr(peft_helpers, "copy_file_into", spy)
    resumed._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    assert calls == [tmp_path / "checkpoint-2" / "adapter_model.safetensors"]
    saved = _saved_adapter(resumed.model, tmp_path / "checkpoint-2")
    now = _current(resumed.model)
    assert all(torch.equal(now[k], v) for k, v in saved.items())


def test_untested_versions_warn_and_fall_back_to_upstream(tmp_path, monkeypatch):
    from peft import PeftModel

    monkeypatch.setattr(_compat, "TESTED_PEFT", (_compat.Version("0.0.1"), _compat.Version("0.0.2")))
    upstream = []
    original = PeftModel.load_adapter

    def spy(self, *args, **kwargs):
        upstream.append(args[:2])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "load_adapter", spy)
    trainer = _trainer(MemSafeTrainer, tmp_path)
    with pytest.warns(UserWarning, match="tested with peft.*Falling back to the Trainer's own adapter loading"):
        trainer.train()
    assert upstream == [(str(tmp_path / "checkpoint-2"), "default")]


def test_fallback_precheck_compares_whole_adapter_with_free_memory(tmp_path, monkeypatch):
    first = _trainer(MemSafeTrainer, tmp_path, max_steps=1)
    first.args.load_best_model_at_end = False
    first.train()
    monkeypatch.setattr(_compat, "TESTED_PEFT", (_compat.Version("0.0.1"), _compat.Version("0.0.2")))
    monkeypatch.setattr(peft_helpers, "device_memory", lambda device: (1000, 2**30))
    first.state.best_model_checkpoint = str(tmp_path / "checkpoint-1")
    with pytest.warns(UserWarning, match="Falling back"), pytest.raises(MemoryBudgetError, match=r"whole adapter on the device\) needs 0\.\d+ GiB.*only 0\.000 GiB of 1\.000 GiB"):
        first._load_best_model()


def test_mixin_composes_with_a_user_trainer():
    from transformers import Trainer

    class Mine(MemSafeTrainerMixin, Trainer):
        pass

    assert Mine._load_best_model is MemSafeTrainerMixin._load_best_model
    assert Mine._load_from_checkpoint is MemSafeTrainerMixin._load_from_checkpoint


def test_example_ends_with_the_best_adapter(tmp_path):
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "peft_best_model.py"), "--max-steps", "3", "--out", str(out)],
        check=True, cwd=root, capture_output=True, text=True, timeout=300,
    )
    summary = json.loads(out.read_text())
    assert summary["adapter_equals_best"] and summary["reloaded_cpu_first"]
    assert "'pin_memory' argument is set as true but no accelerator" not in proc.stderr, "noise at every evaluation (issue 15)"


def test_plan_adapter_reload_decides_when_the_cpu_first_path_applies(tmp_path):
    from peft import LoraConfig

    from accelerate_memsafe.integrations.trainer import plan_adapter_reload

    model = _peft_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj"]))
        model.save_pretrained(tmp_path / "both")
        model.save_pretrained(tmp_path / "only_default", selected_adapters=["default"])
    assert plan_adapter_reload(model, tmp_path / "both") == (model, ["default", "other"])
    assert plan_adapter_reload(model, tmp_path / "only_default") == (model, ["default"])
    assert plan_adapter_reload(torch.nn.Linear(2, 2), tmp_path / "both") is None  # not a PEFT model
    assert plan_adapter_reload(model, tmp_path / "missing") is None
    fresh = _peft_model()  # has no "other" adapter: the Trainer's load_adapter must create it
    assert plan_adapter_reload(fresh, tmp_path / "both") is None
    (tmp_path / "both" / "model.safetensors").write_bytes(b"")  # a full model checkpoint: upstream loads it
    assert plan_adapter_reload(model, tmp_path / "both") is None
