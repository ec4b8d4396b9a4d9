"""Modules a model's code uses without calling them, read from its source (distributed/direct_use.py): what the group
filter keeps out of groups of their own under ``size_based_wrap``."""

from __future__ import annotations

import torch
from torch import nn

from accelerate_memsafe.distributed.direct_use import code_uses, modules_used_directly


class ReadsWeight(nn.Module):
    """ProphetNet's decoder: an embedding's weight read directly; a projection called; metadata read."""

    def __init__(self) -> None:
        super().__init__()
        self.ngram = nn.Embedding(3, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        x = x.to(self.proj.weight.dtype) + self.ngram.weight.shape[0]
        if isinstance(self.proj.weight, torch.Tensor) and self.proj.weight.requires_grad:
            x = x + 0
        return self.proj(x) + self.ngram.weight[0]


class Experts(nn.Module):
    """JetMoE's attention experts: a ``forward`` that raises, two methods the parent calls."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.table = nn.Embedding(2, 4)
        self.bias = nn.Parameter(torch.zeros(4))

    def map(self, x):
        return self.inner(x) + self.table.weight[0]  # `inner` called (its hooks run), `table` read

    def forward(self, x):
        raise NotImplementedError


class CallsMethod(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts()
        self.other = nn.Linear(4, 4)

    def forward(self, x):
        return self.step(x) + next(self.other.parameters()).sum() * 0  # nn.Module's machinery is no use

    def step(self, x):
        return self.experts.map(x) + self.experts.bias


class CallsForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin.forward(x)  # skips the child's hooks


class ReturnsOwnParameter(nn.Module):
    """GPT-NeoX-Japanese's attention: ``forward`` returns its bias for the caller to add."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4, bias=False)
        self.dense_bias = nn.Parameter(torch.zeros(4)) if bias else None
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.dense(x), self.dense_bias, self.scale


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = ReturnsOwnParameter(bias=False)

    def forward(self, x):
        out, _, _ = self.b(self.a(x))
        return out


def test_a_child_whose_weight_the_code_reads_is_found_not_one_called_or_whose_metadata_is_read():
    m = ReadsWeight()
    assert modules_used_directly(m) == [m.ngram]
    uses = code_uses(ReadsWeight)
    assert ("proj", "weight", "dtype") in uses.chains and ("ngram", "weight") in uses.chains
    assert ("proj", "weight") not in uses.chains  # the isinstance check reads its type only


def test_a_childs_method_called_directly_and_what_that_method_reads_are_found():
    m = CallsMethod()
    found = modules_used_directly(m)
    # `experts.map` runs without the experts' hooks: the experts and the table its code reads stay out of groups of
    # their own; `inner` is called through its forward inside it, and `other` only asked for its parameters
    assert {id(x) for x in found} == {id(m.experts), id(m.experts.table)}
    assert ("experts", "map") in code_uses(CallsMethod).chains  # read in `step`, which forward calls
    c = CallsForward()
    assert modules_used_directly(c) == [c.lin]


def test_a_module_whose_forward_returns_its_own_parameter_is_found():
    m = ReturnsOwnParameter()
    assert modules_used_directly(m) == [m]
    assert code_uses(ReturnsOwnParameter).returned == {"dense_bias", "scale"}
    assert modules_used_directly(ReturnsOwnParameter(bias=False)) == []  # a buffer or None: nothing to unshard
    assert modules_used_directly(Plain()) == []


def test_code_without_source_gives_nothing():
    Dynamic = type("Dynamic", (nn.Module,), {"forward": eval("lambda self, x: self.lin.weight")})
    d = Dynamic()
    d.lin = nn.Linear(2, 2)
    assert modules_used_directly(d) == []
    assert code_uses(nn.Linear) == code_uses(nn.Sequential) == code_uses(nn.Module)  # torch's own code is not read
    assert modules_used_directly(nn.Sequential(nn.Linear(2, 2))) == []


def test_transformers_models_that_use_modules_directly_are_read():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese import GPTNeoXJapaneseAttention
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeAttention

    assert "dense_bias" in code_uses(GPTNeoXJapaneseAttention).returned
    assert ("experts", "map") in code_uses(JetMoeAttention).chains and ("experts", "reduce") in code_uses(JetMoeAttention).chains
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=64))
    assert [m for mod in llama.modules() for m in modules_used_directly(mod)] == []  # every module called
