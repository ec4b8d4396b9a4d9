"""A save into a directory that holds an older checkpoint, killed (SIGKILL) mid-way, leaves the older one
intact and loadable."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from accelerate_memsafe import save_offloaded
from accelerate_memsafe.errors import CheckpointError
from accelerate_memsafe.io import atomic
from tests.unit.test_offloaded_save import build_model, load_offloaded

ROOT = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import sys, time
    from accelerate_memsafe import save_offloaded
    from accelerate_memsafe.io import shard_writer
    from tests.unit.test_offloaded_save import build_model, load_offloaded
    from pathlib import Path

    work, target = Path(sys.argv[1]), Path(sys.argv[2])
    reference = build_model("gte", seed=1)
    reference.save_pretrained(work / "orig")
    model = load_offloaded(work / "orig", work / "offload", reference)
    real, written = shard_writer.sync_file, []

    def slow_sync_file(fd, path):
        real(fd, path)
        written.append(path)
        print("WROTE", path, flush=True)
        if len(written) == 2:
            time.sleep(120)  # killed here, with two shards of the new checkpoint on disk

    shard_writer.sync_file = slow_sync_file
    save_offloaded(model, target, max_shard_size=20_000, progress=False)
    print("FINISHED", flush=True)
    """
)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_killed_save_leaves_the_older_checkpoint_intact(tmp_path):
    old_ref = build_model("gte", seed=0)
    old_ref.save_pretrained(tmp_path / "old-src")
    old_model = load_offloaded(tmp_path / "old-src", tmp_path / "old-offload", old_ref)
    target = tmp_path / "checkpoint"
    save_offloaded(old_model, target, max_shard_size=20_000, progress=False)
    (target / "tokenizer_config.json").write_text("{}")
    before = _digest(target)

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "child"), str(target)], cwd=ROOT,
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        wrote = []
        for line in child.stdout:
            if line.startswith("WROTE"):
                wrote.append(line.split()[1])
                if len(wrote) == 2:
                    break
        assert len(wrote) == 2, "the child did not reach its second shard"
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    # The new shards went to the temporary directory, never into the checkpoint.
    assert all(Path(w).parent == atomic.temp_dir_for(target) for w in wrote)

    assert _digest(target) == before
    reloaded = type(old_ref).from_pretrained(target)
    ref = old_ref.state_dict()
    assert all(torch.equal(t, ref[k]) for k, t in reloaded.state_dict().items())
    # The leftover temporary directory is refused by readers and cleaned by the next save.
    leftover = atomic.temp_dir_for(target)
    assert leftover.exists()
    with pytest.raises(CheckpointError, match="incomplete checkpoint"):
        atomic.check_loadable(leftover)
    save_offloaded(old_model, target, max_shard_size=50_000, progress=False)
    assert not leftover.exists()
    assert (target / "tokenizer_config.json").read_text() == "{}"
