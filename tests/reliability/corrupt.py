"""Helpers of the reliability tests: ways to damage a checkpoint, and snapshots that prove nothing changed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import torch

INDEX = "model.safetensors.index.json"


# -- snapshots ------------------------------------------------------------------------------------------
def tree_digest(root: str | os.PathLike) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256); directories count as entries too."""
    root = Path(root)
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirs, files in os.walk(root):
        for d in dirs:
            out[(Path(dirpath) / d).relative_to(root).as_posix() + "/"] = "dir"
        for f in files:
            p = Path(dirpath) / f
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def model_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter and buffer (local shards for DTensors)."""
    out = {f"param:{n}": _local(p.detach()).clone() for n, p in model.named_parameters()}
    out.update({f"buffer:{n}": _local(b.detach()).clone() for n, b in model.named_buffers()})
    return out


def optimizer_snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Copies of the optimizer's state tensors and hyper-parameters."""
    opt = getattr(optimizer, "optimizer", optimizer)
    out: dict[str, Any] = {}
    for gi, group in enumerate(opt.param_groups):
        out[f"group{gi}"] = {k: v for k, v in group.items() if k != "params"}
        for pi, p in enumerate(group["params"]):
            for k, v in opt.state.get(p, {}).items():
                out[f"{gi}.{pi}.{k}"] = _local(v).clone() if isinstance(v, torch.Tensor) else v
    return out


def assert_same(before: dict[str, Any], after: dict[str, Any], what: str) -> None:
    """Bitwise equality of two snapshots."""
    assert before.keys() == after.keys(), f"{what}: entries changed: {sorted(set(before) ^ set(after))[:10]}"
    for k, v in before.items():
        w = after[k]
        if isinstance(v, torch.Tensor):
            assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v.view(-1).view(torch.uint8) if v.numel() else v,
                                                                              w.view(-1).view(torch.uint8) if w.numel() else w), \
                f"{what}: `{k}` was modified"
        else:
            assert v == w, f"{what}: `{k}` was modified ({v!r} -> {w!r})"


# -- safetensors surgery ----------------------------------------------------------------------------------
def read_raw(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(path: Path, header: dict, data: bytes) -> None:
    hb = json.dumps(header).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def truncate(path: Path, nbytes: int = 64) -> None:
    """Cuts the last ``nbytes`` bytes of a file (a save that was interrupted)."""
    os.truncate(path, path.stat().st_size - nbytes)


def inflate_header(path: Path) -> str:
    """Rewrites the header so that its last tensor claims twice its bytes; the data stays as it is, so the
    header claims more bytes than the file holds. Returns the tensor's name."""
    header, data = read_raw(path)
    name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    begin, end = header[name]["data_offsets"]
    header[name]["shape"][0] *= 2
    header[name]["data_offsets"][1] = begin + 2 * (end - begin)
    write_raw(path, header, data)
    return name


def rewrite_tensors(path: Path, change) -> None:
    """Loads a safetensors file, applies ``change(dict)`` and saves it again."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def file_of(directory: Path, name: str) -> Path:
    """The shard file of ``directory`` that holds tensor ``name``."""
    index = directory / INDEX
    if index.exists():
        return directory / json.loads(index.read_text())["weight_map"][name]
    return directory / "model.safetensors"


def drop_and_add_keys(directory: Path, drop: str, add: str) -> None:
    """Removes tensor ``drop`` and adds a tensor ``add`` (index updated)."""
    path = file_of(directory, drop)
    rewrite_tensors(path, lambda t: (t.pop(drop), t.__setitem__(add, torch.zeros(3))))
    index = directory / INDEX
    if index.exists():
        ix = json.loads(index.read_text())
        ix["weight_map"].pop(drop)
        ix["weight_map"][add] = path.name
        index.write_text(json.dumps(ix))


def escape_index(directory: Path, *, absolute: bool) -> Path:
    """Moves the first shard out of the directory and points the index at it with ``../`` or an absolute
    path. Returns where the shard now lies."""
    index = directory / INDEX
    ix = json.loads(index.read_text())
    first = sorted(set(ix["weight_map"].values()))[0]
    outside = directory.parent / f"outside-{directory.name}"
    outside.mkdir(exist_ok=True)
    shutil.move(str(directory / first), str(outside / first))
    target = str(outside / first) if absolute else f"../{outside.name}/{first}"
    ix["weight_map"] = {k: (target if v == first else v) for k, v in ix["weight_map"].items()}
    index.write_text(json.dumps(ix))
    return outside / first


def remark(directory: Path) -> None:
    """Rewrites the plugin's completeness marker to the files as they are now (a checkpoint that was
    damaged or crafted *before* it was marked complete, so the marker cannot catch it)."""
    from accelerate_memsafe.io import atomic

    marker = directory / atomic.MARKER
    if marker.exists():
        data = json.loads(marker.read_text())
        data["files"] = atomic.list_files(directory)
        marker.write_text(json.dumps(data))


class CodePayload:
    """Unpickling this runs ``os.system("touch <marker>")``: the file exists iff checkpoint code ran."""

    def __init__(self, marker: str | os.PathLike) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))
