"""Save an offloaded model shard by shard, with bounded memory, whatever its weight conversions.

For each planned shard (see :mod:`.shard_plan`): load only its tensors (from the cpu/disk offload hooks),
revert transformers' weight conversions group by group, write the file with safetensors, release
everything, then go on. Afterwards the index (with the saved names), the config and the generation config
are written and every file's safetensors header is checked against the plan without reading data.

Memory: at most one shard's outputs plus one conversion group in flight, i.e. below
``2 × max(max_shard_size, largest group)``; CPU-resident tensors are passed to safetensors without a copy.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import _compat
from ..errors import CheckpointError
from ..memory.procfs import malloc_trim
from ..sizes import parse_size
from . import atomic
from .mapped_pages import file_backed_ranges, release_mapped_pages
from .offload_reader import OffloadedTensorReader
from .shard_plan import ConversionGroup, ShardPlan, plan_offloaded_save, saveable_state_dict

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class OffloadedSaveResult:
    """What a save wrote."""

    directory: str
    plan: ShardPlan
    files: dict[str, int] = field(default_factory=dict)
    """File name -> bytes on disk, for every shard."""

    released_bytes: int = 0
    """Resident pages of memory-mapped cpu weights handed back to the kernel after their shard was written."""

    def details(self) -> dict[str, Any]:
        """Figures for the report."""
        return {
            **self.plan.summary(),
            "bytes_written": sum(self.files.values()),
            "largest_file_bytes": max(self.files.values(), default=0),
            "released_mapped_bytes": self.released_bytes,
        }


def _safetensors_dtype(dtype: torch.dtype) -> str:
    names = {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    for attr, name in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                       ("uint32", "U32"), ("uint64", "U64")):
        if hasattr(torch, attr):
            names[getattr(torch, attr)] = name
    return names.get(dtype, str(dtype))


def read_header(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's header (``name -> {dtype, shape, data_offsets}``); reads
    only the header bytes.

    Raises:
        CheckpointError: If the file is too short or its header is not valid JSON.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{path} is not a safetensors file: {len(raw)} bytes.")
        n = int.from_bytes(raw, "little")
        size = path.stat().st_size
        if n > size - 8:
            raise CheckpointError(f"{path} is truncated: its header says {n} bytes, the file has {size}.")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header ({exc}).") from None
    header.pop("__metadata__", None)
    return header


def verify_written(directory: str | os.PathLike, plan: ShardPlan) -> dict[str, int]:
    """Checks every written file against the plan from safetensors headers only (no tensor data is read):
    each planned name is in its planned file with its planned shape and dtype, no file holds anything else,
    the data section has the size the header says, and the index maps every name to its file.

    Args:
        directory: Where the checkpoint was written.
        plan: The plan it was written from.

    Returns:
        File name -> size in bytes.

    Raises:
        CheckpointError: Listing the mismatches (file, tensor, planned vs written).

    Example:
        >>> # verify_written("/ckpt/model", plan)
    """
    directory = Path(directory)
    problems: list[str] = []
    sizes: dict[str, int] = {}
    for shard in plan.shards:
        path = directory / shard.filename
        if not path.exists():
            problems.append(f"{shard.filename}: missing")
            continue
        header = read_header(path)
        sizes[shard.filename] = path.stat().st_size
        planned = {o.name: o for o in shard.outputs}
        for name in sorted(set(header) - set(planned)):
            problems.append(f"{shard.filename}: holds `{name}`, which the plan does not put there")
        end = 0
        for name, spec in planned.items():
            entry = header.get(name)
            if entry is None:
                problems.append(f"{shard.filename}: `{name}` is missing")
                continue
            want = (_safetensors_dtype(spec.dtype), list(spec.shape))
            got = (entry.get("dtype"), list(entry.get("shape", [])))
            if want != got:
                problems.append(f"{shard.filename}: `{name}` is {got[0]}{got[1]}, planned {want[0]}{want[1]}")
            end = max(end, int(entry.get("data_offsets", [0, 0])[1]))
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
        if 8 + header_len + end != sizes[shard.filename]:
            problems.append(
                f"{shard.filename}: {sizes[shard.filename]} bytes on disk, the header describes {8 + header_len + end}"
            )
    index_path = directory / INDEX_NAME
    if index_path.exists():
        weight_map = json.loads(index_path.read_text(encoding="utf-8")).get("weight_map", {})
        if weight_map != plan.weight_map:
            names = set(weight_map) | set(plan.weight_map)
            wrong = sorted(n for n in names if weight_map.get(n) != plan.weight_map.get(n))
            problems.append(f"{INDEX_NAME}: maps {wrong[:5]} differently from the files")
    else:
        problems.append(f"{INDEX_NAME}: missing")
    if problems:
        raise CheckpointError(
            f"the checkpoint written to {directory} does not match its plan ({len(problems)} problem(s)); it is "
            "not loadable and was not put in place:\n" + "\n".join(f"  - {p}" for p in problems[:20])
        )
    return sizes


def _save_configs(model: torch.nn.Module, directory: Path) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    # As save_pretrained: record the dtype and the architecture in the saved config.
    try:
        config.dtype = str(model.dtype).split(".")[1]
        config.architectures = [type(model).__name__]
    except Exception:
        pass
    config.save_pretrained(directory)
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def _convert_group(model: torch.nn.Module, group: ConversionGroup, reader: OffloadedTensorReader, filename: str,
                   save_original_format: bool, resident: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Loads one conversion group, reverts it, and checks the result against the plan. Appends the tensors
    read without a copy (held by the model anyway) to ``resident``."""
    loaded = {s.name: reader.read(s.name) for s in group.sources}
    resident.extend(t for n, t in loaded.items() if reader.is_resident(n))
    out = _compat.revert_conversions(model, loaded) if save_original_format else loaded
    del loaded  # the inputs of a converted group are released before the next group is read
    sources = [s.name for s in group.sources]
    if sorted(out) != sorted(o.name for o in group.outputs):
        raise CheckpointError(
            f"reverting the conversion of {sources} gave {sorted(out)}, planned {[o.name for o in group.outputs]}; "
            f"{filename} was not written."
        )
    converted = {}
    for spec in group.outputs:
        t = out[spec.name]
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise CheckpointError(
                f"reverting the conversion of {sources} gave `{spec.name}` as {(tuple(t.shape), t.dtype)}, planned "
                f"{(spec.shape, spec.dtype)}; {filename} was not written."
            )
        converted[spec.name] = t.contiguous()
    return converted


