"""With ``peft_cpu_reload`` active, a user's ``register_load_state_pre_hook`` hooks see what they see with
stock accelerate (the prepared models), and accelerate still does not read the model file again."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from accelerate_memsafe import Accelerator, MemSafePlugin
from tests.unit.test_peft_reload_stage import _peft_model, _step


def _hook_arguments(tmp_path, stages: list[str]) -> tuple[list, object, int, list]:
    accelerator = Accelerator(plugins=[MemSafePlugin(stages=stages)], cpu=True)
    model = _peft_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = accelerator.prepare(model, opt)
    _step(model, opt)
    ckpt = str(tmp_path / "-".join(stages or ["stock"]))
    accelerator.save_state(ckpt)
    seen = []
    handle = accelerator.register_load_state_pre_hook(lambda models, input_dir: seen.append((list(models), input_dir)))
    accelerator.load_state(ckpt)
    handle.remove()
    statuses = [r.status for r in accelerator.memsafe_plugin.report.find() if r.stage == "peft_cpu_reload"]
    return seen, model, len(accelerator._load_model_state_pre_hook), statuses


def test_load_state_pre_hooks_see_the_models_as_with_stock_accelerate(tmp_path, monkeypatch):
    import accelerate.checkpointing

    stock_seen, stock_model, _, _ = _hook_arguments(tmp_path, [])
    assert len(stock_seen) == 1 and len(stock_seen[0][0]) == 1 and stock_seen[0][0][0] is stock_model
    calls = []
    original = accelerate.checkpointing.load_model
    monkeypatch.setattr(accelerate.checkpointing, "load_model", lambda *a, **k: calls.append(a) or original(*a, **k))
    seen, model, hooks_left, statuses = _hook_arguments(tmp_path, ["peft_cpu_reload"])
    assert statuses == ["ran"], statuses
    assert len(seen) == 1 and len(seen[0][0]) == 1 and seen[0][0][0] is model, seen
    assert seen[0][1] == str(tmp_path / "peft_cpu_reload")
    assert calls == [], "accelerate must not read model.safetensors a second time"
    assert hooks_left == 0, "the plugin's temporary pre-hook must be removed after load_state"
