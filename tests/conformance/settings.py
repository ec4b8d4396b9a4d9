"""The settings (columns) of the conformance matrix: how the FSDP2 plugin, mixed precision and the loader
are configured. Not the full cross product: every wrap policy with both precisions through the memsafe
loader, then CPU offload, activation checkpointing and the stock transformers loader one at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: ``min_num_params`` for ``size_based_wrap``: small enough that the tiny models' layers get their own group.
MIN_NUM_PARAMS = 2_000


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One column of the matrix."""

    name: str
    wrap: str | None = "transformer_based_wrap"
    """``auto_wrap_policy`` of the FSDP plugin (``None``: only the root module is sharded)."""
    mixed_precision: str = "no"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    loader: str = "memsafe"
    """``"memsafe"``: ``accelerate_memsafe.from_pretrained`` (rank 0 reads, others on meta);
    ``"hf"``: ``AutoCls.from_pretrained`` on every rank."""
    efficient: bool = True
    """``cpu_ram_efficient_loading`` (needed by the memsafe loader: stock fills rank != 0 from rank 0)."""
    parallelism: tuple[tuple[str, int], ...] = ()
    """accelerate's ``ParallelismConfig`` sizes (empty: none, FSDP over every rank)."""
    world_size: int = 2
    """How many gloo ranks the cell runs on."""

    @property
    def context_parallel(self) -> bool:
        """Whether accelerate's ``prepare`` attaches its context-parallel hooks (``cp_size`` > 1): the model then
        computes its loss without attention masks, as causal attention."""
        return dict(self.parallelism).get("cp_size", 1) > 1

    def parallelism_config(self) -> Any:
        """The ``ParallelismConfig`` of :attr:`parallelism`, or ``None``."""
        if not self.parallelism:
            return None
        from accelerate.utils import ParallelismConfig

        return ParallelismConfig(**dict(self.parallelism))

    def fsdp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``FullyShardedDataParallelPlugin``, as a user writes them."""
        kwargs: dict[str, Any] = {"fsdp_version": 2, "auto_wrap_policy": self.wrap, "cpu_ram_efficient_loading": self.efficient}
        if self.wrap == "size_based_wrap":
            kwargs["min_num_params"] = MIN_NUM_PARAMS
        if self.cpu_offload:
            kwargs["cpu_offload"] = True
        if self.activation_checkpointing:
            kwargs["activation_checkpointing"] = True
        return kwargs


SETTINGS: tuple[Setting, ...] = (
    Setting(name="tw"),
    Setting(name="tw-bf16", mixed_precision="bf16"),
    Setting(name="size", wrap="size_based_wrap"),
    Setting(name="size-bf16", wrap="size_based_wrap", mixed_precision="bf16"),
    Setting(name="none", wrap=None),
    Setting(name="none-bf16", wrap=None, mixed_precision="bf16"),
    Setting(name="offload", cpu_offload=True),
    Setting(name="ac", activation_checkpointing=True),
    Setting(name="hf-tw", loader="hf", efficient=False),
    Setting(name="hf-tw-efficient", loader="hf"),
    Setting(name="hf-none", wrap=None, loader="hf", efficient=False),
)

#: Settings run on request only (``--settings tp,hsdp,cp``), not in the page's default columns: 4 ranks each, FSDP 2 x
#: TP 2 (the model's own TP plan where the plugin applies it), HSDP 2 x 2 (2 replicas of a 2-way FSDP), and FSDP 2 x CP 2
#: (accelerate shards over the flattened ``dp_shard_cp`` dimension: a 4-way FSDP whose mesh has a ``cp`` dimension).
EXTRA_SETTINGS: tuple[Setting, ...] = (
    Setting(name="tp", parallelism=(("dp_shard_size", 2), ("tp_size", 2)), world_size=4),
    Setting(name="hsdp", parallelism=(("dp_replicate_size", 2), ("dp_shard_size", 2)), world_size=4),
    Setting(name="cp", parallelism=(("dp_shard_size", 2), ("cp_size", 2)), world_size=4),
)

BY_NAME = {s.name: s for s in SETTINGS + EXTRA_SETTINGS}
