"""The bucket plan, the bounded prefetcher and rank 0's source, single process."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from accelerate_memsafe.distributed.plan import _Sharded, plan_buckets, row_boxes, shard_rows
from accelerate_memsafe.distributed.source import Rank0Source
from accelerate_memsafe.distributed.collectives import Pending, _Waiter, _Works
from accelerate_memsafe.distributed.transport import BoundedPrefetcher, _after_send, _hand_over


@pytest.mark.parametrize("n,world", [(5, 2), (1, 2), (7, 4), (8, 4), (3, 4), (0, 2)])
def test_shard_rows_follow_torch_chunk(n, world):
    chunks = torch.arange(n).chunk(world) if n else []
    for r in range(world):
        a, b = shard_rows(n, world, r)
        expect = chunks[r].tolist() if r < len(chunks) else []
        assert list(range(a, b)) == expect


def _item(name, shape, world, dtype=torch.float32):
    return _Sharded(name, None, dtype, shape, row_boxes(shape, world))


def _tp_item(name, shape, dtype=torch.float32):
    """4 ranks, FSDP 2 x TP 2 on a row-parallel weight: (Shard(0) over dp, Shard(1) over tp)."""
    r0, r1 = shard_rows(shape[0], 2, 0), shard_rows(shape[0], 2, 1)
    c0, c1 = shard_rows(shape[1], 2, 0), shard_rows(shape[1], 2, 1)
    boxes = [((r[0], c[0]), (r[1] - r[0], c[1] - c[0])) for r in (r0, r1) for c in (c0, c1)]
    return _Sharded(name, None, dtype, shape, boxes)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_plan_covers_every_row_once_and_respects_the_budget(world):
    items = [_item("big", (301, 17), world), _item("bias", (13,), world), _item("half", (64, 8), world, torch.bfloat16), _item("one", (1, 5), world)]
    budget = 4096
    buckets = plan_buckets(items, world, budget)
    seen = {(it.name, r): [] for it in items for r in range(world)}
    for b in buckets:
        assert world * b.slot_bytes <= budget, "a bucket's scatter buffers exceed the budget"
        ends = {}
        for p in b.pieces:
            assert p.offset % 16 == 0
            assert p.offset + (p.stop - p.start) * p.item.row_bytes(p.rank) <= b.slot_bytes
            seen[(p.item.name, p.rank)].extend(range(p.start, p.stop))
            ends.setdefault(p.rank, []).append((p.offset, p.offset + (p.stop - p.start) * p.item.row_bytes(p.rank)))
        for spans in ends.values():  # pieces of one rank never overlap
            spans.sort()
            assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
    for it in items:
        for r in range(world):
            a, b = it.ranges[r]
            assert seen[(it.name, r)] == list(range(a, b)), (it.name, r)
    assert [n for b in buckets for n in b.last_of] == [it.name for it in items]
    assert len(buckets) > 5, "a tensor larger than the budget is cut into units"


def test_plan_of_blocks_sends_each_rank_its_rows_and_columns():
    """FSDP x TP: a rank's block is some rows *and* some columns; each piece holds that rank's columns only."""
    items = [_tp_item("row_parallel", (37, 11)), _tp_item("small", (3, 5), torch.bfloat16)]
    buckets = plan_buckets(items, 4, 1024)
    full = {it.name: torch.arange(it.shape[0] * it.shape[1], dtype=torch.float32).view(it.shape).to(it.dtype) for it in items}
    src = Rank0Source(full)
    got = {(it.name, r): torch.zeros(it.boxes[r][1], dtype=it.dtype) for it in items for r in range(4)}
    for b in buckets:
        assert 4 * b.slot_bytes <= 1024
        for p in b.pieces:
            it, n = p.item, p.stop - p.start
            out = torch.empty(n, *it.boxes[p.rank][1][1:], dtype=it.dtype)
            src.read_rows(it.name, p.start, p.stop, out, it.cols(p.rank))
            a = it.ranges[p.rank][0]
            got[(it.name, p.rank)][p.start - a : p.stop - a] = out
    for it in items:
        for r in range(4):
            (o0, o1), (z0, z1) = it.boxes[r]
            assert torch.equal(got[(it.name, r)], full[it.name][o0 : o0 + z0, o1 : o1 + z1]), (it.name, r)
    assert _item("w", (4, 6), 2).cols(0) is None and items[0].cols(1) == (slice(6, 11),)


def test_prefetcher_keeps_at_most_max_alive_results():
    alive = {"now": 0, "max": 0}
    lock = threading.Lock()

    def produce(i):
        with lock:
            alive["now"] += 1
            alive["max"] = max(alive["max"], alive["now"])
        return i

    pf = BoundedPrefetcher(produce, list(range(20)), max_alive=3)
    out = []
    for x in pf:
        time.sleep(0.002)  # a slow consumer: the producer runs ahead as far as it may
        out.append(x)
        with lock:
            alive["now"] -= 1
        pf.release()
    pf.close()
    assert out == list(range(20))
    assert alive["max"] == 3


def test_prefetcher_hands_errors_to_the_consumer():
    def produce(i):
        if i == 2:
            raise ValueError("bad read")
        return i

    pf = BoundedPrefetcher(produce, [0, 1, 2, 3], max_alive=2)
    with pytest.raises(ValueError, match="bad read"):
        for _ in pf:
            pf.release()
    pf.close()


def test_prefetcher_runs_chores_on_its_thread_before_the_next_result_and_the_rest_at_close():
    log = []

    def produce(i):
        log.append(("produce", i, threading.current_thread().name))
        return i

    pf = BoundedPrefetcher(produce, [0, 1, 2], max_alive=1)
    for x in pf:
        pf.release(chore=lambda x=x: log.append(("chore", x, threading.current_thread().name)))
    pf.close()
    assert [e[:2] for e in log] == [("produce", 0), ("chore", 0), ("produce", 1), ("chore", 1), ("produce", 2),
                                    ("chore", 2)]
    # the chores of results 0 and 1 ran on the prefetch thread; the last one, with nothing left to produce, here
    assert [e[2] for e in log if e[0] == "chore"] == ["memsafe-prefetch", "memsafe-prefetch",
                                                      threading.current_thread().name]


def test_a_private_source_sent_as_it_is_is_freed_by_its_own_buckets_chore():
    # rank 0 sends a piece of a private tensor (fused experts transformers built in memory) as its own bytes: once the
    # bucket is sent, the chore must free it (and trim), not leave it to a later bucket's chore because the send list,
    # the finished op's handle or the chore itself still referenced the piece
    import numpy as np

    memory = np.ones((8, 4), dtype=np.float32)  # the tensor's storage: alive while any view of the tensor is
    gone = []
    weakref.finalize(memory, gone.append, "freed")
    src = Rank0Source({"experts": torch.from_numpy(memory)})
    del memory
    view = src.rows_view("experts", 0, 4, torch.float32, None)
    sends = [(1, view)]

    class Op:  # a finished gloo send keeps its tensor while its work object lives
        def __init__(self, t):
            self.t = t

    pending = Pending(0, "send of bucket 1/1", 0.0, Op(view))
    entry = (None, None, sends, pending)  # what the double buffer keeps until the finish returns
    del view
    chore = _after_send(src, _hand_over(sends, pending), ["experts"])
    assert entry[2] == [] and pending.work is None
    assert not gone, "kept until the chore ran"
    chore()
    assert gone == ["freed"], "the chore held the last reference: freed by this bucket's chore"


def test_finished_point_to_point_ops_let_go_of_their_tensors():
    class Work:
        def __init__(self, fail=False):
            self.fail = fail

        def wait(self):
            if self.fail:
                raise RuntimeError("peer gone")

    waiter = _Waiter()
    done = _Works([Work(), Work()], waiter)
    assert done.wait() and done.works == [], "a finished op's handles (and the tensors they hold) are dropped"
    failed = _Works([Work(fail=True), Work()], waiter)
    with pytest.raises(RuntimeError):
        failed.wait()
    assert len(failed.works) == 2, "an op left pending keeps its tensors (the transport may still write them)"
    waiter.close()


def test_rank0_source_casts_per_row_range_and_releases():
    src = Rank0Source({"w": torch.arange(12, dtype=torch.bfloat16).view(6, 2)})
    out = torch.empty(2, 2, dtype=torch.float32)
    src.read_rows("w", 2, 4, out)
    assert out.tolist() == [[4.0, 5.0], [6.0, 7.0]]
    src.release("w")
    assert "w" not in src.tensors and src.released_bytes == 0, "anonymous memory is never madvised"


def test_release_hands_back_mmap_pages_without_changing_values(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    w = model.model.embed_tokens.weight.detach()
    before = w.clone()
    src = Rank0Source({"w": w})
    src.release("w")
    assert src.released_bytes >= 4096, "a zero-copy view of the checkpoint: its pages are dropped from RSS"
    assert torch.equal(w, before), "clean file pages are re-read from the file when touched again"


@pytest.mark.parametrize("from_checkpoint", [True, False])
def test_rank0_source_reads_0d_tensors(tmp_path, from_checkpoint):
    # Apertus' xIELU activation has learned scalar parameters; reading one from the checkpoint into its
    # 0-d destination failed ("self.dim() cannot be 0 to view Float as Byte") and aborted prepare
    from safetensors.torch import save_file

    from accelerate_memsafe.io.safetensors_source import SafetensorsSource

    beta = torch.tensor(0.5)
    save_file({"beta": beta, "w": torch.ones(4)}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsSource(tmp_path / "model.safetensors") if from_checkpoint else None
    src = Rank0Source({"beta": beta.clone()}, ckpt, {"beta"} if from_checkpoint else None)
    out = torch.empty((), dtype=torch.float32)
    src.read_rows("beta", 0, 1, out)
    assert out.item() == 0.5
    src.close()


def _plan_quadratic(items, world, budget):
    """The plan as it was computed before issue 14 (O(world²) per unit): the reference for the O(world) one."""
    from accelerate_memsafe.distributed.plan import _align

    out, cur, used = [], [], [0] * world
    for item in items:
        ranges = item.ranges
        longest = max(b - a for a, b in ranges)
        per_rank = budget // world // 16 * 16
        rows = max(1, per_rank // max(1, max(item.row_bytes(r) for r in range(world))))
        k = 0
        while True:
            unit = [(r, min(a + k * rows, b), min(a + (k + 1) * rows, b)) for r, (a, b) in enumerate(ranges)]
            unit = [(r, s, e, _align((e - s) * item.row_bytes(r))) for r, s, e in unit if e > s]
            if any(used) and world * max(used[r] + (n if r == ur else 0) for r in range(world) for ur, _, _, n in unit) > budget:
                out.append((cur, max(used)))
                cur, used = [], [0] * world
            for r, s, e, n in unit:
                cur.append((item.name, r, s, e, used[r]))
                used[r] += n
            k += 1
            if k * rows >= longest:
                break
    out.append((cur, max(used)))
    return [b for b in out if b[0]]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_linear_plan_is_the_quadratic_plan(world):
    import random

    rng = random.Random(world)
    items = [_item(f"t{i}", (rng.randint(1, 300), rng.randint(1, 40)), world) for i in range(40)]
    budget = 8192
    got = [([(p.item.name, p.rank, p.start, p.stop, p.offset) for p in b.pieces], b.slot_bytes)
           for b in plan_buckets(items, world, budget) if b.pieces]
    assert got == _plan_quadratic(items, world, budget)


def test_a_fused_expert_row_larger_than_the_budget_is_cut_along_dim_1():
    # Qwen3-MoE-30B's fused gate_up_proj (128 experts x 1536 x 2048, fp32 master weights) at 8 ranks: one row
    # (an expert, 12 MiB) is 6x a rank's share of a 16 MiB bucket budget (64 MiB, 2 prefetched buckets)
    world, budget = 8, (64 << 20) // 4
    item = _item("experts.gate_up_proj", (128, 1536, 2048), world)
    buckets = plan_buckets([item], world, budget)
    assert all(world * b.slot_bytes <= budget for b in buckets), max(b.slot_bytes for b in buckets)
    covered = {r: torch.zeros(16, 1536, dtype=torch.int32) for r in range(world)}  # (row, dim-1 index) per rank
    for b in buckets:
        for p in b.pieces:
            a = item.ranges[p.rank][0]
            assert p.sub is not None and p.stop - p.start == 1
            assert p.block_shape() == (1, p.sub[1] - p.sub[0], 2048)
            assert p.offset + p.nbytes <= b.slot_bytes
            covered[p.rank][p.start - a, p.sub[0] : p.sub[1]] += 1
    assert all(bool((c == 1).all()) for c in covered.values()), "every row x column of every block exactly once"
    # rank 0 holds at most prefetch + 1 buckets of cast copies: within bucket_bytes, not 8 x 12 MiB per bucket
    assert 3 * max(world * b.slot_bytes for b in buckets) <= 64 << 20


def _llama_70b_shapes():
    h, inter, vocab, kv = 8192, 28672, 128256, 1024
    shapes = [("model.embed_tokens.weight", (vocab, h))]
    for layer in range(80):
        p = f"model.layers.{layer}."
        shapes += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter)), (p + "input_layernorm.weight", (h,)),
                   (p + "post_attention_layernorm.weight", (h,))]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def _block_bytes(item, rank):
    n = item.dtype.itemsize
    for z in item.boxes[rank][1]:
        n *= z
    return n


def test_planning_a_70b_model_for_512_ranks_takes_under_2_s_and_200_mb():
    # issue 14: planning is O(world) per unit in time and memory (it took ~2 min at 64 ranks before)
    import tracemalloc

    world, budget = 512, (64 << 20) // 4  # the default bucket_bytes and prefetch_buckets
    shapes = _llama_70b_shapes()
    items = [_item(n, s, world) for n, s in shapes]
    start = time.process_time()  # CPU time: a busy machine does not make it fail
    buckets = plan_buckets(items, world, budget)
    took = time.process_time() - start
    assert took <= 2.0, f"planning took {took:.2f} s of CPU"
    for i in items:
        i._geometry = None  # the per-tensor geometry is built by the plan: it counts as the plan's memory
    tracemalloc.start()
    try:
        again = plan_buckets(items, world, budget)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 200 << 20, f"planning held {peak / 2**20:.0f} MiB"
    assert len(again) == len(buckets) and all(world * b.slot_bytes <= budget for b in buckets)
    # the last rank's pieces, derived bucket by bucket, are exactly its block of every tensor
    got = {}
    for b in buckets:
        for p in b.pieces_of(world - 1):
            got[p.item.name] = got.get(p.item.name, 0) + p.nbytes
    assert all(got.get(i.name, 0) == _block_bytes(i, world - 1) for i in items)


def test_a_qwen3_moe_shaped_model_keeps_rank0_cast_copies_within_bucket_bytes_at_8_ranks():
    # Qwen3-MoE-30B-A3B's shapes (48 layers, 128 fused experts) with fp32 master weights, FSDP over 8 ranks:
    # rank 0 holds at most prefetch_buckets + 1 buckets of cast copies; they must fit `bucket_bytes`
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_hidden_layers=48))
    world, bucket_bytes, prefetch = 8, 64 << 20, 2
    budget = bucket_bytes // (prefetch + 2)
    items = [_item(n, tuple(p.shape), world) for n, p in model.named_parameters()]
    assert any(len(i.shape) == 3 and i.row_bytes(0) > budget // world for i in items), "fused experts larger than a share"
    buckets = plan_buckets(items, world, budget)
    assert (prefetch + 1) * max(world * b.slot_bytes for b in buckets) <= bucket_bytes
    sent = {}
    for b in buckets:
        for p in b.pieces:
            assert p.offset + p.nbytes <= b.slot_bytes
            sent[(p.item.name, p.rank)] = sent.get((p.item.name, p.rank), 0) + p.nbytes
    assert all(sent.get((i.name, r), 0) == _block_bytes(i, r) for i in items for r in range(world))
