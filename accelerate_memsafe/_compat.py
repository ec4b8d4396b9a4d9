"""The one module that touches accelerate internals, each behind a version check and a test.

1. ``PartialState._shared_state`` / ``AcceleratorState``: accelerate 1.x never selects FSDP on a machine
   without an accelerator (``MULTI_CPU`` is not in the list of types that may become ``FSDP``), and
   ``AcceleratorState()`` re-copies ``PartialState``'s shared dict, so both must say ``FSDP``.
2. ``fsdp2_prepare_model(accelerator, model)`` reads a handful of attributes of the accelerator; we call
   it with a minimal view holding only those, so that our ``shard`` stage applies exactly accelerate's
   wrapping without its full-state-dict broadcast.
3. ``state.parallelism_config`` / ``state.device_mesh`` / ``ParallelismConfig._validate_accelerator``: set
   after the CPU state was promoted to FSDP (``install_parallelism_config``).
4. torchdata's ``StatefulDataLoader.next_iter_state``: a state restored at an epoch boundary is dropped so
   that the next epoch is built once (``start_next_epoch_fresh``).
5. ``accelerate.big_modeling._attach_context_parallel_hooks``: its refusal of a model that context parallelism cannot
   run is asked before any stage changes the model (``context_parallel_refusal``).
6. ``accelerate.utils.modeling._get_parameter_id``: whether accelerate's FSDP2 ``prepare`` tells meta parameters
   apart when it re-points the optimizer (``optimizer_remapped_by_identity_on_meta``).
7. ``Accelerator.prepare``'s source: whether FSDP2 takes a model without its optimizer (``fsdp2_prepares_a_model_alone``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import accelerate
import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from packaging.version import Version

#: accelerate versions whose internals this module was written and tested against: the whole suite passes on 1.14,
#: 1.15 and 1.16 (``tests/other_accelerate.sh``); 1.13's FSDP2 prepare keeps bf16 weights under mixed precision, and on 1.12
#: and 1.10 resume and reload tests fail (docs/guarantees.md, "Other versions than CI's").
TESTED_ACCELERATE = (Version("1.14.0"), Version("1.17.0"))


def _in_range(version: Version, tested: tuple[Version, Version]) -> bool:
    return tested[0] <= version < tested[1]


def _warn_untested(what: str, found: dict[str, Version], tested: dict[str, tuple[Version, Version]], consequence: str,
                   stacklevel: int = 3) -> bool:
    """The one version check of this module: ``True`` when every found version is in its tested range,
    otherwise a warning naming the ranges, the found versions and what it means for the user."""
    if all(_in_range(found[k], tested[k]) for k in found):
        return True
    ranges = " and ".join(f"{k} >={tested[k][0]},<{tested[k][1]}" for k in found)
    versions = ", ".join(f"{k} {v}" for k, v in found.items())
    warnings.warn(f"accelerate_memsafe's {what} was tested with {ranges}; found {versions}. {consequence}", stacklevel=stacklevel)
    return False


def check_accelerate_version(version: str | None = None) -> bool:
    """Warns when accelerate's version is outside the tested range.

    Returns:
        Whether the version is a tested one.
    """
    return _warn_untested(
        "CPU-FSDP2 promotion and `shard` stage", {"accelerate": Version(version or accelerate.__version__)},
        {"accelerate": TESTED_ACCELERATE},
        "They use accelerate internals that may have changed. Please report problems with the versions involved.",
    )


def promote_state_to_fsdp(fsdp_plugin: Any) -> None:
    """Makes the already-initialised accelerate state say FSDP (for CPU multi-process runs).

    Args:
        fsdp_plugin: The ``FullyShardedDataParallelPlugin`` to install.

    Raises:
        RuntimeError: If the state is not a multi-process CPU state (nothing to promote).
    """
    check_accelerate_version()
    state = AcceleratorState()
    if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.FSDP):
        raise RuntimeError(
            f"Cannot run FSDP2 on CPU: accelerate state is {state.distributed_type} with {state.num_processes} "
            "process(es). Launch with `torchrun --nproc_per_node N` or `accelerate launch --num_processes N`."
        )
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def install_parallelism_config(accelerator: Any, parallelism_config: Any) -> None:
    """Gives a CPU FSDP2 accelerator (promoted by :func:`promote_state_to_fsdp`) accelerate's
    ``ParallelismConfig``: its device mesh, built over gloo, and accelerate's own validation of it.

    ``Accelerator.__init__`` validates a ``ParallelismConfig`` before the state can be promoted, and refuses
    it for ``MULTI_CPU``; the face therefore builds the accelerator without it and installs it here, exactly
    as ``Accelerator.__init__`` does once the state says FSDP (``state.parallelism_config``,
    ``state.device_mesh``, ``ParallelismConfig._validate_accelerator``).
    """
    check_accelerate_version()
    state = accelerator.state
    state.parallelism_config = parallelism_config
    state.device_mesh = parallelism_config.get_device_mesh(accelerator.device.type)
    parallelism_config._validate_accelerator(accelerator)


@contextlib.contextmanager
def parallelism_env_hidden(hide: bool) -> Iterator[None]:
    """Hides ``ACCELERATE_USE_PARALLELISM_CONFIG`` (``accelerate launch --use_parallelism_config``) while
    ``Accelerator.__init__`` runs, which would otherwise build and validate its own ``ParallelismConfig``
    for the ``MULTI_CPU`` state; :func:`install_parallelism_config` installs it afterwards."""
    import os

    key = "ACCELERATE_USE_PARALLELISM_CONFIG"
    saved = os.environ.pop(key, None) if hide else None
    try:
        yield
    finally:
        if saved is not None:
            os.environ[key] = saved


def reinit_state_on_cpu(fsdp_plugin: Any) -> None:
    """Re-initialises a single-process (``NO``) accelerate state as a gloo ``MULTI_CPU`` state, then FSDP.

    Used by ``MemSafePlugin.attach`` on a stock ``Accelerator`` that was built in a multi-process launch
    on a machine without an accelerator: stock accelerate then runs every process as rank 0 of 1.
    """
    check_accelerate_version()
    old = AcceleratorState()
    kept = {
        "mixed_precision": old.mixed_precision,
        "dynamo_plugin": getattr(old, "dynamo_plugin", None),
        "parallelism_config": getattr(old, "parallelism_config", None),
    }
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState(cpu=True)
    AcceleratorState(cpu=True, _from_accelerator=True, **kept)
    promote_state_to_fsdp(fsdp_plugin)


def fsdp2_wrap(
    model: torch.nn.Module,
    *,
    fsdp_plugin: Any,
    mixed_precision: str,
    mesh: Any,
    parallelism_config: Any,
    is_main_process: bool,
    device: torch.device,
) -> torch.nn.Module:
    """Applies accelerate's FSDP2 wrapping (wrap policy, mixed precision, offload) without loading weights.

    Calls ``accelerate.utils.fsdp2_prepare_model`` with a copy of the plugin whose
    ``cpu_ram_efficient_loading`` is off (our ``rank0_distribute`` stage does the loading) and a minimal
    view of the accelerator holding only the attributes that function reads. ``ignored_modules`` given as a
    pattern is resolved here (:func:`ignored_modules`): accelerate's own resolution moves each matched module to
    the device, which raises for a module whose weights ``meta_placement`` put on ``meta``.
    """
    from accelerate.utils import fsdp2_prepare_model

    check_accelerate_version()
    plugin = copy.copy(fsdp_plugin)
    plugin.cpu_ram_efficient_loading = False
    resolved = ignored_modules(plugin.ignored_modules, model, device)
    # accelerate 1.16 moves every listed module to the device (1.15 only the modules a pattern matched): handed
    # modules already placed, its move is a no-op, so weights left on `meta` for `rank0_distribute` stay there
    plugin.ignored_modules = None if resolved is None else [_Placed(m) for m in resolved]
    view = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=mesh,
        parallelism_config=parallelism_config,
        mixed_precision=mixed_precision,
        is_main_process=is_main_process,
        device=device,
    )
    with _no_input_embeddings_where_undefined(model):
        return fsdp2_prepare_model(view, model)


@contextlib.contextmanager
def _no_input_embeddings_where_undefined(model: torch.nn.Module) -> Iterator[None]:
    """accelerate's FSDP2 wrapping (1.15) asks ``model.get_input_embeddings()`` for the embedding to shard in a group of
    its own, and expects ``None`` from a model that has none; transformers' default raises ``NotImplementedError``
    there instead (speech encoders: wav2vec2, HuBERT, WavLM ...), which fails stock ``prepare``. Inside this
    context such a model answers ``None`` (an instance attribute, removed after), so it is wrapped as one without an
    input embedding.

    Example:
        >>> class Speech(torch.nn.Linear):
        ...     def get_input_embeddings(self):
        ...         raise NotImplementedError("no embedding")
        >>> m = Speech(2, 2)
        >>> with _no_input_embeddings_where_undefined(m):
        ...     print(m.get_input_embeddings())
        None
        >>> sorted(n for n in vars(m) if n.startswith("get_"))
        []
    """
    ask = getattr(model, "get_input_embeddings", None)
    try:
        if ask is not None:
            ask()
    except NotImplementedError:
        pass
    else:
        yield
        return
    # transformers' `get_output_embeddings` asks `get_input_embeddings` too (a model whose input embedding raises has no
    # output embedding to tie): it keeps the answer it gives outside this context
    answers = {"get_input_embeddings": None, "get_output_embeddings": _answer(model, "get_output_embeddings")}
    saved = {name: vars(model)[name] for name in answers if name in vars(model)}
    for name, value in answers.items():
        object.__setattr__(model, name, lambda value=value: value)
    try:
        yield
    finally:
        for name in answers:
            if name in saved:
                object.__setattr__(model, name, saved[name])
            else:
                del model.__dict__[name]


def _answer(model: torch.nn.Module, method: str) -> Any:
    """``model.<method>()``, ``None`` where the model has no such method or it raises ``NotImplementedError``."""
    ask = getattr(model, method, None)
    try:
        return ask() if ask is not None else None
    except NotImplementedError:
        return None


def ignored_modules(spec: Any, model: torch.nn.Module, device: torch.device | None = None) -> Any:
    """``FullyShardedDataParallelPlugin.ignored_modules`` as the modules accelerate's FSDP2 wrapping would ignore.

    A pattern (a ``str``) is matched against ``model.named_modules()`` names with ``re.fullmatch``, as
    ``accelerate.utils.fsdp_utils.get_parameters_from_modules`` does, and each matched module is moved to
    ``device`` as it does (``None``: not moved, a look), except a module holding a tensor on ``meta`` (its weights
    are filled by ``rank0_distribute``, replicated on every rank: ``fully_shard`` leaves them whole). Modules given
    as such are placed the same way (accelerate 1.16 moves them too; 1.15 takes their parameters where they are).

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta"))
        >>> [type(x).__name__ for x in ignored_modules("[01]", m, torch.device("cpu"))]
        ['Linear', 'Linear']
    """
    if spec is None:
        return None
    if isinstance(spec, str):
        import re

        pattern = re.compile(spec)
        found = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
    else:
        found = list(spec)
    for module in found:
        if device is not None and not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
            module.to(device)
    return found


class _Placed:
    """An ignored module as ``accelerate.utils.fsdp_utils.get_parameters_from_modules`` reads it (``.to(device)``,
    then ``.parameters()``), already placed by :func:`ignored_modules`: its ``.to`` moves nothing."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def to(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        return self.module

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.module.parameters(recurse)


