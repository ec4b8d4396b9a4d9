"""Save an offloaded model shard by shard, with bounded memory, whatever its weight conversions.

The shards are planned from names, shapes and dtypes (:mod:`.shard_plan`), and so is every file's
safetensors layout (:mod:`.safetensors_layout`: header first, each tensor's offset known before it is read).
The caller's thread then prepares one conversion group at a time, in plan order: it reads the group's
tensors (cpu-resident ones as they are, offloaded ones through the offload hooks), reverts transformers'
weight conversions, checks the result against the plan, and notes for each saved tensor whether its bytes
already lie in a file (a memory-mapped checkpoint, a disk offload file; :meth:`OffloadedTensorReader.extent`).
Writer threads (:mod:`.shard_writer`) put each group at its offsets while the next group is prepared —
bytes that lie in a file are copied from that file by the kernel, never faulted in through the mapping — and
a syncer thread fsyncs each
finished file while the next one is written. Afterwards the index (with the saved names), the
config and the generation config are written and every file's safetensors header is checked against the
plan without reading data. Each file is byte-identical to ``safetensors.torch.save_file`` of its tensors
with transformers' ``{"format": "pt"}`` metadata.

Memory: a group's planned inputs and outputs are reserved before it is read; once read, only the private
memory it really holds (the tensors the revert made, inputs loaded into memory: not the model's own tensors,
not pages of a mapped file) stays reserved until it is written. The reserved bytes never exceed
``max(min(max_shard_size, INFLIGHT_BYTES), largest group)`` (a larger group goes alone), so private memory
stays below ``2 × max(max_shard_size, largest group)`` over the baseline, plus one aligned buffer per writer
thread; bytes read from their files never map into this process.
"""

from __future__ import annotations

import bisect
import json
import os
import shutil
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import _compat
from ..errors import CheckpointError, ConfigError
from ..sizes import parse_size
from . import atomic
from .mapped_pages import FileExtent, file_backed_ranges
from .offload_reader import OffloadedTensorReader
from .safetensors_layout import SafetensorsLayout, header_shape, safetensors_dtype
from .safetensors_source import read_raw_header
from .shard_plan import ConversionGroup, ShardPlan, TensorSpec, plan_offloaded_save, saveable_state_dict
from .shard_writer import DEFAULT_IO_MODE, IO_MODES, RELEASE_MODES, ShardWriter, TensorWrite, WriterStats

INDEX_NAME = "model.safetensors.index.json"
#: Most bytes read ahead of the writers (with shards smaller than this, one shard): enough to keep them busy
#: while the next group is read and reverted, and a bound on private memory that does not grow with
#: ``max_shard_size`` (transformers' default is 5 GB).
INFLIGHT_BYTES = 256 * 2**20
#: The ``__metadata__`` transformers' ``save_pretrained`` writes into every shard.
METADATA = {"format": "pt"}


@dataclass
class OffloadedSaveResult:
    """What a save wrote."""

    directory: str
    plan: ShardPlan
    files: dict[str, int] = field(default_factory=dict)
    """File name -> bytes on disk, for every shard."""

    writer: WriterStats = field(default_factory=WriterStats)
    """Bytes read from files / written from memory / written direct, pages released, the memory budget and its
    peak."""

    @property
    def released_bytes(self) -> int:
        """Resident pages of memory-mapped cpu weights handed back to the kernel after their shard was written."""
        return self.writer.released_bytes

    def details(self) -> dict[str, Any]:
        """Figures for the report."""
        return {
            **self.plan.summary(),
            "bytes_written": sum(self.files.values()),
            "largest_file_bytes": max(self.files.values(), default=0),
            "from_files_bytes": self.writer.copied_bytes,
            "from_memory_bytes": self.writer.written_bytes,
            "direct_io_bytes": self.writer.direct_bytes,
            "released_mapped_bytes": self.writer.released_bytes,
            "inflight_budget_bytes": self.writer.budget_bytes,
            "inflight_peak_bytes": self.writer.peak_reserved_bytes,
        }


