"""SIGKILL a save at random points; after every kill, the last complete checkpoint must load bitwise-equal and
no partial checkpoint may ever be loaded.

Two savers are exercised, alternately:

- ``save_state``: ``accelerate_memsafe.Accelerator.save_state`` with the default pipeline (atomic checkpoint
  stage, committed in the background: ``save_state`` returns once the files are written, rank 0's commit
  thread fsyncs, marks and swaps while the child trains one more step, then waits for it) on a tiny Llama
  with an AdamW state, one process;
- ``save_offloaded``: ``accelerate_memsafe.save_offloaded`` of a tiny Llama dispatched on cpu + disk.

Each point runs one child process that saves version ``v`` of the weights into a directory that already
holds an older complete version. The child counts Python call events (``sys.setprofile`` and
``threading.setprofile``: every thread, the background commit's included) from the moment the save starts
and sends itself ``SIGKILL`` at event ``k``, ``k`` drawn uniformly from the number of events a full save
takes (measured first, per saver). Every third point lands in the commit phase only, alternately anywhere
in it (fsync, completeness marker) and from the swap into place on: for ``save_state`` that phase runs in
the background thread, so ``k`` counts the events of that thread alone (the kill lands there, whatever the
interleaving with the main thread, which is training meanwhile); for ``save_offloaded`` it is drawn from the
events of the whole save from its commit on. The kill points are spread over the whole save, from the first
file written to the final rename, and a point is reproducible from the seed. Each child writes, just before
it kills itself, in which phase it was (``save``: before the commit, ``background``: while the commit
thread works, ``commit``: in a commit on the main thread, ``after``: once committed). After each kill the
parent checks:

1. the checkpoint directory passes :func:`accelerate_memsafe.io.atomic.check_loadable` and loads (with
   the plugin's ``load_state`` / with ``from_pretrained``) bitwise-equal to the last version whose save
   completed, or to the version being saved when the kill came after the final swap (then that version is
   the last complete one);
2. every temporary directory left behind is refused with :class:`CheckpointError` (by ``check_loadable``
   and, for ``save_state``, by ``load_state`` itself).

A point where either check fails counts as a lost checkpoint. Run the full harness with::

    python -m tests.reliability.kill_harness --points 24

It prints one JSON line (points tried, kills, checkpoints lost, which version was in place after each
kill, the phases the kills landed in) and exits non-zero if a checkpoint was lost. ``tests/reliability/test_kill_harness.py`` runs a few
points in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODES = ("save_state", "save_offloaded")


# ---------------------------------------------------------------------------------------------------
# Child: one save, killed at event `kill_at` (0: never; print the number of events instead; "bgN": at the
# N-th event of the background commit thread)
# ---------------------------------------------------------------------------------------------------
def _child(mode: str, work: Path, version: int, kill_at: str) -> None:
    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    target = work / mode / "ckpt"
    target.parent.mkdir(parents=True, exist_ok=True)
    ref_path = work / mode / f"ref_{version}.pt"
    if mode == "save_state":
        from accelerate_memsafe import Accelerator, MemSafePlugin
        from accelerate_memsafe.models import build_llama

        acc = Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True)
        model = build_llama("tiny", seed=version)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(version))
        acc.backward(model(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
        ref = {"model": {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()},
               "optimizer": opt.optimizer.state_dict() if hasattr(opt, "optimizer") else opt.state_dict()}

        def save() -> None:
            acc.save_state(str(target))
            # the training loop goes on while rank 0 commits in the background, then waits for the commit
            acc.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
            acc.wait_for_everyone()
    else:
        from transformers import AutoModelForCausalLM

        from accelerate_memsafe import save_offloaded
        from accelerate_memsafe.io.offload_reader import cpu_disk_device_map
        from accelerate_memsafe.models import build_llama, save_llama

        src = work / mode / f"src_{version}"
        if not src.exists():
            save_llama(src, "tiny", seed=version)
        reference = build_llama("tiny", seed=version)
        model = AutoModelForCausalLM.from_pretrained(src, device_map=cpu_disk_device_map(reference, 0.5),
                                                     offload_folder=str(work / mode / f"offload_{version}"))
        ref = {"model": {k: v.clone() for k, v in reference.state_dict().items()}}

        def save() -> None:
            save_offloaded(model, target, max_shard_size=60_000, progress=False)

    if not ref_path.exists():
        torch.save(ref, ref_path)  # written before the kill window, so always complete
    from accelerate_memsafe.background import THREAD_NAME

    background = kill_at.startswith("bg")
    kill_at_event = int(kill_at.removeprefix("bg"))
    count = {"all": 0, "bg": 0}
    marks = {"finalize_at": 0, "swap_at": 0, "bg_swap_at": 0, "finalize_in_background": False}
    phase = {"commit": "save"}
    lock = threading.Lock()
    phase_file = work / mode / "kill_phase.json"

    def hook(frame, event, arg):
        in_bg = threading.current_thread().name == THREAD_NAME
        code = frame.f_code
        if event == "return" and code.co_name == "finalize" and code.co_filename.endswith("atomic.py"):
            phase["commit"] = "after"
        if event not in ("call", "c_call"):
            return
        with lock:
            count["all"] += 1
            count["bg"] += in_bg
            if event == "call" and code.co_filename.endswith("atomic.py"):
                if not marks["finalize_at"] and code.co_name == "finalize":
                    marks["finalize_at"], marks["finalize_in_background"] = count["all"], in_bg
                    phase["commit"] = "background" if in_bg else "commit"
                if not marks["swap_at"] and code.co_name == "_exchange":
                    marks["swap_at"], marks["bg_swap_at"] = count["all"], count["bg"]
            if (count["bg"] if background else count["all"]) == kill_at_event and (in_bg or not background):
                phase_file.write_text(json.dumps({"phase": phase["commit"], "thread": threading.current_thread().name}))
                os.kill(os.getpid(), signal.SIGKILL)

    phase_file.unlink(missing_ok=True)
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        save()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    print(json.dumps({"events": count["all"], "bg_events": count["bg"], **marks, "saved": version}), flush=True)


def _run_child(mode: str, work: Path, version: int, kill_at: int | str, timeout: float = 300) -> tuple[int, dict | None, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    for key in [k for k in env if k.startswith("ACCELERATE_MEMSAFE_")]:
        del env[key]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability.kill_harness", "--child", mode, str(work), str(version), str(kill_at)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    out = None
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            out = json.loads(line)
    return proc.returncode, out, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------
# Parent: verification
# ---------------------------------------------------------------------------------------------------
def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _reset_accelerate() -> None:
    try:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    except Exception:
        pass


def _load_state_dicts(mode: str, directory: Path) -> dict[str, Any]:
    """Loads a checkpoint the way a user would (the plugin's ``load_state`` / ``from_pretrained``)."""
    import torch

    if mode == "save_state":
        from accelerate_memsafe import Accelerator, MemSafePlugin
        from accelerate_memsafe.models import build_llama

        _reset_accelerate()
        try:
            acc = Accelerator(plugins=[MemSafePlugin(progress=False)], cpu=True)
            model = build_llama("tiny", seed=12345)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = acc.prepare(model, opt)
            acc.load_state(str(directory))
            inner = opt.optimizer if hasattr(opt, "optimizer") else opt
            return {"model": acc.unwrap_model(model).state_dict(), "optimizer": inner.state_dict()}
        finally:
            _reset_accelerate()
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe.io import atomic

    atomic.check_loadable(directory)
    return {"model": AutoModelForCausalLM.from_pretrained(directory).state_dict()}


def _which_version(mode: str, work: Path, loaded: dict[str, Any], candidates: list[int]) -> int | None:
    import torch

    for v in candidates:
        ref = torch.load(work / mode / f"ref_{v}.pt", weights_only=True)
        if _equal(ref["model"], {k: loaded["model"][k] for k in ref["model"] if k in loaded["model"]}) and \
                ref["model"].keys() <= loaded["model"].keys() and ("optimizer" not in ref or _equal(ref["optimizer"], loaded["optimizer"])):
            return v
    return None


def _partials_refused(mode: str, folder: Path) -> list[str]:
    """Every temporary directory in ``folder`` must be refused; returns the problems."""
    from accelerate_memsafe import CheckpointError
    from accelerate_memsafe.io import atomic

    problems = []
    for p in sorted(folder.iterdir()):
        if not p.is_dir() or not atomic.is_temp_dir(p):
            continue
        try:
            atomic.check_loadable(p)
            problems.append(f"check_loadable accepted the partial checkpoint {p.name}")
        except CheckpointError:
            pass
        if mode == "save_state":
            try:
                _load_state_dicts(mode, p)
                problems.append(f"load_state loaded the partial checkpoint {p.name}")
            except CheckpointError:
                pass
            except Exception as exc:
                problems.append(f"load_state of the partial checkpoint {p.name} failed without a clear error: {type(exc).__name__}: {exc}")
    return problems


def run(points: int, *, seed: int = 0, workdir: str | None = None, log: Any = None) -> dict[str, Any]:
    """Runs the harness: ``points`` kills, alternating between the savers.

    Returns:
        ``{"points": ..., "killed": ..., "completed": ..., "lost": ..., "lost_details": [...], "outcomes": {...},
        "phases": {mode: {phase: kills}}}`` (``phases["save_state"]["background"]``: kills that landed while the
        background commit was running).
    """
    import torch  # noqa: F401 - the parent verifies in-process

    warnings.simplefilter("ignore")
    rng = random.Random(seed)
    tmp = tempfile.TemporaryDirectory(prefix="memsafe-kill-") if workdir is None else None
    work = Path(workdir or tmp.name)
    result: dict[str, Any] = {"points": 0, "killed": 0, "completed": 0, "lost": 0, "lost_details": [],
                              "outcomes": {m: {"previous_in_place": 0, "new_in_place": 0} for m in MODES},
                              "events_per_save": {}, "seed": seed, "phases": {m: {} for m in MODES}}
    say = log or (lambda *_: None)
    try:
        last: dict[str, int] = {}
        for mode in MODES:
            # the first save creates version 0; the second measures a save that replaces a checkpoint
            for _ in range(2):
                rc, out, err = _run_child(mode, work, 0, 0)
                if rc != 0 or out is None:
                    raise RuntimeError(f"the {mode} calibration save failed (rc={rc}):\n{err}")
            result["events_per_save"][mode] = out["events"]
            result.setdefault("commit_from_event", {})[mode] = out["finalize_at"]
            result.setdefault("swap_from_event", {})[mode] = out["swap_at"]
            result.setdefault("background_commit", {})[mode] = out["finalize_in_background"] and {
                "events": out["bg_events"], "swap_from_event": out["bg_swap_at"]}
            last[mode] = 0
        version = 0
        commits = {m: 0 for m in MODES}
        for i in range(points):
            mode = MODES[i % len(MODES)]
            version += 1  # noqa: SIM113 - counts saves, also those of the other mode
            total = result["events_per_save"][mode]
            # Every third point lands in the commit phase (fsync, marker, swap), alternately anywhere in it
            # and from the swap on (a background commit: counted in its own thread's events); the others
            # anywhere in the save.
            start, prefix, bg = 1, "", result["background_commit"][mode]
            if i % 3 == 2:
                commits[mode] += 1
                if bg:
                    prefix, total = "bg", bg["events"]
                    start = 1 if commits[mode] % 2 else bg["swap_from_event"]
                else:
                    start = result["commit_from_event"][mode] if commits[mode] % 2 else result["swap_from_event"][mode]
            kill_at = f"{prefix}{rng.randint(max(start, 1), total)}"
            rc, out, err = _run_child(mode, work, version, kill_at)
            result["points"] += 1
            killed = rc == -signal.SIGKILL
            if killed:
                result["killed"] += 1
            elif rc == 0:
                result["completed"] += 1
            else:
                raise RuntimeError(f"the {mode} child failed (rc={rc}) instead of being killed:\n{err}")
            phase_file = work / mode / "kill_phase.json"
            phase = json.loads(phase_file.read_text())["phase"] if killed and phase_file.exists() else "completed"
            result["phases"][mode][phase] = result["phases"][mode].get(phase, 0) + 1
            target = work / mode / "ckpt"
            problems = []
            try:
                loaded = _load_state_dicts(mode, target)
                found = _which_version(mode, work, loaded, [last[mode], version])
            except Exception as exc:
                found = None
                problems.append(f"the checkpoint does not load: {type(exc).__name__}: {str(exc)[:300]}")
            if found is None:
                problems.append(f"{target} holds neither version {last[mode]} (last complete) nor {version}")
            elif not killed and found != version:
                problems.append(f"the save of version {version} completed but {target} holds version {found}")
            else:
                key = "new_in_place" if found == version else "previous_in_place"
                if killed:
                    result["outcomes"][mode][key] += 1
                last[mode] = found
            problems += _partials_refused(mode, target.parent)
            say(f"point {i + 1}/{points} {mode} kill_at={kill_at}/{total} "
                f"{'killed in phase ' + phase if killed else 'completed'} -> version {found} in place{'; ' + '; '.join(problems) if problems else ''}")
            if problems:
                result["lost"] += 1
                result["lost_details"].append({"point": i + 1, "mode": mode, "kill_at": kill_at, "phase": phase,
                                               "problems": problems})
    finally:
        if tmp is not None:
            tmp.cleanup()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=int, default=24, help="kills to perform (alternating save_state / save_offloaded)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the checkpoints here (default: a temporary folder)")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--child", nargs=4, metavar=("MODE", "WORK", "VERSION", "KILL_AT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, work, version, kill_at = args.child
        _child(mode, Path(work), int(version), kill_at)
        return 0
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    result = run(args.points, seed=args.seed, workdir=args.workdir, log=log)
    print(json.dumps(result))
    return 1 if result["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
