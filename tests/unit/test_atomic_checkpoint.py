"""atomic_checkpoint: complete-or-absent checkpoints (SIGKILL at several points of a save, in a
subprocess), refusal of temporary / incomplete directories, automatic naming and rolling total_limit."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accelerate_memsafe import Accelerator, CheckpointError, MemSafePlugin
from accelerate_memsafe.io import atomic
from accelerate_memsafe.models import build_llama

ROOT = Path(__file__).resolve().parents[2]


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _make(*, seed=0, project_config=None, stock=False):
    _reset()
    if stock:
        import accelerate

        acc = accelerate.Accelerator(project_config=project_config)
    else:
        acc = Accelerator(plugins=[MemSafePlugin()], project_config=project_config)
    model = build_llama("tiny", seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt, i):
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(i))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()


def _hashes(path: Path) -> dict[str, str]:
    return {rel: hashlib.sha256((path / rel).read_bytes()).hexdigest() for rel in atomic.list_files(path)}


# -- the child process killed in the middle of a save -------------------------------------------------

def _kill():
    os.kill(os.getpid(), signal.SIGKILL)


def _child(path: str, point: str) -> None:
    """Saves checkpoint A, records its hashes, then saves B to the same path and dies at ``point``."""
    acc, model, opt = _make()
    for i in range(2):
        _step(acc, model, opt, i)
    acc.save_state(path)
    Path(path + ".A.json").write_text(json.dumps(_hashes(Path(path))))
    _step(acc, model, opt, 2)
    real_begin, real_exchange, real_fsync = atomic.begin, atomic._exchange, atomic._fsync_file
    if point == "after_begin":
        atomic.begin = lambda temp: (real_begin(temp), _kill())
    elif point in ("in_optimizer_file", "half_optimizer_file"):
        real_save = torch.save

        def save(obj, f, *a, **k):
            if str(f).endswith("optimizer.bin"):
                if point == "half_optimizer_file":
                    real_save(obj, f, *a, **k)
                    data = Path(f).read_bytes()
                    Path(f).write_bytes(data[: len(data) // 2])
                _kill()
            return real_save(obj, f, *a, **k)

        torch.save = save
    elif point == "while_fsyncing":
        calls = []
        atomic._fsync_file = lambda p: (calls.append(p), _kill() if len(calls) == 2 else real_fsync(p))
    elif point == "before_swap":
        atomic._exchange = lambda a, b: _kill()
    elif point == "after_swap":
        atomic._exchange = lambda a, b: (real_exchange(a, b), _kill())
    acc.save_state(path)
    Path(path + ".B.json").write_text(json.dumps(_hashes(Path(path))))


POINTS = ["after_begin", "in_optimizer_file", "half_optimizer_file", "while_fsyncing", "before_swap", "after_swap"]


@pytest.mark.parametrize("point", POINTS)
def test_sigkill_during_save_leaves_previous_checkpoint_intact(tmp_path, point):
    path = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", f"from tests.unit.test_atomic_checkpoint import _child; _child({str(path)!r}, {point!r})"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    a = json.loads(Path(str(path) + ".A.json").read_text())
    now = _hashes(path)
    if point == "after_swap":
        assert now != a, "the swap had happened: the path must hold the new checkpoint"
        assert set(now) == set(a)
    else:
        assert now == a, f"checkpoint A changed after a kill at {point}"
    acc, model, opt = _make(seed=1)
    acc.load_state(str(path))  # loadable
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".memsafe-")]
    for temp in leftovers:
        with pytest.raises(CheckpointError, match="incomplete checkpoint"):
            acc.load_state(str(temp))
    acc.save_state(str(path))  # the next save cleans up what the killed one left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".memsafe-")]


# -- refusing incomplete directories --------------------------------------------------------------

def test_temporary_and_incomplete_directories_are_refused(tmp_path):
    acc, model, opt = _make()
    _step(acc, model, opt, 0)
    acc.save_state(str(tmp_path / "good"))
    marker = json.loads((tmp_path / "good" / atomic.MARKER).read_text())
    assert marker["complete"] and marker["world_size"] == 1 and "optimizer.bin" in marker["files"]
    bad = tmp_path / "bad"
    atomic.begin(bad)  # a directory being written (sentinel), under a normal name
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        acc.load_state(str(bad))
    os.remove(tmp_path / "good" / "random_states_0.pkl")
    with pytest.raises(CheckpointError, match=r"is incomplete: file .*random_states_0.pkl listed"):
        acc.load_state(str(tmp_path / "good"))


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    acc, model, opt = _make()
    _step(acc, model, opt, 0)
    path = tmp_path / "ckpt"
    assert acc.save_state(str(path)) == str(path)
    (path / "stale_file_from_before").write_text("x")
    _step(acc, model, opt, 1)
    acc.save_state(str(path))
    assert not (path / "stale_file_from_before").exists(), "a checkpoint is replaced, not merged"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_model_is_atomic_and_keeps_other_files(tmp_path):
    acc, model, opt = _make()
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text("{}")
    acc.save_model(model, str(out))
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert (out / atomic.MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_automatic_naming_with_total_limit(tmp_path):
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc, model, opt = _make(project_config=config)
    saved = []
    for i in range(3):
        _step(acc, model, opt, i)
        saved.append(acc.save_state())
    folder = tmp_path / "checkpoints"
    assert saved == [str(folder / f"checkpoint_{i}") for i in range(3)]
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".memsafe-")]
    state = {k: v.clone() for k, v in opt.optimizer.state[next(model.parameters())].items()}
    # a killed save leaves a temporary directory next to `checkpoints/`: never picked up
    atomic.begin(tmp_path / f"{atomic.TEMP_PREFIX}checkpoint_3")
    acc2, model2, opt2 = _make(seed=1, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2))
    acc2.load_state()
    record = acc2.memsafe_plugin.report.find(hook="load_state", stage="atomic_checkpoint")[-1]
    assert record.details["directory"] == str(folder / "checkpoint_2")
    got = opt2.optimizer.state[next(model2.parameters())]
    assert all(torch.equal(got[k], v) for k, v in state.items())
    acc3, _, _ = _make(seed=1, stock=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    acc3.load_state()  # stock accelerate's own pick works on the same folder


def test_checkpoint_helpers():
    assert atomic.temp_dir_for("/a/b/step_3").as_posix() == "/a/b/.memsafe-tmp-step_3"
    assert atomic.is_temp_dir("/a/.memsafe-tmp-x")
    assert not atomic.is_temp_dir("/nonexistent/checkpoint_3")


def test_swap_without_renameat2_is_repaired_after_a_kill_between_the_renames(tmp_path, monkeypatch):
    final = tmp_path / "ckpt"
    for content in ("old", "new"):
        temp = atomic.temp_dir_for(final)
        atomic.begin(temp)
        (temp / "f.txt").write_text(content)
        if content == "new":
            monkeypatch.setattr(atomic, "_exchange", lambda a, b: False)
            real_rename = os.rename
            calls = []

            def rename(a, b, calls=calls, real_rename=real_rename):
                calls.append((a, b))
                real_rename(a, b)
                if len(calls) == 1:
                    raise KeyboardInterrupt("killed between the two renames")

            monkeypatch.setattr(atomic.os, "rename", rename)
            with pytest.raises(KeyboardInterrupt):
                atomic.finalize(temp, final, world_size=1)
            monkeypatch.setattr(atomic.os, "rename", real_rename)
            assert not final.exists()
            assert atomic.recover(final)
            assert (final / "f.txt").read_text() == "old"
            atomic.check_loadable(final, world_size=1)
            with pytest.raises(CheckpointError, match="incomplete checkpoint"):
                atomic.check_loadable(temp)
            atomic.begin(temp)
            (temp / "f.txt").write_text("new")
            atomic.finalize(temp, final, world_size=1)
            assert (final / "f.txt").read_text() == "new"
        else:
            atomic.finalize(temp, final, world_size=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
