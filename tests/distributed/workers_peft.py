"""Workers for tests/distributed/test_peft_fsdp2.py (module level so that spawn can pickle them)."""

from __future__ import annotations

import warnings
from typing import Any


def build_peft_model(seed: int):
    """Tiny Llama + two LoRA adapters with odd ranks (uneven shards) and ``modules_to_save``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = get_peft_model(
            build_llama("tiny", seed=seed),
            LoraConfig(r=3, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], init_lora_weights=False),
        )
        model.add_adapter("other", LoraConfig(r=5, target_modules=["k_proj"], init_lora_weights=False))
    return model


def reload_sharded_adapter(rank: int, world_size: int, *, ckpt: str) -> dict[str, Any]:
    """FSDP2-shard a differently initialised model, reload both adapters, return the local shards."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from accelerate_memsafe.integrations.peft import reload_adapters
    from accelerate_memsafe.memory.tracker import LiveTensorTracker

    model = build_peft_model(seed=100 + rank)  # different from the saved weights, and from the other rank
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    with LiveTensorTracker() as tracker:
        stats = reload_adapters(model, ckpt)
    out = {}
    for name, p in model.named_parameters():
        if ".lora_" in name or ".modules_to_save." in name:
            assert isinstance(p, DTensor), name
            out[name] = {"local": p.to_local().detach().clone(), "placements": [str(x) for x in p.placements]}
    return {
        "params": out,
        "peak": tracker.peak_bytes,
        "largest": max(s.largest_tensor_bytes for s in stats),
        "copied": sum(s.bytes for s in stats),
    }
