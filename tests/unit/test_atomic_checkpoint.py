"""atomic_checkpoint: complete-or-absent checkpoints (SIGKILL at several points of a save, in a
subprocess, also while the commit runs in the background), refusal of temporary / incomplete directories,
automatic naming and rolling total_limit, the background commit (off the critical path, waited for by the next
hook, its errors raised, never lost at exit)."""

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


def _make(*, seed=0, project_config=None, stock=False, **options):
    _reset()
    if stock:
        import accelerate

        acc = accelerate.Accelerator(project_config=project_config)
    else:
        acc = Accelerator(plugins=[MemSafePlugin(**options)], project_config=project_config)
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
    """Saves checkpoint A, records its hashes, then saves B to the same path and dies at ``point``: in the
    main thread while accelerate writes, or in rank 0's background commit while the main thread trains on
    (``*_sync``: with ``async_checkpoint=False``, the commit inside ``save_state``)."""
    sync = point.endswith("_sync")
    point = point.removesuffix("_sync")
    acc, model, opt = _make(async_checkpoint=not sync)
    for i in range(2):
        _step(acc, model, opt, i)
    acc.save_state(path)
    acc.memsafe_plugin.wait_for_checkpoint()  # the files are read in-process: wait for the commit
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
    _step(acc, model, opt, 3)  # the training loop goes on while rank 0 commits
    acc.memsafe_plugin.wait_for_checkpoint()
    Path(path + ".B.json").write_text(json.dumps(_hashes(Path(path))))


POINTS = ["after_begin", "in_optimizer_file", "half_optimizer_file", "while_fsyncing", "before_swap", "after_swap",
          "before_swap_sync"]


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
    assert not Path(str(path) + ".B.json").exists(), "the save was not killed"
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
    acc.wait_for_everyone()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".memsafe-")]


# -- refusing incomplete directories --------------------------------------------------------------

def test_temporary_and_incomplete_directories_are_refused(tmp_path):
    acc, model, opt = _make()
    _step(acc, model, opt, 0)
    acc.save_state(str(tmp_path / "good"))
    acc.wait_for_everyone()  # the commit (marker, swap) ends before the directory is read in-process
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
    acc.wait_for_everyone()
    (path / "stale_file_from_before").write_text("x")
    _step(acc, model, opt, 1)
    acc.save_state(str(path))
    acc.wait_for_everyone()
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
    acc.wait_for_everyone()  # the last commit and its total_limit rotation
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


# -- the background commit ---------------------------------------------------------------------------

class _Gate:
    """Holds rank 0's commit inside its first fsync until released (and records which thread fsyncs)."""

    def __init__(self, monkeypatch):
        import threading

        self.entered, self.release, self.threads = threading.Event(), threading.Event(), []
        real = atomic._fsync_file

        def fsync(p):
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.release.wait(60), "the gate was never released"
            real(p)

        monkeypatch.setattr(atomic, "_fsync_file", fsync)


def _state(model, opt):
    return {k: v.clone() for k, v in model.state_dict().items()}, \
        {k: v.clone() for k, v in opt.optimizer.state[next(model.parameters())].items()}


def _committed(tmp_path):
    """An accelerator after one step whose checkpoint ``tmp_path / "ckpt"`` is committed, and its file hashes."""
    acc, model, opt = _make()
    _step(acc, model, opt, 0)
    path = tmp_path / "ckpt"
    acc.save_state(str(path))
    acc.wait_for_everyone()
    return acc, model, opt, path, _hashes(path)


def test_save_state_returns_before_the_commit_and_the_next_hook_waits_for_it(tmp_path, monkeypatch):
    import threading

    acc, model, opt, path, first = _committed(tmp_path)
    _step(acc, model, opt, 1)
    saved_model, saved_opt = _state(model, opt)
    gate = _Gate(monkeypatch)
    # the training loop waits only for the bytes: save_state returns while the commit is held in its first fsync
    assert acc.save_state(str(path)) == str(path)
    assert gate.entered.wait(30) and not gate.release.is_set()
    assert gate.threads[0] != threading.main_thread().name
    assert _hashes(path) == first, "the previous checkpoint stays in place until the new one is committed"
    temp = atomic.temp_dir_for(path)
    assert (temp / atomic.SENTINEL).exists() and not (temp / atomic.MARKER).exists()
    record = acc.memsafe_plugin.report.find(hook="save_state", stage="atomic_checkpoint")[-1]
    assert record.details["commit"] == "background"
    _step(acc, model, opt, 2)  # training goes on, then the next hook waits for the commit and loads the new one
    threading.Timer(0.3, gate.release.set).start()
    acc.load_state(str(path))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in saved_model.items())
    assert all(torch.equal(v, opt.optimizer.state[next(model.parameters())][k]) for k, v in saved_opt.items())
    assert (path / atomic.MARKER).exists() and not temp.exists()
    commit = acc.memsafe_plugin.report.find(hook="save_state", stage="atomic_checkpoint.commit")[-1]
    assert commit.status == "ran" and commit.details["files"] == len(atomic.list_files(path)) and commit.wall_s >= 0.3


