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


def prepare_with_tiny_budget(rank: int, world_size: int, *, model_dir: str) -> dict[str, Any]:
    """Rank 0 pretends to have 1 KiB free (the tiny model needs a few hundred KiB): every rank must refuse prepare before touching the model."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import Accelerator, MemoryBudgetError, MemSafePlugin
    from accelerate_memsafe import pipeline

    real = pipeline.available_memory
    if rank == 0:
        pipeline.available_memory = lambda device: (1024, None)
    accelerator = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        accelerator.prepare(model, opt)
        message = None
    except MemoryBudgetError as exc:
        message = str(exc)
    finally:
        pipeline.available_memory = real
    unchanged = all(p.device.type != "meta" and torch.equal(before[n], p) for n, p in model.named_parameters())
    return {"message": message, "unchanged": unchanged}
