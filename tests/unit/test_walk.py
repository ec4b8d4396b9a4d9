"""accelerate_memsafe.walk gives what nn.Module's own walks give, in the same order, on the module trees people use:
tied weights, a module reached by two paths, encoder-decoder models sharing an embedding, activation checkpointing's
wrappers, and the FSDP2-sharded tree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_memsafe import walk


def _shared_tree() -> nn.Module:
    shared = nn.Linear(4, 4)
    tied = nn.Linear(4, 4, bias=False)
    tied.weight = shared.weight  # one parameter under two modules
    inner = nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared, tied, nn.Linear(4, 2)))
    model = nn.Sequential(inner, nn.Identity(), inner)  # a whole subtree reached twice
    model.add_module("gap", None)  # an unset child is skipped, as torch skips it
    return model


def _transformers(kind: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if kind == "llama_tied":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(cfg)
    if kind == "t5":
        cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        return transformers.T5ForConditionalGeneration(cfg)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["shared_tree", "llama_tied", "t5", "checkpoint_wrapped"])
def test_the_walks_match_torchs(kind):
    if kind == "shared_tree":
        model = _shared_tree()
    elif kind == "checkpoint_wrapped":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model = _transformers("llama_tied")
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    else:
        model = _transformers(kind)
    for dedupe in (True, False):
        mine = walk.named_modules(model, remove_duplicate=dedupe)
        theirs = list(model.named_modules(remove_duplicate=dedupe))
        assert [n for n, _ in mine] == [n for n, _ in theirs]
        assert all(a is b for (_, a), (_, b) in zip(mine, theirs))
    assert [n for n, _ in walk.named_parameters(model)] == [n for n, _ in model.named_parameters()]
    assert all(a is b for (_, a), (_, b) in zip(walk.named_parameters(model), model.named_parameters()))
    assert len(walk.parameters(model)) == len(list(model.parameters()))
    assert all(a is b for a, b in zip(walk.parameters(model), model.parameters()))
    assert all(a is b for a, b in zip(walk.modules(model), model.modules()))
    assert len(walk.modules(model)) == len(list(model.modules()))
