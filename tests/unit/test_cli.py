"""The command line: config -> launch variables, env, report + plot; every error as a user meets it."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from accelerate_memsafe import ConfigError, MemSafePlugin, MemoryReport, StageRecord
from accelerate_memsafe.cli.config import read_config
from accelerate_memsafe.cli.launch import build_command
from accelerate_memsafe.cli.main import main


def test_config_non_interactive_writes_a_file_that_launch_reads(tmp_path, capsys, monkeypatch):
    import accelerate.commands.config.config_args as accelerate_config

    monkeypatch.setattr(accelerate_config, "default_config_file", str(tmp_path / "no_default_config.yaml"))
    out = tmp_path / "f.yaml"
    assert main(["config", "--non-interactive", "--stages", "shard", "--bucket-bytes", "32MiB",
                 "--optimizer-offload", "--collective-timeout-s", "30", "-o", str(out)]) == 0
    plugin = read_config(out)
    assert plugin.stages == ("shard",) and plugin.bucket_bytes == 32 * 2**20
    assert plugin.optimizer_offload is True and plugin.collective_timeout_s == 30.0
    assert MemSafePlugin.from_env(plugin.to_env()) == plugin
    assert main(["launch", "--memsafe_config", str(out), "--dry-run", "--num_processes", "2", "train.py", "--lr", "1"]) == 0
    printed = capsys.readouterr().out
    assert "ACCELERATE_MEMSAFE_STAGES=shard" in printed
    assert "ACCELERATE_MEMSAFE_BUCKET_BYTES=33554432" in printed
    # without an accelerate config, accelerate's defaults are passed (it would warn that they were not)
    assert printed.strip().splitlines()[-1].endswith("--use_fsdp --fsdp_version 2 --num_machines 1 --mixed_precision no "
                                                     "--dynamo_backend no --num_processes 2 train.py --lr 1")


def test_config_interactive_asks_for_each_option(tmp_path):
    from argparse import Namespace

    from accelerate_memsafe.cli.config import settings_from_args

    answers = iter(["shard", "1MiB"] + [""] * 50)
    args = Namespace(non_interactive=False, **{f.name: None for f in MemSafePlugin.options()})
    values = settings_from_args(args, ask=lambda prompt: next(answers))
    assert values == {"stages": ("shard",), "bucket_bytes": 2**20}




def test_read_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        read_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("memsafe:\n  bucket_byts: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml has unknown key\(s\) \['bucket_byts'\]"):
        read_config(bad)


def test_launch_adds_fsdp2_only_on_cpu_multi_process_without_mode_flags():
    assert "--use_fsdp" not in build_command(["--num_processes", "2", "t.py"], has_accelerator=True)
    assert "--use_fsdp" not in build_command(["t.py"], has_accelerator=False)
    cmd = build_command(["--multi_gpu", "--num_processes", "2", "t.py"], has_accelerator=False)
    assert cmd.count("--use_fsdp") == 0
    cmd = build_command(["--num_processes=2", "t.py", "--use_fsdp"], has_accelerator=False)
    assert cmd[3:6] == ["--use_fsdp", "--fsdp_version", "2"], "flags after the script belong to the script"


def test_env_prints_versions_and_pipeline(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "- torch:" in out and "- accelerate:" in out
    assert "prepare: " in out and "shard" in out


def test_report_prints_table_and_writes_png_of_expected_size(tmp_path, capsys):
    recs = []
    for rank in (0, 1):
        for i, stage in enumerate(("shard", "accelerate.prepare")):
            t0 = i * 1.0
            recs.append(StageRecord(hook="prepare", stage=stage, rank=rank, status="ran", reason=None, wall_s=0.5,
                                    cpu_rss_peak_bytes=2**28, start_s=t0,
                                    timeline=[[t0 + k * 0.1, 2**28 + k * 2**20, 2**27 + k * 2**20] for k in range(5)]))
    path = MemoryReport(recs).to_json(tmp_path / "run.json")
    png = tmp_path / "out.png"
    assert main(["report", str(path), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| prepare | shard | 1 | ran |" in out
    from PIL import Image

    from accelerate_memsafe.memory.plot import DPI, FIG_WIDTH_IN, PANEL_HEIGHT_IN

    with Image.open(png) as im:
        assert im.format == "PNG"
        assert im.size == (int(FIG_WIDTH_IN * DPI), int(PANEL_HEIGHT_IN * 2 * DPI))



# --- errors as a user meets them (issue 15): one message naming the input and the fix, exit code 2 for bad
# usage and 1 for a failed check, no traceback unless --debug


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """Runs the command line like the `accelerate-memsafe` script: the exit code, stdout and stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture
def checkpoint(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"embed.weight": torch.zeros(64, 32), "head.weight": torch.zeros(32, 64)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_estimate_of_a_missing_checkpoint_names_it_and_what_it_needs(capsys, tmp_path):
    code, out, err = _cli(capsys, "estimate", "--num-processes", "2", str(tmp_path / "nope"))
    assert code == 2 and out == ""
    assert err.strip() == (f"accelerate-memsafe estimate: error: checkpoint {tmp_path / 'nope'} does not exist; give a "
                           "directory holding model.safetensors or model.safetensors.index.json (as `save_pretrained` writes it).")


def test_estimate_with_an_unknown_dtype_lists_the_accepted_ones(capsys, checkpoint):
    code, out, err = _cli(capsys, "estimate", "--num-processes", "2", "--dtype", "fp8", str(checkpoint))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith("accelerate-memsafe estimate: error: argument --dtype: invalid choice: 'fp8' (choose from 'fp32'")
    assert "'bf16'" in lines[0] and lines[1:] == ["  see `accelerate-memsafe estimate --help`"]


def test_estimate_exits_1_when_the_plugin_does_not_fit_the_budget(capsys, checkpoint):
    code, out, _ = _cli(capsys, "estimate", "--num-processes", "2", "--budget-bytes", "1KB", str(checkpoint))
    assert code == 1
    assert "memsafe: worst stage needs" in out and out.rstrip().endswith("the worst stage does not fit the budget.")
    # the load_state rows are a restarted job's, and the output says which load they bound
    assert "\nload_state: a restarted job's (its optimizer holds no state yet); a load into an optimizer" in out
    code, out, _ = _cli(capsys, "estimate", "--num-processes", "2", "--budget-bytes", "50MB", str(checkpoint), "--json")
    assert code == 0 and json.loads(out)["fits"]["memsafe"]["fits"] is True
    # the exit code follows the plugin's path (what a job with the plugin runs); the output says so
    peaks = {path: f["node_peak_cpu_bytes"] for path, f in json.loads(out)["fits"].items()}
    assert peaks["memsafe"] < peaks["stock"]
    code, out, _ = _cli(capsys, "estimate", "--num-processes", "2", "--budget-bytes", str(peaks["stock"] - 1), str(checkpoint))
    assert code == 0 and "stock: worst stage needs" in out and ": DOES NOT FIT" in out
    assert out.rstrip().endswith("exit code 0: with the plugin, every stage fits the budget (stock accelerate's worst stage would not).")


def test_estimate_takes_the_process_count_from_the_launch_config_or_the_environment(capsys, checkpoint, tmp_path, monkeypatch):
    import accelerate.commands.config.config_args as accelerate_config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    default = tmp_path / "default_config.yaml"
    monkeypatch.setattr(accelerate_config, "default_config_file", str(default))
    code, _, err = _cli(capsys, "estimate", str(checkpoint))
    assert code == 2 and "how many processes? Pass --num-processes N, or --config_file FILE" in err
    assert f"accelerate's default config {default} does not exist" in err
    default.write_text("compute_environment: LOCAL_MACHINE\nnum_processes: 3\n")
    code, out, _ = _cli(capsys, "estimate", str(checkpoint), "--json")
    data = json.loads(out)
    assert code == 0 and data["num_processes"] == 3 and data["num_processes_from"] == f"num_processes in accelerate's default config {default}"
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, out, _ = _cli(capsys, "estimate", str(checkpoint))
    assert code == 0 and "\n4 processes (from WORLD_SIZE in the environment)" in out
    launch = tmp_path / "launch.yaml"
    launch.write_text("num_processes: 8\n")
    code, out, _ = _cli(capsys, "estimate", str(checkpoint), "--config_file", str(launch))
    assert code == 0 and f"\n8 processes (from num_processes in {launch})" in out
    assert max(json.loads(_cli(capsys, "estimate", str(checkpoint), "--config_file", str(launch), "--json")[1])["predictions"],
               key=lambda p: p["rank"])["rank"] == 7
    code, out, _ = _cli(capsys, "estimate", str(checkpoint), "--num-processes", "2", "--config_file", str(launch))
    assert "\n2 processes (from --num-processes)" in out
    code, _, err = _cli(capsys, "estimate", str(checkpoint), "--config_file", str(tmp_path / "none.yaml"))
    assert code == 2 and f"launch config {tmp_path / 'none.yaml'} (--config_file) does not exist" in err


def test_estimate_into_a_closed_pipe_exits_quietly(checkpoint):
    """`accelerate-memsafe estimate ... | head -1`: the reader leaves after one line; no BrokenPipeError."""
    cmd = (f"set -o pipefail; {sys.executable} -m accelerate_memsafe.cli.main estimate --num-processes 2000 {checkpoint} "
           "| head -1; echo \"exit=${PIPESTATUS[0]}\"")
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert proc.stderr == ""
    first, status = proc.stdout.strip().splitlines()
    assert first.startswith(f"checkpoint {checkpoint}") and status == "exit=141"


def test_report_of_a_missing_file_says_how_to_write_one(capsys, tmp_path):
    code, out, err = _cli(capsys, "report", str(tmp_path / "missing.json"))
    assert code == 2 and out == ""
    assert err.startswith(f"accelerate-memsafe report: error: report {tmp_path / 'missing.json'} does not exist; write one "
                          "with `accelerate-memsafe demo`") and len(err.strip().splitlines()) == 1


def test_report_refuses_a_file_that_is_not_a_report(capsys, tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"rows": []}))
    code, _, err = _cli(capsys, "report", str(p))
    assert code == 2 and f"{p} is not a memsafe report: expected a JSON object with a 'records' list." in err
    p.write_text("{not json")
    code, _, err = _cli(capsys, "report", str(p))
    assert code == 2 and f"report {p} is not JSON (" in err