def read_header(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The tensor entries of a safetensors file's header (``name -> {dtype, shape, data_offsets}``); reads
    only the header bytes.

    Raises:
        CheckpointError: If the file is too short or its header is not valid JSON.
    """
    return read_raw_header(path)[0]


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
        header, data_start = read_raw_header(path)
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
            want = (safetensors_dtype(spec.dtype), header_shape(spec.shape, spec.dtype))
            got = (entry.get("dtype"), list(entry.get("shape", [])))
            if want != got:
                problems.append(f"{shard.filename}: `{name}` is {got[0]}{got[1]}, planned {want[0]}{want[1]}")
            end = max(end, int(entry.get("data_offsets", [0, 0])[1]))
        if data_start + end != sizes[shard.filename]:
            problems.append(
                f"{shard.filename}: {sizes[shard.filename]} bytes on disk, the header describes {data_start + end}"
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


def _check_output(t: torch.Tensor, spec: TensorSpec, sources: list[str], filename: str) -> torch.Tensor:
    if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
        raise CheckpointError(
            f"reverting the conversion of {sources} gave `{spec.name}` as {(tuple(t.shape), t.dtype)}, planned "
            f"{(spec.shape, spec.dtype)}; {filename} was not written."
        )
    return t.contiguous()


def _view_extent(t: torch.Tensor, sources: list[tuple[torch.Tensor, FileExtent | None]]) -> FileExtent | None:
    """The extent of ``t`` when it is a contiguous view inside a source tensor whose bytes lie in a file."""
    if not t.numel() or not t.is_contiguous():
        return None
    storage = t.untyped_storage().data_ptr()
    for s, extent in sources:
        if extent is None or not s.is_contiguous() or s.untyped_storage().data_ptr() != storage:
            continue
        start = t.data_ptr() - s.data_ptr()
        nbytes = t.numel() * t.element_size()
        if start >= 0 and start + nbytes <= extent.nbytes:
            return extent.part(start, nbytes)
    return None


class _PrivateBytes:
    """The private memory a prepared group holds until it is written: the distinct storages of the tensors it
    read or made that are neither the model's own (``resident``) nor pages of a memory-mapped file (a disk
    offload file, the checkpoint: clean file pages, not private memory), plus every tensor the writers may
    still have to load. This, not the group's planned inputs and outputs, is what stays reserved while the
    group is written (:meth:`ShardWriter.put`'s ``held``)."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] | None = None

    def _inside(self, ptr: int) -> bool:
        i = bisect.bisect_right(self._ranges, (ptr, float("inf"))) - 1
        return i >= 0 and self._ranges[i][0] <= ptr < self._ranges[i][1]

    def _mapped(self, ptr: int) -> bool:
        if self._ranges is not None and self._inside(ptr):
            return True
        self._ranges = file_backed_ranges()  # a new offload file may have been mapped since the last read
        return self._inside(ptr)

    def __call__(self, writes: list[TensorWrite], loaded: list[torch.Tensor], resident: list[torch.Tensor]) -> int:
        own = {t.untyped_storage().data_ptr() for t in resident}
        inputs = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in loaded}
        total = sum(w.nbytes for w in writes if w.tensor is None)  # loaded by a writer if its file cannot be read
        made = {}  # a tensor the revert made is private; an input may be a view of a mapped file
        for w in writes:
            if w.tensor is not None:
                storage = w.tensor.untyped_storage()
                (inputs if storage.data_ptr() in inputs else made)[storage.data_ptr()] = storage
        total += sum(st.nbytes() for key, st in made.items() if key and key not in own)
        total += sum(st.nbytes() for key, st in inputs.items() if key and key not in own and not self._mapped(key))
        return total


def _read_checked(reader: OffloadedTensorReader, spec: TensorSpec, source: str, filename: str) -> torch.Tensor:
    return _check_output(reader.read(source), spec, [source], filename)


