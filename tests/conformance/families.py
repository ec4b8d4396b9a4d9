"""Architecture families for the conformance matrix, taken from transformers' auto registry.

Every candidate ``model_type`` is shrunk by one generic function (:func:`shrink`) plus a small override
table (:data:`OVERRIDES`), built with a fixed seed, and kept when it builds, gives a finite loss with
labels, survives a ``save_pretrained`` / ``from_pretrained`` round trip bit for bit and has fewer than
:data:`MAX_PARAMS` parameters. What a family exercises (its *kinds*) is read off the built model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from accelerate_memsafe.errors import message_line

SEED = 0
MAX_PARAMS = 2_000_000
BATCH, SEQ = 2, 12
ODD_VOCAB = 97  # FSDP2 pads rank 1's shard of the embeddings and the head (uneven rows)

#: Auto classes searched, in order of preference (a model type takes the first that lists it).
AUTO_CLASSES = (
    ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
)

#: Small sizes, each set on every default config that has the key (and a non-null default).
SIZES: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "word_embed_proj_dim"), 64),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads"), 4),
    "num_key_value_heads": 2,
    **dict.fromkeys(("head_dim", "d_kv"), 16),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
                     "hidden_dim"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts"), 4),
    "num_experts_per_tok": 2,
    **dict.fromkeys(("n_shared_experts", "n_group", "topk_group", "first_k_dense_replace"), 1),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_target_positions"), 64),
    "max_source_positions": 16,
    "sliding_window": 8,  # shorter than the batch, so the window changes the result
    "vocab_size": 128,
    "num_mel_bins": 16,
    "state_size": 8,
    "time_step_rank": 8,
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    "v_head_dim": 16,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 16,
}

#: Per-family changes on top of :data:`SIZES` (``model_type`` names the registry entry of a variant).
OVERRIDES: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": ODD_VOCAB},
    "llama3": {
        "model_type": "llama",
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    },
    "phi3": {
        "vocab_size": ODD_VOCAB,
        "original_max_position_embeddings": 8,  # shorter than the batch: the long factors are used
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 8,
                            "short_factor": [1.0 + i / 8 for i in range(8)], "long_factor": [2.0 + i / 4 for i in range(8)]},
    },
    "qwen2": {"use_sliding_window": True, "max_window_layers": 1, "tie_word_embeddings": True},
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"]},
    # hybrids: one layer of each kind (their defaults' first two layers are linear attention or convolution only, whose
    # cache transformers' forward cannot ask for its length)
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"]},
    "lfm3": {"layer_types": ["conv", "full_attention", "sliding_attention"], "num_hidden_layers": 3},
    "qwen3_moe": {"vocab_size": ODD_VOCAB},
    "deepseek_v3": {"head_dim": 8},
    "bert": {"vocab_size": ODD_VOCAB},
    "t5": {"vocab_size": ODD_VOCAB},
    "whisper": {"vocab_size": ODD_VOCAB, "begin_suppress_tokens": None},
    "gpt2": {"vocab_size": ODD_VOCAB},
    "mamba": {"vocab_size": ODD_VOCAB},
}

#: Tried first, in this order (together they cover every required kind); the rest of the registry follows.
PREFERRED = (
    "llama", "llama3", "phi3", "mistral", "qwen2", "gemma2", "gemma3_text", "qwen3_moe", "mixtral", "deepseek_v3",
    "gpt_oss", "bert", "roberta", "distilbert", "t5", "bart", "whisper", "mamba", "gpt2",
)

#: Kinds the matrix must cover (the reduced test set too).
REQUIRED_KINDS = (
    "decoder", "encoder", "encoder-decoder", "speech", "ssm", "moe", "moe:fused", "rope:default", "rope:llama3",
    "rope:longrope", "sliding-window", "tied:embeddings", "tied:encoder-decoder", "tied:bias", "conv1d",
    "buffers:non-persistent", "buffers:persistent", "vocab:odd",
)

_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 0, "sep_token_id": 2,
           "cls_token_id": 1, "mask_token_id": 3}
_SSM_KEYS = ("state_size", "ssm_state_size", "mamba_d_state")


class Dropped(Exception):
    """A candidate that cannot be part of the matrix; the message says why."""


@dataclass(frozen=True)
class Family:
    """One architecture family: what it is, how to load it and how to feed it."""

    name: str
    """Family name: a transformers ``model_type``, or a variant of one (see :data:`OVERRIDES`)."""
    model_type: str
    """The registry entry it is built from."""
    auto_class: str
    """The ``transformers`` auto class that loads the checkpoint."""
    kinds: tuple[str, ...]
    """What the family exercises (``decoder``, ``rope:llama3``, ``moe``, ``tied:embeddings`` ...)."""
    inputs: dict[str, tuple[str, tuple[int, ...], int]]
    """The batch: input name -> (``"ids"`` or ``"float"``, shape, vocabulary size for ids)."""
    num_params: int
    options: dict[str, Any]
    """Non-tensor forward arguments. Empty for every family: the forward runs with the model's defaults
    (``use_cache`` included, as a training loop calls it), which activation checkpointing must survive."""
    path: str = ""
    """Directory holding ``checkpoint/`` (``save_pretrained``) and ``reference.pt`` once prepared."""

    @property
    def checkpoint(self) -> str:
        return str(Path(self.path) / "checkpoint")

    @property
    def reference(self) -> str:
        return str(Path(self.path) / "reference.pt")


def candidates() -> dict[str, tuple[str, str]]:
    """Every family that may be tried: name -> (model_type, auto class), :data:`PREFERRED` first."""
    from transformers.models.auto import modeling_auto

    found: dict[str, str] = {}
    for auto_class, mapping in AUTO_CLASSES:
        for model_type in getattr(modeling_auto, mapping):
            found.setdefault(model_type, auto_class)
    out = {}
    for name in (*PREFERRED, *sorted(found)):
        model_type = OVERRIDES.get(name, {}).get("model_type", name)
        if model_type in found:
            out.setdefault(name, (model_type, found[model_type]))
    return out


def shrink(name: str, model_type: str):
    """The default config of ``model_type`` with :data:`SIZES`, no dropout, special tokens inside the
    vocabulary, and the family's :data:`OVERRIDES`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    defaults = config_cls().to_dict()
    kwargs = {k: v for k, v in SIZES.items() if defaults.get(k) is not None}
    kwargs.update({k: 0.0 for k, v in defaults.items() if isinstance(v, float) and _is_dropout(k)})
    kwargs.update({k: v for k, v in OVERRIDES.get(name, {}).items() if k != "model_type"})
    vocab = kwargs.get("vocab_size", defaults.get("vocab_size")) or 0
    for key, small in _TOKENS.items():
        value = kwargs.get(key, defaults.get(key))
        if isinstance(value, int) and value >= vocab or isinstance(value, list) and any(v >= vocab for v in value):
            kwargs[key] = small
    if defaults.get("is_encoder_decoder") and defaults.get("decoder_start_token_id") is None:
        kwargs.setdefault("decoder_start_token_id", kwargs.get("pad_token_id", defaults.get("pad_token_id")) or 0)
    return config_cls(**kwargs)


