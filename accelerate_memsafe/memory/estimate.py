"""Predict each stage's peak memory per rank from checkpoint headers only (no tensor data is read).

The formulas follow what each path does (see docs/prepare.md and docs/benchmarks.md) and are checked
against the prepare benchmark by ``tests/distributed/test_estimate_vs_benchmark.py``. With N ranks,
P = model bytes in the training dtype, T = the largest tensor in the training dtype, B = ``bucket_bytes``:

=====================  ==========================================  ==========================================
path / stage           rank 0 (private memory)                      other ranks (private memory)
=====================  ==========================================  ==========================================
stock prepare          P/N (+ P if fp32 master weights are made    P/N + 2T (+ P if fp32 master weights are
                       from a lower-precision checkpoint);          made); every rank maps the whole file
                       RSS adds the whole file (mapped pages)
memsafe prepare        P/N + 1.5·B (cast copies, scatter buffers)  P/N + B/(prefetch+2) (one receive buffer)
optimizer (AdamW)      2·P/N created at the first step (on CPU with ``optimizer_offload``)
stock load_state       2·S (old and new state alive)               S = 2·P/N, the local optimizer state
memsafe load_state     S + largest state tensor/N (read in place)
=====================  ==========================================  ==========================================
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import torch

#: Bytes per element of the training dtypes the CLI accepts.
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


@dataclass(frozen=True)
class CheckpointSummary:
    """What the safetensors headers say about a checkpoint."""

    path: str
    num_tensors: int
    numel: int
    checkpoint_bytes: int
    largest_name: str
    largest_numel: int
    dtypes: dict[str, int] = field(default_factory=dict)


def summarize_checkpoint(path: str | os.PathLike) -> CheckpointSummary:
    """Reads the safetensors headers (or index + headers) of a checkpoint directory or file.

    Raises:
        CheckpointError: If no safetensors checkpoint is found or an index names a missing file.

    Example:
        >>> # summarize_checkpoint("ckpt/").numel
    """
    from ..io.safetensors_source import SafetensorsSource

    src = SafetensorsSource(path)
    try:
        numel = 0
        nbytes = 0
        largest = ("", 0)
        dtypes: dict[str, int] = {}
        for name, e in src.entries.items():
            n = 1
            for d in e.shape:
                n *= d
            numel += n
            nbytes += n * torch.empty((), dtype=e.dtype).element_size()
            dtypes[str(e.dtype).replace("torch.", "")] = dtypes.get(str(e.dtype).replace("torch.", ""), 0) + n
            if n > largest[1]:
                largest = (name, n)
        return CheckpointSummary(str(path), len(src.entries), numel, nbytes, largest[0], largest[1], dtypes)
    finally:
        src.close()


def distribute_peak_bytes(model_bytes: int, *, world_size: int, rank: int, bucket_bytes: int, prefetch_buckets: int,
                          load_source: str = "rank0", cast: bool = False) -> int:
    """Predicted private memory of ``rank0_distribute`` on one rank: its own shard plus bounded staging.

    ``load_source="rank0"``: rank 0 holds at most ``bucket_bytes`` of cast copies (measured: about 1.5x
    with the scatter buffers and allocator slack); another rank one receive buffer of
    ``bucket_bytes // (prefetch_buckets + 2)``. ``"every_rank"``: every rank reads its block straight into
    its shard, through one chunk of that size when it must cast (``cast``: file dtype != training dtype).
    ``"node"``: any rank may lead its node and stage its node's buckets, so every rank gets rank 0's bound.

    Example:
        >>> distribute_peak_bytes(400, world_size=2, rank=1, bucket_bytes=64, prefetch_buckets=2)
        216
        >>> distribute_peak_bytes(400, world_size=2, rank=0, bucket_bytes=64, prefetch_buckets=2, load_source="every_rank")
        200
    """
    shard = model_bytes // max(1, world_size)
    if load_source == "every_rank":
        return shard + (min(bucket_bytes // (prefetch_buckets + 2), shard) if cast else 0)
    if rank == 0 or load_source == "node":
        return shard + min(int(1.5 * bucket_bytes), model_bytes)
    return shard + min(bucket_bytes // (prefetch_buckets + 2), shard)


@dataclass(frozen=True)
class Prediction:
    """Predicted peak extra memory of one stage on one rank, in bytes, for one path."""

    hook: str
    stage: str
    rank: int
    path: str
    cpu_anon_bytes: int
    cpu_rss_bytes: int
    device_bytes: int


def predict(
    summary: CheckpointSummary,
    *,
    num_processes: int,
    dtype: str = "fp32",
    mixed_precision: str = "no",
    offload_optimizer: bool = False,
    bucket_bytes: int = 64 * 2**20,
    prefetch_buckets: int = 2,
    device: str = "cpu",
    load_source: str = "auto",
) -> list[Prediction]:
    """Per-stage, per-rank predictions for the stock path and for the plugin.

    Args:
        summary: From :func:`summarize_checkpoint`.
        num_processes: N, the number of ranks.
        dtype: The dtype the model is loaded in (``fp32``, ``bf16``, ``fp16``).
        mixed_precision: ``"no"`` or ``"bf16"``/``"fp16"`` (trainable weights become fp32 master weights).
        offload_optimizer: Whether optimizer state lives on CPU (``optimizer_offload=True``).
        bucket_bytes: The plugin's ``bucket_bytes``.
        prefetch_buckets: The plugin's ``prefetch_buckets``.
        device: ``"cpu"`` or ``"cuda"``: on CUDA the shards and optimizer state are device memory.
        load_source: The plugin's ``load_source``; ``"auto"`` is predicted as ``"every_rank"`` (what it
            chooses when every rank sees the checkpoint: one node, or a shared filesystem).

    Returns:
        One :class:`Prediction` per (hook, stage, rank, path).

    Example:
        >>> s = CheckpointSummary("x", 2, 2_000_000, 8_000_000, "w", 1_000_000)
        >>> [p.cpu_anon_bytes for p in predict(s, num_processes=2, load_source="rank0") if p.stage == "rank0_distribute"][:2]
        [12000000, 8000000]
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_BYTES)}.")
    n = max(1, num_processes)
    load_bytes = DTYPE_BYTES[dtype]
    upcast = mixed_precision != "no" and load_bytes != 4
    train_bytes = 4 if mixed_precision != "no" else load_bytes
    P = summary.numel * train_bytes
    T = summary.largest_numel * train_bytes
    shard = P // n
    on_device = device != "cpu"
    out: list[Prediction] = []

    def add(hook, stage, rank, path, anon, rss_extra=0, dev=0):
        if on_device:  # shards live on the device; the CPU keeps only the staging copies
            out.append(Prediction(hook, stage, rank, path, max(0, anon - shard), max(0, anon - shard) + rss_extra, dev))
        else:
            out.append(Prediction(hook, stage, rank, path, anon, anon + rss_extra, 0))

    for rank in range(n):
        # stock accelerate: upcast on every rank, broadcast full tensors, distribute_tensor
        up = P if upcast else 0
        if rank == 0:
            add("prepare", "accelerate.prepare", rank, "stock", shard + up, summary.checkpoint_bytes, shard + T)
        else:
            add("prepare", "accelerate.prepare", rank, "stock", shard + up + 2 * T, summary.checkpoint_bytes if not upcast else 0, shard + T)
        # the plugin: nothing before the scatter, then own shard + bounded staging
        for stage in ("meta_placement", "shard"):
            add("prepare", stage, rank, "memsafe", 0, 0, 0)
        # staging is bounded by the bucket, and cannot exceed what there is to send
        source = "every_rank" if load_source == "auto" else load_source
        peak = distribute_peak_bytes(P, world_size=n, rank=rank, bucket_bytes=bucket_bytes, prefetch_buckets=prefetch_buckets,
                                     load_source=source, cast=upcast)
        staging = min(bucket_bytes, P) if (rank == 0 and source == "rank0") or source == "node" else 0
        add("prepare", "rank0_distribute", rank, "memsafe", peak, 0, shard + staging)
        add("prepare", "buffer_init", rank, "memsafe", 0, 0, 0)
        # optimizer state (AdamW: two fp32 moments per trainable element)
        state = 2 * (summary.numel * 4) // n
        largest_state = summary.largest_numel * 4 // n
        cpu_state = offload_optimizer or not on_device
        for path, peak in (("stock", 2 * state), ("memsafe", state + largest_state)):
            stage = "accelerate.load_state" if path == "stock" else "optimizer_cpu_reload"
            if path == "stock" and offload_optimizer and on_device:
                # stock loads onto the device first (on_device) and moves afterwards
                out.append(Prediction("load_state", stage, rank, path, peak, peak, peak))
            elif cpu_state:
                out.append(Prediction("load_state", stage, rank, path, peak, peak, 0))
            else:
                out.append(Prediction("load_state", stage, rank, path, 0, 0, peak))
    return out


def node_totals(preds: list[Prediction], path: str) -> dict[tuple[str, str], tuple[int, int]]:
    """Sum over the ranks of one node of (CPU anon, device) per (hook, stage) for ``path``."""
    totals: dict[tuple[str, str], tuple[int, int]] = {}
    for p in preds:
        if p.path != path:
            continue
        cpu, dev = totals.get((p.hook, p.stage), (0, 0))
        totals[(p.hook, p.stage)] = (cpu + p.cpu_anon_bytes, max(dev, p.device_bytes))
    return totals


def to_dicts(preds: list[Prediction]) -> list[dict]:
    """JSON-ready form."""
    return [asdict(p) for p in preds]