@contextlib.contextmanager
def tp_already_applied(accelerator: Any) -> Iterator[None]:
    """While open, accelerate's ``Accelerator._prepare_tp`` (private) prepares only the objects that are not
    models (its first and second passes): the ``shard`` stage has applied the model's TP plan and
    ``fully_shard`` already. Its model pass would wrap the remaining parameters with transformers'
    ``ReplicateParallel``, which transformers 5.x no longer has (an ``ImportError`` in stock accelerate 1.13).
    """
    check_accelerate_version()

    def prepare_tp(*args: Any) -> list[Any]:
        result = [accelerator._prepare_one(o, first_pass=True) if not isinstance(o, torch.nn.Module) else o for o in args]
        return [accelerator._prepare_one(o) if not isinstance(o, torch.nn.Module) else o for o in result]

    accelerator._prepare_tp = prepare_tp
    try:
        yield
    finally:
        del accelerator._prepare_tp


def optimizer_remapped_by_identity_on_meta() -> bool:
    """Whether accelerate's FSDP2 ``prepare`` re-points the optimizer to the sharded parameters by each meta parameter's
    identity (1.16 on: ``accelerate.utils.modeling._get_parameter_id``, private) rather than by its data pointer, which
    is 0 for every meta tensor: from 1.16 it maps any number of them right, before one at most.
    """
    check_accelerate_version()
    try:
        from accelerate.utils.modeling import _get_parameter_id
    except ImportError:
        return False
    return _get_parameter_id(torch.empty(1, device="meta")) != 0