def _is_dropout(key: str) -> bool:
    return any(part in key for part in ("dropout", "pdrop", "layerdrop", "drop_rate"))


def build(name: str, model_type: str, auto_class: str) -> tuple[torch.nn.Module, Family]:
    """Builds the shrunk model with :data:`SEED` (after counting its parameters on ``meta``).

    Raises:
        Dropped: If the config or the model cannot be built, or it is too large.
    """
    import transformers

    cls = getattr(transformers, auto_class)
    try:
        config = shrink(name, model_type)
        with torch.device("meta"):
            n = sum(p.numel() for p in cls.from_config(config).parameters())
        if n >= MAX_PARAMS:
            raise Dropped(f"{n:,} parameters after shrinking (limit {MAX_PARAMS:,})")
        torch.manual_seed(SEED)
        model = cls.from_config(config).eval()
    except Dropped:
        raise
    except Exception as exc:
        raise Dropped(f"does not build: {_first_line(exc)}") from exc
    options: dict[str, Any] = {}
    family = Family(name=name, model_type=model_type, auto_class=auto_class, kinds=kinds_of(model, auto_class),
                    inputs=_inputs(model), num_params=n, options=options)
    return model, family


def _inputs(model: torch.nn.Module) -> dict[str, tuple[str, tuple[int, ...], int]]:
    config = model.config
    vocab = config.get_text_config().vocab_size
    labels = ("ids", (BATCH, SEQ), vocab)
    main = model.main_input_name
    if main == "input_ids":
        return {"input_ids": labels, "labels": labels}
    if main == "input_features" and hasattr(config, "num_mel_bins") and hasattr(config, "max_source_positions"):
        # Whisper-style encoders take exactly 2 frames per source position (stride-2 convolution)
        return {"input_features": ("float", (BATCH, config.num_mel_bins, 2 * config.max_source_positions), 0), "labels": labels}
    raise Dropped(f"no batch recipe for main input {main!r}")


