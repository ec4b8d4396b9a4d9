"""optimizer_cpu_reload + optimizer_offload, single process: bitwise resume, in-place reads, bounded peak,
no loaded tensor left alive, refusal of truncated / foreign / unsafe files before anything changes."""

from __future__ import annotations

import gc
import os
import weakref
import zipfile

import pytest
import torch

from accelerate_memsafe import Accelerator, CheckpointError, MemSafePlugin
from accelerate_memsafe.distributed.optimizer_offload import OptimizerOffload, state_bytes
from accelerate_memsafe.memory.tracker import LiveTensorTracker
from accelerate_memsafe.models import build_llama
from tests import releases


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _make(plugin=None, *, seed=0, stock=False):
    _reset()
    if stock:
        import accelerate

        acc = accelerate.Accelerator()
    else:
        acc = Accelerator(plugins=[plugin or MemSafePlugin()])
    model = build_llama("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt, i):
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(i))
    loss = model(input_ids=ids, labels=ids).loss
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.detach().clone()


def _state(opt):
    return {(gi, pi, k): v.detach().clone() if isinstance(v, torch.Tensor) else v
            for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])
            for k, v in opt.state[p].items()}


def _largest(opt):
    return max(v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))


@pytest.fixture
def checkpoint(tmp_path):
    """A plugin-written checkpoint after 2 steps, the state at that point, and the loss of step 3."""
    acc, model, opt = _make()
    for i in range(2):
        _step(acc, model, opt, i)
    path = tmp_path / "ckpt"
    acc.save_state(str(path))
    acc.wait_for_everyone()  # read in-process (also by stock accelerate): wait for the background commit
    state = _state(opt)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    next_loss = _step(acc, model, opt, 2)
    return {"path": path, "state": state, "params": params, "next_loss": next_loss,
            "state_bytes": state_bytes(opt), "largest": _largest(opt)}


def _load_tracked(acc, path):
    refs = []
    with LiveTensorTracker(on_alloc=lambda name, t: refs.append(weakref.ref(t))) as tracker:
        acc.load_state(str(path))
    gc.collect()
    return tracker, [r() for r in refs if r() is not None]


def _allowed_storages(model, opt):
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    ptrs |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    ptrs |= {v.untyped_storage().data_ptr() for st in opt.optimizer.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)}
    return ptrs


def _mapped(checkpoint) -> int:
    """What the live-tensor figure counts of the mapped optimizer file where torch records no offsets on `meta`
    storages (the file's pages, not the process's memory: `test_a_torch_without_meta_offsets_...`), else 0."""
    return 0 if releases.torch_records_meta_offsets() else checkpoint["state_bytes"]


@pytest.mark.parametrize("offload", [False, True])
def test_reload_into_fresh_optimizer_is_bitwise_bounded_and_leaves_nothing_alive(checkpoint, offload):
    acc, model, opt = _make(MemSafePlugin(optimizer_offload=offload), seed=1)
    tracker, alive = _load_tracked(acc, checkpoint["path"])
    assert _state(opt.optimizer).keys() == checkpoint["state"].keys()
    for k, v in _state(opt.optimizer).items():
        assert torch.equal(v, checkpoint["state"][k]), k
        assert v.device.type == "cpu"
    bound = checkpoint["state_bytes"] + checkpoint["largest"] + 0.05 * checkpoint["state_bytes"] + _mapped(checkpoint)
    assert tracker.peak_bytes <= bound, (tracker.peak_bytes, bound)
    allowed = _allowed_storages(model, opt)
    leftovers = [tuple(t.shape) for t in alive if t.untyped_storage().data_ptr() not in allowed]
    assert not leftovers, f"tensors from the loaded state dicts still alive: {leftovers}"
    record = acc.memsafe_plugin.report.find(hook="load_state", stage="optimizer_cpu_reload")[-1]
    assert record.status == "ran" and record.details["new_bytes"] == checkpoint["state_bytes"]
    assert "reclaimed_device_bytes" in record.details
    assert torch.equal(_step(acc, model, opt, 2), checkpoint["next_loss"]), "resumed step differs"


