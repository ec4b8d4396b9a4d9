"""``benchmarks/gpu_checks.sh``, the one command a session lent a GPU runs: it must parse, and every benchmark it
calls must exist and take the options it passes (the device time of a session is 15 minutes: a typo found there
costs a rerun)."""

from __future__ import annotations

import re
import subprocess

from .bench import DIR, load_benchmark

SCRIPT = DIR / "gpu_checks.sh"


def _calls() -> list[tuple[str, list[str]]]:
    text = SCRIPT.read_text().replace("\\\n", " ")
    return [(m.group(1), m.group(2).split()) for m in re.finditer(r"benchmarks/(\w+)\.py ([^\n]*)", text)]


def test_the_script_parses_and_calls_each_device_benchmark():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    called = {name for name, _ in _calls()}
    assert called == {"peft_reload", "resume", "overhead"}, called
    assert "-m gpu" in SCRIPT.read_text()


def test_every_option_it_passes_is_one_the_benchmark_takes():
    for name, argv in _calls():
        source = (DIR / f"{name}.py").read_text()
        options = [a for a in argv if a.startswith("--")]
        assert "--device" in options and argv[argv.index("--device") + 1] == "cuda", (name, argv)
        for opt in options:
            assert re.search(rf"add_argument\(\s*\"{re.escape(opt)}\"", source), f"benchmarks/{name}.py has no {opt}"


def test_overhead_takes_the_settings_the_script_gives_it_on_a_gpu():
    overhead = load_benchmark("overhead")
    argv = dict(_calls())["overhead"]
    settings = argv[argv.index("--settings") + 1].split(",")
    assert overhead.device_problem("cuda", settings, cuda_available=True, accelerator_available=True) is None