def write_offloaded(model: torch.nn.Module, directory: str | os.PathLike, plan: ShardPlan, *,
                    save_original_format: bool = True, progress: bool = True,
                    reader: OffloadedTensorReader | None = None, release_pages: bool = True) -> OffloadedSaveResult:
    """Writes the planned shards, the index and the configs into an existing, empty ``directory`` (no
    temporary directory: the caller owns atomicity, e.g. the ``atomic_checkpoint`` stage).

    Args:
        model: The dispatched model.
        directory: Target folder.
        plan: From :func:`~accelerate_memsafe.io.shard_plan.plan_offloaded_save`.
        save_original_format: Revert transformers' weight conversions.
        progress: Show a tqdm bar of bytes written.
        reader: Where tensors are read from (default: the model's offload hooks).
        release_pages: After each shard, hand the pages of the memory-mapped cpu-resident weights it read
            back to the kernel (see :mod:`.mapped_pages`), so that RSS grows by about one shard, not by the
            cpu-resident model.

    Returns:
        What was written.

    Raises:
        CheckpointError: If a converted tensor differs from the plan (before its file is written) or the
            written headers do not match the plan.

    Example:
        >>> # write_offloaded(model, tmp_dir, plan_offloaded_save(model, 10**9))
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if reader is None:
        reader = OffloadedTensorReader(model, saveable_state_dict(model))
    _save_configs(model, directory)
    result = OffloadedSaveResult(str(directory), plan)
    bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="Writing offloaded shards", disable=not progress)
    try:
        ranges = file_backed_ranges() if release_pages else []
        for shard in plan.shards:
            tensors: dict[str, torch.Tensor] = {}
            resident: list[torch.Tensor] = []  # alive anyway (the model holds them); pages released below
            for group in shard.groups:
                tensors.update(_convert_group(model, group, reader, shard.filename, save_original_format, resident))
            save_file(tensors, str(directory / shard.filename), metadata={"format": "pt"})
            del tensors
            if ranges:
                result.released_bytes += release_mapped_pages(resident, ranges)
            del resident
            malloc_trim()
            bar.update(shard.nbytes)
    finally:
        bar.close()
    index = {
        "metadata": {
            "total_size": plan.total_bytes,
            "total_parameters": sum(_numel(s.shape) for s in plan.outputs.values()),
        },
        "weight_map": dict(sorted(plan.weight_map.items())),
    }
    with open(directory / INDEX_NAME, "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    result.files = verify_written(directory, plan)
    return result


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def save_offloaded(model: torch.nn.Module, save_directory: str | os.PathLike, *,
                   max_shard_size: int | str = "5GB", save_original_format: bool = True,
                   progress: bool = True, release_pages: bool = True) -> OffloadedSaveResult:
    """Saves a model dispatched on cpu and disk shard by shard, with bounded memory.

    The shards are planned from names, shapes and dtypes before anything is loaded, so that every group of
    tensors one reverse weight conversion needs lands in one shard; each shard is then loaded from the
    offload hooks, reverted, written with safetensors and released. The checkpoint is written into a
    temporary directory next to ``save_directory`` and swapped into place only once every file was checked
    against the plan, so a save that is killed leaves a previous checkpoint there intact.

    Args:
        model: A transformers model dispatched with a ``device_map`` (cpu and/or disk); a model that is not
            offloaded is saved the same way.
        save_directory: Where the checkpoint goes (replaced as a whole; its other files, e.g. a tokenizer,
            are kept).
        max_shard_size: Largest shard file: bytes, or a string with transformers' meaning (``"500MB"`` =
            500·10^6 bytes). A conversion group larger than this gets a shard of its own.
        save_original_format: Revert transformers' weight conversions, as ``save_pretrained`` does.
        progress: Show a progress bar (bytes written).
        release_pages: Hand the pages of memory-mapped cpu-resident weights back to the kernel once their
            shard is written (a hint that never loses data; see :mod:`accelerate_memsafe.io.mapped_pages`).

    Returns:
        What was written (``result.details()`` for a report).

    Raises:
        ConfigError: For a bad ``max_shard_size``.
        CheckpointError: If a tensor cannot be loaded, the conversions cannot be planned, or the written
            files do not match the plan; nothing is put in place then.

    Example:
        >>> # model = AutoModelForCausalLM.from_pretrained(path, device_map=dm, offload_folder="offload")
        >>> # save_offloaded(model, "out", max_shard_size="500MB")
    """
    size = parse_size(max_shard_size, what="max_shard_size")
    final = Path(save_directory)
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"`save_directory` {final} is a file; pass a directory.")
    plan = plan_offloaded_save(model, size, save_original_format=save_original_format)
    reader = OffloadedTensorReader(model, saveable_state_dict(model))
    temp = atomic.temp_dir_for(final)
    atomic.begin(temp)
    try:
        result = write_offloaded(model, temp, plan, save_original_format=save_original_format,
                                 progress=progress, reader=reader, release_pages=release_pages)
        atomic.finalize(temp, final, world_size=1, carry_over=True, extra={"writer": "offloaded_save"})
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    result.directory = str(final)
    return result
