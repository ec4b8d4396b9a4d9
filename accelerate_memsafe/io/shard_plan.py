"""A conversion-aware shard plan, made from names, shapes and dtypes only (no tensor data is read).

transformers loads some checkpoints through *weight conversions* (``conversion_mapping.py``): per-expert
tensors are fused into one, one ``qkv`` tensor is chunked into ``q``/``k``/``v``... Saving with
``save_original_format=True`` reverts them. A reverse conversion that is many-to-one (the model's ``q``,
``k`` and ``v`` concatenated back into ``qkv``) needs all of its inputs at once; if they land in different
shards, a shard-by-shard writer cannot revert it. The plan therefore packs *conversion groups* (every model
tensor one reverse conversion needs), never single tensors, into shards:

- groups come from transformers' own conversion mapping (no model type is named here),
- the names, shapes and dtypes each group will be saved as are predicted by running transformers' reverse
  conversion on ``meta`` tensors, and cross-checked against reverting the whole model at once,
- groups stay in natural key order; a shard is closed before it would exceed ``max_shard_size`` (file
  bytes, safetensors header included); a group larger than the limit gets a shard of its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import _compat
from ..errors import CheckpointError

#: Bytes of a safetensors file that are not tensor entries: the 8-byte length, ``{"__metadata__":
#: {"format":"pt"}}``, braces, and up to 7 bytes of padding (generous upper bound).
FILE_OVERHEAD_BYTES = 64
_MAX_OFFSET_DIGITS = 20


def _natural(name: str):
    return _compat.natural_key(name)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor described by name, shape and dtype only."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        """The spec of ``tensor`` (works for ``meta`` tensors; reads no data)."""
        return cls(name, tuple(int(s) for s in tensor.shape), tensor.dtype)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    @property
    def header_bytes(self) -> int:
        """Upper bound of this tensor's entry in a safetensors JSON header."""
        entry = {self.name: {"dtype": "XXXXXXX", "shape": list(self.shape), "data_offsets": [0, 0]}}
        return len(json.dumps(entry, separators=(",", ":"))) + 2 * _MAX_OFFSET_DIGITS

    @property
    def file_bytes(self) -> int:
        """What this tensor adds to a safetensors file at most (data plus header entry)."""
        return self.nbytes + self.header_bytes

    def meta(self) -> torch.Tensor:
        """A ``meta`` tensor with this shape and dtype."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


@dataclass(frozen=True)
class ConversionGroup:
    """The model tensors one reverse conversion needs together, and what they are saved as.

    A tensor that is only renamed (or kept as is) is a group of one.
    """

    sources: tuple[TensorSpec, ...]
    """Model state-dict tensors (names as in ``model.state_dict()``)."""

    outputs: tuple[TensorSpec, ...]
    """Tensors written to the checkpoint (names after the reverse conversion)."""

    converted: bool = False
    """Whether a reverse ``WeightConverter`` (more than a rename) applies."""

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.outputs)

    @property
    def file_bytes(self) -> int:
        return sum(s.file_bytes for s in self.outputs)

    @property
    def memory_bytes(self) -> int:
        """Bytes alive while this group is converted: its inputs plus its outputs."""
        return sum(s.nbytes for s in self.sources) + (self.nbytes if self.converted else 0)


@dataclass(frozen=True)
class PlannedShard:
    """One planned file."""

    filename: str
    groups: tuple[ConversionGroup, ...]
    oversized: bool = False
    """A single group larger than ``max_shard_size``: it gets this shard of its own."""

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return tuple(o for g in self.groups for o in g.outputs)

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def file_bytes(self) -> int:
        """Upper bound of the file's size."""
        return FILE_OVERHEAD_BYTES + sum(g.file_bytes for g in self.groups)