def make_batch(family: Family, seed: int = 1234) -> dict[str, Any]:
    """The forward arguments of a family's fixed batch (the same on every rank and in the reference).

    Ids are drawn from ``[4, vocab)``, away from the special tokens.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = dict(family.options)
    for key, (kind, shape, vocab) in family.inputs.items():
        out[key] = torch.randint(4, vocab, shape, generator=g) if kind == "ids" else torch.randn(shape, generator=g)
    return out


def tie_groups(model: torch.nn.Module) -> list[list[str]]:
    """Parameter names that share one parameter object, sorted (one list per tied group).

    Wrapper prefixes (activation checkpointing, ``torch.compile``) are left out of the names.
    """
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(clean_name(name))
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def clean_name(name: str) -> str:
    """``name`` without the prefixes that wrappers insert (``_checkpoint_wrapped_module.`` ...)."""
    for prefix in ("_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def kinds_of(model: torch.nn.Module, auto_class: str) -> tuple[str, ...]:
    """What a built model exercises, read off its config, modules, parameters and buffers."""
    from transformers.pytorch_utils import Conv1D

    config = model.config
    kinds = {"encoder-decoder" if getattr(config, "is_encoder_decoder", False)
             else "encoder" if auto_class == "AutoModelForMaskedLM" else "decoder"}
    if model.main_input_name != "input_ids":
        kinds.add("speech")
    if any(getattr(config, k, None) for k in _SSM_KEYS):
        kinds.add("ssm")
    params = dict(model.named_parameters())
    if any(".experts." in n for n in params):
        kinds.add("moe")
        if any(".experts." in n and p.ndim == 3 for n, p in params.items()):
            kinds.add("moe:fused")
    buffers = dict(model.named_buffers())
    if any("inv_freq" in n for n in buffers):
        kinds.update(f"rope:{t}" for t in _rope_types(getattr(config, "rope_parameters", None)))
    layer_types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" in layer_types or getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        kinds.add("sliding-window")
    kinds.update(_tie_kinds(model))
    if any(isinstance(m, Conv1D) for m in model.modules()):
        kinds.add("conv1d")
    non_persistent = {f"{mn}.{b}" if mn else b for mn, m in model.named_modules() for b in m._non_persistent_buffers_set}
    if non_persistent & set(buffers):
        kinds.add("buffers:non-persistent")
    if set(buffers) - non_persistent:
        kinds.add("buffers:persistent")
    if config.get_text_config().vocab_size % 2:
        kinds.add("vocab:odd")
    return tuple(sorted(kinds))


def _rope_types(params: Any) -> set[str]:
    if not isinstance(params, dict):
        return set()
    if "rope_type" in params:
        return {params["rope_type"]}
    return set().union(*(_rope_types(v) for v in params.values()))


def _tie_kinds(model: torch.nn.Module) -> set[str]:
    out_emb = model.get_output_embeddings()
    out_name = next((f"{n}.weight" for n, m in model.named_modules() if m is out_emb), None) if out_emb is not None else None
    kinds = set()
    for group in tie_groups(model):
        if out_name in group:
            kinds.add("tied:embeddings")
        parts = [set(n.split(".")) for n in group]
        if any("encoder" in p for p in parts) and any("decoder" in p for p in parts):
            kinds.add("tied:encoder-decoder")
        if all(n.endswith("bias") for n in group):
            kinds.add("tied:bias")
    return kinds


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {message_line(exc)}".rstrip(": ")


def prepare(name: str, root: Path) -> Family:
    """Builds, checks and saves one family under ``root / name``: ``checkpoint/`` (safetensors) and
    ``reference.pt`` (the reloaded model's parameters, buffers, tie groups and loss on the fixed batch).

    Raises:
        Dropped: If the family fails any check (the message says which).
    """
    import transformers

    model_type, auto_class = candidates()[name]
    model, family = build(name, model_type, auto_class)
    family = replace(family, path=str(root / name))
    built = full_state(model)  # before the forward: LongRoPE's buffers change with the length it sees
    batch = make_batch(family)
    try:
        with torch.no_grad():
            loss = model(**batch).loss
    except Exception as exc:
        raise Dropped(f"forward with labels fails: {_first_line(exc)}") from exc
    if loss is None or not math.isfinite(loss.item()):
        raise Dropped(f"forward with labels gives loss {loss}")
    model.save_pretrained(family.checkpoint)
    ref, info = getattr(transformers, auto_class).from_pretrained(family.checkpoint, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise Dropped(f"does not round-trip through save_pretrained: {bad}")
    state = full_state(ref)
    if state.keys() != built.keys() or any(not torch.equal(state[k], built[k]) for k in state):
        raise Dropped("from_pretrained does not give back the saved tensors bit for bit")
    loss = reference_loss(ref.eval(), batch)
    torch.save({"state": state, "ties": tie_groups(ref), "loss": loss, "loss_cp": context_parallel_loss(ref, batch)},
               family.reference)
    return family


def context_parallel_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float | dict[str, str] | None:
    """The loss on ``batch`` with the hooks accelerate's ``prepare`` attaches under context parallelism (each
    ``self_attn`` gets no attention mask and ``is_causal=True``: what the model computes in the ``cp`` setting, on
    either path); ``None`` for a model accelerate refuses there; ``{"type", "message"}`` where the hooked forward
    fails in this one process (an attention whose ``forward`` takes no ``is_causal``): the cell's forward fails alike
    on either path. Attaches them to ``model``: call it last."""
    from accelerate.big_modeling import _attach_context_parallel_hooks

    from accelerate_memsafe import _compat

    if _compat.context_parallel_refusal(model) is not None:
        return None
    _attach_context_parallel_hooks(model)
    try:
        return reference_loss(model, batch)
    except Exception as exc:
        return {"type": type(exc).__name__, "message": message_line(exc)}  # as the worker records a path's error


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (full tensor, also when sharded) and every buffer, persistent or not, by clean name."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        out[clean_name(name)] = full.detach().to("cpu", copy=True)
    return out


def reference_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """The loss on ``batch`` computed on one thread, as each rank computes it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model(**batch).loss.float().item()
    finally:
        torch.set_num_threads(threads)


def select(root: Path, names: list[str] | None = None, *, count: int = 30, verbose: bool = False) -> tuple[list[Family], dict[str, str]]:
    """Prepares ``names`` (or the first ``count`` candidates that pass) under ``root``.

    Returns:
        The families kept, and why each other candidate tried was dropped.

    Raises:
        ValueError: If a name is not a candidate.
    """
    from transformers.utils import logging

    known = candidates()
    unknown = [n for n in names or () if n not in known]
    if unknown:
        raise ValueError(f"unknown families {unknown}; candidates are: {', '.join(known)}")
    kept, dropped = [], {}
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()  # shrunk configs and random weights make transformers warn a lot
    logging.disable_progress_bar()
    try:
        for name in names or known:
            if names is None and len(kept) >= count:
                break
            try:
                kept.append(prepare(name, root))
            except Dropped as exc:
                dropped[name] = str(exc)
                if verbose:
                    print(f"  dropped {name}: {exc}", flush=True)
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
    return kept, dropped