@functools.lru_cache(maxsize=None)
def fsdp2_prepares_a_model_alone() -> bool:
    """Whether accelerate's FSDP2 ``prepare`` takes a model without its optimizer (1.16 on: a model for evaluation, or
    one whose optimizer is built from the sharded parameters and prepared with it after); before, it refuses
    ("a model and optimizer must be passed together"). Read from ``Accelerator.prepare``'s source, once."""
    import inspect

    check_accelerate_version()
    return "model_count > 0 and optimizer_count < 1" not in inspect.getsource(accelerate.Accelerator.prepare)


def context_parallel_refusal(model: torch.nn.Module) -> str | None:
    """Why accelerate's context parallelism refuses ``model``, or ``None``: accelerate's ``prepare`` raises it first
    thing (``Accelerator._prepare_cp``), before anything moves; with the plugin its stages run before that call, so
    the plugin asks the same check before its first stage. It asks accelerate's own
    ``big_modeling._attach_context_parallel_hooks`` (private), which checks the model's config (a layer that is not full
    causal attention: sliding-window, chunked, linear; from 1.16 through transformers' ``supports_context_parallel``)
    before it attaches hooks, with a view holding the config, that answer and no modules: nothing is attached.
    ``None`` too where this accelerate has no such function or check (before 1.15 it
    refuses no model, and neither does the plugin).

    Example:
        >>> from transformers import MistralConfig
        >>> why = context_parallel_refusal(SimpleNamespace(config=MistralConfig(sliding_window=8)))
        >>> why is None or why.startswith("Context parallelism does not support attention layers of type ['sliding_")
        True
    """
    check_accelerate_version()
    try:
        from accelerate.big_modeling import _attach_context_parallel_hooks
    except ImportError:
        return None
    # accelerate 1.15 reads the config; 1.16 asks transformers' ``supports_context_parallel`` (a property reading it)
    attrs = {"config": getattr(model, "config", None), "named_modules": lambda self: ()}
    if hasattr(model, "supports_context_parallel"):
        attrs["supports_context_parallel"] = model.supports_context_parallel
    view = type(type(model).__name__, (), attrs)()
    try:
        _attach_context_parallel_hooks(view)  # the message names the view's class: the model's
    except ValueError as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def filtered_fully_shard(
    root: torch.nn.Module,
    keep: Callable[[list[torch.nn.Module]], list[torch.nn.Module]],
    formed: Callable[[list[torch.nn.Module]], None],
) -> Iterator[None]:
    r"""Routes accelerate's non-root ``fully_shard`` calls through ``keep`` while the context is open.

    ``fsdp2_prepare_model`` imports ``fully_shard`` from ``torch.distributed.fsdp`` when it runs and calls
    it for every module its wrap policy picks, for the input embedding and for the ``[final_norm,
    lm_head]`` tail. Some of those groups cannot exist: a container without ``forward`` (``size_based_wrap``
    picks ``ModuleList``\ s: "fully_shard does not support containers that do not implement forward"), or
    a group that would hold only one of the modules sharing a tied parameter (a BERT decoder bias, T5's
    shared embedding: "shared with a parameter already managed by another FSDP group"). ``keep(modules)``
    returns the modules of one call that may form a group (possibly none: the call is skipped and its
    parameters stay with an enclosing group, ultimately the root); ``formed(modules)`` is told of every
    group made. The root call is never filtered.
    """
    import torch.distributed.fsdp as fsdp

    original = fsdp.fully_shard

    @functools.wraps(original)
    def call(module, *args, **kwargs):
        if module is root:
            return original(module, *args, **kwargs)
        many = isinstance(module, (list, tuple))
        kept = keep(list(module) if many else [module])
        if kept:
            original(kept if many else kept[0], *args, **kwargs)
            formed(kept)
        return module

    fsdp.fully_shard = call
    try:
        yield
    finally:
        fsdp.fully_shard = original


