"""Workers for tests/distributed/test_mesh_shapes.py (module level so that spawn can pickle them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    """An attention-free transformer block: a column-parallel and a row-parallel projection."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)


class TpModel(nn.Module):
    """Odd sizes everywhere: uneven row and column blocks on a 2 x 2 mesh."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(67, 14)
        self.blocks = nn.ModuleList(Block(14, 37) for _ in range(2))
        self.head = nn.Linear(14, 67, bias=False)


def tp_distribute(rank: int, world_size: int, *, bucket_bytes: int) -> dict[str, Any]:
    """FSDP 2 x TP 2 from rank 0, with torch's own TP layout (``parallelize_module``: colwise ``up``,
    rowwise ``down``, so FSDP2 shards TP-sharded dim 0 as ``_StridedShard``): the non-zero ranks build on
    meta, ``rank0_distribute`` fills every rank's block. Returns the names whose full tensor differs from
    rank 0's model, the placements, and the bytes received."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from accelerate_memsafe.distributed.collectives import Collectives
    from accelerate_memsafe.distributed.meta import agree_on_structure, move_to_meta
    from accelerate_memsafe.distributed.scatter import distribute_from_rank0
    from accelerate_memsafe.distributed.source import Rank0Source

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    torch.manual_seed(0)
    reference = {k: v.clone() for k, v in TpModel().state_dict().items()}
    if rank == 0:
        torch.manual_seed(0)
        model = TpModel()
    else:
        with torch.device("meta"):
            model = TpModel()
    coll = Collectives("rank0_distribute", timeout_s=60)
    originals = move_to_meta(model, [], agree_on_structure(model, coll), keep=rank == 0)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    stats = distribute_from_rank0(model, Rank0Source(originals) if rank == 0 else None, coll=coll,
                                  bucket_bytes=bucket_bytes, prefetch_buckets=1, device=torch.device("cpu"))
    differs = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), reference[n])]
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return {"differs": differs, "placements": {n: str(p.placements) for n, p in model.named_parameters()},
            "bytes_received": stats.bytes_received, "local_bytes": local, "buckets": stats.buckets}


