"""``GroupFilter``: which modules of one ``fully_shard`` call may form an FSDP2 group (ties kept in one
group, containers without forward skipped, nothing grouped twice), and the ``cpu_offload=True`` fix."""

from __future__ import annotations

import functools

import re

import pytest
import torch
from torch import nn

from accelerate_memsafe import walk
from accelerate_memsafe.distributed.sharding import GroupFilter, resolve_wrap_policy


class Head(nn.Module):
    """A BERT-style prediction head: the decoder's bias is the head's own ``bias`` (a tied bias)."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(emb.num_embeddings))
        self.decoder = nn.Linear(emb.embedding_dim, emb.num_embeddings)
        self.decoder.weight = emb.weight
        self.decoder.bias = self.bias

    def forward(self, x):
        return self.decoder(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = Head(self.emb)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_a_group_that_would_split_a_tie_is_dropped():
    m = Model()
    f = GroupFilter(m)
    assert f.select([m.head.decoder]) == []  # its bias is the head's, its weight the embedding's
    assert f.select([m.emb]) == []  # its weight is the decoder's
    assert f.select([m.head]) == []  # the head still shares the embedding weight
    assert f.select([m.emb, m.head]) == [m.emb, m.head]  # every user of both ties: one group
    assert f.select([m.emb, m.head.decoder]) == []  # the head's bias is still outside


def test_containers_without_forward_are_skipped_and_their_children_kept():
    m = Model()
    f = GroupFilter(m)
    assert f.select([m.layers]) == []
    assert f.select([m.layers[0]]) == [m.layers[0]]


def test_modules_whose_parameters_a_group_already_manages_are_dropped():
    m = Model()
    f = GroupFilter(m)
    f.formed([m.layers[0]])
    assert f.select([m.layers[0]]) == []
    assert f.select([m.layers[1]]) == [m.layers[1]]


def test_transformer_wrap_policy_is_resolved_against_the_unwrapped_model():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    resolve_wrap_policy(plugin, model)
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    # a second resolution (accelerate's own, after fully_shard renamed the classes) is a no-op
    type(model.model.layers[0]).__name__ = "FSDPLlamaDecoderLayer"
    try:
        plugin.set_auto_wrap_policy(model)
    finally:
        type(model.model.layers[0]).__name__ = "LlamaDecoderLayer"


def test_cpu_offload_true_is_unpinned_for_cpu_fsdp2():
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    from accelerate_memsafe.accelerator import unpin_cpu_offload

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_offload=True)
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) and plugin.cpu_offload.pin_memory
    assert unpin_cpu_offload(plugin) is True
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) and not plugin.cpu_offload.pin_memory
    assert unpin_cpu_offload(plugin) is False


def test_tensor_subclass_parameters_are_named():
    from accelerate_memsafe.distributed.meta import tensor_subclass_parameters

    class Quantized(nn.Parameter):
        pass

    lin = nn.Linear(2, 2)
    assert tensor_subclass_parameters(lin) == []
    lin.weight = Quantized(torch.zeros(2, 2))
    assert tensor_subclass_parameters(lin) == ["weight (Quantized)"]


def _fresh_owners(root: nn.Module) -> dict[int, set[int]]:
    owners: dict[int, set[int]] = {}
    for mod in root.modules():
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(id(mod))
    return owners


def _shard_like_fully_shard(modules: list[nn.Module]) -> None:
    """What ``fully_shard`` does to the owner map: every parameter of the group's modules becomes a new object (shared
    ones stay shared), the old ones are dropped."""
    new: dict[int, nn.Parameter] = {}
    for k in modules:
        for m in k.modules():
            for name, p in list(m._parameters.items()):
                if p is not None:
                    m._parameters[name] = new.setdefault(id(p), nn.Parameter(p.detach().clone()))


def test_the_owner_map_kept_up_to_date_equals_one_built_afresh_after_every_group():
    # one walk of the tree for a whole wrap policy's calls (not one per call), with the same answers
    m = Model()
    f = GroupFilter(m)
    for call in ([m.layers[0]], [m.layers[1]], [m.head.decoder], [m.emb, m.head]):
        kept = f.select(call)
        assert f._owner_map() == _fresh_owners(m)
        if kept:
            _shard_like_fully_shard(kept)
            f.formed(kept)
        assert f._owner_map() == _fresh_owners(m)
    assert f.select([m.emb]) == []  # grouped with the head already


def test_the_owner_map_walks_the_tree_once_for_many_calls(monkeypatch):
    m = Model()
    walks = []
    real_method, real_walk = nn.Module.modules, walk.modules

    def counting(self):
        if self is m:
            walks.append(1)
        return real_method(self)

    def counting_walk(module):
        if module is m:
            walks.append(1)
        return real_walk(module)

    monkeypatch.setattr(nn.Module, "modules", counting)  # either way of walking the whole tree counts
    monkeypatch.setattr(walk, "modules", counting_walk)
    f = GroupFilter(m)
    for layer in m.layers:
        kept = f.select([layer])
        _shard_like_fully_shard(kept)
        f.formed(kept)
    assert len(walks) == 1


class Untied(nn.Module):
    """No parameter held by two modules: the head has weights of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4)])
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _run_calls(force_tie_check: bool) -> list[list[str]]:
    torch.manual_seed(0)
    m = Untied()
    names = {id(mod): n for n, mod in m.named_modules()}
    f = GroupFilter(m)
    f._owner_map()
    if force_tie_check:
        f._tied = True  # the general path, as for a tree with ties
    answers = []
    for call in (["layers"], ["layers.0"], ["layers.0"], ["layers.0.0"], ["layers.1"], ["norm", "head"], ["emb"],
                 ["head"]):
        kept = f.select([m.get_submodule(n) for n in call])
        answers.append([names[id(k)] for k in kept])
        if kept:
            _shard_like_fully_shard(kept)
            f.formed(kept)
    return answers + [sorted(f.dropped)]


