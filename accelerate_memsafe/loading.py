"""``from_pretrained``: rank 0 loads the weights, every other rank builds the same model on ``meta``."""

from __future__ import annotations

import os
from typing import Any

import torch

from .env import launch_env
from .errors import ConfigError

#: Keyword arguments of ``from_pretrained`` that also shape the model built from its config.
_BUILD_KWARGS = ("attn_implementation",)
#: Keyword arguments that say where and how to read the config.
_CONFIG_KWARGS = ("revision", "subfolder", "cache_dir", "local_files_only", "token", "trust_remote_code", "force_download")
#: Keyword arguments that only matter when weights are read (ignored on the ranks that build on meta).
_LOAD_ONLY_KWARGS = (
    "device_map", "low_cpu_mem_usage", "use_safetensors", "weights_only", "max_memory", "offload_folder",
    "offload_state_dict", "state_dict", "quantization_config", "key_mapping", "output_loading_info",
    "ignore_mismatched_sizes", "tp_plan", "tp_size", "device_mesh", "variant", "gguf_file", "adapter_kwargs",
    "adapter_name", "use_kernels", "distributed_config", "proxies", "resume_download", "_fast_init",
)


#: How a checkpoint's head of another shape is loaded anyway, as transformers does (both refusals say it).
_ANOTHER_HEAD = ("for a head of another shape (another number of labels), pass `ignore_mismatched_sizes=True`, "
                 "as to transformers")


def from_pretrained(model_cls: Any, path: str | os.PathLike, **kwargs: Any) -> torch.nn.Module:
    """Loads a transformers model for an FSDP2 ``prepare`` that reads the weights on rank 0 only.

    Rank 0 calls ``model_cls.from_pretrained(path, **kwargs)`` (transformers maps the checkpoint, so this
    is cheap until the weights are read). Every other rank builds the same model from the config with its
    parameters on ``meta`` (no memory) and real non-persistent buffers; ``prepare`` with the plugin then
    sends each rank its shard. On rank 0 the checkpoint path is remembered, so that ``rank0_distribute``
    re-reads unmodified weights from the file with ``pread`` instead of paging the mapping in.

    Args:
        model_cls: Any transformers model class or auto class (``AutoModelForCausalLM``, ``LlamaForCausalLM`` ...).
        path: Local directory (or hub id) of the checkpoint.
        **kwargs: Passed to ``model_cls.from_pretrained`` on rank 0; on the other ranks ``dtype``,
            ``attn_implementation``, config overrides and config-location arguments are honoured.

    Returns:
        The model: loaded on rank 0, on ``meta`` elsewhere. Pass it to ``accelerator.prepare`` before
        using it (a non-zero rank's model has no weights until then).

    Raises:
        ConfigError: When called under a multi-process launch before the process group exists (build
            the ``Accelerator`` first).

    Example:
        >>> # accelerator = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        >>> # model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, "ckpt/", dtype=torch.bfloat16)
        >>> # model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    """
    if _rank("from_pretrained") == 0:
        if os.path.isdir(path):
            _check_checkpoint(model_cls, path, kwargs)
        want_info = kwargs.pop("output_loading_info", False)
        model, info = model_cls.from_pretrained(path, output_loading_info=True, **kwargs)
        _check_loading_info(path, info, model, ignore_mismatched=bool(kwargs.get("ignore_mismatched_sizes")))
        if want_info:
            return model, info
        if os.path.isdir(path):
            # read by `meta_placement` (rank 0 only); plain attribute, not a buffer or parameter
            object.__setattr__(model, "_memsafe_checkpoint", os.fspath(path))
        return model
    return _build_on_meta(model_cls, path, kwargs)


