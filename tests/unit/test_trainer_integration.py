"""The Trainer integration (single process): the plugin's accelerator and records, atomic checkpoints (also
killed mid-save), resume from the newest complete checkpoint, the best checkpoint found again, and the CPU-first
adapter reload for load_best_model_at_end and resume. The 2-rank FSDP2 runs are in
tests/distributed/test_trainer_fsdp2.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from accelerate_memsafe import CheckpointError, MemoryBudgetError, MemSafePlugin, _compat
from accelerate_memsafe.integrations import MemSafeTrainer, MemSafeTrainerMixin
from accelerate_memsafe.integrations import peft as peft_helpers
from accelerate_memsafe.integrations import trainer_checkpoints as tc
from accelerate_memsafe.io import atomic
from tests.distributed.workers_trainer import _scripted, cpu_first_versions

ROOT = Path(__file__).resolve().parents[2]


#: the tests of the CPU-first path itself: with other peft / transformers versions the integration falls back to the
#: Trainer's own loading by design (tested below either way), e.g. transformers 5.17 in the GPU machines' image
cpu_first_path = pytest.mark.skipif(not cpu_first_versions(), reason="peft / transformers versions the Trainer "
                                    "integration was not tested with: it falls back to the Trainer's own loading")


def _peft_model():
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_peft_model(build_llama("tiny"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int = 16, vocab: int = 256, seq: int = 8):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(cls: type, out: Path, *, max_steps: int = 4, evals: int = 0, **kwargs):
    from transformers import TrainingArguments

    options = dict(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        learning_rate=5e-2, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
        load_best_model_at_end=True, metric_for_best_model="scripted", greater_is_better=False,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1, seed=0,
    )
    plugin = {k: kwargs.pop(k) for k in ("memsafe_plugin",) if k in kwargs}
    args = TrainingArguments(**(options | kwargs))
    trainer = _scripted(cls)(model=_peft_model(), args=args, train_dataset=_Data(), eval_dataset=_Data(8), **plugin)
    trainer._evals = evals  # the scripted metric continues where a resumed run was
    return trainer


def _saved_adapter(model, checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    mapping = peft_helpers.adapter_parameter_map(model, "default")
    saved = load_file(checkpoint / "adapter_model.safetensors")
    return {mapping[k][0]: v for k, v in saved.items()}


def _current(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _forbid_peft_load(monkeypatch):
    from peft import PeftModel

    def boom(*args, **kwargs):
        raise AssertionError("peft's load_adapter must not be called: the CPU-first path should have run")

    monkeypatch.setattr(PeftModel, "load_adapter", boom)


@cpu_first_path
def test_load_best_model_at_end_reloads_best_checkpoint_cpu_first(tmp_path, monkeypatch):
    _forbid_peft_load(monkeypatch)
    trainer = _trainer(MemSafeTrainer, tmp_path)
    trainer.model.train()
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    best = _saved_adapter(trainer.model, tmp_path / "checkpoint-2")
    last = _saved_adapter(trainer.model, tmp_path / "checkpoint-4")
    now = _current(trainer.model)
    assert all(torch.equal(now[k], v) for k, v in best.items())
    assert any(not torch.equal(now[k], v) for k, v in last.items())  # so the check above can fail
    assert any("modules_to_save" in k for k in best)
    assert [s.tensors for s in trainer.memsafe_last_reload] == [len(best)]


@cpu_first_path
def test_resume_reloads_adapter_in_place(tmp_path, monkeypatch):
    first = _trainer(MemSafeTrainer, tmp_path, max_steps=2)
    first.train()
    _forbid_peft_load(monkeypatch)
    resumed = _trainer(MemSafeTrainer, tmp_path / "resumed", max_steps=2)
    resumed.args.load_best_model_at_end = False
    calls = []
    original = peft_helpers.copy_file_into

    def spy(path, plan):
        calls.append(Path(path))
        return original(path, plan)

    monkeypatch.setattr(peft_helpers, "copy_file_into", spy)
    resumed._load_from_checkpoint(str(tmp_path / "checkpoint-2"))
    assert calls == [tmp_path / "checkpoint-2" / "adapter_model.safetensors"]
    saved = _saved_adapter(resumed.model, tmp_path / "checkpoint-2")
    now = _current(resumed.model)
    assert all(torch.equal(now[k], v) for k, v in saved.items())


def test_untested_versions_warn_and_fall_back_to_upstream(tmp_path, monkeypatch):
    from peft import PeftModel

    monkeypatch.setattr(_compat, "TESTED_PEFT", (_compat.Version("0.0.1"), _compat.Version("0.0.2")))
    upstream = []
    original = PeftModel.load_adapter

    def spy(self, *args, **kwargs):
        upstream.append(args[:2])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PeftModel, "load_adapter", spy)
    trainer = _trainer(MemSafeTrainer, tmp_path)
    with pytest.warns(UserWarning, match="tested with peft.*Falling back to the Trainer's own adapter loading"):
        trainer.train()
    assert upstream == [(str(tmp_path / "checkpoint-2"), "default")]


def test_fallback_precheck_compares_whole_adapter_with_free_memory(tmp_path, monkeypatch):
    first = _trainer(MemSafeTrainer, tmp_path, max_steps=1)
    first.args.load_best_model_at_end = False
    first.train()
    monkeypatch.setattr(_compat, "TESTED_PEFT", (_compat.Version("0.0.1"), _compat.Version("0.0.2")))
    monkeypatch.setattr(peft_helpers, "device_memory", lambda device: (1000, 2**30))
    first.state.best_model_checkpoint = str(tmp_path / "checkpoint-1")
    with pytest.warns(UserWarning, match="Falling back"), pytest.raises(MemoryBudgetError, match=r"whole adapter on the device\) needs 0\.\d+ GiB.*only 0\.000 GiB of 1\.000 GiB"):
        first._load_best_model()


def test_mixin_composes_with_a_user_trainer():
    from transformers import Trainer

    class Mine(MemSafeTrainerMixin, Trainer):
        pass

    assert Mine._load_best_model is MemSafeTrainerMixin._load_best_model
    assert Mine._load_from_checkpoint is MemSafeTrainerMixin._load_from_checkpoint


@cpu_first_path
def test_example_ends_with_the_best_adapter(tmp_path):
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "peft_best_model.py"), "--max-steps", "3", "--out", str(out)],
        check=True, cwd=root, capture_output=True, text=True, timeout=300,
    )
    summary = json.loads(out.read_text())
    assert summary["adapter_equals_best"] and summary["reloaded_cpu_first"]
    assert "'pin_memory' argument is set as true but no accelerator" not in proc.stderr, "noise at every evaluation (issue 15)"


def test_plan_adapter_reload_decides_when_the_cpu_first_path_applies(tmp_path):
    from peft import LoraConfig

    from accelerate_memsafe.integrations.trainer import plan_adapter_reload

    model = _peft_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj"]))
        model.save_pretrained(tmp_path / "both")
        model.save_pretrained(tmp_path / "only_default", selected_adapters=["default"])
    assert plan_adapter_reload(model, tmp_path / "both") == (model, ["default", "other"])
    assert plan_adapter_reload(model, tmp_path / "only_default") == (model, ["default"])
    assert plan_adapter_reload(torch.nn.Linear(2, 2), tmp_path / "both") is None  # not a PEFT model
    assert plan_adapter_reload(model, tmp_path / "missing") is None
    fresh = _peft_model()  # has no "other" adapter: the Trainer's load_adapter must create it
    assert plan_adapter_reload(fresh, tmp_path / "both") is None
    (tmp_path / "both" / "model.safetensors").write_bytes(b"")  # a full model checkpoint: upstream loads it
    assert plan_adapter_reload(model, tmp_path / "both") is None


# -- the plugin's accelerator and its records ------------------------------------------------------------


def _adapter(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class _Lines:
    """Collects what a transformers logger emits (transformers' loggers do not propagate to pytest's caplog)."""

    def __init__(self, name: str):
        import logging

        self.logger, self.lines = logging.getLogger(name), []
        self.handler = logging.Handler()
        self.handler.emit = lambda record: self.lines.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.lines

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


@cpu_first_path
def test_the_trainers_accelerator_carries_the_plugin_and_records_one_pipeline_per_hook(tmp_path, monkeypatch):
    """Issue 16: `trainer.accelerator` was a stock Accelerator (no plugin, no records); once given one, every
    dataloader-only `prepare` (train + one per evaluation) added an empty prepare pipeline. The report goes where
    ACCELERATE_MEMSAFE_REPORT_PATH says, and the summary line follows the Trainer's log level."""
    import json

    from accelerate_memsafe.accelerator import MemSafeMixin

    monkeypatch.setenv("ACCELERATE_MEMSAFE_REPORT_PATH", str(tmp_path / "report-{rank}.json"))
    trainer = _trainer(MemSafeTrainer, tmp_path / "out", log_level="info")
    assert isinstance(trainer.accelerator, MemSafeMixin) and trainer.accelerator.memsafe_plugin is trainer.memsafe_plugin
    assert trainer.memsafe_plugin.report_path == str(tmp_path / "report-{rank}.json")
    with _Lines("transformers.trainer") as lines:
        trainer.train()
    records = trainer.memsafe_plugin.report.records
    assert [r.stage for r in records if r.hook == "prepare" and r.stage.startswith("accelerate.")] == ["accelerate.prepare"]
    saves = [(r.stage, r.status) for r in records if r.hook == "save_state"]
    assert saves == [("atomic_checkpoint", "ran"), ("transformers.Trainer._save_checkpoint", "ran")] * 4
    loads = [(r.stage, r.status) for r in records if r.hook == "load_state"]
    assert loads == [("peft_cpu_reload", "ran")]  # load_best_model_at_end, CPU-first; the Trainer's own load skipped
    starts = [r.start_s for r in records]  # one time axis: the records of the Trainer's hooks follow prepare's
    assert starts == sorted(starts) and starts[0] > 0
    written = json.loads((tmp_path / "report-0.json").read_text())["records"]
    assert len(written) == len(records)
    summary = [line for line in lines if line.startswith("accelerate_memsafe (rank 0)")]
    assert summary == [trainer.memsafe_summary()]
    assert "4 checkpoint(s) saved atomically" in summary[0] and "peft_cpu_reload x1" in summary[0]
    assert str(tmp_path / "report-0.json") in summary[0]
    for step in range(1, 5):  # every checkpoint carries the completeness marker, no link or temp dir is left
        ckpt = tmp_path / "out" / f"checkpoint-{step}"
        assert ckpt.is_dir() and not ckpt.is_symlink() and (ckpt / atomic.MARKER).is_file()
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".memsafe")]

    quiet = _trainer(MemSafeTrainer, tmp_path / "quiet", max_steps=1, log_level="warning", save_strategy="no",
                     eval_strategy="no", load_best_model_at_end=False)
    with _Lines("transformers.trainer") as lines:
        quiet.train()
    assert not [line for line in lines if line.startswith("accelerate_memsafe")]


