"""``optimizer_offload`` keeps ``state["step"]`` where torch's optimizers want it: on the parameter's device
for ``capturable=True`` / ``fused=True`` (their kernels check it), on CPU otherwise (issue #12).

A CPU machine has no second device, so the placement rule is tested directly and the offload hooks are
driven with a fake accelerator (``meta`` tensors, moved by a recording ``_moved``); the real CUDA case is
behind the ``gpu`` marker."""

from __future__ import annotations

import pytest
import torch

from accelerate_memsafe.distributed import optimizer_offload as oo
from accelerate_memsafe.distributed.optimizer_offload import (
    OptimizerOffload,
    move_optimizer_state,
    state_tensor_device,
    step_device,
)
from accelerate_memsafe.io.optimizer_state import _target_spec

CUDA = torch.device("cuda", 0)  # a device object; nothing is allocated on it
CPU = torch.device("cpu")


@pytest.mark.parametrize(("group", "expected"), [
    ({"capturable": True, "fused": None}, CUDA),
    ({"capturable": False, "fused": True}, CUDA),
    ({"capturable": False, "fused": None}, CPU),
    ({"capturable": False, "fused": False, "foreach": True}, CPU),
    ({}, CPU),  # SGD and friends have neither flag
])
def test_step_device_follows_torch(group, expected):
    assert step_device(group, CUDA) == expected
    assert state_tensor_device("step", torch.zeros(()), group, CUDA, offloaded=True) == expected
    assert state_tensor_device("step", torch.zeros(()), group, CUDA, offloaded=False) == expected
    assert state_tensor_device("exp_avg", torch.zeros(3), group, CUDA, offloaded=True) == CPU
    assert state_tensor_device("exp_avg", torch.zeros(3), group, CUDA, offloaded=False) == CUDA


@pytest.mark.parametrize("flag", ["capturable", "fused"])
def test_reload_plan_puts_step_on_the_parameter_device_even_when_offloaded(flag):
    param = torch.empty(4, device="meta")  # stands for a parameter on an accelerator
    group = {"capturable": False, "fused": None, flag: True}
    step = torch.zeros((), dtype=torch.float32)
    assert _target_spec(None, group, param, "step", step, offload=True)[1] == param.device
    assert _target_spec(None, group, param, "exp_avg", torch.zeros(4), offload=True)[1] == CPU
    plain = {"capturable": False, "fused": None}
    assert _target_spec(None, plain, param, "step", step, offload=True)[1] == CPU
    assert _target_spec(None, plain, param, "step", step, offload=False)[1] == CPU


def _fake_device_optimizer(**flags):
    """An Adam whose parameter and state live on ``meta`` (the fake accelerator); no step is ever run."""
    p = torch.nn.Parameter(torch.empty(4, device="meta"))
    opt = torch.optim.Adam([p], lr=1e-3, **flags)
    opt.state[p] = {"step": torch.zeros((), device="meta"), "exp_avg": torch.empty(4, device="meta"),
                    "exp_avg_sq": torch.empty(4, device="meta")}
    return p, opt


@pytest.fixture
def recording_moves(monkeypatch):
    """``_moved`` that allocates an empty tensor on the target instead of copying (meta has no data)."""
    def moved(t, device, *, pin=False, into=None):
        return t if t.device == device else torch.empty(t.shape, dtype=t.dtype, device=device)

    monkeypatch.setattr(oo, "_moved", moved)


@pytest.mark.parametrize("flags", [{"capturable": True}, {"fused": True}])
def test_offload_keeps_capturable_or_fused_step_on_the_parameter_device(recording_moves, flags):
    p, opt = _fake_device_optimizer(**flags)
    off = OptimizerOffload(opt, p.device)
    off.offload()
    devices = {k: v.device.type for k, v in opt.state[p].items()}
    assert devices == {"step": "meta", "exp_avg": "cpu", "exp_avg_sq": "cpu"}, devices
    off._before_step(opt, (), {})
    assert {v.device.type for v in opt.state[p].values()} == {"meta"}
    # a `step` that a load left on CPU is brought back to the parameter's device by either path
    opt.state[p]["step"] = torch.zeros(())
    off.offload()
    assert opt.state[p]["step"].device.type == "meta"
    opt.state[p]["step"] = torch.zeros(())
    move_optimizer_state(opt, p.device)
    assert opt.state[p]["step"].device.type == "meta"


def test_offload_keeps_plain_step_on_cpu(recording_moves):
    p, opt = _fake_device_optimizer()
    off = OptimizerOffload(opt, p.device)
    off.offload()
    assert {k: v.device.type for k, v in opt.state[p].items()} == {"step": "cpu", "exp_avg": "cpu", "exp_avg_sq": "cpu"}
    off._before_step(opt, (), {})
    assert {k: v.device.type for k, v in opt.state[p].items()} == {"step": "cpu", "exp_avg": "meta", "exp_avg_sq": "meta"}


def _train(flags, offload, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, **flags)
    off = OptimizerOffload.install(opt, torch.device("cuda", torch.cuda.current_device())) if offload else None
    for i in range(steps):
        x = torch.randn(4, 8, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt, off


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [{"capturable": True}, {"fused": True}, {}])
def test_offloaded_adam_steps_on_cuda_like_the_plain_one(flags):
    model, opt, off = _train(flags, offload=True)
    assert off.steps == 3
    want_step = "cuda" if flags else "cpu"
    for st in opt.state.values():
        assert st["step"].device.type == want_step
        assert st["exp_avg"].device.type == "cpu" and st["exp_avg_sq"].device.type == "cpu"
    ref, _, _ = _train(flags, offload=False)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
