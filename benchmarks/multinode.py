"""Loading a Llama checkpoint onto 4 CPU gloo ranks laid out as 2 "nodes" x 2, per mesh and per source.

Meshes: ``fsdp4`` (FSDP over all 4 ranks), ``hsdp2x2`` (accelerate's ``ParallelismConfig(dp_replicate_size=2,
dp_shard_size=2)``: replicate across the nodes, shard within one), ``fsdp2xtp2`` (FSDP 2 x TP 2 with torch's
TP layout: colwise q/k/v/gate/up, rowwise o/down, applied by ``parallelize_module`` on meta, then
``fully_shard`` and ``distribute_from_rank0``: accelerate's own TP prepare cannot run with the installed
transformers, see docs/prepare.md).

Sources: ``stock`` (every rank ``from_pretrained``, ``prepare`` with ``MemSafePlugin(stages=[])`` and
``cpu_ram_efficient_loading=True``: accelerate's broadcast; not for ``fsdp2xtp2``), ``rank0`` (the plugin,
``load_source="rank0"``), ``every_rank`` (the plugin, ``load_source="every_rank"``: each rank reads its own
block from the file). The default configuration otherwise (``bucket_bytes``, ``prefetch_buckets``).

Per rank: peak RSS and RssAnon over the baseline (sampled every 2 ms), wall time of load + prepare, bytes
received through ``broadcast``/``scatter`` (counted by wrapping them) and, for rank 0, bytes sent (what the
others received). The bound checked for every rank != 0 is issue 13's: its mesh share of P + T + 64 MiB.
One JSON line; ``--markdown FILE`` appends a table.

    python benchmarks/multinode.py --model-size 1g --markdown /tmp/multinode.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from prepare import MIB, _checkpoint, _Sampler, baseline, parse_args, spawn

MESHES = ("fsdp4", "hsdp2x2", "fsdp2xtp2")
SOURCES = ("stock", "rank0", "every_rank")
WORLD, PER_NODE = 4, 2
TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
           "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def _worker(rank: int, port: int, mesh: str, source: str, ckpt: str, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank % PER_NODE), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(PER_NODE),
        GROUP_RANK=str(rank // PER_NODE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    try:
        queue.put((rank, "ok", _run(rank, mesh, source, ckpt)))
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _accelerator(mesh: str, source: str):
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

    from accelerate_memsafe import Accelerator, MemSafePlugin

    plugin = MemSafePlugin(stages=[], track_live_tensors=False) if source == "stock" else MemSafePlugin(
        load_source=source, track_live_tensors=False)
    extra = {"parallelism_config": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)} if mesh == "hsdp2x2" else {}
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
    return Accelerator(plugins=[plugin], fsdp_plugin=fsdp, **extra), plugin


def _tp_load(rank: int, source: str, ckpt: str, plugin):
    """The plugin's prepare stages by hand, with torch's TP layout between ``meta_placement`` and ``shard``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe
    from accelerate_memsafe.distributed.collectives import Collectives
    from accelerate_memsafe.distributed.local_read import agree_on_local_reads, close_unless
    from accelerate_memsafe.distributed.meta import agree_on_structure, checkpoint_source_names, move_to_meta
    from accelerate_memsafe.distributed.scatter import Rank0Source, distribute_from_rank0

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, ckpt, dtype=torch.float32)
    coll = Collectives("rank0_distribute", timeout_s=600)
    originals = move_to_meta(model, [], agree_on_structure(model, coll), keep=rank == 0)
    src = None
    if rank == 0:
        checkpoint, names = checkpoint_source_names(originals, getattr(model, "_memsafe_checkpoint", None))
        src = Rank0Source(originals, checkpoint, names)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], {k: styles[v]() for k, v in TP_PLAN.items()})
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    local, names, _ = (None, set(), None) if source == "rank0" else agree_on_local_reads(
        coll, src.checkpoint if src else None, src.from_checkpoint if src else set(), mode=source)
    distribute_from_rank0(model, src, coll=coll, bucket_bytes=plugin.bucket_bytes, prefetch_buckets=plugin.prefetch_buckets,
                          device=torch.device("cpu"), local_source=local, local_names=names)
    close_unless(local, src.checkpoint if src else None)
    return model


