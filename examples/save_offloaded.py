"""Save a model whose weights are offloaded to cpu and disk, shard by shard, with the plugin.

    python examples/save_offloaded.py                                  # tiny Qwen3-MoE, 20 kB shards
    python examples/save_offloaded.py --arch llama --size small --max-shard-size 2MB
    accelerate launch --num_processes 1 examples/save_offloaded.py     # through accelerate's launcher

A model dispatched with a ``device_map`` putting modules on ``cpu`` and ``disk`` keeps ``meta`` tensors
whose values live in the offload folder. ``accelerator.save_model(model, dir)`` with the plugin routes it
through the ``offloaded_save`` stage (``accelerate_memsafe.save_offloaded``): the shards are planned from
names/shapes/dtypes so that every group of tensors one reverse weight conversion needs (fused MoE experts)
lands in one shard, then each shard is loaded, reverted, written and released. The checkpoint is written
to a temporary directory and renamed into place when complete. The example reloads it with
``from_pretrained`` and checks every weight bitwise against the original.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "llama"])
    p.add_argument("--size", default="tiny", help="for --arch llama: accelerate_memsafe.models.SIZES")
    p.add_argument("--max-shard-size", default="20kB")
    p.add_argument("--workdir", help="default: a temporary directory")
    p.add_argument("--out", help="write a JSON summary here")
    return p.parse_args()


def build(arch: str, size: str, path: Path) -> None:
    torch.manual_seed(0)
    if arch == "llama":
        from accelerate_memsafe.models import save_llama

        save_llama(path, size)
        return
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64)
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)


def main() -> dict:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from accelerate_memsafe import Accelerator, MemSafePlugin
    from accelerate_memsafe.io.offload_reader import cpu_disk_device_map

    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        src, out = work / "source", work / "saved"
        build(args.arch, args.size, src)
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
        device_map = cpu_disk_device_map(skeleton, cpu_fraction=0.5)
        model = AutoModelForCausalLM.from_pretrained(src, device_map=device_map, offload_folder=str(work / "offload"))
        placements = sorted(set(device_map.values()))

        accelerator = Accelerator(plugins=[MemSafePlugin()])
        accelerator.save_model(model, str(out), max_shard_size=args.max_shard_size)

        reference = AutoModelForCausalLM.from_pretrained(src).state_dict()
        reloaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
        mismatched = sorted(k for k in reference if k not in reloaded or not torch.equal(reference[k], reloaded[k]))
        index = json.loads((out / "model.safetensors.index.json").read_text())
        record = accelerator.memsafe_plugin.report.find(hook="save_model", stage="offloaded_save")[0]
        summary = {
            "arch": args.arch,
            "placements": placements,
            "shards": len(set(index["weight_map"].values())),
            "tensors": len(index["weight_map"]),
            "mismatched": mismatched,
            "stage_status": record.status,
            "anon_peak_over_start_mib": round(((record.cpu_anon_peak_bytes or 0) - (record.cpu_anon_start_bytes or 0)) / 2**20, 2),
        }
        print(accelerator.memsafe_plugin.report.to_markdown())
        print(json.dumps(summary))
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=1))
        return summary


if __name__ == "__main__":
    result = main()
    raise SystemExit(0 if not result["mismatched"] and result["stage_status"] == "ran" else 1)
