"""A thin ``accelerate.Accelerator`` subclass that routes ``prepare`` / ``load_state`` / ``save_state`` /
``save_model`` through the plugin's pipeline. All the work is in stages; this file only routes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from . import _compat, walk
from .errors import ConfigError
from .env import launch_env, memsafe_variables
from .memory.report import MemoryReport
from .pipeline import HookContext, Pipeline
from .plugin import MemSafePlugin


def _accelerator_device_available() -> bool:
    return torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()


def _wants_cpu_fsdp2(fsdp_plugin: Any) -> bool:
    env = launch_env()
    if _accelerator_device_available() or env.world_size <= 1:
        return False
    if fsdp_plugin is not None:
        return getattr(fsdp_plugin, "fsdp_version", 1) == 2
    return env.use_fsdp and env.fsdp_version == 2


def unpin_cpu_offload(fsdp_plugin: Any) -> bool:
    """Turns off pinning in the plugin's FSDP2 ``CPUOffloadPolicy`` (returns whether it changed anything).

    ``FullyShardedDataParallelPlugin(cpu_offload=True)`` becomes ``CPUOffloadPolicy(pin_memory=True)``, and
    FSDP2 pins offloaded shards through the accelerator runtime: on a machine without one that raises
    "Cannot access accelerator device when none is available". Pinning only speeds host-to-device
    copies, which a CPU-only run never makes, so the CPU FSDP2 path drops it.

    Example:
        >>> from torch.distributed.fsdp import CPUOffloadPolicy
        >>> from types import SimpleNamespace
        >>> plugin = SimpleNamespace(cpu_offload=CPUOffloadPolicy())
        >>> unpin_cpu_offload(plugin), plugin.cpu_offload.pin_memory
        (True, False)
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    policy = getattr(fsdp_plugin, "cpu_offload", None)
    if isinstance(policy, CPUOffloadPolicy) and policy.pin_memory:
        fsdp_plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        return True
    return False


def _fsdp_plugin_from_env() -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin() if launch_env().use_fsdp else None


def _parallelism_config_from_env() -> Any:
    """accelerate's ``ParallelismConfig()`` (sizes from ``PARALLELISM_CONFIG_*``) when the launch asks for
    one (``accelerate launch --use_parallelism_config``), as ``Accelerator.__init__`` builds it."""
    if not launch_env().use_parallelism_config:
        return None
    from accelerate.parallelism_config import ParallelismConfig

    return ParallelismConfig()


@contextlib.contextmanager
def _upstream_overrides(accelerator: Any, scratch: dict) -> Iterator[None]:
    """Temporary changes around accelerate's own ``save_state`` / ``load_state``, asked for by stages.

    - ``upstream_skips_optimizers``: a stage (``optimizer_cpu_reload``) reads the optimizer state itself,
      in place and straight into CPU tensors, so accelerate's load must not read it a second time.
    - ``upstream_skips_models``: a stage (``peft_cpu_reload``) reloads every prepared model in place,
      CPU-first and tensor by tensor, so accelerate's load must not read the model files again. ``_models``
      is left as it is (the user's ``register_load_state_pre_hook`` hooks receive the same models as
      without the plugin); a pre-hook registered last empties the list accelerate then loads from.
    - ``upstream_explicit_dir``: a stage (``atomic_checkpoint``) resolved the automatic checkpoint name
      into ``ctx.directory`` (a temporary directory); accelerate must write there, not pick its own.
    """
    saved_opts = saved_naming = None
    config = getattr(accelerator, "project_configuration", None)
    if scratch.get("upstream_skips_optimizers"):
        saved_opts, accelerator._optimizers = accelerator._optimizers, []
    skip_models = None
    if scratch.get("upstream_skips_models"):
        # accelerate passes the same list to the pre-hooks and then to `load_accelerator_state`.
        skip_models = accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())
    if scratch.get("upstream_explicit_dir") and config is not None and config.automatic_checkpoint_naming:
        saved_naming, config.automatic_checkpoint_naming = True, False
    try:
        yield
    finally:
        if saved_opts is not None:
            accelerator._optimizers = saved_opts
        if skip_models is not None:
            skip_models.remove()
        if saved_naming:
            config.automatic_checkpoint_naming = True


