"""Lazy, tensor-by-tensor reads of a safetensors checkpoint (one file or a sharded ``*.index.json``).

The header of each file (8-byte length + JSON: names, dtypes, shapes, byte offsets) is parsed directly
and checked against the file size; tensor data is read with ``pread`` straight into the caller's buffer,
row range by row range. Nothing is memory mapped (``safe_open`` would map the whole file and keep every
page it touched in this process's RSS until closed), so reading a checkpoint does not grow the RSS with
file pages: what was read sits in the kernel's page cache, which the kernel can drop.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch

from ..errors import CheckpointError

#: safetensors dtype names -> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: file, absolute byte offset of its data, shape and dtype."""

    file: str
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one index along dim 0 (the whole tensor for a 0-d tensor)."""
        if not self.shape:
            return self.nbytes
        return self.nbytes // self.shape[0] if self.shape[0] else 0


_FIX = "Re-save the checkpoint or restore the file."


def read_raw_header(file: str | os.PathLike) -> tuple[dict[str, Any], int]:
    """A safetensors file's JSON header without ``__metadata__`` (``name -> {dtype, shape, data_offsets}``) and
    the offset its data starts at; reads only the header bytes. The one header reader of the package.

    Raises:
        CheckpointError: If the file cannot be read, is too short, its header size is implausible or beyond
            the file, or the header is not valid JSON (each naming the file).
    """
    try:
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"safetensors file {file} is truncated: shorter than its 8-byte header length. {_FIX}")
            (n,) = struct.unpack("<Q", raw)
            if n > 100 * 2**20:
                raise CheckpointError(f"safetensors file {file} is corrupt: header size {n} is implausible. {_FIX}")
            size = os.fstat(f.fileno()).st_size
            if n > size - 8:
                raise CheckpointError(
                    f"safetensors file {file} is truncated or corrupt: its header claims {n} bytes but the file holds "
                    f"{size} bytes in all. {_FIX}"
                )
            header = json.loads(f.read(n))
    except OSError as exc:
        raise CheckpointError(f"cannot read safetensors file {file}: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"safetensors file {file} has a corrupt header ({exc}). {_FIX}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"safetensors file {file} has a corrupt header (not a JSON object). {_FIX}")
    header.pop("__metadata__", None)
    return header, 8 + n


def _read_header(file: str) -> dict[str, TensorEntry]:
    header, base = read_raw_header(file)
    size = os.path.getsize(file)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{file}: tensor `{name}` has dtype {info['dtype']} which torch cannot read.")
        begin, end = info["data_offsets"]
        entry = TensorEntry(file, base + begin, tuple(info["shape"]), DTYPES[info["dtype"]])
        if end - begin != entry.nbytes or base + end > size:
            raise CheckpointError(
                f"{file}: tensor `{name}` claims bytes [{begin}, {end}) for shape {entry.shape} {entry.dtype}, "
                f"but the file has {size - base} data bytes: the file is truncated or corrupt."
            )
        out[name] = entry
    return out


class SafetensorsSource:
    """Reads tensors of a safetensors checkpoint lazily, row range by row range.

    Args:
        path: A ``.safetensors`` file, a ``*.safetensors.index.json``, or a directory holding either
            (``model.safetensors`` or ``model.safetensors.index.json``).

    Raises:
        CheckpointError: If nothing readable is found, or an index names a missing file.

    Example:
        >>> # src = SafetensorsSource("ckpt/")
        >>> # src.read("lm_head.weight", 0, 128)  # rows 0..127 only
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self.files = self._resolve(Path(path))
        self.entries: dict[str, TensorEntry] = {}
        for file in self.files:
            for name, entry in _read_header(file).items():
                if name in self.entries:
                    raise CheckpointError(f"tensor `{name}` appears in both {self.entries[name].file} and {file}.")
                self.entries[name] = entry
        self._fds: dict[str, int] = {}
        self._scratch = threading.local()  # one reused buffer per thread for the rows a cast reads
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}  # file -> its mapping (map_rows)
        self._lock = threading.Lock()

    def _rows_buffer(self, entry: TensorEntry, rows: int) -> torch.Tensor:
        """A tensor for ``rows`` rows of ``entry`` in the file's dtype, in this thread's reused scratch buffer:
        rows read only to be cast are read into the same memory every time, so a long series of reads of
        varying sizes does not fragment the heap (a 1g Llama read in bf16 into fp32 shards, chunk by chunk, kept
        about 390 MiB of freed chunks resident on each rank)."""
        nbytes = rows * entry.row_bytes
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.numel() < nbytes:
            self._scratch.buf = buf = None
            self._scratch.buf = buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(entry.dtype).view((rows, *entry.shape[1:]) if entry.shape else ())

    def drop_scratch(self) -> None:
        """Frees the calling thread's scratch buffer of cast reads (:meth:`_rows_buffer`), once a run of reads is over
        and the source stays open for other work (rank 0 reads its own blocks, then sends the rest): up to a bucket
        that would otherwise stay allocated until :meth:`close`."""
        self._scratch.buf = None

    @staticmethod
    def _resolve(path: Path) -> list[str]:
        if path.is_dir():
            for name in ("model.safetensors.index.json", "model.safetensors"):
                if (path / name).exists():
                    return SafetensorsSource._resolve(path / name)
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise CheckpointError(f"no safetensors checkpoint in {path}: expected model.safetensors or an index.json.")
            return [str(p) for p in found]
        if path.name.endswith(".json"):
            from .validate import index_files

            # refuses entries outside the directory (`../`, absolute paths) and lists missing shards
            return [str(p) for p in sorted(set(index_files(path).values()))]
        if not path.exists():
            raise CheckpointError(f"safetensors checkpoint {path} does not exist.")
        return [str(path)]

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def keys(self) -> Iterable[str]:
        return self.entries.keys()

    def validate(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]]) -> None:
        """Checks that every expected tensor is present with the expected shape.

        Args:
            expected: Name -> (shape, dtype or ``None`` when any dtype is fine).

        Raises:
            CheckpointError: Listing missing tensors and shape/dtype mismatches (first 10 of each).
        """
        missing = [n for n in expected if n not in self.entries]
        wrong = []
        for name, (shape, dtype) in expected.items():
            entry = self.entries.get(name)
            if entry is None:
                continue
            if tuple(entry.shape) != tuple(shape) or (dtype is not None and entry.dtype != dtype):
                wrong.append(f"`{name}`: checkpoint {entry.shape} {entry.dtype}, model {tuple(shape)} {dtype}")
        from .validate import raise_if_mismatched

        raise_if_mismatched(self.path, missing=missing, wrong=wrong, limit=10,
                            hint="Load the model from the same checkpoint (same config) or pass the matching path.")

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)
        if fd is None:
            fd = os.open(file, os.O_RDONLY)
            self._fds[file] = fd
        return fd

    def read(self, name: str, start: int | None = None, stop: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Reads rows ``[start, stop)`` (along dim 0) of one tensor, in the checkpoint's dtype.

        Args:
            name: Tensor name.
            start: First row (default 0).
            stop: One past the last row (default: all rows).
            out: Optional contiguous tensor of the right shape and dtype to read into (no allocation).

        Returns:
            The rows (``out`` when given).

        Raises:
            CheckpointError: For an unknown name or a short read (the file changed underneath).
        """
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointError(f"tensor `{name}` is not in the checkpoint {self.path}.")
        rows = entry.shape[0] if entry.shape else 1
        start = 0 if start is None else start
        stop = rows if stop is None else stop
        shape = ((stop - start), *entry.shape[1:]) if entry.shape else ()
        if out is None:
            out = torch.empty(shape, dtype=entry.dtype)
        nbytes = (stop - start) * entry.row_bytes
        if nbytes:
            view = memoryview(out.view(torch.uint8).numpy() if out.dtype != torch.uint8 else out.numpy()).cast("B")
            fd = self._fd(entry.file)
            done = 0
            offset = entry.offset + start * entry.row_bytes
            while done < nbytes:
                n = os.preadv(fd, [view[done:nbytes]], offset + done)
                if n <= 0:
                    raise CheckpointError(f"short read of `{name}` from {entry.file}: the file changed while reading.")
                done += n
        return out

    def read_block(self, name: str, rows: tuple[int, int], cols: tuple[slice, ...] | None, out: torch.Tensor, *,
                   chunk_bytes: int) -> int:
        """Reads rows ``rows`` (and, for a TP block, the columns ``cols``) of ``name`` into ``out`` (a rank's
        local tensor of that block), casting to ``out.dtype``; returns the bytes read from the file.

        Straight into ``out`` when the dtypes match and the block is whole rows; otherwise in chunks of at
        most ``chunk_bytes`` of file rows.
        """
        entry = self.entries[name]
        a, b = rows
        if out.dim() == 0:
            out = out.view(1)
        if b <= a:
            return 0
        if cols is None and out.dtype == entry.dtype and out.is_contiguous() and out.device.type == "cpu":
            self.read(name, a, b, out=out)
            return (b - a) * entry.row_bytes
        if cols is not None and len(entry.shape) >= 2 and all(
                (c.start or 0) == 0 and (c.stop is None or c.stop >= n) for c, n in zip(cols[1:], entry.shape[2:])):
            return self._read_dim1(name, a, b, cols[0], out)
        step = max(1, chunk_bytes // max(1, entry.row_bytes))
        done = 0
        for s in range(a, b, step):
            e = min(b, s + step)
            rows_read = self.read(name, s, e, out=self._rows_buffer(entry, e - s))
            out[s - a : e - a].copy_(rows_read if cols is None else rows_read[(slice(None), *cols)])
            done += (e - s) * entry.row_bytes
        return done

    def _read_dim1(self, name: str, a: int, b: int, span: slice, out: torch.Tensor) -> int:
        """Rows ``[a, b)`` x the range ``span`` of dim 1 (the other dims whole): contiguous bytes within each
        row, so each row is one ``pread`` of just those bytes (a TP column block, a slice of a fused expert),
        cast into ``out`` through a temporary of that size when the dtypes differ."""
        entry = self.entries[name]
        c0, c1 = span.start or 0, entry.shape[1] if span.stop is None else min(span.stop, entry.shape[1])
        inner = entry.row_bytes // max(1, entry.shape[1])
        nbytes = (c1 - c0) * inner
        direct = out.dtype == entry.dtype and out.device.type == "cpu"
        tmp = None if direct else torch.empty((c1 - c0, *entry.shape[2:]), dtype=entry.dtype)
        fd = self._fd(entry.file)
        for r in range(a, b):
            target = out[r - a] if direct else tmp
            if direct and not target.is_contiguous():
                target, direct_row = torch.empty(target.shape, dtype=target.dtype), False
            else:
                direct_row = True
            view = memoryview(target.view(torch.uint8).numpy() if target.dtype != torch.uint8 else target.numpy()).cast("B")
            offset, done = entry.offset + r * entry.row_bytes + c0 * inner, 0
            while done < nbytes:
                n = os.preadv(fd, [view[done:nbytes]], offset + done)
                if n <= 0:
                    raise CheckpointError(f"short read of `{name}` from {entry.file}: the file changed while reading.")
                done += n
            if not direct or not direct_row:
                out[r - a].copy_(target)
        return (b - a) * nbytes

    def map_rows(self, name: str, start: int, stop: int) -> torch.Tensor | None:
        """Rows ``[start, stop)`` of ``name`` as the bytes of a private, never written mapping of its file (a
        flat ``uint8`` view, no copy): what a sender hands to the transport so that the kernel copies the page
        cache's bytes once, into the socket, instead of a ``pread`` into a buffer first. The caller drops the
        pages once they are sent (:func:`~accelerate_memsafe.io.mapped_pages.drop_pages`), so they do not
        accumulate in this process's RSS. ``None`` for a 0-d tensor or an empty file.

        Example:
            >>> # SafetensorsSource("ckpt/").map_rows("lm_head.weight", 0, 8).numel()  # 8 rows' bytes
        """
        entry = self.entries[name]
        if not entry.shape:
            return None
        with self._lock:
            mapped = self._maps.get(entry.file)
            if mapped is None:
                if os.fstat(self._fd(entry.file)).st_size == 0:
                    return None
                mm = mmap.mmap(self._fd(entry.file), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                mapped = self._maps[entry.file] = (mm, torch.frombuffer(mm, dtype=torch.uint8))
        a = entry.offset + start * entry.row_bytes
        return mapped[1][a : a + (stop - start) * entry.row_bytes]

    def is_mapped_here(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of one of this source's mappings (:meth:`map_rows`)."""
        ptr = t.data_ptr()
        return any(whole.data_ptr() <= ptr < whole.data_ptr() + whole.numel() for _, whole in self._maps.values())

    def close(self) -> None:
        """Closes the open file descriptors and the mappings (a mapping a view still uses stays until that
        view is gone)."""
        maps, self._maps = self._maps, {}
        while maps:
            mm, whole = maps.popitem()[1]
            del whole  # the last reference of this source's own view: the mapping can close
            try:
                mm.close()
            except BufferError:  # a view is still alive: the mapping goes with it
                pass
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._scratch = threading.local()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def mapped_checkpoint_dir(tensors: Iterable[torch.Tensor], maps: list[tuple[int, int, int, str]] | None = None) -> str | None:
    """The checkpoint directory whose safetensors files ``tensors`` are memory-mapped views of, when they all
    come from one directory holding ``model.safetensors`` or its index (a model transformers loaded zero-copy);
    ``None`` otherwise (no view of a mapped file, or files of several directories).

    ``maps``: the process's ``.safetensors`` mappings (``None``: only those at the tensors' addresses, asked of
    the kernel with :func:`~accelerate_memsafe.io.mapped_pages.file_mappings_at`).

    Example:
        >>> mapped_checkpoint_dir([torch.ones(4)]) is None  # anonymous memory maps no file
        True
    """
    tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if maps is None:
        from .mapped_pages import file_mappings_at

        maps = file_mappings_at((t.data_ptr() for t in tensors), ".safetensors")
    if not maps:
        return None
    starts = [lo for lo, _, _, _ in maps]
    dirs = set()
    for t in tensors:
        k = bisect.bisect_right(starts, t.data_ptr()) - 1
        if k >= 0 and t.data_ptr() < maps[k][1]:
            dirs.add(os.path.dirname(maps[k][3]))
    if len(dirs) != 1:
        return None
    (folder,) = dirs
    if any(os.path.isfile(os.path.join(folder, n)) for n in ("model.safetensors", "model.safetensors.index.json")):
        return folder
    return None


def is_view_of_entry(tensor: torch.Tensor, entry: TensorEntry, maps: list[tuple[int, int, int, str]],
                     real: dict[str, str] | None = None) -> bool:
    """Whether ``tensor``'s bytes are the memory-mapped bytes of ``entry`` (a zero-copy load).

    transformers 5 loads weights as views of a copy-on-write mmap of the checkpoint. A view keeps its
    address when written in place, so this says where the bytes *came from*, not that they are still the
    file's: check that with :func:`accelerate_memsafe.io.mapped_pages.unmodified_file_pages` before
    re-reading the tensor from the file. ``real``: a cache of resolved paths, shared over many calls.
    """
    if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape or not tensor.is_contiguous():
        return False
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    ptr = tensor.data_ptr()
    real = {} if real is None else real
    if entry.file not in real:
        real[entry.file] = os.path.realpath(entry.file)
    for lo, hi, off, path in maps:
        if lo <= ptr < hi and path == real[entry.file]:
            return ptr - lo + off == entry.offset
    return False
