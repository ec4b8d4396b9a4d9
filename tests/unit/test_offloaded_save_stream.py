"""The streaming writer of ``save_offloaded``: header first, tensors at their offsets, bytes that lie in a file
read from there, writer and syncer threads ahead of the caller within a byte budget.

Checked here: the layout is exactly safetensors' (every dtype, odd names, metadata); every written file is
byte-identical to ``safetensors.torch.save_file`` of the same tensors (a Llama and a Qwen3-MoE whose fused
experts are split on save) in every ``io_mode`` (``O_DIRECT``, page cache with ``copy_file_range``, from
memory) and with the fallbacks; bytes are never taken from a file that no longer holds what the model
holds (a weight written in place, a replaced checkpoint file); the caller runs ahead of the writers by at
most the budget; a failure in any thread reaches the caller and keeps the previous checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accelerate_memsafe import _compat, save_offloaded
from accelerate_memsafe.errors import ConfigError
from accelerate_memsafe.io import atomic, offloaded_save, shard_writer
from accelerate_memsafe.io.mapped_pages import file_backed_ranges
from accelerate_memsafe.io.offload_reader import OffloadedTensorReader, cpu_disk_device_map
from accelerate_memsafe.io.safetensors_layout import DTYPE_NAMES, SafetensorsLayout
from accelerate_memsafe.io.shard_plan import saveable_state_dict
from accelerate_memsafe.io.shard_writer import ShardWriter, TensorWrite
from tests.unit.test_offloaded_save import build_model, load_offloaded


def _fill(layout: SafetensorsLayout, tensors: dict[str, torch.Tensor]) -> bytes:
    buf = bytearray(layout.size)
    buf[: len(layout.header)] = layout.header
    for name, t in tensors.items():
        begin, end = layout.ranges[name]
        buf[begin:end] = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return bytes(buf)


@pytest.mark.parametrize("metadata", [{"format": "pt"}, None])
def test_layout_is_the_one_safetensors_writes(metadata):
    from safetensors.torch import save

    rng = random.Random(0)
    names = ["a", "b.10", "b.2", "Z", "layers.00", "é€", 'q"\\\n\t\x01']
    tensors = {}
    for i, dtype in enumerate(DTYPE_NAMES):
        for j in range(3):
            shape = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 3)))
            if DTYPE_NAMES[dtype] == "F4":
                shape = (2, 3)  # packed two per element; safetensors refuses empty or odd sub-byte slices
            raw = torch.randint(0, 255, (*shape, dtype.itemsize), dtype=torch.uint8)
            tensors[f"{rng.choice(names)}.{i}.{j}"] = raw.view(dtype).reshape(shape)
    layout = SafetensorsLayout.of([(k, tuple(v.shape), v.dtype) for k, v in tensors.items()], metadata)
    assert _fill(layout, tensors) == save(tensors, metadata=metadata)


def test_layout_refuses_what_safetensors_cannot_store():
    with pytest.raises(ValueError, match="complex128"):
        SafetensorsLayout.of([("x", (2,), torch.complex128)])
    with pytest.raises(ValueError, match="given twice"):
        SafetensorsLayout.of([("x", (2,), torch.float32), ("x", (3,), torch.float16)])


# -- whole saves -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def offloaded(request, tmp_path_factory):
    """(name, offloaded model, max_shard_size giving several shards)."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        from transformers import AutoModelForCausalLM

        from accelerate_memsafe.models import build_llama, save_llama

        save_llama(root / "orig", "tiny", seed=0)
        model = AutoModelForCausalLM.from_pretrained(root / "orig", device_map=cpu_disk_device_map(build_llama("tiny"), 0.5),
                                                     offload_folder=str(root / "offload"))
        return request.param, model, 60_000
    reference = build_model("qwen3_moe")
    reference.save_pretrained(root / "orig")
    return request.param, load_offloaded(root / "orig", root / "offload", reference), 5_000


