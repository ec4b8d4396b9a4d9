"""The ``transformers.Trainer`` with and without the plugin: memory of model load + Trainer setup + ``prepare``
on 2 gloo ranks, and the cost of a CPU-first adapter reload (``load_best_model_at_end``) on CPU.

Memory. A Llama of ``--model-size`` + LoRA (r=8 on q/v) is trained by

- ``stock``: ``transformers.Trainer`` with ``TrainingArguments(fsdp=True, fsdp_config={"version": 2,
  "cpu_ram_efficient_loading": True}, use_cpu=True)`` and ``AutoModelForCausalLM.from_pretrained`` on every rank.
  This is what the stock Trainer can do on a CPU machine: it runs DDP over gloo (without ``use_cpu`` it refuses
  ``fsdp``; under ``accelerate launch --use_fsdp`` each process trains alone);
- ``memsafe``: ``MemSafeTrainer`` with the same arguments (FSDP2 over gloo) and ``accelerate_memsafe.from_pretrained``
  (rank 0 reads, the other ranks build on meta).

Each path runs in its own 2 fresh processes. On each rank the RssAnon (private memory) and RSS are sampled every
2 ms from before the model is loaded until the Trainer's ``on_train_begin`` (the model prepared), then ``--steps``
training steps are timed. ``bound`` is the prepare bound for ranks != 0: P/2 + T + 64 MiB (P: model bytes in the
training dtype, T: the largest tensor).

Reload. In this process, a tiny Llama + LoRA (the setup of issue 16) is trained one step with checkpointing; then
the best-model reload is timed (median of ``--repeats``): the plugin's ``MemSafeTrainer._load_best_model`` (the
whole path: version check, plan, validation, CPU-first copy, the pipeline's probe and records), the copy alone
(``copy_file_into`` with the same plan) and the stock ``Trainer._load_best_model`` (peft's ``load_adapter``).

Prints one JSON line; ``--markdown FILE`` appends the two tables.

    python benchmarks/trainer.py --model-size 100m --markdown docs/benchmarks.md
    python benchmarks/trainer.py --quick          # small model, 1 step, seconds
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from markdown_region import write_tables
from prepare import spawn  # the launcher of the sibling benchmark

MIB = 2**20
PATHS = ("stock", "memsafe")


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])


class _Data:
    def __init__(self, n: int, vocab: int, seq: int = 32):
        import torch

        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _worker(rank: int, port: int, world: int, path: str, model_dir: str, out: str, steps: int, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    try:
        queue.put((rank, "ok", _run(path, model_dir, out, steps)))
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run(path: str, model_dir: str, out: str, steps: int) -> dict:
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import accelerate_memsafe
    from accelerate_memsafe.integrations import MemSafeTrainer
    from accelerate_memsafe.memory.probe import MemoryProbe

    warnings.simplefilter("ignore")
    args = TrainingArguments(
        output_dir=out, max_steps=max(steps, 1), per_device_train_batch_size=2, learning_rate=1e-4,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
        fsdp=True, fsdp_config={"version": 2, "cpu_ram_efficient_loading": True},
        use_cpu=True,  # the stock Trainer refuses fsdp on CPU without it; MemSafeTrainer runs FSDP2 either way
    )
    probe = MemoryProbe(torch.device("cpu"), track_tensors=False)
    started = time.perf_counter()
    probe.__enter__()
    memsafe = path == "memsafe"
    model = (accelerate_memsafe.from_pretrained if memsafe else lambda cls, p: cls.from_pretrained(p))(AutoModelForCausalLM, model_dir)
    model = get_peft_model(model, _lora())
    window: dict = {}

    class Measure(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            probe.__exit__(None, None, None)
            window["setup_s"] = time.perf_counter() - started
            window["first_step"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                window["first_step"] = time.perf_counter()  # steps after the first (warm-up) are timed

    cls = MemSafeTrainer if memsafe else Trainer
    trainer = cls(model=model, args=args, train_dataset=_Data(64, model.config.vocab_size), callbacks=[Measure()])
    trainer.train()
    ended = time.perf_counter()
    params = list(trainer.model.parameters())
    r = probe.result
    from torch.distributed.tensor import DTensor

    return {
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1],
        "sharded": all(isinstance(p, DTensor) for p in params),
        "P": sum(p.numel() * p.element_size() for p in params),
        "T": max(p.numel() * p.element_size() for p in params),
        "anon_growth": r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes,
        "rss_growth": r.cpu_rss_peak_bytes - r.cpu_rss_start_bytes,
        "setup_s": window["setup_s"],
        "step_s": (ended - window["first_step"]) / max(steps - 1, 1) if steps > 1 else float("nan"),
        "loss": trainer.state.log_history[-1].get("train_loss"),
    }


def measure_reload(repeats: int) -> dict:
    """Best-model reload on CPU: the plugin's whole path, its copy alone, and the stock Trainer's (median ms)."""
    import torch
    from peft import get_peft_model
    from transformers import Trainer, TrainingArguments

    from accelerate_memsafe.integrations import MemSafeTrainer
    from accelerate_memsafe.integrations import peft as peft_helpers
    from accelerate_memsafe.models import build_llama

    warnings.simplefilter("ignore")
    work = Path(tempfile.mkdtemp(prefix="memsafe-bench-trainer-reload-"))
    out = {}
    for name, cls in (("memsafe", MemSafeTrainer), ("stock", Trainer)):
        torch.manual_seed(0)
        model = get_peft_model(build_llama("tiny"), _lora())
        args = TrainingArguments(output_dir=str(work / name), max_steps=1, per_device_train_batch_size=2, save_strategy="steps",
                                 save_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
        trainer = cls(model=model, args=args, train_dataset=_Data(4, model.config.vocab_size, 8))
        trainer.train()
        trainer.state.best_model_checkpoint = str(work / name / "checkpoint-1")
        trainer.model.train()

        def timed(fn) -> float:
            walls = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                walls.append(time.perf_counter() - t)
            return statistics.median(walls) * 1e3

        out[f"{name}_reload_ms"] = timed(trainer._load_best_model)
        if name == "memsafe":
            peft_model = peft_helpers.find_peft_model(trainer.model)
            path, plan, _ = peft_helpers._plan_adapter(peft_model, trainer.state.best_model_checkpoint, "default")
            out["copy_ms"] = timed(functools.partial(peft_helpers.copy_file_into, path, plan))
            out["adapter_bytes"] = sum(t.numel() * t.element_size() for _, t in plan)
            out["tensors"] = len(plan)
    out["overhead_ms"] = out["memsafe_reload_ms"] - out["copy_ms"]
    return out


def _markdown(doc: dict) -> str:
    runs, reload = doc["runs"], doc["reload"]
    P, T = runs["memsafe"][1]["P"] / MIB, runs["memsafe"][1]["T"] / MIB
    lines = [
        "\n<!-- table: trainer-{}-2ranks -->\n".format(doc["model_size"]),
        f"Trainer load + setup + prepare, Llama `{doc['model_size']}` + LoRA r=8 (q, v), 2 gloo ranks, P = {P:.1f} MiB, "
        f"T = {T:.1f} MiB, {doc['steps']} steps ({doc['timestamp']}):\n\n",
        "| path | rank | distributed type | sharded | RssAnon growth (MiB) | RSS growth (MiB) | bound (MiB) | within bound | setup (s) | step (s) |\n",
        "|---|---|---|---|---|---|---|---|---|---|\n",
    ]
    for path in PATHS:
        for rank, r in enumerate(runs[path]):
            bound = doc["bound_mib"]
            lines.append(
                f"| {path} | {rank} | {r['distributed_type']} | {r['sharded']} | {r['anon_growth'] / MIB:.1f} | "
                f"{r['rss_growth'] / MIB:.1f} | {bound:.1f} | {r['anon_growth'] / MIB <= bound if rank else 'n/a'} | "
                f"{r['setup_s']:.2f} | {r['step_s']:.2f} |\n"
            )
    lines += [
        "<!-- /table -->\n",
        "\n<!-- table: trainer-reload-tiny -->\n",
        f"Best-model reload on CPU, Llama `tiny` + LoRA r=8 (q, v): {reload['tensors']} tensors, "
        f"{reload['adapter_bytes'] / 1024:.1f} KiB, median of {doc['repeats']} ({doc['timestamp']}):\n\n",
        "| path | reload (ms) | copy (ms) | overhead over the copy (ms) |\n",
        "|---|---|---|---|\n",
        f"| MemSafeTrainer._load_best_model | {reload['memsafe_reload_ms']:.2f} | {reload['copy_ms']:.2f} | {reload['overhead_ms']:.2f} |\n",
        f"| Trainer._load_best_model | {reload['stock_reload_ms']:.2f} | n/a | n/a |\n",
        "<!-- /table -->\n",
    ]
    return "".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-size", default="100m", help="Llama size from accelerate_memsafe.models.SIZES")
    parser.add_argument("--steps", type=int, default=3, help="training steps after the setup (the first is a warm-up)")
    parser.add_argument("--repeats", type=int, default=30, help="reloads timed (median)")
    parser.add_argument("--cache-dir", default=None, help="where the checkpoint is built (kept for reuse)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--quick", action="store_true", help="Llama small, 1 step, 5 reloads")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.model_size, args.steps, args.repeats = "small", 1, 5
    from accelerate_memsafe.models import save_llama

    cache = Path(args.cache_dir or os.path.join(tempfile.gettempdir(), "memsafe-bench-trainer"))
    model_dir = cache / f"llama-{args.model_size}"
    if not (model_dir / "config.json").exists():
        save_llama(model_dir, args.model_size)
    runs = {}
    for path in PATHS:
        out = tempfile.mkdtemp(prefix=f"memsafe-bench-trainer-{path}-")
        runs[path] = spawn(_worker, 2, (2, path, str(model_dir), out, args.steps), args.timeout, f"trainer {path}")
    m = runs["memsafe"][1]
    bound = (m["P"] / 2 + m["T"]) / MIB + 64
    doc = {
        "benchmark": "trainer", "model_size": args.model_size, "world_size": 2, "steps": args.steps, "repeats": args.repeats,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python benchmarks/trainer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "runs": runs, "bound_mib": bound,
        "rank1_anon_growth_mib": {p: runs[p][1]["anon_growth"] / MIB for p in PATHS},
        "memsafe_within_bound": all(r["anon_growth"] / MIB <= bound for r in runs["memsafe"][1:]),
        "stock_exceeds_bound": any(r["anon_growth"] / MIB > bound for r in runs["stock"][1:]),
        "ratio_rank1_anon": runs["memsafe"][1]["anon_growth"] / max(runs["stock"][1]["anon_growth"], 1),
        "reload": measure_reload(args.repeats),
    }
    print(json.dumps(doc))
    if args.markdown:
        print(f"{args.markdown}: " + ", ".join(write_tables(args.markdown, _markdown(doc))), file=sys.stderr)
    return doc


if __name__ == "__main__":
    main()
