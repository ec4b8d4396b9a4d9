"""Small Llama-style models built from configs (random init, saved locally): nothing is downloaded.

Used by the demo, the examples, the tests and the benchmarks.
"""

from __future__ import annotations

from pathlib import Path

import torch

#: Named sizes: (hidden, intermediate, layers, heads, kv_heads, vocab). ``"1g"`` is about 1 GB in fp32.
SIZES = {
    "tiny": (64, 128, 2, 4, 2, 256),
    "small": (256, 688, 4, 8, 4, 4096),
    "100m": (768, 2048, 8, 12, 4, 16000),
    "250m": (1024, 2816, 12, 16, 8, 32000),
    "500m": (1280, 3456, 16, 16, 8, 32000),
    "1g": (1536, 4096, 20, 16, 8, 32000),
}


def llama_config(size: str = "tiny", *, tie_word_embeddings: bool = False):
    """A ``LlamaConfig`` of a named size (see :data:`SIZES`).

    Example:
        >>> llama_config("tiny").hidden_size
        64
    """
    from transformers import LlamaConfig

    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}.")
    hidden, inter, layers, heads, kv, vocab = SIZES[size]
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )


def build_llama(size: str = "tiny", *, seed: int = 0, dtype: torch.dtype = torch.float32, tie_word_embeddings: bool = False):
    """A randomly initialised ``LlamaForCausalLM`` of a named size, deterministic for a seed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(size, tie_word_embeddings=tie_word_embeddings))
    return model.to(dtype)


def save_llama(path: str | Path, size: str = "tiny", *, seed: int = 0, dtype: torch.dtype = torch.float32,
               tie_word_embeddings: bool = False, max_shard_size: str | int = "5GB") -> Path:
    """Builds a model with :func:`build_llama` and ``save_pretrained``s it (safetensors) to ``path``.

    Example:
        >>> # save_llama("/tmp/tiny-llama")
    """
    path = Path(path)
    model = build_llama(size, seed=seed, dtype=dtype, tie_word_embeddings=tie_word_embeddings)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    del model
    return path
