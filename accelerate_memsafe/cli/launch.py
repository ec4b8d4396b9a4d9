"""``accelerate-memsafe launch [--memsafe_config FILE] [accelerate launch args] script.py [script args]``.

Runs ``accelerate launch`` with the plugin's settings as ``ACCELERATE_MEMSAFE_*`` variables. On a machine
without an accelerator, ``--num_processes N`` (N > 1) with no distributed flag starts N processes running
FSDP2 over gloo (stock accelerate would start one process).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from .errors import CliError

_DISTRIBUTED_FLAGS = ("--use_fsdp", "--multi_gpu", "--use_deepspeed", "--use_megatron_lm", "--tpu", "--cpu", "--use_parallelism_config")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="accelerate launch with the plugin's settings (and FSDP2 over gloo on CPU-only machines)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--memsafe_config", "--memsafe-config", dest="memsafe_config", help="file written by `accelerate-memsafe config`")
    p.add_argument("--dry-run", action="store_true", help="print the command and variables instead of running")
    p.set_defaults(run=run, accepts_extra=True)


def _num_processes(argv: list[str]) -> int:
    for i, a in enumerate(argv):
        value = argv[i + 1] if a in ("--num_processes", "--num-processes") and i + 1 < len(argv) else \
            a.split("=", 1)[1] if a.startswith(("--num_processes=", "--num-processes=")) else None
        if value is not None:
            if not value.isdigit():
                raise CliError(f"--num_processes {value!r} is not a whole number; give the number of processes, e.g. 2.")
            return int(value)
    return 1


#: What ``accelerate launch`` uses for these flags when no config file gives them, and warns about ("The
#: following values were not passed to `accelerate launch` and had defaults used instead") on every run.
_ACCELERATE_DEFAULTS = {"--num_machines": "1", "--mixed_precision": "no", "--dynamo_backend": "no"}


def _given(flag: str, launch_args: list[str]) -> bool:
    names = {flag, flag.replace("_", "-")}
    return any(a.split("=", 1)[0] in names for a in launch_args)


def build_command(accelerate_args: list[str], *, has_accelerator: bool, has_config: bool = True) -> list[str]:
    """The ``accelerate launch`` command line, with FSDP2 flags added on CPU-only multi-process runs.

    Without a config file (``has_config=False``: no ``--config_file`` and no default config), the values
    accelerate would default (one machine, no mixed precision, no dynamo) are passed explicitly: the same run,
    without accelerate's warning about them.

    Example:
        >>> build_command(["--num_processes", "2", "train.py"], has_accelerator=False)[3:7]
        ['--use_fsdp', '--fsdp_version', '2', '--num_processes']
        >>> build_command(["--mixed_precision=bf16", "t.py"], has_accelerator=True, has_config=False)[3:]
        ['--num_machines', '1', '--dynamo_backend', 'no', '--mixed_precision=bf16', 't.py']
    """
    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    script_at = next((i for i, a in enumerate(accelerate_args) if a.endswith(".py") or a == "-m"), len(accelerate_args))
    launch_args = accelerate_args[:script_at]
    if not has_accelerator and _num_processes(launch_args) > 1 and not any(
        a.split("=")[0] in _DISTRIBUTED_FLAGS for a in launch_args
    ):
        cmd += ["--use_fsdp", "--fsdp_version", "2"]
    if not has_config and not _given("--config_file", launch_args):
        for flag, value in _ACCELERATE_DEFAULTS.items():
            if not _given(flag, launch_args):
                cmd += [flag, value]
    return cmd + accelerate_args


def run(args: argparse.Namespace) -> int:
    import torch

    from ..plugin import MemSafePlugin
    from .config import read_config

    if not args.extra:
        raise CliError("give a script to run: `accelerate-memsafe launch [accelerate launch arguments] script.py [its arguments]`.")
    plugin = read_config(args.memsafe_config) if args.memsafe_config else MemSafePlugin.from_env()
    env = dict(os.environ)
    env.update(plugin.to_env())
    has_acc = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    from accelerate.commands.config.config_args import default_config_file

    cmd = build_command(list(args.extra), has_accelerator=has_acc, has_config=os.path.isfile(default_config_file))
    if args.dry_run:
        for k, v in sorted(plugin.to_env().items()):
            print(f"{k}={v}")
        print(" ".join(cmd))
        return 0
    return subprocess.call(cmd, env=env)
