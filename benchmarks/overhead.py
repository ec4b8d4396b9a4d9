"""What the default plugin costs a training loop: the walls of ``prepare``, ``save_state`` and ``load_state``
with stock ``accelerate.Accelerator`` and with ``accelerate_memsafe.Accelerator(plugins=[MemSafePlugin()])`` as a
user writes it (the default: every stage, the memory sampler on (every 10 ms), the live-tensor tracker off, the
checkpoint committed in the background), on one process and on 2 gloo ranks with FSDP2 (accelerate's default plugin,
no wrap policy: ``fsdp2_2ranks``; and ``auto_wrap_policy="transformer_based_wrap"``, one group per decoder layer:
``fsdp2_tw_2ranks``), same model, same data.

Each (setting, path) runs ``--launches`` times in fresh processes: a Llama of ``--size`` (fp32, the same seed on
every rank), AdamW, ``prepare``, one training step, then ``--repeats`` rounds of ``save_state`` into a new directory
and ``load_state`` of it (the directory is deleted afterwards, untimed: no path pays for overwriting an older
checkpoint). Each figure is the best over
launches and rounds of the slowest rank's wall (every hook starts after a barrier), but for ``prepare``: there stock
issues no collective, so a rank that leaves the barrier late (gloo releases the ranks up to a few milliseconds
apart) is late in its own wall only, while the plugin's exchange and agreements make the early rank wait for it, which
the slowest wall would charge to the plugin alone. ``prepare``'s wall is therefore the same span on both paths: from
the last rank's call to the last rank's return (the ranks' ``perf_counter``, one clock on one host), the time the
training loop's first collective waits for beyond the ranks' arrival. What the training loop waits
for is the ``save_state`` call; with the background commit (``async_checkpoint=True``), the time from its return
until the checkpoint is durable and in place is measured separately (``commit_tail_s``, the training loop does
not wait for it) and waited for before ``load_state`` is timed, so no path's commit is counted in its load.

Stock on 2 ranks is ``accelerate.Accelerator(cpu=True, fsdp_plugin=...)`` with its state switched to FSDP the
way the plugin does it on a machine without an accelerator (``_compat.promote_state_to_fsdp``); nothing else of
the plugin runs. Optional extra paths (``--paths``): ``sync_commit`` (``async_checkpoint=False``: fsync, marker and
swap inside ``save_state``), ``tracker`` (``track_live_tensors=True``) and ``tracker_sync`` (both: the settings of the
previous default).

``--device cpu`` (the default) keeps the one process on the CPU also where a GPU is there; ``--device cuda`` runs the
one-process setting with the model moved to the GPU by ``prepare``, each timed call between two device
synchronizations, into tables of their own (``overhead-<size>-cuda``). The FSDP2 settings are CPU gloo ranks only.

Prints one JSON line; ``--markdown FILE`` appends a table with the ratios to stock and the wall added per hook.

``--paired``: ``prepare`` (a new model each round), then ``save_state`` and ``load_state`` (of one prepared model)
of the two paths alternated in the *same* processes, round by round (stock is accelerate's own
``Accelerator.prepare`` / ``save_state`` / ``load_state`` called on the plugin's accelerator: no stage runs). A
paired ``prepare`` is not a process's first (which the launches above measure): it shows what each path costs
once both have paid the process's one-time costs (imports, first calls). Launch-to-launch differences (the page
cache, the disk's writeback, where the allocator's memory lies) then fall on both paths alike; each round gives a
ratio of two neighbouring calls, and the table reports the median of those ratios besides the best and median
walls. A first round of both paths is not counted (a process's first prepare, save and load pay one-time costs),
and a full garbage collection runs before every timed call: Python's collector falls due with the allocations of both paths, and the plugin's stages
run with it paused, so a collection due from stock's garbage would otherwise land in the plugin's next hook (a
full collection of a transformers process takes about 0.2 s here), and the paired walls would charge one path
with the other's collections.

    python benchmarks/overhead.py --size 100m --launches 3 --repeats 3 --paths stock,default,sync_commit,tracker_sync \
        --markdown /tmp/overhead.md
    python benchmarks/overhead.py --size 1g --paired --launches 2 --repeats 4 --settings fsdp2_2ranks
    python benchmarks/overhead.py --device cuda --settings 1proc --launches 3 --repeats 2   # on a GPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from markdown_region import write_tables
from prepare import spawn  # the launcher of the sibling benchmark

HOOKS = ("prepare_s", "save_state_s", "load_state_s")
PATHS = ("stock", "default", "sync_commit", "tracker", "tracker_sync")
#: setting -> (processes, FSDP2 ``auto_wrap_policy``): accelerate's default plugin (no wrap policy: the root group, the
#: input embedding and the ``[final_norm, lm_head]`` tail) and the policy scripts use (one group per decoder layer).
SETTINGS = {"1proc": (1, None), "fsdp2_2ranks": (2, None), "fsdp2_tw_2ranks": (2, "transformer_based_wrap")}


def _accelerator(path: str, world: int, wrap: str | None = None, device: str = "cpu"):
    """The accelerator of ``path``; on one process, on ``device`` (``cpu`` also where an accelerator is there:
    ``cpu=True``), the FSDP2 settings on CPU gloo ranks."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=wrap) if world > 1 else None
    one_process = {"cpu": device == "cpu"} if fsdp_plugin is None else {}
    if path == "stock":
        import accelerate

        if fsdp_plugin is None:
            return accelerate.Accelerator(**one_process)
        from accelerate_memsafe import _compat

        acc = accelerate.Accelerator(cpu=True, fsdp_plugin=fsdp_plugin)
        _compat.promote_state_to_fsdp(fsdp_plugin)  # what the plugin does on CPU; stock would run DDP
        return acc
    from accelerate_memsafe import Accelerator, MemSafePlugin

    options = {"sync_commit": {"async_checkpoint": False}, "tracker": {"track_live_tensors": True},
               "tracker_sync": {"track_live_tensors": True, "async_checkpoint": False}}.get(path, {})
    return Accelerator(plugins=[MemSafePlugin(**options)], fsdp_plugin=fsdp_plugin, **one_process)


