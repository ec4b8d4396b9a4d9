"""The differential resume worker: the same training script with ``MemSafePlugin()`` and with
``MemSafePlugin(stages=[])`` (accelerate's own path), saved mid-epoch and resumed, in one spawn.

A cell is (distributed type, loader form, ``optimizer_offload``). For each cell the worker runs, each time
with a fresh ``Accelerator``, model, optimizer and dataloader after ``set_seed(0)`` (what a restarted
script does):

1. ``plugin`` and ``stock`` uninterrupted: train ``K`` steps, ``save_state``, train to the end; the losses
   after step ``K`` are the reference;
2. resumes: plugin from its own checkpoint, stock from its own, plugin from stock's, stock from the
   plugin's. A resume builds the model from another seed, calls ``load_state``, skips the batches of the
   epoch already seen (``skip_first_batches``; a stateful dataloader knows its position), and trains to
   the end.

Module level so that spawn can pickle it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

SEQ, SAMPLES, BATCH = 8, 24, 2
#: Steps before the save (mid-epoch: 6 steps per epoch on 2 ranks) and epochs in all.
K, EPOCHS = 4, 2
LOADERS = ("shuffle", "shuffle_gen", "random_sampler_gen", "stateful", "stateful_gen", "seedable")
DISTRIBUTED = ("ddp", "fsdp2_full", "fsdp2_sharded", "fsdp2_ignored", "fsdp2_compile", "single")
#: ``fsdp2_ignored``: FSDP2 (``SHARDED_STATE_DICT``) with ``ignored_modules`` naming a frozen module, which ``fully_shard``
#: leaves whole on every rank (frozen, as a module FSDP does not reduce must be for the ranks to stay equal), and a
#: frozen module FSDP shards; the optimizer holds the trainable parameters only.
IGNORED = r"model\.layers\.0\.mlp"
#: ``fsdp2_compile``: FSDP2 (``SHARDED_STATE_DICT``) with ``torch.compile`` (dynamo's ``eager`` backend), which accelerate
#: applies to the model the plugin's ``shard`` wrapped (stock compiles it first).


@dataclass(frozen=True)
class Cell:
    distributed: str
    loader: str
    offload: bool
    boundary: bool = False
    """Save at the end of the first epoch instead of at step ``K`` (mid-epoch)."""

    @property
    def world_size(self) -> int:
        return 1 if self.distributed == "single" else 2

    @property
    def id(self) -> str:
        return f"{self.distributed}-{self.loader}{'-offload' if self.offload else ''}{'-boundary' if self.boundary else ''}"


def _reset() -> None:
    import gc

    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    gc.collect()


def _setup(cell: Cell, *, stock: bool, seed: int):
    import torch
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin, set_seed
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from accelerate_memsafe import Accelerator, MemSafePlugin
    from accelerate_memsafe.models import build_llama

    set_seed(0)
    kwargs: dict[str, Any] = {}
    if cell.distributed.startswith("fsdp2"):
        sdt = "FULL_STATE_DICT" if cell.distributed == "fsdp2_full" else "SHARDED_STATE_DICT"
        ignored = {"ignored_modules": IGNORED} if cell.distributed == "fsdp2_ignored" else {}
        kwargs["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=sdt, **ignored)
    else:
        kwargs["cpu"] = True
    stateful = cell.loader.startswith("stateful")
    kwargs["dataloader_config"] = DataLoaderConfiguration(use_stateful_dataloader=stateful,
                                                          use_seedable_sampler=cell.loader == "seedable")
    plugin = MemSafePlugin(stages=[]) if stock else MemSafePlugin(optimizer_offload=cell.offload)
    if cell.distributed == "fsdp2_compile":
        kwargs["dynamo_backend"] = "eager"
    acc = Accelerator(plugins=[plugin], **kwargs)
    model = build_llama("tiny", seed=seed)  # a resume builds from another seed: load_state must overwrite it
    if cell.distributed == "fsdp2_ignored":  # and a frozen module FSDP shards
        model.get_submodule(IGNORED.replace("\\", "")).requires_grad_(False)
        model.get_submodule("model.layers.1.self_attn").requires_grad_(False)
    set_seed(0)  # the script's seed again: accelerate seeds a seedable sampler from torch.random.initial_seed()
    # with a frozen module, the optimizer over the trainable parameters only, as scripts build it
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    data = TensorDataset(torch.randint(0, 256, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1234)))
    if cell.loader == "shuffle_gen":  # the loader's generator is also the sampler's (base seed, then permutation)
        dl = DataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7))
    elif cell.loader == "random_sampler_gen":
        dl = DataLoader(data, batch_size=BATCH, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(5)))
    elif cell.loader == "stateful_gen":
        from torchdata.stateful_dataloader import StatefulDataLoader

        dl = StatefulDataLoader(data, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(9))
    else:  # "shuffle", "stateful" (accelerate makes it a StatefulDataLoader), "seedable"
        dl = DataLoader(data, batch_size=BATCH, shuffle=True)
    model, opt, dl = acc.prepare(model, opt, dl)
    return acc, model, opt, dl


def _step(acc, model, opt, ids) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _train(cell: Cell, *, stock: bool, save: str | None = None, load: str | None = None) -> list[float]:
    """Losses of the steps after the save (with ``load``: of a run resumed from it)."""
    acc, model, opt, dl = _setup(cell, stock=stock, seed=0 if load is None else 99)
    per_epoch = len(dl)
    k = per_epoch if cell.boundary else K
    first_epoch, skip = (k // per_epoch, k % per_epoch) if load else (0, 0)
    if load:
        acc.load_state(load)
    losses, step = [], first_epoch * per_epoch + skip
    stateful = cell.loader.startswith("stateful")
    for epoch in range(first_epoch, EPOCHS):
        if cell.loader == "seedable":
            dl.set_epoch(epoch)
        batches = acc.skip_first_batches(dl, skip) if (load and epoch == first_epoch and skip and not stateful) else dl
        for (ids,) in batches:
            loss = _step(acc, model, opt, ids)
            step += 1
            if step > k:
                losses.append(loss)
            if step == k and save:
                acc.save_state(save)  # the training goes on while rank 0 commits the checkpoint
    # the checkpoint is read in-process next (loads, file digests): wait for its commit, as the docs ask
    acc.wait_for_everyone()
    del acc, model, opt, dl
    _reset()
    return losses


def _digests(directory: str) -> dict[str, str]:
    """Every file of a checkpoint directory (relative path) and the SHA-256 of its bytes; for a DCP
    ``.metadata``, of its content without ``storage_meta`` (the directory and a random id of this save,
    which differ between any two saves)."""
    import hashlib
    import pickle

    out = {}
    for d, _, files in os.walk(directory):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                data = fh.read()
            if f == ".metadata":
                metadata = pickle.loads(data)
                metadata.storage_meta = None
                data = pickle.dumps(metadata)
            out[os.path.relpath(os.path.join(d, f), directory)] = hashlib.sha256(data).hexdigest()
    return dict(sorted(out.items()))


def run_cells(rank: int, world_size: int, *, cells: list[Cell], root: str) -> dict[str, dict[str, Any]]:
    """Runs each cell's six trainings; returns, per cell id, the losses of each and the checkpoint files
    (with the digests of their bytes)."""
    import warnings

    warnings.filterwarnings("ignore")
    out = {}
    for cell in cells:
        plugin_ckpt, stock_ckpt = os.path.join(root, cell.id, "plugin"), os.path.join(root, cell.id, "stock")
        result = {
            "plugin": _train(cell, stock=False, save=plugin_ckpt),
            "stock": _train(cell, stock=True, save=stock_ckpt),
            "plugin<-plugin": _train(cell, stock=False, load=plugin_ckpt),
            "stock<-stock": _train(cell, stock=True, load=stock_ckpt),
            "plugin<-stock": _train(cell, stock=False, load=stock_ckpt),
            "stock<-plugin": _train(cell, stock=True, load=plugin_ckpt),
        }
        result["files"] = {k: _digests(p) for k, p in (("plugin", plugin_ckpt), ("stock", stock_ckpt))}
        out[cell.id] = result
    return out
