"""Reloading PEFT adapters: peft's ``load_adapter`` (the Trainer's call) vs the plugin's CPU-first
``reload_adapters``, same run, same model, same files.

A Llama of ``--size`` gets LoRA adapters on every linear layer (one adapter per ``--ranks`` entry: the
first is ``default``, the others ``a1``, ``a2``...), saved with peft's ``save_pretrained``; the adapter
weights are then perturbed and reloaded by each path in turn (``malloc_trim`` and device cache emptied
between phases). Both paths must restore the saved weights bitwise (checked). Per path:

- ``live_tensor_peak_bytes``: the dispatch-level tracker's peak above the phase's baseline.
- ``held_bytes`` (peft only): bytes of the adapter state dict that ``load_peft_weights`` returns, all
  alive at once on the load device while ``set_peft_model_state_dict`` copies it (measured by wrapping
  that function; safetensors' ``load_file`` builds tensors the dispatch tracker only partly sees).
- ``rss_peak_over_baseline`` / ``anon_peak_over_baseline``: sampled every 2 ms (plus VmHWM).
- ``device_peak_over_baseline``: ``max_memory_allocated`` minus allocated at the start (CUDA only).

Like the Trainer, peft's path passes no ``torch_device`` (peft infers ``cuda`` when present).
Prints one JSON line; ``--markdown FILE`` appends a table row per path.

    python benchmarks/peft_reload.py --size 100m --ranks 64,32 --markdown docs/benchmarks.md
    python benchmarks/peft_reload.py --quick            # tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="100m", help="model size (accelerate_memsafe.models.SIZES)")
    p.add_argument("--ranks", default="64,32", help="LoRA rank of each adapter, comma-separated")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu", help="where the model lives (cpu, cuda)")
    p.add_argument("--quick", action="store_true", help="tiny model, ranks 16,8 (a smoke run)")
    p.add_argument("--markdown", help="append a markdown table to this file")
    return p.parse_args()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def build(size: str, ranks: list[int], device: str):
    import torch
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(build_llama(size), LoraConfig(r=ranks[0], target_modules="all-linear", init_lora_weights=False))
        for i, r in enumerate(ranks[1:], 1):
            model.add_adapter(f"a{i}", LoraConfig(r=r, target_modules="all-linear", init_lora_weights=False))
    return model.to(torch.device(device))


def adapter_names(model) -> list[str]:
    return list(model.peft_config)


def adapter_params(model) -> dict:
    return {n: p for n, p in model.named_parameters() if ".lora_" in n}


def perturb(model) -> None:
    import torch

    with torch.no_grad():
        for p in adapter_params(model).values():
            p.add_(1.0)


def peft_path(model, ckpt: Path) -> None:
    for name in adapter_names(model):
        folder = ckpt if name == "default" else ckpt / name
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.load_adapter(str(folder), name)  # no torch_device: what the Trainer does


def plugin_path(model, ckpt: Path) -> None:
    from accelerate_memsafe.integrations.peft import reload_adapters

    reload_adapters(model, ckpt)


def measure(fn, model, ckpt: Path, device: str) -> dict:
    import peft.peft_model
    import torch

    from accelerate_memsafe.integrations.peft import empty_device_caches
    from accelerate_memsafe.memory.probe import MemoryProbe
    from accelerate_memsafe.memory.procfs import malloc_trim

    perturb(model)
    empty_device_caches()
    malloc_trim()
    held: list[int] = []
    original = peft.peft_model.load_peft_weights

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        held.append(sum(t.numel() * t.element_size() for t in out.values()))
        return out

    peft.peft_model.load_peft_weights = spy
    device_start = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    try:
        with MemoryProbe(torch.device(device), track_tensors=True) as probe:
            fn(model, ckpt)
    finally:
        peft.peft_model.load_peft_weights = original
    r = probe.result
    out = {
        "wall_s": round(r.wall_s, 4),
        "live_tensor_peak_bytes": r.live_tensor_peak_bytes,
        "rss_peak_over_baseline": (r.cpu_rss_peak_bytes - r.cpu_rss_start_bytes) if r.cpu_rss_peak_bytes else None,
        "anon_peak_over_baseline": (r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes) if r.cpu_anon_peak_bytes else None,
    }
    if held:
        out["held_bytes"] = max(held)
    if r.device_peak_bytes is not None:
        out["device_peak_over_baseline"] = r.device_peak_bytes - device_start
    return out


def main() -> dict:
    import torch

    from accelerate_memsafe.integrations.peft import read_safetensors_header

    args = parse_args()
    size, ranks = ("tiny", [16, 8]) if args.quick else (args.size, [int(r) for r in args.ranks.split(",")])
    model = build(size, ranks, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.save_pretrained(ckpt)
        saved = {n: p.detach().to("cpu", copy=True) for n, p in adapter_params(model).items()}
        files = [ckpt / "adapter_model.safetensors"] + [ckpt / n / "adapter_model.safetensors" for n in adapter_names(model)[1:]]
        entries = [e for f in files for e in read_safetensors_header(f).values()]
        results = {}
        for label, fn in (("peft load_adapter", peft_path), ("plugin reload_adapters", plugin_path)):
            results[label] = measure(fn, model, ckpt, args.device)
            now = adapter_params(model)
            results[label]["bitwise_equal"] = all(torch.equal(now[n].cpu(), v) for n, v in saved.items())
    row = {
        "benchmark": "peft_reload",
        "size": size,
        "ranks": ranks,
        "device": args.device,
        "adapter_bytes": sum(e.nbytes for e in entries),
        "adapter_tensors": len(entries),
        "largest_tensor_bytes": max(e.nbytes for e in entries),
        "paths": results,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(row))
    if args.markdown:
        write_markdown(row, args.markdown)
    return row


def _mib(v) -> str:
    return "n/a" if v is None else f"{v / MIB:.2f}"


def write_markdown(row: dict, path: str) -> None:
    lines = [
        "",
        f"peft reload, Llama `{row['size']}` + LoRA ranks {row['ranks']} on every linear layer, device `{row['device']}`: "
        f"adapter {_mib(row['adapter_bytes'])} MiB in {row['adapter_tensors']} tensors, largest tensor "
        f"{_mib(row['largest_tensor_bytes'])} MiB ({row['time']}).",
        "",
        "| path | live tensor peak (MiB) | held at once (MiB) | RSS peak over baseline (MiB) | RssAnon peak over baseline (MiB) | device peak over baseline (MiB) | wall (s) | bitwise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in row["paths"].items():
        lines.append(
            f"| {label} | {_mib(r['live_tensor_peak_bytes'])} | {_mib(r.get('held_bytes'))} | {_mib(r['rss_peak_over_baseline'])} "
            f"| {_mib(r['anon_peak_over_baseline'])} | {_mib(r.get('device_peak_over_baseline'))} | {r['wall_s']} | {r['bitwise_equal']} |"
        )
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
