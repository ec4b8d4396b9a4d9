"""The model's TP plan (transformers' ``_tp_plan``) mapped to torch's styles, and the node layout of the
``node`` load source: both decided from names only, identically on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_memsafe.distributed import tensor_parallel
from accelerate_memsafe.distributed.sharding import fsdp2_prepare_skip_reason
from accelerate_memsafe.distributed.tensor_parallel import resolve_tp_plan, tp_plan_problem
from accelerate_memsafe.distributed.topology import Nodes, node_key


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)


class Net(nn.Module):
    def __init__(self, plan: dict[str, str], tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self._tp_plan = plan


PLAN = {"layers.*.up": "colwise", "layers.*.down": "rowwise", "embed": "embedding_rowwise", "head": "colwise_gather_output"}


def test_every_module_the_plan_names_gets_torchs_style():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan, tied, problem = resolve_tp_plan(Net(PLAN))
    assert problem is None and tied == []
    assert sorted(plan) == ["embed", "head", "layers.0.down", "layers.0.up", "layers.1.down", "layers.1.up"]
    assert isinstance(plan["layers.1.up"], ColwiseParallel) and isinstance(plan["layers.0.down"], RowwiseParallel)
    from torch.distributed.tensor import Replicate

    layouts = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731
    assert layouts(plan["head"].output_layouts) == (Replicate(),)  # gathered output
    assert layouts(plan["embed"].input_layouts) == (Replicate(),)


def test_tied_modules_stay_replicated_and_say_so():
    plan, tied, problem = resolve_tp_plan(Net(PLAN, tie=True))
    assert problem is None and tied == ["embed", "head"] and "embed" not in plan and "layers.0.up" in plan


@pytest.mark.parametrize("plan, says", [
    ({}, "has no tensor-parallel plan"),
    ({"layers.*.up": "packed_colwise"}, "style(s) ['packed_colwise']"),
    ({"nothing.*": "colwise"}, "matches none of its"),
])
def test_a_plan_the_plugin_cannot_apply_is_declined_with_its_reason(plan, says):
    assert says in resolve_tp_plan(Net(plan))[2]
    assert says in tp_plan_problem(Net(plan), 2)
    # the stages still run: FSDP over `dp_shard` only, as accelerate's own prepare does with such a model
    config = type("PC", (), {"tp_size": 2})()
    assert fsdp2_prepare_skip_reason(is_fsdp2=True, model=Net(plan), parallelism_config=config) is None


def test_a_model_the_plugin_can_parallelise_is_not_skipped():
    config = type("PC", (), {"tp_size": 2})()
    assert fsdp2_prepare_skip_reason(is_fsdp2=True, model=Net(PLAN), parallelism_config=config) is None


def test_nodes_come_from_the_launchers_node_index(monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "3")
    assert node_key() == "node 3"
    monkeypatch.delenv("GROUP_RANK")
    assert node_key().startswith("host ")
    nodes = Nodes(((0, 1, 2), (3,)))
    assert nodes.leaders == (0, 3) and nodes.leader_of(2) == 0 and not nodes.is_leader(1) and nodes.node_of(3) == (3,)


def test_node_layout_is_agreed_through_one_all_gather():
    from accelerate_memsafe.distributed.topology import find_nodes

    class Coll:
        def all_gather_object(self, obj, what):
            return ["node 1", "node 0", "node 1", "node 0"]

    assert find_nodes(Coll()).ranks == ((0, 2), (1, 3))


class Runnable(Net):
    """:class:`Net` with a forward and ``dummy_inputs`` (what transformers' models have); ``scale``: a parameter of
    the up projection's width that the forward multiplies its output with, which no TP plan splits."""

    def __init__(self, plan: dict[str, str], *, scale: bool = False, broken: bool = False) -> None:
        super().__init__(plan)
        self.scale = nn.Parameter(torch.ones(8)) if scale else None
        self.broken = broken

    @property
    def dummy_inputs(self) -> dict[str, torch.Tensor]:
        return {"ids": torch.tensor([[1, 2, 3]])}

    def trunk(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        if self.broken:
            h = h.view(7, -1)  # fails with or without the split
        for block in self.layers:
            up = block.up(h)
            h = h + block.down(up * self.scale if self.scale is not None else up)
        return h

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(ids))


@pytest.mark.parametrize("tp", [2, 3])  # 3: uneven rows (3, 3, 2 of 8), two rank shapes rehearsed
def test_a_plan_the_models_forward_runs_with_is_applied(tp):
    assert tp_plan_problem(Runnable(PLAN), tp) is None


def test_a_plan_the_models_forward_does_not_run_with_is_declined_naming_the_error():
    problem = tp_plan_problem(Runnable(PLAN, scale=True), 2)
    assert problem.startswith("the model's forward does not run with its TP plan split over tp=2 (rank 0's shapes")
    assert "RuntimeError" in problem  # the forward's own error: 4 of the 8 up-projected features against 8 scales


def test_a_forward_that_fails_on_meta_without_the_split_too_leaves_the_plan_unchecked_and_declined():
    problem = tp_plan_problem(Runnable(PLAN, broken=True), 2)
    assert problem.startswith("the plugin could not check the TP plan against the model's forward: it fails on `meta` "
                              "without the split too")
    assert "could not check" in tp_plan_problem(Net(PLAN), 2) and "dummy_inputs" in tp_plan_problem(Net(PLAN), 2)


class GroupedExperts(Runnable):
    """:class:`Runnable` with experts no plan splits, run through torch's grouped matmul as transformers' MoE
    experts are: on ``meta`` it takes bf16 inputs only, so the model's fp32 forward fails there, split or not."""

    def __init__(self, plan: dict[str, str], *, scale: bool = False) -> None:
        super().__init__(plan, scale=scale)
        self.wide, self.narrow = nn.Linear(4, 16), nn.Linear(8, 4)  # widths the grouped matmul's strides accept
        self.experts = nn.Parameter(torch.randn(3, 16, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tokens = self.wide(self.trunk(ids)).reshape(-1, 16)
        offs = torch.tensor([1, 2, tokens.shape[0]], dtype=torch.int32, device=ids.device)
        return self.head(self.narrow(torch._grouped_mm(tokens, self.experts, offs=offs)))


def test_a_forward_that_runs_on_meta_in_bf16_only_is_rehearsed_in_bf16():
    model = GroupedExperts(PLAN)
    with pytest.raises(RuntimeError, match="BF16"):  # the fp32 forward on `meta`: what the rehearsal got around
        tensor_parallel._meta_copy(model)(**{k: v.to("meta") for k, v in model.dummy_inputs.items()})
    model(**model.dummy_inputs)  # the real fp32 forward runs
    assert tp_plan_problem(model, 2) is None
    assert tp_plan_problem(GroupedExperts(PLAN), 3) is None  # uneven rows
    # the bf16 rehearsal still finds a plan the forward does not run with, naming its error
    problem = tp_plan_problem(GroupedExperts(PLAN, scale=True), 2)
    assert problem.startswith("the model's forward does not run with its TP plan split over tp=2 (rank 0's shapes")
    assert "RuntimeError" in problem and "BF16" not in problem
    assert next(model.parameters()).dtype == torch.float32 and not next(model.parameters()).is_meta  # untouched


def test_a_planned_module_torchs_styles_do_not_apply_to_is_named():
    model = Runnable({**PLAN, "layers.*": "colwise"})
    assert "the TP plan names `layers.0`, a Block" in tp_plan_problem(model, 2)


def test_the_rehearsal_leaves_the_model_as_it_was_and_runs_once_per_model(monkeypatch):
    model = Runnable(PLAN, scale=True)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    calls = []
    real = tensor_parallel.rehearse_tp_plan
    monkeypatch.setattr(tensor_parallel, "rehearse_tp_plan", lambda *a: calls.append(a) or real(*a))
    first = tp_plan_problem(model, 2)
    assert tp_plan_problem(model, 2) == first and len(calls) == 1  # the stages ask several times per prepare
    tp_plan_problem(model, 4)
    assert len(calls) == 2  # another tp is another question
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for n, (p, value) in before.items():
        assert after[n] is p and p.device.type == "cpu" and torch.equal(p, value), n


def _tiny(config_cls, model_cls, **overrides):
    config = config_cls(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, **overrides)
    torch.manual_seed(0)
    return model_cls(config)


def test_transformers_plans_that_the_models_forward_does_not_run_with_are_declined():
    from transformers import DogeConfig, DogeForCausalLM, LlamaConfig, LlamaForCausalLM

    llama = _tiny(LlamaConfig, LlamaForCausalLM)
    assert tp_plan_problem(llama, 2) is None
    # 2 key/value heads over 4 ranks: half a head each
    assert "does not run with its TP plan split over tp=4" in tp_plan_problem(llama, 4)
    # Doge's plan splits the attention's heads but not `A`, the per-head parameter its forward multiplies them with
    doge = _tiny(DogeConfig, DogeForCausalLM)
    assert "does not run with its TP plan split over tp=2" in tp_plan_problem(doge, 2)


def test_every_rank_applies_the_plan_or_none_does():
    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.pipeline import ANNOUNCED_KEY, HookContext
    from accelerate_memsafe.stages.shard import ShardStage

    config = type("PC", (), {"tp_size": 2})()
    stage = ShardStage(MemSafePlugin())
    ctx = HookContext(hook="prepare", rank=0, world_size=2, device=torch.device("cpu"), options=stage.options,
                      model=Runnable(PLAN), is_fsdp2=True, scratch={"parallelism_config": config})
    assert stage.announce(ctx) == ("tp", None)  # what this rank sends with the preflight exchange
    ctx.scratch[ANNOUNCED_KEY] = {"shard": [("tp", None), ("tp", None)]}
    assert stage._agreed_tp_problem(ctx, 2) is None
    # one rank's model differs (a user's edit on that rank only): no rank applies the plan, and the reason names it
    ctx.scratch[ANNOUNCED_KEY] = {"shard": [("tp", None), ("tp", "the model's forward does not run with ...")]}
    assert stage._agreed_tp_problem(ctx, 2) == "rank 1: the model's forward does not run with ..."
    # without a tp dimension nothing is announced, and nothing is rehearsed
    ctx.scratch["parallelism_config"] = type("PC", (), {"tp_size": 1})()
    assert stage.announce(ctx) is None


def test_a_model_that_cannot_be_copied_is_declined_unchecked_not_raised():
    import threading

    model = Runnable(PLAN)
    model.lock = threading.Lock()  # deepcopy cannot copy it
    assert tp_plan_problem(model, 2).startswith("the plugin could not check the TP plan against the model's forward")
