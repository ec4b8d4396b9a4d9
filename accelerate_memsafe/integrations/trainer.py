"""transformers ``Trainer`` integration: best-model loading and adapter resume through the CPU-first path.

transformers 5.23's ``Trainer._load_best_model`` calls ``model.load_adapter(best_checkpoint, adapter)``
with no ``torch_device``: peft then reads the whole adapter onto the accelerator before copying it into the
parameters, at the end of training when free memory is lowest (and callbacks run too late to intercept it).
The resume path (``Trainer._load_from_checkpoint``) does the same. The mixin below reroutes both through
:func:`~accelerate_memsafe.integrations.peft.reload_adapters`: caches emptied first, one tensor at a time,
in place, training mode and ``requires_grad`` untouched.

It falls back to the Trainer's own methods (with a warning) when the peft/transformers versions are not
tested ones, and silently when the case is not an adapter checkpoint it handles (DeepSpeed, FSDP, a full
model file, a prompt-learning method, pickle adapter files, adapters the model does not have yet).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from .. import _compat
from .peft import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    adapter_file,
    check_device_memory,
    empty_device_caches,
    find_peft_model,
    reload_adapters,
)

logger = logging.getLogger(__name__)

_FULL_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def _saved_adapter_dirs(checkpoint: Path) -> list[str]:
    """Names of adapters saved in subfolders (peft's layout for non-default adapters)."""
    return sorted(
        d.name
        for d in checkpoint.iterdir()
        if d.is_dir() and ((d / ADAPTER_SAFE_WEIGHTS_NAME).is_file() or (d / ADAPTER_WEIGHTS_NAME).is_file())
    )


def plan_adapter_reload(model: Any, checkpoint: str | os.PathLike | None) -> tuple[Any, list[str]] | None:
    """Decides whether a checkpoint can be reloaded CPU-first into ``model``'s existing adapters.

    Args:
        model: The trainer's model (a ``PeftModel`` or a wrapper of one).
        checkpoint: The checkpoint directory the Trainer would load.

    Returns:
        ``(peft_model, adapter names to reload)``, or ``None`` when the Trainer's own path must run (no
        PEFT model, prompt learning, no safetensors adapter for an active adapter, a saved adapter the
        model does not have, or a full model file in the checkpoint).
    """
    peft_model = find_peft_model(model)
    if peft_model is None or checkpoint is None or not os.path.isdir(checkpoint):
        return None
    root = Path(checkpoint)
    if any((root / name).is_file() for name in _FULL_WEIGHTS):
        return None
    if any(cfg.is_prompt_learning for cfg in peft_model.peft_config.values()):
        return None
    saved = (["default"] if (root / ADAPTER_SAFE_WEIGHTS_NAME).is_file() or (root / ADAPTER_WEIGHTS_NAME).is_file() else [])
    saved += _saved_adapter_dirs(root)
    if not saved or any(name not in peft_model.peft_config for name in saved):
        return None  # the Trainer's load_adapter creates missing adapters; an in-place reload cannot
    if any(not adapter_file(root, name).is_file() for name in saved):
        return None  # pickle files: leave them to peft
    if any(name not in saved for name in peft_model.active_adapters):
        return None
    return peft_model, saved


def _adapter_bytes(checkpoint: str | os.PathLike) -> int:
    root = Path(checkpoint)
    files = [root / ADAPTER_SAFE_WEIGHTS_NAME, root / ADAPTER_WEIGHTS_NAME]
    files += [d / n for d in root.iterdir() if d.is_dir() for n in (ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)]
    return sum(f.stat().st_size for f in files if f.is_file())


def _model_device(model: Any) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


class MemSafeTrainerMixin:
    """Routes the Trainer's adapter reloads (``load_best_model_at_end`` and resume) through the CPU-first,
    in-place path. Put it first: ``class MyTrainer(MemSafeTrainerMixin, Trainer)``.

    Attributes:
        memsafe_check_memory: Compare the device memory needed with the free memory before reloading and
            raise :class:`~accelerate_memsafe.errors.MemoryBudgetError` (sizes in GiB) instead of an OOM.
        memsafe_last_reload: The :class:`~accelerate_memsafe.integrations.peft.ReloadStats` of the last
            CPU-first reload (one per adapter), for logging and tests.

    Example:
        >>> from transformers import Trainer
        >>> class MyTrainer(MemSafeTrainerMixin, Trainer):
        ...     pass
    """

    memsafe_check_memory: bool = True

    def _memsafe_reload(self, model: Any, checkpoint: str | None, what: str) -> bool:
        if getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False):
            return False  # those load their own checkpoint formats
        plan = plan_adapter_reload(model, checkpoint)
        if plan is None:
            return False
        peft_model, names = plan
        if not _compat.check_trainer_peft_versions():
            if self.memsafe_check_memory:
                size = _adapter_bytes(checkpoint)
                check_device_memory(
                    _model_device(peft_model), required_bytes=size, adapter_bytes=size,
                    what="with the Trainer's own `load_adapter` (the whole adapter on the device)", file=checkpoint,
                )
            return False
        empty_device_caches()
        stats = reload_adapters(peft_model, checkpoint, names, check_memory=self.memsafe_check_memory)
        logger.info(
            "accelerate_memsafe: %s: reloaded adapter(s) %s from %s CPU-first (%d tensors, %.1f MiB, largest %.1f MiB).",
            what, names, checkpoint, sum(s.tensors for s in stats), sum(s.bytes for s in stats) / 2**20,
            max(s.largest_tensor_bytes for s in stats) / 2**20,
        )
        self.memsafe_last_reload = stats
        return True

    def _load_best_model(self) -> None:
        checkpoint = self.state.best_model_checkpoint
        if self._memsafe_reload(self.model, checkpoint, "best model"):
            logger.info(f"Loaded best model from {checkpoint} (score: {self.state.best_metric}).")
            return
        super()._load_best_model()

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if self._memsafe_reload(self.model if model is None else model, resume_from_checkpoint, "resume"):
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)


class MemSafeTrainer(MemSafeTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`MemSafeTrainerMixin`: PEFT adapters are reloaded CPU-first for
    ``load_best_model_at_end`` and when resuming.

    Example:
        >>> # trainer = MemSafeTrainer(model=peft_model, args=TrainingArguments(..., load_best_model_at_end=True))
    """


__all__ = ["MemSafeTrainer", "MemSafeTrainerMixin", "plan_adapter_reload"]
