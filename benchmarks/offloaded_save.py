"""Saving a model dispatched on cpu + disk: the plugin's ``save_offloaded`` against the disk's limit (a plain
``safetensors.torch.save_file`` + ``fsync`` of exactly the same tensors in exactly the same shards), transformers'
``save_pretrained`` and accelerate's ``save_model``, same run, at each ``max_shard_size``.

A Llama (``--arch llama``, ``--size`` from ``accelerate_memsafe.models``) or a Qwen3-MoE of ~1 GB whose experts
transformers fuses on load (``--arch qwen3_moe``: its save splits every fused tensor back into per-expert
tensors) is saved once; each measured path then runs in a fresh subprocess that loads it with
``from_pretrained(device_map=..., offload_folder=...)`` (the first half of the layers on cpu, the rest on
disk), trims malloc, takes the baseline, and saves while RSS and RssAnon are sampled every 2 ms (VmHWM is read
as a cross-check). Figures are over that baseline. Paths:

- ``save_file`` and ``save_file_sync_end``: the limit. Before the baseline, the child reverts the conversions
  of the plugin's plan and copies every shard's tensors into memory; the timed part is ``save_file(shard,
  path, metadata={"format": "pt"})`` of each shard with an ``fsync`` of each file right after it is written
  (``save_file``) or of every file after the last one is written (``save_file_sync_end``; much faster on
  ext4, where an fsync stalls the writes that follow it), then ``fsync`` of the folder: the same bytes, the
  same files, the same durability as the plugin (which also fsyncs its marker and swaps a temporary folder
  into place).
- ``plugin``: ``save_offloaded`` with its defaults (``io_mode="buffered"``: through the page cache,
  ``copy_file_range`` from the files). Optional (``--paths``): ``plugin_direct`` (``io_mode="direct"``: whole
  blocks with ``O_DIRECT``, the previous default),
  ``plugin_memory`` (``io_mode="memory"``: every tensor written from memory, mapped pages dropped after each
  file) and ``plugin_pageout`` (``io_mode="memory", release_pages="pageout"``: the previous version's writes
  and synchronous paging out).
- ``transformers``: ``model.save_pretrained``; ``accelerate``: ``Accelerator(cpu=True).save_model``.

The machine is shared, so every path runs in ``--repeat`` fresh processes, the paths interleaved, each process
saving ``--rounds`` times (into an emptied folder: the first save of a fresh process on a machine whose memory is
full of page cache pays the reclaim of the pages it writes, which lands on whichever path came first); the wall is
the best of all saves, the memory figures the worst over the processes' first saves. The ratio (``vs_save_file``) is each path's best wall
over the best wall of either ``save_file`` variant.
Prints one JSON line; ``--markdown FILE`` appends a table.

    python benchmarks/offloaded_save.py --arch llama --size 1g --dtype bfloat16 --shard-sizes 100MB,500MB --repeat 5 --rounds 2
    python benchmarks/offloaded_save.py --arch qwen3_moe --dtype bfloat16 --shard-sizes 100MB,500MB --repeat 5 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from markdown_region import write_tables  # the sibling module (this script's folder is on sys.path)

PATHS = ("save_file", "save_file_sync_end", "plugin", "transformers", "accelerate")
LIMITS = ("save_file", "save_file_sync_end")
VARIANTS = {"plugin": {}, "plugin_direct": {"io_mode": "direct"}, "plugin_memory": {"io_mode": "memory"},
            "plugin_pageout": {"io_mode": "memory", "release_pages": "pageout"}}
MIB = 2**20


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _shards_in_memory(model, size: int) -> list[tuple[str, dict]]:
    """The plugin's shards with their reverted tensors copied into memory (what ``save_file`` is given)."""
    from accelerate_memsafe import _compat
    from accelerate_memsafe.io.offload_reader import OffloadedTensorReader
    from accelerate_memsafe.io.shard_plan import plan_offloaded_save, saveable_state_dict

    plan = plan_offloaded_save(model, size)
    reader = OffloadedTensorReader(model, saveable_state_dict(model))
    shards = []
    for shard in plan.shards:
        tensors = {}
        for group in shard.groups:
            loaded = {s.name: reader.read(s.name) for s in group.sources}
            tensors.update({k: v.contiguous().clone() for k, v in _compat.revert_conversions(model, loaded).items()})
        shards.append((shard.filename, tensors))
    return shards