@dataclass(frozen=True)
class ShardPlan:
    """Every shard of a save, in write order."""

    shards: tuple[PlannedShard, ...]
    max_shard_size: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def weight_map(self) -> dict[str, str]:
        """Saved tensor name -> file name (what ``model.safetensors.index.json`` holds)."""
        return {o.name: s.filename for s in self.shards for o in s.outputs}

    @property
    def outputs(self) -> dict[str, TensorSpec]:
        return {o.name: o for s in self.shards for o in s.outputs}

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def groups(self) -> tuple[ConversionGroup, ...]:
        return tuple(g for s in self.shards for g in s.groups)

    @property
    def largest_group_bytes(self) -> int:
        return max((g.nbytes for g in self.groups), default=0)

    @property
    def oversized(self) -> list[str]:
        """Files holding a single group that is larger than ``max_shard_size``."""
        return [s.filename for s in self.shards if s.oversized]

    def summary(self) -> dict[str, Any]:
        """Figures for the report."""
        return {
            "shards": len(self.shards),
            "tensors_saved": sum(len(s.outputs) for s in self.shards),
            "conversion_groups": sum(1 for g in self.groups if g.converted),
            "total_bytes": self.total_bytes,
            "max_shard_size": self.max_shard_size,
            "largest_group_bytes": self.largest_group_bytes,
            "oversized_shards": self.oversized,
            **self.extra,
        }


def group_specs(specs: Iterable[TensorSpec], key: Callable[[str], str | None]) -> list[list[TensorSpec]]:
    """Groups tensors that share a reverse-conversion key; every other tensor is a group of one.

    Args:
        specs: The model's tensors.
        key: ``name -> group key`` (``None``: the tensor needs no other tensor).

    Returns:
        Groups in natural key order of their first member, members in natural key order.

    Example:
        >>> specs = [TensorSpec(n, (2,), torch.float32) for n in ("a.q", "a.k", "b")]
        >>> [[s.name for s in g] for g in group_specs(specs, lambda n: "a.qkv" if n.startswith("a.") else None)]
        [['a.k', 'a.q'], ['b']]
    """
    groups: dict[Any, list[TensorSpec]] = {}
    for spec in sorted(specs, key=lambda s: _natural(s.name)):
        k = key(spec.name)
        groups.setdefault(("group", k) if k is not None else ("single", spec.name), []).append(spec)
    return sorted(groups.values(), key=lambda g: _natural(g[0].name))


def shard_filenames(n: int, weights_name: str = "model.safetensors") -> list[str]:
    """transformers' file names for ``n`` shards (``model-00001-of-00003.safetensors``; one: ``model.safetensors``)."""
    if n == 1:
        return [weights_name]
    stem, dot, ext = weights_name.rpartition(".")
    return [f"{stem}-{i + 1:05d}-of-{n:05d}{dot}{ext}" for i in range(n)]


def pack_shards(groups: Sequence[ConversionGroup], max_shard_size: int, *,
                weights_name: str = "model.safetensors") -> ShardPlan:
    """Packs groups into shards, in order, so that no file exceeds ``max_shard_size`` bytes.

    Args:
        groups: Conversion groups in save order.
        max_shard_size: Largest file size in bytes (header included).
        weights_name: File name of a single-shard checkpoint.

    Returns:
        The plan. A group whose file alone exceeds the limit gets a shard of its own, marked ``oversized``.

    Example:
        >>> spec = lambda n: TensorSpec(n, (250,), torch.float32)  # 1000 bytes
        >>> g = lambda n: ConversionGroup((spec(n),), (spec(n),))
        >>> [len(s.groups) for s in pack_shards([g("a"), g("b"), g("c")], 2400).shards]
        [2, 1]
    """
    packed: list[tuple[list[ConversionGroup], bool]] = []
    current: list[ConversionGroup] = []
    used = FILE_OVERHEAD_BYTES
    for group in groups:
        alone = FILE_OVERHEAD_BYTES + group.file_bytes
        if alone > max_shard_size:
            if current:
                packed.append((current, False))
            packed.append(([group], True))
            current, used = [], FILE_OVERHEAD_BYTES
            continue
        if current and used + group.file_bytes > max_shard_size:
            packed.append((current, False))
            current, used = [], FILE_OVERHEAD_BYTES
        current.append(group)
        used += group.file_bytes
    if current:
        packed.append((current, False))
    names = shard_filenames(len(packed), weights_name)
    shards = tuple(PlannedShard(name, tuple(gs), oversized) for name, (gs, oversized) in zip(names, packed))
    return ShardPlan(shards, int(max_shard_size))