def _sync_device(acc) -> None:
    """Waits for the accelerator's queued work (CUDA runs asynchronously): a timed call starts and ends with none."""
    import torch

    if acc.device.type == "cuda":
        torch.cuda.synchronize(acc.device)


def _model_and_optimizer(size: str, ckpt: str | None):
    """A Llama loaded with transformers' own ``from_pretrained`` on every rank (as scripts do), or (``ckpt=None``)
    the same random weights built on every rank, and its AdamW."""
    import torch
    from transformers import LlamaForCausalLM

    from accelerate_memsafe.models import llama_config

    model = LlamaForCausalLM.from_pretrained(ckpt) if ckpt else LlamaForCausalLM(llama_config(size))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _train_step(acc, model, opt) -> None:
    """One training step on a fixed batch, so that the optimizer has state to save."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)).to(acc.device)
    acc.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()


def _run(rank: int, world: int, path: str, size: str, repeats: int, work: str, ckpt: str | None = None,
         wrap: str | None = None, device: str = "cpu") -> dict:
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    torch.set_num_threads(1)
    acc = _accelerator(path, world, wrap, device)
    sync = acc.wait_for_everyone

    cpu: dict[str, list[float]] = {"prepare_s": [], "save_state_s": [], "load_state_s": []}

    span: list[float] = []

    def timed(fn, hook):
        _sync_device(acc)
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        _sync_device(acc)
        t1 = time.perf_counter()
        cpu[hook].append(time.process_time() - c0)  # every thread of the process: the sampler's too
        span[:] = [t0, t1]
        return t1 - t0, out

    model, opt = _model_and_optimizer(size, ckpt)
    with Collections() as collections:
        prepare_s, (model, opt) = timed(lambda: acc.prepare(model, opt), "prepare_s")
    prepare_span = list(span)
    stock_work_s = _stock_work(acc, rank)
    gc_s = collections.seconds(*span)
    upstream = _upstream_span(acc, rank)
    gc_upstream_s = collections.seconds(*upstream) if upstream else None
    _train_step(acc, model, opt)
    wait = getattr(getattr(acc, "memsafe_plugin", None), "wait_for_checkpoint", lambda: None)
    saves, tails, loads = [], [], []
    for k in range(repeats):
        target = os.path.join(work, f"ckpt{k}")
        save_s, _ = timed(lambda target=target: acc.save_state(target), "save_state_s")
        t0 = time.perf_counter()
        wait()  # the background commit (rank 0), outside every timed hook
        tails.append(time.perf_counter() - t0)
        load_s, _ = timed(lambda target=target: acc.load_state(target), "load_state_s")
        saves.append(save_s)
        loads.append(load_s)
        sync()
        if rank == 0:  # untimed: no path pays for overwriting or deleting an older checkpoint in a timed hook
            shutil.rmtree(target)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return {"rank": rank, "prepare_s": prepare_s, "prepare_span": prepare_span, "prepare_stock_work_s": stock_work_s,
            "prepare_gc_s": gc_s,
            "prepare_gc_upstream_s": gc_upstream_s, "save_state_s": saves, "commit_tail_s": tails, "load_state_s": loads,
            "cpu": cpu}


class Collections:
    """Python's cyclic garbage collections while open (``gc.callbacks``): when each started and ended.

    Example:
        >>> import gc
        >>> with Collections() as c:
        ...     _ = gc.collect()
        >>> len(c.spans) == 1 and c.seconds(0.0, float("inf")) > 0
        True
    """

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.spans.append((self._start, time.perf_counter()))
            self._start = None

    def __enter__(self) -> "Collections":
        import gc

        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        import gc

        gc.callbacks.remove(self)

    def seconds(self, begin: float, end: float) -> float:
        """The collections' time inside ``[begin, end]`` (``perf_counter`` seconds)."""
        return sum(max(0.0, min(b, end) - max(a, begin)) for a, b in self.spans)


def _upstream_span(acc, rank: int) -> tuple[float, float] | None:
    """Where accelerate's own ``prepare`` call ran inside the plugin's hook (``perf_counter`` seconds, from the
    ``accelerate.prepare`` record); ``None`` for stock."""
    records = [r for r in _hook_records(acc, rank) if r.stage == "accelerate.prepare"]
    if not records:
        return None
    origin = acc.memsafe_plugin.pipeline.origin
    return origin + records[-1].start_s, origin + records[-1].start_s + records[-1].wall_s