def test_config_with_a_bad_stage_list_names_the_flag_every_problem_and_the_fix(capsys, tmp_path):
    out = tmp_path / "f.yaml"
    code, stdout, err = _cli(capsys, "config", "--non-interactive", "--stages", "meta_placement,bogus", "-o", str(out))
    assert code == 2 and stdout == "" and not out.exists()
    lines = err.strip().splitlines()
    assert lines[0] == "accelerate-memsafe config: error: --stages 'meta_placement,bogus' is not a valid pipeline:"
    assert lines[1].startswith("  - unknown stage `bogus`. Available names: meta_placement, shard,")
    assert lines[2].startswith("  - `meta_placement` needs `shard`, `rank0_distribute` after it") and "HINT: add" in lines[2]
    assert len(lines) == 3
    code, _, err = _cli(capsys, "config", "--non-interactive", "--bucket-bytes", "lots", "-o", str(out))
    assert code == 2 and err.strip() == ("accelerate-memsafe config: error: --bucket-bytes 'lots' is not accepted; use a byte "
                                         "count or a size, e.g. 67108864, 32MB, 64MiB, 1GiB.")


def test_interactive_config_asks_again_after_a_bad_answer_with_the_accepted_formats(capsys, tmp_path, monkeypatch):
    """Typing `lots` for bucket_bytes ended the questionnaire with `--bucket-bytes='lots' is not an integer`: a flag
    the user never typed, and sizes such as 32MB are accepted."""
    out = tmp_path / "f.yaml"
    answers = ["", "lots", "32MB", "0", "3"] + [""] * 20
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(answers) + "\n"))
    code, stdout, err = _cli(capsys, "config", "-o", str(out))
    assert code == 0, err
    assert ("bucket_bytes 'lots' is not accepted; use a byte count or a size, e.g. 67108864, 32MB, 64MiB, 1GiB. "
            "Enter keeps the default.") in stdout
    assert "prefetch_buckets '0': `prefetch_buckets` must be an int >= 1, got 0. Use a whole number, e.g. 2." in stdout
    assert stdout.count("bucket_bytes [67108864]: ") == 2 and "--bucket-bytes" not in stdout + err
    plugin = read_config(out)
    assert plugin.bucket_bytes == 32 * 10**6 and plugin.prefetch_buckets == 3