def _save_file_reference(model, plan, out: Path) -> None:
    """What the previous implementation wrote: ``save_file`` of each planned shard's reverted tensors."""
    from safetensors.torch import save_file

    reader = OffloadedTensorReader(model, saveable_state_dict(model))
    out.mkdir()
    for shard in plan.shards:
        tensors = {}
        for group in shard.groups:
            loaded = {s.name: reader.read(s.name) for s in group.sources}
            tensors.update({k: v.contiguous() for k, v in _compat.revert_conversions(model, loaded).items()})
        save_file(tensors, str(out / shard.filename), metadata={"format": "pt"})


def _same_files(a: Path, b: Path, plan) -> list[str]:
    return [s.filename for s in plan.shards if (a / s.filename).read_bytes() != (b / s.filename).read_bytes()]


@pytest.mark.parametrize(("io_mode", "release_pages", "piece"),
                         [("direct", "unmap", None), ("buffered", "unmap", 10_000), ("memory", "pageout", 10_000),
                          ("direct", "off", 10_000)])
def test_files_are_byte_identical_to_save_file(offloaded, tmp_path, monkeypatch, io_mode, release_pages, piece):
    name, model, limit = offloaded
    monkeypatch.setattr(shard_writer, "DIRECT_MIN_BYTES", 4096)  # the tiny models' tensors take O_DIRECT too
    if piece:  # tensors cut into many pieces, written by both writer threads in any order
        monkeypatch.setattr(shard_writer, "CHUNK_BYTES", piece)
    result = save_offloaded(model, tmp_path / "out", max_shard_size=limit, progress=False,
                            io_mode=io_mode, release_pages=release_pages)
    plan = result.plan
    assert len(plan.shards) > 2
    if name == "qwen3_moe":
        assert any(g.converted for g in plan.groups)  # fused experts are split on save
    _save_file_reference(model, plan, tmp_path / "ref")
    assert _same_files(tmp_path / "out", tmp_path / "ref", plan) == []
    stats = result.writer
    assert stats.copied_bytes + stats.written_bytes == plan.total_bytes
    if io_mode != "memory":
        # Every tensor of the tiny Llama lies in a file (mapped checkpoint or disk offload); the Qwen3-MoE's
        # cpu-resident fused experts were fused in memory on load, its disk ones were offloaded to files.
        assert stats.copied_bytes == plan.total_bytes if name == "llama" else 0 < stats.copied_bytes < plan.total_bytes
    else:
        assert stats.copied_bytes == 0
    assert (stats.direct_bytes > 0) == (io_mode == "direct")
    # Pages are released only where tensors were written from memory (reading the file faults none in).
    assert (stats.released_bytes > 0) == (io_mode == "memory" and release_pages != "off")


def test_the_default_copies_file_bytes_in_the_kernel_through_the_page_cache(offloaded, tmp_path, monkeypatch):
    """The default ``io_mode`` is ``"buffered"`` (the fastest measured, docs/benchmarks.md): no ``O_DIRECT``
    open, and the bytes of the disk offload and the mapped checkpoint copied by ``copy_file_range``."""
    _, model, limit = offloaded
    opened_direct = []
    real_open = os.open

    def watch(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            opened_direct.append(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", watch)
    result = save_offloaded(model, tmp_path / "out", max_shard_size=limit, progress=False)
    monkeypatch.undo()
    assert opened_direct == [] and result.writer.direct_bytes == 0
    assert 0 < result.writer.copied_bytes <= result.plan.total_bytes
    assert result.writer.copied_bytes + result.writer.written_bytes == result.plan.total_bytes
    _save_file_reference(model, result.plan, tmp_path / "ref")
    assert _same_files(tmp_path / "out", tmp_path / "ref", result.plan) == []


def test_refused_kernel_copies_and_direct_io_fall_back_to_the_page_cache(offloaded, tmp_path, monkeypatch):
    """``copy_file_range`` across file systems (EXDEV) and ``O_DIRECT`` on one that refuses it (EINVAL, e.g.
    tmpfs) each fail once; the save goes on through the page cache from memory, with the same bytes."""
    _, model, limit = offloaded
    calls = []
    real_open = os.open

    def cross_device(*args):
        calls.append("copy_file_range")
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    def no_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            calls.append("O_DIRECT")
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "copy_file_range", cross_device)
    monkeypatch.setattr(os, "open", no_direct)
    result = save_offloaded(model, tmp_path / "out", max_shard_size=limit, progress=False, io_mode="direct")
    assert sorted(calls) == ["O_DIRECT", "copy_file_range"]  # each tried once in the save
    assert result.writer.copied_bytes == result.writer.direct_bytes == 0
    assert result.writer.written_bytes == result.plan.total_bytes
    monkeypatch.undo()
    _save_file_reference(model, result.plan, tmp_path / "ref")
    assert _same_files(tmp_path / "out", tmp_path / "ref", result.plan) == []


def test_bad_options_are_refused_before_anything_is_written(offloaded, tmp_path):
    _, model, _ = offloaded
    with pytest.raises(ConfigError, match="release_pages='sometimes'"):
        save_offloaded(model, tmp_path / "out", release_pages="sometimes", progress=False)
    with pytest.raises(ConfigError, match="io_mode='mmap'.*'direct', 'buffered', 'memory'"):
        save_offloaded(model, tmp_path / "out", io_mode="mmap", progress=False)
    assert not any(tmp_path.iterdir())


# -- what may be read from a file ---------------------------------------------------------------------------
@pytest.fixture
def llama_on_cpu_and_disk(tmp_path):
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe.models import build_llama, save_llama

    save_llama(tmp_path / "orig", "tiny", seed=4)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "orig", device_map=cpu_disk_device_map(build_llama("tiny"), 0.5),
                                                 offload_folder=str(tmp_path / "offload"))
    return model, tmp_path