def test_wait_for_checkpoint_and_the_synchronous_option(tmp_path, monkeypatch):
    import threading

    acc, model, opt = _make()
    _step(acc, model, opt, 0)
    gate = _Gate(monkeypatch)
    acc.save_state(str(tmp_path / "a"))
    threading.Timer(0.2, gate.release.set).start()
    assert acc.memsafe_plugin.wait_for_checkpoint() == str(tmp_path / "a")  # no collective: rank 0 alone may call it
    atomic.check_loadable(tmp_path / "a", world_size=1)
    assert acc.memsafe_plugin.wait_for_checkpoint() is None  # nothing pending any more
    acc, model, opt = _make(async_checkpoint=False)
    gate.threads.clear()
    acc.save_state(str(tmp_path / "b"))
    assert set(gate.threads) == {threading.main_thread().name}, "async_checkpoint=False commits inside save_state"
    atomic.check_loadable(tmp_path / "b", world_size=1)


def test_a_failed_background_commit_is_raised_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import errno

    acc, model, opt, path, first = _committed(tmp_path)

    def full(p):
        raise OSError(errno.ENOSPC, "No space left on device", str(p))

    monkeypatch.setattr(atomic, "_fsync_file", full)
    for settle in (acc.wait_for_everyone, lambda: acc.load_state(str(path)), acc.end_training,
                   acc.memsafe_plugin.wait_for_checkpoint):
        _step(acc, model, opt, 1)
        acc.save_state(str(path))  # returns: the error comes from the background
        with pytest.raises(CheckpointError, match=r"the commit of .*ckpt failed in the background on rank 0: OSError: "
                                                  r"\[Errno 28\] No space left on device.*previous checkpoint"):
            settle()
        assert _hashes(path) == first
    monkeypatch.undo()
    acc.load_state(str(path))  # settled: the next hooks work
    _step(acc, model, opt, 2)
    acc.save_state(str(path))
    acc.wait_for_everyone()
    assert _hashes(path) != first
    failed = [r for r in acc.memsafe_plugin.report.records if r.stage == "atomic_checkpoint.commit" and r.status == "failed"]
    assert len(failed) == 4 and "No space left" in failed[0].reason


_EXIT_CHILD = r'''
import sys, time, torch
from accelerate_memsafe import Accelerator, MemSafePlugin
from accelerate_memsafe.background import BackgroundWork
from accelerate_memsafe.io import atomic
from accelerate_memsafe.models import build_llama
real = atomic._fsync_file
def fsync(p):
    time.sleep(0.2)  # a slow disk: the commit is still running when the script ends
    real(p)
atomic._fsync_file = fsync
acc = Accelerator(plugins=[MemSafePlugin()], cpu=True)
m, o = acc.prepare(build_llama("tiny"), torch.optim.AdamW(build_llama("tiny").parameters()))
acc.save_state(sys.argv[1] + "/good")
def fail():
    raise OSError(5, "Input/output error", sys.argv[1] + "/bad")
other = BackgroundWork()  # a second pending commit whose error nothing waits for
other.start("the commit of " + sys.argv[1] + "/bad", fail, rank=0)
print("returned; good committed:", acc.memsafe_plugin.pipeline.background.task.done(), flush=True)
'''


def test_the_process_does_not_exit_with_a_commit_pending(tmp_path):
    """A script that ends right after save_state: the interpreter waits for the commit, and an error that nothing
    waited for is printed at exit."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "returned; good committed: False" in proc.stdout, (proc.stdout, proc.stderr[-2000:])
    atomic.check_loadable(tmp_path / "good", world_size=1)
    assert (tmp_path / "good" / atomic.MARKER).exists()
    assert "the commit of" in proc.stderr and "bad failed in the background" in proc.stderr, proc.stderr[-2000:]
    assert "Input/output error" in proc.stderr