class Experts(nn.Module):
    """Fused MoE experts (experts x 2·intermediate x hidden) and a router: one expert row is larger than the
    per-rank bucket budget the tests use, so it is sent in dim-1 ranges."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(6, 50, 12))
        self.down_proj = nn.Parameter(torch.randn(6, 12, 25))
        self.router = nn.Linear(12, 6, bias=False)


def experts_distribute(rank: int, world_size: int, *, bucket_bytes: int, nodes: bool = False) -> dict[str, Any]:
    """FSDP over ``world_size`` ranks of :class:`Experts`, filled from rank 0 (``nodes``: through the ``node``
    transport, each rank its own node). Returns the names whose full tensor differs from rank 0's model and the
    distribution figures."""
    from torch.distributed.fsdp import fully_shard

    from accelerate_memsafe.distributed.collectives import Collectives
    from accelerate_memsafe.distributed.meta import agree_on_structure, move_to_meta
    from accelerate_memsafe.distributed.scatter import distribute_from_rank0
    from accelerate_memsafe.distributed.source import Rank0Source
    from accelerate_memsafe.distributed.topology import Nodes

    torch.manual_seed(0)
    reference = {k: v.clone() for k, v in Experts().state_dict().items()}
    if rank == 0:
        torch.manual_seed(0)
        model = Experts()
    else:
        with torch.device("meta"):
            model = Experts()
    coll = Collectives("rank0_distribute", timeout_s=60)
    originals = move_to_meta(model, [], agree_on_structure(model, coll), keep=rank == 0)
    fully_shard(model)
    layout = Nodes(tuple((r,) for r in range(world_size))) if nodes else None
    stats = distribute_from_rank0(model, Rank0Source(originals) if rank == 0 else None, coll=coll,
                                  bucket_bytes=bucket_bytes, prefetch_buckets=1, device=torch.device("cpu"), nodes=layout)
    differs = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), reference[n])]
    return {"differs": differs, "buckets": stats.buckets, "bucket_budget": stats.bucket_budget}


def prepare_refused_under_cp(rank: int, world_size: int, *, model_dir: str, stages: list[str] | None) -> dict[str, Any]:
    """``prepare`` of a checkpoint whose layers use sliding-window attention under ``ParallelismConfig(dp_shard_size=2,
    cp_size=2)``, with the plugin (``stages=None``; ``accelerate_memsafe.from_pretrained``: rank 0's weights, meta
    elsewhere) or stock's path (``stages=[]``; transformers' ``from_pretrained`` on every rank): the error, and whether
    anything moved (a parameter sharded) or changed (rank 0's weights, the meta weights filled)."""
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe
    from accelerate_memsafe import Accelerator, MemSafePlugin

    acc = Accelerator(plugins=[MemSafePlugin(**({} if stages is None else {"stages": stages}))],
                      fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True),
                      parallelism_config=ParallelismConfig(dp_shard_size=2, cp_size=2))
    if stages == []:  # what a script without the plugin loads: the weights on every rank
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    else:
        model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    metas = sorted(n for n, p in model.named_parameters() if p.is_meta)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out: dict[str, Any] = {"error": None}
    try:
        acc.prepare(model, optimizer)
    except Exception as exc:
        out["error"] = {"type": type(exc).__name__, "value_error": isinstance(exc, ValueError), "message": str(exc)}
    params = dict(model.named_parameters())
    out["sharded"] = any(isinstance(p, DTensor) for p in params.values())
    out["changed"] = [] if out["sharded"] else sorted(n for n, t in before.items() if not torch.equal(params[n].detach(), t))
    out["still_meta"] = sorted(n for n, p in params.items() if p.is_meta) == metas
    return out


def dtensor_chunks_against_the_protocol(rank: int, world_size: int) -> dict[str, Any]:
    """``_compat.dtensor_chunks`` of DTensors on a 2 x 2 mesh (uneven rows and columns, FSDP2's strided shard under TP)
    beside DCP's ``__create_chunk_list__``, each block checked against the full tensor; and whether computing them
    loaded ``torch.distributed.checkpoint`` (the protocol's import, which the helper avoids)."""
    import sys

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from accelerate_memsafe import _compat
    from accelerate_memsafe.io.blocks import local_block

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = {"shard0_shard1": ((7, 5), [Shard(0), Shard(1)]), "replicate_shard0": ((7, 5), [Replicate(), Shard(0)]),
             "shard1_replicate": ((7, 5), [Shard(1), Replicate()]),
             "strided0_shard0": ((8, 5), [_StridedShard(0, split_factor=2), Shard(0)])}  # torch splits these evenly only
    fulls = {name: torch.arange(r * c, dtype=torch.float32).reshape(r, c) for name, ((r, c), _) in cases.items()}
    loaded_before = "torch.distributed.checkpoint" in sys.modules
    tensors = {name: distribute_tensor(fulls[name], mesh, placements) for name, (_, placements) in cases.items()}
    ours = {name: _compat.dtensor_chunks(d) for name, d in tensors.items()}
    blocks = {name: local_block(d) for name, d in tensors.items()}
    loaded = "torch.distributed.checkpoint" in sys.modules
    protocol = {name: [(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in d.__create_chunk_list__()]
                for name, d in tensors.items()}
    matches = {}
    for name, d in tensors.items():
        (offsets, sizes), local = ours[name][0], d.to_local()
        window = fulls[name][tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]
        matches[name] = tuple(local.shape) == sizes and torch.equal(window, local)
    return {"ours": ours, "protocol": protocol, "blocks": blocks, "matches": matches,
            "dcp_loaded_before": loaded_before, "dcp_loaded_by_ours": loaded}