def test_a_tree_without_ties_skips_the_tie_check_and_answers_the_same(monkeypatch):
    # every parameter's one holder lies in the subtree of the module whose group takes it: the tie check cannot drop
    # anything, so it is skipped (no walk of each candidate's subtree, no owner map kept up to date)
    general = _run_calls(force_tie_check=True)
    subtree_walks = []
    real_walk = walk.modules
    monkeypatch.setattr(walk, "modules", lambda module: subtree_walks.append(type(module).__name__) or real_walk(module))
    assert _run_calls(force_tie_check=False) == general
    assert subtree_walks == ["Untied"]  # the one walk of the whole tree that finds no tie
    assert general[:3] == [[], ["layers.0"], []] and general[5] == ["norm", "head"]


def test_a_tree_with_a_tie_takes_the_general_path():
    f = GroupFilter(Model())
    f._owner_map()
    assert f._tied
    f = GroupFilter(Untied())
    f._owner_map()
    assert not f._tied


def _force_accelerate_hooks():
    try:
        from transformers.integrations.accelerate import force_accelerate_hooks
    except ImportError:  # pragma: no cover - a transformers without the declaration
        pytest.skip("this transformers has no force_accelerate_hooks")
    return force_accelerate_hooks


def _mixer_class(force_accelerate_hooks):
    class Mixer(nn.Module):
        """A mamba-style mixer: its forward reads ``conv1d.weight`` directly, never calling ``conv1d``."""

        def __init__(self) -> None:
            super().__init__()
            self.in_proj = nn.Linear(4, 4)
            self.conv1d = nn.Conv1d(4, 4, 3, groups=4, padding=2)

        @force_accelerate_hooks("conv1d")
        def forward(self, x):
            h = self.in_proj(x).transpose(1, 2)
            return torch.nn.functional.conv1d(h, self.conv1d.weight, self.conv1d.bias, padding=2, groups=4)

    return Mixer