def _prepare_group(model: torch.nn.Module, group: ConversionGroup, reader: OffloadedTensorReader,
                   layout: SafetensorsLayout, filename: str, *, save_original_format: bool,
                   from_files: bool, private: _PrivateBytes) -> tuple[list[TensorWrite], list[torch.Tensor], int]:
    """Reads one conversion group, reverts it, checks it against the plan, and says where each saved tensor
    goes and where its bytes can be copied from.

    Returns:
        The writes, the tensors read that the model holds itself (whose pages are released later), and the
        private memory the group holds until written (:class:`_PrivateBytes`).
    """
    sources = [s.name for s in group.sources]
    if not group.converted:
        # A group of one that is only renamed: the saved bytes are the source's, maybe straight from a file.
        (spec,), name = group.outputs, sources[0]
        begin, end = layout.ranges[spec.name]
        resident = reader.is_resident(name)
        extent = reader.extent(name) if from_files else None
        if extent is not None and extent.nbytes == end - begin:
            tensor = reader.read(name) if resident else None  # offloaded: loaded only if its file cannot be read
            load = partial(_read_checked, reader, spec, name, filename)
            writes, own = [TensorWrite(begin, end - begin, tensor, extent, load)], [tensor] if resident else []
        else:
            tensor = _check_output(reader.read(name), spec, sources, filename)
            writes, own = [TensorWrite(begin, end - begin, tensor)], [tensor] if resident else []
        return writes, own, private(writes, [], own)
    loaded = {n: reader.read(n) for n in sources}
    extents = [(loaded[n], reader.extent(n) if from_files else None) for n in sources]
    resident = [t for n, t in loaded.items() if reader.is_resident(n)]
    out = _compat.revert_conversions(model, loaded) if save_original_format else dict(loaded)
    if sorted(out) != sorted(o.name for o in group.outputs):
        raise CheckpointError(
            f"reverting the conversion of {sources} gave {sorted(out)}, planned {[o.name for o in group.outputs]}; "
            f"{filename} was not written."
        )
    writes = []
    for spec in group.outputs:
        t = _check_output(out[spec.name], spec, sources, filename)
        begin, end = layout.ranges[spec.name]
        writes.append(TensorWrite(begin, end - begin, t, _view_extent(t, extents)))
    return writes, resident, private(writes, list(loaded.values()), resident)