def apply_activation_checkpointing(model: torch.nn.Module, fsdp_plugin: Any) -> torch.nn.Module:
    """Applies accelerate's activation checkpointing (must come before ``fully_shard``)."""
    from accelerate.utils import fsdp2_apply_ac

    return fsdp2_apply_ac(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=fsdp_plugin)), model)


# -- transformers' declaration of children whose weights a parent's forward reads (the `shard` stage) ----------
#
# 8. ``transformers.integrations.accelerate.force_accelerate_hooks``: which children a ``forward`` uses without
#    calling them; the wrap policy must not make them FSDP2 groups of their own.

@functools.cache
def directly_used_children(module_type: type) -> tuple[str, ...]:
    """The child modules whose weights ``module_type.forward`` reads without calling the child, as transformers
    declares them: ``@force_accelerate_hooks("conv1d")`` on a mixer's ``forward`` (mamba, jamba, falcon_h1,
    qwen3_next ... pass ``self.conv1d.weight`` to a convolution kernel). An FSDP2 group of such a child is never
    unsharded (its ``forward`` never runs), so the parent's forward meets a sharded ``DTensor``: the child must stay
    in an enclosing group.

    Reads the decorator's closure (its ``child_module_names``) from the ``forward`` or any function it wraps
    (``__wrapped__``): the decorator is recognised by its code (a function ``wrapped`` of
    ``transformers/integrations/accelerate.py`` closing over ``child_module_names``), so a transformers whose
    decorator looks otherwise gives ``()``: the children are grouped as a wrap policy picks them, as without the plugin.

    Example:
        >>> directly_used_children(torch.nn.Linear)
        ()
    """
    fn = getattr(module_type, "forward", None)
    for _ in range(16):  # the decorators stacked on a forward, outermost first
        code = getattr(fn, "__code__", None)
        if code is None:
            return ()
        if (code.co_name == "wrapped" and "child_module_names" in code.co_freevars
                and code.co_filename.replace(os.sep, "/").endswith("transformers/integrations/accelerate.py")):
            names = fn.__closure__[code.co_freevars.index("child_module_names")].cell_contents
            if isinstance(names, str):
                names = [names]
            return tuple(n for n in names if isinstance(n, str)) if isinstance(names, (list, tuple)) else ()
        fn = getattr(fn, "__wrapped__", None)
    return ()