def _hook_records(acc, rank: int, hook: str = "prepare") -> list:
    """This rank's records of the plugin's ``hook`` (none for stock: no plugin, no report)."""
    plugin = getattr(acc, "memsafe_plugin", None)
    return plugin.report.find(hook=hook, rank=rank) if plugin is not None else []


def _stock_work(acc, rank: int, since: int = 0) -> float | None:
    """The part of this rank's ``prepare`` wall that a stock ``prepare`` does too, from the plugin's report:
    accelerate's own ``prepare`` call (the ``accelerate.prepare`` record), accelerate's FSDP2 wrapping, which the
    ``shard`` stage runs in its place (``fsdp2_wrap_s``: ``fsdp2_prepare_model`` and its ``fully_shard`` calls, less
    ``own_in_wrap_s``, the plugin's group filter called from inside them), and
    freeing the unsharded weights (``unsharded_release_s``: unmapping the checkpoint's pages, about 4 ms for the
    ``100m`` model, which stock pays when it switches its optimizer to the shards). ``None`` for stock. The slowest
    rank's wall minus the largest of these over the ranks is the plugin's own time (:func:`_launch`): the preflight,
    the probes, the agreements and the stages' checks, measured inside one call, so without the launch-to-launch
    spread of comparing two walls. ``since``: only the records after the first ``since`` of this rank's ``prepare``
    records (one call of several in a process)."""
    upstream = _upstream_wall(acc, rank, "prepare", since)
    wrap = [r.details.get("fsdp2_wrap_s", 0.0) - r.details.get("own_in_wrap_s", 0.0)
            + r.details.get("unsharded_release_s", 0.0) for r in _hook_records(acc, rank)[since:]
            if r.stage == "shard" and r.status == "ran"]
    return upstream + sum(wrap) if upstream is not None else None


def _upstream_wall(acc, rank: int, hook: str, since: int) -> float | None:
    """The wall of accelerate's own ``hook`` call inside the plugin's last hook call on this rank (its
    ``accelerate.<hook>`` record among this rank's ``hook`` records after the first ``since``); ``None``: none (stock).
    """
    records = _hook_records(acc, rank, hook)[since:]
    walls = [r.wall_s for r in records if r.stage == f"accelerate.{hook}"]
    return sum(walls) if walls else None


def _run_paired(rank: int, world: int, size: str, repeats: int, work: str, ckpt: str | None,
                wrap: str | None = None, device: str = "cpu") -> dict:
    """One launch of ``--paired``: with the plugin's accelerator, rounds of ``prepare`` of a new model by each path
    (stock: accelerate's own ``Accelerator.prepare``), then the plugin prepares the model that is saved and loaded;
    after one uncounted round of both paths, each round saves and loads with both. Stock goes first in even
    rounds, the plugin in odd ones."""
    import gc

    import accelerate
    import torch
    import torch.distributed as dist

    torch.manual_seed(0)
    torch.set_num_threads(1)
    acc = _accelerator("default", world, wrap, device)
    prepares = {"stock": lambda *objs: accelerate.Accelerator.prepare(acc, *objs), "default": acc.prepare}
    out = {path: {"prepare_s": [], "prepare_span": [], "save_state_s": [], "load_state_s": [], "commit_tail_s": []}
           for path in prepares}
    # the plugin's calls: the work stock does too, measured inside the same call (its own time is the rest)
    out["default"].update(prepare_stock_work_s=[], save_state_upstream_s=[])
    span: list[float] = []

    def timed(fn) -> float:
        gc.collect()  # no path pays a collection that the other's garbage made due
        _sync_device(acc)
        acc.wait_for_everyone()
        t0 = time.perf_counter()
        fn()
        _sync_device(acc)
        t1 = time.perf_counter()
        span[:] = [t0, t1]
        return t1 - t0

    for k in range(-1, repeats):  # prepare: a new model each time, alternated likewise, round -1 not counted
        for path in (("stock", "default") if k % 2 == 0 else ("default", "stock")):
            objs = _model_and_optimizer(size, ckpt)
            since = len(_hook_records(acc, rank))
            prepare_s = timed(lambda objs=objs, path=path: prepares[path](*objs))
            if k >= 0:
                out[path]["prepare_s"].append(prepare_s)
                out[path]["prepare_span"].append(list(span))
                if path == "default":
                    out[path]["prepare_stock_work_s"].append(_stock_work(acc, rank, since))
            acc._models.clear()  # this model is done with: the accelerator holds only the next one
            acc._optimizers.clear()
            del objs
    model, opt = acc.prepare(*_model_and_optimizer(size, ckpt))
    _train_step(acc, model, opt)
    calls = {"stock": (lambda d: accelerate.Accelerator.save_state(acc, d), lambda d: accelerate.Accelerator.load_state(acc, d)),
             "default": (acc.save_state, acc.load_state)}

    for k in range(-1, repeats):  # round -1 warms both paths up, not counted (a process's first save and load pay one-time costs)
        for path in (("stock", "default") if k % 2 == 0 else ("default", "stock")):
            save, load = calls[path]
            target = os.path.join(work, f"{path}{k}")
            since = len(_hook_records(acc, rank, "save_state"))
            save_s = timed(lambda save=save, target=target: save(target))
            if k >= 0 and path == "default":
                out[path]["save_state_upstream_s"].append(_upstream_wall(acc, rank, "save_state", since))
            t0 = time.perf_counter()
            acc.memsafe_plugin.wait_for_checkpoint()  # the background commit, outside every timed hook
            tail_s = time.perf_counter() - t0
            load_s = timed(lambda load=load, target=target: load(target))
            if k >= 0:
                out[path]["save_state_s"].append(save_s)
                out[path]["commit_tail_s"].append(tail_s)
                out[path]["load_state_s"].append(load_s)
            acc.wait_for_everyone()
            if rank == 0:
                shutil.rmtree(target)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return {"rank": rank, **out}


