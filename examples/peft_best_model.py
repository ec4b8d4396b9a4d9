"""LoRA fine-tuning with ``load_best_model_at_end=True`` through ``MemSafeTrainer``, runnable on CPU.

    python examples/peft_best_model.py                     # tiny Llama, 6 steps, eval + save every step
    python examples/peft_best_model.py --max-steps 3       # shorter
    python examples/peft_best_model.py --size small --max-steps 20 --out run.json

What it shows
-------------
``transformers.Trainer._load_best_model`` reloads a PEFT adapter with ``model.load_adapter(best, name)``,
which reads the whole adapter onto the accelerator before copying it: a late OOM when memory is tight.
``MemSafeTrainer`` (or ``class MyTrainer(MemSafeTrainerMixin, Trainer)``) routes that call, and adapter
resume, through ``accelerate_memsafe.reload_adapters``: caches emptied, the safetensors file validated,
then read tensor by tensor on CPU and copied in place (pinned, non-blocking on CUDA).

Builds a tiny Llama from a config (nothing downloaded), adds LoRA (r=8 on the attention projections,
``lm_head`` in ``modules_to_save``), trains on random tokens with a high learning rate (so the eval loss
moves around), evaluates and saves every step, and at the end checks that the model's adapter weights are
bitwise those of the best checkpoint. Writes a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="tiny", help="model size (accelerate_memsafe.models.SIZES)")
    p.add_argument("--max-steps", type=int, default=6, help="training steps (eval and checkpoint every step)")
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--output-dir", help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--out", help="write the summary to this JSON file")
    return p.parse_args()


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, vocab: int, seq: int = 16, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_model(size: str):
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(
            build_llama(size), LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=["lm_head"])
        )


def adapter_matches(model, checkpoint: Path) -> bool:
    """Whether the model's default adapter is bitwise the one saved in ``checkpoint``."""
    from safetensors.torch import load_file

    from accelerate_memsafe.integrations.peft import adapter_parameter_map

    saved = load_file(checkpoint / "adapter_model.safetensors")
    mapping = adapter_parameter_map(model, "default")
    return all(torch.equal(mapping[k][1].detach().cpu(), v) for k, v in saved.items())


def main() -> dict:
    from transformers import TrainingArguments

    from accelerate_memsafe.integrations import MemSafeTrainer

    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(args.output_dir or tmp)
        model = build_model(args.size)
        vocab = model.config.vocab_size
        training_args = TrainingArguments(
            output_dir=str(out_dir), max_steps=args.max_steps, per_device_train_batch_size=4,
            per_device_eval_batch_size=8, learning_rate=args.lr, eval_strategy="steps", eval_steps=1,
            save_strategy="steps", save_steps=1, load_best_model_at_end=True, metric_for_best_model="eval_loss",
            greater_is_better=False, report_to=[], disable_tqdm=True, logging_steps=1, seed=0,
            # pinned memory needs an accelerator; without one torch warns at every evaluation
            dataloader_pin_memory=torch.cuda.is_available(),
        )
        trainer = MemSafeTrainer(
            model=model, args=training_args, train_dataset=RandomTokens(64, vocab), eval_dataset=RandomTokens(16, vocab, seed=1)
        )
        trainer.train()
        best = Path(trainer.state.best_model_checkpoint)
        last = out_dir / f"checkpoint-{trainer.state.global_step}"
        losses = [round(h["eval_loss"], 4) for h in trainer.state.log_history if "eval_loss" in h]
        stats = getattr(trainer, "memsafe_last_reload", None) or []
        summary = {
            "eval_losses": losses,
            "best_checkpoint": best.name,
            "last_checkpoint": last.name,
            "adapter_equals_best": adapter_matches(trainer.model, best),
            "adapter_equals_last": adapter_matches(trainer.model, last) if last != best else None,
            "reloaded_cpu_first": bool(stats),
            "reloaded_tensors": sum(s.tensors for s in stats),
            "largest_tensor_bytes": max((s.largest_tensor_bytes for s in stats), default=0),
        }
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    if not summary["adapter_equals_best"]:
        raise SystemExit("the model does not hold the best checkpoint's adapter")
    return summary


if __name__ == "__main__":
    main()