@dataclass(frozen=True)
class _Facts:
    """See :meth:`MemSafeMixin._memsafe_read_facts`."""

    rank: int
    world_size: int
    device: torch.device
    fsdp_plugin: Any
    is_fsdp2: bool
    mixed_precision: str | None
    mesh: Any
    parallelism_config: Any
    project_configuration: Any


class MemSafeMixin:
    """The routing shared by :class:`Accelerator` and accelerators given the plugin by ``attach``."""

    memsafe_plugin: MemSafePlugin

    # -- context ----------------------------------------------------------------------------------
    def _memsafe_context(self, hook: str, args: tuple = (), kwargs: dict | None = None, *,
                         optimizers: list | None = None) -> HookContext:
        """The context of one hook call; ``optimizers``: the call's own (``prepare``'s arguments), else the ones
        this accelerator prepared."""
        facts = self.__dict__.get("_memsafe_facts") or self._memsafe_read_facts()
        return HookContext(
            hook=hook,
            rank=facts.rank,
            world_size=facts.world_size,
            device=facts.device,
            options=self.memsafe_plugin,
            args=tuple(args),
            kwargs=dict(kwargs or {}),
            models=list(self._models),
            optimizers=[getattr(o, "optimizer", o) for o in (self._optimizers if optimizers is None else optimizers)],
            fsdp_plugin=facts.fsdp_plugin,
            is_fsdp2=facts.is_fsdp2,
            mixed_precision=facts.mixed_precision or self.state.mixed_precision,
            mesh=facts.mesh,
            scratch={"parallelism_config": facts.parallelism_config,
                     "project_configuration": facts.project_configuration},
        )

    def _memsafe_read_facts(self) -> _Facts:
        """What the hooks' contexts read from the accelerator and its state that is fixed once it is built (the
        process group, the device, the distributed type and its plugin, the mesh, the parallelism and project
        configurations), read at the first hook call and kept: each read goes through accelerate's properties, a
        few microseconds warm and tens cold, on every hook call."""
        initialized = dist.is_available() and dist.is_initialized()
        state = self.state
        facts = _Facts(
            rank=dist.get_rank() if initialized else 0,
            world_size=dist.get_world_size() if initialized else 1,
            device=self.device,
            # AcceleratorState keeps its attributes in one shared dict; `getattr(state, name, None)` of one it lacks
            # goes through its `__getattr__`, which builds an error message to be discarded
            fsdp_plugin=vars(state).get("fsdp_plugin"),
            is_fsdp2=bool(state.is_fsdp2),
            # fixed once the state is built, except under DeepSpeed, where it follows the selected plugin's config
            mixed_precision=None if state.distributed_type == DistributedType.DEEPSPEED else state.mixed_precision,
            mesh=getattr(self, "torch_device_mesh", None),
            parallelism_config=getattr(self, "parallelism_config", None),
            project_configuration=getattr(self, "project_configuration", None),
        )
        self.__dict__["_memsafe_facts"] = facts
        return facts

    def _memsafe_finish(self) -> None:
        path = self.memsafe_plugin.report_path
        if path:
            ctx_rank = self.process_index
            self.memsafe_plugin.report.to_json(path.replace("{rank}", str(ctx_rank)))

    def _memsafe_meta_gap(self, ctx: HookContext) -> str | None:
        """Why the enabled prepare stages will not fill weights on ``meta`` here (``None``: they will)."""
        stages = {s.name: s for s in self.memsafe_plugin.pipeline.stages.get("prepare", ())}
        placement = stages.get("meta_placement")
        if placement is None:
            enabled = ", ".join(f"`{n}`" for n in stages) or "none"
            return f"`meta_placement` is not among the enabled prepare stages ({enabled})"
        reason = placement.skip_reason(ctx)
        return None if reason is None else f"`meta_placement` does not run here ({reason})"

    def _memsafe_refuse_context_parallel(self, ctx: HookContext) -> None:
        """Raises, on every rank and before any stage changes the model, what accelerate's own ``prepare`` raises first
        thing under context parallelism for a model it cannot run (a layer that is not full causal attention); without
        this the plugin's stages would shard the model before accelerate's call refused it. Only where prepare stages
        run: without them accelerate raises it itself, first.

        Raises:
            ConfigError: accelerate's message (a ``ValueError``, as stock raises), and what to change.
        """
        pc = ctx.scratch.get("parallelism_config")
        if ctx.model is None or not getattr(pc, "cp_enabled", False) or not self.memsafe_plugin.pipeline.stages.get("prepare"):
            return
        reason = _compat.context_parallel_refusal(ctx.model)
        if reason is not None:
            raise ConfigError(
                f"{reason} (accelerate's check for ParallelismConfig(cp_size={pc.cp_size}), raised on every rank before "
                "`prepare` changed anything.) Set cp_size=1, or train a model whose layers are all full attention."
            )

    # -- hooks --------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        models = [(i, a) for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        ctx = self._memsafe_context("prepare", args, optimizers=optimizers)
        if ctx.is_fsdp2 and (len(models) > 1 or optimizers and not models
                             or models and not optimizers and not _compat.fsdp2_prepares_a_model_alone()):
            # accelerate's own rules (a model alone from 1.16 on), raised before any stage runs
            alone = " (or a model alone" + ("" if _compat.fsdp2_prepares_a_model_alone() else ", from accelerate 1.16") + ")"
            raise ValueError(
                f"When using FSDP2, exactly one model and its optimizer must be passed together to "
                f"`Accelerator.prepare()`{alone} (got {len(models)} model(s), {len(optimizers)} optimizer(s))."
            )
        ctx.model = models[0][1] if models else None
        if ctx.world_size == 1 and not ctx.is_fsdp2:  # nothing walks the tree before a stage runs here
            return self._memsafe_prepare(ctx, args, models, optimizers, device_placement)
        # the look before any stage runs (the checks here, then the pipeline's preflight, which thaws the tree before
        # its first stage) walks the model's tree once
        with walk.frozen(ctx.model):
            return self._memsafe_prepare(ctx, args, models, optimizers, device_placement)

    def _memsafe_prepare(self, ctx: HookContext, args: tuple, models: list, optimizers: list,
                         device_placement: list[bool] | None) -> Any:
        self._memsafe_refuse_context_parallel(ctx)
        # one process without FSDP: accelerate's own `model.to(device)` refuses weights on meta, as stock does, and
        # they are named once it has (`meta_weights_failure`); elsewhere accelerate could take them silently (FSDP2
        # re-points the optimizer by data pointer, 0 for every meta tensor), so every rank looks before anything moves
        meta_after_failure = ctx.model is not None and ctx.world_size == 1 and not ctx.is_fsdp2
        if ctx.model is not None and not meta_after_failure:
            from .distributed.meta import refuse_unfilled_meta_weights

            refuse_unfilled_meta_weights(
                ctx.model, self._memsafe_meta_gap(ctx), rank=ctx.rank, world_size=ctx.world_size,
                timeout_s=self.memsafe_plugin.collective_timeout_s,
                broadcast_by_accelerate=ctx.is_fsdp2 and bool(getattr(ctx.fsdp_plugin, "cpu_ram_efficient_loading", False)))
        # A call without a model or an optimizer (a Trainer prepares each dataloader alone) still runs the stages
        # (dataloader_resume records its dataloaders) but adds no records: one `prepare` pipeline per model.
        pipeline = self.memsafe_plugin.pipeline
        if not models and not optimizers:
            pipeline = Pipeline(pipeline.stages, MemoryReport(), track_tensors=False,
                                sample_interval_s=pipeline.sample_interval_s, trim_heap=pipeline.trim_heap,
                                probe_hooks_without_stages=pipeline.probe_hooks_without_stages)

        def upstream(c: HookContext) -> Any:
            new_args = args
            if models and c.model is not args[models[0][0]]:
                new_args = list(args)
                new_args[models[0][0]] = c.model
            if c.scratch.get("sharded") or c.scratch.get("tensor_parallel"):
                return self._memsafe_prepare_sharded(c, new_args, device_placement)
            try:
                return super(MemSafeMixin, self).prepare(*new_args, device_placement=device_placement)
            except Exception as exc:
                if meta_after_failure:
                    from .distributed.meta import meta_weights_failure

                    named = meta_weights_failure(c.model, self._memsafe_meta_gap(c) or "", exc)
                    if named is not None:
                        raise named from exc
                raise

        result = pipeline.run(ctx, upstream)
        if pipeline is self.memsafe_plugin.pipeline:
            self._memsafe_finish()
        return result

    def _memsafe_prepare_sharded(self, c: HookContext, args: Any, device_placement: list[bool] | None) -> Any:
        """accelerate's own ``prepare`` of a model the stages sharded (``shard``) or parallelised: activation
        checkpointing, already applied before ``fully_shard``, is not applied twice; accelerate's own TP plan is not
        applied again; the optimizers keep the stages' mapping of their parameters (by name; accelerate re-derives it
        from data pointers)."""
        sharded = c.scratch.get("sharded")
        groups = [[list(g["params"]) for g in o.param_groups] for o in c.optimizers] if sharded else []
        plugin = c.fsdp_plugin
        ac = getattr(plugin, "activation_checkpointing", False) if c.is_fsdp2 and sharded else False
        if ac:
            plugin.activation_checkpointing = False  # already applied by `shard`, before fully_shard
        tp = _compat.tp_already_applied(self) if c.scratch.get("tensor_parallel") else contextlib.nullcontext()
        try:
            with tp:
                out = super(MemSafeMixin, self).prepare(*args, device_placement=device_placement)
        finally:
            if ac:
                plugin.activation_checkpointing = True
        if sharded:
            for o, saved in zip(c.optimizers, groups):
                for g, params in zip(o.param_groups, saved):
                    g["params"] = params
        return out

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        ctx = self._memsafe_context("save_state", kwargs=kwargs)
        ctx.directory = output_dir

        def upstream(c: HookContext) -> Any:
            with _upstream_overrides(self, c.scratch):
                return super(MemSafeMixin, self).save_state(c.directory, safe_serialization=safe_serialization, **c.kwargs)

        result = self.memsafe_plugin.pipeline.run(ctx, upstream)
        self._memsafe_finish()
        return result

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> Any:
        ctx = self._memsafe_context("load_state", kwargs=kwargs)
        ctx.directory = input_dir
        ctx.scratch["load_kwargs"] = dict(load_kwargs or {})

        def upstream(c: HookContext) -> Any:
            with _upstream_overrides(self, c.scratch):
                return super(MemSafeMixin, self).load_state(c.directory, load_kwargs=c.scratch["load_kwargs"] or None, **c.kwargs)

        result = self.memsafe_plugin.pipeline.run(ctx, upstream)
        self._memsafe_finish()
        return result

    def save_model(self, model: torch.nn.Module, save_directory: str, **kwargs: Any) -> Any:
        ctx = self._memsafe_context("save_model", kwargs=kwargs)
        ctx.model = model
        ctx.directory = str(save_directory)

        def upstream(c: HookContext) -> Any:
            return super(MemSafeMixin, self).save_model(c.model, c.directory, **c.kwargs)

        result = self.memsafe_plugin.pipeline.run(ctx, upstream)
        self._memsafe_finish()
        return result

    # -- points where a background checkpoint commit is settled -------------------------------------
    def _memsafe_settle(self) -> None:
        """Ends the last ``save_state``'s background commit on every rank (raises its error on every rank)."""
        initialized = dist.is_available() and dist.is_initialized()
        plugin = self.memsafe_plugin
        plugin.pipeline.background.settle(rank=dist.get_rank() if initialized else 0,
                                          world_size=dist.get_world_size() if initialized else 1,
                                          timeout_s=plugin.collective_timeout_s)

    def wait_for_everyone(self) -> None:
        """accelerate's barrier; first, the last ``save_state``'s checkpoint is committed (rank 0's background
        commit ends, and its error is raised on every rank), so after it every rank sees the checkpoint in place."""
        self._memsafe_settle()
        super().wait_for_everyone()

    def end_training(self) -> None:
        """Commits the last ``save_state``'s checkpoint (raising its error on every rank), then accelerate's
        ``end_training``."""
        self._memsafe_settle()
        super().end_training()


