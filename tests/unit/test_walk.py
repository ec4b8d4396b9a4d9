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


@pytest.mark.parametrize("frozen", [False, True], ids=["walked", "frozen"])
@pytest.mark.parametrize("kind", ["shared_tree", "llama_tied", "t5", "checkpoint_wrapped"])
def test_the_walks_match_torchs(kind, frozen):
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
    with walk.frozen(model if frozen else None):
        _check_walks(model)


def _check_walks(model):
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


def _count_walks(monkeypatch) -> list:
    """Records each walk of a tree: ``remove_duplicate`` of a walk with paths, ``"modules"`` for one without."""
    calls: list = []
    real, real_modules = walk._walk, walk._modules
    monkeypatch.setattr(walk, "_walk", lambda m, remove_duplicate: calls.append(remove_duplicate) or real(m, remove_duplicate))
    monkeypatch.setattr(walk, "_modules", lambda m: calls.append("modules") or real_modules(m))
    return calls


def test_a_frozen_tree_is_walked_once_and_its_tensors_are_still_read_live(monkeypatch):
    model = _shared_tree()
    calls = _count_walks(monkeypatch)
    with walk.frozen(model):
        walk.named_modules(model)
        walk.named_parameters(model)
        walk.parameters(model)
        walk.named_modules(model, remove_duplicate=False)
        walk.modules(model)
        assert calls == [False], "the look's walks share one walk of the tree"
        assert walk.modules(model) == list(model.modules())
        new = nn.Parameter(torch.zeros(2, 4))
        model[0][2][2].weight = new  # a parameter replaced meanwhile is seen: only the tree is remembered
        assert any(p is new for p in walk.parameters(model))
        model.add_module("late", nn.Linear(2, 2))
        assert "late" not in [n for n, _ in walk.named_modules(model)], "the caller promised an unchanged tree"
        with walk.frozen(model):  # re-entrant: the inner one leaves the outer's walk in place
            pass
        assert "late" not in [n for n, _ in walk.named_modules(model)]
        walk.thaw(model)  # ended early (the pipeline, before its first stage)
        assert "late" in [n for n, _ in walk.named_modules(model)]
    assert "late" in [n for n, _ in walk.named_modules(model)]
    assert not walk._FROZEN
    other = _shared_tree()
    with walk.frozen(model):
        assert [m for _, m in walk.named_modules(other)] == list(other.modules()), "another model is walked as it is"


def test_the_prepare_pipeline_thaws_the_tree_before_its_first_stage(monkeypatch):
    # the look (announcements, estimates) shares one walk; a stage that changes the tree is seen by the next one
    from accelerate_memsafe.memory.report import MemoryReport
    from accelerate_memsafe.pipeline import HookContext, Pipeline, Stage, ran

    model = _shared_tree()
    calls = _count_walks(monkeypatch)
    seen = {}

    class Looks(Stage):
        name = "looks"
        hooks = ("prepare",)

        def announce(self, ctx):
            return len(walk.named_modules(ctx.model)) + len(walk.parameters(ctx.model))

        def run(self, ctx):
            ctx.model.add_module("wrapper", nn.Linear(2, 2))
            return ran()

    class After(Stage):
        name = "after"
        hooks = ("prepare",)

        def run(self, ctx):
            seen["names"] = [n for n, _ in walk.named_modules(ctx.model)]
            return ran()

    from accelerate_memsafe import MemSafePlugin

    ctx = HookContext(hook="prepare", rank=0, world_size=1, device=torch.device("cpu"), options=MemSafePlugin(stages=[]),
                      model=model)
    with walk.frozen(model):  # as the accelerator's prepare opens it around its own checks
        walk.modules(model)
        Pipeline({"prepare": (Looks(MemSafePlugin(stages=[])), After(MemSafePlugin(stages=[])))}, MemoryReport()).run(
            ctx, lambda c: None)
    assert "wrapper" in seen["names"]
    # the accelerator's checks walk without paths (as a one-process prepare only does), the announcement with them,
    # once, and its parameters come from the walks already made
    assert calls[:2] == ["modules", False], calls
    assert calls.count(False) == 1 and calls.count("modules") == 1, calls[:4]
    assert not walk._FROZEN


def test_a_frozen_tree_asked_for_its_modules_first_walks_without_paths_and_answers_as_torch(monkeypatch):
    model = _shared_tree()
    calls = _count_walks(monkeypatch)
    with walk.frozen(model):
        assert walk.modules(model) == list(model.modules())
        assert [p for p in walk.parameters(model)] == list(model.parameters())
        assert calls == ["modules"], "one walk without paths (a one-process prepare's only walk)"
        assert walk.named_modules(model, remove_duplicate=False) == list(model.named_modules(remove_duplicate=False))
        assert walk.modules(model) == list(model.modules())
    assert calls == ["modules", False]
