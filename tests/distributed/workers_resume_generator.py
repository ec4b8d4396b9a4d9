"""Workers for the exact resume of a ``StatefulDataLoader`` shuffling with an explicit generator on 2 gloo
ranks (FSDP2, SHARDED state dict). Module level so that spawn can pickle them."""

from __future__ import annotations

from typing import Any


def batches_around_a_resume(rank: int, world_size: int, *, ckpt: str, phase: str, stock: bool) -> list[list[int]]:
    """``phase="save"``: 3 steps, ``save_state``, then the rest of the epoch and the next one (the
    uninterrupted batches). ``phase="resume"``: ``load_state`` in a fresh process group, then two epochs."""
    import torch
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin
    from torchdata.stateful_dataloader import StatefulDataLoader

    from accelerate_memsafe import Accelerator, MemSafePlugin

    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    if stock:
        import accelerate

        acc: Any = accelerate.Accelerator(dataloader_config=config)
        MemSafePlugin(stages=["shard"]).attach(acc, fsdp_plugin=fsdp)  # FSDP2 on CPU only
    else:
        acc = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=fsdp, dataloader_config=config)
    data = torch.arange(40)
    dl = acc.prepare(StatefulDataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(9)))
    if phase == "save":
        it = iter(dl)
        for _ in range(3):
            next(it)
        acc.save_state(ckpt)
        return [b.tolist() for b in it] + [b.tolist() for b in dl]
    acc.load_state(ckpt)
    return [b.tolist() for b in dl] + [b.tolist() for b in dl]