def _select_plugin(plugins: list[Any] | None) -> MemSafePlugin | None:
    if plugins is None:
        return MemSafePlugin.from_env() if memsafe_variables() else None
    found = [p for p in plugins if isinstance(p, MemSafePlugin)]
    other = [p for p in plugins if not isinstance(p, MemSafePlugin)]
    if other:
        raise TypeError(
            f"`plugins` accepts MemSafePlugin instances only, got {[type(p).__name__ for p in other]}. "
            "Pass accelerate's own plugins by their keyword (`fsdp_plugin=...`)."
        )
    if len(found) > 1:
        raise ValueError(f"`plugins` holds {len(found)} MemSafePlugin instances; pass one.")
    return found[0] if found else None


class Accelerator(MemSafeMixin, accelerate.Accelerator):
    """``accelerate.Accelerator`` with ``plugins=[MemSafePlugin(...)]``. Every other argument is passed
    through unchanged.

    With no ``plugins`` argument, a plugin is built from ``ACCELERATE_MEMSAFE_*`` variables when any is
    set (``accelerate-memsafe launch`` sets them); otherwise the default ``MemSafePlugin()`` is used.
    On a machine without an accelerator, a multi-process FSDP2 launch runs real FSDP2 over gloo
    (stock accelerate would silently fall back to DDP).

    Example:
        >>> # accelerator = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    """

    def __init__(self, *args: Any, plugins: list[Any] | None = None, **kwargs: Any) -> None:
        plugin = _select_plugin(plugins) or MemSafePlugin()
        fsdp_plugin = kwargs.get("fsdp_plugin")
        if fsdp_plugin is None and _wants_cpu_fsdp2(None):
            fsdp_plugin = _fsdp_plugin_from_env()
        cpu_fsdp2 = _wants_cpu_fsdp2(fsdp_plugin)
        parallelism_config = None
        if cpu_fsdp2:
            # Without cpu=True accelerate runs each process as a single-process job on a CPU-only machine; a
            # state already initialised that way (by `TrainingArguments`) is reset first.
            _compat.reset_single_process_state()
            kwargs["cpu"] = True
            kwargs["fsdp_plugin"] = fsdp_plugin
            # accelerate refuses a ParallelismConfig for a MULTI_CPU state: installed once the state is FSDP.
            parallelism_config = kwargs.pop("parallelism_config", None) or _parallelism_config_from_env()
        with _compat.parallelism_env_hidden(parallelism_config is not None):
            super().__init__(*args, **kwargs)
        if cpu_fsdp2:
            unpin_cpu_offload(fsdp_plugin)
            _compat.promote_state_to_fsdp(fsdp_plugin)
            if parallelism_config is not None:
                _compat.install_parallelism_config(self, parallelism_config)
        self.memsafe_plugin = plugin
        _ready_for_hooks()