def _child(path: str, src: Path, out: Path, shard: str, cpu_fraction: float, rounds: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accelerate_memsafe.io.offload_reader import cpu_disk_device_map
    from accelerate_memsafe.memory.probe import MemoryProbe
    from accelerate_memsafe.memory.procfs import malloc_trim, read_proc_memory, reset_peak_rss
    from accelerate_memsafe.sizes import parse_size

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    device_map = cpu_disk_device_map(skeleton, cpu_fraction)
    del skeleton
    model = AutoModelForCausalLM.from_pretrained(src, device_map=device_map, offload_folder=str(out.parent / "offload"))
    size = parse_size(shard)
    accelerator, shards = None, None
    if path == "accelerate":
        import accelerate

        accelerator = accelerate.Accelerator(cpu=True)
    elif path in LIMITS:
        shards = _shards_in_memory(model, size)
    row: dict = {"path": path, "max_shard_size": size, "devices": sorted(set(device_map.values())), "walls_s": []}
    for k in range(rounds):
        shutil.rmtree(out, ignore_errors=True)
        malloc_trim()
        reset_peak_rss()
        hwm0 = read_proc_memory()
        details = {}
        with MemoryProbe(track_tensors=False) as probe:
            if path == "transformers":
                model.save_pretrained(out, max_shard_size=size)
            elif path == "accelerate":
                accelerator.save_model(model, out, max_shard_size=size)
            elif path in LIMITS:
                from safetensors.torch import save_file

                out.mkdir(parents=True)
                for filename, tensors in shards:
                    save_file(tensors, str(out / filename), metadata={"format": "pt"})
                    if path == "save_file":
                        _fsync(out / filename)
                if path == "save_file_sync_end":  # the same fsyncs, all after the last write
                    for filename, _ in shards:
                        _fsync(out / filename)
                _fsync(out)
            else:
                from accelerate_memsafe import save_offloaded

                details = save_offloaded(model, out, max_shard_size=size, progress=False, **VARIANTS[path]).details()
        r = probe.result
        row["walls_s"].append(round(r.wall_s, 3))
        if k:
            continue  # memory: the first save of the process, what a user's save sees
        end = read_proc_memory()
        files = sorted(out.glob("*.safetensors"))
        row.update({
            "peak_rss_over_baseline_mib": round((r.cpu_rss_peak_bytes - r.cpu_rss_start_bytes) / MIB, 1),
            "peak_anon_over_baseline_mib": round((r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes) / MIB, 1),
            "vmhwm_over_baseline_mib": round((end.hwm - hwm0.rss) / MIB, 1) if end and hwm0 else None,
            "baseline_rss_mib": round(r.cpu_rss_start_bytes / MIB, 1),
            "baseline_anon_mib": round(r.cpu_anon_start_bytes / MIB, 1),
            "files": len(files),
            "largest_file_mib": round(max(f.stat().st_size for f in files) / MIB, 1),
            "written_mib": round(sum(f.stat().st_size for f in files) / MIB, 1),
            **{k: details[k] for k in ("from_files_bytes", "from_memory_bytes", "direct_io_bytes", "inflight_peak_bytes") if k in details},
        })
    return row


def _run_child(path: str, src: Path, work: Path, shard: str, cpu_fraction: float, rounds: int) -> dict:
    out = work / f"{path}-{shard}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, __file__, "--child", path, "--src", str(src), "--out", str(out / "model"),
           "--shard-sizes", shard, "--cpu-fraction", str(cpu_fraction), "--rounds", str(rounds)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), TQDM_DISABLE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} at {shard} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return result