def write_offloaded(model: torch.nn.Module, directory: str | os.PathLike, plan: ShardPlan, *,
                    save_original_format: bool = True, progress: bool = True,
                    reader: OffloadedTensorReader | None = None, release_pages: str = "unmap",
                    io_mode: str = DEFAULT_IO_MODE) -> OffloadedSaveResult:
    """Writes the planned shards, the index and the configs into an existing, empty ``directory`` (no
    temporary directory: the caller owns atomicity, e.g. the ``atomic_checkpoint`` stage). Every shard is
    fsynced before this returns.

    Args:
        model: The dispatched model.
        directory: Target folder.
        plan: From :func:`~accelerate_memsafe.io.shard_plan.plan_offloaded_save`.
        save_original_format: Revert transformers' weight conversions.
        progress: Show a tqdm bar of bytes written.
        reader: Where tensors are read from (default: the model's offload hooks).
        release_pages: What to do, after each shard, with the pages of the memory-mapped cpu weights it read
            (see :class:`~accelerate_memsafe.io.shard_writer.ShardWriter`): ``"unmap"`` (default; drops the
            clean ones from RSS, no I/O), ``"pageout"`` (reclaims them, synchronously), ``"off"``.
        io_mode: ``"buffered"`` (default), ``"direct"`` or ``"memory"``: how tensors reach the files (see
            :mod:`~accelerate_memsafe.io.shard_writer`).

    Returns:
        What was written.

    Raises:
        CheckpointError: If a converted tensor differs from the plan (its file is not completed), a dtype
            cannot be stored in safetensors (before anything is written), or the written headers do not
            match the plan.
        OSError: If writing or fsyncing a file fails (naming the file).

    Example:
        >>> # write_offloaded(model, tmp_dir, plan_offloaded_save(model, 10**9))
    """
    from tqdm.auto import tqdm

    directory = Path(directory)
    try:
        layouts = [SafetensorsLayout.of(((o.name, o.shape, o.dtype) for o in s.outputs), METADATA) for s in plan.shards]
    except ValueError as exc:
        raise CheckpointError(f"{exc} Nothing was written. HINT: cast the model to a supported dtype first.") from None
    directory.mkdir(parents=True, exist_ok=True)
    if reader is None:
        reader = OffloadedTensorReader(model, saveable_state_dict(model))
    _save_configs(model, directory)
    result = OffloadedSaveResult(str(directory), plan)
    bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="Writing offloaded shards", disable=not progress)
    try:
        with ShardWriter(min(plan.max_shard_size, INFLIGHT_BYTES), io_mode=io_mode, release_pages=release_pages,
                         on_written=bar.update) as writer:
            private = _PrivateBytes()
            for shard, layout in zip(plan.shards, layouts):
                writer.open(directory / shard.filename, layout)
                for group in shard.groups:
                    writer.reserve(group.memory_bytes)
                    writes, resident, held = _prepare_group(model, group, reader, layout, shard.filename,
                                                            save_original_format=save_original_format,
                                                            from_files=io_mode != "memory", private=private)
                    writer.put(writes, reserved=group.memory_bytes, resident=resident, nbytes=group.nbytes,
                               held=held)
                    del writes, resident
                writer.close()
            result.writer = writer.finish()
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
                   progress: bool = True, release_pages: str = "unmap", io_mode: str = DEFAULT_IO_MODE) -> OffloadedSaveResult:
    """Saves a model dispatched on cpu and disk shard by shard, with bounded memory.

    The shards are planned from names, shapes and dtypes before anything is loaded, so that every group of
    tensors one reverse weight conversion needs lands in one shard, and so is every file's layout; each
    conversion group is then loaded from the offload hooks, reverted and handed to writer threads that put
    it at its offsets while the next group is prepared (bytes that lie in a file — the memory-mapped
    checkpoint, the disk offload — are read from that file), and each finished file is fsynced in the
    background while the next is written. The checkpoint is written into a temporary directory next to
    ``save_directory`` and swapped into place only once every file was fsynced and checked against the
    plan, so a save that is killed or fails leaves a previous checkpoint there intact.

    Args:
        model: A transformers model dispatched with a ``device_map`` (cpu and/or disk); a model that is not
            offloaded is saved the same way.
        save_directory: Where the checkpoint goes (replaced as a whole; its other files, e.g. a tokenizer,
            are kept).
        max_shard_size: Largest shard file: bytes, or a string with transformers' meaning (``"500MB"`` =
            500·10^6 bytes). A conversion group larger than this gets a shard of its own.
        save_original_format: Revert transformers' weight conversions, as ``save_pretrained`` does.
        progress: Show a progress bar (bytes written).
        release_pages: After each shard, ``"unmap"`` (default) drops the pages of memory-mapped cpu weights
            that still hold their file's bytes from this process's RSS (``MADV_DONTNEED``: no I/O),
            ``"pageout"`` has the kernel reclaim them (``MADV_PAGEOUT``, synchronous: costs wall time and a
            re-read on the next use), ``"off"`` leaves them (see :mod:`accelerate_memsafe.io.mapped_pages`).
        io_mode: How tensors reach the files. ``"buffered"`` (default): through the page cache, bytes that
            lie in a file (the memory-mapped checkpoint, the disk offload) copied by the kernel
            (``copy_file_range``) and handed to the disk at once (``sync_file_range``). ``"direct"``: the
            whole 4 KiB blocks of each tensor written with ``O_DIRECT`` (no copy into the page cache) from a
            small aligned buffer filled from the file the bytes lie in or from memory; the edges and file
            systems without ``O_DIRECT`` go through the page cache. ``"memory"``: every tensor written from
            memory, as ``safetensors.torch.save_file`` does. Every mode writes the same bytes and fsyncs
            every file.

    Returns:
        What was written (``result.details()`` for a report).

    Raises:
        ConfigError: For a bad ``max_shard_size``, ``release_pages`` or ``io_mode``.
        CheckpointError: If a tensor cannot be loaded, the conversions cannot be planned, or the written
            files do not match the plan; nothing is put in place then.
        OSError: If writing or fsyncing a file fails (naming the file); nothing is put in place then.

    Example:
        >>> # model = AutoModelForCausalLM.from_pretrained(path, device_map=dm, offload_folder="offload")
        >>> # save_offloaded(model, "out", max_shard_size="500MB")
    """
    size = parse_size(max_shard_size, what="max_shard_size")
    if release_pages not in RELEASE_MODES:
        raise ConfigError(f"`release_pages={release_pages!r}`; choose one of {', '.join(map(repr, RELEASE_MODES))}.")
    if io_mode not in IO_MODES:
        raise ConfigError(f"`io_mode={io_mode!r}`; choose one of {', '.join(map(repr, IO_MODES))}.")
    final = Path(save_directory)
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"`save_directory` {final} is a file; pass a directory.")
    plan = plan_offloaded_save(model, size, save_original_format=save_original_format)
    reader = OffloadedTensorReader(model, saveable_state_dict(model))
    temp = atomic.temp_dir_for(final)
    atomic.begin(temp)
    try:
        result = write_offloaded(model, temp, plan, save_original_format=save_original_format, progress=progress,
                                 reader=reader, release_pages=release_pages, io_mode=io_mode)
        atomic.finalize(temp, final, world_size=1, carry_over=True, extra={"writer": "offloaded_save"})
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    result.directory = str(final)
    return result
