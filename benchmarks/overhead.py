"""What the default plugin costs a training loop: ``prepare``, ``save_state`` and ``load_state`` walls with
``accelerate.Accelerator`` (stock) and with ``accelerate_memsafe.Accelerator(plugins=[MemSafePlugin()])`` as a
user writes it (the default: every stage, the live-tensor tracker and the 2 ms memory sampler on), and with
the tracker off, same process type, same model, same data.

Each path runs in a fresh process: a Llama of ``--size`` (fp32), AdamW, one training step, ``prepare``, then
``--repeats`` rounds of ``save_state`` (each into a new directory) and ``load_state``; the best round is
reported. Prints one JSON line; ``--markdown FILE`` appends a table with the ratios to stock.

    python benchmarks/overhead.py --size 100m --markdown docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

PATHS = ("stock", "default", "no_tracker")


def _run(path: str, size: str, repeats: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from accelerate_memsafe.models import llama_config

    torch.manual_seed(0)
    torch.set_num_threads(1)
    if path == "stock":
        from accelerate import Accelerator

        acc = Accelerator()
    else:
        from accelerate_memsafe import Accelerator, MemSafePlugin

        acc = Accelerator(plugins=[MemSafePlugin() if path == "default" else MemSafePlugin(track_live_tensors=False)])
    model = LlamaForCausalLM(llama_config(size))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    model, opt = acc.prepare(model, opt)
    prepare_s = time.perf_counter() - t0
    ids = torch.randint(0, model.config.vocab_size, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    saves, loads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(repeats):
            target = os.path.join(tmp, f"ckpt{k}")
            t0 = time.perf_counter()
            acc.save_state(target)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            acc.load_state(target)
            loads.append(time.perf_counter() - t0)
    return {"path": path, "prepare_s": prepare_s, "save_state_s": min(saves), "load_state_s": min(loads)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_run(args.child, args.size, args.repeats)))
        return {}
    runs = {}
    for path in PATHS:
        out = subprocess.run([sys.executable, __file__, "--size", args.size, "--repeats", str(args.repeats), "--child", path],
                             capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        runs[path] = json.loads(out.stdout.strip().splitlines()[-1])
    doc = {"benchmark": "overhead", "size": args.size, "repeats": args.repeats, "runs": runs,
           "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "ratios": {p: {k: runs[p][k] / runs["stock"][k] for k in ("prepare_s", "save_state_s", "load_state_s")}
                      for p in PATHS if p != "stock"}}
    print(json.dumps(doc))
    if args.markdown:
        lines = [f"\noverhead of the default plugin, Llama `{args.size}` fp32, 1 process, best of {args.repeats} "
                 f"({doc['timestamp']}):\n", "| path | prepare (s) | save_state (s) | load_state (s) | prepare ÷ stock | "
                 "save_state ÷ stock | load_state ÷ stock |", "|---|---|---|---|---|---|---|"]
        for p in PATHS:
            r, q = runs[p], doc["ratios"].get(p, {"prepare_s": 1, "save_state_s": 1, "load_state_s": 1})
            lines.append(f"| {p} | {r['prepare_s']:.3f} | {r['save_state_s']:.3f} | {r['load_state_s']:.3f} | "
                         f"{q['prepare_s']:.2f} | {q['save_state_s']:.2f} | {q['load_state_s']:.2f} |")
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return doc


if __name__ == "__main__":
    main()