def _held(model) -> dict[str, torch.Tensor]:
    """What the model holds right now (resident tensors as they are, offloaded ones through the hooks)."""
    reader = OffloadedTensorReader(model, saveable_state_dict(model))
    return {n: reader.read(n).clone() for n in saveable_state_dict(model)}


def _reloaded(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def test_a_weight_written_in_place_is_saved_as_the_model_holds_it(llama_on_cpu_and_disk):
    model, root = llama_on_cpu_and_disk
    reader = OffloadedTensorReader(model, saveable_state_dict(model))
    resident = [n for n in saveable_state_dict(model) if reader.is_resident(n) and reader.extent(n) is not None]
    victim = resident[len(resident) // 2]
    with torch.no_grad():
        model.get_parameter(victim).view(-1)[3] += 1.0  # one element: a private copy of one page of the mapping
    expected = _held(model)
    result = save_offloaded(model, root / "out", max_shard_size=60_000, progress=False)
    got = _reloaded(root / "out")
    assert all(torch.equal(got[k], v) for k, v in expected.items())
    assert result.writer.written_bytes >= model.get_parameter(victim).nbytes  # from memory, not from the file
    assert result.writer.copied_bytes > 0


def test_a_replaced_checkpoint_file_is_never_copied(llama_on_cpu_and_disk):
    model, root = llama_on_cpu_and_disk
    expected = _held(model)
    # Another file under the same path (different bytes): the model still holds the old file's bytes.
    from accelerate_memsafe.models import save_llama

    save_llama(root / "other", "tiny", seed=5)
    os.replace(root / "other" / "model.safetensors", root / "orig" / "model.safetensors")
    reader = OffloadedTensorReader(model, saveable_state_dict(model))
    assert all(reader.extent(n) is None for n in saveable_state_dict(model) if reader.is_resident(n))
    save_offloaded(model, root / "out", max_shard_size=60_000, progress=False)
    got = _reloaded(root / "out")
    resident = [n for n in expected if reader.is_resident(n)]
    assert resident and all(torch.equal(got[n], expected[n]) for n in resident)


def test_offload_file_entry_names_where_accelerate_reads_from(tmp_path):
    """``_compat.offload_file_entry`` (accelerate's private loader index) for the three layouts, and the
    reader's extents hold exactly the bytes the hooks return."""
    import copy

    from accelerate import cpu_offload, dispatch_model
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe.models import build_llama, save_llama

    save_llama(tmp_path / "orig", "tiny", seed=1)
    reference = build_llama("tiny", seed=1)
    models = {
        "safetensors": AutoModelForCausalLM.from_pretrained(tmp_path / "orig", device_map=cpu_disk_device_map(reference, 0.5),
                                                            offload_folder=str(tmp_path / "off-tf")),
        "dat": dispatch_model(copy.deepcopy(reference), device_map=cpu_disk_device_map(reference, 0.5),
                              offload_dir=str(tmp_path / "off-acc"), main_device="cpu"),
        None: cpu_offload(copy.deepcopy(reference), execution_device=torch.device("cpu")),  # values in memory
    }
    for kind, model in models.items():
        reader = OffloadedTensorReader(model, saveable_state_dict(model))
        assert reader.offloaded
        for name in reader.offloaded:
            entry = _compat.offload_file_entry(*reader._sources[name])
            assert (entry or {}).get("format") == kind, (kind, name, entry)
            extent = reader.extent(name)
            assert (extent is None) == (kind is None)
            if extent is not None:
                with open(extent.path, "rb") as f:
                    f.seek(extent.offset)
                    on_disk = f.read(extent.nbytes)
                assert on_disk == reader.read(name).reshape(-1).view(torch.uint8).numpy().tobytes()


# -- overlap, budget, failures -------------------------------------------------------------------------------
def test_the_caller_runs_ahead_of_the_writer_within_the_budget(offloaded, tmp_path, monkeypatch):
    """Counted independently of the writer's own bookkeeping: a group is pending from the moment the caller
    starts reading it (its planned inputs and outputs) until its last byte is written, and once read it holds
    the private memory its writes point at (storages the model does not hold and no file maps, plus tensors
    a writer may still load). With a slow disk, groups must be pending together (reading overlaps writing),
    and never more bytes than ``max(max_shard_size, largest group)``."""
    import time

    _, model, limit = offloaded
    lock = threading.Lock()
    pending: dict[int, int] = {}  # group -> bytes
    left: dict[int, int] = {}  # group -> writes not done
    by_write: dict[int, int] = {}  # id(TensorWrite) -> group
    todo: dict[int, int] = {}  # id(TensorWrite) -> bytes not written yet
    peaks = {"bytes": 0, "groups": 0}
    real_prepare, real_write = offloaded_save._prepare_group, shard_writer.ShardWriter._write
    own = {t.untyped_storage().data_ptr() for t in model.state_dict().values() if t.device.type == "cpu"}

    def held(writes) -> int:
        mapped = file_backed_ranges()
        storages = {w.tensor.untyped_storage().data_ptr(): w.tensor.untyped_storage().nbytes()
                    for w in writes if w.tensor is not None}
        return sum(w.nbytes for w in writes if w.tensor is None) + sum(
            n for ptr, n in storages.items() if ptr not in own and not any(lo <= ptr < hi for lo, hi in mapped))

    def count(group, nbytes):
        pending[group] = nbytes
        peaks["bytes"] = max(peaks["bytes"], sum(pending.values()))
        peaks["groups"] = max(peaks["groups"], len(pending))

    def prepare(model, group, *args, **kwargs):
        with lock:
            count(id(group), group.memory_bytes)
        writes, resident, private = real_prepare(model, group, *args, **kwargs)
        with lock:
            count(id(group), held(writes))
            left[id(group)] = sum(1 for w in writes if w.nbytes)
            by_write.update({id(w): id(group) for w in writes if w.nbytes})
            if not left[id(group)]:
                del pending[id(group)], left[id(group)]
        return writes, resident, private

    def write(self, fd, w, start, nbytes):
        time.sleep(0.002)  # a slow disk
        copied = real_write(self, fd, w, start, nbytes)
        with lock:
            todo[id(w)] = todo.get(id(w), w.nbytes) - nbytes
            if not todo[id(w)]:  # the last piece of this tensor
                del todo[id(w)]
                g = by_write.pop(id(w))
                left[g] -= 1
                if not left[g]:
                    del pending[g], left[g]
        return copied

    monkeypatch.setattr(offloaded_save, "_prepare_group", prepare)
    monkeypatch.setattr(shard_writer.ShardWriter, "_write", write)
    result = save_offloaded(model, tmp_path / "out", max_shard_size=limit, progress=False)
    bound = max(limit, max(g.memory_bytes for g in result.plan.groups))
    assert peaks["groups"] >= 2, "reading never overlapped writing"
    assert peaks["bytes"] <= bound
    assert result.writer.peak_reserved_bytes <= bound and not pending


def test_a_group_keeps_reserved_only_the_memory_it_holds(tmp_path):
    """``put(held=...)`` gives the rest of the planned bytes back at once: with a budget of 100 bytes and a
    first group that planned 100 but holds 10 (its outputs are views of the model's own tensors), the next
    group of 90 is reserved while the first is still being written; without ``held`` it waits."""
    layout = SafetensorsLayout.of([("a", (25,), torch.float32), ("b", (25,), torch.float32)])
    a, b = torch.arange(25, dtype=torch.float32), torch.ones(25)
    gate = threading.Event()

    class Slow(ShardWriter):
        def _write(self, file, w, start, nbytes):
            gate.wait(10)
            return super()._write(file, w, start, nbytes)

    for held, waits in ((10, False), (None, True)):
        gate.clear()
        with Slow(100, io_mode="memory") as writer:
            writer.open(tmp_path / f"x{held}.safetensors", layout)
            writer.reserve(100)
            writer.put([TensorWrite(*_range(layout, "a"), a)], reserved=100, held=held)
            second = threading.Thread(target=writer.reserve, args=(90,))
            second.start()
            second.join(0.5)
            assert second.is_alive() == waits
            gate.set()
            second.join(10)
            writer.put([TensorWrite(*_range(layout, "b"), b)], reserved=90)
            writer.close()
            stats = writer.finish()
        assert stats.peak_reserved_bytes == 100  # never over the budget, either way
        assert load_file(tmp_path / f"x{held}.safetensors")["a"].equal(a)


def _range(layout: SafetensorsLayout, name: str) -> tuple[int, int]:
    begin, end = layout.ranges[name]
    return begin, end - begin


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_writer_threads() -> bool:
    return not any(t.name.startswith("memsafe-shard-") for t in threading.enumerate())


@pytest.mark.parametrize("where", ["write", "direct write", "fsync", "caller"])
def test_a_failure_reaches_the_caller_and_keeps_the_previous_checkpoint(llama_on_cpu_and_disk, monkeypatch, where):
    model, root = llama_on_cpu_and_disk
    monkeypatch.setattr(shard_writer, "DIRECT_MIN_BYTES", 4096)
    target = root / "ckpt"
    save_offloaded(model, target, max_shard_size=60_000, progress=False)
    before = _digest(target)
    calls = [0]
    if where in ("write", "direct write"):  # the disk fills up while a writer thread writes the third piece
        real = shard_writer._pwrite_all

        def pwrite(fd, data, offset):
            calls[0] += 1
            if calls[0] == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd, data, offset)

        monkeypatch.setattr(shard_writer, "_pwrite_all", pwrite)
        expected = (OSError, r"No space left on device.*model-0000\d-of-0000\d.safetensors")
    elif where == "fsync":  # the syncer thread's fsync of the second file fails
        real = shard_writer.sync_file

        def sync(fd, path):
            calls[0] += 1
            if calls[0] == 2:
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
            real(fd, path)

        monkeypatch.setattr(shard_writer, "sync_file", sync)
        expected = (OSError, r"Input/output error.*model-0000\d-of-0000\d.safetensors")
    else:  # the caller's thread fails while the writer has work queued
        real = offloaded_save._prepare_group

        def prepare(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 6:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(offloaded_save, "_prepare_group", prepare)
        expected = (KeyboardInterrupt, None)
    with pytest.raises(expected[0], match=expected[1]):
        save_offloaded(model, target, max_shard_size=60_000, progress=False,
                       io_mode="direct" if where == "direct write" else "memory")
    assert calls[0] >= 2
    assert _digest(target) == before, "the previous checkpoint was modified"
    atomic.check_loadable(target)
    assert not atomic.temp_dir_for(target).exists()
    assert _no_writer_threads()
