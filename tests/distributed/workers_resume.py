"""Workers for the exact-resume tests: FSDP2 on 2 gloo ranks, a StatefulDataLoader, save at step k,
resume in a fresh process group. Module level so that spawn can pickle them."""

from __future__ import annotations

from typing import Any

SEQ, SAMPLES, BATCH = 8, 48, 2


def _setup(*, sdt: str, offload: bool, shuffle: bool, stock: bool, seed: int = 0):
    import torch
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_memsafe import Accelerator, MemSafePlugin
    from accelerate_memsafe.models import build_llama

    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=sdt)
    config = DataLoaderConfiguration(use_stateful_dataloader=True)
    if stock:
        import accelerate

        acc = accelerate.Accelerator(dataloader_config=config)
        MemSafePlugin(stages=["shard"]).attach(acc, fsdp_plugin=fsdp_plugin)  # FSDP2 on CPU only
    else:
        acc = Accelerator(plugins=[MemSafePlugin(optimizer_offload=offload, track_live_tensors=True)], fsdp_plugin=fsdp_plugin,
                          dataloader_config=config)
    model = build_llama("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.randint(0, 256, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(1234))
    dl = DataLoader(TensorDataset(data), batch_size=BATCH, shuffle=shuffle)
    model, opt = acc.prepare(model, opt)
    dl = acc.prepare(dl)
    return acc, model, opt, dl


def _train(acc, model, opt, it, n):
    import torch

    losses, batches = [], []
    for _ in range(n):
        (ids,) = next(it)
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
        batches.append(ids.clone())
    return torch.stack(losses), batches


def _state_tensors(optimizer) -> dict:
    return {(i, k): v for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
            for k, v in optimizer.state.get(p, {}).items() if hasattr(v, "shape")}


def _state_pointers(optimizer) -> dict:
    return {(i, k): (v.to_local() if hasattr(v, "to_local") else v).data_ptr()
            for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])
            for k, v in optimizer.state.get(p, {}).items()}


def reference_run(rank: int, world_size: int, *, outs: dict[str, str], offload: bool, shuffle: bool, k: int,
                  m: int, stock: bool = False) -> dict[str, Any]:
    """Trains k steps, saves (once per state-dict type in ``outs``), trains m more: the uninterrupted
    losses of steps k+1..k+m."""
    types = list(outs)
    acc, model, opt, dl = _setup(sdt=types[0], offload=offload, shuffle=shuffle, stock=stock)
    it = iter(dl)
    _train(acc, model, opt, it, k)
    for sdt, out in outs.items():
        acc.state.fsdp_plugin.set_state_dict_type(sdt)
        acc.save_state(out)
    losses, batches = _train(acc, model, opt, it, m)
    state_on_cpu = all(
        (v.to_local() if hasattr(v, "to_local") else v).device.type == "cpu"
        for st in opt.optimizer.state.values() for v in st.values()
    )
    return {"losses": losses, "batches": batches, "state_on_cpu": state_on_cpu}


def _inside_barrier() -> bool:
    """Whether the caller runs inside ``torch.distributed.barrier`` (accelerate's ``wait_for_everyone``)."""
    import sys

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "barrier" and frame.f_code.co_filename.endswith("distributed_c10d.py"):
            return True
        frame = frame.f_back
    return False