_SUBCLASSES: dict[type, type] = {}


def _ready_for_hooks() -> None:
    """Does, before the first hook, the once-per-process setup the hooks need: starts the memory probes' sampling
    thread, finds this process's cgroups (where the preflight reads its memory limits), and, in a multi-process run,
    starts the waiter of the ranks' agreements (with its own connection to the store) and runs the kernel checks behind
    the in-place proof of ``prepare`` (what the pagemap reports). Each is otherwise done by the first hook that needs
    it, on its path."""
    from .distributed.collectives import ready_to_agree
    from .io.mapped_pages import check_kernel_support
    from .memory.limits import find_own_groups
    from .memory.probe import start_sampler

    start_sampler()
    find_own_groups()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ready_to_agree()
        check_kernel_support()


def attach_plugin(accelerator: Any, plugin: MemSafePlugin, *, fsdp_plugin: Any = None) -> Any:
    """See :meth:`MemSafePlugin.attach`."""
    if isinstance(accelerator, MemSafeMixin):
        raise ValueError("this accelerator already has a MemSafePlugin; build a new Accelerator to change it.")
    if not isinstance(accelerator, accelerate.Accelerator):
        raise TypeError(f"attach() needs an accelerate.Accelerator, got {type(accelerator).__name__}.")
    if accelerator._models or accelerator._optimizers:
        raise ValueError("attach() must be called before `prepare`: this accelerator already prepared objects.")
    if fsdp_plugin is None:
        fsdp_plugin = getattr(accelerator.state, "fsdp_plugin", None) or _fsdp_plugin_from_env()
    if _wants_cpu_fsdp2(fsdp_plugin):
        unpin_cpu_offload(fsdp_plugin)
        dtype = accelerator.state.distributed_type
        if dtype == DistributedType.NO:
            _compat.reinit_state_on_cpu(fsdp_plugin)
        elif dtype == DistributedType.MULTI_CPU:
            _compat.promote_state_to_fsdp(fsdp_plugin)
    cls = type(accelerator)
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"MemSafe{cls.__name__}", (MemSafeMixin, cls), {"__module__": __name__})
        _SUBCLASSES[cls] = sub
    accelerator.__class__ = sub
    accelerator.memsafe_plugin = plugin
    _ready_for_hooks()
    return accelerator