# -- transformers internals used by the offloaded save -----------------------------------------------------
#
# 3. ``transformers.core_model_loading``: the reverse weight conversions of a model (``revert_weight_conversion``
#    and the pieces it is built from). transformers has no public API that says which tensors one reverse
#    conversion needs together; we rebuild its grouping rule from the same objects it uses, and cross-check
#    it against ``revert_weight_conversion`` itself on meta tensors (see ``io/shard_plan.py``).
# 4. ``transformers.modeling_utils.remove_tied_weights_from_state_dict``: which tied names ``save_pretrained``
#    drops, so that our checkpoint holds exactly the names transformers would write.
# 5. accelerate's ``module._hf_hook.weights_map``: where an offloaded module's values live (cpu dict or disk
#    index); ``transformers.integrations.accelerate.load_offloaded_parameter`` reads it the same way.

#: transformers versions whose internals the offloaded save was written and tested against.
TESTED_TRANSFORMERS_CONVERSIONS = (Version("5.23.0"), Version("5.26.0"))


def check_transformers_version(version: str | None = None) -> bool:
    """Warns when transformers' version is outside the range the offloaded save was tested with.

    Returns:
        Whether the version is a tested one.
    """
    import transformers

    return _warn_untested(
        "offloaded save", {"transformers": Version(version or transformers.__version__)},
        {"transformers": TESTED_TRANSFORMERS_CONVERSIONS},
        "It uses transformers' weight-conversion internals (`core_model_loading`), which may have changed. "
        "Please report problems with the versions involved.",
    )


def reverse_conversion_key(model: torch.nn.Module):
    """A function naming, for one state-dict key, the reverse conversion (``WeightConverter``) it belongs to.

    Mirrors the grouping of ``transformers.core_model_loading.revert_weight_conversion``: every key that its
    reversed converters rename to the same target is converted together. Keys that only get renamed map to
    ``None``.

    Args:
        model: A transformers ``PreTrainedModel``.

    Returns:
        ``key(name) -> str | None``.
    """
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming

    check_transformers_version()
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        # Same rule as revert_weight_conversion for a model not built by from_pretrained.
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    reverse = [c.reverse_transform() for c in conversions[::-1]]
    converters = [c for c in reverse if isinstance(c, WeightConverter)]
    renamings = [c for c in reverse if isinstance(c, WeightRenaming)]
    rename = _reverse_converter_rename()

    def key(name: str) -> str | None:
        if not converters:
            return None
        renamed, pattern = rename(name, renamings, converters)
        return renamed if pattern is not None else None

    return key


def _reverse_converter_rename(cml: Any = None):
    """``(name, renamings, converters) -> (renamed, source pattern or None)``: the key under which the installed
    transformers' ``revert_weight_conversion`` groups a name with the others its reverse converter takes (``cml``: its
    ``core_model_loading``). Where it has ``apply_converters`` (5.21 on), the name after at most one converter; before
    (5.17-5.20), the name after that converter and then every renaming (``rename_source_key(..., reverse=True)``). The
    shard plan checks either against ``revert_weight_conversion`` itself before anything is written."""
    if cml is None:
        from transformers import core_model_loading as cml

    if hasattr(cml, "apply_converters"):
        return lambda name, renamings, converters: cml.apply_converters(name, converters)
    return lambda name, renamings, converters: cml.rename_source_key(name, renamings, converters, reverse=True)