def _worker(rank: int, port: int, world: int, path: str, size: str, repeats: int, work: str, ckpt: str | None,
            wrap: str | None, device: str, queue) -> None:
    """One rank of a launch; ``path="paired"`` runs :func:`_run_paired`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    if world == 1:
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key)
    try:
        run = _run_paired(rank, world, size, repeats, work, ckpt, wrap, device) if path == "paired" else \
            _run(rank, world, path, size, repeats, work, ckpt, wrap, device)
        queue.put((rank, "ok", run))
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _launch(world: int, path: str, size: str, repeats: int, ckpt: str | None, wrap: str | None = None,
            device: str = "cpu") -> dict:
    """One launch: per hook, the slowest rank's wall in each round, then the best round."""
    with tempfile.TemporaryDirectory(prefix="memsafe-overhead-") as work:
        ranks = spawn(_worker, world, (world, path, size, repeats, work, ckpt, wrap, device), 1800, f"{path}/{world}/{wrap}")
    spans = [r.get("prepare_span") for r in ranks]
    # from the last rank's call to the last rank's return, on both paths alike (see the top of this file)
    out = {"prepare_s": _last_call_to_last_return(spans) if all(spans) else max(r["prepare_s"] for r in ranks)}
    if all(r.get("prepare_gc_s") is not None for r in ranks):
        # the least any rank spent in Python's collector during `prepare` (what `measure` takes off the plugin's
        # own time for stock: the least, so as not to take off more than the slowest rank paid)
        out["prepare_gc_s"] = min(r["prepare_gc_s"] for r in ranks)
    if all(r.get("prepare_stock_work_s") is not None for r in ranks):
        # the ranks end the hook together (its last agreement): the slowest wall, less the most work stock would do
        out["prepare_own_s"] = out["prepare_s"] - max(r["prepare_stock_work_s"] for r in ranks)
        if all(r.get("prepare_gc_upstream_s") is not None for r in ranks):
            # the collections inside accelerate's own call count in the stock work above: the most of any rank
            out["prepare_gc_upstream_s"] = max(r["prepare_gc_upstream_s"] for r in ranks)
    for key in ("save_state_s", "commit_tail_s", "load_state_s"):
        out[key] = min(max(r[key][i] for r in ranks) for i in range(repeats))
    for key in HOOKS:  # CPU seconds of the busiest rank: less sensitive than the wall to a busy machine
        out[f"cpu_{key}"] = min(max(r["cpu"][key][i] for r in ranks) for i in range(len(ranks[0]["cpu"][key])))
    return out


