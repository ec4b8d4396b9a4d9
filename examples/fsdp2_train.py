"""FSDP2 fine-tuning with accelerate_memsafe, runnable on CPU.

    accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 examples/fsdp2_train.py --out run.json
    accelerate-memsafe launch --num_processes 2 examples/fsdp2_train.py --out run.json   # the same, FSDP2 added on CPU
    torchrun --nproc_per_node 2 examples/fsdp2_train.py --out run.json
    python examples/fsdp2_train.py --reference --out ref.json      # single-process reference, same data

Builds a tiny Llama from a config (nothing downloaded), prepares it with the plugin, trains a few steps,
checks that the parameters are FSDP2 DTensors sharded on dim 0, round-trips save_state/load_state and
checks the restored parameters and optimizer state bitwise. Writes losses and checks as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", help="a saved transformers causal LM (default: build a tiny Llama)")
    p.add_argument("--size", default="tiny", help="size of the built model (accelerate_memsafe.models.SIZES)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4, help="global batch size (split across ranks)")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--out", help="write losses and checks to this JSON file (rank 0)")
    p.add_argument("--report", help="write the gathered memory report to this JSON file (rank 0)")
    p.add_argument("--checkpoint-dir", help="where save_state writes (default: a temporary directory)")
    p.add_argument("--workdir", help="where the built model and checkpoint go (default: a temporary directory)")
    p.add_argument("--reference", action="store_true", help="plain single-process run without accelerate")
    p.add_argument("--attach", action="store_true", help="use a stock accelerate.Accelerator + MemSafePlugin().attach()")
    return p.parse_args()


def make_data(args: argparse.Namespace, vocab: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (args.steps * args.batch_size + args.batch_size, args.seq_len), generator=g)
    return TensorDataset(ids)


def load_model(args: argparse.Namespace, workdir: Path, *, as_one_process: bool = False):
    """The model as the script loads it on every rank, or (``as_one_process``) with the checkpoint's weights on every
    rank: under accelerate's FSDP efficient-loading variables transformers before 5.23 loads them on local rank 0 only
    and leaves zeros elsewhere, for ``prepare`` to fill."""
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe.models import save_llama

    model_dir = Path(args.model_dir) if args.model_dir else workdir / "model"
    if not args.model_dir and not (model_dir / "config.json").exists():
        save_llama(model_dir, args.size)
    hidden = ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING") if as_one_process else ()
    saved = {k: os.environ.pop(k) for k in hidden if k in os.environ}
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    finally:
        os.environ.update(saved)


def reference(args: argparse.Namespace, workdir: Path) -> dict:
    torch.manual_seed(0)
    model = load_model(args, workdir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = DataLoader(make_data(args, model.config.vocab_size), batch_size=args.batch_size)
    losses = []
    for step, (x,) in enumerate(data):
        if step == args.steps:
            break
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "world_size": 1}


def snapshot(model, opt) -> dict[str, torch.Tensor]:
    out = {f"param/{n}": (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for n, p in model.named_parameters()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{i}/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    return out


def distributed(args: argparse.Namespace, workdir: Path) -> dict:
    import accelerate
    from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor, Shard

    from accelerate_memsafe import Accelerator, MemSafePlugin

    plugin = MemSafePlugin.from_env() if any(k.startswith("ACCELERATE_MEMSAFE_") for k in os.environ) else MemSafePlugin()
    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    dl_config = DataLoaderConfiguration(split_batches=True)
    if args.attach:
        accelerator = accelerate.Accelerator(dataloader_config=dl_config)
        plugin.attach(accelerator, fsdp_plugin=fsdp_plugin)
    else:
        accelerator = Accelerator(plugins=[plugin], fsdp_plugin=fsdp_plugin, dataloader_config=dl_config)

    from accelerate.utils import broadcast_object_list

    # every rank must read the same model directory: rank 0 picks it and builds the model there
    shared = broadcast_object_list([str(workdir)])[0]
    workdir = Path(shared)
    if accelerator.is_main_process:
        load_model(args, workdir)
    accelerator.wait_for_everyone()
    torch.manual_seed(0)
    model = load_model(args, workdir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = DataLoader(make_data(args, model.config.vocab_size), batch_size=args.batch_size)
    model, opt, data = accelerator.prepare(model, opt, data)

    world = accelerator.num_processes
    sharding = []
    loaded = load_model(args, workdir, as_one_process=True).state_dict()  # what a single process holds: every rank must end with it
    differs = []
    for name, p in model.named_parameters():
        full = p.numel()
        local = p.to_local().numel() if isinstance(p, DTensor) else full
        if not torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, loaded[name]):
            differs.append(name)
        sharding.append(
            {
                "name": name,
                "dtensor": isinstance(p, DTensor),
                "shard0": isinstance(p, DTensor) and tuple(p.placements) == (Shard(0),),
                "placements": str(p.placements) if isinstance(p, DTensor) else None,
                "local_fraction": local / full,
                "numel": full,
            }
        )
    del loaded
    mesh = accelerator.torch_device_mesh

    losses = []
    batches = iter(data)
    for _ in range(args.steps):
        (x,) = next(batches)
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())

    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else workdir / "checkpoint"
    accelerator.save_state(str(ckpt))
    before = snapshot(model, opt)
    (x,) = next(batches)  # change the state, then restore it
    accelerator.backward(model(input_ids=x, labels=x).loss)
    opt.step()
    opt.zero_grad()
    changed = any(not torch.equal(before[k], v) for k, v in snapshot(model, opt).items())
    accelerator.load_state(str(ckpt))
    after = snapshot(model, opt)
    mismatched = sorted(k for k in before if k not in after or not torch.equal(before[k], after[k]))

    report = accelerator.memsafe_plugin.report.gather()
    if args.report and accelerator.is_main_process:
        report.to_json(args.report)
    result = {
        "losses": losses,
        "world_size": world,
        "distributed_type": str(accelerator.distributed_type),
        "sharding": sharding,
        "differs_from_single_process": accelerator.gather_for_metrics([differs], use_gather_object=True),
        "mesh": None if mesh is None else dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape)),
        "state_changed_by_extra_step": changed,
        "roundtrip_mismatches": mismatched,
        "roundtrip_tensors": len(before),
        "stages": {h: list(accelerator.memsafe_plugin.stage_names(h)) for h in ("prepare", "load_state", "save_state", "save_model")},
    }
    if accelerator.is_main_process:
        print(report.to_markdown())
    # every rank finishes its communication before any rank tears the process group down (gloo's
    # connections are closed by the first rank to exit)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        result = reference(args, workdir) if args.reference else distributed(args, workdir)
    if int(os.environ.get("RANK", "0")) == 0:  # the results once, from rank 0 (every rank has the same)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        print("losses:", result["losses"])


if __name__ == "__main__":
    main()