def from_config(model_cls: Any, config: Any, **kwargs: Any) -> torch.nn.Module:
    """Builds a transformers model from its config (training from scratch) for an FSDP2 ``prepare`` that
    initialises the weights on rank 0 only.

    Rank 0 builds the model as transformers does (``AutoModelForCausalLM.from_config(config, **kwargs)``, or
    ``LlamaForCausalLM._from_config(config, **kwargs)`` for a model class): real weights, randomly initialised. Every
    other rank builds the same model with its parameters on ``meta`` (no memory; non-persistent buffers real), so
    that a node does not hold one full model per process; ``prepare`` with the plugin then sends each rank its shard
    of rank 0's initialisation. Without it, each process initialises its own full copy, and without a common seed
    stock FSDP2 keeps each rank's rows of its own draw.

    Args:
        model_cls: Any transformers model class or auto class.
        config: The model's config (``AutoConfig.for_model(...)``, ``LlamaConfig(...)`` ...), the same on every rank.
        **kwargs: Passed to ``from_config`` / ``_from_config`` on every rank (``dtype``, ``attn_implementation``,
            ``trust_remote_code`` for an auto class).

    Returns:
        The model: initialised on rank 0, on ``meta`` elsewhere. Pass it to ``accelerator.prepare`` before
        using it.

    Raises:
        ConfigError: When called under a multi-process launch before the process group exists (build
            the ``Accelerator`` first).

    Example:
        >>> from transformers import AutoModelForCausalLM, LlamaConfig
        >>> config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        ...                      vocab_size=32)
        >>> model = from_config(AutoModelForCausalLM, config)  # one process: rank 0, real weights
        >>> model.lm_head.weight.is_meta, model.training
        (False, True)
    """
    if _rank("from_config") == 0:
        return _from_config(model_cls, config, kwargs)
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):  # buffers real: computed here as on rank 0
        model = _from_config(model_cls, config, kwargs)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # init_empty_weights re-creates parameters, which unties them
    return model


def _from_config(model_cls: Any, config: Any, kwargs: dict[str, Any]) -> torch.nn.Module:
    if hasattr(model_cls, "from_config") and not hasattr(model_cls, "_from_config"):
        return model_cls.from_config(config, **kwargs)  # an auto class
    return model_cls._from_config(config, **kwargs)


def _rank(caller: str) -> int:
    """This process's rank, once the process group exists under a multi-process launch.

    Raises:
        ConfigError: Under a multi-process launch before the process group exists.
    """
    import torch.distributed as dist

    env = launch_env()
    initialized = dist.is_available() and dist.is_initialized()
    if env.world_size > 1 and not initialized:
        raise ConfigError(
            f"`accelerate_memsafe.{caller}` was called on rank {env.rank} of a {env.world_size}-process launch "
            "before the process group exists, so it cannot tell rank 0 from the others. HINT: build the "
            f"`Accelerator(...)` first, then call `{caller}`."
        )
    return dist.get_rank() if initialized else 0


def _build_on_meta(model_cls: Any, path: Any, kwargs: dict[str, Any]) -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    kwargs = dict(kwargs)
    dtype = kwargs.pop("dtype", None)
    if dtype is None:
        dtype = kwargs.pop("torch_dtype", None)
    else:
        kwargs.pop("torch_dtype", None)
    build = {k: kwargs.pop(k) for k in _BUILD_KWARGS if k in kwargs}
    config_kwargs = {k: kwargs.pop(k) for k in _CONFIG_KWARGS if k in kwargs}
    for k in _LOAD_ONLY_KWARGS:
        kwargs.pop(k, None)
    config = kwargs.pop("config", None)
    if config is None or isinstance(config, (str, os.PathLike)):
        config, unused = AutoConfig.from_pretrained(config or path, return_unused_kwargs=True, **config_kwargs, **kwargs)
    else:
        for key, value in kwargs.items():
            setattr(config, key, value)
    if dtype in (None, "auto"):
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    trust = config_kwargs.get("trust_remote_code")
    # Buffers stay real: non-persistent ones (rotary inv_freq ...) are then computed here as on rank 0.
    with init_empty_weights(include_buffers=False):
        if hasattr(model_cls, "from_config") and not hasattr(model_cls, "_from_config"):
            extra = {"trust_remote_code": trust} if trust is not None else {}
            model = model_cls.from_config(config, dtype=dtype, **build, **extra)
        else:
            model = model_cls._from_config(config, dtype=dtype, **build)
    if hasattr(model, "tie_weights"):
        model.tie_weights()  # init_empty_weights re-creates parameters, which unties them
    model.eval()  # as from_pretrained returns it
    return model