def measure(size: str, paths: list[str], settings: list[str], launches: int, repeats: int, log=print,
            load: str = "checkpoint", device: str = "cpu") -> dict:
    ckpt = _checkpoint_of(size, load)  # a random-init Llama saved with save_pretrained
    runs: dict[str, dict[str, dict]] = {s: {p: {} for p in paths} for s in settings}
    prepares: dict[str, dict[str, list[float]]] = {s: {p: [] for p in paths} for s in settings}
    owns: dict[str, dict[str, list[float]]] = {s: {p: [] for p in paths} for s in settings}
    gcs: dict[str, dict[str, list[float]]] = {s: {p: [] for p in paths} for s in settings}
    owns_gc: dict[str, dict[str, list[float]]] = {s: {p: [] for p in paths} for s in settings}
    for i in range(launches):  # interleaved, so that a busy spell of the machine hits every path alike
        for setting in settings:
            world, wrap = SETTINGS[setting]
            for path in paths:
                got = _launch(world, path, size, repeats, ckpt, wrap, device)
                best = runs[setting][path]
                prepares[setting][path].append(got["prepare_s"])
                if "prepare_own_s" in got:
                    owns[setting][path].append(got["prepare_own_s"])
                if "prepare_gc_s" in got:
                    gcs[setting][path].append(got["prepare_gc_s"])
                if "prepare_gc_upstream_s" in got:
                    owns_gc[setting][path].append(got["prepare_own_s"] + got["prepare_gc_upstream_s"])
                for key, value in got.items():
                    best[key] = min(best.get(key, float("inf")), value)
                log(f"launch {i + 1}/{launches} {setting} {path}: " + ", ".join(f"{k}={v:.3f}" for k, v in got.items()))
    ratios = {s: {p: {h: runs[s][p][h] / runs[s]["stock"][h] for h in HOOKS} for p in paths if p != "stock"}
              for s in settings}
    added = {s: {p: {h: runs[s][p][h] - runs[s]["stock"][h] for h in HOOKS} for p in paths if p != "stock"}
             for s in settings}
    # one `prepare` per launch (a process's first): the median over launches besides the best
    for s in settings:
        for p in paths:
            runs[s][p]["prepare_median_s"] = statistics.median(prepares[s][p])
            runs[s][p]["prepare_all_s"] = prepares[s][p]
            if p != "stock":
                runs[s][p]["prepare_median_ratio_ci90"] = median_ratio_interval(prepares[s][p], prepares[s]["stock"])
            if owns[s][p]:
                runs[s][p]["prepare_own_median_s"] = statistics.median(owns[s][p])
                runs[s][p]["prepare_own_all_s"] = owns[s][p]
            if gcs[s][p]:
                runs[s][p]["prepare_gc_median_s"] = statistics.median(gcs[s][p])
            if owns_gc[s][p] and gcs[s]["stock"]:
                runs[s][p]["prepare_own_gc_both_sides_median_s"] = own_with_collections_on_both_sides(
                    owns_gc[s][p], gcs[s]["stock"])
    return {"benchmark": "overhead", "size": size, "load": load, "device": device, "launches": launches,
            "repeats": repeats, "runs": runs,
            "ratios": ratios, "added_s": added,
            "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def own_with_collections_on_both_sides(own_and_upstream_gc: list[float], stock_gc: list[float]) -> float:
    """The plugin's own time in ``prepare`` with Python's collector counted alike on both sides: the median over
    the plugin's launches of its own time plus the collections inside accelerate's own call (which the own time
    took off as stock work), less stock's median time in the collector during its whole ``prepare``.

    The own time takes off the stock work measured inside the plugin's hook, and there the collector is paused
    through the stages (accelerate's FSDP2 wrapping runs in the ``shard`` stage): the collections stock runs inside
    its ``fully_shard`` calls are in stock's wall but in no stock work measured, while the one collection that falls
    due when the plugin switches the collector back on is in its own time. With ``W`` the work both do, the
    plugin's wall is ``W + own' + C_plugin`` and stock's ``W + C_stock`` (``own'`` without collections), so the
    wall added is ``own + C_upstream - C_stock``: what this returns (medians, as the launches are independent).

    Example:
        >>> own_with_collections_on_both_sides([0.010, 0.012, 0.011], [0.002, 0.001, 0.0015])
        0.0095
    """
    return statistics.median(own_and_upstream_gc) - statistics.median(stock_gc)


def median_ratio_interval(values: list[float], stock: list[float], *, level: float = 0.9, resamples: int = 4000,
                          seed: int = 0) -> tuple[float, float]:
    """A bootstrap interval of ``median(values) / median(stock)`` (launches resampled with replacement, each path's
    on its own: the launches are independent processes), at ``level`` (the central 90% by default); a fixed seed,
    so the same walls give the same interval.

    Example:
        >>> lo, hi = median_ratio_interval([1.0, 1.1, 1.2], [1.0, 1.0, 1.0])
        >>> 1.0 <= lo <= 1.1 <= hi <= 1.2
        True
    """
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(values, k=len(values))) /
                    statistics.median(rng.choices(stock, k=len(stock))) for _ in range(resamples))
    cut = int(round((1 - level) / 2 * resamples))
    return ratios[cut], ratios[resamples - 1 - cut]


def _checkpoint_of(size: str, load: str) -> str | None:
    """The checkpoint every rank loads (built once, kept for reuse), or ``None`` for ``load="config"``."""
    if load != "checkpoint":
        return None
    from accelerate_memsafe.models import save_llama

    ckpt = Path(tempfile.gettempdir()) / "memsafe-bench-overhead" / f"llama-{size}"
    if not (ckpt / "config.json").exists():
        save_llama(ckpt, size)
    return str(ckpt)


def _round_wall(ranks: list[dict], path: str, hook: str, k: int) -> float:
    """Round ``k``'s wall of ``hook`` by ``path``: the slowest rank's, but ``prepare``'s from the last rank's call to the
    last rank's return (as in the launches: stock's ``prepare`` has no collective to absorb a late start)."""
    spans = [r[path].get(hook.removesuffix("_s") + "_span") for r in ranks]
    if all(spans):
        return _last_call_to_last_return([s[k] for s in spans])
    return max(r[path][hook][k] for r in ranks)


def _last_call_to_last_return(spans: list) -> float:
    """The wall from the last rank's call to the last rank's return, from each rank's ``[call, return]``
    (``perf_counter`` seconds: one clock on one host)."""
    return max(t1 for _, t1 in spans) - max(t0 for t0, _ in spans)


def _round_own(ranks: list[dict], hook: str, k: int) -> float | None:
    """Round ``k``'s own time of the plugin in ``hook``: its wall less the work stock does too, measured inside the same
    call, so without the spread between two calls. ``prepare``: the wall of :func:`_round_wall` less the most stock work
    of any rank (:func:`_stock_work`); ``save_state``: the most any rank spent outside accelerate's own call inside the
    hook (its wall less its ``accelerate.save_state`` record). ``None`` for ``load_state``, whose ``optimizer_cpu_reload``
    stage does part of accelerate's work in its place, so that no part of the call is stock's alone.

    Example:
        >>> ranks = [{"default": {"save_state_s": [0.50], "save_state_upstream_s": [0.49]}},
        ...          {"default": {"save_state_s": [0.50], "save_state_upstream_s": [0.495]}}]
        >>> round(_round_own(ranks, "save_state_s", 0), 3)
        0.01
    """
    plugin = [r["default"] for r in ranks]
    if hook == "prepare_s" and (work := _round_stock_work(ranks, k)) is not None:
        return _round_wall(ranks, "default", hook, k) - work
    if hook == "save_state_s" and all(p.get("save_state_upstream_s") for p in plugin):
        return max(p["save_state_s"][k] - p["save_state_upstream_s"][k] for p in plugin)
    return None