def test_no_stage_gives_the_stock_trainer(tmp_path):
    """`MemSafePlugin(stages=[])`: the Trainer's own checkpoints (no marker, no temp dir) and loads, no stage records."""
    trainer = _trainer(MemSafeTrainer, tmp_path, max_steps=2, memsafe_plugin=MemSafePlugin(stages=[]))
    trainer.train()
    assert not (tmp_path / "checkpoint-2" / atomic.MARKER).exists() and (tmp_path / "checkpoint-2" / "optimizer.pt").is_file()
    stages = {r.stage for r in trainer.memsafe_plugin.report.records}
    assert stages <= {"accelerate.prepare", "transformers.Trainer._save_checkpoint", "transformers.Trainer._load_best_model"}


def test_an_untested_transformers_gets_the_plugin_attached_to_its_own_accelerator(tmp_path, monkeypatch):
    import contextlib

    from accelerate_memsafe.accelerator import MemSafeMixin

    monkeypatch.setattr(_compat, "trainer_accelerator_factory", lambda factory: contextlib.nullcontext())
    trainer = _trainer(MemSafeTrainer, tmp_path, max_steps=1)
    assert isinstance(trainer.accelerator, MemSafeMixin)
    assert trainer.memsafe_plugin is trainer.accelerator.memsafe_plugin


