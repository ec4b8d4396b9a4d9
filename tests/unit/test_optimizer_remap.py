"""``remap_optimizer_params``: the optimizer's parameters move to the sharded ones by name; state that came from a step
is refused, the state an optimizer builds when constructed is dropped (it builds it again at its first step)."""

from __future__ import annotations

import pytest
import torch

from accelerate_memsafe.distributed.sharding import remap_optimizer_params, stepped_state


def _params():
    old = {"w": torch.nn.Parameter(torch.ones(3)), "b": torch.nn.Parameter(torch.zeros(2))}
    new = {n: torch.nn.Parameter(p.detach().clone()) for n, p in old.items()}
    return old, new


def test_the_state_adagrad_builds_when_constructed_is_dropped_and_rebuilt_at_the_first_step():
    old, new = _params()
    opt = torch.optim.Adagrad(list(old.values()), lr=0.1, initial_accumulator_value=0.5)
    assert len(opt.state) == 2 and stepped_state(opt) is None
    assert remap_optimizer_params([opt], old, new) == 2
    assert len(opt.state) == 0 and opt.param_groups[0]["params"] == list(new.values())
    for p in new.values():
        p.grad = torch.ones_like(p)
    opt.step()  # the optimizer's own first step builds the accumulators of the new parameters
    assert set(opt.state) == set(new.values())
    assert all(torch.equal(opt.state[p]["sum"], torch.full_like(p, 1.5)) for p in new.values())


def test_state_on_meta_counts_as_built_at_construction():
    # a rank that holds its weights on meta (before `rank0_distribute`) built Adagrad's state on meta: no step taken
    old = {"w": torch.nn.Parameter(torch.ones(3, device="meta"))}
    opt = torch.optim.Adagrad(list(old.values()), lr=0.1, fused=False)
    opt.state[old["w"]]["step"] = torch.zeros((), device="meta")
    assert stepped_state(opt) is None


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_state_from_a_step_is_refused_naming_it(optimizer):
    old, new = _params()
    params = list(old.values())
    opt = torch.optim.AdamW(params, lr=0.1) if optimizer == "adamw" else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    # AdamW's state has a step of 1; SGD's momentum buffer has no step at all
    why = "a parameter has taken 1 step" if optimizer == "adamw" else "a parameter's state has no `step`"
    with pytest.raises(ValueError, match=rf"optimizer #0 already has state for 2 parameter\(s\), {why}"):
        remap_optimizer_params([opt], old, new)
    assert opt.param_groups[0]["params"] == params, "nothing was switched before the refusal"