def test_interactive_config_without_answers_says_to_use_flags(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    code, _, err = _cli(capsys, "config", "-o", str(tmp_path / "f.yaml"))
    assert code == 2 and "no answer for `stages` (standard input ended); give every value as a flag with --non-interactive" in err


def test_debug_shows_the_traceback_and_an_unexpected_error_is_one_line(capsys, tmp_path, monkeypatch):
    from accelerate_memsafe.cli import env_cmd
    from accelerate_memsafe.cli.errors import CliError

    for argv in (["--debug", "report", str(tmp_path / "m.json")], ["report", str(tmp_path / "m.json"), "--debug"]):
        with pytest.raises(CliError, match="does not exist"):
            main(argv)

    def boom(plugin):
        raise RuntimeError("boom")

    monkeypatch.setattr(env_cmd, "collect", boom)
    code, _, err = _cli(capsys, "env")
    assert code == 1 and err.strip() == ("accelerate-memsafe env: error: unexpected RuntimeError: boom. This is a bug: run "
                                         "again with `accelerate-memsafe --debug ...` and report the traceback.")


def test_a_demo_rank_leaves_without_teardown_only_after_its_work_succeeded(monkeypatch, tmp_path):
    """torch 2.11 aborted 1 of 68 demo runs at interpreter teardown (a gloo worker thread freeing tensors):
    a rank whose work succeeded leaves with ``os._exit(0)`` after flushing; one whose work raised does not."""
    from accelerate_memsafe.cli import demo

    exits, flushed = [], []
    monkeypatch.setattr(demo.os, "_exit", exits.append)
    monkeypatch.setattr(sys, "argv", ["demo", "--worker", "--workdir", str(tmp_path)])
    monkeypatch.setattr(sys.stdout, "flush", lambda: flushed.append("out"))
    monkeypatch.setattr(demo, "_worker", lambda workdir, steps: None)
    demo._worker_main()
    assert exits == [0] and "out" in flushed

    def fails(workdir, steps):
        raise RuntimeError("rank 1 failed")

    monkeypatch.setattr(demo, "_worker", fails)
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        demo._worker_main()
    assert exits == [0]