def _check_checkpoint(model_cls: Any, path: Any, kwargs: dict[str, Any]) -> None:
    """Checks a local safetensors checkpoint before transformers reads it: a complete directory, index
    entries inside it, shards present and untruncated, shapes and lossless dtype casts against the model
    built on ``meta`` (names only a weight conversion produces are left to :func:`_check_loading_info`)."""
    from pathlib import Path

    from .io import atomic, validate

    path = Path(path)
    atomic.check_loadable(path)
    if not any((path / n).exists() for n in ("model.safetensors", "model.safetensors.index.json")):
        return  # another format (e.g. pickle .bin), or a variant: transformers checks it
    infos = validate.check_safetensors_checkpoint(path)
    meta = _build_on_meta(model_cls, path, kwargs)
    state = meta.state_dict()
    if kwargs.get("ignore_mismatched_sizes"):
        # asked for: transformers initialises the tensors of another shape anew, and never reads them
        state = {n: t for n, t in state.items() if n not in infos or tuple(infos[n].shape) == tuple(t.shape)}
    validate.check_shapes(infos, {n: tuple(t.shape) for n, t in state.items()}, where=str(path),
                          hint=f"Load a checkpoint saved from the same model (same config); {_ANOTHER_HEAD}.")
    validate.check_casts(infos, {n: t.dtype for n, t in state.items()})


def _check_loading_info(path: Any, info: dict[str, Any], model: torch.nn.Module, *, ignore_mismatched: bool = False) -> None:
    """Refuses a load that transformers completed with missing or mismatched tensors (it would initialise them
    randomly and only log a warning), but for the two loads where transformers means them (tensors of the checkpoint
    the model does not use are dropped, with a warning, as transformers does):

    - a checkpoint saved from another class than the one loaded (its ``config.architectures`` does not name it): a
      base model or another task's head loaded under a new head (``AutoModelForSequenceClassification`` from a causal
      LM's checkpoint ...). The tensors the checkpoint lacks are the new head's, initialised on rank 0, which
      ``prepare`` then sends to every rank; the ones the model lacks are the old head's.
    - ``ignore_mismatched_sizes=True``: tensors of another shape (a classifier with another number of labels) are
      initialised anew, as asked.

    A checkpoint saved from the very class loaded must match it: a tensor missing there is a damaged checkpoint."""
    import logging

    from .io.validate import listing, raise_if_mismatched

    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    wrong = sorted(str(m[0] if isinstance(m, (tuple, list)) else m) for m in info.get("mismatched_keys") or [])
    saved_from = list(getattr(getattr(model, "config", None), "architectures", None) or [])
    loaded = type(model).__name__
    new_head = bool(saved_from) and loaded not in saved_from
    where = (f"its config.json names {loaded}, the class loaded" if saved_from
             else "its config.json names no class it was saved from (`architectures`)")
    hint = (f"A checkpoint must hold every tensor of the model when {where}: re-save the checkpoint, or load it "
            f"with the class it was saved from; {_ANOTHER_HEAD}. To take transformers' random initialisation of "
            "the missing tensors anyway, load with transformers' `from_pretrained` on every rank: `prepare` then "
            "sends rank 0's to every rank.")
    # tensors of the checkpoint the model does not use are no damage (a config that shrinks the model,
    # `num_hidden_layers=1`, or another head): transformers drops them with a warning, and so does this
    raise_if_mismatched(str(path), missing=[] if new_head else missing, wrong=[] if ignore_mismatched else wrong,
                        hint=hint)
    fresh = missing + (wrong if ignore_mismatched else [])
    if fresh or unexpected:
        logging.getLogger(__name__).warning(
            "`accelerate_memsafe.from_pretrained`: %s was saved from %s and is loaded as %s: %d tensor(s) are newly "
            "initialised on rank 0, which `prepare` sends to every rank (%s); %d of the checkpoint are not used (%s).",
            path, "/".join(saved_from) or "an unnamed class", loaded, len(fresh), listing(fresh, 10), len(unexpected),
            listing(unexpected, 10))
