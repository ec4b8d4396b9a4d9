"""``accelerate-memsafe demo``: a small Llama-style model, FSDP2 on N CPU processes with the plugin.

Builds the model from a config (random init, saved locally, nothing downloaded), launches N processes
with torch's elastic launcher, trains a few steps, saves and reloads state (checked bitwise), and
prints the per-stage memory report as a table (and writes it as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from .errors import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the built-in FSDP2 demo on CPU processes and print the memory report")
    p.add_argument("--workdir", default="memsafe-demo", help="where the model, checkpoint and report go")
    p.add_argument("--num-processes", type=int, default=2)
    p.add_argument("--size", default="small", help="model size: tiny, small, 100m, 250m, 500m, 1g")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stages", help="comma-separated stage names (default: every stage)")
    p.set_defaults(run=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    from ..models import save_llama

    workdir = Path(args.workdir).resolve()
    model_dir = workdir / "model"
    if not (model_dir / "config.json").exists():
        print(f"building a {args.size} Llama-style model in {model_dir} ...", flush=True)
        save_llama(model_dir, args.size)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if args.stages:
        env["ACCELERATE_MEMSAFE_STAGES"] = args.stages
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc_per_node={args.num_processes}", f"--master_port={_free_port()}",
        "-m", "accelerate_memsafe.cli.demo", "--worker",
        "--workdir", str(workdir), "--steps", str(args.steps),
    ]
    print("launching:", " ".join(cmd[2:]), flush=True)
    code = subprocess.call(cmd, env=env)
    if code != 0:
        raise CliError(f"the demo's processes failed (exit code {code}); their error is printed above.", code=1)
    summary = json.loads((workdir / "summary.json").read_text())
    from ..memory.plot import plot_report
    from ..memory.report import MemoryReport

    print(f"\nreport: {workdir / 'report.json'}")
    print(f"plot:   {plot_report(MemoryReport.from_json(workdir / 'report.json'), workdir / 'report.png')}")
    print(f"losses: {summary['losses']}  save/load round trip bitwise: {summary['roundtrip_ok']}")
    return 0 if summary["roundtrip_ok"] else 1


def _worker(workdir: Path, steps: int) -> None:
    import torch
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import Accelerator, MemSafePlugin, from_pretrained

    plugin = MemSafePlugin.from_env()
    accelerator = Accelerator(
        plugins=[plugin],
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        dataloader_config=DataLoaderConfiguration(split_batches=True),
    )
    torch.manual_seed(0)
    # rank 0 reads the weights; the other ranks build the model on meta and receive only their shard
    model = from_pretrained(AutoModelForCausalLM, workdir / "model", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, ((steps + 1) * 4, 32), generator=g)
    data = DataLoader(TensorDataset(ids), batch_size=4)
    model, opt, data = accelerator.prepare(model, opt, data)
    batches = iter(data)
    losses = []
    for _ in range(steps):
        (x,) = next(batches)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(round(accelerator.reduce(loss.detach(), reduction="mean").item(), 6))
    ckpt = workdir / "checkpoint"
    accelerator.save_state(str(ckpt))
    saved = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    (x,) = next(batches)
    accelerator.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    opt.zero_grad()
    accelerator.load_state(str(ckpt))
    ok = all(torch.equal(saved[n], p.to_local()) for n, p in model.named_parameters())
    ok_all = accelerator.reduce(torch.tensor(float(ok)), reduction="sum").item() == accelerator.num_processes
    report = plugin.report.gather()
    if accelerator.is_main_process:
        report.to_json(workdir / "report.json")
        print(report.to_markdown())
        (workdir / "summary.json").write_text(json.dumps({"losses": losses, "roundtrip_ok": ok_all}))
    # every rank finishes its communication before any rank tears the process group down (gloo's
    # connections are closed by the first rank to exit)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _worker_main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    _worker(Path(a.workdir), a.steps)
    leave_without_teardown()


def leave_without_teardown() -> None:
    """Ends a demo rank that finished its work, as Python's ``multiprocessing`` ends a forked child: output flushed,
    then ``os._exit(0)``, without the interpreter's teardown.

    After ``destroy_process_group`` the gloo group is still held by FSDP2's ``DTensor`` caches, so its worker threads
    outlive the call; with torch 2.11, one that frees a finished collective's tensors while the interpreter tears
    down aborts the process ("terminate called without an active exception", SIGABRT; 1 of 68 demo runs on a busy
    2-core machine), after the report was written. Only a rank whose work succeeded gets here: an error raised by
    the work ends the process as it would have."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _worker_main()
