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


def prepare_with_tiny_budget(rank: int, world_size: int, *, model_dir: str, shared_bytes: int | None = None,
                             rank0_bytes: int = 1024, load_source: str = "rank0") -> dict[str, Any]:
    """Rank 0 pretends to sit in a cgroup with ``rank0_bytes`` free (1 KiB: the tiny model needs a few hundred KiB);
    or (``shared_bytes``) both ranks share one cgroup with that much free. Where that is too little, every rank
    must refuse prepare before touching the model. Returns which stages' estimates the preflight asked for."""
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import Accelerator, MemoryBudgetError, MemSafePlugin
    from accelerate_memsafe import pipeline
    from accelerate_memsafe.memory.limits import CpuLimit

    real = pipeline.available_memory
    if shared_bytes is not None:
        limit = CpuLimit(shared_bytes, "cgroup memory.max of /sys/fs/cgroup/pod (test)", "node:pod")
        pipeline.available_memory = lambda device: (limit, None)
    elif rank == 0:
        limit = CpuLimit(rank0_bytes, "cgroup memory.max of /sys/fs/cgroup/rank0 (test)", "node:rank0")
        pipeline.available_memory = lambda device: (limit, None)
    estimates = []
    real_estimate = pipeline.Pipeline._preflight

    asked = []

    def spy(self, ctx):
        try:
            return real_estimate(self, ctx)
        finally:
            estimates.append(ctx.scratch.get("estimates", {}).get("rank0_distribute"))
            asked.append(sorted(ctx.scratch.get("estimates", {})))

    pipeline.Pipeline._preflight = spy
    accelerator = Accelerator(plugins=[MemSafePlugin(load_source=load_source)],
                              fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
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
        pipeline.Pipeline._preflight = real_estimate
    unchanged = message is not None and all(p.device.type != "meta" and torch.equal(before[n], p)
                                            for n, p in model.named_parameters())
    est = estimates[0] if estimates else None
    return {"message": message, "unchanged": unchanged, "cpu_estimate": est.cpu_bytes if est else None,
            "asked": asked[0] if asked else None}


def object_collectives(rank: int, world_size: int, *, sizes: list[int]) -> dict[str, Any]:
    """``all_gather_object`` and ``broadcast_object`` of objects whose pickled sizes straddle the first
    collective's buffer (each rank sends a different size), and how many collectives each took."""
    from accelerate_memsafe.distributed.collectives import Collectives

    coll = Collectives("test", timeout_s=60)
    out: dict[str, Any] = {"gathered": [], "broadcast": [], "ops": []}
    for n in sizes:
        before = coll._count
        mine = bytes([rank + 1]) * (n + 1000 * rank)  # different contents and sizes on every rank
        out["gathered"].append(coll.all_gather_object(mine, what="test gather"))
        out["broadcast"].append(coll.broadcast_object(mine if rank == 0 else None, src=0, what="test broadcast"))
        out["ops"].append(coll._count - before)
    return out


def late_peer_collective(rank: int, world_size: int, *, delay_s: float) -> dict[str, Any]:
    """An all-reduce that rank 1 joins ``delay_s`` late, with every call rank 0's wait makes on the gloo work
    recorded (a gloo work's ``wait`` must never time out: the process would abort at exit)."""
    import time

    import torch

    from accelerate_memsafe.distributed import collectives as C

    calls: list[tuple[str, float | None]] = []

    class Recorded:  # the gloo work, with the calls made on it recorded
        def __init__(self, work):
            self.work = work

        def wait(self, timeout=None):
            calls.append(("wait", None if timeout is None else timeout.total_seconds()))
            return self.work.wait() if timeout is None else self.work.wait(timeout=timeout)

        def is_completed(self):
            calls.append(("is_completed", None))
            return self.work.is_completed()

    coll = C.Collectives("test", timeout_s=60)
    if rank == 1:
        time.sleep(delay_s)
    t = torch.full((3,), float(rank + 1))
    coll.run("test all_reduce", lambda: Recorded(C.dist.all_reduce(t, group=coll.group, async_op=True)))
    after = torch.ones(2)
    coll.all_reduce(after, what="the next collective")  # the process group is still in step
    return {"value": t.tolist(), "after": after.tolist(), "calls": calls}


def exchanges_through_one_waiter(rank: int, world_size: int, *, rounds: int) -> dict[str, Any]:
    """``rounds`` point-to-point exchanges, two on the wire at a time, as the transport posts them: what arrived,
    and how many waiter threads the process ran (one per :class:`Collectives`, not one per exchange)."""
    import threading

    import torch

    from accelerate_memsafe.distributed.collectives import Collectives

    coll = Collectives("test", timeout_s=60)
    peer = 1 - rank
    got, on_wire = [], []
    for k in range(rounds):
        out, inn = torch.full((1000,), float(k * 10 + rank)), torch.empty(1000)
        on_wire.append((inn, coll.exchange_async([(peer, out)], [(peer, inn)], what=f"exchange {k}")))
        if len(on_wire) == 2:
            inn0, pending = on_wire.pop(0)
            coll.finish(pending)
            got.append(inn0.unique().tolist())
    for inn0, pending in on_wire:
        coll.finish(pending)
        got.append(inn0.unique().tolist())
    waiters = [t for t in threading.enumerate() if t.name == "memsafe-p2p-wait"]
    return {"got": got, "waiters": len(waiters)}


def announcements_in_one_exchange(rank: int, world_size: int, *, check: bool, later: int | None = None,
                                  through_store: bool = True) -> dict[str, Any]:
    """A pipeline whose stage announces ``rank * 10`` and estimates a small need: what the stage saw of every
    rank's announcement, and which exchanges the preflight made (one for both: through the store, or with
    ``through_store=False`` an all-gather, as beyond ``STORE_EXCHANGE_MAX_RANKS`` ranks). ``later``: a second
    stage whose estimate waits for the announcements and is needed where rank 1 announced ``later``."""
    import torch

    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.distributed import collectives
    from accelerate_memsafe.memory.report import MemoryReport
    from accelerate_memsafe.pipeline import ANNOUNCED_KEY, HookContext, MemoryEstimate, Pipeline, Stage, ran

    seen: dict[str, Any] = {}

    class Announcing(Stage):
        name, hooks = "announcing", ("save_state",)

        def announce(self, ctx):
            return {"value": ctx.rank * 10}

        def estimate(self, ctx):
            return MemoryEstimate(cpu_bytes=1 << 20, what="a small need")

        def run(self, ctx):
            seen["announced"] = ctx.scratch[ANNOUNCED_KEY]["announcing"]
            return ran()

    class Later(Stage):
        name, hooks = "later", ("save_state",)

        def needs_estimate(self, ctx):
            return ctx.scratch[ANNOUNCED_KEY]["announcing"][1]["value"] == later

        def estimate(self, ctx):
            return MemoryEstimate(cpu_bytes=(1 << 20) * (ctx.rank + 1), what="a need known after the exchange")

        def run(self, ctx):
            return ran()

    calls = []
    real = collectives.Collectives.all_gather
    real_exchange = collectives.HookScope.exchange

    def counting(self, tensor, *, what="all_gather"):
        calls.append(("all_gather", what))
        return real(self, tensor, what=what)

    def counting_exchange(self, obj, *, what, timeout_s):
        calls.append(("store", what))
        return real_exchange(self, obj, what=what, timeout_s=timeout_s)

    collectives.Collectives.all_gather = counting
    collectives.HookScope.exchange = counting_exchange
    if not through_store:
        collectives.STORE_EXCHANGE_MAX_RANKS = 1
    try:
        ctx = HookContext(hook="save_state", rank=rank, world_size=world_size, device=torch.device("cpu"),
                          options=MemSafePlugin(stages=["shard"], preflight_memory_check=check))
        stages = (Announcing(ctx.options),) + ((Later(ctx.options),) if later is not None else ())
        Pipeline({"save_state": stages}, MemoryReport()).run(ctx, lambda c: None)
    finally:
        collectives.Collectives.all_gather = real
        collectives.HookScope.exchange = real_exchange
    return {"announced": seen["announced"], "collectives": calls, "estimates": sorted(ctx.scratch.get("estimates", {})),
            "later_cpu": ctx.scratch.get("estimates", {}).get("later", MemoryEstimate()).cpu_bytes}


def ended_process_group(rank: int, world_size: int) -> dict:
    """One all-reduce, then :func:`end_process_group` twice (the second finds no group): whether a group is left."""
    import torch
    import torch.distributed as dist

    from accelerate_memsafe.distributed.collectives import end_process_group

    x = torch.ones(1)
    dist.all_reduce(x)
    end_process_group()
    end_process_group()
    return {"sum": float(x.item()), "initialized": dist.is_initialized()}