def test_children_whose_weights_the_parent_reads_directly_stay_in_the_parents_group():
    # a group of `conv1d` would never be unsharded (its forward never runs): the mixer's forward would meet a DTensor
    Mixer = _mixer_class(_force_accelerate_hooks())
    m = nn.Sequential(Mixer(), Mixer())
    f = GroupFilter(m)
    assert f.select([m[0].conv1d]) == [] and "Conv1d" in f.dropped
    assert f.select([m[0].in_proj]) == [m[0].in_proj]  # called through its forward: a group of its own is fine
    assert f.select([m[0]]) == [m[0]]  # the mixer takes conv1d's weights
    assert f.select([m[1].conv1d, m[1]]) == [m[1]]


def test_transformers_declarations_of_children_used_directly_are_read():
    # the decorator's own closure, read through other decorators stacked on it; transformers' mamba mixer declares two
    from accelerate_memsafe import _compat

    force_accelerate_hooks = _force_accelerate_hooks()
    assert _compat.directly_used_children(_mixer_class(force_accelerate_hooks)) == ("conv1d",)

    class Stacked(nn.Module):  # another decorator on top of transformers' (functools.wraps keeps `__wrapped__`)
        pass

    inner = force_accelerate_hooks(["conv1d", "dt_proj"])(lambda self, x: x)
    Stacked.forward = functools.wraps(inner)(lambda self, x: inner(self, x))
    assert _compat.directly_used_children(Stacked) == ("conv1d", "dt_proj")
    assert _compat.directly_used_children(nn.Linear) == () and _compat.directly_used_children(nn.Module) == ()
    from transformers.models.mamba.modeling_mamba import MambaMixer

    assert _compat.directly_used_children(MambaMixer) == ("conv1d", "dt_proj")


def _with_no_split(model: nn.Module, names: list[str]) -> nn.Module:
    model._no_split_modules = names
    return model


def test_layer_classes_the_model_does_not_contain_are_left_out_of_transformer_wrap():
    # transformers lists every layer class an architecture may build (a cross-attention built only with
    # add_cross_attention): accelerate refuses the whole model where one is missing; the policy wraps those it has
    from accelerate.utils import FullyShardedDataParallelPlugin

    def plugin(**kw):
        return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", **kw)

    m = _with_no_split(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ["Linear", "CrossAttention", "ReLU"])
    p = plugin()
    assert resolve_wrap_policy(p, m) == ["CrossAttention"]
    assert p.transformer_cls_names_to_wrap == ["Linear", "ReLU"]
    assert p.auto_wrap_policy.keywords["transformer_layer_cls"] == {nn.Linear, nn.ReLU}
    # every listed class there: nothing left out, as accelerate resolves it
    p = plugin()
    assert resolve_wrap_policy(p, _with_no_split(nn.Sequential(nn.Linear(2, 2)), ["Linear"])) == []
    assert p.transformer_cls_names_to_wrap == ["Linear"]
    # classes the user named: accelerate's own error
    with pytest.raises(ValueError, match="Could not find the transformer layer class CrossAttention"):
        resolve_wrap_policy(plugin(transformer_cls_names_to_wrap=["Linear", "CrossAttention"]), m)
    # a model with none of the listed classes: as accelerate resolves it (1.15 refuses it; 1.16 leaves out the classes
    # the model does not build, as the policy does, and wraps no layer)
    none_there = _with_no_split(nn.Sequential(nn.Linear(2, 2)), ["CrossAttention"])
    stock = plugin()
    try:
        stock.set_auto_wrap_policy(none_there)
        theirs = None
    except ValueError as exc:
        theirs = str(exc)
    mine = plugin()
    if theirs is None:
        assert resolve_wrap_policy(mine, none_there) == []
        assert mine.auto_wrap_policy.keywords == stock.auto_wrap_policy.keywords == {"transformer_layer_cls": set()}
    else:
        assert "Could not find the transformer layer class CrossAttention" in theirs
        with pytest.raises(ValueError, match=re.escape(theirs)):
            resolve_wrap_policy(mine, none_there)