def revert_conversions(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Applies transformers' reverse weight conversions (``save_original_format=True``) to ``state_dict``.

    Works on meta tensors too (shapes and dtypes only), which is how the shard plan predicts the saved names.
    """
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, state_dict)


def natural_key(name: str):
    """transformers' sort key for state-dict names (``layers.2`` before ``layers.10``)."""
    from transformers.core_model_loading import dot_natural_key

    return dot_natural_key(name)


def drop_tied_and_ignored(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Removes the names ``save_pretrained`` does not write: ``_keys_to_ignore_on_save`` and tied aliases.

    Meta (offloaded) tensors are matched by their parameter object, as transformers does; no data is read.
    """
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state_dict = dict(state_dict)
    for ignore in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state_dict.pop(ignore, None)
    return remove_tied_weights_from_state_dict(state_dict, model)


def hook_weights_map(module: torch.nn.Module):
    """The mapping an accelerate offload hook reads ``module``'s own tensors from, or ``None``.

    ``dispatch_model`` / ``from_pretrained(device_map=...)`` attach an ``AlignDevicesHook`` (possibly inside a
    ``SequentialHook``) whose ``weights_map`` is a ``PrefixedDataset`` over the cpu state dict and the disk
    offload index; indexing it loads one tensor.
    """
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return None
    for h in getattr(hook, "hooks", None) or (hook,):
        wm = getattr(h, "weights_map", None)
        if wm is not None and getattr(h, "offload", True):
            return wm
    return None


def offload_file_entry(weights_map: Any, key: str) -> dict[str, Any] | None:
    """Where accelerate's offload loader reads ``weights_map[key]`` from, without loading it.

    ``OffloadedWeightsLoader.__getitem__`` (behind a hook's ``PrefixedDataset``) returns a tensor of its
    ``state_dict`` if it holds one, else reads its ``index`` entry: a tensor of a safetensors file
    (``safetensors_file`` / ``weight_name``, cast to ``dtype``; transformers' disk offload) or the raw
    ``<save_folder>/<key>.dat`` (accelerate's ``offload_weight``). The caller checks dtype and shape
    against the file before using the bytes in place of the loaded tensor.

    Returns:
        ``{"format": "safetensors", "file", "name", "dtype"}`` or ``{"format": "dat", "file", "dtype",
        "shape"}``; ``None`` for a tensor held in memory or a mapping of another kind.
    """
    check_accelerate_version()
    from accelerate.utils.offload import OffloadedWeightsLoader, PrefixedDataset

    if not isinstance(weights_map, PrefixedDataset) or not isinstance(weights_map.dataset, OffloadedWeightsLoader):
        return None
    loader, full = weights_map.dataset, f"{weights_map.prefix}{key}"
    info = loader.index.get(full)
    if full in loader.state_dict or not isinstance(info, dict):
        return None
    if info.get("safetensors_file") is not None:
        return {"format": "safetensors", "file": str(info["safetensors_file"]), "name": info.get("weight_name", full),
                "dtype": info.get("dtype")}
    if loader.save_folder is None or "dtype" not in info or "shape" not in info:
        return None
    return {"format": "dat", "file": os.path.join(loader.save_folder, f"{full}.dat"), "dtype": info["dtype"],
            "shape": list(info["shape"])}


def default_store() -> Any:
    """The default process group's key-value store, or ``None``.

    ``torch.distributed.distributed_c10d._get_default_store`` is private; our timeout-guarded collectives
    use the store only to mark which rank reached which collective, so that a timeout can name the rank
    that is missing. Without it the errors still fire, just without the rank.
    """
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank holds of ``tensor``: its local shard's for a ``DTensor``, all of them otherwise.

    ``DTensor.to_local()`` is the public way, but each call goes through an autograd function (0.3 ms for the
    75 parameters of a 100M-parameter Llama on a process's first ``prepare``); the ``shard`` stage's report reads
    the local tensor that ``DTensor`` keeps as its private attribute ``_local_tensor`` instead (the same tensor
    ``to_local()`` returns), falling back to ``to_local()`` where a torch version has no such attribute.
    """
    local = getattr(tensor, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local.numel()
    to_local = getattr(tensor, "to_local", None)
    if to_local is None:
        return tensor.numel()
    with torch.no_grad():
        return to_local().numel()


def dtensor_chunks(param: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offsets, sizes)`` of each block of the full tensor that this rank's local tensor of the DTensor ``param``
    holds: what ``DTensor.__create_chunk_list__`` (the protocol DCP saves by) reports, one block for a plain local
    tensor.

    The public protocol imports ``torch.distributed.checkpoint`` on its first call (its ``planner_helpers``): about 2 MiB
    of private memory and 40 ms in a process that has not loaded DCP, paid by every rank inside ``prepare``'s
    ``rank0_distribute``, which stock accelerate never pays. For a plain local tensor without partial placements the
    block is the one ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (private) computes from
    the placements, as the protocol itself does; anything else (a tensor subclass with its own chunks, a partial
    placement, which the protocol refuses), or a torch without that function, goes through the protocol.

    Example:
        >>> # dtensor_chunks(model.lm_head.weight)  # rank 1 of 2, FSDP2, 8 rows: [((4, 0), (4, hidden))]
    """
    local = getattr(param, "_local_tensor", None)
    if (type(local) is torch.Tensor or type(local) is torch.nn.Parameter) and not any(
            p.is_partial() for p in param.placements):
        try:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        except ImportError:
            compute_local_shape_and_global_offset = None
        if compute_local_shape_and_global_offset is not None:
            sizes, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            return [(tuple(int(x) for x in offsets), tuple(int(x) for x in sizes))]
    return [(tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)) for c in param.__create_chunk_list__()]


#: The first torch release whose process-group stores have ``clone()`` (a second connection to the same store): the
#: plugin's agreements wait on a clone while the failure board uses the store itself. ``pyproject.toml`` requires it.
TORCH_STORE_CLONE = Version("2.8.0")


def store_clone(store: Any) -> Any:
    """``store.clone()``: a new client of the same store, for a thread that blocks in ``wait``.

    Raises:
        ConfigError: If the installed torch's store has no ``clone`` (torch before :data:`TORCH_STORE_CLONE`, which
            the package requires: such a torch came in without pip's dependency check).
    """
    clone = getattr(store, "clone", None)
    if clone is None:
        from .errors import ConfigError

        raise ConfigError(
            f"torch {torch.__version__}: the process group's store ({type(store).__name__}) has no `clone()`, which "
            f"came with torch {TORCH_STORE_CLONE}; accelerate_memsafe requires torch>={TORCH_STORE_CLONE} for its "
            "agreements between ranks. Upgrade torch, or run without the plugin."
        )
    return clone()


#: The first torch release seen to record ``_checkpoint_offset`` on the storages of ``torch.load(map_location="meta")``
#: (2.6, 2.8 and 2.10 record none; 2.11 and 2.13 do). Where none is recorded the optimizer reload maps the file instead.
TORCH_META_CHECKPOINT_OFFSET = Version("2.11.0")


def checkpoint_file_offset(tensor: torch.Tensor) -> int | None:
    """Byte offset in its ``torch.save`` file of the storage of a tensor loaded with ``map_location="meta"``.

    ``torch.load`` records it as the private attribute ``_checkpoint_offset`` of each meta storage (torch
    >= :data:`TORCH_META_CHECKPOINT_OFFSET`); the optimizer reload uses it to read one tensor at a time straight
    into its destination instead of materialising the whole file. ``None`` where torch does not record it: the
    caller then maps the file (``torch.load(mmap=True)``) and copies each tensor from the mapping.
    """
    offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
    return int(offset) if isinstance(offset, int) else None


#: peft / transformers versions whose ``Trainer._load_best_model`` / ``Trainer._load_from_checkpoint`` (private
#: methods overridden by ``integrations.trainer.MemSafeTrainerMixin``) and peft save layout were tested.
TESTED_PEFT = (Version("0.21.0"), Version("0.23.0"))
TESTED_TRANSFORMERS = (Version("5.23.0"), Version("5.26.0"))


def check_trainer_peft_versions(peft_version: str | None = None, transformers_version: str | None = None) -> bool:
    """Whether the installed peft and transformers are versions the Trainer integration was tested with.

    ``MemSafeTrainerMixin`` overrides the private ``Trainer._load_best_model`` and
    ``Trainer._load_from_checkpoint`` and relies on peft's ``save_pretrained`` layout; with other versions it
    warns and falls back to the upstream methods.

    Returns:
        ``True`` for tested versions; otherwise warns and returns ``False``.
    """
    import peft
    import transformers

    return _warn_untested(
        "Trainer integration",
        {"peft": Version(peft_version or peft.__version__), "transformers": Version(transformers_version or transformers.__version__)},
        {"peft": TESTED_PEFT, "transformers": TESTED_TRANSFORMERS},
        "Falling back to the Trainer's own adapter loading (it materialises the whole adapter on the device). "
        "Call `accelerate_memsafe.reload_adapter(model, checkpoint)` yourself to keep the CPU-first path.",
        stacklevel=4,
    )


def current_dispatch_modes() -> list[Any]:
    """The ``TorchDispatchMode`` objects active in this thread (innermost last).

    ``torch.utils._python_dispatch._get_current_dispatch_mode_stack`` is private. Dispatch modes are
    thread-local; ``rank0_distribute`` re-enters them in its prefetch thread so that the live-tensor
    tracker of the stage probe also sees the bucket copies made there.
    """
    try:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        return list(_get_current_dispatch_mode_stack())
    except Exception:
        return []


#: torchdata versions whose ``StatefulDataLoader.next_iter_state`` and single-process iterator state keys
#: (``_num_yielded``, ``_sampler_iter_state``, ``_iterator_finished``, ``_dataset_state``) were tested.
TESTED_TORCHDATA = (Version("0.10.0"), Version("0.12.0"))


def start_next_epoch_fresh(dataloader: Any) -> bool:
    """Makes a torchdata ``StatefulDataLoader`` restored from the state of a *finished* epoch begin its next
    epoch as the uninterrupted run does: with one new iterator.

    torchdata restores such a state by building an iterator for the finished epoch (which draws its base
    seed and, for a stateful ``RandomSampler``, a permutation), replaying its sampler, then discarding it
    and building the next one: draws the uninterrupted run never made, so the next epoch's order and the
    global RNG after it differ. Here the pending state (the private ``next_iter_state``) is dropped, after
    its dataset state (if any) was applied as torchdata would, so the next ``iter()`` is a plain new epoch.

    Only the single-process iterator's state (``num_workers=0``) is handled; a worker-pool state is left to
    torchdata. Outside the tested torchdata versions this warns and does nothing.

    Returns:
        Whether the pending state was dropped.
    """
    state = getattr(dataloader, "next_iter_state", None)
    if not (isinstance(state, dict) and state.get("_iterator_finished") is True and "_num_yielded" in state
            and "_sampler_iter_state" in state):
        return False
    import torchdata

    if not _warn_untested("resume at an epoch boundary", {"torchdata": Version(torchdata.__version__.split("+")[0])},
                          {"torchdata": TESTED_TORCHDATA},
                          "The next epoch is left to torchdata's own restore, which may draw another order.",
                          stacklevel=4):
        return False
    from torchdata.stateful_dataloader.stateful import Stateful
    from torchdata.stateful_dataloader.stateful_dataloader import try_to_deserialize

    if state.get("_dataset_state") is not None and isinstance(dataloader.dataset, Stateful):
        try_to_deserialize(dataloader.dataset, state["_dataset_state"])
    dataloader.next_iter_state = None
    dataloader._iterator = None  # what `load_state_dict` sets: a fresh iterator at `iter()`
    return True


# -- transformers ``Trainer`` internals used by ``integrations.trainer`` --------------------------------------
#
# 6. ``Trainer.create_accelerator_and_postprocess`` builds the Trainer's accelerator as
#    ``transformers.trainer.Accelerator(**args)`` (a module global) and derives ``is_fsdp_enabled`` /
#    ``is_deepspeed_enabled`` from its state. ``MemSafeTrainerMixin`` lets that method run unchanged with the
#    global pointing at a factory of ``accelerate_memsafe.Accelerator`` for the duration of the call.
# 7. ``AcceleratorState._reset_state``: ``TrainingArguments`` initialises accelerate's state as it builds its
#    device; on a machine without an accelerator and without ``use_cpu=True`` that is a single-process state
#    (``NO``), which must be reset before a gloo group can be formed (transformers resets it the same way).


def check_trainer_version(transformers_version: str | None = None) -> bool:
    """Whether the installed transformers is one whose ``Trainer.create_accelerator_and_postprocess`` was
    tested with :func:`trainer_accelerator_factory` (warns otherwise).

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     check_trainer_version("9.0.0")
        False
    """
    import transformers

    return _warn_untested(
        "Trainer accelerator", {"transformers": Version(transformers_version or transformers.__version__)},
        {"transformers": TESTED_TRANSFORMERS},
        "If the Trainer no longer builds its accelerator as `transformers.trainer.Accelerator(**args)`, the plugin is "
        "attached to the accelerator it built instead. Please report problems with the versions involved.",
        stacklevel=4,
    )


@contextlib.contextmanager
def trainer_accelerator_factory(factory: Callable[..., Any]) -> Iterator[None]:
    """While open, ``transformers.Trainer.create_accelerator_and_postprocess`` builds its accelerator with
    ``factory(**args)`` instead of ``accelerate.Accelerator(**args)`` (the module global
    ``transformers.trainer.Accelerator`` is swapped and restored; the Trainer builds nothing else with it).
    """
    import transformers.trainer as trainer_module

    check_trainer_version()
    original = trainer_module.Accelerator
    trainer_module.Accelerator = factory
    try:
        yield
    finally:
        trainer_module.Accelerator = original


def reset_single_process_state() -> bool:
    """Resets an accelerate state that was initialised as a single process (``NO``) in a multi-process launch
    on a machine without an accelerator, so that the next ``Accelerator(cpu=True)`` forms a gloo group.

    ``TrainingArguments`` builds accelerate's ``PartialState`` when it is created; without ``use_cpu=True`` a
    CPU-only machine gets ``DistributedType.NO`` with one process, in every process of the launch. Objects that
    hold the state (``TrainingArguments.distributed_state``) share its dictionary and see the new state.

    Returns:
        Whether the state was reset.
    """
    from .env import launch_env

    shared = PartialState._shared_state
    if not shared or shared.get("distributed_type") != DistributedType.NO or launch_env().world_size <= 1:
        return False
    check_accelerate_version()
    AcceleratorState._reset_state(reset_partial_state=True)
    return True
