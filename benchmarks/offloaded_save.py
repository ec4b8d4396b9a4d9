"""Saving a model dispatched on cpu + disk: transformers' ``save_pretrained`` vs accelerate's ``save_model``
vs the plugin's ``save_offloaded``, same run, at two ``max_shard_size`` values.

A ~1.2 GB Llama (bf16) is saved once; each measured path then runs in a fresh subprocess that loads it with
``from_pretrained(device_map=..., offload_folder=...)`` (the first half of the layers on cpu, the rest on
disk), trims malloc, takes the baseline, and saves while RSS and RssAnon are sampled every 2 ms (VmHWM is
read as a cross-check). Figures are over that baseline. Prints one JSON line; ``--markdown FILE`` appends
a table.

    python benchmarks/offloaded_save.py --size 1g --dtype bfloat16 --shard-sizes 100MB,500MB --markdown docs/benchmarks.md
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

PATHS = ("transformers", "accelerate", "plugin")
MIB = 2**20


def _child(path: str, src: Path, out: Path, shard: str, cpu_fraction: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe.io.offload_reader import cpu_disk_device_map
    from accelerate_memsafe.memory.probe import MemoryProbe
    from accelerate_memsafe.memory.procfs import malloc_trim, read_proc_memory, reset_peak_rss
    from accelerate_memsafe.sizes import parse_size

    with torch.device("meta"):
        from transformers import AutoConfig

        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    device_map = cpu_disk_device_map(skeleton, cpu_fraction)
    del skeleton
    model = AutoModelForCausalLM.from_pretrained(src, device_map=device_map, offload_folder=str(out.parent / "offload"))
    devices = sorted(set(device_map.values()))
    malloc_trim()
    accelerator = None
    if path == "accelerate":
        import accelerate

        accelerator = accelerate.Accelerator(cpu=True)
    malloc_trim()
    reset_peak_rss()
    hwm0 = read_proc_memory()
    size = parse_size(shard)
    with MemoryProbe(track_tensors=False) as probe:
        if path == "transformers":
            model.save_pretrained(out, max_shard_size=size)
        elif path == "accelerate":
            accelerator.save_model(model, out, max_shard_size=size)
        else:
            from accelerate_memsafe import save_offloaded

            save_offloaded(model, out, max_shard_size=size, progress=False)
    r = probe.result
    end = read_proc_memory()
    files = sorted(out.glob("*.safetensors"))
    return {
        "path": path,
        "max_shard_size": size,
        "devices": devices,
        "wall_s": round(r.wall_s, 2),
        "peak_rss_over_baseline_mib": round((r.cpu_rss_peak_bytes - r.cpu_rss_start_bytes) / MIB, 1),
        "peak_anon_over_baseline_mib": round((r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes) / MIB, 1),
        "vmhwm_over_baseline_mib": round((end.hwm - hwm0.rss) / MIB, 1) if end and hwm0 else None,
        "baseline_rss_mib": round(r.cpu_rss_start_bytes / MIB, 1),
        "baseline_anon_mib": round(r.cpu_anon_start_bytes / MIB, 1),
        "files": len(files),
        "largest_file_mib": round(max(f.stat().st_size for f in files) / MIB, 1),
        "written_mib": round(sum(f.stat().st_size for f in files) / MIB, 1),
    }


def _run_child(path: str, src: Path, work: Path, shard: str, cpu_fraction: float) -> dict:
    out = work / f"{path}-{shard}"
    cmd = [sys.executable, __file__, "--child", path, "--src", str(src), "--out", str(out / "model"),
           "--shard-sizes", shard, "--cpu-fraction", str(cpu_fraction)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), TQDM_DISABLE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{path} at {shard} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shutil.rmtree(out, ignore_errors=True)
    return result


def _group_bound_mib(src: Path, shard_bytes: int) -> float:
    """The issue's bound on the plugin's private memory: max(max_shard_size, largest group) x 2 + 64 MiB."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accelerate_memsafe.io.shard_plan import plan_offloaded_save

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    largest = plan_offloaded_save(model, shard_bytes).largest_group_bytes
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


def _markdown(rows: list[dict], args: argparse.Namespace, model_mib: float) -> str:
    lines = [
        "",
        f"### {args.arch}",
        "",
        f"`python benchmarks/offloaded_save.py --arch {args.arch} --size {args.size} --dtype {args.dtype} "
        f"--shard-sizes {args.shard_sizes}` ({model_mib:.0f} MiB {args.dtype} {args.arch}, first {args.cpu_fraction:.0%} of the layers on cpu, the rest on disk; "
        "each path in a fresh process; figures over the baseline taken after loading; CPU only, 2 cores).",
        "",
        "| max_shard_size | path | peak RSS over baseline (MiB) | peak RssAnon over baseline (MiB) | bound on RssAnon (MiB) | wall (s) | files | largest file (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        bound = r.get("anon_bound_mib", "") if r["path"] == "plugin" else ""
        lines.append(
            f"| {r['max_shard_size'] / 1e6:.0f} MB | {r['path']} | {r['peak_rss_over_baseline_mib']} | "
            f"{r['peak_anon_over_baseline_mib']} | {bound} | {r['wall_s']} | {r['files']} | {r['largest_file_mib']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen3_moe"))
    parser.add_argument("--size", default="1g", help="Llama size from accelerate_memsafe.models.SIZES")
    parser.add_argument("--shard-sizes", default="100MB,500MB")
    parser.add_argument("--dtype", default="bfloat16", help="weights dtype (bfloat16: the 1g model is ~1.2 GB)")
    parser.add_argument("--cpu-fraction", type=float, default=0.5)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--device", default="cpu", help="only cpu is measured (offloading targets cpu + disk)")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--src", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        print(json.dumps(_child(args.child, Path(args.src), Path(args.out), args.shard_sizes, args.cpu_fraction)))
        return

    from accelerate_memsafe.sizes import parse_size

    work = Path(tempfile.mkdtemp(prefix="memsafe-offloaded-save-"))
    try:
        t0 = time.perf_counter()
        import torch

        src = _save_source(work / "src", args.arch, args.size, getattr(torch, args.dtype))
        model_mib = sum(f.stat().st_size for f in src.glob("*.safetensors")) / MIB
        build_s = time.perf_counter() - t0
        rows = []
        for shard in args.shard_sizes.split(","):
            bound = _group_bound_mib(src, parse_size(shard))
            for path in args.paths.split(","):
                row = _run_child(path, src, work, shard, args.cpu_fraction)
                if path == "plugin":
                    row["anon_bound_mib"] = bound
                    row["within_bound"] = row["peak_anon_over_baseline_mib"] <= bound
                rows.append(row)
        result = {"benchmark": "offloaded_save", "arch": args.arch, "size": args.size, "model_mib": round(model_mib, 1),
                  "device": args.device, "build_s": round(build_s, 1), "rows": rows}
        print(json.dumps(result))
        if args.markdown:
            existing = Path(args.markdown).read_text(encoding="utf-8") if Path(args.markdown).exists() else ""
            with open(args.markdown, "a", encoding="utf-8") as f:
                if "## offloaded save" not in existing:
                    f.write("\n## offloaded save\n")
                f.write(_markdown(rows, args, model_mib))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
