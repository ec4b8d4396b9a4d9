"""Workers for tests/distributed/test_trainer_fsdp2.py (module level so that spawn can pickle them).

One spawn runs everything a Trainer / TRL user meets, each next to the stock Trainer in the same processes:
the memory of model load + Trainer setup + ``prepare`` (Llama ``100m``), then training with evaluation,
checkpoints, ``load_best_model_at_end`` and a resume into another output directory (Llama ``small`` + LoRA),
with ``transformers.Trainer`` and TRL's ``SFTTrainer``.
"""

from __future__ import annotations

import ctypes
import gc
import os
import warnings
from typing import Any

from tests import releases

#: The scripted eval metric (lower is better): the best checkpoint is step 2, not the last one.
SCRIPT = [3.0, 1.0, 2.0, 4.0]
VOCAB = 4096
FSDP2_ARGS = {"fsdp": True, "fsdp_config": {"version": 2, "cpu_ram_efficient_loading": True}}


def cpu_first_versions() -> bool:
    """Whether the Trainer integration reloads adapters CPU-first with the installed peft / transformers: with versions
    it was not tested with (transformers 5.17 in the GPU machines' image) it falls back to the Trainer's own loading
    by design."""
    from accelerate_memsafe import _compat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _compat.check_trainer_peft_versions()


class _Stop(Exception):
    """Raised at ``on_train_begin`` to end a run once the model is prepared (memory runs need no step)."""


class _EnvRestored:
    """Runs share a process: accelerate exports ``ACCELERATE_USE_FSDP`` once an FSDP plugin is built, and
    ``TrainingArguments`` ``FSDP_CPU_RAM_EFFICIENT_LOADING`` (which makes transformers load on meta): each run
    starts from the launch environment, as in its own process."""

    def __enter__(self) -> None:
        self.saved = dict(os.environ)

    def __exit__(self, *exc) -> None:
        os.environ.clear()
        os.environ.update(self.saved)


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap of an earlier run must not look like headroom


def _lora(modules_to_save: bool = True):
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                      modules_to_save=["lm_head"] if modules_to_save else None)


def _load(model_dir: str, memsafe: bool):
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    if memsafe:
        return accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir)


def _dataset(n: int, seed: int, hf: bool = False):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, 16), generator=g)
    if hf:
        import datasets

        return datasets.Dataset.from_dict({"input_ids": ids.tolist()})

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    return Data()


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _scripted(base: type) -> type:
    class Scripted(base):
        def evaluate(self, *args, **kwargs):
            metrics = super().evaluate(*args, **kwargs)
            metrics["eval_scripted"] = SCRIPT[self._evals % len(SCRIPT)]
            self._evals += 1
            return metrics

    return Scripted


def _args(out: str, *, sft: bool, fsdp2: bool, max_steps: int = 4, **extra: Any):
    from transformers import TrainingArguments

    kwargs = dict(
        output_dir=out, max_steps=max_steps, per_device_train_batch_size=2, per_device_eval_batch_size=4,
        learning_rate=5e-2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="scripted", greater_is_better=False,
        report_to=[], disable_tqdm=True, logging_steps=1, seed=0, data_seed=0, save_total_limit=2,
    )
    # the stock Trainer cannot run FSDP2 on CPU: with `use_cpu=True` it runs DDP over gloo (without, it refuses fsdp)
    kwargs |= FSDP2_ARGS if fsdp2 else {} if sft else {"use_cpu": True}
    kwargs |= extra
    if sft:
        from trl import SFTConfig

        # TRL's defaults otherwise: gradient checkpointing on (transformers' own, through peft's input grads)
        return SFTConfig(**kwargs, bf16=False, max_length=16, packing=False)
    return TrainingArguments(**kwargs)


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _adapter(model) -> dict:
    """Every trainable tensor (LoRA weights, ``modules_to_save`` copy), gathered whole."""
    return {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}


def _snapshots():
    """A callback keeping the trainable tensors as they were saved at each checkpoint (whatever the format:
    peft's adapter files with FULL_STATE_DICT, DCP folders with SHARDED_STATE_DICT)."""
    from transformers import TrainerCallback

    class Snapshots(TrainerCallback):
        saved: dict[int, dict] = {}

        def on_save(self, args, state, control, model=None, **kwargs):
            self.saved[state.global_step] = _adapter(model)

    return Snapshots()


def _recorded_best(checkpoint: str) -> str | None:
    import json

    path = os.path.join(checkpoint, "trainer_state.json")
    return json.loads(open(path).read()).get("best_model_checkpoint") if os.path.isfile(path) else None


def _records(trainer, hook: str | None = None) -> list[tuple]:
    return [(r.hook, r.stage, r.status) for r in trainer.memsafe_plugin.report.records if hook is None or r.hook == hook]