def test_compat_trainer_helpers(monkeypatch):
    import transformers.trainer as trainer_module
    from accelerate.state import PartialState

    with pytest.warns(UserWarning, match="Trainer accelerator was tested with transformers"):
        assert _compat.check_trainer_version("9.0.0") is False
    original = trainer_module.Accelerator
    with _compat.trainer_accelerator_factory(dict):
        assert trainer_module.Accelerator is dict
    assert trainer_module.Accelerator is original
    PartialState()  # a single process: DistributedType.NO
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _compat.reset_single_process_state() is False and PartialState._shared_state
    monkeypatch.setenv("WORLD_SIZE", "2")  # what TrainingArguments leaves on a CPU machine under a 2-process launch
    assert _compat.reset_single_process_state() is True and not PartialState._shared_state


# -- atomic Trainer checkpoints: the plain functions ------------------------------------------------------


def _write(path: Path, **files: bytes) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (path / name).write_bytes(data)


def test_begin_commit_and_repair_after_a_kill_at_each_point(tmp_path):
    final = tmp_path / "checkpoint-3"
    temp = tc.begin(final)
    assert final.is_symlink() and final.resolve() == temp.resolve() and (temp / atomic.SENTINEL).is_file()
    _write(final, **{"model.safetensors": b"new"})  # a writer that only knows the final name
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        atomic.check_loadable(final)
    assert tc.complete_checkpoints(tmp_path) == []
    marker = tc.commit(final, temp, world_size=1)
    assert not final.is_symlink() and (final / "model.safetensors").read_bytes() == b"new" and not temp.exists()
    assert marker["files"] == {"model.safetensors": 3} and atomic.check_loadable(final) is not None

    # the same step saved again, killed while writing: the previous complete one comes back
    temp = tc.begin(final)
    _write(final, **{"model.safetensors": b"partial"})
    assert tc.repair(final) and (final / "model.safetensors").read_bytes() == b"new" and not temp.exists()
    assert not (tmp_path / f"{atomic.OLD_PREFIX}checkpoint-3").exists()

    # killed after the link was removed, before the rename: the previous one comes back
    temp = tc.begin(final)
    os.unlink(final)
    assert tc.repair(final) and (final / "model.safetensors").read_bytes() == b"new" and not temp.exists()

    # killed after the rename, before the previous one was deleted: the new one stays
    temp = tc.begin(final)
    _write(final, **{"model.safetensors": b"newer"})
    os.unlink(final)
    atomic.finalize(temp, final, world_size=1)
    assert (tmp_path / f"{atomic.OLD_PREFIX}checkpoint-3").is_dir()
    assert tc.repair_all(tmp_path) == ["checkpoint-3"]
    assert (final / "model.safetensors").read_bytes() == b"newer" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-3"]

    # a fresh step killed while writing: nothing is left of it
    fresh = tmp_path / "checkpoint-4"
    temp = tc.begin(fresh)
    assert tc.repair(fresh) and not fresh.exists() and not fresh.is_symlink() and not temp.exists()


