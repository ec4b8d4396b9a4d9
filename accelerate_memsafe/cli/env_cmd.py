"""``accelerate-memsafe env``: versions and the effective settings (like ``accelerate env``)."""

from __future__ import annotations

import argparse
import platform


def add_parser(sub) -> None:
    p = sub.add_parser("env", help="print versions, the effective plugin settings and the stage pipeline")
    p.add_argument("--memsafe_config", "--memsafe-config", dest="memsafe_config", help="read settings from this file")
    p.set_defaults(run=run)


def collect(plugin) -> dict:
    import importlib.metadata as md

    import torch

    versions = {}
    for pkg in ("accelerate-memsafe", "torch", "accelerate", "transformers", "peft", "safetensors", "torchdata"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "cuda_available": torch.cuda.is_available(),
        "settings": {k: v for k, v in plugin.to_env().items()},
        "pipeline": {hook: list(plugin.stage_names(hook)) for hook in ("prepare", "load_state", "save_state", "save_model")},
    }


def run(args: argparse.Namespace) -> int:
    from ..plugin import MemSafePlugin
    from .config import read_config

    plugin = read_config(args.memsafe_config) if args.memsafe_config else MemSafePlugin.from_env()
    info = collect(plugin)
    print("- platform:", info["platform"])
    print("- python:", info["python"])
    for k, v in info["versions"].items():
        print(f"- {k}: {v}")
    print("- CUDA available:", info["cuda_available"])
    print("\nEffective settings (as ACCELERATE_MEMSAFE_* variables):")
    for k, v in info["settings"].items():
        print(f"  {k}={v}")
    print("\nPipeline:")
    for hook, names in info["pipeline"].items():
        print(f"  {hook}: {' -> '.join(names) or '(none)'}")
    return 0