def _memory_run(model_dir: str, out: str, *, memsafe: bool) -> dict[str, Any]:
    """Peak RssAnon over model load + Trainer setup + ``prepare`` (the run stops at ``on_train_begin``)."""
    import torch
    from transformers import Trainer, TrainerCallback

    from accelerate_memsafe.integrations import MemSafeTrainer
    from accelerate_memsafe.memory.probe import MemoryProbe

    _trim()
    probe = MemoryProbe(torch.device("cpu"), track_tensors=False)
    probe.__enter__()

    class StopAfterPrepare(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            probe.__exit__(None, None, None)
            raise _Stop

    from peft import get_peft_model

    args = _args(out, sft=False, fsdp2=memsafe, eval_strategy="no", save_strategy="no", load_best_model_at_end=False)
    model = get_peft_model(_load(model_dir, memsafe), _lora(modules_to_save=False))
    cls = MemSafeTrainer if memsafe else Trainer
    trainer = cls(model=model, args=args, train_dataset=_dataset(8, 0), callbacks=[StopAfterPrepare()])
    try:
        trainer.train()
    except _Stop:
        pass
    from torch.distributed.tensor import DTensor

    params = list(trainer.model.named_parameters())
    res = {
        "grown": probe.result.cpu_anon_peak_bytes - probe.result.cpu_anon_start_bytes,
        "model_bytes": sum(p.numel() * p.element_size() for _, p in params),
        "largest": max(p.numel() * p.element_size() for _, p in params),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "dtensor": all(isinstance(p, DTensor) for _, p in params),
        "prepare": _records(trainer, "prepare") if memsafe else [],
    }
    del trainer, model, params
    return res


#: What ``accelerate launch --use_fsdp --fsdp_version 2 --fsdp_cpu_ram_efficient_loading true`` exports.
ACCELERATE_LAUNCH_FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}


def _train(out: str, model_dir: str, *, plugin: bool, sft: bool, resume: str | None = None,
           launch: str = "torchrun", load_best: bool = True) -> dict[str, Any]:
    """Trains LoRA on Llama ``small`` with FSDP2 for 4 steps (eval + checkpoint each step, the best is step 2) and
    loads the best at the end. ``plugin=False``: ``MemSafePlugin(stages=[])``, i.e. the stock Trainer and stock
    accelerate, on the CPU FSDP2 state (the only way the stock Trainer runs FSDP2 on CPU). FSDP2 comes from the
    ``TrainingArguments`` (``launch="torchrun"``) or from the variables ``accelerate launch`` exports."""
    import torch
    from peft import get_peft_model
    from torch.distributed.tensor import DTensor
    from transformers import Trainer

    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.integrations import MemSafeTrainerMixin

    if launch == "accelerate":
        os.environ.update(ACCELERATE_LAUNCH_FSDP2)
    # first: it forms the process group from_pretrained needs
    args = _args(out, sft=sft, fsdp2=launch == "torchrun", load_best_model_at_end=load_best)
    if sft:
        from trl import SFTTrainer

        base = SFTTrainer
        # no `modules_to_save=["lm_head"]`: TRL's fused LM head reads the sharded head outside its FSDP2 unit, and
        # its gradients differ between ranks (with stock accelerate's FSDP2 as well)
        extra = {"processing_class": _tokenizer(), "peft_config": _lora(modules_to_save=False)}
        model = _load(model_dir, plugin)
    else:
        base = Trainer
        extra = {}
        torch.manual_seed(0)  # the LoRA init (SFTTrainer seeds it itself)
        model = get_peft_model(_load(model_dir, plugin), _lora())
    cls = _scripted(type("MemSafe" + base.__name__, (MemSafeTrainerMixin, base), {}))
    snapshots = _snapshots()
    trainer = cls(model=model, args=args, train_dataset=_dataset(16, 1, hf=sft), eval_dataset=_dataset(4, 2, hf=sft),
                  memsafe_plugin=MemSafePlugin() if plugin else MemSafePlugin(stages=[]), callbacks=[snapshots], **extra)
    trainer._evals = 0
    if resume is not None:
        trainer._evals = int(resume.rsplit("-", 1)[1])  # the metric script continues where the resumed run was
    trainer.train(resume_from_checkpoint=resume)
    best = trainer.state.best_model_checkpoint
    res = {
        "best": best,
        "adapter": _adapter(trainer.model),
        "saved": snapshots.saved,
        "state_dict_type": str(trainer.accelerator.state.fsdp_plugin.state_dict_type).rsplit(".", 1)[-1],
        # the best checkpoint as recorded in checkpoint 2 (the best step) by the save itself
        "recorded_best": _recorded_best(os.path.join(out, "checkpoint-2")),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "distributed_type": str(trainer.accelerator.distributed_type),
        "sharded": sorted(n for n, p in trainer.model.named_parameters() if isinstance(p, DTensor)),
        "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad),
        "checkpoints": sorted(os.listdir(out)),
        "marked": sorted(c for c in os.listdir(out) if os.path.isfile(os.path.join(out, c, ".memsafe_complete.json"))),
        "records": _records(trainer),
        "summary": trainer.memsafe_summary(),
        "reloads": [(r.stage, r.details) for r in trainer.memsafe_plugin.report.records
                    if r.hook == "load_state" and r.status == "ran" and not r.stage.startswith("transformers.")],
    }
    del trainer, model
    _trim()
    return res


