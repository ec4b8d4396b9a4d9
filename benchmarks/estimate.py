"""`accelerate-memsafe estimate` against what ``prepare`` measures, rank by rank and stage by stage.

For each case (a checkpoint, a setting, a number of ranks, a load source) the ranks are spawned (CPU gloo,
FSDP2), load the checkpoint with ``accelerate_memsafe.from_pretrained`` (transformers' own ``from_pretrained``
on every rank for the ``stock`` path) and ``prepare`` it with AdamW through the default plugin
(``MemSafePlugin(load_source=...)``, every other option at its default but the measuring ones; ``stages=[]`` for
``stock``). Each stage's measured figure is the plugin's own record on that rank: ``cpu_anon_peak_bytes -
cpu_anon_start_bytes`` (the peak of RssAnon, private memory, over the stage's start, sampled every 2 ms:
``memory_sample_interval_s=0.002``, five times as often as the plugin's default of 10 ms), with the heap glibc
keeps after frees handed back to the kernel before each stage (``memory_trim_heap=True``): what the stage takes
from the kernel, the figure the estimate predicts, not less where it happens to reuse memory freed before it (the
load's temporaries), which varies from run to run and hid up to a third of rank 0's figure before. The
estimate is ``accelerate-memsafe estimate CHECKPOINT --json`` with the same settings, run in this process
before the ranks start (headers and config only).

A row agrees when ``|estimated - measured| <= 25%`` of measured, or, for a stage that measures a few MiB
(interpreter and allocator noise), when it is within ``FLOOR_BYTES`` (4 MiB); the table says which rule
decided. The floor is below 25% of every stage that moves weights here, so it never decides those.

Cases (``--cases``, comma-separated; default: the matrix and ``moe-small-bf16-4``):

* ``moe-bf16-4`` / ``-rank0`` / ``-stock``: a Qwen3-MoE (fused experts, 10 per layer, so FSDP2 pads their
  dim 0 on 4 ranks; 73 M parameters), bf16 checkpoint, ``mixed_precision="bf16"`` (fp32 master weights),
  4 ranks, ``load_source`` ``auto`` / ``rank0`` / stock accelerate.
* ``llama-fp32-2`` / ``-rank0`` / ``-stock``: a Llama (``250m``), fp32, 2 ranks.
* ``moe-small-bf16-4``: a smaller Qwen3-MoE, the case the default test suite runs.
* ``moe-small-bf16-hsdp4`` / ``-stock``: the smaller Qwen3-MoE on HSDP 2 × 2 (``ParallelismConfig(dp_replicate_size=2,
  dp_shard_size=2)``): each rank holds half of every weight, not a quarter.
* ``moe-small-bf16-tp4``: the same on FSDP 2 × TP 2 (``dp_shard_size=2, tp_size=2``), where the ``shard`` stage declines
  Qwen3-MoE's TP plan (styles torch has no counterpart of) and FSDP shards over ``dp_shard`` only: half again.
* ``llama-fp32-tp4``: a Llama (``100m``) on FSDP 2 × TP 2 with its TP plan applied, where the estimate takes each
  rank's block as 1/4 of every weight (the norms, left whole by the plan, are held 1/2).
* ``moe-small-bf16-cp4`` / ``-stock``: the same on FSDP 2 × CP 2 (``dp_shard_size=2, cp_size=2``): accelerate shards over
  the flattened ``dp_shard_cp`` dimension, a quarter of every weight per rank, which the estimate (no ``cp`` flag) takes
  from the 4 processes.
* ``moe-small-bf16-4-resume`` / ``-stock``, ``llama-fp32-2-resume`` / ``-stock``: a resume. One launch prepares, trains a
  step and saves (``save_state``); fresh processes prepare again and ``load_state`` it into an optimizer with no state
  yet, as a restarted job does. Compared: the plugin's ``optimizer_cpu_reload`` (its ``accelerate.load_state`` loads
  the model and the rest, which the estimate does not model) and stock's ``accelerate.load_state``.
* ``moe-small-bf16-4-reload`` / ``-stock``, ``llama-fp32-2-reload`` / ``-stock``: a load into an optimizer that holds
  its state: one launch prepares, trains a step, saves and loads that state back (a rollback, or an evaluation of a
  checkpoint in the process that wrote it). Both paths read in place; the estimate, a restarted job's, is checked as an
  upper bound (rule ``bound``), stage by stage and for the whole hook (the plugin's model load beside its stage
  included).
* ``trivial-*``: the ``tiny`` Llama (107 k parameters) on which the estimate's fixed overheads were measured
  once (``FULLY_SHARD_OVERHEAD``, ``DISTRIBUTE_OVERHEAD`` in ``accelerate_memsafe/memory/estimate.py``);
  not part of the default matrix.

Prints one JSON line; ``--markdown FILE`` appends the tables (model, setting, load source, ranks, rank, stage,
estimated MiB, measured MiB, ratio, the rule that decided; then the counts per rule and the lowest and highest
ratio of the weight-moving rows: ``rank0_distribute`` and stock's ``accelerate.prepare``).

    python benchmarks/estimate.py --markdown /tmp/estimate.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from prepare import MIB, spawn

#: Stages whose figures are compared (the plugin's prepare stages and accelerate's own call; for a resume, the
#: optimizer's reload, and accelerate's own load_state, which the estimate predicts for stock only: with the plugin it
#: loads everything but the optimizer, which the estimate does not model).
STAGES = ("meta_placement", "shard", "rank0_distribute", "buffer_init", "accelerate.prepare", "optimizer_cpu_reload",
          "accelerate.load_state")
#: Relative tolerance of the comparison.
TOLERANCE = 0.25
#: Absolute resolution of the comparison, in bytes: a stage within this of its measurement agrees whatever
#: the ratio (a stage that moves no weights measures a few MiB of interpreter and allocator noise).
FLOOR_BYTES = 4 * MIB
#: The plugin's sampling interval while measuring: five times as often as its default (10 ms).
MEASURE_INTERVAL_S = 0.002

#: Qwen3-MoE shapes: (hidden, moe_intermediate, layers, heads, kv_heads, head_dim, experts, vocab).
MOE_SIZES = {
    "moe": (512, 384, 6, 8, 4, 64, 10, 32000),
    "moe-small": (256, 256, 4, 4, 2, 64, 10, 16000),
}
SETTINGS = {"fp32": ("float32", "no"), "bf16": ("bfloat16", "bf16")}


@dataclass(frozen=True)
class Case:
    """One measured configuration."""

    name: str
    model: str
    setting: str
    ranks: int
    load_source: str
    path: str = "memsafe"
    dp_replicate: int = 1
    tp: int = 1
    cp: int = 1
    """accelerate's ``cp_size``: FSDP shards over the flattened ``dp_shard_cp`` dimension, so the estimate, which has no
    flag for it, takes the processes the other sizes leave as the shard degree."""
    hook: str = "prepare"
    """``"load_state"``: a resume, measured in fresh processes that load the state another launch saved."""
    held: bool = False
    """With ``hook="load_state"``: the load is into an optimizer that already holds its state (the same launch trains a
    step, saves, then loads), not a restarted job's."""

    @property
    def parallelism(self) -> dict:
        """accelerate's ``ParallelismConfig`` sizes (empty: FSDP over every rank)."""
        if self.dp_replicate == 1 and self.tp == 1 and self.cp == 1:
            return {}
        sizes = {"dp_replicate_size": self.dp_replicate,
                 "dp_shard_size": self.ranks // (self.dp_replicate * self.tp * self.cp), "tp_size": self.tp}
        return {**sizes, "cp_size": self.cp} if self.cp > 1 else sizes

    @property
    def mesh(self) -> str:
        """The mesh in the tables' words."""
        if not self.parallelism:
            return str(self.ranks)
        sizes = self.parallelism
        parts = [f"{k.removesuffix('_size')} {v}" for k, v in sizes.items() if v > 1]
        return f"{self.ranks} ({' x '.join(parts)})"


CASES = {c.name: c for c in (
    Case("moe-bf16-4", "moe", "bf16", 4, "auto"),
    Case("moe-bf16-4-rank0", "moe", "bf16", 4, "rank0"),
    Case("moe-bf16-4-stock", "moe", "bf16", 4, "auto", "stock"),
    Case("llama-fp32-2", "llama-250m", "fp32", 2, "auto"),
    Case("llama-fp32-2-rank0", "llama-250m", "fp32", 2, "rank0"),
    Case("llama-fp32-2-stock", "llama-250m", "fp32", 2, "auto", "stock"),
    Case("moe-small-bf16-4", "moe-small", "bf16", 4, "auto"),
    Case("moe-small-bf16-hsdp4", "moe-small", "bf16", 4, "auto", dp_replicate=2),
    Case("moe-small-bf16-hsdp4-stock", "moe-small", "bf16", 4, "auto", "stock", dp_replicate=2),
    Case("moe-small-bf16-tp4", "moe-small", "bf16", 4, "auto", tp=2),
    Case("llama-fp32-tp4", "llama-100m", "fp32", 4, "auto", tp=2),
    Case("moe-small-bf16-cp4", "moe-small", "bf16", 4, "auto", cp=2),
    Case("moe-small-bf16-cp4-stock", "moe-small", "bf16", 4, "auto", "stock", cp=2),
    Case("moe-small-bf16-4-resume", "moe-small", "bf16", 4, "auto", hook="load_state"),
    Case("moe-small-bf16-4-resume-stock", "moe-small", "bf16", 4, "auto", "stock", hook="load_state"),
    Case("llama-fp32-2-resume", "llama-250m", "fp32", 2, "auto", hook="load_state"),
    Case("llama-fp32-2-resume-stock", "llama-250m", "fp32", 2, "auto", "stock", hook="load_state"),
    Case("moe-small-bf16-4-reload", "moe-small", "bf16", 4, "auto", hook="load_state", held=True),
    Case("moe-small-bf16-4-reload-stock", "moe-small", "bf16", 4, "auto", "stock", hook="load_state", held=True),
    Case("llama-fp32-2-reload", "llama-250m", "fp32", 2, "auto", hook="load_state", held=True),
    Case("llama-fp32-2-reload-stock", "llama-250m", "fp32", 2, "auto", "stock", hook="load_state", held=True),
    Case("trivial-fp32-2", "llama-tiny", "fp32", 2, "auto"),
    Case("trivial-bf16-4", "llama-tiny", "bf16", 4, "auto"),
    Case("trivial-bf16-4-rank0", "llama-tiny", "bf16", 4, "rank0"),
    Case("trivial-fp32-2-stock", "llama-tiny", "fp32", 2, "auto", "stock"),
    Case("trivial-bf16-4-stock", "llama-tiny", "bf16", 4, "auto", "stock"),
)}


#: The matrix ``benchmarks/estimate.py`` runs by default (docs/benchmarks.md, "Estimate vs measured").
DEFAULT_CASES = ("moe-bf16-4", "moe-bf16-4-rank0", "moe-bf16-4-stock", "llama-fp32-2", "llama-fp32-2-rank0",
                 "llama-fp32-2-stock", "moe-small-bf16-4")


def save_moe(path: Path, size: str, *, dtype) -> Path:
    """A randomly initialised Qwen3-MoE of a named size (:data:`MOE_SIZES`), ``save_pretrained`` to ``path``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    hidden, inter, layers, heads, kv, head_dim, experts, vocab = MOE_SIZES[size]
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * inter, moe_intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                         num_experts=experts, num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).to(dtype).save_pretrained(path)
    return path


def checkpoint(cache: Path, model: str, setting: str) -> Path:
    """The case's checkpoint under ``cache`` (built once, kept for reuse)."""
    import torch

    dtype = getattr(torch, SETTINGS[setting][0])
    path = cache / f"{model}-{setting}"
    if not (path / "config.json").exists():
        if model.startswith("llama-"):
            from accelerate_memsafe.models import save_llama

            save_llama(path, model.removeprefix("llama-"), dtype=dtype)
        else:
            save_moe(path, model, dtype=dtype)
    return path


def _worker(rank: int, port: int, world: int, case: Case, ckpt: str, state: str | None, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    try:
        queue.put((rank, "ok", _run(rank, case, ckpt, state)))
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run(rank: int, case: Case, ckpt: str, state: str | None = None) -> dict:
    """One rank of ``case``: ``prepare`` measured; for a resume (``case.hook == "load_state"``), with ``state`` a
    directory: the first launch (``state`` not there yet) trains one step and saves it, the second loads it into a
    fresh optimizer (no state yet, as a restarted job has) and that ``load_state`` is measured."""
    import torch
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe
    from accelerate_memsafe import Accelerator, MemSafePlugin

    torch.set_num_threads(1)
    dtype_name, mp_name = SETTINGS[case.setting]
    dtype = getattr(torch, dtype_name)
    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
    # the measuring instrument samples every 2 ms (the plugin's default is 10 ms, see MEASURE_INTERVAL_S)
    if case.path == "stock":
        plugin = MemSafePlugin(stages=[], memory_sample_interval_s=MEASURE_INTERVAL_S, memory_trim_heap=True)
    else:
        plugin = MemSafePlugin(load_source=case.load_source, memory_sample_interval_s=MEASURE_INTERVAL_S,
                               memory_trim_heap=True)
    extra = {}
    if case.parallelism:
        from accelerate.utils import ParallelismConfig

        extra["parallelism_config"] = ParallelismConfig(**case.parallelism)
    acc = Accelerator(plugins=[plugin], fsdp_plugin=fsdp_plugin, mixed_precision=mp_name, **extra)
    _warm_up(ckpt)
    dist.barrier()
    if case.path == "stock":
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
    else:
        model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, ckpt, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = acc.prepare(model, opt)
    dist.barrier()
    if case.hook == "load_state":
        if not os.path.isdir(state):
            ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
            acc.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            opt.zero_grad()
            acc.save_state(state)
            acc.wait_for_everyone()
            if not case.held:
                return {"rank": rank, "stages": {}}
            plugin.wait_for_checkpoint()
            dist.barrier()
        acc.load_state(state)
        dist.barrier()
    stages = {}
    for r in plugin.report.records:
        if r.hook != case.hook or r.stage not in STAGES:
            continue
        measured = r.cpu_anon_peak_bytes is not None and r.cpu_anon_start_bytes is not None
        stages[r.stage] = {
            "status": r.status,
            "anon_bytes": r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes if measured else None,
            "rss_bytes": r.cpu_rss_peak_bytes - r.cpu_rss_start_bytes if measured else None,
            "wall_s": r.wall_s,
            "load_source": r.details.get("load_source"),
            "details": {k: v for k, v in r.details.items() if isinstance(v, (int, float, str))},
        }
    hooked = sorted((r for r in plugin.report.records if r.hook == case.hook and r.cpu_anon_start_bytes is not None),
                    key=lambda r: r.start_s)
    hook = {}
    if hooked:  # the whole hook: its peak of RssAnon over the RssAnon at its first record's start
        hook = {"anon_bytes": max(r.cpu_anon_peak_bytes for r in hooked) - hooked[0].cpu_anon_start_bytes,
                "rss_bytes": max(r.cpu_rss_peak_bytes for r in hooked) - hooked[0].cpu_rss_start_bytes}
    return {"rank": rank, "stages": stages, "hook": hook}


def _warm_up(ckpt: str) -> None:
    """First-use allocations of the model code (imports, dispatch caches) happen before ``prepare``, as in a
    training script that built or ran a model before: a tiny model of the same class, run once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    for key, value in (("num_hidden_layers", 1), ("vocab_size", 64), ("hidden_size", 64), ("intermediate_size", 64),
                       ("moe_intermediate_size", 32), ("num_attention_heads", 2), ("num_key_value_heads", 1),
                       ("head_dim", 32)):
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    del model


def estimate(case: Case, ckpt: Path) -> dict:
    """``accelerate-memsafe estimate CKPT --json`` for the case's settings (run in this process)."""
    from accelerate_memsafe.cli.main import main as cli

    dtype, mp_name = {"fp32": ("fp32", "no"), "bf16": ("bf16", "bf16")}[case.setting]
    argv = ["estimate", str(ckpt), "--num-processes", str(case.ranks), "--dtype", dtype, "--mixed-precision", mp_name,
            "--load-source", case.load_source, "--json", "--budget-bytes", "1TiB",
            "--dp-replicate-size", str(case.dp_replicate), "--tp-size", str(case.tp)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(argv)
    if code != 0:
        raise RuntimeError(f"`accelerate-memsafe {' '.join(argv)}` exited with {code}")
    return json.loads(out.getvalue())


def released(case: Case, ckpt: Path) -> int:
    """Bytes of private (converted) copies rank 0 frees while it scatters them (fused experts), from the same
    headers and config: how far below its estimate rank 0's ``rank0_distribute`` may measure."""
    from accelerate_memsafe.memory.estimate import (DTYPE_BYTES, layout, mesh_blocks, released_by_rank0,
                                                    summarize_checkpoint, tp_plan_declined)

    dtype, mp_name = {"fp32": ("fp32", "no"), "bf16": ("bf16", "bf16")}[case.setting]
    applied = case.tp == 1 or tp_plan_declined(ckpt, case.tp) is None
    lay = layout(summarize_checkpoint(ckpt).tensors, world_size=case.ranks, load_bytes=DTYPE_BYTES[dtype],
                 mixed_precision=mp_name, blocks=mesh_blocks(case.ranks, dp_replicate=case.dp_replicate, tp=case.tp,
                                                             tp_applied=applied))
    return released_by_rank0(lay) if case.path == "memsafe" else 0


def compare(case: Case, predicted: dict, measured: list[dict], released_bytes: int = 0) -> list[dict]:
    """One row per rank and stage that ran: estimated and measured bytes, their ratio, and which rule decided:
    ``25%``, ``floor``, ``released`` (rank 0's ``rank0_distribute`` over-estimated by no more than the private
    copies it frees, ``released_bytes``: not within the acceptance, reported as such), or ``NO``. A stage that ran
    without a prediction is a row that does not agree.

    A load into held state (``case.held``) is not what the estimate models (a restarted job's, whose optimizer holds
    no state): its figure is an upper bound there, and the rule is ``bound`` (estimated >= measured) or ``NO``; each rank
    gets a second row, ``whole hook``, against the same bound: the hook's peak over its start, the plugin's model load
    beside its stage included."""
    preds = {(p["stage"], p["rank"]): p for p in predicted["predictions"] if p["path"] == case.path and p["hook"] == case.hook}
    used = next((m["load_source"] for run in measured for st, m in run["stages"].items() if m.get("load_source")), None)
    if case.hook == "prepare":
        source = "stock accelerate" if case.path == "stock" else f"{case.load_source} ({used})"
    else:
        source = f"{'reload (state held)' if case.held else 'resume'}: {'stock accelerate' if case.path == 'stock' else 'plugin'}"
    rows = []
    for run in measured:
        figures = [(stage, run["stages"].get(stage), preds.get((stage, run["rank"]))) for stage in STAGES]
        if case.held and run.get("hook"):
            own = "accelerate.load_state" if case.path == "stock" else "optimizer_cpu_reload"
            figures.append(("whole hook", {"status": "ran", **run["hook"]}, preds.get((own, run["rank"]))))
        for stage, m, p in figures:
            if m is None or m["status"] != "ran" or m["anon_bytes"] is None:
                continue
            if p is None and case.hook != "prepare":
                continue  # accelerate's own load_state beside the plugin's stage: loads what the estimate does not model
            got = max(0, m["anon_bytes"])
            est = p["cpu_anon_bytes"] if p is not None else None
            if est is None:
                within = "NO"
            elif case.held:
                within = "bound" if est >= got else "NO"
            elif abs(est - got) <= TOLERANCE * got:
                within = "25%"
            elif abs(est - got) <= FLOOR_BYTES:
                within = "floor"
            elif stage == "rank0_distribute" and run["rank"] == 0 and 0 <= est - got <= released_bytes:
                within = "released"
            else:
                within = "NO"
            rows.append({
                "case": case.name, "model": case.model, "setting": case.setting, "ranks": case.ranks, "mesh": case.mesh,
                "load_source": source, "path": case.path, "rank": run["rank"], "stage": stage,
                "estimated_mib": None if est is None else est / MIB, "measured_mib": got / MIB,
                "ratio": est / got if est is not None and got else None, "within": within,
                "agrees": within in ("25%", "floor", "bound"), "released_mib": released_bytes / MIB,
            })
    return rows


_SETTING = {"fp32": "fp32", "bf16": "bf16 + mixed precision"}


def markdown(doc: dict) -> str:
    lines = [
        f"\n`accelerate-memsafe estimate` vs the measured RssAnon peak over each stage's start, per rank "
        f"({doc['timestamp']}): agrees when |estimated - measured| <= 25% of measured (`25%`), or <= "
        f"{doc['floor_mib']:.0f} MiB (`floor`, for a stage that measures a few MiB); `released`: rank 0 measured "
        "below the estimate by more than 25% but by no more than the private copies it frees while sending them "
        "(not within the acceptance)"
        + ("; `bound`: a load into an optimizer that holds its state, which the estimate (a restarted job's) bounds "
           "from above, stage by stage and for the whole hook" if any(r["within"] == "bound" for r in doc["rows"]) else "")
        + ":\n",
        "| model | setting | load source | ranks | rank | stage | estimated MiB | measured MiB | ratio | within |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        est = "-" if r["estimated_mib"] is None else f"{r['estimated_mib']:.1f}"
        within = f"released (<= {r['released_mib']:.1f})" if r["within"] == "released" else r["within"]
        ranks = r.get("mesh", r["ranks"])
        lines.append(f"| {r['model']} | {_SETTING[r['setting']]} | {r['load_source']} | {ranks} | {r['rank']} | "
                     f"{r['stage']} | {est} | {r['measured_mib']:.1f} | {ratio} | {within} |")
    s = doc["summary"]
    lines += [
        "",
        "| rows | within 25% | within the floor only | over by no more than rank 0's released copies | not within | "
        "weight-moving rows | weight-moving rows within 25% | lowest ratio | highest ratio |"
        + (" bounded from above (state held) |" if s["bound"] else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if s["bound"] else ""),
        f"| {s['rows']} | {s['within_25']} | {s['floor_only']} | {s['released']} | {s['not_within']} | {s['moving_rows']} | "
        f"{s['moving_within_25']} | "
        f"{_ratio(s['moving_ratio_min'])} | {_ratio(s['moving_ratio_max'])} |" + (f" {s['bound']} |" if s["bound"] else ""),
    ]
    return "\n".join(lines) + "\n"


def _ratio(x: float) -> str:
    """A ratio of the summary, ``-`` where no row gave one (NaN)."""
    return "-" if x != x else f"{x:.2f}"


def _moves_state(row: dict) -> bool:
    """Whether the row's stage moves the weights or the optimizer state: ``rank0_distribute`` and
    ``optimizer_cpu_reload``, and stock's ``accelerate.prepare`` and ``accelerate.load_state``."""
    if row["stage"] in ("rank0_distribute", "optimizer_cpu_reload"):
        return True
    return row["path"] == "stock" and row["stage"] in ("accelerate.prepare", "accelerate.load_state")


def summarize(rows: list[dict]) -> dict:
    """Counts per rule, and the range of the ratios of the stages that move weights (``rank0_distribute``, stock's
    ``accelerate.prepare``), the rows of a load into held state left out (``bound``: the estimate is an upper bound
    there, counted apart)."""
    moving_rows = [r for r in rows if r["ratio"] is not None and _moves_state(r) and r["within"] != "bound"]
    moving = [r["ratio"] for r in moving_rows]
    return {
        "moving_within_25": sum(r["within"] == "25%" for r in moving_rows),
        "rows": len(rows), "within_25": sum(r["within"] == "25%" for r in rows),
        "floor_only": sum(r["within"] == "floor" for r in rows), "released": sum(r["within"] == "released" for r in rows),
        "not_within": sum(r["within"] == "NO" for r in rows), "bound": sum(r["within"] == "bound" for r in rows),
        "moving_rows": len(moving), "moving_ratio_min": min(moving, default=float("nan")),
        "moving_ratio_max": max(moving, default=float("nan")),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    parser.add_argument("--cache-dir", default=None, help="where the checkpoints are built (kept for reuse)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--markdown", default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    cache = Path(args.cache_dir or os.path.join(tempfile.gettempdir(), "memsafe-bench-estimate"))
    cache.mkdir(parents=True, exist_ok=True)
    doc: dict = {
        "benchmark": "estimate", "tolerance": TOLERANCE, "floor_mib": FLOOR_BYTES / MIB,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python benchmarks/estimate.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "rows": [],
    }
    for name in names:
        case = CASES[name]
        ckpt = checkpoint(cache, case.model, case.setting)
        predicted = estimate(case, ckpt)
        if case.hook == "load_state" and case.held:  # one launch saves a step's state and loads it back
            with tempfile.TemporaryDirectory(prefix="memsafe-estimate-reload-") as work:
                state = os.path.join(work, "state")
                measured = spawn(_worker, case.ranks, (case.ranks, case, str(ckpt), state), args.timeout, name)
        elif case.hook == "load_state":  # one launch saves a step's state, fresh processes load it (a restarted job)
            with tempfile.TemporaryDirectory(prefix="memsafe-estimate-resume-") as work:
                state = os.path.join(work, "state")
                spawn(_worker, case.ranks, (case.ranks, case, str(ckpt), state), args.timeout, f"{name} (save)")
                measured = spawn(_worker, case.ranks, (case.ranks, case, str(ckpt), state), args.timeout, name)
        else:
            measured = spawn(_worker, case.ranks, (case.ranks, case, str(ckpt), None), args.timeout, name)
        doc["rows"] += compare(case, predicted, measured, released(case, ckpt))
        doc.setdefault("measured", {})[name] = measured
    doc["summary"] = summarize(doc["rows"])
    doc["all_agree"] = bool(doc["rows"]) and all(r["agrees"] for r in doc["rows"])
    print(json.dumps(doc))
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write(markdown(doc))
    return doc


if __name__ == "__main__":
    main()
