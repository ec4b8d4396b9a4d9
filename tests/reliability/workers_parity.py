"""Workers for the parity tests: the same FSDP2 training with the plugin and with stock accelerate."""

from __future__ import annotations

from typing import Any


def _batches(vocab: int, steps: int, world_size: int, rank: int, per_rank: int = 2, seq: int = 16):
    import torch

    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, vocab, (steps, per_rank * world_size, seq), generator=g)
    return [d[rank * per_rank:(rank + 1) * per_rank] for d in data]


def train(rank: int, world_size: int, *, model_dir: str, mode: str, steps: int, start: int = 0,
          save_at: int | None = None, ckpt: str | None = None, resume_from: str | None = None) -> dict[str, Any]:
    """Train steps [start, steps) and return the losses (mean over ranks).

    mode: "memsafe" (our Accelerator, default pipeline) or "stock" (accelerate.Accelerator forced onto CPU
    FSDP2 the way the plugin does it, then accelerate's own fsdp2 prepare).
    """
    import accelerate
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import Accelerator, MemSafePlugin, _compat

    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    if mode == "memsafe":
        accelerator = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=fsdp_plugin)
    else:
        accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=fsdp_plugin)
        _compat.promote_state_to_fsdp(fsdp_plugin)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    if resume_from:
        accelerator.load_state(resume_from)
    batches = _batches(model.config.vocab_size, steps, world_size, rank)
    losses = []
    for step in range(start, steps):
        x = batches[step]
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        if save_at is not None and step + 1 == save_at:
            accelerator.save_state(ckpt)
    return {"losses": losses, "fsdp2": accelerator.is_fsdp2}