def saveable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``save_pretrained`` would write, before conversion: ``model.state_dict()`` without tied
    aliases and ``_keys_to_ignore_on_save``. Offloaded tensors stay ``meta``; nothing is loaded."""
    return _compat.drop_tied_and_ignored(model, model.state_dict())


def _describe(specs: Mapping[str, TensorSpec]) -> dict[str, tuple]:
    return {n: (s.shape, str(s.dtype).removeprefix("torch.")) for n, s in specs.items()}


def plan_offloaded_save(model: torch.nn.Module, max_shard_size: int, *, save_original_format: bool = True,
                        state_dict: Mapping[str, torch.Tensor] | None = None) -> ShardPlan:
    """Plans the shards of a save of ``model`` from names, shapes and dtypes only.

    Args:
        model: A transformers ``PreTrainedModel`` (offloaded or not: offloaded tensors are ``meta``).
        max_shard_size: Largest shard file in bytes.
        save_original_format: Revert transformers' weight conversions (as ``save_pretrained`` does).
        state_dict: The tensors to save (default: :func:`saveable_state_dict`); only shapes/dtypes are read.

    Returns:
        The plan; ``plan.summary()`` goes into the report.

    Raises:
        CheckpointError: If grouping the reverse conversions per group does not give exactly what
            transformers gives when it reverts the whole model at once (an unknown kind of conversion),
            or if two groups would write the same name. Raised before anything is written.

    Example:
        >>> # plan = plan_offloaded_save(model, 500 * 10**6); plan.weight_map
    """
    sd = saveable_state_dict(model) if state_dict is None else dict(state_dict)
    specs = {n: TensorSpec.of(n, t) for n, t in sd.items()}
    key = _compat.reverse_conversion_key(model) if save_original_format else (lambda name: None)
    groups: list[ConversionGroup] = []
    seen: dict[str, str] = {}
    for members in group_specs(specs.values(), key):
        converted = key(members[0].name) is not None
        if save_original_format:
            out = _compat.revert_conversions(model, {s.name: s.meta() for s in members})
            outputs = tuple(TensorSpec.of(n, t) for n, t in sorted(out.items(), key=lambda kv: _natural(kv[0])))
        else:
            outputs = tuple(members)
        for o in outputs:
            if o.name in seen:
                raise CheckpointError(
                    f"two conversion groups would both save `{o.name}` (from {seen[o.name]} and "
                    f"{[s.name for s in members]}); the model's conversion mapping is ambiguous. "
                    "HINT: save with `save_original_format=False`."
                )
            seen[o.name] = str([s.name for s in members])
        groups.append(ConversionGroup(tuple(members), outputs, converted))
    if save_original_format:
        whole = _compat.revert_conversions(model, {s.name: s.meta() for s in specs.values()})
        expected = _describe({n: TensorSpec.of(n, t) for n, t in whole.items()})
        planned = _describe({o.name: o for g in groups for o in g.outputs})
        if expected != planned:
            missing = sorted(set(expected) - set(planned))[:5]
            extra = sorted(set(planned) - set(expected))[:5]
            differ = sorted(n for n in set(expected) & set(planned) if expected[n] != planned[n])[:5]
            raise CheckpointError(
                "reverting the weight conversions group by group does not give what transformers gives for the "
                f"whole model (missing: {missing}, unexpected: {extra}, different shape/dtype: {differ}). "
                "This model type uses a conversion the shard planner does not understand. HINT: save with "
                "`save_original_format=False`, or load the model without offloading and use `save_pretrained`."
            )
    plan = pack_shards(groups, max_shard_size)
    return ShardPlan(plan.shards, plan.max_shard_size, {"source_tensors": len(specs)})
