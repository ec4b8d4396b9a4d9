"""transformers ``Trainer`` integration: the whole plugin for ``Trainer`` and TRL users.

``MemSafeTrainerMixin`` (and ``MemSafeTrainer = MemSafeTrainerMixin + Trainer``) gives a Trainer:

1. **The plugin's accelerator.** ``Trainer.create_accelerator_and_postprocess`` runs unchanged, but builds an
   :class:`accelerate_memsafe.Accelerator` carrying the plugin (``memsafe_plugin=``, else one from the
   ``ACCELERATE_MEMSAFE_*`` variables, else the default), configured from the ``TrainingArguments`` and the
   launch environment as the stock one is. Every ``prepare`` stage therefore runs for the Trainer's model
   (meta placement, rank-0 distribution, buffer checks, optimizer offload), and the Trainer's
   ``is_fsdp_enabled`` and save paths follow the state the plugin set up. On a machine without an accelerator,
   ``fsdp_config={"version": 2}`` (or ``accelerate launch --use_fsdp --fsdp_version 2``) under a multi-process
   launch runs real FSDP2 over gloo, as :doc:`cpu_fsdp2` describes.
2. **Atomic checkpoints.** ``_save_checkpoint`` writes into a temporary directory renamed into place once
   complete; ``save_total_limit`` rotation runs after that and counts complete checkpoints only;
   ``resume_from_checkpoint=True`` picks the newest complete checkpoint (what a killed save left is repaired
   first); a best checkpoint lost on resume is found again.
3. **CPU-first reloads.** The optimizer state is read in place, straight into CPU tensors; PEFT adapters are
   reloaded tensor by tensor in place (each rank's own shard under FSDP2) for resume and
   ``load_best_model_at_end`` (transformers' ``_load_best_model`` / ``_load_from_checkpoint`` read the whole
   adapter onto the device first).
4. **Reports.** The same per-stage records as accelerate runs get (one ``prepare`` pipeline for the model,
   one ``save_state`` per checkpoint, one ``load_state`` per reload), written to ``report_path``, and a
   one-line summary logged by the Trainer's logger at the end of ``train``.

Every addition follows the plugin's stage list: ``MemSafeTrainer(memsafe_plugin=MemSafePlugin(stages=[]))``
behaves as the stock Trainer (used for differential tests). Adapter reloads fall back to the Trainer's own
methods (with a warning) when the peft/transformers versions are not tested ones, and silently when the case
is not one they handle (DeepSpeed, FSDP1, a full model file, a prompt-learning method, pickle adapter files,
adapters the model does not have yet, trainable parameters outside the adapters under FSDP2).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer

from .. import _compat
from ..errors import CheckpointError
from ..io import atomic
from ..plugin import MemSafePlugin
from . import trainer_checkpoints
from .peft import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    adapter_file,
    adapter_parameter_map,
    check_device_memory,
    empty_device_caches,
    find_peft_model,
    reload_adapters,
)
from .trainer_stages import TRAINER_SCHEDULER_NAME, run_trainer_hook, trainer_pipeline

logger = logging.getLogger(__name__)

_FULL_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")


def _saved_adapter_dirs(checkpoint: Path) -> list[str]:
    """Names of adapters saved in subfolders (peft's layout for non-default adapters)."""
    return sorted(
        d.name
        for d in checkpoint.iterdir()
        if d.is_dir() and ((d / ADAPTER_SAFE_WEIGHTS_NAME).is_file() or (d / ADAPTER_WEIGHTS_NAME).is_file())
    )


def adapter_reload_plan(model: Any, checkpoint: str | os.PathLike | None, *, sharded: bool = False) -> tuple[Any, list[str]] | str:
    """Decides whether a checkpoint can be reloaded CPU-first into ``model``'s existing adapters.

    Args:
        model: The trainer's model (a ``PeftModel`` or a wrapper of one).
        checkpoint: The checkpoint directory the Trainer would load.
        sharded: The model is FSDP2-sharded: the Trainer would load the whole model from its FSDP files, so
            every trainable parameter must be in the adapter files (the frozen ones cannot have changed).

    Returns:
        ``(peft_model, adapter names to reload)``, or the reason the Trainer's own path must run.
    """
    peft_model = find_peft_model(model)
    if peft_model is None:
        return "no PEFT model"
    if checkpoint is None or not os.path.isdir(checkpoint):
        return f"no checkpoint directory {checkpoint!r}"
    root = Path(checkpoint)
    full = [name for name in _FULL_WEIGHTS if (root / name).is_file()]
    if full:
        return f"{root / full[0]} is a full model file: the Trainer loads it"
    if any(cfg.is_prompt_learning for cfg in peft_model.peft_config.values()):
        return "a prompt-learning adapter: the Trainer's `load_adapter` handles it"
    saved = (["default"] if (root / ADAPTER_SAFE_WEIGHTS_NAME).is_file() or (root / ADAPTER_WEIGHTS_NAME).is_file() else [])
    saved += _saved_adapter_dirs(root)
    if not saved:
        return f"no adapter file in {root}"
    missing = [name for name in saved if name not in peft_model.peft_config]
    if missing:
        return f"the checkpoint holds adapter(s) {missing} the model does not have: the Trainer's `load_adapter` creates them"
    pickled = [name for name in saved if not adapter_file(root, name).is_file()]
    if pickled:
        return f"adapter(s) {pickled} saved as pickle: peft loads them"
    inactive = [name for name in peft_model.active_adapters if name not in saved]
    if inactive:
        return f"active adapter(s) {inactive} not in the checkpoint"
    if sharded:
        covered = {name for a in saved for name, _ in adapter_parameter_map(peft_model, a).values()}
        outside = [n for n, p in peft_model.named_parameters() if p.requires_grad and n not in covered]
        if outside:
            return (f"{len(outside)} trainable parameter(s) outside the adapters (e.g. `{outside[0]}`): the Trainer "
                    "loads the whole model from its FSDP files")
    return peft_model, saved


def plan_adapter_reload(model: Any, checkpoint: str | os.PathLike | None) -> tuple[Any, list[str]] | None:
    """:func:`adapter_reload_plan` for an unsharded model, ``None`` where the Trainer's own path must run.

    Returns:
        ``(peft_model, adapter names to reload)``, or ``None``.
    """
    plan = adapter_reload_plan(model, checkpoint)
    return None if isinstance(plan, str) else plan


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


def _requested_plugin(plugin: MemSafePlugin | None) -> MemSafePlugin:
    from ..accelerator import _select_plugin

    if plugin is not None:
        if not isinstance(plugin, MemSafePlugin):
            raise TypeError(f"`memsafe_plugin` must be a MemSafePlugin, got {type(plugin).__name__}.")
        return plugin
    return _select_plugin(None) or MemSafePlugin()


class MemSafeTrainerMixin:
    """Gives a ``transformers.Trainer`` (or a subclass, such as TRL's ``SFTTrainer``) the whole plugin: its
    accelerator carries a :class:`~accelerate_memsafe.MemSafePlugin`, checkpoints are atomic, resume and
    best-model reloads are CPU-first, and the plugin's records cover the run. Put it first:
    ``class MyTrainer(MemSafeTrainerMixin, SFTTrainer)``; pass ``memsafe_plugin=MemSafePlugin(...)`` to
    configure it (default: from ``ACCELERATE_MEMSAFE_*`` variables, else ``MemSafePlugin()``).

    Attributes:
        memsafe_plugin: The plugin of the Trainer's accelerator.
        memsafe_check_memory: Compare the device memory needed with the free memory before reloading an
            adapter and raise :class:`~accelerate_memsafe.errors.MemoryBudgetError` (sizes in GiB) instead of an OOM.
        memsafe_last_reload: The :class:`~accelerate_memsafe.integrations.peft.ReloadStats` of the last
            CPU-first adapter reload (one per adapter), for logging and tests.

    Example:
        >>> from transformers import Trainer
        >>> class MyTrainer(MemSafeTrainerMixin, Trainer):
        ...     pass
        >>> # trainer = MyTrainer(model=model, args=args, train_dataset=ds, memsafe_plugin=MemSafePlugin(optimizer_offload=True))
    """

    memsafe_check_memory: bool = True

    def __init__(self, *args: Any, memsafe_plugin: MemSafePlugin | None = None, **kwargs: Any) -> None:
        self.memsafe_plugin = _requested_plugin(memsafe_plugin)
        super().__init__(*args, **kwargs)

    # -- the accelerator ------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        from ..accelerator import Accelerator, MemSafeMixin

        plugin = getattr(self, "memsafe_plugin", None) or _requested_plugin(None)
        with _compat.trainer_accelerator_factory(functools.partial(Accelerator, plugins=[plugin])):
            super().create_accelerator_and_postprocess()
        if not isinstance(self.accelerator, MemSafeMixin):
            # a transformers version that builds its accelerator otherwise: give the plugin to the one it built
            plugin.attach(self.accelerator)
            self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None
        self.memsafe_plugin = self.accelerator.memsafe_plugin

    # -- train: resume from the newest complete checkpoint, log the summary -----------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        resume_from_checkpoint = self._memsafe_resume_point(resume_from_checkpoint)
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            self._memsafe_log_summary()

    def _memsafe_atomic(self) -> bool:
        return "atomic_checkpoint" in self.memsafe_plugin.stage_names("save_state")

    def _memsafe_collectives(self, what: str) -> Any:
        import torch.distributed as dist

        if self.args.world_size > 1 and dist.is_available() and dist.is_initialized():
            from ..distributed.collectives import Collectives

            return Collectives(what, timeout_s=self.memsafe_plugin.collective_timeout_s)
        return None

    def _memsafe_resume_point(self, resume: str | bool | None) -> str | bool | None:
        """Repairs what a killed save left in ``output_dir``, then resolves ``resume_from_checkpoint=True`` to
        the newest complete checkpoint and refuses an incomplete one given by path (rank 0 decides)."""
        if resume is False:
            return None
        if not self._memsafe_atomic():
            return resume
        # without a resume no other rank reads the checkpoints: rank 0 repairs alone (its first save waits for it)
        coll = self._memsafe_collectives("trainer_resume") if resume is not None else None
        choice: Any = None
        if self.args.process_index == 0:
            try:
                repaired = trainer_checkpoints.repair_all(self.args.output_dir)
                if repaired:
                    logger.warning("accelerate_memsafe: removed the unfinished save(s) of %s in %s (a save was killed); "
                                   "the checkpoints before them are intact.", repaired, self.args.output_dir)
                if resume is True:
                    found = trainer_checkpoints.newest_complete(self.args.output_dir, world_size=self.args.world_size)
                    choice = str(found) if found is not None else ValueError(
                        f"No valid checkpoint found in output directory ({self.args.output_dir}): it holds no "
                        "complete `checkpoint-<step>` directory.")
                elif resume is not None:
                    atomic.check_loadable(resume, world_size=self.args.world_size)
                    choice = resume
            except Exception as exc:  # every rank raises it, none waits for rank 0 in the broadcast
                choice = exc if isinstance(exc, (CheckpointError, OSError, ValueError)) else RuntimeError(f"{type(exc).__name__}: {exc}")
        if coll is not None:
            choice = coll.broadcast_object(choice, what="the checkpoint to resume from")
        if isinstance(choice, Exception):
            raise choice
        return choice if resume is not None else None

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: str | None, trial: Any) -> Any:
        out = super()._init_training_state(max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial)
        state_file = Path(resume_from_checkpoint or "") / "trainer_state.json"
        if resume_from_checkpoint is None or not state_file.is_file() or not self._memsafe_atomic():
            return out
        recorded = json.loads(state_file.read_text()).get("best_model_checkpoint")
        best_step = self.state.best_global_step
        if recorded is None and not best_step:
            return out
        found = trainer_checkpoints.locate_best(
            recorded, best_step, search=[Path(resume_from_checkpoint).parent, self._get_output_dir(trial)],
            world_size=self.args.world_size,
        )
        if found is not None and found != self.state.best_model_checkpoint:
            logger.warning("accelerate_memsafe: the best checkpoint (step %s) recorded as %r is %s.", best_step, recorded, found)
            self.state.best_model_checkpoint = found
        return out

    # -- checkpoints ----------------------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        pipeline = trainer_pipeline(self.memsafe_plugin, "save_state")
        if not pipeline.names("save_state"):
            return super()._save_checkpoint(model, trial)
        final = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        ctx = self.accelerator._memsafe_context("save_state")
        ctx.model = model
        ctx.directory = final
        if self.args.save_on_each_node and self.args.world_size > 1:
            ctx.scratch["trainer_skip_atomic"] = "save_on_each_node: every node writes its own copy; the Trainer saves it"
        limit = self.args.save_total_limit
        ctx.scratch["trainer_rotation"] = (limit, lambda: self.state.best_model_checkpoint)

        def upstream(c: Any) -> None:
            if c.scratch.get("trainer_skip_atomic"):
                return super(MemSafeTrainerMixin, self)._save_checkpoint(model, trial)
            self.args.save_total_limit = None  # the stage rotates once the new checkpoint is complete
            try:
                return super(MemSafeTrainerMixin, self)._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = limit

        try:
            run_trainer_hook(pipeline, ctx, upstream, "transformers.Trainer._save_checkpoint")
        finally:
            self.accelerator._memsafe_finish()

    def _memsafe_reload_adapters(self, model: Any, checkpoint: str | None, what: str) -> Any:
        """Reloads ``model``'s adapters from ``checkpoint`` CPU-first; returns the stats, or why it does not apply."""
        if getattr(self, "is_deepspeed_enabled", False):
            return "DeepSpeed loads its own checkpoint format"
        sharded = bool(getattr(self, "is_fsdp_enabled", False))
        if sharded and not getattr(self.accelerator, "is_fsdp2", False):
            return "FSDP1: the Trainer loads its own checkpoint format"
        plan = adapter_reload_plan(model, checkpoint, sharded=sharded)
        if isinstance(plan, str):
            return plan
        peft_model, names = plan
        if not _compat.check_trainer_peft_versions():
            if self.memsafe_check_memory:
                size = _adapter_bytes(checkpoint)
                check_device_memory(
                    _model_device(peft_model), required_bytes=size, adapter_bytes=size,
                    what="with the Trainer's own `load_adapter` (the whole adapter on the device)", file=checkpoint,
                )
            return "peft / transformers versions not tested: the Trainer's `load_adapter` loads it"
        empty_device_caches()
        stats = reload_adapters(peft_model, checkpoint, names, check_memory=self.memsafe_check_memory)
        logger.info(
            "accelerate_memsafe: %s: reloaded adapter(s) %s from %s CPU-first (%d tensors, %.1f MiB, largest %.1f MiB).",
            what, names, checkpoint, sum(s.tensors for s in stats), sum(s.bytes for s in stats) / 2**20,
            max(s.largest_tensor_bytes for s in stats) / 2**20,
        )
        self.memsafe_last_reload = stats
        return stats

    def _memsafe_load(self, names: tuple[str, ...], directory: str, upstream: Any, upstream_name: str, **scratch: Any) -> None:
        pipeline = trainer_pipeline(self.memsafe_plugin, "load_state", names)
        if not pipeline.names("load_state"):
            upstream(None)
            return
        ctx = self.accelerator._memsafe_context("load_state")
        ctx.directory = directory
        ctx.model = scratch.pop("model", None)
        ctx.scratch.update(scratch)
        try:
            run_trainer_hook(pipeline, ctx, upstream, upstream_name)
        finally:
            self.accelerator._memsafe_finish()

    def _load_best_model(self) -> None:
        checkpoint = self.state.best_model_checkpoint
        model = self.model

        def reload() -> Any:
            stats = self._memsafe_reload_adapters(model, checkpoint, "best model")
            if not isinstance(stats, str):
                logger.info(f"Loaded best model from {checkpoint} (score: {self.state.best_metric}).")
            return stats

        def upstream(ctx: Any) -> None:
            super(MemSafeTrainerMixin, self)._load_best_model()

        self._memsafe_load(("peft_cpu_reload",), checkpoint, upstream, "transformers.Trainer._load_best_model",
                           model=model, trainer_adapter_reload=reload)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        target = self.model if model is None else model

        def reload() -> Any:
            return self._memsafe_reload_adapters(target, resume_from_checkpoint, "resume")

        def upstream(ctx: Any) -> None:
            super(MemSafeTrainerMixin, self)._load_from_checkpoint(resume_from_checkpoint, model)

        self._memsafe_load(("peft_cpu_reload",), resume_from_checkpoint, upstream,
                           "transformers.Trainer._load_from_checkpoint", model=target, trainer_adapter_reload=reload)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        skip = None
        if getattr(self, "is_deepspeed_enabled", False):
            skip = "DeepSpeed loads the optimizer with the model"
        elif getattr(self, "is_fsdp_enabled", False) and not getattr(self.accelerator, "is_fsdp2", False):
            skip = "FSDP1 optimizer state is flattened; the Trainer loads it"
        elif getattr(self, "is_fsdp_xla_enabled", False):
            skip = "XLA FSDP: the Trainer loads it"

        def upstream(ctx: Any) -> None:
            if ctx is not None and "trainer_optimizer_plan" in ctx.scratch:
                self._memsafe_load_scheduler(checkpoint)  # the stage reads the optimizer in `after`
            else:
                super(MemSafeTrainerMixin, self)._load_optimizer_and_scheduler(checkpoint)

        self._memsafe_load(("optimizer_cpu_reload",), checkpoint, upstream,
                           "transformers.Trainer._load_optimizer_and_scheduler", model=self.model,
                           trainer_optimizer=getattr(self.optimizer, "optimizer", self.optimizer),
                           trainer_skip_optimizer=skip)

    def _memsafe_load_scheduler(self, checkpoint: str) -> None:
        """The scheduler half of ``Trainer._load_optimizer_and_scheduler`` (same file, same checks)."""
        import warnings

        from transformers.trainer_pt_utils import reissue_pt_warnings
        from transformers.utils import check_torch_load_is_safe

        with warnings.catch_warnings(record=True) as caught_warnings:
            check_torch_load_is_safe()
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, TRAINER_SCHEDULER_NAME), weights_only=True))
        reissue_pt_warnings(caught_warnings)

    # -- report -----------------------------------------------------------------------------------------
    def memsafe_summary(self) -> str:
        """One line saying what the plugin did for this Trainer on this rank (from the plugin's records)."""
        from .trainer_report import summary_line

        return summary_line(self.memsafe_plugin.report, rank=self.args.process_index,
                            report_path=self.memsafe_plugin.report_path)

    def _memsafe_log_summary(self) -> None:
        from transformers.trainer import logger as trainer_logger

        try:
            trainer_logger.info(self.memsafe_summary())
        except Exception as exc:  # a summary never hides the training's own outcome
            logger.debug("accelerate_memsafe: no summary (%s)", exc)


class MemSafeTrainer(MemSafeTrainerMixin, Trainer):
    """``transformers.Trainer`` with :class:`MemSafeTrainerMixin`: the plugin's accelerator, atomic
    checkpoints, CPU-first optimizer and adapter reloads, and the plugin's records.

    Example:
        >>> # args = TrainingArguments("out", fsdp="full_shard", fsdp_config={"version": 2, "cpu_ram_efficient_loading": True})
        >>> # model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, "ckpt/")
        >>> # trainer = MemSafeTrainer(model=model, args=args, train_dataset=ds)
    """


__all__ = ["MemSafeTrainer", "MemSafeTrainerMixin", "adapter_reload_plan", "plan_adapter_reload"]
