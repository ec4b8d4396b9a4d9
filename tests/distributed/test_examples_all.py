"""The examples in a reduced configuration: resume with optimizer offload, offloaded save, plugin launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, timeout: int = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


#: Third-party noise that our examples and launcher used to print on every run (issue 15).
NOISE = ("'set_vital' is deprecated", "were not passed to `accelerate launch`")


def _assert_quiet_and_printed_once(output: str) -> None:
    assert not [n for n in NOISE if n in output], output[-4000:]
    assert output.count("losses:") == 1, "the results are printed by rank 0 only"


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]


def test_resume_offload_example_continues_bitwise(tmp_path):
    script = str(ROOT / "examples" / "resume_offload.py")
    work = tmp_path / "run"
    _run(_torchrun() + [script, "--workdir", str(work), "--steps", "6", "--save-at", "3", "--out", str(tmp_path / "full.json")], tmp_path)
    output = _run(_torchrun() + [script, "--workdir", str(work), "--steps", "6", "--resume", "--out", str(tmp_path / "res.json")], tmp_path)
    _assert_quiet_and_printed_once(output)  # its StatefulDataLoader warned about torch's set_vital on every rank
    full = json.loads((tmp_path / "full.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "res.json").read_text())
    assert resumed["start"] == 3 and len(full) == 6
    assert resumed["losses"] == full[3:]


def test_save_offloaded_example_reloads_bitwise(tmp_path):
    out = tmp_path / "s.json"
    _run([sys.executable, str(ROOT / "examples" / "save_offloaded.py"), "--out", str(out)], tmp_path)
    summary = json.loads(out.read_text())
    assert summary["placements"] == ["cpu", "disk"]
    assert summary["stage_status"] == "ran" and summary["shards"] > 1 and summary["mismatched"] == []


def test_config_then_plugin_launcher_runs_the_fsdp2_example_with_the_configured_stages(tmp_path):
    cfg = tmp_path / "f.yaml"
    stages = "meta_placement,shard,rank0_distribute,buffer_init,atomic_checkpoint"
    _run([sys.executable, "-m", "accelerate_memsafe.cli.main", "config", "--non-interactive", "--stages", stages,
          "--bucket-bytes", "1MiB", "-o", str(cfg)], tmp_path)
    report = tmp_path / "report.json"
    # no --num_machines / --mixed_precision / --dynamo_backend: the launcher passes accelerate's defaults itself,
    # so accelerate does not warn that they were not passed
    output = _run([sys.executable, "-m", "accelerate_memsafe.cli.main", "launch", "--memsafe_config", str(cfg),
                   "--num_processes", "2", "--main_process_port", str(free_port()),
                   str(ROOT / "examples" / "fsdp2_train.py"), "--report", str(report), "--out", str(tmp_path / "run.json")],
                  tmp_path)
    _assert_quiet_and_printed_once(output)
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["distributed_type"] == "DistributedType.FSDP" and run["world_size"] == 2
    assert run["stages"]["prepare"] == ["meta_placement", "shard", "rank0_distribute", "buffer_init"]
    assert run["stages"]["load_state"] == ["atomic_checkpoint"]
    records = json.loads(report.read_text())["records"]
    ran = {(r["stage"], r["rank"]) for r in records if r["status"] == "ran"}
    for stage in ("meta_placement", "shard", "buffer_init", "atomic_checkpoint"):
        assert {(stage, 0), (stage, 1)} <= ran, stage
    # the example loads with transformers on every rank, on the CPU: every rank maps the same unmodified checkpoint,
    # so the weights stay in place and rank0_distribute has nothing to send
    for rank in (0, 1):
        placement = next(r for r in records if r["stage"] == "meta_placement" and r["rank"] == rank)
        dist = next(r for r in records if r["stage"] == "rank0_distribute" and r["rank"] == rank)
        assert placement["details"]["in_place"] is True, placement
        assert dist["status"] == "skipped", (placement, dist)
    assert run["differs_from_single_process"] == [[], []], "every rank ends with the checkpoint's weights"
    assert not {r["stage"] for r in records} & {"optimizer_cpu_reload", "peft_cpu_reload", "offloaded_save"}
