"""Activation checkpointing of transformers layers that write the KV cache (sliding-window attention).

accelerate's FSDP2 activation checkpointing replays a layer with its cache arguments; a layer that writes
the cache then sees twice the keys in backward. ``drop_cache_under_checkpointing`` applies transformers' own
rule (no cache in training under checkpointing): the gradients equal those of the model without
checkpointing, bit for bit, and evaluation still fills the cache.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

from accelerate_memsafe.distributed.sharding import drop_cache_under_checkpointing  # noqa: E402


def _mistral() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5)
    return transformers.MistralForCausalLM(config)


def _checkpointed(model: torch.nn.Module) -> torch.nn.Module:
    model = copy.deepcopy(model)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, GradientCheckpointingLayer))
    return model


def _grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.train()
    model(**batch).loss.backward()  # the model's defaults: use_cache=True, as a training loop calls it
    return [p.grad for p in model.parameters()]


BATCH = {"input_ids": torch.arange(4, 16).repeat(2, 1), "labels": torch.arange(4, 16).repeat(2, 1)}


def test_checkpointed_layers_without_the_hook_fail_in_backward():
    with pytest.raises(RuntimeError, match="must match the size"):
        _grads(_checkpointed(_mistral()), BATCH)


def test_hooked_layers_give_the_gradients_of_the_unwrapped_model():
    reference = _mistral()
    model = _checkpointed(reference)
    assert drop_cache_under_checkpointing(model) == 2
    for got, want in zip(_grads(model, BATCH), _grads(reference, BATCH), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_evaluation_keeps_the_cache():
    model = _checkpointed(_mistral())
    drop_cache_under_checkpointing(model)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=BATCH["input_ids"])
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 12


def test_a_call_without_gradients_in_training_mode_keeps_the_cache():
    # no backward replays the layer, so the cache stays (transformers' own rule since 5.24: generating in train mode)
    model = _checkpointed(_mistral())
    drop_cache_under_checkpointing(model)
    model.train()
    with torch.no_grad():
        out = model(input_ids=BATCH["input_ids"], use_cache=True)
    assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 12


def test_modules_that_are_not_transformers_layers_are_left_alone():
    model = torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(2, 2)))
    assert drop_cache_under_checkpointing(model) == 0
    assert not model[0]._forward_pre_hooks


def _gpt_neox_japanese() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPTNeoXJapaneseConfig(vocab_size=64, hidden_size=32, intermediate_multiple_size=2,
                                                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
                                                attention_dropout=0.0, hidden_dropout=0.0)
    return transformers.GPTNeoXJapaneseForCausalLM(config)


def test_a_transformers_layer_that_is_no_gradient_checkpointing_layer_is_hooked_too():
    # GPT-NeoX-Japanese's layers are plain modules (the model predates GradientCheckpointingLayer) and write the cache
    reference = _gpt_neox_japanese()
    layers = reference.gpt_neox_japanese.layers
    assert not isinstance(layers[0], GradientCheckpointingLayer)
    model = copy.deepcopy(reference)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, type(layers[0])))
    with pytest.raises(RuntimeError, match="must match the size"):
        _grads(copy.deepcopy(model), BATCH)
    assert drop_cache_under_checkpointing(model) == 2
    for got, want in zip(_grads(model, BATCH), _grads(reference, BATCH), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