def test_reload_into_optimizer_with_state_reads_in_place(checkpoint):
    acc, model, opt = _make(MemSafePlugin(track_live_tensors=True), seed=1)
    _step(acc, model, opt, 7)  # the optimizer now holds state of its own
    before = {k: v.data_ptr() for k, v in _state_ptrs(opt.optimizer).items()}
    tracker, alive = _load_tracked(acc, checkpoint["path"])
    after = {k: v.data_ptr() for k, v in _state_ptrs(opt.optimizer).items()}
    assert before == after, "state must be read into the existing tensors"
    for k, v in _state(opt.optimizer).items():
        assert torch.equal(v, checkpoint["state"][k]), k
    # The existing state is alive throughout; the optimizer load may only allocate the slack of the bound
    # (stock accelerate allocates a whole second copy here: 2x the state at the peak). The whole
    # `load_state` also reads the model (accelerate's part, at most the model's bytes).
    slack = checkpoint["largest"] + 0.05 * checkpoint["state_bytes"]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert tracker.peak_bytes <= slack + model_bytes + _mapped(checkpoint), (tracker.peak_bytes, slack + model_bytes)
    record = acc.memsafe_plugin.report.find(hook="load_state", stage="optimizer_cpu_reload")[-1]
    assert record.details["new_bytes"] == 0 and record.details["in_place_bytes"] == checkpoint["state_bytes"]
    assert record.live_tensor_peak_bytes <= checkpoint["largest"] + 0.05 * checkpoint["state_bytes"] + _mapped(checkpoint)
    assert not [t for t in alive if t.untyped_storage().data_ptr() not in _allowed_storages(model, opt)]
    assert torch.equal(_step(acc, model, opt, 2), checkpoint["next_loss"])


def _state_ptrs(opt):
    return {(gi, pi, k): v for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])
            for k, v in opt.state[p].items()}


def test_stock_accelerate_loads_a_plugin_checkpoint_and_vice_versa(checkpoint, tmp_path):
    acc, model, opt = _make(stock=True, seed=1)
    acc.load_state(str(checkpoint["path"]))
    assert torch.equal(_step(acc, model, opt, 2), checkpoint["next_loss"])
    acc, model, opt = _make(stock=True)
    for i in range(2):
        _step(acc, model, opt, i)
    acc.save_state(str(tmp_path / "stock"))
    acc, model, opt = _make(seed=1)
    acc.load_state(str(tmp_path / "stock"))  # no completeness marker: accepted, still read in place
    assert torch.equal(_step(acc, model, opt, 2), checkpoint["next_loss"])


def _snapshot(model, opt):
    return {n: p.detach().clone() for n, p in model.named_parameters()}, _state(opt.optimizer)


def _unchanged(model, opt, snap):
    params, state = snap
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters()), "model changed before the refusal"
    now = _state(opt.optimizer)
    assert now.keys() == state.keys() and all(torch.equal(now[k], state[k]) for k in now), "optimizer changed"