def resumed_run(rank: int, world_size: int, *, out: str, sdt: str, offload: bool, shuffle: bool, m: int,
                stock: bool = False, pre_step: bool = False, expect_refusal: bool = False) -> dict[str, Any]:
    """Fresh process group: load the checkpoint (into an optimizer that already has state when
    ``pre_step``), train m steps."""
    import torch

    acc, model, opt, dl = _setup(sdt=sdt, offload=offload, shuffle=shuffle, stock=stock, seed=99)
    if pre_step:
        ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(7 + rank))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    ptrs_before = _state_pointers(opt.optimizer)
    if expect_refusal:
        from accelerate_memsafe import CheckpointError

        params = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
        state = {k: (v.to_local() if hasattr(v, "to_local") else v).clone()
                 for k, v in _state_tensors(opt.optimizer).items()}
        try:
            acc.load_state(out)
        except CheckpointError as exc:
            unchanged = all(torch.equal((p.to_local() if hasattr(p, "to_local") else p), params[n])
                            for n, p in model.named_parameters())
            now = _state_tensors(opt.optimizer)
            unchanged = unchanged and now.keys() == state.keys() and all(
                torch.equal((v.to_local() if hasattr(v, "to_local") else v), state[k]) for k, v in now.items())
            return {"refused": str(exc), "unchanged": unchanged}
        return {"refused": None}
    import gc
    import weakref

    from accelerate_memsafe.memory.tracker import LiveTensorTracker

    refs = []

    def loaded(name, t):
        # torch 2.11's gloo barrier keeps every barrier's 1-byte tensor alive (with or without the plugin): not loaded
        # state; torch 2.13's frees it
        if not _inside_barrier():
            refs.append(weakref.ref(t))

    with LiveTensorTracker(on_alloc=loaded):
        acc.load_state(out)
    gc.collect()
    allowed = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in model.parameters()}
    allowed |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    allowed |= {(v.to_local() if hasattr(v, "to_local") else v).untyped_storage().data_ptr()
                for v in _state_tensors(opt.optimizer).values()}
    leftovers = [tuple(t.shape) for r in refs if (t := r()) is not None and t.untyped_storage().data_ptr() not in allowed]
    ptrs_after = _state_pointers(opt.optimizer)
    state_on_cpu = all(
        (v.to_local() if hasattr(v, "to_local") else v).device.type == "cpu"
        for st in opt.optimizer.state.values() for v in st.values()
    )
    losses, batches = _train(acc, model, opt, iter(dl), m)
    records = [vars(r) for r in acc.memsafe_plugin.report.find()]
    return {"losses": losses, "batches": batches, "state_on_cpu": state_on_cpu,
            "in_place": bool(ptrs_before) and ptrs_before == ptrs_after, "leftovers": leftovers,
            "records": [{"stage": r["stage"], "status": r["status"], "details": r.get("details", {}), "reason": r.get("reason"), "hook": r.get("hook"),
                         "live": r.get("live_tensor_peak_bytes")} for r in records]}


def adagrad_run(rank: int, world_size: int, *, out: str) -> dict[str, Any]:
    """FSDP2 (SHARDED) with ``torch.optim.Adagrad``, which builds its state when constructed, before ``prepare``: the
    stock path trains 2 steps and saves; the plugin trains 2 steps, saves, trains 2 more; then a fresh model and
    Adagrad are prepared, load the plugin's checkpoint and train 2 steps."""
    import os

    import torch
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin, set_seed

    from accelerate_memsafe import Accelerator, MemSafePlugin
    from accelerate_memsafe.models import build_llama

    ids = torch.arange(16).reshape(2, 8) % 50

    def run(stock: bool, *, seed: int, save: str | None = None, load: str | None = None, steps: int = 2):
        set_seed(0)
        acc = Accelerator(plugins=[MemSafePlugin(stages=[] if stock else None)],
                          fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT"))
        model = build_llama("tiny", seed=seed)
        opt = torch.optim.Adagrad(model.parameters(), lr=1e-2)
        losses: list[float] = []
        res: dict[str, Any] = {"state_before_prepare": len(opt.state), "losses": losses}
        try:
            model, opt = acc.prepare(model, opt)
            if load:
                acc.load_state(load)
            for i in range(steps):
                loss = model(input_ids=ids, labels=ids).loss
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
                if save and i == 1:
                    acc.save_state(save)
            acc.wait_for_everyone()
            res["error"] = None
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}"
        res["stale_state"] = sum(1 for p in opt.state if not hasattr(p, "full_tensor"))  # state of unsharded parameters
        del acc, model, opt
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        return res

    return {
        "stock": run(True, seed=0, save=os.path.join(out, "stock")),
        "plugin": run(False, seed=0, save=os.path.join(out, "plugin"), steps=4),
        "resumed": run(False, seed=7, load=os.path.join(out, "plugin")),
    }
