"""``optimizer_cpu_reload`` restores an optimizer exactly as torch's own ``load_state_dict`` would (issue #12):
tensor hyper-parameters are real tensors on the device they had (not ``meta``), and a subclass's
``load_state_dict`` override and the optimizer's load-state-dict hooks run. Each case is compared with
stock accelerate loading the same checkpoint into the same setup."""

from __future__ import annotations

import pytest
import torch

from accelerate_memsafe import Accelerator, MemSafePlugin


class RecordingAdam(torch.optim.Adam):
    """A subclass with its own ``load_state_dict`` (e.g. to migrate old checkpoints)."""

    loads = 0

    def load_state_dict(self, state_dict):
        self.loads += 1
        self.loaded_keys = sorted(state_dict)
        super().load_state_dict(state_dict)
        for g in self.param_groups:
            g["migrated"] = True


def _make_opt(kind, params):
    lr = torch.tensor(1e-2) if kind.endswith("-tensor-lr") else 1e-2
    base = kind.removesuffix("-tensor-lr")
    if base == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if base == "adam":
        return torch.optim.Adam(params, lr=lr)
    if base == "adam-tensor-betas":
        return torch.optim.Adam(params, lr=lr, betas=(torch.tensor(0.8), torch.tensor(0.95)))
    if base == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    if base == "custom":
        return RecordingAdam(params, lr=lr)
    raise ValueError(kind)


def _setup(kind, *, stock=False, seed=0, hooks=None):
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    if stock:
        import accelerate

        acc = accelerate.Accelerator()
    else:
        acc = Accelerator(plugins=[MemSafePlugin()])
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = _make_opt(kind, model.parameters())
    if hooks is not None:
        opt.register_load_state_dict_pre_hook(hooks.pre)
        opt.register_load_state_dict_post_hook(hooks.post)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt, i):
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
    acc.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), (where, a, b)
        assert a.device == b.device and a.dtype == b.dtype and torch.equal(a, b), (where, a, b)
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _assert_same_optimizer(got, want):
    assert len(got.param_groups) == len(want.param_groups)
    for gi, (g, w) in enumerate(zip(got.param_groups, want.param_groups)):
        assert g.keys() == w.keys(), (gi, g.keys() ^ w.keys())
        for k in g:
            if k != "params":
                _same(g[k], w[k], f"param_groups[{gi}].{k}")
        for pi, (p, q) in enumerate(zip(g["params"], w["params"])):
            assert got.state[p].keys() == want.state[q].keys()
            for k in got.state[p]:
                _same(got.state[p][k], want.state[q][k], f"state[{gi}.{pi}].{k}")


@pytest.fixture
def saved(tmp_path):
    def save(kind):
        acc, model, opt = _setup(kind)
        for i in range(2):
            _step(acc, model, opt, i)
        path = tmp_path / kind
        acc.save_state(str(path))
        return path

    return save


def _load_both(kind, path, *, hooks_factory=None, warm=False):
    """The same fresh setup loaded by the plugin and by stock accelerate; both then take one more step."""
    out = []
    for stock in (False, True):
        hooks = hooks_factory() if hooks_factory else None
        acc, model, opt = _setup(kind, stock=stock, seed=1, hooks=hooks)
        if warm:
            _step(acc, model, opt, 9)  # the optimizer has state of its own: the plugin reads into it
        ptrs = {k: v.data_ptr() for st in opt.optimizer.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim()}
        if hooks is not None:
            hooks.calls.clear()  # accelerate's `prepare` itself may reload the state (device placement)
        opt.optimizer.loads = 0
        acc.load_state(str(path))
        out.append((acc, model, opt, hooks, ptrs))
    return out


KINDS = ["sgd", "adam", "adamw", "sgd-tensor-lr", "adam-tensor-lr", "adamw-tensor-lr", "adam-tensor-betas-tensor-lr",
         "custom"]


@pytest.mark.parametrize("kind", KINDS)
def test_reload_matches_stock_accelerate_and_steps(saved, kind):
    path = saved(kind)
    (acc, model, opt, _, _), (acc_s, model_s, opt_s, _, _) = _load_both(kind, path)
    _assert_same_optimizer(opt.optimizer, opt_s.optimizer)
    for g in opt.optimizer.param_groups:
        for v in g.values():
            for t in (v if isinstance(v, (tuple, list)) else [v]):
                assert not (isinstance(t, torch.Tensor) and t.is_meta), f"a meta hyper-parameter: {g}"
    _step(acc, model, opt, 2)  # stock accelerate's load steps; so must ours (it raised on meta `lr`)
    _step(acc_s, model_s, opt_s, 2)
    for p, q in zip(model.parameters(), model_s.parameters()):
        assert torch.equal(p, q)
    _assert_same_optimizer(opt.optimizer, opt_s.optimizer)


def test_subclass_load_state_dict_override_runs(saved):
    path = saved("custom")
    (acc, _, opt, _, _), (_, _, opt_s, _, _) = _load_both("custom", path)
    assert opt.optimizer.loads == opt_s.optimizer.loads == 1, "the override was bypassed"
    assert opt.optimizer.loaded_keys == ["param_groups", "state"]
    assert all(g.get("migrated") for g in opt.optimizer.param_groups), "the override's own changes are missing"
    _assert_same_optimizer(opt.optimizer, opt_s.optimizer)
    record = acc.memsafe_plugin.report.find(hook="load_state", stage="optimizer_cpu_reload")[-1]
    assert record.status == "ran" and record.details["load_state_dict_calls"] == 1
    assert "RecordingAdam.load_state_dict" in record.details["custom_load_state_dict"]["optimizer 0 (RecordingAdam)"]


class _Hooks:
    def __init__(self):
        self.calls = []

    def pre(self, optimizer, state_dict):
        self.calls.append("pre")
        state_dict["param_groups"] = [{**g, "weight_decay": 0.25} for g in state_dict["param_groups"]]
        return state_dict

    def post(self, optimizer):
        self.calls.append("post")
        optimizer.param_groups[0]["loaded_by_hook"] = True


@pytest.mark.parametrize("kind", ["sgd", "adamw", "adam-tensor-lr"])
@pytest.mark.parametrize("warm", [False, True])
def test_load_state_dict_hooks_run_and_state_is_read_in_place(saved, kind, warm):
    path = saved(kind)
    (acc, model, opt, hooks, ptrs), (acc_s, model_s, opt_s, hooks_s, _) = _load_both(kind, path, hooks_factory=_Hooks, warm=warm)
    assert hooks.calls == hooks_s.calls == ["pre", "post"]
    assert all(g["weight_decay"] == 0.25 for g in opt.optimizer.param_groups), "the pre-hook's change is missing"
    assert opt.optimizer.param_groups[0]["loaded_by_hook"] is True
    _assert_same_optimizer(opt.optimizer, opt_s.optimizer)
    if warm:  # torch's cast keeps tensors already on the parameters' device: still read in place
        now = {k: v.data_ptr() for st in opt.optimizer.state.values() for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim()}
        assert now == ptrs
    record = acc.memsafe_plugin.report.find(hook="load_state", stage="optimizer_cpu_reload")[-1]
    assert record.details["custom_load_state_dict"] == {
        f"optimizer 0 ({type(opt.optimizer).__name__})":
            "1 `register_load_state_dict_pre_hook` hook(s); 1 `register_load_state_dict_post_hook` hook(s)"}
    _step(acc, model, opt, 2)
    _step(acc_s, model_s, opt_s, 2)
    for p, q in zip(model.parameters(), model_s.parameters()):
        assert torch.equal(p, q)