def trainer_suite(rank: int, world_size: int, *, big_dir: str, small_dir: str, out: str) -> dict[str, Any]:
    """Memory of the 100m load (plugin first, in a clean process; then the stock Trainer), then Trainer and
    SFTTrainer runs: stock, plugin, and the plugin resumed from checkpoint 2 after the run's folder was moved
    (its recorded best checkpoint path no longer exists)."""
    import time

    import torch.distributed as dist

    warnings.simplefilter("ignore")
    res: dict[str, Any] = {"memory": {}, "times": {}}

    def timed(key: str, fn, *args, **kwargs):
        t = time.perf_counter()
        with _EnvRestored():
            out = fn(*args, **kwargs)
        res["times"][key] = time.perf_counter() - t
        return out

    for kind in ("memsafe", "stock"):
        res["memory"][kind] = timed(f"memory-{kind}", _memory_run, big_dir, f"{out}/mem-{kind}", memsafe=kind == "memsafe")
    for sft in (False, True):
        name = "sft" if sft else "trainer"
        launch = "accelerate" if sft else "torchrun"  # both launch styles, one each
        res[name] = {}
        for kind in ("stock", "memsafe"):
            # the stock Trainer of the FULL_STATE_DICT run cannot reload its best adapter before accelerate 1.15: it
            # trains and saves the same, and the test compares its saved best adapter instead
            load_best = kind == "memsafe" or sft or releases.stock_reloads_a_full_state_dict_adapter()
            res[name][kind] = timed(f"{name}-{kind}", _train, f"{out}/{name}-{kind}", small_dir, plugin=kind == "memsafe",
                                    sft=sft, launch=launch, load_best=load_best)
        if rank == 0:
            os.rename(f"{out}/{name}-memsafe", f"{out}/{name}-moved")
        dist.barrier()
        res[name]["resumed"] = timed(f"{name}-resumed", _train, f"{out}/{name}-resumed", small_dir, plugin=True, sft=sft,
                                     resume=f"{out}/{name}-moved/checkpoint-2", launch=launch)
    return res


def dpo_run(rank: int, world_size: int, *, model_dir: str, out: str, plugin: bool) -> dict[str, Any]:
    """TRL's ``DPOTrainer`` (full fine-tuning; TRL loads the reference model from the policy's path on every rank and
    shards it with its own ``fully_shard``) with :class:`MemSafeTrainerMixin`, FSDP2 from the arguments, 3 steps.
    ``plugin``: ``MemSafePlugin()`` and the policy from ``accelerate_memsafe.from_pretrained`` (rank 1 on meta);
    else ``MemSafePlugin(stages=[])`` and transformers' load on every rank. Returns the losses and the full trained
    parameters."""
    import datasets
    import torch
    from trl import DPOConfig, DPOTrainer

    from accelerate_memsafe import MemSafePlugin
    from accelerate_memsafe.integrations import MemSafeTrainerMixin

    args = DPOConfig(output_dir=out, max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2, report_to=[],
                     disable_tqdm=True, logging_steps=1, seed=0, data_seed=0, save_strategy="no", bf16=False,
                     max_length=24, **FSDP2_ARGS)
    g = torch.Generator().manual_seed(0)

    def words(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(4, 200, (n,), generator=g))

    rows = [{"prompt": words(5), "chosen": " " + words(4), "rejected": " " + words(4)} for _ in range(8)]
    model = _load(model_dir, plugin)
    cls = type("MemSafeDPOTrainer", (MemSafeTrainerMixin, DPOTrainer), {})
    trainer = cls(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=_tokenizer(),
                  memsafe_plugin=MemSafePlugin() if plugin else MemSafePlugin(stages=[]))
    trainer.train()
    return {"losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "params": {n: _full(p) for n, p in trainer.model.named_parameters()},
            "ref_sharded": trainer.ref_model is not None and type(trainer.ref_model).__name__.startswith("FSDP")}