@pytest.mark.parametrize("with_marker", [True, False])
def test_truncated_optimizer_file_is_refused_before_anything_changes(checkpoint, with_marker):
    path = checkpoint["path"]
    opt_file = path / "optimizer.bin"
    data = opt_file.read_bytes()
    opt_file.write_bytes(data[: len(data) // 2])
    if not with_marker:
        (path / ".memsafe_complete.json").unlink()
    acc, model, opt = _make(seed=1)
    _step(acc, model, opt, 5)
    snap = _snapshot(model, opt)
    with pytest.raises(CheckpointError, match="truncated") as err:
        acc.load_state(str(path))
    assert str(opt_file) in str(err.value)
    _unchanged(model, opt, snap)


def test_a_full_checkpoint_of_another_world_size_loads_with_a_warning(checkpoint):
    """Written by "4 processes" (a DDP checkpoint holds full state dicts, which load anywhere): stock
    accelerate loads it, so the plugin loads it too, says so, and the next step matches the saving run's."""
    import json

    marker = checkpoint["path"] / ".memsafe_complete.json"
    data = json.loads(marker.read_text())
    data["world_size"] = 4
    marker.write_text(json.dumps(data))
    acc, model, opt = _make(seed=1)
    with pytest.warns(UserWarning, match=r"written by 4 process\(es\) and is loaded by 1: model and optimizer"):
        acc.load_state(str(checkpoint["path"]))
    assert all(torch.equal(p, checkpoint["params"][n]) for n, p in model.named_parameters())
    state = _state(opt.optimizer)
    assert state.keys() == checkpoint["state"].keys() and all(torch.equal(state[k], checkpoint["state"][k]) for k in state)
    assert torch.equal(_step(acc, model, opt, 2), checkpoint["next_loss"])


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch PWNED_MEMSAFE",))


def test_optimizer_file_with_pickled_code_is_refused_without_running_it(checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opt_file = checkpoint["path"] / "optimizer.bin"
    sd = torch.load(opt_file, weights_only=True)
    sd["param_groups"][0]["evil"] = _Boom()
    torch.save(sd, opt_file)
    (checkpoint["path"] / ".memsafe_complete.json").unlink()
    acc, model, opt = _make(seed=1)
    with pytest.raises(CheckpointError, match="optimizer file .*optimizer.bin"):
        acc.load_state(str(checkpoint["path"]))
    assert not (tmp_path / "PWNED_MEMSAFE").exists()


def test_optimizer_of_another_model_is_refused(checkpoint):
    _reset()
    acc = Accelerator(plugins=[MemSafePlugin()])
    model = build_llama("tiny", seed=1)
    opt = torch.optim.AdamW(list(model.parameters())[:-1], lr=1e-3)
    model, opt = acc.prepare(model, opt)
    with pytest.raises(CheckpointError, match="parameter group 0 has .* in the checkpoint"):
        acc.load_state(str(checkpoint["path"]))


def test_offload_keeps_state_on_cpu_and_matches_plain_training():
    acc, model, opt = _make(MemSafePlugin(optimizer_offload=True))
    assert isinstance(getattr(opt.optimizer, "_memsafe_offload", None), OptimizerOffload)
    record = acc.memsafe_plugin.report.find(hook="prepare", stage="optimizer_offload")[-1]
    assert record.status == "ran"
    losses = [_step(acc, model, opt, i) for i in range(3)]
    assert opt.optimizer._memsafe_offload.steps == 3
    assert all(v.device.type == "cpu" for st in opt.optimizer.state.values() for v in st.values())
    acc2, model2, opt2 = _make(MemSafePlugin(optimizer_offload=False))
    assert acc2.memsafe_plugin.report.find(hook="prepare", stage="optimizer_offload")[-1].status == "skipped"
    ref = [_step(acc2, model2, opt2, i) for i in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(losses, ref))


def test_zipfile_is_what_torch_saves():
    """The reader relies on torch.save writing uncompressed zip records (one per storage)."""
    import io

    buf = io.BytesIO()
    torch.save({"a": torch.arange(10.0)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())


def _file_mapped(tensors, path) -> bool:
    """Whether every tensor's bytes lie in a mapping of the file ``path`` (``/proc/self/maps``): none was copied."""
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and os.path.realpath(fields[5]) == os.path.realpath(path):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                spans.append((lo, hi))
    return all(any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in spans)
               for t in tensors if t.numel())


def _no_offsets(monkeypatch):
    """A torch that records no file offsets on `meta` storages (2.10 and before): the reload maps the file. Returns
    the `torch.load` calls made, each with whether what a mapped load returned lay in the file's mapping."""
    from accelerate_memsafe import _compat
    from accelerate_memsafe.memory.tracker import tensors_in

    loads = []
    real_load = torch.load

    def load(f, *args, **kwargs):
        out = real_load(f, *args, **kwargs)
        call = {"file": os.path.basename(str(f)), **{k: str(v) for k, v in kwargs.items()}}
        if kwargs.get("mmap"):
            call["in_mapping"] = _file_mapped(tensors_in(out), f)
        loads.append(call)
        return out

    monkeypatch.setattr(_compat, "checkpoint_file_offset", lambda tensor: None)
    monkeypatch.setattr(torch, "load", load)
    return loads


@pytest.mark.parametrize("held", [False, True], ids=["fresh", "in_place"])
def test_a_torch_without_meta_offsets_reloads_from_the_files_mapping_bitwise_and_bounded(checkpoint, monkeypatch, held):
    acc, model, opt = _make(MemSafePlugin(track_live_tensors=True), seed=1)
    if held:
        _step(acc, model, opt, 7)
    before = {k: v.data_ptr() for k, v in _state_ptrs(opt.optimizer).items()}
    loads = _no_offsets(monkeypatch)
    tracker, alive = _load_tracked(acc, checkpoint["path"])
    # the structure on `meta` first, then, as it has no offsets, the file mapped: never a whole load into memory
    assert [(k["map_location"], k.get("mmap"), k.get("in_mapping")) for k in loads if k["file"] == "optimizer.bin"] == \
        [("meta", None, None), ("cpu", "True", True)], loads
    state = _state(opt.optimizer)
    assert state.keys() == checkpoint["state"].keys() and all(torch.equal(state[k], checkpoint["state"][k]) for k in state)
    if held:
        assert {k: v.data_ptr() for k, v in _state_ptrs(opt.optimizer).items()} == before, "not read in place"
    record = acc.memsafe_plugin.report.find(hook="load_state", stage="optimizer_cpu_reload")[-1]
    assert record.details["bytes_read"] >= checkpoint["state_bytes"]
    assert record.details["new_bytes" if not held else "in_place_bytes"] == checkpoint["state_bytes"]
    # the live-tensor figure counts the mapped file's tensors too (the file's pages, not the process's own memory):
    # besides them, only the new state of a fresh optimizer and the slack
    slack = checkpoint["largest"] + 0.05 * checkpoint["state_bytes"]
    bound = checkpoint["state_bytes"] + (0 if held else checkpoint["state_bytes"]) + slack
    assert record.live_tensor_peak_bytes <= bound, (record.live_tensor_peak_bytes, bound)
    assert not [t for t in alive if t.untyped_storage().data_ptr() not in _allowed_storages(model, opt)]
    assert torch.equal(_step(acc, model, opt, 2), checkpoint["next_loss"]), "resumed step differs"


def _conv(seed, plugin):
    _reset()
    acc = Accelerator(plugins=[plugin])
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    model = model.to(memory_format=torch.channels_last)  # the convolutions' weights, and so Adam's state, are NHWC
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _conv_step(acc, model, opt, i):
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)).to(memory_format=torch.channels_last)
    loss = model(x).square().mean()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    return loss.detach().clone()


@pytest.mark.parametrize("offsets", [True, False], ids=["offsets", "mapped"])
@pytest.mark.parametrize("held", [False, True], ids=["fresh", "in_place"])
def test_a_channels_last_optimizer_state_reloads_as_stock_loads_it(tmp_path, monkeypatch, offsets, held):
    """State saved with other strides than a contiguous tensor's (a channels_last convolution's Adam moments):
    stock accelerate loads it; the plugin refused it (it read every tensor as one contiguous run of bytes).
    Now both paths end with the same bytes and the same strides, and the next step is the same."""
    acc, model, opt = _conv(0, MemSafePlugin())
    for i in range(2):
        _conv_step(acc, model, opt, i)
    assert any(not v.is_contiguous() for st in opt.optimizer.state.values() for v in st.values() if v.dim())
    acc.save_state(str(tmp_path / "ckpt"))
    acc.wait_for_everyone()
    got = {}
    for path, plugin in (("stock", MemSafePlugin(stages=[])), ("plugin", MemSafePlugin())):
        acc, model, opt = _conv(1, plugin)
        if held:
            _conv_step(acc, model, opt, 7)
        with monkeypatch.context() as m:
            if not offsets and path == "plugin":
                _no_offsets(m)
            acc.load_state(str(tmp_path / "ckpt"))
        state = _state_ptrs(opt.optimizer)
        got[path] = ({k: (v.detach().clone(), v.stride()) for k, v in state.items() if isinstance(v, torch.Tensor)},
                     _conv_step(acc, model, opt, 2))
        if path == "plugin":
            record = acc.memsafe_plugin.report.find(hook="load_state", stage="optimizer_cpu_reload")[-1]
            assert record.status == "ran", record
    (stock, stock_loss), (mine, loss) = got["stock"], got["plugin"]
    assert stock.keys() == mine.keys()
    for k in stock:
        assert torch.equal(stock[k][0], mine[k][0]) and stock[k][0].dtype == mine[k][0].dtype, k
        assert stock[k][1] == mine[k][1], (k, stock[k][1], mine[k][1])
    assert torch.equal(loss, stock_loss)
