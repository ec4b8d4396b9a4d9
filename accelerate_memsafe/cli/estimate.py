"""``accelerate-memsafe estimate CHECKPOINT_DIR [--num-processes N]``: predicted peak memory per stage and
rank, stock path vs the plugin, from safetensors headers only (no tensor data is read).

The number of processes comes from ``--num-processes``, else from the launch configuration (``--config_file``
of ``accelerate launch``, its ``num_processes``), else from ``WORLD_SIZE`` (inside a launched job), else
from accelerate's default config file. The mesh (``--dp-replicate-size``, ``--tp-size``) comes from the flags, else
from the same place as the process count (the config file's ``parallelism_config``, or the
``PARALLELISM_CONFIG_*`` variables of ``accelerate launch --use_parallelism_config``), else none. Exit code 1 when
the plugin's worst stage does not fit the budget, so a job script can gate on it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .errors import CHECK_FAILED, CliError

MIXED_PRECISION = ("no", "bf16", "fp16")
DEVICES = ("cpu", "cuda")


def add_parser(sub) -> None:
    from ..memory.estimate import DTYPE_BYTES

    p = sub.add_parser("estimate", help="predict per-stage peak memory per rank, stock vs plugin, from headers only",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a directory with model.safetensors or model.safetensors.index.json")
    p.add_argument("--num-processes", "--num_processes", type=_positive_int, default=None,
                   help="number of ranks (default: from --config_file, WORLD_SIZE or accelerate's default config)")
    p.add_argument("--config_file", "--config-file", dest="config_file", default=None,
                   help="an `accelerate launch` config file to take num_processes from")
    p.add_argument("--dtype", default="fp32", choices=tuple(DTYPE_BYTES), help="dtype the model is loaded in")
    p.add_argument("--mixed-precision", default="no", choices=MIXED_PRECISION, help="mixed precision (fp32 master weights)")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--cpu-offload", action="store_true", help="FSDP2 CPU offload: the shards stay in CPU memory on CUDA too")
    p.add_argument("--bucket-bytes", default="64MiB")
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--budget-bytes", default=None, help="CPU memory of one node (default: detected MemAvailable)")
    p.add_argument("--load-source", default="auto", choices=("auto", "rank0", "node", "every_rank"),
                   help="the plugin's load_source (auto is predicted as every_rank: every rank sees the checkpoint)")
    p.add_argument("--dp-replicate-size", "--dp_replicate_size", type=_positive_int, default=None,
                   help="ParallelismConfig's dp_replicate_size (HSDP: each weight's shards are held that many times; "
                        "default: from where the process count comes, else 1)")
    p.add_argument("--tp-size", "--tp_size", type=_positive_int, default=None,
                   help="ParallelismConfig's tp_size (whether the model's TP plan applies is checked as `prepare` "
                        "checks it; a declined plan leaves FSDP over dp_shard only)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.set_defaults(run=run)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give the number of ranks, e.g. 2") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} processes: give at least 1")
    return n


def _config_data(path: Path) -> dict:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())  # accelerate writes YAML; its JSON configs parse as YAML too
    except yaml.YAMLError as exc:
        raise CliError(f"launch config {path} is not valid YAML/JSON ({exc}); write one with `accelerate config`.") from None
    return data if isinstance(data, dict) else {}


def _mesh_of_config(path: Path) -> dict[str, int]:
    """The ``parallelism_config`` sizes of an ``accelerate launch`` config (``accelerate config`` writes
    ``parallelism_config: {parallelism_config_dp_replicate_size: 2, ...}``); 1 for what it does not set."""
    section = _config_data(path).get("parallelism_config") or {}
    out = {}
    for key in ("dp_replicate_size", "tp_size"):
        value = section.get(f"parallelism_config_{key}", 1) if isinstance(section, dict) else 1
        if not isinstance(value, int) or value < 1:
            raise CliError(f"launch config {path} has a parallelism_config_{key} of {value!r}; give a whole number >= 1 "
                           f"there, or pass --{key.replace('_', '-')}.")
        out[key] = value
    return out


def _from_config_file(path: Path) -> int:
    data = _config_data(path)
    n = data.get("num_processes")
    if not isinstance(n, int) or n < 1:
        raise CliError(f"launch config {path} has no usable `num_processes` (found {n!r}); set it there, or pass "
                       "--num-processes N.")
    return n


def num_processes(args: argparse.Namespace) -> tuple[int, str]:
    """The number of ranks to predict for, and where it came from (said in the output).

    Raises:
        CliError: If no source gives it, or the given config file cannot be read.
    """
    n, source, _, _ = _processes_and_mesh(args)
    return n, source


def _processes_and_mesh(args: argparse.Namespace) -> tuple[int, str, dict[str, int] | None, str | None]:
    """:func:`num_processes`, and the ``ParallelismConfig`` sizes of the same source and where they are (``None``:
    that source has none)."""
    from ..env import launched_mesh, launched_world_size

    if args.num_processes is not None:
        return args.num_processes, "--num-processes", None, None
    if args.config_file:
        path = Path(args.config_file)
        if not path.is_file():
            raise CliError(f"launch config {path} (--config_file) does not exist; give the file you pass to "
                           "`accelerate launch --config_file`, or --num-processes N.")
        return _from_config_file(path), f"num_processes in {path}", _mesh_of_config(path), f"parallelism_config in {path}"
    world = launched_world_size()
    if world is not None:
        return world, "WORLD_SIZE in the environment", launched_mesh(), "PARALLELISM_CONFIG_* in the environment"
    from accelerate.commands.config.config_args import default_config_file

    default = Path(default_config_file)
    if default.is_file():
        return (_from_config_file(default), f"num_processes in accelerate's default config {default}",
                _mesh_of_config(default), f"parallelism_config in accelerate's default config {default}")
    raise CliError(f"how many processes? Pass --num-processes N, or --config_file FILE of `accelerate launch`, or run "
                   f"inside a launched job (WORLD_SIZE); accelerate's default config {default} does not exist "
                   "(`accelerate config` writes it).")


def run(args: argparse.Namespace) -> int:
    import psutil

    from ..memory.estimate import node_totals, predict, summarize_checkpoint, to_dicts, tp_plan_declined
    from ..sizes import parse_size

    if not Path(args.checkpoint).exists():
        raise CliError(f"checkpoint {args.checkpoint} does not exist; give a directory holding model.safetensors or "
                       "model.safetensors.index.json (as `save_pretrained` writes it).")
    n, source, found, found_in = _processes_and_mesh(args)
    flags = [f"--{k.replace('_', '-')}" for k in ("dp_replicate_size", "tp_size") if getattr(args, k) is not None]
    for key in ("dp_replicate_size", "tp_size"):  # a flag wins; else the process count's source says, else 1
        if getattr(args, key) is None:
            setattr(args, key, (found or {}).get(key, 1))
    mesh_from = " and ".join(flags) if flags else (found_in if found is not None else None)
    bucket_bytes = parse_size(args.bucket_bytes, what="--bucket-bytes")
    budget = parse_size(args.budget_bytes, what="--budget-bytes") if args.budget_bytes else psutil.virtual_memory().available
    if n % (args.dp_replicate_size * args.tp_size):
        raise CliError(f"{n} processes (from {source}) do not divide into --dp-replicate-size {args.dp_replicate_size} x "
                       f"--tp-size {args.tp_size} groups; give a number of processes that is a multiple of their product.")
    summary = summarize_checkpoint(args.checkpoint)
    declined = tp_plan_declined(args.checkpoint, args.tp_size) if args.tp_size > 1 else None
    preds = predict(
        summary, num_processes=n, dtype=args.dtype, mixed_precision=args.mixed_precision,
        offload_optimizer=args.offload_optimizer, bucket_bytes=bucket_bytes, device=args.device, load_source=args.load_source,
        cpu_offload=args.cpu_offload, dp_replicate_size=args.dp_replicate_size, tp_size=args.tp_size,
        tp_applied=declined is None,
    )
    mesh = {"dp_replicate_size": args.dp_replicate_size, "dp_shard_size": n // (args.dp_replicate_size * args.tp_size),
            "tp_size": args.tp_size, **({"tp_declined": declined} if args.tp_size > 1 and declined else {}),
            **({"from": mesh_from} if mesh_from else {})}
    fits = {}
    for path in ("stock", "memsafe"):
        worst = max((cpu for cpu, _ in node_totals(preds, path).values()), default=0)
        fits[path] = {"node_peak_cpu_bytes": worst, "budget_bytes": budget, "fits": worst <= budget}
    code = 0 if fits["memsafe"]["fits"] else CHECK_FAILED
    if args.json:
        print(json.dumps({"checkpoint": summary.to_dict(), "num_processes": n, "num_processes_from": source,
                          "parallelism": mesh, "predictions": to_dicts(preds), "fits": fits}))
        return code
    mib = 2**20
    print(f"checkpoint {summary.path}: {summary.num_tensors} tensors, {summary.numel:,} elements, "
          f"{summary.checkpoint_bytes / mib:,.1f} MiB on disk; largest `{summary.largest_name}`; model tensors from "
          f"{summary.layout_from}")
    print(f"{n} processes (from {source}), load dtype {args.dtype}, mixed precision {args.mixed_precision}, "
          f"device {args.device}")
    if args.dp_replicate_size > 1 or args.tp_size > 1:
        tp = ""
        if args.tp_size > 1:
            tp = (f" x tp {args.tp_size} (the model's TP plan applies)" if declined is None else
                  f" x tp {args.tp_size}, TP plan declined ({declined}): FSDP over dp_shard only")
        print(f"mesh: dp_replicate {mesh['dp_replicate_size']} x dp_shard {mesh['dp_shard_size']}{tp} (from {mesh_from})")
    print()
    print("| hook | stage | rank | path | CPU private MiB | CPU RSS MiB | device MiB |")
    print("|---|---|---|---|---|---|---|")
    for p in preds:
        print(f"| {p.hook} | {p.stage} | {p.rank} | {p.path} | {p.cpu_anon_bytes / mib:,.1f} | "
              f"{p.cpu_rss_bytes / mib:,.1f} | {p.device_bytes / mib:,.1f} |")
    print("\nload_state: a restarted job's (its optimizer holds no state yet); a load into an optimizer that holds its "
          "state reads into it in place and needs less (an upper bound there).")
    print()
    for path, f in fits.items():
        verdict = "fits" if f["fits"] else "DOES NOT FIT"
        print(f"{path}: worst stage needs {f['node_peak_cpu_bytes'] / mib:,.1f} MiB of CPU memory on one node "
              f"(all ranks), budget {f['budget_bytes'] / mib:,.1f} MiB: {verdict}")
    if code:
        print(f"\nexit code {code}: with the plugin, the worst stage does not fit the budget.")
    else:
        stock = "" if fits["stock"]["fits"] else " (stock accelerate's worst stage would not)"
        print(f"\nexit code 0: with the plugin, every stage fits the budget{stock}.")
    return code
