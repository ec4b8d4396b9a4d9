"""``accelerate-memsafe estimate CHECKPOINT_DIR --num-processes N``: predicted peak memory per stage and
rank, stock path vs the plugin, from safetensors headers only (no tensor data is read)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("estimate", help="predict per-stage peak memory per rank, stock vs plugin, from headers only")
    p.add_argument("checkpoint", help="a directory with model.safetensors or model.safetensors.index.json")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--dtype", default="fp32", help="dtype the model is loaded in: fp32, bf16, fp16")
    p.add_argument("--mixed-precision", default="no", help="no, bf16, fp16 (fp32 master weights)")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--bucket-bytes", default="64MiB")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--budget-bytes", default=None, help="CPU memory of one node (default: detected MemAvailable)")
    p.add_argument("--load-source", default="auto", choices=("auto", "rank0", "node", "every_rank"),
                   help="the plugin's load_source (auto is predicted as every_rank: every rank sees the checkpoint)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import psutil

    from ..memory.estimate import node_totals, predict, summarize_checkpoint, to_dicts
    from ..sizes import parse_size

    summary = summarize_checkpoint(args.checkpoint)
    preds = predict(
        summary, num_processes=args.num_processes, dtype=args.dtype, mixed_precision=args.mixed_precision,
        offload_optimizer=args.offload_optimizer, bucket_bytes=parse_size(args.bucket_bytes, what="--bucket-bytes"),
        device=args.device, load_source=args.load_source,
    )
    budget = parse_size(args.budget_bytes, what="--budget-bytes") if args.budget_bytes else psutil.virtual_memory().available
    fits = {}
    for path in ("stock", "memsafe"):
        worst = max((cpu for cpu, _ in node_totals(preds, path).values()), default=0)
        fits[path] = {"node_peak_cpu_bytes": worst, "budget_bytes": budget, "fits": worst <= budget}
    if args.json:
        print(json.dumps({"checkpoint": summary.__dict__, "predictions": to_dicts(preds), "fits": fits}))
        return 0
    mib = 2**20
    print(f"checkpoint {summary.path}: {summary.num_tensors} tensors, {summary.numel:,} elements, "
          f"{summary.checkpoint_bytes / mib:,.1f} MiB on disk; largest `{summary.largest_name}`")
    print(f"{args.num_processes} processes, load dtype {args.dtype}, mixed precision {args.mixed_precision}, device {args.device}\n")
    print("| hook | stage | rank | path | CPU private MiB | CPU RSS MiB | device MiB |")
    print("|---|---|---|---|---|---|---|")
    for p in preds:
        print(f"| {p.hook} | {p.stage} | {p.rank} | {p.path} | {p.cpu_anon_bytes / mib:,.1f} | "
              f"{p.cpu_rss_bytes / mib:,.1f} | {p.device_bytes / mib:,.1f} |")
    print()
    for path, f in fits.items():
        verdict = "fits" if f["fits"] else "DOES NOT FIT"
        print(f"{path}: worst stage needs {f['node_peak_cpu_bytes'] / mib:,.1f} MiB of CPU memory on one node "
              f"(all ranks), budget {f['budget_bytes'] / mib:,.1f} MiB: {verdict}")
    return 0