class Undeclared(nn.Module):
    """Reads its child's weight without calling the child, and nothing declares it (ProphetNet's decoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(4, 4, 3, groups=4)
        self.out = nn.Linear(4, 4)

    def forward(self, x):
        return self.out(torch.nn.functional.conv1d(x, self.conv1d.weight, groups=4).transpose(1, 2))


def test_a_child_used_directly_without_transformers_declaration_is_read_from_the_source():
    # read_code (size_based_wrap, a policy of the user's): the forward's source shows conv1d read without a call, so
    # conv1d stays in its parent's group; without it (transformer_based_wrap, no policy) the policy's pick stands
    m = nn.Sequential(Undeclared())
    f = GroupFilter(m, read_code=True)
    assert f.select([m[0].conv1d]) == [] and f.dropped == ["Conv1d"]
    assert f.select([m[0].out]) == [m[0].out]  # called through its forward
    assert GroupFilter(m).select([m[0].conv1d]) == [m[0].conv1d]


def test_policies_that_may_group_any_module_read_the_source():
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_memsafe.distributed.sharding import policy_picks_any_module

    def plugin(policy, **kw):
        p = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=policy, **kw)
        p.set_auto_wrap_policy(_with_no_split(nn.Sequential(nn.Linear(2, 2)), ["Linear"]))
        return p

    assert policy_picks_any_module(plugin("size_based_wrap", min_num_params=10))
    assert policy_picks_any_module(plugin(lambda module, recurse, nonwrapped_numel: True))
    assert not policy_picks_any_module(plugin("transformer_based_wrap"))
    assert not policy_picks_any_module(plugin(None))
    assert not policy_picks_any_module(plugin("size_based_wrap"))  # min_num_params=0: accelerate sets no policy


def test_size_based_wrap_keeps_a_child_read_directly_in_its_parents_group():
    # shard_model on a 1-rank gloo group, as the `shard` stage calls it: under size_based_wrap conv1d was a group of
    # its own, resharded when the parent's forward read its weight (a DTensor meeting a tensor); read from the source
    # it stays with its parent, and the forward gives the unsharded model's output bitwise
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    from accelerate_memsafe.distributed.sharding import shard_model
    from tests.spawn import free_port

    torch.manual_seed(0)
    model = nn.Sequential(Undeclared(), Undeclared())
    x = torch.randn(2, 4, 8)
    expected = model[1](model[0](x).transpose(1, 2))
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=10)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = shard_model(model, [], fsdp_plugin=plugin, mixed_precision="no", device=torch.device("cpu"))
        got = model[1](model[0](x).transpose(1, 2))
    finally:
        dist.destroy_process_group()
    assert all(isinstance(u, FSDPModule) and isinstance(u.out, FSDPModule) for u in model)  # the policy's groups
    assert not any(isinstance(u.conv1d, FSDPModule) for u in model)
    assert torch.equal(got, expected)


def test_the_shard_record_names_the_layer_classes_left_out():
    # shard_model on a 1-rank gloo group, as the `shard` stage calls it: the classes left out reach its details
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    from accelerate_memsafe.distributed.sharding import shard_model
    from tests.spawn import free_port

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    model = _with_no_split(nn.Sequential(Block(), Block()), ["Block", "CrossAttention"])
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    details: dict = {}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = shard_model(model, [], fsdp_plugin=plugin, mixed_precision="no", device=torch.device("cpu"),
                            details=details)
    finally:
        dist.destroy_process_group()
    assert details == {"wrap_classes_absent": ["CrossAttention"]}
    assert all(isinstance(b, FSDPModule) for b in model)  # both blocks are groups of their own
