"""The model's TP plan (transformers' ``_tp_plan``) mapped to torch's styles, and the node layout of the
``node`` load source: both decided from names only, identically on every rank."""

from __future__ import annotations

import pytest
from torch import nn

from accelerate_memsafe.distributed.sharding import fsdp2_prepare_skip_reason
from accelerate_memsafe.distributed.tensor_parallel import resolve_tp_plan
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
    config = type("PC", (), {"tp_size": 2})()
    reason = fsdp2_prepare_skip_reason(is_fsdp2=True, model=Net(plan), parallelism_config=config)
    assert "tp_size=2" in reason and says in reason


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