def _run(rank: int, mesh: str, source: str, ckpt: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    torch.set_num_threads(1)
    acc, plugin = _accelerator("fsdp4" if mesh == "fsdp2xtp2" else mesh, source)
    counter, base, t0 = baseline(rank)
    with _Sampler() as sampler:
        if mesh == "fsdp2xtp2":
            model = _tp_load(rank, source, ckpt, plugin)
        else:
            load = AutoModelForCausalLM.from_pretrained if source == "stock" else (
                lambda p, dtype: accelerate_memsafe.from_pretrained(AutoModelForCausalLM, p, dtype=dtype))
            model = load(ckpt, dtype=torch.float32)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            model, opt = acc.prepare(model, opt)
        dist.barrier()
    wall = time.perf_counter() - t0
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    checksum = float(sum(p.full_tensor().double().sum() if isinstance(p, DTensor) else p.double().sum()
                         for p in model.parameters()))
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    dist.barrier()
    return {
        "rank": rank, "node": rank // PER_NODE,
        "rss_peak_mib": (sampler.peak_rss - base.rss) / MIB, "anon_peak_mib": (sampler.peak_anon - base.anon) / MIB,
        "wall_s": wall, "received_mib": counter["bytes"] / MIB, "local_mib": local / MIB, "checksum": checksum,
        "P_mib": sum(sizes) / MIB, "T_mib": max(sizes) / MIB,
    }


def _launch(mesh: str, source: str, ckpt: str, timeout: float) -> list[dict]:
    runs = spawn(_worker, WORLD, (mesh, source, ckpt), timeout, f"{mesh}/{source}")
    runs[0]["sent_mib"] = sum(r["received_mib"] for r in runs[1:])  # rank 0 is the only sender
    return runs


def _markdown(doc: dict) -> str:
    lines = [
        f"\nmulti-node load, Llama `{doc['model_size']}` fp32 (P = {doc['P_mib']:.0f} MiB, T = {doc['T_mib']:.0f} MiB), "
        f"{WORLD} gloo ranks as 2 nodes x {PER_NODE} ({doc['timestamp']}):\n",
        "| mesh | source | rank | node | RssAnon peak (MiB) | RSS peak (MiB) | received (MiB) | sent (MiB) | local shard (MiB) | "
        "wall (s) | bound (MiB) | within |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in doc["runs"]:
        for r in run["ranks"]:
            bound = r["local_mib"] + doc["T_mib"] + 64
            within = "-" if r["rank"] == 0 or run["source"] == "stock" else ("yes" if r["anon_peak_mib"] <= bound else "no")
            lines.append(
                f"| {run['mesh']} | {run['source']} | {r['rank']} | {r['node']} | {r['anon_peak_mib']:.0f} | {r['rss_peak_mib']:.0f} | "
                f"{r['received_mib']:.0f} | {r.get('sent_mib', 0):.0f} | {r['local_mib']:.0f} | {r['wall_s']:.2f} | "
                f"{bound:.0f} | {within} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default=",".join(MESHES))
    parser.add_argument("--sources", default=",".join(SOURCES))
    args = parse_args(parser, argv, timeout=900)
    cache = Path(args.cache_dir or os.path.join(tempfile.gettempdir(), "memsafe-bench-prepare"))
    cache.mkdir(parents=True, exist_ok=True)
    ckpt = _checkpoint(cache, args.model_size, "fp32")
    doc: dict = {
        "benchmark": "multinode", "model_size": args.model_size, "world_size": WORLD, "per_node": PER_NODE,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python benchmarks/multinode.py " + " ".join(argv if argv is not None else sys.argv[1:]), "runs": [],
    }
    checksums = set()
    for mesh in [m for m in args.meshes.split(",") if m]:
        for source in [s for s in args.sources.split(",") if s]:
            if mesh == "fsdp2xtp2" and source == "stock":
                continue
            ranks = _launch(mesh, source, str(ckpt), args.timeout)
            checksums.add(round(ranks[0]["checksum"], 3))
            doc["runs"].append({"mesh": mesh, "source": source, "ranks": ranks})
    first = doc["runs"][0]["ranks"][0]
    doc["P_mib"], doc["T_mib"] = first["P_mib"], first["T_mib"]
    doc["checksums_equal"] = len(checksums) == 1
    print(json.dumps(doc))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(_markdown(doc))
    return doc


if __name__ == "__main__":
    main()