def _anon_bound_mib(src: Path, shard_bytes: int) -> float:
    """The documented bound on the plugin's private memory: 2 x max(max_shard_size, largest group) + 64 MiB,
    a group counted with its inputs and outputs."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accelerate_memsafe.io.shard_plan import plan_offloaded_save

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    largest = max(g.memory_bytes for g in plan_offloaded_save(model, shard_bytes).groups)
    return round((2 * max(shard_bytes, largest) + 64 * MIB) / MIB, 1)


#: ``--arch qwen3_moe``: a Qwen3-MoE of ~1 GB in bf16 whose experts transformers fuses on load (its save
#: splits every fused tensor back into per-expert tensors: the reverse conversion runs for every layer).
QWEN3_MOE_1G = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=10, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=64, intermediate_size=2816, moe_intermediate_size=768,
                    num_experts=16, num_experts_per_tok=2, max_position_embeddings=256)


def _save_source(path: Path, arch: str, size: str, dtype) -> Path:
    if arch == "llama":
        from accelerate_memsafe.models import save_llama

        return save_llama(path, size, dtype=dtype)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **QWEN3_MOE_1G)).to(dtype)
    model.save_pretrained(path)
    return path


def _summarize(runs: list[dict], bound: float | None, limit_wall: float | None) -> dict:
    """Best wall over every save of every process, worst memory over the processes (first saves) of one path."""
    row = dict(runs[0])
    row["walls_s"] = [w for r in runs for w in r["walls_s"]]
    row["wall_s"] = min(row["walls_s"])
    for key in ("peak_rss_over_baseline_mib", "peak_anon_over_baseline_mib", "vmhwm_over_baseline_mib",
                "inflight_peak_bytes"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            row[key] = max(values)
    if bound is not None:
        row["anon_bound_mib"] = bound
        row["within_bound"] = row["peak_anon_over_baseline_mib"] <= bound
    if limit_wall:
        row["vs_save_file"] = round(row["wall_s"] / limit_wall, 2)
    return row


def _markdown(rows: list[dict], args: argparse.Namespace, model_mib: float) -> str:
    size = f" --size {args.size}" if args.arch == "llama" else ""
    region = f"offloaded-save-{args.arch.replace('_', '-')}" + (f"-{args.size}" if args.arch == "llama" and args.size != "1g" else "")
    lines = [
        "",
        f"<!-- table: {region} -->",
        f"### {args.arch}" + (f" {args.size}" if args.arch == "llama" and args.size != "1g" else ""),
        "",
        f"`python benchmarks/offloaded_save.py --arch {args.arch}{size} --dtype {args.dtype} --shard-sizes "
        f"{args.shard_sizes} --repeat {args.repeat} --rounds {args.rounds} --paths {args.paths}` ({model_mib:.0f} MiB "
        f"{args.dtype} {args.arch}, first {args.cpu_fraction:.0%} of the layers on cpu, the rest on disk; each path in "
        f"{args.repeat} fresh processes, interleaved, {args.rounds} saves each; wall: best of all saves, memory: worst "
        "first save, over the baseline taken after loading; CPU only, 2 shared cores).",
        "",
        "| max_shard_size | path | wall, best (s) | vs save_file | walls (s) | peak RSS over baseline (MiB) | "
        "peak RssAnon over baseline (MiB) | bound on RssAnon (MiB) | files | largest file (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        walls = ", ".join(f"{w:.2f}" for w in r["walls_s"])
        lines.append(
            f"| {r['max_shard_size'] / 1e6:.0f} MB | {r['path']} | {r['wall_s']:.2f} | {r.get('vs_save_file', '')} | "
            f"{walls} | {r['peak_rss_over_baseline_mib']} | {r['peak_anon_over_baseline_mib']} | "
            f"{r.get('anon_bound_mib', '')} | {r['files']} | {r['largest_file_mib']} |"
        )
    lines.append("<!-- /table -->")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen3_moe"))
    parser.add_argument("--size", default="1g", help="Llama size from accelerate_memsafe.models.SIZES")
    parser.add_argument("--shard-sizes", default="100MB,500MB")
    parser.add_argument("--dtype", default="bfloat16", help="weights dtype (bfloat16: the 1g model is ~1.2 GB)")
    parser.add_argument("--cpu-fraction", type=float, default=0.5)
    parser.add_argument("--paths", default=",".join(PATHS), help=f"of {PATHS + tuple(VARIANTS)[1:]}")
    parser.add_argument("--repeat", type=int, default=3, help="fresh-process runs per path (best wall, worst memory)")
    parser.add_argument("--rounds", type=int, default=2, help="timed saves per process (memory: the first)")
    parser.add_argument("--device", default="cpu", help="only cpu is measured (offloading targets cpu + disk)")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--src", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(_child(args.child, Path(args.src), Path(args.out), args.shard_sizes, args.cpu_fraction, args.rounds)))
        return

    from accelerate_memsafe.sizes import parse_size

    paths = args.paths.split(",")
    work = Path(tempfile.mkdtemp(prefix="memsafe-offloaded-save-"))
    try:
        t0 = time.perf_counter()
        import torch

        src = _save_source(work / "src", args.arch, args.size, getattr(torch, args.dtype))
        model_mib = sum(f.stat().st_size for f in src.glob("*.safetensors")) / MIB
        build_s = time.perf_counter() - t0
        rows, ratios = [], {}
        for shard in args.shard_sizes.split(","):
            bound = _anon_bound_mib(src, parse_size(shard))
            runs: dict[str, list[dict]] = {p: [] for p in paths}
            for i in range(args.repeat):
                for path in paths[i % len(paths):] + paths[: i % len(paths)]:  # a different first path each round
                    runs[path].append(_run_child(path, src, work, shard, args.cpu_fraction, args.rounds))
            limits = [w for p in LIMITS if p in runs for r in runs[p] for w in r["walls_s"]]
            limit = min(limits) if limits else None
            shard_rows = [_summarize(runs[p], bound if p in VARIANTS else None, limit) for p in paths]
            rows += shard_rows
            ratios[shard] = {r["path"]: r["vs_save_file"] for r in shard_rows if "vs_save_file" in r}
        result = {"benchmark": "offloaded_save", "arch": args.arch, "size": args.size if args.arch == "llama" else "1g",
                  "dtype": args.dtype, "model_mib": round(model_mib, 1), "device": args.device, "repeat": args.repeat,
                  "rounds": args.rounds,
                  "build_s": round(build_s, 1), "vs_save_file": ratios, "rows": rows}
        print(json.dumps(result))
        if args.markdown:
            existing = Path(args.markdown).read_text(encoding="utf-8") if Path(args.markdown).exists() else ""
            heading = "" if "## offloaded save" in existing else "\n## offloaded save\n"
            print(f"{args.markdown}: " + ", ".join(write_tables(args.markdown, heading + _markdown(rows, args, model_mib))),
                  file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
