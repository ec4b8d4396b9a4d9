"""The ``peft_cpu_reload`` stage on ``load_state``: in place, one tensor at a time, accelerate's model load skipped."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("peft")

from accelerate_memsafe import Accelerator, CheckpointError, MemSafePlugin


def _peft_model():
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(
            build_llama("tiny"),
            LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], init_lora_weights=False),
        )
        model.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj"], init_lora_weights=False))
    return model


def _setup(model=None):
    accelerator = Accelerator(plugins=[MemSafePlugin(stages=["peft_cpu_reload"], track_live_tensors=True)], cpu=True)
    model = _peft_model() if model is None else model
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model, opt


def _step(model, opt) -> None:
    if not hasattr(model, "peft_config"):
        model(torch.randn(3, model.in_features)).sum().backward()
    else:
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _perturb(model) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n or ".modules_to_save." in n:
                p.add_(1.0)


@pytest.fixture
def saved(tmp_path):
    accelerator, model, opt = _setup()
    _step(model, opt)
    accelerator.save_state(str(tmp_path / "ckpt"))
    return accelerator, model, opt, tmp_path / "ckpt", _snapshot(model)


def test_load_state_reloads_peft_model_in_place_and_skips_accelerates_model_load(saved, monkeypatch):
    import accelerate.checkpointing

    accelerator, model, opt, ckpt, reference = saved
    params_before = {n: p for n, p in model.named_parameters()}
    _perturb(model)
    calls = []
    original = accelerate.checkpointing.load_model
    monkeypatch.setattr(accelerate.checkpointing, "load_model", lambda *a, **k: calls.append(a) or original(*a, **k))
    accelerator.load_state(str(ckpt))
    assert calls == []  # accelerate did not read model.safetensors a second time
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in reference.items())
    assert all(p is params_before[n] for n, p in model.named_parameters())  # in place: same parameters
    assert accelerator._models == [model]
    record = [r for r in accelerator.memsafe_plugin.report.records if r.stage == "peft_cpu_reload"][-1]
    assert record.status == "ran", record.reason
    assert record.details["tensors"] == len(reference)
    assert record.details["adapters"] == ["default", "other"]
    # one tensor at a time: the live tensor peak of the whole stage (validation + copy) is the largest tensor
    assert record.live_tensor_peak_bytes <= 1.05 * record.details["largest_tensor_bytes"]
    assert record.details["bytes"] > 5 * record.details["largest_tensor_bytes"]


def test_optimizer_and_training_continue_after_reload(saved):
    accelerator, model, opt, ckpt, reference = saved
    _perturb(model)
    accelerator.load_state(str(ckpt))
    _step(model, opt)
    assert any(not torch.equal(model.state_dict()[k], v) for k, v in reference.items() if "lora_A.default" in k)


def test_truncated_model_file_is_refused_before_any_change(saved):
    accelerator, model, opt, ckpt, _ = saved
    path = ckpt / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 64)
    _perturb(model)
    before = _snapshot(model)
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated: tensor `[\w.]+`"):
        accelerator.load_state(str(ckpt))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert accelerator._models == [model]


def test_shape_mismatch_is_refused_naming_the_tensor(saved, tmp_path):
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    _, _, _, ckpt, _ = saved
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other = get_peft_model(build_llama("tiny"), LoraConfig(r=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
        other.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj"]))
    accelerator, model, _ = _setup(other)
    with pytest.raises(CheckpointError, match=r"tensor `[\w.]+lora_[AB]\.default\.weight` has shape \[\d+, \d+\] in the file"):
        accelerator.load_state(str(ckpt))


def test_not_a_peft_model_is_skipped(tmp_path):
    accelerator, model, opt = _setup(torch.nn.Linear(4, 4))
    _step(model, opt)
    accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.load_state(str(tmp_path / "ckpt"))
    record = [r for r in accelerator.memsafe_plugin.report.records if r.stage == "peft_cpu_reload"][-1]
    assert (record.status, record.reason) == ("skipped", "no PEFT model")
