"""Workers run by tests/distributed on 2 gloo ranks (module level so that spawn can pickle them)."""

from __future__ import annotations

from typing import Any


def prepare_tiny_llama(rank: int, world_size: int, *, model_dir: str, attach: bool = False, stages=None) -> dict[str, Any]:
    """Prepare a tiny Llama with the plugin (subclass or attach) and describe the result."""
    import accelerate
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor, Shard
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import Accelerator, MemSafePlugin

    plugin = MemSafePlugin(stages=stages)
    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    if attach:
        accelerator = accelerate.Accelerator()
        plugin.attach(accelerator, fsdp_plugin=fsdp_plugin)
    else:
        accelerator = Accelerator(plugins=[plugin], fsdp_plugin=fsdp_plugin)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    params = {}
    for name, p in model.named_parameters():
        params[name] = {
            "dtensor": isinstance(p, DTensor),
            "placements": [str(x) for x in p.placements] if isinstance(p, DTensor) else None,
            "local": (p.to_local() if isinstance(p, DTensor) else p).detach().clone(),
            "shard0": isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),),
        }
    opt_params_are_model_params = all(
        any(q is p for p in model.parameters()) for g in opt.param_groups for q in g["params"]
    )
    report = plugin.report.gather()
    return {
        "class": type(accelerator).__name__,
        "distributed_type": str(accelerator.distributed_type),
        "is_fsdp2": accelerator.is_fsdp2,
        "params": params,
        "opt_params_are_model_params": opt_params_are_model_params,
        "report": report.to_dict(timeline=False),
        "markdown": report.to_markdown(),
    }
