"""Loading a Llama checkpoint onto 4 CPU gloo ranks laid out as 2 "nodes" x 2, per mesh and per source.

Meshes: ``fsdp4`` (FSDP over all 4 ranks), ``hsdp2x2`` (accelerate's ``ParallelismConfig(dp_replicate_size=2,
dp_shard_size=2)``: replicate across the nodes, shard within one), ``fsdp2xtp2`` (``ParallelismConfig(
dp_shard_size=2, tp_size=2)``: the plugin applies the model's own TP plan on meta, then ``fully_shard``).

Sources: ``stock`` (every rank ``from_pretrained``, for ``fsdp2xtp2`` with ``tp_plan="auto"`` over the ``tp``
mesh as transformers documents it; ``prepare`` with ``MemSafePlugin(stages=[])`` and
``cpu_ram_efficient_loading=True``: accelerate's own path), ``rank0``, ``node`` and ``every_rank`` (the plugin's
``load_source``: rank 0 sends everything; each node's leader reads for its node; each rank reads its own
block from the file). The default configuration otherwise (``bucket_bytes``, ``prefetch_buckets``).

Per rank: peak RSS and RssAnon over the baseline (sampled every 2 ms), wall time of load + prepare, bytes
received and sent through ``broadcast``/``scatter`` (counted by wrapping them: a broadcast counts once per
receiving rank). The bound checked for every rank != 0 is issue 13's: its mesh share of P + T + 64 MiB.
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
SOURCES = ("stock", "rank0", "node", "every_rank")
WORLD, PER_NODE = 4, 2


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
    sizes = {"hsdp2x2": {"dp_replicate_size": 2, "dp_shard_size": 2}, "fsdp2xtp2": {"dp_shard_size": 2, "tp_size": 2}}
    extra = {"parallelism_config": ParallelismConfig(**sizes[mesh])} if mesh in sizes else {}
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
    return Accelerator(plugins=[plugin], fsdp_plugin=fsdp, **extra), plugin


def _run(rank: int, mesh: str, source: str, ckpt: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    torch.set_num_threads(1)
    acc, plugin = _accelerator(mesh, source)
    counter, base, t0 = baseline(rank)
    with _Sampler() as sampler:
        if source == "stock" and mesh == "fsdp2xtp2":  # transformers' TP load: each rank reads its TP part
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, tp_plan="auto",
                                                         device_mesh=acc.torch_device_mesh["tp"])
        elif source == "stock":
            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        else:
            model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, ckpt, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
        dist.barrier()
    wall = time.perf_counter() - t0
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    checksum = float(sum(p.full_tensor().double().sum() if isinstance(p, DTensor) else p.double().sum()
                         for p in model.parameters()))
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    chosen = next((r.details.get("load_source") for r in plugin.report.records
                   if r.stage == "rank0_distribute" and r.status == "ran"), None)
    dist.barrier()
    return {
        "rank": rank, "node": rank // PER_NODE, "load_source": chosen,
        "rss_peak_mib": (sampler.peak_rss - base.rss) / MIB, "anon_peak_mib": (sampler.peak_anon - base.anon) / MIB,
        "wall_s": wall, "received_mib": counter["bytes"] / MIB, "sent_mib": counter["sent"] / MIB,
        "local_mib": local / MIB, "checksum": checksum, "P_mib": sum(sizes) / MIB, "T_mib": max(sizes) / MIB,
    }


def _launch(mesh: str, source: str, ckpt: str, timeout: float) -> list[dict] | str:
    """Each rank's figures, or (stock accelerate failing on this mesh) the error's last line."""
    try:
        return spawn(_worker, WORLD, (mesh, source, ckpt), timeout, f"{mesh}/{source}")
    except RuntimeError as exc:
        if source != "stock":
            raise
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return next((ln.strip() for ln in reversed(lines) if "Error" in ln), lines[-1].strip())


def _markdown(doc: dict) -> str:
    lines = [
        f"\nmulti-node load, Llama `{doc['model_size']}` fp32 (P = {doc['P_mib']:.0f} MiB, T = {doc['T_mib']:.0f} MiB), "
        f"{WORLD} gloo ranks as 2 nodes x {PER_NODE} ({doc['timestamp']}):\n",
        "| mesh | source | rank | node | RssAnon peak (MiB) | RSS peak (MiB) | received (MiB) | sent (MiB) | local shard (MiB) | "
        "wall (s) | bound (MiB) | within |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in doc["runs"]:
        if "error" in run:
            lines.append(f"| {run['mesh']} | {run['source']} | all | - | fails: `{run['error'][:120]}` | | | | | | | |")
            continue
        for r in run["ranks"]:
            bound = r["local_mib"] + doc["T_mib"] + 64
            within = "-" if r["rank"] == 0 or run["source"] == "stock" else ("yes" if r["anon_peak_mib"] <= bound else "no")
            source = run["source"] if r.get("load_source") in (None, run["source"]) else f"{run['source']} ({r['load_source']})"
            lines.append(
                f"| {run['mesh']} | {source} | {r['rank']} | {r['node']} | {r['anon_peak_mib']:.0f} | {r['rss_peak_mib']:.0f} | "
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
            ranks = _launch(mesh, source, str(ckpt), args.timeout)
            if isinstance(ranks, str):
                doc["runs"].append({"mesh": mesh, "source": source, "error": ranks})
                continue
            checksums.add(round(ranks[0]["checksum"], 3))
            doc["runs"].append({"mesh": mesh, "source": source, "ranks": ranks})
    first = next(r for r in doc["runs"] if "ranks" in r)["ranks"][0]
    doc["P_mib"], doc["T_mib"] = first["P_mib"], first["T_mib"]
    doc["checksums_equal"] = len(checksums) == 1
    print(json.dumps(doc))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(_markdown(doc))
    return doc


if __name__ == "__main__":
    main()
