"""Applying FSDP2 and keeping optimizers pointed at the sharded parameters."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat, walk
from .direct_use import modules_used_directly


def fsdp2_prepare_skip_reason(*, is_fsdp2: bool, model: torch.nn.Module | None, parallelism_config: Any = None) -> str | None:
    """Why an FSDP2 prepare stage has nothing to do (``None``: it applies).

    With tensor parallelism (``tp_size > 1``) the stages apply, but to a model that transformers already
    parallelised while loading (accelerate's ``prepare`` finishes that one); whether the model's TP plan is applied
    is :func:`shard_model`'s decision.

    Example:
        >>> fsdp2_prepare_skip_reason(is_fsdp2=False, model=None)
        'not an FSDP2 run'
    """
    if not is_fsdp2:
        return "not an FSDP2 run"
    if model is None:
        return "no model passed to prepare"
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        return "model is already sharded"
    tp = getattr(parallelism_config, "tp_size", 1) or 1
    if tp > 1:
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in model.parameters()):
            return (f"tensor parallelism (parallelism_config.tp_size={tp}) with a model already parallelised while "
                    "loading (`tp_plan`): accelerate's own prepare finishes it")
    return None


def canonical_name(name: str) -> str:
    """Strips wrapper prefixes (activation checkpointing, ``torch.compile``) from a parameter name.

    Example:
        >>> canonical_name("layers.0._checkpoint_wrapped_module.mlp.weight")
        'layers.0.mlp.weight'
    """
    if "_checkpoint_wrapped_module" not in name and "_orig_mod" not in name:
        return name  # the common case: no wrapper in the name
    name = name.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")
    return name.replace("_orig_mod.", "").replace("._orig_mod", "")


def stepped_state(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s state is not the one it builds when constructed (``None``: it is, or it has none): a
    parameter's state without a ``step``, or with a ``step`` other than 0. A ``step`` on ``meta`` counts as 0 (the
    parameters of a rank that holds them on ``meta`` have taken no step).

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.Adagrad([p], lr=0.1)  # builds its accumulators at construction
        >>> stepped_state(opt) is None
        True
        >>> p.grad = torch.ones(2); opt.step()
        >>> stepped_state(opt)
        'a parameter has taken 1 step(s)'
    """
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is None:
            return "a parameter's state has no `step`"
        if isinstance(step, torch.Tensor):
            if step.is_meta:
                continue
            step = step.item()
        if step != 0:
            return f"a parameter has taken {step:g} step(s)"
    return None


def remap_optimizer_params(optimizers: list[torch.optim.Optimizer], old: dict[str, Any], new: dict[str, Any]) -> int:
    """Points every optimizer param group at the new (sharded) parameters, matched by name.

    Args:
        optimizers: Optimizers built on the model's original parameters.
        old: Canonical name -> original parameter.
        new: Canonical name -> parameter after sharding.

    Returns:
        The number of parameter slots switched.

    Raises:
        ValueError: If an optimizer holds a parameter that is not in the model, or has taken a step (state of unsharded
            parameters cannot be carried over; the state an optimizer builds when constructed, :func:`stepped_state`, is
            dropped: it builds it again for the sharded parameters).

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2)); q = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([p], lr=0.1)
        >>> remap_optimizer_params([opt], {"w": p}, {"w": q})
        1
        >>> opt.param_groups[0]["params"][0] is q
        True
    """
    by_id = {id(p): n for n, p in old.items()}
    switched = 0
    for k, opt in enumerate(optimizers):
        if len(opt.state) > 0:
            stepped = stepped_state(opt)
            if stepped:
                raise ValueError(
                    f"optimizer #{k} already has state for {len(opt.state)} parameter(s), {stepped}; FSDP2 cannot carry "
                    "the state of unsharded parameters over. Build the optimizer, then call `prepare` before the first "
                    "step."
                )
            # the state an optimizer builds when it is constructed (Adagrad's accumulators at their initial value,
            # step 0), for the unsharded parameters: the optimizer builds the same for the sharded ones at its first
            # step, as it does under stock accelerate, which keeps these full-size tensors and then fails in
            # `save_state` (`state_dict` meets state of parameters no group holds)
            opt.state.clear()
        unknown = []
        for group in opt.param_groups:
            params = []
            for p in group["params"]:
                name = by_id.get(id(p))
                if name is None or name not in new:
                    unknown.append(name or f"<tensor shape={tuple(p.shape)}>")
                    params.append(p)
                else:
                    params.append(new[name])
                    switched += 1
            group["params"] = params
        if unknown:
            raise ValueError(
                f"optimizer #{k} holds {len(unknown)} parameter(s) that are not parameters of the prepared model: "
                f"{unknown[:10]}. Build the optimizer from `model.parameters()` of the model passed to `prepare`."
            )
    return switched


def named_parameters_canonical(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``dict(model.named_parameters())`` with canonical names (tied parameters appear once)."""
    return {canonical_name(n): p for n, p in walk.named_parameters(model)}


def _implements_forward(module: torch.nn.Module) -> bool:
    return type(module).forward is not torch.nn.Module.forward


def _group_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a ``fully_shard(module)`` would manage: those of ``module`` and of its descendants,
    not looking inside descendants that already are FSDP groups (a module reached twice gives its parameters
    twice: the callers only test membership). A plain loop over ``_modules``: a wrap policy asks it for every
    ``fully_shard`` call, and torch's nested generators cost most of the time."""
    from torch.distributed.fsdp import FSDPModule

    out: list[torch.nn.Parameter] = []
    stack = [module]
    while stack:
        mod = stack.pop()
        out.extend(p for p in mod._parameters.values() if p is not None)
        stack.extend(c for c in mod._modules.values() if c is not None and not isinstance(c, FSDPModule))
    return out


class GroupFilter:
    """Keeps every non-root FSDP2 group formable (see ``_compat.filtered_fully_shard``).

    From the modules of one ``fully_shard`` call :meth:`select` drops containers without ``forward``,
    modules whose parameters an earlier group already manages (accelerate's tail ``[final_norm, lm_head]``
    after ``size_based_wrap`` grouped their parent), children whose weights their parent's ``forward`` reads
    without calling them (transformers' ``force_accelerate_hooks``: a mamba mixer's ``conv1d``; such a group would
    never be unsharded, :func:`~accelerate_memsafe._compat.directly_used_children`; with ``read_code``, also those the
    source of the model's ``forward`` methods shows used that way, and modules whose ``forward`` returns a parameter of
    their own: :func:`~accelerate_memsafe.distributed.direct_use.modules_used_directly`), and, repeatedly, every module
    holding a parameter that is also owned by a module outside the call (a tie the group would split). What is
    dropped stays with an enclosing group, so tied parameters always end up in one group: the smallest that holds
    every module using them.

    Example:
        >>> a = torch.nn.Linear(2, 2); b = torch.nn.Linear(2, 2); b.weight = a.weight
        >>> f = GroupFilter(torch.nn.Sequential(a, b))
        >>> f.select([a]), len(f.select([a, b]))
        ([], 2)
    """

    def __init__(self, root: torch.nn.Module, *, read_code: bool = False) -> None:
        self.root = root
        self.read_code = read_code
        self.managed: set[int] = set()
        self.dropped: list[str] = []
        self._owners: dict[int, set[int]] | None = None  # id(parameter) -> ids of the modules holding it
        self._tied = True  # whether some parameter is held by several modules (known once the owner map is built)
        self._direct: set[int] = set()  # ids of the children a parent's forward uses directly (with the owner map)
        self._selected: list[tuple[torch.nn.Module, list[int]]] = []  # (module, ids of its parameters) before sharding

    def _owner_map(self) -> dict[int, set[int]]:
        """Which modules of the tree hold each parameter: built once (one walk of the tree), then kept up to date by
        :meth:`formed` (``fully_shard`` replaces the parameters of the modules it groups), so a wrap policy's many
        calls cost one walk of the tree, not one each.

        A tree in which no parameter is held by two modules has no tie to split: every parameter's one holder lies in
        the subtree of the module whose group takes it, and ``fully_shard`` makes no tie (each parameter becomes one new
        one). :meth:`select` then skips the tie check, and :meth:`formed` leaves the map as it was (it is not asked
        again)."""
        if self._owners is None:
            self._owners = {}
            for mod in walk.modules(self.root):
                self._add_owner(mod)
                for name in _compat.directly_used_children(type(mod)):
                    child = mod._modules.get(name)
                    if child is not None:
                        self._direct.add(id(child))
                if self.read_code:
                    self._direct.update(id(m) for m in modules_used_directly(mod))
            self._tied = any(len(holders) > 1 for holders in self._owners.values())
        return self._owners

    def _add_owner(self, mod: torch.nn.Module) -> None:
        for p in mod._parameters.values():
            if p is not None:
                self._owners.setdefault(id(p), set()).add(id(mod))

    def select(self, modules: list[torch.nn.Module]) -> list[torch.nn.Module]:
        # (module, the ids of the parameters its group would manage); its subtree too where the tie check needs it:
        # each walked once per call
        owners = self._owner_map()  # (built at the first call, with the children used directly)
        candidates = []
        for m in modules:
            if not _implements_forward(m) or id(m) in self._direct:
                continue
            ids = [id(p) for p in _group_params(m)]
            if not any(pid in self.managed for pid in ids):
                candidates.append((m, ids))
        if not self._tied:  # no tie anywhere: nothing to split, and no owner map to keep up to date
            kept_modules = [m for m, _ in candidates]
            chosen = {id(m) for m in kept_modules}
            self.dropped.extend(type(m).__name__ for m in modules if id(m) not in chosen)
            return kept_modules
        candidates = [(m, ids, walk.modules(m)) for m, ids in candidates]
        while candidates:
            inside = {id(sub) for _, _, subtree in candidates for sub in subtree}
            kept = [c for c in candidates if all(owners[pid] <= inside for pid in c[1])]
            if len(kept) == len(candidates):
                break
            candidates = kept
        kept_modules = [m for m, _, _ in candidates]
        chosen = {id(m) for m in kept_modules}
        self.dropped.extend(type(m).__name__ for m in modules if id(m) not in chosen)
        # what the kept modules hold now, to put the owner map right once `fully_shard` replaced it (`formed`)
        self._selected = [(sub, [id(p) for p in sub._parameters.values() if p is not None])
                          for _, _, subtree in candidates for sub in subtree]
        return kept_modules

    def formed(self, modules: list[torch.nn.Module]) -> None:
        for m in modules:
            self.managed.update(id(p) for p in _group_params(m))
        if self._owners is not None and self._tied:
            # the parameters `fully_shard` replaced leave the map before their successors enter it: a successor may
            # have the id of a replaced parameter that was freed (outside the group every old parameter is still held
            # by its module, so no id of theirs can come back)
            for mod, ids in self._selected:
                for pid in ids:
                    holders = self._owners.get(pid)
                    if holders is not None:
                        holders.discard(id(mod))
                        if not holders:
                            del self._owners[pid]
            for mod, _ in self._selected:
                self._add_owner(mod)
        self._selected = []


#: Keyword arguments through which a transformers layer reads and *writes* its KV cache (``cache`` from
#: transformers 5.24, ``past_key_values`` before it; ``layer_past`` / ``past_key_value`` in older layers).
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past", "past_key_value")


def _cache_free_in_training(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple | None:
    """Forward pre-hook of a checkpoint wrapper: in training, the wrapped layer runs without a KV cache.

    transformers' own gradient checkpointing (``GradientCheckpointingLayer``) applies the same rule: a layer
    that writes the cache would write it a second time when the backward pass recomputes it, and the
    recomputed attention then sees twice the keys (a shape error, or a checkpoint metadata error). A layer
    that only reads the cache (``_can_checkpoint_with_cache``) keeps it, and so does a call without gradients
    (generating from a model in training mode): no backward replays it.
    """
    if not module.training or not torch.is_grad_enabled():
        return None
    inner = getattr(module, "_checkpoint_wrapped_module", module)
    changed = dict(kwargs)
    if changed.get("use_cache"):
        changed["use_cache"] = False
    if not getattr(inner, "_can_checkpoint_with_cache", False):
        for key in _CACHE_KWARGS:
            if changed.get(key) is not None:
                changed[key] = None
    return (args, changed) if changed != kwargs else None


def drop_cache_under_checkpointing(model: torch.nn.Module) -> int:
    """Makes activation-checkpointed transformers layers skip the KV cache in training, as transformers does.

    accelerate's FSDP2 activation checkpointing wraps layers in torch's ``CheckpointWrapper``, which replays
    the layer's forward with the same arguments, cache included; models whose layers write the cache
    (sliding-window and encoder-decoder attention among them) then fail in backward. Only wrappers around a
    transformers layer get the hook: a ``GradientCheckpointingLayer``, or a layer class of transformers' models
    that is not one (GPT-NeoX-Japanese's, which writes the cache as well); evaluation (``model.eval()``) is untouched.

    Returns:
        The number of wrappers hooked.

    Example:
        >>> drop_cache_under_checkpointing(torch.nn.Linear(2, 2))
        0
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # no transformers: no transformers layers
        return 0
    def transformers_layer(module: torch.nn.Module) -> bool:
        return isinstance(module, GradientCheckpointingLayer) or type(module).__module__.startswith("transformers.models.")

    hooked = 0
    for module in model.modules():
        if isinstance(module, CheckpointWrapper) and transformers_layer(module._checkpoint_wrapped_module):
            module.register_forward_pre_hook(_cache_free_in_training, with_kwargs=True)
            hooked += 1
    return hooked


def resolve_wrap_policy(fsdp_plugin: Any, model: torch.nn.Module) -> list[str]:
    """Resolves the plugin's ``auto_wrap_policy`` against the *unwrapped* model, once, as accelerate's
    ``_prepare_fsdp2`` does first thing. After ``fully_shard`` the layer classes are renamed
    (``FSDPLlamaDecoderLayer``), so resolving later by class name fails; a resolved policy (a
    ``functools.partial``) makes accelerate's own second call a no-op.

    ``transformer_based_wrap`` takes its classes from the model's ``_no_split_modules`` unless the user named them
    (``transformer_cls_names_to_wrap``). transformers lists there every layer class the architecture may build, and a
    configuration may build fewer (RoBERTa-PreLayerNorm's cross-attention only with ``add_cross_attention``, the text
    half of a vision-language model): accelerate then refuses the whole model ("Could not find the transformer layer
    class ... in the model"). The classes the model does not contain are left out here, so the policy wraps the layers
    it has, as it would had transformers listed only those. Classes the user named, and a model that has none of the
    listed classes, are resolved as accelerate does (its error included).

    Returns:
        The ``_no_split_modules`` classes left out because the model has no module of them (empty: none).

    Example:
        >>> from accelerate.utils import FullyShardedDataParallelPlugin
        >>> class Block(torch.nn.Linear): ...
        >>> model = torch.nn.Sequential(Block(2, 2)); model._no_split_modules = ["Block", "CrossAttention"]
        >>> plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
        >>> resolve_wrap_policy(plugin, model), plugin.transformer_cls_names_to_wrap
        (['CrossAttention'], ['Block'])
    """
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    absent: list[str] = []
    listed = getattr(model, "_no_split_modules", None)
    if fsdp_plugin.auto_wrap_policy is transformer_auto_wrap_policy and fsdp_plugin.transformer_cls_names_to_wrap is None \
            and listed:
        have = {type(m).__name__ for m in walk.modules(model)}
        present = [name for name in listed if name in have]
        if present and len(present) < len(listed):
            absent = [name for name in listed if name not in have]
            fsdp_plugin.transformer_cls_names_to_wrap = present
    fsdp_plugin.set_auto_wrap_policy(model)
    return absent


def policy_picks_any_module(fsdp_plugin: Any) -> bool:
    """Whether the plugin's (resolved) wrap policy may make any module a group of its own (``size_based_wrap``, a
    callable of the user's), where the group filter reads the model's source for modules its code uses without calling
    them (``GroupFilter(read_code=True)``). ``transformer_based_wrap`` groups the layer classes transformers declares
    (``_no_split_modules``: blocks its models call through their ``forward``), and no policy only the input embedding
    and the ``[final_norm, lm_head]`` tail: no family of docs/compatibility.md needs the reading there, and
    ``prepare`` pays none.

    Example:
        >>> from accelerate.utils import FullyShardedDataParallelPlugin
        >>> policy_picks_any_module(FullyShardedDataParallelPlugin(fsdp_version=2))
        False
    """
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = getattr(fsdp_plugin, "auto_wrap_policy", None)
    return policy is not None and getattr(policy, "func", policy) is not transformer_auto_wrap_policy


def shard_model(
    model: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    fsdp_plugin: Any,
    mixed_precision: str,
    mesh: Any = None,
    parallelism_config: Any = None,
    is_main_process: bool = True,
    device: torch.device | None = None,
    on_group: Callable[[list[torch.nn.Module]], None] | None = None,
    timings: dict[str, float] | None = None,
    counts: dict[str, int] | None = None,
    details: dict[str, Any] | None = None,
    tp_declined: str | None = None,
) -> torch.nn.Module:
    """Applies ``fully_shard`` the way accelerate does and remaps the optimizers onto the DTensor params.

    Parameters that are on ``meta`` stay on ``meta`` (no memory); others are moved to their shard.

    Args:
        model: The unsharded model.
        optimizers: Optimizers built on ``model``'s parameters (may be empty).
        fsdp_plugin: accelerate's ``FullyShardedDataParallelPlugin`` (``fsdp_version=2``).
        mixed_precision: ``"no"``, ``"bf16"`` or ``"fp16"`` (trainable params are upcast to fp32 master
            weights, as accelerate does).
        mesh: Device mesh (``None``: the default 1-D mesh over the world).
        parallelism_config: accelerate's ``ParallelismConfig`` or ``None``.
        is_main_process: Whether this is rank 0 (for logging only).
        device: The training device.
        on_group: Told of the modules of every FSDP group once ``fully_shard`` made it (the root's last, after
            accelerate's call returned): their parameters are sharded by then.
        timings: Receives ``fsdp2_wrap_s``, the wall of accelerate's own wrapping call (``fsdp2_prepare_model``,
            its ``fully_shard`` calls included), ``own_in_wrap_s``, the part of it spent in this function's own
            callbacks (the group filter, ``on_group``), and ``unsharded_release_s``, the wall of dropping the last
            references this function holds to the unsharded weights (where nothing else holds them, freeing them:
            unmapping a checkpoint's pages): the parts of this function that a stock ``prepare`` runs too.
        counts: Receives ``parameters`` (the sharded model's parameters, each once) and ``local_elements`` (the
            elements of their shards this rank holds), read from the walk that remaps the optimizers.
        details: Receives ``wrap_classes_absent`` where ``transformer_based_wrap`` left out classes of the model's
            ``_no_split_modules`` that it does not contain (:func:`resolve_wrap_policy`).
        tp_declined: With ``tp_size > 1``: why the model's TP plan is not applied, as the ranks agreed
            (``None``: this rank asks :func:`~accelerate_memsafe.distributed.tensor_parallel.tp_plan_problem`).
            A declined plan leaves FSDP over ``dp_shard`` only, as accelerate's own ``prepare`` does.

    Returns:
        The sharded model (the same object, now an ``FSDPModule``).

    Example:
        >>> # on every rank of an initialised process group
        >>> # model = shard_model(model, [opt], fsdp_plugin=plugin, mixed_precision="no")
    """
    old = named_parameters_canonical(model)
    tp = getattr(parallelism_config, "tp_size", 1) or 1
    if tp > 1:  # TP first, on meta, then activation checkpointing, then fully_shard (torchtitan's order)
        from .tensor_parallel import apply_tensor_parallel, resolve_tp_plan, tp_plan_problem

        plan, _, problem = resolve_tp_plan(model)
        problem = tp_declined or problem or tp_plan_problem(model, tp)
        if problem is None:
            apply_tensor_parallel(model, mesh["tp"], plan)
        # else, as accelerate's own prepare does with a model whose weights no TP plan split: FSDP over the
        # `dp_shard` dimension only (the groups of ranks along `tp` hold the same shards, fed the same batches)
    absent = resolve_wrap_policy(fsdp_plugin, model)
    if absent and details is not None:
        details["wrap_classes_absent"] = absent
    if fsdp_plugin.activation_checkpointing:
        model = _compat.apply_activation_checkpointing(model, fsdp_plugin)
        drop_cache_under_checkpointing(model)
    groups = GroupFilter(model, read_code=policy_picks_any_module(fsdp_plugin))
    own = [0.0]  # the wall of this function's callbacks inside accelerate's wrapping call

    def timed(callback: Callable[[list[torch.nn.Module]], Any]) -> Callable[[list[torch.nn.Module]], Any]:
        def call(modules: list[torch.nn.Module]) -> Any:
            t = time.perf_counter()
            try:
                return callback(modules)
            finally:
                own[0] += time.perf_counter() - t
        return call

    def formed(modules: list[torch.nn.Module]) -> None:
        groups.formed(modules)
        if on_group is not None:
            on_group(modules)

    started = time.perf_counter()
    with _compat.filtered_fully_shard(model, timed(groups.select), timed(formed)):
        model = _compat.fsdp2_wrap(
            model,
            fsdp_plugin=fsdp_plugin,
            mixed_precision=mixed_precision,
            mesh=mesh,
            parallelism_config=parallelism_config,
            is_main_process=is_main_process,
            device=device or torch.device("cpu"),
        )
    if timings is not None:
        timings["fsdp2_wrap_s"] = time.perf_counter() - started
        timings["own_in_wrap_s"] = own[0]
    if on_group is not None:
        on_group([model])
    new = named_parameters_canonical(model)
    remap_optimizer_params(optimizers, old, new)
    if counts is not None:
        counts["parameters"] = len(new)
        counts["local_elements"] = sum(_compat.local_numel(p) for p in new.values())
    del new
    started = time.perf_counter()
    # the last references to the unsharded weights here (the optimizers point at the shards now): what freeing them
    # costs (unmapping a mapped checkpoint's pages) a stock prepare pays too, when it switches its optimizers
    del old
    if timings is not None:
        timings["unsharded_release_s"] = time.perf_counter() - started
    return model
