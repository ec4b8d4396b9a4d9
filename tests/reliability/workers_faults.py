"""Workers of the hung/dead-rank and non-finite tests: FSDP2 on 2 gloo ranks with the plugin, one rank
made to stall or die inside a chosen stage. Module level so that spawn can pickle them."""

from __future__ import annotations

import os
import time
from typing import Any

#: How much longer than the collective timeout a stalled rank sleeps before it exits.
STALL_EXTRA_S = 4.0


def _accelerator(timeout_s: float, **options: Any):
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_memsafe import Accelerator, MemSafePlugin

    plugin = MemSafePlugin(collective_timeout_s=timeout_s, progress=False, **options)
    return Accelerator(plugins=[plugin], fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))


def _fault(kind: str, timeout_s: float):
    def fault(*args: Any, **kwargs: Any) -> Any:
        if kind == "stall":
            time.sleep(timeout_s + STALL_EXTRA_S)
        os._exit(3)  # a dead rank: no exception, no cleanup
    return fault


def faulty_rank(rank: int, world_size: int, *, stage: str, kind: str, timeout_s: float, ckpt: str,
                faulty: int = 1) -> dict[str, Any]:
    """Rank ``faulty`` stalls (``kind="stall"``) or dies (``"exit"``) inside ``stage``; the other ranks report how
    their own call failed and how long it took from the start of the hook. Rank 0 hosts the process group's store
    (``MASTER_ADDR``/``MASTER_PORT``, as under a plain ``torch.distributed`` launch): ``faulty=0`` takes the store
    down with it."""
    import torch

    from accelerate_memsafe.models import build_llama

    acc = _accelerator(timeout_s)
    if rank == faulty:
        if stage == "rank0_distribute":
            import accelerate_memsafe.stages.rank0_distribute as mod

            mod.distribute_from_rank0 = _fault(kind, timeout_s)
        elif stage == "buffer_init":
            import accelerate_memsafe.stages.buffer_init as mod

            mod.init_non_persistent_buffers = _fault(kind, timeout_s)
        elif stage == "preflight":
            # the peers wait in the preflight's exchange, which runs through the store only (no collective)
            from accelerate_memsafe.pipeline import Pipeline

            Pipeline._preflight = _fault(kind, timeout_s)
        elif stage == "atomic_checkpoint":
            # rank 1 never reaches the stage's first synchronisation (rank 0 has begun the temp directory)
            from accelerate_memsafe.stages.atomic_checkpoint import AtomicCheckpointStage

            AtomicCheckpointStage.run = _fault(kind, timeout_s)
        else:
            raise ValueError(stage)
    model = build_llama("tiny", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    started = time.monotonic()
    try:
        model, opt = acc.prepare(model, opt)
        if stage == "atomic_checkpoint":
            started = time.monotonic()
            acc.save_state(ckpt)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - started,
                "is_memsafe": type(exc).__module__.startswith("accelerate_memsafe")}
    return {"error": None, "elapsed": time.monotonic() - started}


def nonfinite(rank: int, world_size: int, *, where: str, model_dir: str, timeout_s: float) -> dict[str, Any]:
    """``where="weight"``: the checkpoint has a NaN weight and ``check_finite_weights=True``;
    ``where="buffer"``: a non-persistent buffer without an init recipe is NaN on every rank."""
    import torch
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    acc = _accelerator(timeout_s, check_finite_weights=where == "weight")
    model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir, dtype=torch.float32)
    if where == "buffer":
        model.model.register_buffer("scale_table", torch.full((4,), float("nan")), persistent=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        acc.prepare(model, opt)
    except Exception as exc:
        on_meta = sum(p.device.type == "meta" for p in model.parameters())
        return {"error": type(exc).__name__, "message": str(exc), "params_on_meta": on_meta}
    return {"error": None}