def _round_stock_work(ranks: list[dict], k: int) -> float | None:
    """Round ``k``'s work that stock does too inside the plugin's ``prepare`` (the most of any rank, as
    :func:`_round_own` takes off), or ``None`` without it. Set beside stock's own ``prepare`` of the same rounds, it
    shows whether running after the plugin's code changes accelerate's call: where that call runs faster inside the
    hook than alone (in one process, the plugin's code may bring back into the caches what the model's construction
    evicted, which stock's call pays for itself), the own time also counts misses that stock pays too, while the
    wall added (the plugin's wall less stock's in the same round) counts them on both sides."""
    works = [r["default"].get("prepare_stock_work_s") for r in ranks]
    return max(w[k] for w in works) if all(works) else None


def measure_paired(size: str, settings: list[str], launches: int, repeats: int, log=print,
                   load: str = "checkpoint", device: str = "cpu") -> dict:
    """``--paired``: per setting, every round's wall of each path (:func:`_round_wall`); the best and the median over all
    rounds of all launches, and the median over rounds of the plugin's wall over stock's in the same round."""
    import statistics

    ckpt = _checkpoint_of(size, load)
    rows: dict[str, dict] = {}
    for setting in settings:
        world, wrap = SETTINGS[setting]
        rounds: dict[str, dict[str, list[float]]] = {p: {h: [] for h in (*HOOKS, "commit_tail_s")}
                                                     for p in ("stock", "default")}
        owns: dict[str, list[float]] = {h: [] for h in HOOKS}
        inside: list[float] = []  # the work stock does too, measured inside the plugin's `prepare` (its own time's base)
        for i in range(launches):
            with tempfile.TemporaryDirectory(prefix="memsafe-overhead-") as work:
                ranks = spawn(_worker, world, (world, "paired", size, repeats, work, ckpt, wrap, device), 1800,
                              f"paired/{world}")
            for path, by_hook in rounds.items():
                for hook, values in by_hook.items():
                    values.extend(_round_wall(ranks, path, hook, k) for k in range(repeats))
            for hook in HOOKS:
                owns[hook].extend(own for k in range(repeats) if (own := _round_own(ranks, hook, k)) is not None)
            inside.extend(w for k in range(repeats) if (w := _round_stock_work(ranks, k)) is not None)
            log(f"launch {i + 1}/{launches} {setting}: " + ", ".join(
                f"{p} {h}={[round(v, 3) for v in rounds[p][h][-repeats:]]}" for p in rounds for h in HOOKS))
        row = {}
        for path, by_hook in rounds.items():
            for hook, values in by_hook.items():
                row[f"{path}_{hook}_best"] = min(values)
                row[f"{path}_{hook}_median"] = statistics.median(values)
        for hook in HOOKS:
            ratios = [d / s for d, s in zip(rounds["default"][hook], rounds["stock"][hook])]
            row[f"{hook}_ratio_median"] = statistics.median(ratios)
            row[f"{hook}_ratio_best"] = row[f"default_{hook}_best"] / row[f"stock_{hook}_best"]
            row[f"{hook}_added_median"] = statistics.median(
                d - s for d, s in zip(rounds["default"][hook], rounds["stock"][hook]))
            if owns[hook]:
                row[f"default_{hook}_own_median"] = statistics.median(owns[hook])
        if inside:
            row["default_prepare_s_stock_work_median"] = statistics.median(inside)
        rows[setting] = {"rounds": rounds, "own": owns, **row}
    return {"benchmark": "overhead-paired", "size": size, "load": load, "device": device, "launches": launches,
            "repeats": repeats,
            "settings": rows, "timestamp": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _table_id(prefix: str, doc: dict) -> str:
    """The table's region: ``overhead-100m`` on the CPU, ``overhead-100m-cuda`` on a GPU (neither replaces the other).

    Example:
        >>> _table_id("overhead", {"size": "100m"}), _table_id("overhead-paired", {"size": "100m", "device": "cuda"})
        ('overhead-100m', 'overhead-paired-100m-cuda')
    """
    device = doc.get("device", "cpu")
    return f"{prefix}-{doc['size']}" + ("" if device == "cpu" else f"-{device}")


def _on_device(doc: dict) -> str:
    device = doc.get("device", "cpu")
    return "" if device == "cpu" else f" on `{device}` (one process, the model moved there by `prepare`)"


def markdown_paired(doc: dict) -> str:
    """The ``--paired`` table, between ``<!-- table: overhead-paired-<size> -->`` markers."""
    lines = [f"\n<!-- table: {_table_id('overhead-paired', doc)} -->",
             f"`prepare` (a new model each time), `save_state` and `load_state` (of one prepared model) of stock "
             f"accelerate and of the default plugin alternated in the same processes, Llama `{doc['size']}` fp32 + "
             f"AdamW{_on_device(doc)}, {doc['launches']} launches x "
             f"{doc['repeats']} rounds, each launch after one uncounted round, a full garbage collection before every "
             f"timed call ({doc['timestamp']}); a wall is the slowest rank's, but `prepare`'s runs from the last "
             "rank's call to the last rank's return; the median ratio is the median over rounds of the plugin's "
             "wall over stock's in the same round, and the wall added the median over rounds of the plugin's wall "
             "less stock's in the same round. The plugin's own time is its wall less the work stock does too, "
             "measured inside the same call (`prepare`: accelerate's own call, its FSDP2 wrapping and the release "
             "of the unsharded weights, the most of any rank; `save_state`: the most any rank spent outside "
             "accelerate's own call; the collections that fall due when the plugin switches the collector back on "
             "count in it; none for `load_state`, where a stage does part of accelerate's work in its place), and, "
             "for `prepare`, that work (the base of the own time) beside stock's median `prepare`:\n",
             "| setting | hook | stock best (s) | plugin best (s) | stock median (s) | plugin median (s) | ratio of bests "
             "| median ratio | plugin commit in background, median (s) | plugin's own time, median (s) "
             "| own time / stock median (%) | wall added, median (s) | wall added / stock median (%) "
             "| stock's work inside the plugin's call, median (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting, r in doc["settings"].items():
        for hook in HOOKS:
            tail = f"{r['default_commit_tail_s_median']:.3f}" if hook == "save_state_s" else "-"
            own = r.get(f"default_{hook}_own_median")
            own_cells = f"{own:.4f} | {100 * own / r[f'stock_{hook}_median']:.1f}" if own is not None else "- | -"
            added = r.get(f"{hook}_added_median")
            added_cells = f"{added:.4f} | {100 * added / r[f'stock_{hook}_median']:.1f}" if added is not None else "- | -"
            work = r.get(f"default_{hook}_stock_work_median")
            lines.append(f"| {setting} | {hook[:-2]} | {r[f'stock_{hook}_best']:.4f} | {r[f'default_{hook}_best']:.4f} "
                         f"| {r[f'stock_{hook}_median']:.4f} | {r[f'default_{hook}_median']:.4f} "
                         f"| {r[f'{hook}_ratio_best']:.2f} | {r[f'{hook}_ratio_median']:.2f} | {tail} | {own_cells} "
                         f"| {added_cells} | {f'{work:.4f}' if work is not None else '-'} |")
    return "\n".join(lines) + "\n<!-- /table -->\n"


def markdown(doc: dict) -> str:
    """The two tables (wall, then CPU seconds), between ``<!-- table: overhead-<size> -->`` markers."""
    lines = [f"\n<!-- table: {_table_id('overhead', doc)} -->",
             f"Overhead of the plugin on the hooks a training loop waits for, Llama `{doc['size']}` fp32 + AdamW{_on_device(doc)} "
             f"({'loaded from its checkpoint by transformers on every rank' if doc.get('load') == 'checkpoint' else 'the same random weights built on every rank'}), best "
             f"of {doc['launches']} launches x {doc['repeats']} rounds ({doc['timestamp']}); a ratio is the path's figure "
             "over stock's in the same setting; a wall is the slowest rank's, but `prepare`'s is from the last rank's call to "
             "the last rank's return on both paths; `prepare` runs once per launch (a process's first), so the last six "
             "columns give its median over the launches, the 90% bootstrap interval of the ratio of medians, and the "
             "plugin's own part of its wall (the wall minus the most work any rank did that stock does "
             "too: accelerate's own `prepare` call, accelerate's FSDP2 wrapping, which the `shard` stage runs in its "
             "place, and freeing the unsharded weights; median over the launches) with its share of stock's median "
             "`prepare`; then the time in Python's garbage collector during `prepare` (the least of any rank, median "
             "over the launches) and the own time with the collector counted alike on both sides (the own time plus "
             "the collections inside accelerate's own call, less stock's median time in the collector: the plugin "
             "pauses the collector through its stages, so stock's collections inside `fully_shard` are in no stock "
             "work it measures, while the one that falls due after the stages is in its own time):\n",
             "| setting | path | prepare (s) | save_state (s) | load_state (s) | commit in background (s) | prepare ratio "
             "| save_state ratio | load_state ratio | added per hook (s): prepare / save / load | prepare, median of launches (s) "
             "| prepare median ratio | median ratio, 90% interval low | median ratio, 90% interval high "
             "| plugin's own time in prepare, median (s) | own time / stock prepare median (%) "
             "| collector in prepare, median (ms) | own time, collector on both sides (s) "
             "| own time, collector on both sides / stock prepare median (%) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for setting, by_path in doc["runs"].items():
        for path, r in by_path.items():
            q = doc["ratios"][setting].get(path)
            a = doc["added_s"][setting].get(path)
            ratio = " | ".join(f"{q[h]:.2f}" for h in HOOKS) if q else "1 | 1 | 1"
            add = " / ".join(f"{a[h]:+.3f}" for h in HOOKS) if a else "-"
            tail = f"{r['commit_tail_s']:.3f}" if path != "stock" else "-"
            median = r.get("prepare_median_s")
            stock_median = by_path["stock"].get("prepare_median_s")
            median_cells = (f"{median:.3f} | {median / stock_median:.2f}" if median is not None and stock_median
                            else "- | -")
            ci = r.get("prepare_median_ratio_ci90")
            own = r.get("prepare_own_median_s")
            median_cells += f" | {ci[0]:.2f} | {ci[1]:.2f}" if ci else " | - | -"
            median_cells += (f" | {own:.4f} | {100 * own / stock_median:.1f}" if own is not None and stock_median
                             else " | - | -")
            collector = r.get("prepare_gc_median_s")
            median_cells += f" | {1e3 * collector:.2f}" if collector is not None else " | -"
            both = r.get("prepare_own_gc_both_sides_median_s")
            median_cells += (f" | {both:.4f} | {100 * both / stock_median:.1f}" if both is not None and stock_median
                             else " | - | -")
            lines.append(f"| {setting} | {path} | {r['prepare_s']:.3f} | {r['save_state_s']:.3f} | {r['load_state_s']:.3f} "
                         f"| {tail} | {ratio} | {add} | {median_cells} |")
    lines += ["", "CPU seconds of the busiest rank's process in the hook (every thread; less sensitive than the wall to "
              "other work on the machine), best round:", "",
              "| setting | path | prepare CPU (s) | save_state CPU (s) | load_state CPU (s) | prepare CPU ratio "
              "| save_state CPU ratio | load_state CPU ratio |", "|---|---|---|---|---|---|---|---|"]
    for setting, by_path in doc["runs"].items():
        stock = by_path["stock"]
        for path, r in by_path.items():
            cpu = [r[f"cpu_{h}"] for h in HOOKS]
            ratio = " | ".join(f"{r[f'cpu_{h}'] / stock[f'cpu_{h}']:.2f}" for h in HOOKS)
            lines.append(f"| {setting} | {path} | " + " | ".join(f"{c:.3f}" for c in cpu) + f" | {ratio} |")
    return "\n".join(lines) + "\n<!-- /table -->\n"


def device_problem(device: str, settings: list[str], *, cuda_available: bool | None = None,
                   accelerator_available: bool | None = None) -> str | None:
    """Why ``--device`` cannot run ``settings`` here (``None``: it can). The FSDP2 settings are CPU gloo ranks, which the
    plugin sets up only on a machine without an accelerator (two ranks cannot share one GPU under NCCL); ``cuda`` needs
    a CUDA device.

    Example:
        >>> device_problem("cuda", ["1proc"], cuda_available=True, accelerator_available=True) is None
        True
        >>> device_problem("cuda", ["1proc", "fsdp2_2ranks"], cuda_available=True, accelerator_available=True)
        '--device cuda measures the one-process setting only (drop fsdp2_2ranks: --settings 1proc)'
    """
    import torch

    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if accelerator_available is None:  # what accelerate_memsafe.Accelerator asks before it sets up CPU FSDP2
        accelerator_available = torch.accelerator.is_available() if hasattr(torch, "accelerator") else cuda_available
    multi = [s for s in settings if SETTINGS[s][0] > 1]
    if device == "cuda":
        if multi:
            return f"--device cuda measures the one-process setting only (drop {', '.join(multi)}: --settings 1proc)"
        if not cuda_available:
            return "--device cuda: torch sees no CUDA device here"
    elif multi and accelerator_available:
        return (f"the FSDP2 settings ({', '.join(multi)}) run on CPU gloo ranks, which the plugin sets up only on a "
                "machine without an accelerator: here use --settings 1proc")
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="100m")
    parser.add_argument("--launches", type=int, default=3, help="fresh launches per (setting, path); the best counts")
    parser.add_argument("--repeats", type=int, default=3, help="save_state / load_state rounds per launch")
    parser.add_argument("--paths", default="stock,default", help=f"comma-separated, from {', '.join(PATHS)}")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, from {', '.join(SETTINGS)}")
    parser.add_argument("--markdown", default=None,
                        help="write the table into this file (replacing the region of the same id, else appended)")
    parser.add_argument("--paired", action="store_true",
                        help="save_state / load_state of stock and the plugin alternated in the same processes")
    parser.add_argument("--load", default="checkpoint", choices=("checkpoint", "config"),
                        help="the model: from_pretrained of a saved checkpoint on every rank, or built from the config")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where one process trains (cpu: also where a GPU is there); cuda: the 1proc setting only, "
                             "its tables get their own regions (overhead-<size>-cuda)")
    args = parser.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    settings = [s for s in args.settings.split(",") if s]
    unknown = [p for p in paths if p not in PATHS] + [s for s in settings if s not in SETTINGS]
    if unknown or "stock" not in paths:
        parser.error(f"unknown path/setting {unknown}, or no `stock` path to compare with")
    problem = device_problem(args.device, settings)
    if problem:
        parser.error(problem)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.paired:
        doc = measure_paired(args.size, settings, args.launches, args.repeats, log=log, load=args.load, device=args.device)
    else:
        doc = measure(args.size, paths, settings, args.launches, args.repeats, log=log, load=args.load,
                      device=args.device)
    print(json.dumps(doc))
    if args.markdown:
        log(f"{args.markdown}: " + ", ".join(write_tables(args.markdown, markdown_paired(doc) if args.paired else markdown(doc))))
    return doc


if __name__ == "__main__":
    main()
