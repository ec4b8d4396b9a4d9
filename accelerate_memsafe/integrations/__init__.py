"""Integrations with libraries around accelerate: peft (CPU-first adapter reload) and the transformers
``Trainer`` (best-model loading and resume through that path).

``MemSafeTrainerMixin`` and ``MemSafeTrainer`` are imported lazily so that ``import accelerate_memsafe``
does not import ``transformers.Trainer``.

Example:
    >>> from accelerate_memsafe.integrations import reload_adapter
    >>> # class MyTrainer(MemSafeTrainerMixin, Trainer): ...
"""

from __future__ import annotations

from typing import Any

from .peft import ReloadStats, find_peft_model, reload_adapter, reload_adapters

__all__ = ["MemSafeTrainer", "MemSafeTrainerMixin", "ReloadStats", "find_peft_model", "reload_adapter", "reload_adapters"]


def __getattr__(name: str) -> Any:
    if name in ("MemSafeTrainer", "MemSafeTrainerMixin"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
