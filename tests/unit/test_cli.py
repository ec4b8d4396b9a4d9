"""The command line: config -> launch variables, env, report + plot."""

from __future__ import annotations

import json

import pytest

from accelerate_memsafe import ConfigError, MemSafePlugin, MemoryReport, PipelineError, StageRecord
from accelerate_memsafe.cli.config import read_config
from accelerate_memsafe.cli.launch import build_command
from accelerate_memsafe.cli.main import main


def test_config_non_interactive_writes_a_file_that_launch_reads(tmp_path, capsys):
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
    assert printed.strip().splitlines()[-1].endswith("--use_fsdp --fsdp_version 2 --num_processes 2 train.py --lr 1")


def test_config_interactive_asks_for_each_option(tmp_path):
    from argparse import Namespace

    from accelerate_memsafe.cli.config import settings_from_args

    answers = iter(["shard", "1MiB"] + [""] * 50)
    args = Namespace(non_interactive=False, **{f.name: None for f in MemSafePlugin.options()})
    values = settings_from_args(args, ask=lambda prompt: next(answers))
    assert values == {"stages": ("shard",), "bucket_bytes": 2**20}


def test_config_rejects_a_bad_pipeline_before_writing(tmp_path):
    out = tmp_path / "f.yaml"
    with pytest.raises(PipelineError, match="unknown stage `nope`"):
        main(["config", "--non-interactive", "--stages", "nope", "-o", str(out)])
    assert not out.exists()


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


def test_report_refuses_a_file_that_is_not_a_report(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a memsafe report"):
        main(["report", str(p)])