def test_newest_complete_rotation_and_best(tmp_path):
    for step in (1, 2, 3):
        temp = tc.begin(tmp_path / f"checkpoint-{step}")
        _write(tmp_path / f"checkpoint-{step}", **{"f": b"x" * step})
        tc.commit(tmp_path / f"checkpoint-{step}", temp, world_size=1)
    _write(tmp_path / "checkpoint-0", f=b"stock")  # written by the stock Trainer: no marker, counts as finished
    tc.begin(tmp_path / "checkpoint-5")  # a save killed while writing
    _write(tmp_path / "runs", f=b"")
    assert [p.name for p in tc.complete_checkpoints(tmp_path)] == ["checkpoint-0", "checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert tc.newest_complete(tmp_path) == tmp_path / "checkpoint-3"
    deleted = tc.rotate(tmp_path, 2, keep=tmp_path / "checkpoint-3", best=tmp_path / "checkpoint-1")
    assert [p.name for p in deleted] == ["checkpoint-0", "checkpoint-2"]  # the unfinished one is neither counted nor deleted
    assert (tmp_path / "checkpoint-5").is_symlink()
    assert tc.rotate(tmp_path, None, keep=tmp_path / "checkpoint-3") == []
    (tmp_path / "checkpoint-3" / "f").write_bytes(b"")  # truncated after it was written
    with pytest.raises(CheckpointError, match="truncated"):
        tc.newest_complete(tmp_path)
    # the best checkpoint found again: the recorded path is gone, the same step lies in a searched folder
    moved = tmp_path / "moved"
    moved.mkdir()
    os.rename(tmp_path / "checkpoint-1", moved / "checkpoint-1")
    assert tc.locate_best(str(tmp_path / "checkpoint-1"), 1, search=[tmp_path, moved]) == str(moved / "checkpoint-1")
    assert tc.locate_best(str(tmp_path / "checkpoint-1"), 5, search=[tmp_path]) is None  # unfinished: never chosen
    assert tc.step_of(tmp_path / "checkpoint-12") == 12 and tc.step_of(tmp_path / ".memsafe-tmp-checkpoint-12") is None


# -- a save killed mid-checkpoint leaves a resumable run -----------------------------------------------------


def _kill_child(out: str) -> None:
    """Run as a script: the stock Trainer fails in the middle of its 3rd checkpoint (an exception where a kill
    would land: model and optimizer written, RNG and trainer state not); then MemSafeTrainer is SIGKILLed at the
    same point."""
    from transformers import Trainer

    class Midway(Exception):
        pass

    def die_at_step_3(kill: bool):
        def save_rng_state(self, output_dir):
            if self.state.global_step == 3:
                if kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise Midway
            return Trainer._save_rng_state(self, output_dir)

        return save_rng_state

    stock = type("Stock", (Trainer,), {"_save_rng_state": die_at_step_3(False)})
    with pytest.raises(Midway):
        _trainer(stock, Path(out) / "stock", save_total_limit=2).train()
    mine = type("Mine", (MemSafeTrainer,), {"_save_rng_state": die_at_step_3(True)})
    _trainer(mine, Path(out) / "memsafe", save_total_limit=2).train()
    raise AssertionError("the process should have been killed")


@cpu_first_path
def test_a_save_killed_mid_checkpoint_leaves_a_resumable_run(tmp_path):
    from transformers import Trainer

    reference = _trainer(MemSafeTrainer, tmp_path / "reference", save_total_limit=2)
    reference.train()
    child = subprocess.run([sys.executable, "-c", f"from tests.unit.test_trainer_integration import _kill_child; _kill_child({str(tmp_path)!r})"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    mine = tmp_path / "memsafe"
    assert (mine / "checkpoint-3").is_symlink()  # the killed save: a link to its unfinished temporary directory
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        atomic.check_loadable(mine / "checkpoint-3")
    assert [p.name for p in tc.complete_checkpoints(mine)] == ["checkpoint-1", "checkpoint-2"]

    # the stock Trainer picks its half-written checkpoint-3 and cannot resume
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        _trainer(Trainer, tmp_path / "stock", save_total_limit=2).train(resume_from_checkpoint=True)

    resumed = _trainer(MemSafeTrainer, mine, save_total_limit=2, evals=2)
    resumed.train(resume_from_checkpoint=True)
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h] == [h["loss"] for h in reference.state.log_history if "loss" in h]
    expected = _adapter(reference.model)
    assert all(torch.equal(v, expected[k]) for k, v in _adapter(resumed.model).items())
    assert sorted(p.name for p in mine.iterdir()) == ["checkpoint-2", "checkpoint-4"]  # the best (2) and the last
    assert [r.stage for r in resumed.memsafe_plugin.report.records if r.hook == "load_state" and r.status == "ran"][:2] == [
        "peft_cpu_reload", "optimizer_cpu_reload"]

    # the best checkpoint found again after the run's folder moved (stock drops it: the recorded path is gone)
    os.rename(tmp_path / "reference", tmp_path / "moved")
    stock = _trainer(Trainer, tmp_path / "stock-after-move", evals=2)
    stock.train(resume_from_checkpoint=str(tmp_path / "moved" / "checkpoint-2"))
    assert stock.state.best_model_checkpoint is None
    again = _trainer(MemSafeTrainer, tmp_path / "after-move", evals=2)
    again.train(resume_from_checkpoint=str(tmp_path / "moved" / "checkpoint-2"))
    assert again.state.best_model_checkpoint == str(tmp_path / "moved" / "checkpoint-2")
    assert all(torch.equal(v, expected[k]) for k, v in _adapter(again.model).items())
    assert any(not torch.equal(v, expected[k]) for k, v in _adapter(stock.model).items())


@cpu_first_path
def test_the_cpu_reload_runs_no_garbage_collection_without_a_device_cache(tmp_path, monkeypatch):
    """Issue 16: each reload ran a full gc.collect() (0.25 s) inside empty_device_caches() on a CPU-only run."""
    import gc

    first = _trainer(MemSafeTrainer, tmp_path, max_steps=1, load_best_model_at_end=False)
    first.train()
    calls = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append(a) or 0)
    stats = first._memsafe_reload_adapters(first.model, str(tmp_path / "checkpoint-1"), "test")
    assert stats[0].tensors > 0 and calls == []


def test_a_sharded_optimizer_checkpoint_restores_the_groups_hyperparameters(tmp_path):
    """Found by the SFTTrainer resume under `accelerate launch` (FSDP2, SHARDED_STATE_DICT): the DCP reload of
    `optimizer_cpu_reload` kept each group's current hyper-parameters instead of the saved ones (DCP reads them
    into its flat copy of the template, which was never read back), so the first step after a resume used the
    learning rate of step 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from accelerate_memsafe.io.optimizer_state import execute_optimizer_load, plan_optimizer_load

    def setup():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1.0)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)

    model, opt, sched = setup()
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=str(tmp_path / "optimizer_0"))
    fresh, fresh_opt, _ = setup()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        execute_optimizer_load(plan_optimizer_load(fresh_opt, ("dcp", tmp_path / "optimizer_0"), model=fresh))
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 0.25
    assert fresh_opt.param_groups[0]["initial_lr"] == 1.0
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert all(torch.equal(opt.state[p][k], fresh_opt.state[q][k]) for k in ("exp_avg", "exp_avg_sq", "step"))
