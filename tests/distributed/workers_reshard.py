"""Workers for resuming FSDP2 checkpoints on another world size (module level so that spawn can pickle them).

``save`` trains two steps on N ranks and saves; ``load`` builds a fresh model on M ranks, loads, and returns
the full (unsharded) model and optimizer state plus the random state, to be compared bitwise with what
``save`` had. ``stock`` selects accelerate's own path (``MemSafePlugin(stages=[])``).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

SEQ, BATCH = 8, 2


def _setup(*, sdt: str, offload: bool, stock: bool, seed: int):
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_memsafe import Accelerator, MemSafePlugin
    from accelerate_memsafe.models import build_llama

    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=sdt)
    plugin = MemSafePlugin(stages=[]) if stock else MemSafePlugin(optimizer_offload=offload)
    acc = Accelerator(plugins=[plugin], fsdp_plugin=fsdp_plugin)
    model = build_llama("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _full_state(model, opt) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {"model": get_model_state_dict(model, options=options),
             "optimizer": get_optimizer_state_dict(model, opt.optimizer, options=options)}
    return copy.deepcopy(state)  # on CPU the full state may share storage with the live one


def save(rank: int, world_size: int, *, out: str, sdt: str, offload: bool) -> dict[str, Any]:
    import torch

    acc, model, opt = _setup(sdt=sdt, offload=offload, stock=False, seed=0)
    for step in range(2):
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    torch.manual_seed(500 + rank)
    rng = torch.get_rng_state()
    acc.save_state(out)
    full = _full_state(model, opt)
    return {"rng": rng, **(full if rank == 0 else {})}


def load(rank: int, world_size: int, *, out: str, sdt: str, offload: bool, stock: bool = False) -> dict[str, Any]:
    import torch

    acc, model, opt = _setup(sdt=sdt, offload=offload, stock=stock, seed=99)
    torch.manual_seed(900 + rank)
    before = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc.load_state(out)
    rng = torch.get_rng_state()
    full = _full_state(model, opt)
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()  # the loaded state trains
    return {"rng": rng, "rng_before": before, "warnings": [str(w.message) for w in caught],
            **(full if rank == 0 else {})}
