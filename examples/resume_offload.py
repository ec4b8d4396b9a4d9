"""Resume FSDP2 training from a checkpoint with the optimizer offloaded to CPU, exactly.

    # train 6 steps, checkpoint after step 3
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 examples/resume_offload.py \
        --workdir run --steps 6 --save-at 3 --out full.json
    # a fresh job resumes from the checkpoint and runs steps 4..6: same losses, bitwise
    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 examples/resume_offload.py \
        --workdir run --steps 6 --resume --out resumed.json

``MemSafePlugin(optimizer_offload=True)`` keeps the AdamW state in (pinned) CPU tensors between steps.
On ``load_state`` the ``optimizer_cpu_reload`` stage reads the state straight into those tensors (no device
copy, nothing stale left behind), ``atomic_checkpoint`` guarantees the checkpoint is complete, and
``dataloader_resume`` restores the shuffled ``StatefulDataLoader`` so the resumed job sees the same batches.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="model, checkpoint and outputs go here (shared by both runs)")
    p.add_argument("--size", default="tiny")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-at", type=int, default=3)
    p.add_argument("--resume", action="store_true", help="load the checkpoint and run the remaining steps")
    p.add_argument("--out", help="write the losses as JSON (rank 0)")
    return p.parse_args()


def main() -> None:
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin, set_seed
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe import Accelerator, MemSafePlugin
    from accelerate_memsafe.models import save_llama

    # accelerate builds a torchdata StatefulDataLoader for this script (use_stateful_dataloader=True), whose
    # constructor calls torch's deprecated `set_vital` and warns about it on every rank: torchdata's business
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
    args = parse_args()
    work = Path(args.workdir).resolve()
    plugin = MemSafePlugin(optimizer_offload=True)
    accelerator = Accelerator(
        plugins=[plugin],
        fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True),
    )
    if accelerator.is_main_process and not (work / "model" / "config.json").exists():
        save_llama(work / "model", args.size)
    accelerator.wait_for_everyone()
    set_seed(0)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.steps * 4, 16), generator=g)
    data = DataLoader(TensorDataset(ids), batch_size=2, shuffle=True)
    model, opt, data = accelerator.prepare(model, opt, data)

    ckpt = work / "checkpoint"
    start = 0
    if args.resume:
        accelerator.load_state(str(ckpt))
        start = args.save_at
        on_cpu = all(
            t.device.type == "cpu" for st in opt.optimizer.state.values() for t in st.values() if torch.is_tensor(t)
        )
        assert on_cpu, "with optimizer_offload every optimizer state tensor must be on CPU after load_state"
    losses = []
    step = start
    for (x,) in data:
        if step == args.steps:
            break
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        step += 1
        if not args.resume and step == args.save_at:
            accelerator.save_state(str(ckpt))
    if accelerator.is_main_process:
        print(plugin.report.to_markdown())
        print("losses:", losses)
        if args.out:
            Path(args.out).write_text(json.dumps({"start": start, "losses": losses}))
    # every rank finishes its communication before any rank tears the process group down (gloo's
    # connections are closed by the first rank to exit)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
