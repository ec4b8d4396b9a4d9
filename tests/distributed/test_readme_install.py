"""The README's first command (install + demo) produces the demo's report and its plot (issue 15: the base
install lacked matplotlib, so the demo printed `plot skipped`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_command(line: int) -> str:
    """Line ``line`` (1-based) of the README's first ``bash`` block, without its comment (as ``.ci/run`` reads
    line 2, the test command)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)
    assert block, "README.md has no ```bash block"
    return re.sub(r" *#.*$", "", block.group(1).splitlines()[line - 1])


def test_the_base_install_declares_matplotlib():
    """The cheap half of the check below: `pip install -e .` (no extra) pulls matplotlib, and the old `[plot]`
    extra still exists, so `pip install -e ".[plot]"` keeps working."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~\[; ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]]
    assert "matplotlib" in names, project["dependencies"]
    assert "plot" in project["optional-dependencies"]
    assert readme_command(1).split(" && ")[1:] == ["pip install -e .", "accelerate-memsafe demo"], \
        "the README's first command changed: check that it still installs the base package and runs the demo"


def _working_tree(dest: Path) -> Path:
    """A copy of the files a fresh clone would have (plus files not committed yet, not the ignored ones)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.slow  # ~2 min: a fresh venv, torch and the package installed into it, then the 2-process demo
@pytest.mark.timeout(1500)
def test_readme_first_command_on_a_fresh_venv_writes_the_report_and_the_plot(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the test copies what a fresh clone holds)")
    command = readme_command(1)
    src = _working_tree(tmp_path / "clone")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)  # no system site packages
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "-c", command], cwd=src, env=env, capture_output=True, text=True, timeout=1400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command!r} failed:\n{out[-6000:]}"
    assert "plot skipped" not in out and "Traceback" not in out, out[-6000:]
    from PIL import Image

    from accelerate_memsafe import MemoryReport

    report = MemoryReport.from_json(src / "memsafe-demo" / "report.json")
    assert {r.rank for r in report.records} == {0, 1}
    with Image.open(src / "memsafe-demo" / "report.png") as im:
        assert im.format == "PNG" and im.size[0] > 0 and im.size[1] > 0
        im.verify()
