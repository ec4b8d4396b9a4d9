"""Resuming from a checkpoint: stock accelerate vs the plugin, same run, same model, same data.

For each path (``stock``: ``accelerate.Accelerator``; ``plugin``: ``accelerate_memsafe.Accelerator`` with the
default stages, ``--offload`` adds ``optimizer_offload=True``), every phase runs in a fresh process:

1. ``save``: build a Llama of ``--size`` (seed 0), AdamW, ``--steps`` training steps, then ``save_state``.
2. ``load_fresh``: build the model again (another seed), a fresh AdamW (no state), ``load_state`` + one step.
3. ``load_existing``: the same, but the optimizer already took one step (it holds state) before ``load_state``.

Per phase and path: ``live_tensor_peak_bytes`` (dispatch-level tracker, bytes allocated during the phase
and alive at once), RSS and RssAnon peaks over the phase's baseline (sampled every 2 ms, plus VmHWM), wall
time; for the loads also the optimizer-state bytes, the largest state tensor, the bound of the issue
(``state + largest + 5%``), the loss of the step after the load (must be equal for both paths: both resume
the same state), and on CUDA (``--device cuda``) the device bytes allocated and reserved-minus-allocated
after the load. For the plugin, the load's per-stage records are included. ``malloc_trim`` between phases.
Prints one JSON line; ``--markdown FILE`` appends a table.

    python benchmarks/resume.py --size 250m --steps 2 --markdown docs/benchmarks.md
    python benchmarks/resume.py --quick                  # tiny model, seconds
    python benchmarks/resume.py --device cuda --offload   # on a GPU box
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

MIB = 2**20
PHASES = ("save", "load_fresh", "load_existing")
PATHS = ("stock", "plugin")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="250m", help="model size (accelerate_memsafe.models.SIZES)")
    p.add_argument("--steps", type=int, default=2, help="training steps before the save")
    p.add_argument("--seq", type=int, default=16, help="tokens per sample (batch of 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--offload", action="store_true", help="plugin path with optimizer_offload=True")
    p.add_argument("--fsdp2", action="store_true", help="FSDP2 on 2 CPU ranks (gloo) instead of one process")
    p.add_argument("--sdt", default="FULL_STATE_DICT", help="FSDP2 state dict type (FULL_STATE_DICT, SHARDED_STATE_DICT)")
    p.add_argument("--quick", action="store_true", help="tiny model (a smoke run)")
    p.add_argument("--markdown", help="append a markdown table to this file")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)
    p.add_argument("--path", choices=PATHS, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one phase, in its own process ------------------------------------------------------------------

def _accelerator(path: str, device: str, offload: bool, fsdp2: bool = False, sdt: str = "FULL_STATE_DICT"):
    from accelerate_memsafe import Accelerator, MemSafePlugin

    fsdp_plugin = None
    if fsdp2:
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=sdt)
    if path == "stock":
        import accelerate

        if fsdp_plugin is None:
            return accelerate.Accelerator(cpu=device == "cpu")
        acc = accelerate.Accelerator(fsdp_plugin=fsdp_plugin) if device != "cpu" else accelerate.Accelerator()
        if device == "cpu":  # stock accelerate cannot run FSDP2 on CPU: only the `shard` stage is added
            MemSafePlugin(stages=["shard"], progress=False).attach(acc, fsdp_plugin=fsdp_plugin)
        return acc
    kwargs = {"fsdp_plugin": fsdp_plugin} if fsdp_plugin is not None else {"cpu": device == "cpu"}
    # the stage table reports each stage's live tensor peak: the tracker on
    return Accelerator(plugins=[MemSafePlugin(optimizer_offload=offload, progress=False, track_live_tensors=True)], **kwargs)


def _batch(i: int, seq: int, vocab: int):
    import torch

    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1000 + i))


def _step(acc, model, opt, ids):
    ids = ids.to(acc.device)
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach().cpu())


def _state_figures(opt) -> dict:
    sizes = [
        (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size()
        for st in opt.state.values() for v in st.values() if hasattr(v, "element_size")
    ]
    devices = sorted({str((v.to_local() if hasattr(v, "to_local") else v).device)
                      for st in opt.state.values() for v in st.values() if hasattr(v, "device")})
    return {"state_bytes": sum(sizes), "largest_state_tensor_bytes": max(sizes, default=0), "state_devices": devices}


def _measure(fn, device: str) -> tuple[dict, object]:
    import torch

    from accelerate_memsafe.memory.probe import MemoryProbe
    from accelerate_memsafe.memory.procfs import malloc_trim, read_proc_memory, reset_peak_rss

    malloc_trim()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    allocated_start = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    reset_peak_rss()
    with MemoryProbe(torch.device(device), track_tensors=True) as probe:
        out = fn()
    hwm = read_proc_memory()
    r = probe.result
    fig = {
        "wall_s": round(r.wall_s, 3),
        "live_tensor_peak_bytes": r.live_tensor_peak_bytes,
        "rss_peak_over_baseline": r.cpu_rss_peak_bytes - r.cpu_rss_start_bytes if r.cpu_rss_peak_bytes else None,
        "anon_peak_over_baseline": r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes if r.cpu_anon_peak_bytes else None,
        "vmhwm_over_baseline": hwm.hwm - r.cpu_rss_start_bytes if hwm and r.cpu_rss_start_bytes else None,
    }
    if device.startswith("cuda"):
        fig["device_peak_over_baseline"] = torch.cuda.max_memory_allocated() - allocated_start
    return fig, out


def run_phase(args) -> dict:
    import torch

    from accelerate_memsafe.models import build_llama, llama_config

    vocab = llama_config(args.size).vocab_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = _accelerator(args.path, args.device, args.offload, args.fsdp2, args.sdt)
        model = build_llama(args.size, seed=0 if args.phase == "save" else 1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, opt = acc.prepare(model, opt)
    inner = getattr(opt, "optimizer", opt)
    out: dict = {"phase": args.phase, "path": args.path, "rank": acc.process_index}
    if args.phase == "save":
        losses = [_step(acc, model, opt, _batch(i, args.seq, vocab)) for i in range(args.steps)]
        fig, _ = _measure(lambda: acc.save_state(args.ckpt), args.device)
        out.update(fig, losses=losses, **_state_figures(inner))
        return out
    if args.phase == "load_existing":
        _step(acc, model, opt, _batch(99, args.seq, vocab))
    before = _state_figures(inner)["state_bytes"]
    fig, _ = _measure(lambda: acc.load_state(args.ckpt), args.device)
    out.update(fig, **_state_figures(inner))
    # The tracker counts what the load allocates; the state held before the load is alive on top of it.
    out["state_bytes_before_load"] = before
    out["total_tensor_peak_bytes"] = before + (fig["live_tensor_peak_bytes"] or 0)
    sb, lg = out["state_bytes"], out["largest_state_tensor_bytes"]
    out["bound_bytes"] = int(sb + lg + 0.05 * sb)
    if args.device.startswith("cuda"):
        out["device_allocated_after_load"] = torch.cuda.memory_allocated()
        out["device_reserved_minus_allocated_after_load"] = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    step_fig, loss = _measure(lambda: _step(acc, model, opt, _batch(args.steps, args.seq, vocab)), args.device)
    out["step"] = step_fig
    out["loss_after_load"] = loss
    if args.path == "plugin":
        out["stages"] = [
            {"stage": r.stage, "status": r.status, "wall_s": round(r.wall_s, 3),
             "live_tensor_peak_bytes": r.live_tensor_peak_bytes, "rss_peak": r.cpu_rss_peak_bytes,
             "details": {k: v for k, v in r.details.items() if isinstance(v, (int, float, str))}}
            for r in acc.memsafe_plugin.report.find(hook="load_state")
        ]
    return out


# -- the driver ---------------------------------------------------------------------------------

def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.phase:
        print("RESULT " + json.dumps(run_phase(args)))
        return {}
    size = "tiny" if args.quick else args.size
    results: dict[str, dict] = {p: {} for p in PATHS}
    with tempfile.TemporaryDirectory(prefix="memsafe-resume-") as tmp:
        for path in PATHS:
            ckpt = str(Path(tmp) / f"ckpt_{path}")
            for phase in PHASES:
                launcher = [sys.executable]
                if args.fsdp2:
                    launcher += ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port())]
                cmd = launcher + [__file__, "--phase", phase, "--path", path, "--ckpt", ckpt, "--size", size,
                                  "--steps", str(args.steps), "--seq", str(args.seq), "--device", args.device,
                                  "--sdt", args.sdt]
                cmd += ["--offload"] * args.offload + ["--fsdp2"] * args.fsdp2
                env = {**os.environ, "PYTHONWARNINGS": "ignore"}
                if args.fsdp2:
                    env["OMP_NUM_THREADS"] = "1"  # two ranks on this 2-core machine
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                lines = [json.loads(x[len("RESULT "):]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode != 0 or not lines:
                    raise RuntimeError(f"{path}/{phase} failed:\n{proc.stderr[-4000:]}")
                # rank 0's figures; with FSDP2 every rank holds half the state
                results[path][phase] = sorted(lines, key=lambda r: r["rank"])[0]
                results[path][phase]["ranks"] = len(lines)
    same_loss = all(
        results["stock"][ph]["loss_after_load"] == results["plugin"][ph]["loss_after_load"] for ph in PHASES[1:]
    )
    row = {
        "benchmark": "resume",
        "size": size,
        "steps": args.steps,
        "device": args.device,
        "offload": args.offload,
        "fsdp2": args.fsdp2,
        "sdt": args.sdt if args.fsdp2 else None,
        "same_loss_after_load": same_loss,
        "results": results,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(row))
    if args.markdown:
        write_markdown(row, args.markdown)
    return row


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _mib(v) -> str:
    return "n/a" if v is None else f"{v / MIB:.1f}"


def write_markdown(row: dict, path: str) -> None:
    stock_save = row["results"]["stock"]["save"]
    lines = [
        "",
        f"Llama `{row['size']}`, AdamW, {row['steps']} steps, device `{row['device']}`, "
        f"{'FSDP2 on 2 ranks, ' + row['sdt'] + ', figures of rank 0' if row.get('fsdp2') else 'one process'}, plugin offload "
        f"{row['offload']}: optimizer state {_mib(stock_save['state_bytes'])} MiB, largest state tensor "
        f"{_mib(stock_save['largest_state_tensor_bytes'])} MiB; loss of the step after the load equal for both "
        f"paths: {row['same_loss_after_load']} ({row['time']}).",
        "",
        "| phase | path | state held before (MiB) | live tensor peak: new (MiB) | held + new (MiB) | bound state+largest+5% (MiB) | RSS peak over baseline (MiB) "
        "| RssAnon peak over baseline (MiB) | VmHWM over baseline (MiB) | device alloc / reserved−alloc after load (MiB) "
        "| wall (s) | next step wall (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in PHASES:
        for p in PATHS:
            r = row["results"][p][phase]
            dev = (f"{_mib(r.get('device_allocated_after_load'))} / {_mib(r.get('device_reserved_minus_allocated_after_load'))}"
                   if "device_allocated_after_load" in r else "n/a")
            lines.append(
                f"| {phase} | {p} | {_mib(r.get('state_bytes_before_load'))} | {_mib(r['live_tensor_peak_bytes'])} "
                f"| {_mib(r.get('total_tensor_peak_bytes'))} | {_mib(r.get('bound_bytes'))} "
                f"| {_mib(r['rss_peak_over_baseline'])} | {_mib(r['anon_peak_over_baseline'])} "
                f"| {_mib(r['vmhwm_over_baseline'])} | {dev} | {r['wall_s']} | {r.get('step', {}).get('wall_s', '')} |"
            )
    for phase in PHASES[1:]:
        stages = row["results"]["plugin"][phase].get("stages", [])
        if stages:
            lines += ["", f"Plugin `load_state` ({phase}), per stage:", "",
                      "| stage | status | live tensor peak (MiB) | RSS peak (MiB) | wall (s) |", "|---|---|---|---|---|"]
            lines += [f"| {s['stage']} | {s['status']} | {_mib(s['live_tensor_peak_bytes'])} | {_mib(s['rss_peak'])} | {s['wall_s']} |"
                      for s in stages]
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
